"""The two federated LoRA rules of issue 40: FFA-LoRA (``add_lora(freeze_a=True)`` under FedAvg: ``A`` frozen at
its random initialisation, ``B`` trained and averaged, aggregation exact) and FedSA-LoRA (``fedsa_lora``: ``A``
shared and averaged, ``B`` personal), each against a plain-PyTorch reference of its paper's update on unequal
clients (3 of 5 training clients a round, one held out), full batches."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.fedsa_lora import FedSALoRA, personal_parameter_names
from lightning_fedmeta.communication.accounting import upload_of_client
from lightning_fedmeta.data.synthetic_tasks import make_synthetic_next_token
from lightning_fedmeta.models.lora import LoRALinear, LoRAModel, add_lora
from lightning_fedmeta.models.reference import TinyTransformer
from lightning_fedmeta.testing import CHECKS, check_algorithm, check_loop_equals_vmap
from tests.conftest import run_plain_rounds
from tests.helpers import tiny_data

LR, STEPS, ROUNDS = 0.4, 3, 3
A_NAMES = ("0.lora_A", "2.lora_A")
B_NAMES = ("0.lora_B", "2.lora_B")


def lora_mlp(freeze_a: bool = False) -> nn.Module:
    """``Linear(5, 8) → Tanh → Linear(8, 3)``, seeded, with rank-2 adapters (α = 4) on both layers."""
    torch.manual_seed(0)
    return add_lora(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)), rank=2, alpha=4.0,
                    freeze_a=freeze_a)


def module_of(algorithm: dict[str, Any], model: nn.Module, batching: str = "vmap") -> FederatedModule:
    module = FederatedModule(model=model, algorithm={"local_lr": LR, "local_steps": STEPS, "batch_size": None,
                                                     **algorithm},
                             clients_per_round=3, seed=5, holdout_clients=1, client_batching=batching)
    module.attach_data(tiny_data())
    assert len(set(module.client_weight.tolist())) > 1  # unequal clients
    return module


def trainable(net: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad}


def local_sgd(net: nn.Module, start: dict[str, Tensor], x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """The paper's local work in plain PyTorch: ``STEPS`` full-batch steps of ``torch.optim.SGD`` on the trainable
    parameters of ``net`` from ``start``."""
    with torch.no_grad():
        for n, p in net.named_parameters():
            if n in start:
                p.copy_(start[n])
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=LR)
    for _ in range(STEPS):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    return trainable(net)


def weights(module: FederatedModule, sampled: Tensor) -> list[float]:
    w = module.client_weight.double()[sampled]
    return (w / w.sum()).tolist()


# ----------------------------------------------------------------------------------------------
# FFA-LoRA: A frozen, B trained and averaged
# ----------------------------------------------------------------------------------------------
def test_freeze_a_freezes_every_a_at_its_random_initialisation() -> None:
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(6, 4), rank=2, freeze_a=True)
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == ["lora_B"]
    assert float(layer.lora_A.abs().sum()) > 0 and torch.equal(layer.lora_B, torch.zeros(4, 2))
    torch.manual_seed(0)
    assert torch.equal(LoRALinear(nn.Linear(6, 4), rank=2).lora_A, layer.lora_A)  # the same draw as LoRA's A
    model = lora_mlp(freeze_a=True)
    assert [n for n, p in model.named_parameters() if p.requires_grad] == list(B_NAMES)
    wrapped = LoRAModel(nn.Sequential(nn.Linear(5, 3)), rank=1, freeze_a=True)
    assert [n for n, p in wrapped.named_parameters() if p.requires_grad] == ["model.0.lora_B"]
    with pytest.raises(ValueError, match="freeze_a freezes every lora_A, but train_also"):
        add_lora(nn.Sequential(nn.Linear(5, 3)), rank=1, freeze_a=True, train_also=["lora_A"])
    with pytest.raises(ValueError, match="freeze_a must be true or false"):
        LoRALinear(nn.Linear(6, 4), freeze_a="yes")  # type: ignore[arg-type]


def test_ffa_lora_average_of_b_is_exactly_the_average_of_the_clients_updates() -> None:
    """FedAvg on the FFA-LoRA model, 3 rounds, against torch.optim.SGD per client: the new global B is Σ p_i B_i
    and (α/r) B A is exactly Σ p_i (α/r) B_i A, the average of the clients' own updates (closed form, A fixed);
    A is bit-identical after training, in no tree the engine holds, and no byte of it is sent."""
    module = module_of({"name": "fedavg"}, lora_mlp(freeze_a=True))
    model = module.model
    a0 = {n: p.detach().clone() for n, p in model.named_parameters() if n in A_NAMES}
    assert list(module.engine.global_params()) == list(B_NAMES)
    data = tiny_data()
    net = lora_mlp(freeze_a=True)
    b = trainable(net)
    rounds = run_plain_rounds(module, ROUNDS)
    for sampled in rounds:
        p = weights(module, sampled)
        trained = [local_sgd(net, b, *data.client_train(c)) for c in sampled.tolist()]
        b = {k: sum(pi * t[k] for pi, t in zip(p, trained, strict=True)) for k in b}
        for k_b, k_a in zip(B_NAMES, A_NAMES, strict=True):  # exact aggregation of the products
            mean_of_products = sum(pi * t[k_b] @ a0[k_a] for pi, t in zip(p, trained, strict=True))
            torch.testing.assert_close(b[k_b] @ a0[k_a], mean_of_products, rtol=0, atol=1e-6)
    assert len({c for r in rounds for c in r.tolist()}) > 3  # partial participation: the rounds differ
    got = module.engine.global_params()
    for k in B_NAMES:
        torch.testing.assert_close(got[k], b[k], rtol=0, atol=2e-6)
        assert float(got[k].abs().sum()) > 0
    for n, p in model.named_parameters():
        if n in A_NAMES:
            assert torch.equal(p, a0[n]) and not p.requires_grad
    result = module.engine.compute(ROUNDS)
    upload = module.algorithm.upload(upload_of_client(result.output, 0))
    assert set(upload["delta"]) == set(B_NAMES)
    b_bytes = 4 * sum(model.get_parameter(k).numel() for k in B_NAMES)
    traffic = module.engine.count_traffic(ROUNDS, result).totals()
    assert traffic == {"comm/up_bytes": b_bytes * result.clients.numel(),
                       "comm/down_bytes": b_bytes * result.clients.numel()}


def test_averaging_both_factors_is_not_exact_which_is_why_ffa_lora_freezes_a() -> None:
    """The same run with A trained (plain LoRA under FedAvg): the product of the averages (Σ p_i B_i)(Σ p_i A_i)
    is not the average of the products Σ p_i B_i A_i, so the closed form above really depends on A being frozen."""
    data = tiny_data()
    net = lora_mlp()
    start = trainable(net)
    start["0.lora_B"] = torch.full_like(start["0.lora_B"], 0.1)
    trained = [local_sgd(net, start, *data.client_train(c)) for c in (0, 1, 2)]
    p = [0.5, 0.3, 0.2]
    mean = {k: sum(pi * t[k] for pi, t in zip(p, trained, strict=True)) for k in start}
    exact = sum(pi * t["0.lora_B"] @ t["0.lora_A"] for pi, t in zip(p, trained, strict=True))
    assert float((mean["0.lora_B"] @ mean["0.lora_A"] - exact).abs().max()) > 1e-4


def test_ffa_lora_exchanges_nothing_frozen() -> None:
    check_algorithm({"name": "fedavg", "local_steps": 2, "local_lr": 0.3}, model=lambda: lora_mlp(freeze_a=True),
                    data=tiny_data(), clients_per_round=3, holdout_clients=1,
                    skip=[c for c in CHECKS if c != "check_exchange"])


# ----------------------------------------------------------------------------------------------
# FedSA-LoRA: A shared and averaged, B personal
# ----------------------------------------------------------------------------------------------
def test_fedsa_lora_rounds_match_plain_pytorch() -> None:
    """3 rounds against the paper's update in plain PyTorch (torch.optim.SGD per client): each sampled client
    trains (global A, its own B_i) jointly, the server averages the A's with the round's weights p_i, each client
    keeps its B; the global A and every trained client's B agree to 1e-5. The uploads hold every lora_A and no
    lora_B or base parameter; the personalised model of client i is (base, global A, B_i), and a held-out client's
    is (base, global A, B⁰ = 0): the base model itself."""
    module = module_of({"name": "fedsa_lora"}, lora_mlp())
    data = tiny_data()
    net = lora_mlp()
    start = trainable(net)
    a = {k: start[k] for k in A_NAMES}
    own: dict[int, dict[str, Tensor]] = {}
    rounds = run_plain_rounds(module, ROUNDS)
    for sampled in rounds:
        clients = sampled.tolist()
        p = weights(module, sampled)
        trained = {c: local_sgd(net, {**a, **own.get(c, {k: start[k] for k in B_NAMES})}, *data.client_train(c))
                   for c in clients}
        a = {k: v + sum(pi * (trained[c][k] - v) for pi, c in zip(p, clients, strict=True)) for k, v in a.items()}
        own.update({c: {k: trained[c][k] for k in B_NAMES} for c in clients})
    assert any(sum(c in r.tolist() for r in rounds) > 1 for c in own), "the test needs a client sampled twice"
    got = module.engine.global_params()
    for k in A_NAMES:
        torch.testing.assert_close(got[k], a[k], rtol=0, atol=1e-5)
        assert not torch.equal(got[k], start[k])
    for k in B_NAMES:  # the global B never moves from B⁰ = 0: no B is sent
        assert torch.equal(got[k], start[k])
    states = module.client_states.tensors["personal"]
    assert set(states) == set(B_NAMES)
    for c, mine in own.items():
        for k in B_NAMES:
            torch.testing.assert_close(states[k][c], mine[k], rtol=0, atol=1e-5)
    assert float((states["2.lora_B"][list(own)[0]] - states["2.lora_B"][list(own)[1]]).abs().max()) > 1e-4
    # uploads: the A's only
    result = module.engine.compute(ROUNDS)
    frozen = {n for n, p in module.model.named_parameters() if not p.requires_grad}
    for i in range(result.clients.numel()):
        upload = module.algorithm.upload(upload_of_client(result.output, i))
        assert set(upload["delta"]) == set(A_NAMES) and not set(upload["delta"]) & frozen
    # evaluation: (global A, own B) for a trained client; (global A, B⁰ = 0), the base, for the held-out one
    trained_client, held_out = next(iter(own)), int(module.holdout[0])
    x = data.client_train(held_out)[0]
    personal = module.personalize(trained_client).state_dict()
    for k in A_NAMES:
        torch.testing.assert_close(personal[k], got[k], rtol=0, atol=0)
    for k in B_NAMES:
        torch.testing.assert_close(personal[k], states[k][trained_client], rtol=0, atol=0)
    base = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    base.load_state_dict({k.replace(".base", ""): v for k, v in module.model.state_dict().items() if ".base." in k})
    torch.testing.assert_close(module.personalize(held_out)(x), base(x), rtol=0, atol=0)


def lora_lm() -> nn.Module:
    torch.manual_seed(0)
    return add_lora(TinyTransformer(8, d_model=16, nhead=2, num_layers=1, max_len=6), ["qkv", "proj", "head"],
                    rank=2, alpha=4.0)


def test_fedsa_lora_runs_looped_and_batched_alike() -> None:
    """loop == vmap on the LoRA'd MLP (full batches) and on a LoRA'd TinyTransformer on synthetic next-token data
    (7 unequal clients, 3 a round, one held out)."""
    check_loop_equals_vmap({"name": "fedsa_lora", "local_steps": STEPS, "local_lr": LR, "batch_size": None},
                           model=lora_mlp, data=tiny_data(), clients_per_round=3, holdout_clients=1,
                           atol=1e-5, rtol=1e-5)
    data = make_synthetic_next_token(num_clients=7, vocab_size=8, seq_len=6, seed=0)
    check_loop_equals_vmap({"name": "fedsa_lora", "local_steps": 2, "local_lr": 0.3}, model=lora_lm, data=data,
                           clients_per_round=3, holdout_clients=1, atol=1e-5, rtol=1e-5)


def test_fedsa_lora_personal_parameters_are_named_by_pattern() -> None:
    names = [n for n, p in lora_lm().named_parameters() if p.requires_grad]
    assert FedSALoRA().personal_names(dict.fromkeys(names)) == [n for n in names if n.endswith("lora_B")]
    assert personal_parameter_names(["classifier.weight", "classifier.bias", "enc.lora_A", "enc.lora_B"],
                                    ["lora_B", "classifier"]) == ["classifier.weight", "classifier.bias",
                                                                   "enc.lora_B"]
    assert personal_parameter_names(["head.lora_B", "blocks.0.lora_B"], ["head.*"]) == ["head.lora_B"]
    assert personal_parameter_names(["x.my_lora_B"], ["lora_B"]) == []  # whole components, not substrings


def test_fedsa_lora_refuses_a_model_without_adapters_and_bad_patterns() -> None:
    with pytest.raises(ValueError, match="names no trainable parameter.*needs a LoRA'd model"):
        FedSALoRA().personal_names({"0.weight": torch.zeros(1), "0.bias": torch.zeros(1)})
    with pytest.raises(ValueError, match="names every trainable parameter"):
        FedSALoRA(personal=["lora_A", "lora_B"]).personal_names({"0.lora_A": torch.zeros(1),
                                                                 "0.lora_B": torch.zeros(1)})
    with pytest.raises(ValueError, match="personal must be a parameter name pattern"):
        FedSALoRA(personal=[])
    with pytest.raises(ValueError, match="personal must be a parameter name pattern"):
        FedSALoRA(personal=[3])  # type: ignore[list-item]
    module = FederatedModule(model=nn.Sequential(nn.Linear(5, 3)), algorithm="fedsa_lora", clients_per_round=3)
    with pytest.raises(ValueError, match="needs a LoRA'd model"):
        module.attach_data(tiny_data())
        run_plain_rounds(module, 1)
