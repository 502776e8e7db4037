"""FedBABU: body trained with the head frozen at its initialisation; whole-model fine-tuning (issue 27)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.fedbabu import FedBABU
from tests.conftest import run_plain_rounds
from tests.helpers import tiny_data

HEAD = ("2.weight", "2.bias")


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def _sgd(net: nn.Module, start: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, lr: float, steps: int,
         trained: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """``steps`` full-batch SGD steps of an ``nn.Module`` on the parameters ``trained`` only (autograd)."""
    net.load_state_dict(start)
    params = {k: p for k, p in net.named_parameters() if k in trained}
    for _ in range(steps):
        grads = torch.autograd.grad(F.cross_entropy(net(x), y), list(params.values()))
        with torch.no_grad():
            for p, g in zip(params.values(), grads, strict=True):
                p -= lr * g
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def test_fedbabu_matches_plain_pytorch_body_training_and_whole_model_fine_tuning() -> None:
    """4 rounds of 3 of 5 unequal training clients (one held out), full batches: the body is SGD-trained with the
    head fixed and averaged with the round's weights p_i, the head never moves from its initialisation; every
    client, the held-out one included, is evaluated after fine-tuning the whole model from the global one."""
    lr, steps, ft_lr, ft_steps = 0.4, 2, 0.3, 3
    algorithm = {"name": "fedbabu", "local_lr": lr, "local_steps": steps, "batch_size": None,
                 "finetune_steps": ft_steps, "finetune_lr": ft_lr, "finetune_batch_size": None}
    module = FederatedModule(model=_net(), algorithm=algorithm, clients_per_round=3, seed=5, holdout_clients=1)
    data = tiny_data()
    module.attach_data(data)
    net = _net()
    w = {k: v.detach().clone() for k, v in net.state_dict().items()}
    init_head = {k: w[k].clone() for k in HEAD}
    weight = module.client_weight.double()
    for sampled in run_plain_rounds(module, 4):
        p = weight[sampled] / weight[sampled].sum()
        trained = [_sgd(net, w, *data.client_train(c), lr, steps, ("0.weight", "0.bias")) for c in sampled.tolist()]
        w = {k: v + sum(float(p[i]) * (t[k] - v) for i, t in enumerate(trained)) for k, v in w.items()}
    got = module._global_params()
    for k, v in w.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=2e-6)
    for k in HEAD:
        assert torch.equal(got[k], init_head[k]), "the head must stay at its initialisation"
    assert not torch.equal(got["0.weight"], _net().state_dict()["0.weight"]), "the body was not trained"
    for c in (int(module.holdout[0]), int(module.seen.nonzero()[0, 0])):
        expected = _sgd(net, w, *data.client_train(c), ft_lr, ft_steps, tuple(w))
        for k, v in module.personalize(c).state_dict().items():
            torch.testing.assert_close(v, expected[k], rtol=0, atol=2e-6)


def test_finetune_steps_defaults_to_ten_and_zero_evaluates_the_global_model() -> None:
    assert FedBABU().finetune_steps == 10
    assert FedBABU(finetune_steps=0).finetune_steps == 0
    module = FederatedModule(model=_net(), algorithm={"name": "fedbabu", "finetune_steps": 0}, clients_per_round=3)
    module.attach_data(tiny_data())
    run_plain_rounds(module, 1)
    for k, v in module.personalize(0).state_dict().items():
        torch.testing.assert_close(v, module.model.state_dict()[k], rtol=0, atol=0)


def test_bad_head_prefix_is_refused() -> None:
    with pytest.raises(ValueError, match="head_prefix must be"):
        FedBABU(head_prefix=[0])  # type: ignore[list-item]
    params = dict(_net().named_parameters())
    assert FedBABU().head(params) == set(HEAD)
    with pytest.raises(ValueError, match="matches no parameter"):
        FedBABU(head_prefix="linear").head(params)
