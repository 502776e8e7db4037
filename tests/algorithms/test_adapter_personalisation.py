"""The personal-state algorithms applied to LoRA adapters over a frozen base (issue 40): Ditto, FedRep/FedPer (the
head's adapter personal), APFL, FedALA, FDLoRA and HetLoRA on a LoRA'd TinyTransformer train, send and store the
adapters only — the base is bit-identical after training, never in an upload or a download, and no client stores a
frozen tensor — and Ditto's and APFL's rounds match plain-PyTorch references of their papers' updates on the
adapter parameters (on a LoRA'd MLP and on the LoRA'd TinyTransformer, full batches)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.communication.accounting import upload_of_client
from lightning_fedmeta.data.synthetic_tasks import make_synthetic_next_token
from lightning_fedmeta.persistence.memory_store import flatten_state
from lightning_fedmeta.testing import CHECKS, check_algorithm
from tests.algorithms.test_lora_rules import LR, ROUNDS, STEPS, lora_lm, lora_mlp, module_of, weights
from tests.conftest import run_plain_rounds
from tests.helpers import tiny_data

#: each algorithm, with the arguments that make it personalise the adapters (FedRep/FedPer: the head's adapter)
ALGORITHMS: dict[str, dict[str, Any]] = {
    "ditto": {"lam": 0.1},
    "fedrep": {"head_prefix": "head.", "head_steps": 2},
    "fedper": {"head_prefix": "head."},
    "apfl": {},
    "fedala": {"ala_layers": 2, "ala_steps": 2, "ala_start_steps": 2},
    "fdlora": {"fusion_steps": 2},
    "hetlora": {"rank_choices": [1, 2]},
}


def lm_data() -> Any:
    return make_synthetic_next_token(num_clients=7, vocab_size=8, seq_len=6, seed=0)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_personal_state_algorithms_train_send_and_store_the_adapters_only(name: str) -> None:
    """Two rounds on a LoRA'd TinyTransformer (7 unequal clients, 3 a round, one held out): the frozen base is
    bit-identical, the client states hold trainable tensors only, every personalised model keeps the base, and
    check_exchange finds nothing frozen sent either way."""
    algorithm = {"name": name, "local_steps": 2, "local_lr": 0.3, "batch_size": 8, **ALGORITHMS[name]}
    module = FederatedModule(model=lora_lm(), algorithm=algorithm, clients_per_round=3, seed=5, holdout_clients=1)
    module.attach_data(lm_data())
    frozen = {n: p.detach().clone() for n, p in module.model.named_parameters() if not p.requires_grad}
    trainable_names = {n for n, p in module.model.named_parameters() if p.requires_grad}
    assert frozen and all("lora_" in n for n in trainable_names)
    before = {n: p.detach().clone() for n, p in module.model.named_parameters() if p.requires_grad}
    run_plain_rounds(module, 2)
    for n, p in module.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"{name} changed the frozen base parameter {n}"
    assert any(not torch.equal(module.model.get_parameter(n), before[n]) for n in trainable_names)
    for key in flatten_state(module.client_states.tensors):
        leaf = key.rsplit("/", 1)[-1]
        assert leaf not in frozen, f"{name} stores the frozen {leaf} per client"
    for c in (0, int(module.holdout[0])):
        personal = module.personalize(c).state_dict()
        for n, v in frozen.items():
            assert torch.equal(personal[n], v), f"{name}: client {c}'s personalised model changed the base {n}"
    result = module.engine.compute(2)
    for i in range(result.clients.numel()):
        up = flatten_state(module.algorithm.upload(upload_of_client(result.output, i)))
        assert not {k.rsplit("/", 1)[-1] for k in up} & set(frozen)
    check_algorithm(algorithm, model=lora_lm, data=lm_data(), clients_per_round=3, holdout_clients=1,
                    skip=[c for c in CHECKS if c != "check_exchange"])


# ----------------------------------------------------------------------------------------------
# Ditto and APFL on the adapters, against plain PyTorch
# ----------------------------------------------------------------------------------------------
def seeded_b(net: nn.Module) -> nn.Module:
    """``net`` with its B matrices drawn (seeded), so A trains from the first step."""
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in net.named_parameters():
            if n.endswith("lora_B"):
                p.normal_(0.0, 0.3)
    return net


def setting(kind: str, algorithm: dict[str, Any]) -> tuple[FederatedModule, nn.Module, Any]:
    """The module (full batches, 3 clients a round, one held out), a twin network and the data: the LoRA'd MLP on
    the tiny classification clients, or the LoRA'd TinyTransformer on synthetic next-token clients."""
    if kind == "mlp":
        return module_of(algorithm, seeded_b(lora_mlp())), seeded_b(lora_mlp()), tiny_data()
    data = lm_data()
    module = FederatedModule(model=seeded_b(lora_lm()), algorithm={"local_lr": LR, "local_steps": STEPS,
                                                                   "batch_size": None, **algorithm},
                             clients_per_round=3, seed=5, holdout_clients=1)
    module.attach_data(data)
    return module, seeded_b(lora_lm()), data


