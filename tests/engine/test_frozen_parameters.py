"""Frozen parameters (``requires_grad=False``) in the engine: never trained, sent, stored or batched (issue 40).

A LoRA'd tiny causal LM (:func:`~lightning_fedmeta.models.lora.add_lora` on
:class:`~lightning_fedmeta.models.reference.TinyTransformer`) on the synthetic next-token data (clients of unequal
sizes, 3 of 7 per round): the trees the engine and the algorithms see hold the adapters only; the frozen base is
captured unbatched by ``vmap``, is bit-identical after training, and costs no byte.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

import lightning_fedmeta.loop.clients as loop_clients
from lightning_fedmeta import FederatedModule
from lightning_fedmeta.client.functional import ClientContext
from lightning_fedmeta.client.trainable import TrainableSet
from lightning_fedmeta.data.synthetic_tasks import make_synthetic_next_token
from lightning_fedmeta.loop.server import apply_server_step
from lightning_fedmeta.models.lora import LoRALinear, add_lora
from lightning_fedmeta.models.reference import TinyTransformer
from lightning_fedmeta.persistence.memory_store import flatten_state
from lightning_fedmeta.testing import (
    CHECKS,
    _frozen_paths,
    check_algorithm,
    check_loop_equals_vmap,
    check_resume_is_bit_exact,
)

VOCAB, T = 8, 6
ALGORITHMS = {
    "fedavg": {"name": "fedavg", "local_steps": 2, "local_lr": 0.3},
    "ditto": {"name": "ditto", "local_steps": 2, "local_lr": 0.3, "personal_steps": 2, "personal_lr": 0.3},
}


def lora_lm() -> nn.Module:
    """A seeded one-block TinyTransformer with rank-2 adapters on its attention projections and head."""
    torch.manual_seed(0)
    return add_lora(TinyTransformer(VOCAB, d_model=16, nhead=2, num_layers=1, max_len=T), ["qkv", "proj", "head"],
                    rank=2, alpha=4.0)


@pytest.fixture(scope="module")
def data() -> Any:
    data = make_synthetic_next_token(num_clients=7, vocab_size=VOCAB, seq_len=T, seed=0)
    assert len(set(data.train_counts.tolist())) > 1  # unequal clients
    return data


def frozen_names(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if not p.requires_grad}


def adapter_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def bound(data: Any, algorithm: str, batching: str = "vmap") -> FederatedModule:
    module = FederatedModule(model=lora_lm(), algorithm=ALGORITHMS[algorithm], clients_per_round=3, seed=1,
                             client_batching=batching, compile_clients=False)
    module.attach_data(data)
    return module


def rounds(module: FederatedModule, count: int, optimizer: torch.optim.Optimizer) -> None:
    for r in range(count):
        result = module.engine.compute(r)
        assert result is not None
        uploads = module.engine.combine(result)
        assert uploads is not None and uploads.update is not None
        apply_server_step(optimizer, module.model, uploads.update.delta)
        module.engine.commit(result, uploads.update.server_state)


def paths(tree: Any) -> set[str]:
    return {part for key in flatten_state(dict(tree)) for part in key.split("/")}


# ----------------------------------------------------------------------------------------------
# loop = vmap, exchange, resume: the conformance kit on the LoRA'd model
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_lora_language_model_runs_looped_and_batched_alike(algorithm: str, data: Any) -> None:
    check_loop_equals_vmap(ALGORITHMS[algorithm], model=lora_lm, data=data, clients_per_round=3, holdout_clients=1,
                           atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_nothing_frozen_is_downloaded_uploaded_or_stored(algorithm: str, data: Any) -> None:
    only_exchange = [c for c in CHECKS if c != "check_exchange"]
    check_algorithm(ALGORITHMS[algorithm], model=lora_lm, data=data, clients_per_round=3, holdout_clients=1,
                    skip=only_exchange)


def test_the_exchange_check_names_a_frozen_tensor_in_a_tree() -> None:
    frozen = {"blocks.0.attn.qkv.base.weight"}
    assert _frozen_paths({"personal": {"blocks.0.attn.qkv.base.weight": torch.zeros(1)}}, frozen) == \
        ["personal/blocks.0.attn.qkv.base.weight"]
    assert _frozen_paths({"personal": {"blocks.0.attn.qkv.lora_A": torch.zeros(1)}}, frozen) == []


def test_resume_of_a_lora_run_is_bit_exact(data: Any) -> None:
    check_resume_is_bit_exact(ALGORITHMS["ditto"], model=lora_lm, data=data, clients_per_round=3, holdout_clients=1)


# ----------------------------------------------------------------------------------------------
# the base is never trained, stored or stepped
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_base_is_bit_identical_after_training_and_held_in_no_state(algorithm: str, data: Any) -> None:
    module = bound(data, algorithm)
    model = module.model
    assert model is not None
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert set(module.engine.global_params()) == set(adapters)
    # an optimizer given every parameter, with weight decay and momentum: the frozen ones still never move
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    rounds(module, 3, optimizer)
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), f"the frozen {n} changed"
            assert p.grad is None and p not in optimizer.state
    assert any(not torch.equal(dict(model.named_parameters())[n], v) for n, v in adapters.items())
    frozen = frozen_names(model)
    assert not paths(module.client_states.tensors) & frozen
    assert not paths(module.server_state) & frozen
    if algorithm == "ditto":  # the personal models are adapters only
        assert set(flatten_state(module.client_states.tensors)) == {f"personal/{n}" for n in adapters}


def test_personalised_model_keeps_the_global_base(data: Any) -> None:
    module = bound(data, "ditto")
    rounds(module, 1, torch.optim.SGD([p for p in module.model.parameters() if p.requires_grad], lr=1.0))
    personal = module.personalize(0)
    own = dict(personal.named_parameters())
    for n, p in module.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(own[n], p)


# ----------------------------------------------------------------------------------------------
# bytes: adapters only
# ----------------------------------------------------------------------------------------------
def test_bytes_per_round_count_the_adapters_only(data: Any) -> None:
    module = bound(data, "fedavg")
    assert module.model is not None
    adapter_bytes = 4 * sum(p.numel() for p in module.model.parameters() if p.requires_grad)
    base_bytes = 4 * sum(p.numel() for p in module.model.parameters() if not p.requires_grad)
    assert base_bytes > 10 * adapter_bytes
    result = module.engine.compute(0)
    traffic = module.engine.count_traffic(0, result)
    clients = result.clients.numel()
    # FedAvg downloads θ and uploads Δθ (float32): Σ numel(adapters) × 4 bytes × clients each way
    assert traffic.totals() == {"comm/up_bytes": adapter_bytes * clients, "comm/down_bytes": adapter_bytes * clients}


# ----------------------------------------------------------------------------------------------
# a batched round does not copy the base per client
# ----------------------------------------------------------------------------------------------
def test_batched_round_stacks_adapters_only_and_sees_the_base_unbatched(data: Any, monkeypatch: Any) -> None:
    module = bound(data, "ditto")
    model = module.model
    assert model is not None and module.engine.batching == "vmap"
    frozen, adapters = frozen_names(model), adapter_names(model)
    calls: list[tuple[Any, Any, int]] = []
    original = loop_clients.run_clients

    def recording(fn: Any, shared: Any, per_client: Any, count: int, *args: Any, **kwargs: Any) -> Any:
        calls.append((shared, per_client, count))
        return original(fn, shared, per_client, count, *args, **kwargs)

    monkeypatch.setattr(loop_clients, "run_clients", recording)
    seen: list[tuple[bool, bool]] = []

    def look(layer: nn.Module, _args: Any) -> None:
        wrapped = torch._C._functorch.is_functorch_wrapped_tensor
        seen.append((wrapped(layer.base.weight), wrapped(layer.lora_A)))

    hooks = [m.register_forward_pre_hook(look) for m in model.modules() if isinstance(m, LoRALinear)]
    try:
        module.engine.compute(0)
    finally:
        for h in hooks:
            h.remove()
    assert calls, "the round ran no client"
    for shared, per_client, count in calls:
        params, _server_state = shared
        assert list(params) == adapters  # the shared (in_dims=None) download: adapters only
        batches, state, _record, buffers = per_client
        stacked = paths(state) | set(buffers)
        assert not stacked & frozen
        per_client_floats = sum(t.numel() for t in flatten_state(dict(state)).values())
        assert per_client_floats == count * sum(p.numel() for p in model.parameters() if p.requires_grad)
    # every LoRA layer's forward under vmap: the base weight a plain (unbatched) tensor, the adapter a batched one
    assert seen and all(not base and adapter for base, adapter in seen)


def test_context_passes_frozen_parameters_with_the_buffers() -> None:
    model = lora_lm()

    def loss(logits: Tensor, y: Tensor) -> Tensor:  # per sample: the mean over positions
        return nn.functional.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(-1)

    ctx = ClientContext(model, per_sample_loss=loss)
    assert set(ctx.frozen_params) == frozen_names(model)
    x = torch.randint(0, VOCAB, (2, T))
    adapters = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    torch.testing.assert_close(ctx.predict(adapters, x), model(x), rtol=0, atol=0)
    # a caller may still pass every parameter (today's full trees): the given ones win
    full = {n: p.detach() for n, p in model.named_parameters()}
    torch.testing.assert_close(ctx.predict(full, x), model(x), rtol=0, atol=0)
    assert set(ctx.grad(adapters, _batch(x))) == set(adapters)


def _batch(x: Tensor) -> Any:
    from lightning_fedmeta.client.functional import Batch
    return Batch(x, torch.roll(x, -1, dims=-1), torch.ones(x.shape[0]))


# ----------------------------------------------------------------------------------------------
# the trainable set is fixed at bind time
# ----------------------------------------------------------------------------------------------
def test_a_trainable_set_changed_after_binding_is_refused(data: Any) -> None:
    module = bound(data, "fedavg")
    assert module.model is not None
    module.model.tok.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"trainable parameters changed after it was bound.*tok\.weight"):
        module.engine.compute(0)


def test_a_model_with_nothing_trainable_is_refused(data: Any) -> None:
    model = lora_lm()
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        TrainableSet(model)
    module = FederatedModule(model=model, algorithm="fedavg", clients_per_round=3)
    with pytest.raises(ValueError, match="no trainable parameter"):
        module.attach_data(data)


def test_a_model_without_frozen_parameters_sees_every_parameter() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    split = TrainableSet(model)
    assert split.names == tuple(n for n, _ in model.named_parameters()) and not split.has_frozen
    assert ClientContext(model).frozen_params == {}
