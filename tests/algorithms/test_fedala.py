"""FedALA: the conformance kit, the weight learning and local training against plain PyTorch autograd on unequal
clients (start phase and after), η_W = 0 is FedAvg, and a run with held-out clients and partial participation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from lightning_fedmeta.algorithms.fedala import FedALA
from lightning_fedmeta.algorithms.fedavg import FedAvg
from lightning_fedmeta.client.functional import Batch, ClientContext
from lightning_fedmeta.testing import client_record
from tests.conftest import run_plain_rounds
from tests.helpers import tanh_mlp, tiny_data, tiny_module

LR, ETA = 0.3, 2.0


def _client_batches(client: int, steps: int, batch: int = 4) -> Batch:
    x, y = tiny_data().client_train(client)
    idx = (torch.arange(steps * batch) * 3 + client).remainder(x.shape[0]).view(steps, 1, batch)
    return Batch(x[idx], y[idx], torch.ones(steps, 1, batch))


def _params(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tanh_mlp(seed=seed).named_parameters()}


def _reference(theta: dict, local: dict, weights: dict, batches: Batch, w_steps: int, local_steps: int) -> tuple:
    """The authors' ALA (PFLlib utils/ALA.py) and local training in plain PyTorch: W by autograd through
    θ_k + (θ − θ_k) ⊙ W on the higher tensors (the lower ones take θ), clipped to [0, 1]; then SGD."""
    model = tanh_mlp()
    weights = {k: v.clone() for k, v in weights.items()}
    for t in range(w_steps):
        wt = {k: v.clone().requires_grad_() for k, v in weights.items()}
        start = {**theta, **{k: local[k] + (theta[k] - local[k]) * wt[k] for k in wt}}
        loss = F.cross_entropy(functional_call(model, start, (batches.x[t, 0],)), batches.y[t, 0])
        grads = torch.autograd.grad(loss, list(wt.values()))
        weights = {k: (weights[k] - ETA * g).clamp(0, 1) for k, g in zip(wt, grads, strict=True)}
    trained = {**theta, **{k: local[k] + (theta[k] - local[k]) * weights[k] for k in weights}}
    for t in range(w_steps, w_steps + local_steps):
        pt = {k: v.clone().requires_grad_() for k, v in trained.items()}
        loss = F.cross_entropy(functional_call(model, pt, (batches.x[t, 0],)), batches.y[t, 0])
        grads = torch.autograd.grad(loss, list(pt.values()))
        trained = {k: trained[k] - LR * g for k, g in zip(pt, grads, strict=True)}
    return trained, weights


@pytest.mark.parametrize(("client", "started"), [(0, 0.0), (3, 0.0), (3, 1.0)])
def test_fedala_round_equals_plain_pytorch_on_unequal_clients(client: int, started: float) -> None:
    """A seen client: W steps (4 in the start phase, 2 after it), then 3 SGD steps, equal the plain-PyTorch
    reference: the upload, the stored θ_k and W_k (which moved, and stays in [0, 1])."""
    alg = FedALA(eta=ETA, ala_layers=2, ala_steps=2, ala_start_steps=4, local_steps=3, local_lr=LR)
    theta, local = _params(1), _params(2)
    weights = {k: torch.full_like(theta[k], 0.7) for k in alg.higher(theta)}
    batches = _client_batches(client, steps=7)
    state = {"local": local, "weights": weights, "started": torch.tensor(started)}
    record = client_record(int(tiny_data().train_counts[client]), index=client, seen=True)
    out = alg.client_update(ClientContext(tanh_mlp()), theta, batches, state, {}, record)
    # the steps the plan holds beyond ala_steps are skipped once the start phase is done
    want_local, want_w = _reference(theta, local, weights, _steps_used(batches, 4, 2 if started else 4), 2 if started
                                    else 4, 3)
    for k in theta:
        torch.testing.assert_close(out.delta[k], want_local[k] - theta[k], rtol=0, atol=1e-6)
        torch.testing.assert_close(out.state["local"][k], want_local[k], rtol=0, atol=1e-6)
    for k in want_w:
        torch.testing.assert_close(out.state["weights"][k], want_w[k], rtol=0, atol=1e-6)
    moved = max(float((out.state["weights"][k] - 0.7).abs().max()) for k in want_w)
    assert moved > 1e-3 and all(0 <= float(v.min()) and float(v.max()) <= 1 for v in out.state["weights"].values())
    assert float(out.state["started"]) == 1.0


def _steps_used(batches: Batch, room: int, used: int) -> Batch:
    """The plan's batches with the W steps not taken (``used .. room − 1``) removed."""
    keep = [*range(used), *range(room, batches.x.shape[0])]
    return Batch(batches.x[keep], batches.y[keep], batches.mask[keep])


def test_fedala_without_weight_learning_is_fedavg_on_its_training_batches() -> None:
    """η_W = 0: W_k stays 1, the local start is the global model, and the upload is FedAvg's client update on the
    local-training batches, whatever the client's local model."""
    alg = FedALA(eta=0.0, ala_steps=1, ala_start_steps=2, local_steps=3, local_lr=LR)
    ctx, theta = ClientContext(tanh_mlp()), _params(1)
    for client in (1, 3):
        batches = _client_batches(client, steps=5)
        record = client_record(int(tiny_data().train_counts[client]), index=client, seen=True)
        state = alg.init_client_state(_params(2))
        out = alg.client_update(ctx, theta, batches, state, {}, record)
        tail = Batch(batches.x[2:], batches.y[2:], batches.mask[2:])
        want = FedAvg(local_lr=LR).client_update(ctx, theta, tail, {}, {}, record).delta
        for k in theta:  # θ_k + (θ − θ_k)·1 is θ up to rounding
            torch.testing.assert_close(out.delta[k], want[k], rtol=0, atol=1e-6)


def test_fedala_held_out_clients_and_partial_participation() -> None:
    """6 clients, 2 held out, 2 sampled a round: held-out and never-sampled clients are evaluated with the global
    model; a client sampled twice has finished its start phase and learned W_k ≠ 1."""
    module = tiny_module({"name": "fedala", "local_lr": 0.2, "local_steps": 2, "batch_size": 4, "ala_steps": 1,
                          "ala_start_steps": 3, "eta": 5.0},
                         model=lambda: tanh_mlp(seed=0), clients_per_round=2, holdout_clients=2, seed=3)
    module.attach_data(tiny_data())
    sampled = torch.cat(run_plain_rounds(module, 4)).tolist()
    glob = module._global_params()
    states = module.client_states.tensors
    never = [i for i in range(6) if i not in sampled]
    assert all(bool(module.is_holdout[i]) for i in module.is_holdout.nonzero().flatten().tolist())
    assert len(never) >= 2
    for i in never:
        got = dict(module.personalize(i).named_parameters())
        assert all(torch.equal(got[k], glob[k]) for k in glob), i
    twice = [i for i in set(sampled) if sampled.count(i) >= 2]
    assert twice, "some client was sampled twice"
    for i in twice:
        assert float(states["started"][i]) == 1.0
        assert float((states["weights"]["2.weight"][i] - 1).abs().max()) > 0
