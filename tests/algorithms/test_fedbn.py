"""FedBN: normalisation layers stay on the client; FedAvg on a model without them (issue 27)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.fedbn import FedBN, normalisation_parameters
from lightning_fedmeta.client.functional import Batch, ClientContext
from lightning_fedmeta.models.reference import SmallCNN
from tests.conftest import run_plain_rounds
from tests.helpers import one_client, tanh_mlp, tiny_data

NORM = ("1.weight", "1.bias")


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))


def _module(algorithm: dict, model: nn.Module, **kwargs: object) -> FederatedModule:
    module = FederatedModule(model=model, algorithm=algorithm, clients_per_round=3, seed=5, **kwargs)
    module.attach_data(tiny_data())
    return module


def test_fedbn_is_fedavg_on_a_model_without_normalisation_layers() -> None:
    """Unequal clients, 3 of 6 a round: no normalisation parameter, so no state and FedAvg's rounds exactly."""
    common = {"local_lr": 0.3, "local_steps": 3, "batch_size": 4}
    fedbn, fedavg = (_module({"name": n, **common}, tanh_mlp()) for n in ("fedbn", "fedavg"))
    assert fedbn.client_states.tensors == {}
    for module in (fedbn, fedavg):
        run_plain_rounds(module, 3)
    for k, v in fedavg.model.state_dict().items():
        torch.testing.assert_close(fedbn.model.state_dict()[k], v, rtol=0, atol=0)


def _plain_round(net: nn.Module, start: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, lr: float,
                 steps: int) -> dict[str, torch.Tensor]:
    """``steps`` full-batch SGD steps of an ``nn.Module`` in train mode (autograd, no torch.func)."""
    net.load_state_dict(start, strict=False)
    net.train()
    params = dict(net.named_parameters())
    for _ in range(steps):
        loss = F.cross_entropy(net(x), y)
        grads = torch.autograd.grad(loss, list(params.values()))
        with torch.no_grad():
            for p, g in zip(params.values(), grads, strict=True):
                p -= lr * g
    return {k: v.detach().clone() for k, v in params.items()}


def test_fedbn_rounds_match_plain_pytorch_with_local_normalisation_parameters() -> None:
    """The rule: each sampled client trains (θ, its own γ, β) jointly; θ is averaged with the round's weights
    p_i, γ and β stay with the client. Checked against autograd on an nn.Module, 4 rounds of 3 of 5 training
    clients (one held out), full batches of unequal sizes."""
    lr, steps = 0.4, 2
    module = _module({"name": "fedbn", "local_lr": lr, "local_steps": steps, "batch_size": None}, _bn_net(),
                     holdout_clients=1)
    data = tiny_data()
    net = _bn_net()
    shared = {k: v.detach().clone() for k, v in net.named_parameters()}
    personal: dict[int, dict[str, torch.Tensor]] = {}
    rounds = run_plain_rounds(module, 4)
    weight = module.client_weight.double()
    for sampled in rounds:
        clients = sampled.tolist()
        p = weight[sampled] / weight[sampled].sum()
        trained = {c: _plain_round(net, {**shared, **personal.get(c, {})}, *data.client_train(c), lr, steps)
                   for c in clients}
        shared = {k: v if k in NORM else v + sum(float(p[i]) * (trained[c][k] - v) for i, c in enumerate(clients))
                  for k, v in shared.items()}  # the normalisation parameters are not sent: the global ones stay π⁰
        personal.update({c: {k: trained[c][k] for k in NORM} for c in clients})
    assert any(sum(c in r.tolist() for r in rounds) > 1 for c in range(6)), "the test needs a client sampled twice"
    got = module._global_params()
    for k in ("0.weight", "0.bias", "3.weight", "3.bias"):
        torch.testing.assert_close(got[k], shared[k], rtol=0, atol=2e-6)
    for c, own in personal.items():
        for k in NORM:
            torch.testing.assert_close(module.client_states.tensors["personal"][k][c], own[k], rtol=0, atol=2e-6)
    gammas = module.client_states.tensors["personal"]["1.weight"][list(personal)]
    assert (gammas - gammas[0]).abs().amax(1)[1:].min() > 1e-4, "the clients' γ should differ"


def test_trained_clients_are_evaluated_with_their_own_norm_and_a_held_out_one_with_the_mean() -> None:
    module = _module({"name": "fedbn", "local_lr": 0.4, "local_steps": 2, "batch_size": 4}, _bn_net(),
                     holdout_clients=1)
    run_plain_rounds(module, 3)
    params = module._global_params()
    states = module.client_states.tensors["personal"]
    trained = int(module.seen.nonzero()[0, 0])
    held_out = int(module.holdout[0])
    own = module.personalize(trained).state_dict()
    new = module.personalize(held_out).state_dict()
    for k in NORM:
        torch.testing.assert_close(own[k], states[k][trained], rtol=0, atol=0)
        torch.testing.assert_close(new[k], params[k], rtol=0, atol=0)
        assert not torch.equal(states[k][trained], params[k])
    for k in ("0.weight", "3.weight"):
        torch.testing.assert_close(own[k], params[k], rtol=0, atol=0)
        torch.testing.assert_close(new[k], params[k], rtol=0, atol=0)


def test_normalisation_parameters_are_found_by_module_type() -> None:
    cnn = SmallCNN(norm="batch")
    params = dict(cnn.named_parameters())
    expected = ["features.1.weight", "features.1.bias", "features.5.weight", "features.5.bias"]
    assert normalisation_parameters(cnn) == expected
    assert FedBN().personal_names(params) == expected
    assert FedBN(norm_prefix="features.1").personal_names(params) == expected[:2]
    with pytest.raises(ValueError, match="matches no parameter"):
        FedBN(norm_prefix="bn").personal_names(params)
    with pytest.raises(ValueError, match="norm_prefix must be"):
        FedBN(norm_prefix=[1])  # type: ignore[list-item]


def test_a_one_dimensional_layer_that_is_not_a_normalisation_layer_is_refused() -> None:
    net = nn.Sequential(nn.Linear(5, 4), nn.PReLU(4), nn.Linear(4, 3))
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = torch.randn(1, 1, 4, 5)
    batches = Batch(x, torch.zeros(1, 1, 4, dtype=torch.long), torch.ones(1, 1, 4))
    alg = FedBN(local_steps=1)
    with pytest.raises(ValueError, match=r"would keep \['1.weight'\] local; pass norm_prefix"):
        alg.client_update(ClientContext(net), params, batches, alg.init_client_state(params), {}, one_client())
    FedBN(norm_prefix="1", local_steps=1).client_update(
        ClientContext(net), params, batches, alg.init_client_state(params), {}, one_client())
