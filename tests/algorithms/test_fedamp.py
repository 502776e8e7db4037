"""FedAMP: conformance, the client step against a plain-PyTorch computation of the paper's rule, λ = 0."""

from __future__ import annotations

import math

import torch
from torch import nn

from lightning_fedmeta.algorithms.base import ClientRecord, client_records
from lightning_fedmeta.algorithms.fedamp import FedAMP
from lightning_fedmeta.algorithms.local_steps import local_sgd
from lightning_fedmeta.client.functional import Batch, ClientContext
from lightning_fedmeta.persistence.memory_store import map_state
from tests.helpers import tiny_data

SIZES = [5, 8, 11, 14]


def _setup(alg: FedAMP, client: int, seen: list[bool]):
    """A linear model, 4 clients of unequal sizes with distinct stored models, client ``client``'s inputs."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    records = client_records(SIZES, weight=[0.2, 0.3, 0.0, 0.5], is_new=[False, False, True, False], seen=seen)
    alg.bind_clients(records, torch.ones(4, 3, dtype=torch.long))
    server_state = alg.init_server_state(params)
    models = {k: v + 0.3 * torch.randn(4, *v.shape) for k, v in params.items()}
    server_state["models"] = dict(models)
    server_state["seen"] = torch.tensor(seen, dtype=torch.float32)
    state = map_state(lambda v: v[client], alg.init_client_states(params, records))
    state["personal"] = {k: models[k][client] for k in params}
    x, y = tiny_data().client_train(client)
    n = SIZES[client] // 2 * 2
    batches = Batch(x[:n].reshape(2, 1, n // 2, 5), y[:n].reshape(2, 1, n // 2), torch.ones(2, 1, n // 2))
    record = ClientRecord(*(t[client] for t in records))
    return ClientContext(model), params, models, state, server_state, batches, record


def _plain_fedamp(models, k, usable, batches, lam, alpha, sigma, lr):
    """The paper's rule written out with autograd on a flat vector: u_k, then τ proximal SGD steps."""
    flat = torch.stack([torch.cat([models["weight"][j].reshape(-1), models["bias"][j]]) for j in range(4)])
    xi = torch.zeros(4)
    for j in usable:
        xi[j] = alpha * math.exp(-float(((flat[k] - flat[j]) ** 2).sum()) / sigma) / sigma
    u = (1 - xi.sum()) * flat[k] + (xi[:, None] * flat).sum(0)
    w = flat[k].clone()
    for t in range(batches.x.shape[0]):
        w = w.detach().requires_grad_(True)
        logits = batches.x[t, 0] @ w[:15].reshape(3, 5).T + w[15:]
        loss = nn.functional.cross_entropy(logits, batches.y[t, 0]) + lam / (2 * alpha) * ((w - u) ** 2).sum()
        (g,) = torch.autograd.grad(loss, w)
        w = w - lr * g
    return w.detach()


def test_fedamp_client_step_equals_plain_pytorch_rule() -> None:
    """Client 3 (weight 0.5): neighbours are clients 0 and 1 (seen, training); client 2 is held out (weight 0)
    and must send no message. Unequal sizes and weights; σ, α chosen so that ξ is far from 0 and from 1."""
    lam, alpha, sigma, lr = 0.8, 0.4, 2.0, 0.1
    alg = FedAMP(lam=lam, alpha_k=alpha, sigma=sigma, local_steps=2, local_lr=lr)
    ctx, params, models, state, server_state, batches, record = _setup(alg, 3, [True, True, True, True])
    out = alg.client_update(ctx, params, batches, state, server_state, record)
    expected = _plain_fedamp(models, 3, [0, 1], batches, lam, alpha, sigma, lr)
    got = torch.cat([out.state["personal"]["weight"].reshape(-1), out.state["personal"]["bias"]])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    start = torch.cat([models["weight"][3].reshape(-1), models["bias"][3]])
    torch.testing.assert_close(torch.cat([out.delta["weight"].reshape(-1), out.delta["bias"]]), expected - start,
                               rtol=0, atol=1e-5)


def test_fedamp_unseen_neighbour_sends_no_message() -> None:
    """Client 0 with client 1 not yet trained: only client 3 is a neighbour."""
    lam, alpha, sigma, lr = 0.5, 0.3, 1.5, 0.05
    alg = FedAMP(lam=lam, alpha_k=alpha, sigma=sigma, local_steps=2, local_lr=lr)
    ctx, params, models, state, server_state, batches, record = _setup(alg, 0, [True, False, False, True])
    out = alg.client_update(ctx, params, batches, state, server_state, record)
    expected = _plain_fedamp(models, 0, [3], batches, lam, alpha, sigma, lr)
    got = torch.cat([out.state["personal"]["weight"].reshape(-1), out.state["personal"]["bias"]])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_fedamp_lambda_zero_is_local_sgd_from_the_personal_model() -> None:
    """λ = 0: the attention term vanishes, the client takes plain SGD steps from its own stored model."""
    alg = FedAMP(lam=0.0, alpha_k=0.5, sigma=1.0, local_steps=2, local_lr=0.1)
    ctx, params, models, state, server_state, batches, record = _setup(alg, 1, [True, True, True, True])
    out = alg.client_update(ctx, params, batches, state, server_state, record)
    expected, _ = local_sgd(ctx, {k: models[k][1] for k in params}, batches, 0.1)
    for k in params:
        torch.testing.assert_close(out.state["personal"][k], expected[k], rtol=0, atol=1e-6)