def adapters(net: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad}


def loss_grad(net: nn.Module, w: dict[str, Tensor], x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """∇F(w) on the adapters by autograd (the base frozen): the mean cross-entropy over samples (and positions)."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in w.items()}
    out = torch.func.functional_call(net, {**dict(net.named_parameters()), **leaves}, (x,))
    loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return dict(zip(leaves, grads, strict=True))


def sgd(net: nn.Module, w: dict[str, Tensor], x: Tensor, y: Tensor) -> dict[str, Tensor]:
    for _ in range(STEPS):
        g = loss_grad(net, w, x, y)
        w = {k: w[k] - LR * g[k] for k in w}
    return w


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_ditto_on_adapters_matches_plain_pytorch(kind: str) -> None:
    """Ditto (Li et al., 2021, Algorithm 1) on the adapters: FedAvg of the global adapters (τ SGD steps), and each
    client's personal adapters v_k ← v_k − η (∇F_k(v_k) + λ (v_k − wᵗ)), s = τ steps from v_k (wᵗ the first time).
    The base is frozen: only the adapters enter the proximal term."""
    lam = 0.5
    module, net, data = setting(kind, {"name": "ditto", "lam": lam})
    w = adapters(net)
    own: dict[int, dict[str, Tensor]] = {}
    rounds = run_plain_rounds(module, ROUNDS)
    for sampled in rounds:
        clients = sampled.tolist()
        p = weights(module, sampled)
        trained = {c: sgd(net, w, *data.client_train(c)) for c in clients}
        for c in clients:
            v = dict(own.get(c, w))
            x, y = data.client_train(c)
            for _ in range(STEPS):
                g = loss_grad(net, v, x, y)
                v = {k: v[k] - LR * (g[k] + lam * (v[k] - w[k])) for k in v}
            own[c] = v
        w = {k: u + sum(pi * (trained[c][k] - u) for pi, c in zip(p, clients, strict=True)) for k, u in w.items()}
    got = module.engine.global_params()
    for k in w:
        torch.testing.assert_close(got[k], w[k], rtol=0, atol=2e-5)
    states = module.client_states.tensors["personal"]
    assert set(states) == set(w)
    for c, v in own.items():
        for k in w:
            torch.testing.assert_close(states[k][c], v[k], rtol=0, atol=2e-5)


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_apfl_on_adapters_matches_plain_pytorch(kind: str) -> None:
    """APFL (Deng et al., 2020, Algorithm 1, adaptive α) on the adapters: per step, w_k ← w_k − η ∇F(w_k);
    v_k ← v_k − η α ∇F(v̄); α ← clip(α − η ⟨v_k − w_k, ∇F(v̄)⟩), v̄ = α v_k + (1 − α) w_k, all from the values
    before the step; the server averages the w_k. The mixing runs over the adapters only."""
    module, net, data = setting(kind, {"name": "apfl"})
    w = adapters(net)
    own: dict[int, tuple[dict[str, Tensor], Tensor]] = {}
    rounds = run_plain_rounds(module, ROUNDS)
    for sampled in rounds:
        clients = sampled.tolist()
        p = weights(module, sampled)
        trained = {}
        for c in clients:
            x, y = data.client_train(c)
            wk = dict(w)
            v, alpha = own.get(c, (dict(w), torch.tensor(0.5)))
            for _ in range(STEPS):
                mixed = {k: alpha * v[k] + (1 - alpha) * wk[k] for k in v}
                gw, gv = loss_grad(net, wk, x, y), loss_grad(net, mixed, x, y)
                new_alpha = (alpha - LR * sum((v[k] - wk[k]).mul(gv[k]).sum() for k in v)).clamp(0.0, 1.0)
                v = {k: v[k] - LR * alpha * gv[k] for k in v}
                wk = {k: wk[k] - LR * gw[k] for k in wk}
                alpha = new_alpha
            trained[c] = wk
            own[c] = (v, alpha)
        w = {k: u + sum(pi * (trained[c][k] - u) for pi, c in zip(p, clients, strict=True)) for k, u in w.items()}
    got = module.engine.global_params()
    for k in w:
        torch.testing.assert_close(got[k], w[k], rtol=0, atol=2e-5)
    states = module.client_states.tensors
    assert set(states["personal"]) == set(w)
    for c, (v, alpha) in own.items():
        torch.testing.assert_close(states["alpha"][c], alpha, rtol=0, atol=2e-5)
        for k in w:
            torch.testing.assert_close(states["personal"][k][c], v[k], rtol=0, atol=2e-5)
