"""FedFomo against a plain-PyTorch re-implementation of PFLlib's clientfomo/serverfomo (top-M models by affinity,
first-order weights, P updated with the raw weights), with unequal clients, partial participation and a new
client."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.fedfomo import FedFomo, first_order_combination
from lightning_fedmeta.client.functional import Batch, ClientContext
from lightning_fedmeta.client.sampling import sample_clients
from lightning_fedmeta.loop.gather import new_client_batches
from tests.conftest import run_plain_rounds
from tests.helpers import tanh_mlp, tiny_data

ALG = {"name": "fedfomo", "models_per_client": 3, "local_lr": 0.3, "local_steps": 2, "batch_size": 4,
       "finetune_steps": 1, "finetune_lr": 0.1, "finetune_batch_size": 4}


def _real(x: Tensor, y: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
    return x[0][m[0] > 0], y[0][m[0] > 0]


def _val_loss(net: nn.Module, val: tuple[Tensor, Tensor]) -> Tensor:
    with torch.no_grad():
        return F.cross_entropy(net(val[0]), val[1])


def _combine(own: nn.Module, received: list[nn.Module], val: tuple[Tensor, Tensor]) -> list[float]:
    """PFLlib's weight_cal + weight_scale + aggregate_parameters (in place on ``own``); returns the raw weights."""
    base = _val_loss(own, val)
    raw = []
    for other in received:
        pairs = zip(other.parameters(), own.parameters(), strict=True)
        diff = torch.cat([(p - q).detach().reshape(-1) for p, q in pairs])
        raw.append(float((base - _val_loss(other, val)) / (torch.norm(diff) + 1e-5)))
    pos = torch.clamp(torch.tensor(raw, dtype=torch.float64), min=0)
    if pos.sum() > 0:
        with torch.no_grad():
            for name, p in own.named_parameters():
                terms = zip(pos, received, strict=True)
                p.copy_(sum(float(c / pos.sum()) * dict(o.named_parameters())[name] for c, o in terms))
    return raw


def _sgd(net: nn.Module, batches: list[tuple[Tensor, Tensor]], lr: float) -> None:
    for x, y in batches:
        net.zero_grad()
        F.cross_entropy(net(x), y).backward()
        with torch.no_grad():
            for p in net.parameters():
                p -= lr * p.grad


def test_fedfomo_matches_plain_pytorch_with_partial_participation_and_a_new_client() -> None:
    """Unequal clients, 3 of 5 eligible clients a round, one held out, M = 3 of 6 stored models: after four rounds
    every client's model, the server's copies and P equal the reference, and some client did take a peer's model
    (P has a positive off-diagonal entry). A new client combines all stored models on its first batch, then
    fine-tunes. Changing the rule (no distance normalisation, P updated with clipped weights, no top-M) fails."""
    module = FederatedModule(model=tanh_mlp(), algorithm=dict(ALG), clients_per_round=3, holdout_clients=1, seed=5)
    module.attach_data(tiny_data())
    init = copy.deepcopy(module.model)
    k = 6
    stored = [copy.deepcopy(init) for _ in range(k)]
    nets = {c: copy.deepcopy(init) for c in range(k)}
    affinity = torch.eye(k, dtype=torch.float64)
    for r in range(4):
        sampled = sample_clients(module.seed, r, module.eligible, module.num_sampled)
        b = module._batches("train", r, sampled, module.algorithm.round_plan())
        sent = [copy.deepcopy(s) for s in stored]
        for i, c in enumerate(sampled.tolist()):
            batches = [_real(b.x[i, t], b.y[i, t], b.mask[i, t]) for t in range(b.x.shape[1])]
            top = sorted(range(k), key=lambda n, c=c: (-float(affinity[c, n]), n))[:ALG["models_per_client"]]
            raw = _combine(nets[c], [sent[n] for n in top], batches[0])
            _sgd(nets[c], batches[1:], ALG["local_lr"])
            stored[c] = copy.deepcopy(nets[c])
            for n, w in zip(top, raw, strict=True):
                affinity[c, n] += w
        assert torch.equal(run_plain_rounds(module, 1, first=r)[0], sampled)
    off_diagonal = affinity - torch.diag(torch.diag(affinity))
    assert off_diagonal.max() > 0, "some client took a peer's model"
    personal, server = module.client_states.tensors["personal"], module.server_state
    torch.testing.assert_close(server["affinity"], affinity.to(server["affinity"].dtype), rtol=0, atol=1e-4)
    for c in range(k):
        for name, p in stored[c].named_parameters():
            torch.testing.assert_close(server["models"][name][c], p.detach(), rtol=0, atol=1e-5)
            if module.seen[c]:
                torch.testing.assert_close(personal[name][c], p.detach(), rtol=0, atol=1e-5)
    x, y = torch.randn(9, 5), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2])
    got = dict(module.personalize((x, y), round_idx=4).named_parameters())
    eb, _ = new_client_batches(module.seed, (x, y), 4, module.algorithm.eval_plan(), torch.device("cpu"))
    new = copy.deepcopy(init)
    raw = _combine(new, stored, _real(eb.x[0], eb.y[0], eb.mask[0]))
    assert max(raw) > 0, "the new client took some stored model"
    _sgd(new, [_real(eb.x[1], eb.y[1], eb.mask[1])], ALG["finetune_lr"])
    for name, p in new.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=1e-5)


def test_fedfomo_combination_is_hand_computable_on_a_linear_model() -> None:
    """Two candidates on a bias-free linear model, one better (L lower) and one worse than the client's own: the
    client moves all the way to the better one (its normalised weight is 1) and the raw weights are
    (L_own − L_n) / (‖θ_n − θ_own‖ + 1e-5)."""
    net = nn.Linear(2, 2, bias=False)
    ctx = ClientContext(net)
    own = {"weight": torch.zeros(2, 2)}
    better = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    worse = -better
    val = Batch(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1]), torch.ones(2))
    combined, w = first_order_combination(ctx, own, {"weight": torch.stack([better, worse])}, val)
    l_own = torch.log(torch.tensor(2.0))
    l_better = F.cross_entropy(better, torch.tensor([0, 1]))
    l_worse = F.cross_entropy(worse, torch.tensor([0, 1]))
    expected = torch.stack([(l_own - l_better), (l_own - l_worse)]) / (2.0 ** 0.5 + 1e-5)
    torch.testing.assert_close(w, expected)
    torch.testing.assert_close(combined["weight"], better)


def test_fedfomo_refuses_bad_models_per_client() -> None:
    with pytest.raises(ValueError, match="models_per_client must be an integer >= 1"):
        FedFomo(models_per_client=0)
