"""pFedHN: conformance, an identity hypernetwork on a fixed embedding is FedAvg, the server step vs plain PyTorch."""

from __future__ import annotations

import torch
from torch import nn

from lightning_fedmeta.algorithms.base import ClientOutput, client_records
from lightning_fedmeta.algorithms.pfedhn import PFedHN
from tests.conftest import run_plain_rounds
from tests.helpers import tiny_data, tiny_module

COMMON = {"local_lr": 0.2, "local_steps": 3, "batch_size": 4}


def test_pfedhn_identity_hypernetwork_on_a_fixed_embedding_is_fedavg() -> None:
    """No MLP (θ_i = A v_i + b), embeddings fixed at 0, plain server step of rate 1: θ_i = b for every client
    and b ← b + Σ p_i Δθ_i, FedAvg's rule; the global model follows FedAvg's round for round (6 unequal
    clients, 2 per round, 1 held out)."""
    identity = {"mlp_layers": 0, "embed_dim": 2, "embed_init_std": 0.0, "embed_lr": 0.0, "server_lr": 1.0,
                "momentum": 0.0, "weight_decay": 0.0, "clip_norm": 0.0}
    runs = {}
    for spec in ({"name": "fedavg", **COMMON}, {"name": "pfedhn", **identity, **COMMON}):
        module = tiny_module(spec, clients_per_round=2, holdout_clients=1, seed=3)
        module.attach_data(tiny_data())
        run_plain_rounds(module, 4)
        runs[spec["name"]] = module._global_params()
    for name, w in runs["fedavg"].items():
        torch.testing.assert_close(runs["pfedhn"][name], w, rtol=0, atol=1e-6)


def _plain_generate(h: dict[str, torch.Tensor], v: torch.Tensor) -> dict[str, torch.Tensor]:
    f = h["mlp.0.weight"] @ v + h["mlp.0.bias"]
    f = h["mlp.1.weight"] @ torch.relu(f) + h["mlp.1.bias"]
    return {"weight": (h["head.weight.weight"] @ f + h["head.weight.bias"]).reshape(3, 5),
            "bias": h["head.bias.weight"] @ f + h["head.bias.bias"]}


def test_pfedhn_server_step_equals_plain_pytorch() -> None:
    """Two sampled clients (indices 1 and 3, round weights 0.3 / 0.7) of four, a two-layer MLP with random
    heads, an old momentum buffer, clipping active: the new hypernetwork equals torch's SGD(momentum, weight
    decay) after clip_grad_norm_ on the autograd gradient of Σ_i p_i ⟨θ_i(φ, v_i), −Δθ_i⟩, and the global
    model becomes h(v̄; φ') with v̄ = Σ_k p_k v_k over the training clients."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    alg = PFedHN(embed_dim=2, hidden_dim=4, mlp_layers=2, server_lr=0.05, embed_lr=0.2, momentum=0.9,
                 weight_decay=0.01, clip_norm=0.5)
    records = client_records([5, 8, 11, 14], weight=[0.1, 0.2, 0.0, 0.7], is_new=[False, False, True, False])
    alg.bind_clients(records, torch.ones(4, 3, dtype=torch.long))
    state = alg.init_server_state(params)
    state["hnet"] = {k: v + 0.3 * torch.randn_like(v) for k, v in state["hnet"].items()}
    state["momentum"] = {k: 0.1 * torch.randn_like(v) for k, v in state["hnet"].items()}
    delta = {k: torch.randn(2, *v.shape) for k, v in params.items()}
    weights = torch.tensor([0.3, 0.7])
    outputs = ClientOutput(delta=delta, state={}, extras={}, metrics={"loss": torch.zeros(2)})
    sampled = client_records([8, 14], weight=[0.2, 0.7], index=[1, 3], seen=[True, True])
    new_delta, new_state = alg.aggregate(params, outputs, weights, state, sampled)

    leaves = {k: v.clone().requires_grad_(True) for k, v in state["hnet"].items()}
    objective = sum(
        weights[c] * sum((_plain_generate(leaves, leaves["embed"][i])[k] * -delta[k][c]).sum() for k in params)
        for c, i in enumerate([1, 3])
    )
    names = list(leaves)
    grads = torch.autograd.grad(objective, [leaves[n] for n in names])
    tensors = [nn.Parameter(state["hnet"][n].clone()) for n in names]
    for t, g in zip(tensors, grads, strict=True):
        t.grad = g.clone()
    nn.utils.clip_grad_norm_(tensors, 0.5)
    groups = [{"params": [t for n, t in zip(names, tensors, strict=True) if n != "embed"]},
              {"params": [tensors[names.index("embed")]], "lr": 0.2}]
    opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.01)
    for n, t in zip(names, tensors, strict=True):
        opt.state[t]["momentum_buffer"] = state["momentum"][n].clone()
    opt.step()
    for n, t in zip(names, tensors, strict=True):
        torch.testing.assert_close(new_state["hnet"][n], t.detach(), rtol=0, atol=1e-6)
    v_bar = 0.1 * tensors[names.index("embed")][0] + 0.2 * tensors[names.index("embed")][1] \
        + 0.7 * tensors[names.index("embed")][3]
    expected = _plain_generate({n: t.detach() for n, t in zip(names, tensors, strict=True)}, v_bar.detach())
    for k in params:
        torch.testing.assert_close(params[k] + new_delta[k], expected[k], rtol=0, atol=1e-5)
