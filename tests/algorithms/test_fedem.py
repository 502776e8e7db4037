"""FedEM: conformance, M = 1 is FedAvg, the EM round and the aggregation against plain PyTorch, new clients."""

from __future__ import annotations

import torch
from torch import nn

from lightning_fedmeta.algorithms.base import ClientOutput, client_records
from lightning_fedmeta.algorithms.fedem import FedEM
from lightning_fedmeta.client.functional import Batch, ClientContext
from tests.conftest import run_plain_rounds
from tests.helpers import one_client, tiny_data, tiny_module

COMMON = {"local_lr": 0.2, "local_steps": 3, "batch_size": 4}


def test_fedem_with_one_component_is_fedavg() -> None:
    """M = 1: every q is 1, the weighted loss is the batch mean, the server averages one model: the global
    model follows FedAvg's round for round (6 unequal clients, 2 per round, 1 held out)."""
    runs = {}
    for spec in ({"name": "fedavg", **COMMON}, {"name": "fedem", "num_components": 1, **COMMON}):
        module = tiny_module(spec, clients_per_round=2, holdout_clients=1, seed=3)
        module.attach_data(tiny_data())
        run_plain_rounds(module, 4)
        runs[spec["name"]] = module._global_params()
    for name, w in runs["fedavg"].items():
        torch.testing.assert_close(runs["fedem"][name], w, rtol=0, atol=1e-6)


def _components(seed: int = 0) -> tuple[nn.Linear, list[dict[str, torch.Tensor]]]:
    torch.manual_seed(seed)
    model = nn.Linear(5, 3)
    thetas = [{k: v.detach().clone() + m * torch.randn_like(v) for k, v in model.named_parameters()}
              for m in range(2)]
    return model, thetas


def _plain_em_round(thetas, pi, x, y, steps, lr):
    """The paper's client round with autograd: E-step, M-step, then τ steps on Σ_s q_s(m) ℓ_s / n per component."""
    losses = torch.stack([nn.functional.cross_entropy(x.reshape(-1, 5) @ t["weight"].T + t["bias"],
                                                      y.reshape(-1), reduction="none") for t in thetas])
    q = pi[:, None] * torch.exp(-losses)
    q = q / q.sum(0, keepdim=True)
    new_pi = q.mean(1)
    q = q.reshape(2, *y.shape)
    out = []
    for m, t in enumerate(thetas):
        w, b = t["weight"].clone(), t["bias"].clone()
        for s in range(steps):
            w.requires_grad_(True)
            b.requires_grad_(True)
            per = nn.functional.cross_entropy(x[s] @ w.T + b, y[s], reduction="none")
            gw, gb = torch.autograd.grad((q[m, s] * per).sum() / y.shape[1], (w, b))
            w, b = (w - lr * gw).detach(), (b - lr * gb).detach()
        out.append({"weight": w, "bias": b})
    return new_pi, out


def _client_batches(client: int, steps: int, size: int) -> Batch:
    x, y = tiny_data().client_train(client)
    g = torch.Generator().manual_seed(client)
    idx = torch.stack([torch.randperm(x.shape[0], generator=g)[:size] for _ in range(steps)])
    return Batch(x[idx][:, None], y[idx][:, None], torch.ones(steps, 1, size))


def test_fedem_client_round_and_aggregation_equal_plain_pytorch() -> None:
    """M = 2, two clients of unequal sizes (5 and 14 samples), unequal mixtures and weights: each client's new π
    and trained components equal the plain-PyTorch EM round, and the server's components are their p-weighted
    means (component 1 through the global parameters' Δ)."""
    model, thetas = _components()
    alg = FedEM(num_components=2, local_steps=3, local_lr=0.3, batch_size=4)
    params = thetas[0]
    server_state = {"components": {k: v.unsqueeze(0) for k, v in thetas[1].items()}}
    ctx = ClientContext(model)
    outputs, expected = [], []
    for client, pi in ((0, torch.tensor([0.7, 0.3])), (3, torch.tensor([0.2, 0.8]))):
        batches = _client_batches(client, 3, 4)
        record = one_client([5, 14][client // 3], index=client, seen=True)
        outputs.append(alg.client_update(ctx, params, batches, {"mixture": pi}, server_state, record))
        expected.append(_plain_em_round(thetas, pi, batches.x[:, 0], batches.y[:, 0], 3, 0.3))
    for out, (pi, trained) in zip(outputs, expected, strict=True):
        torch.testing.assert_close(out.state["mixture"], pi, rtol=0, atol=1e-6)
        for k in params:
            torch.testing.assert_close(out.delta[k], trained[0][k] - params[k], rtol=0, atol=1e-5)
            torch.testing.assert_close(out.extras["components"][k][0], trained[1][k], rtol=0, atol=1e-5)
    stacked = ClientOutput(*(
        {k: torch.stack([getattr(o, f)[k] for o in outputs]) for k in getattr(outputs[0], f)}
        if f != "extras" else {"components": {k: torch.stack([o.extras["components"][k] for o in outputs])
                                              for k in params}}
        for f in ClientOutput._fields
    ))
    p = torch.tensor([5.0, 14.0]) / 19.0
    delta, new_state = alg.aggregate(params, stacked, p, server_state, client_records([5, 14], index=[0, 3]))
    for k in params:
        mean0 = p[0] * expected[0][1][0][k] + p[1] * expected[1][1][0][k]
        mean1 = p[0] * expected[0][1][1][k] + p[1] * expected[1][1][1][k]
        torch.testing.assert_close(params[k] + delta[k], mean0, rtol=0, atol=1e-5)
        torch.testing.assert_close(new_state["components"][k][0], mean1, rtol=0, atol=1e-5)


def test_fedem_new_client_estimates_its_mixture_and_takes_the_likeliest_component() -> None:
    """A held-out client: π by EM from uniform on its adaptation batch, components fixed; it is evaluated with
    θ_argmax π. Component 1 is made to fit client 2's data (a few SGD steps on it), component 0 not."""
    model, thetas = _components()
    x, y = tiny_data().client_train(2)
    ctx = ClientContext(model)
    batch = Batch(x[None, None], y[None, None], torch.ones(1, 1, x.shape[0]))
    for _ in range(30):
        thetas[1], _ = ctx.sgd_step(thetas[1], batch.at(0, 0), 0.5)
    alg = FedEM(num_components=2, em_steps=5, batch_size=4, finetune_batch_size=None)
    server_state = {"components": {k: v.unsqueeze(0) for k, v in thetas[1].items()}}
    record = one_client(x.shape[0], index=2, is_new=True)
    chosen = alg.personalize(ctx, thetas[0], batch, {"mixture": torch.tensor([0.5, 0.5])}, server_state, record)
    losses = torch.stack([nn.functional.cross_entropy(x @ t["weight"].T + t["bias"], y, reduction="none")
                          for t in thetas])
    pi = torch.tensor([0.5, 0.5])
    for _ in range(5):
        q = pi[:, None] * torch.exp(-losses)
        pi = (q / q.sum(0, keepdim=True)).mean(1)
    assert int(pi.argmax()) == 1 and pi[1] > 0.6
    for k in chosen:
        assert torch.equal(chosen[k], thetas[1][k])
    # a training client keeps its stored mixture (here favouring component 0)
    seen = one_client(x.shape[0], index=2, seen=True)
    kept = alg.personalize(ctx, thetas[0], batch, {"mixture": torch.tensor([0.9, 0.1])}, server_state, seen)
    for k in kept:
        assert torch.equal(kept[k], thetas[0][k])
