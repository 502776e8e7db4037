"""Compression of LoRA adapter updates (issue 40, docs/communication.md "LoRA adapters"): under fedavg on a LoRA'd
TinyTransformer, plain and FFA-LoRA (``freeze_a=True``), top-k and QSGD compress the trainable (adapter) update
only: the compressed row has the adapters' length, top-k keeps ``⌈fraction·d_adapters⌉`` coordinates of it, the
error-feedback residual is adapter-shaped (in memory and in the disk store), and the frozen base is never
compressed, sent or changed. FedSA-LoRA refuses upload compression with a message that says why."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.data.synthetic_tasks import make_synthetic_next_token
from lightning_fedmeta.loop.compression_stage import flat_rows
from lightning_fedmeta.loop.server import apply_server_step
from lightning_fedmeta.models.lora import add_lora
from lightning_fedmeta.models.reference import TinyTransformer
from lightning_fedmeta.persistence.disk_store import DiskClientStateStore
from lightning_fedmeta.persistence.memory_store import flatten_state

VOCAB, T = 8, 6
COHORT = 3
TOPK = {"upload": "topk", "fraction": 0.1}


def lora_lm(freeze_a: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return add_lora(TinyTransformer(VOCAB, d_model=16, nhead=2, num_layers=1, max_len=T), ["qkv", "proj", "head"],
                    rank=2, alpha=4.0, freeze_a=freeze_a)


@pytest.fixture(scope="module")
def data() -> Any:
    return make_synthetic_next_token(num_clients=7, vocab_size=VOCAB, seq_len=T, seed=0)


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def bound(data: Any, freeze_a: bool, compression: Any, algorithm: str = "fedavg", **options: Any) -> FederatedModule:
    module = FederatedModule(model=lora_lm(freeze_a), algorithm={"name": algorithm, "local_steps": 2, "local_lr": 0.3},
                             clients_per_round=COHORT, seed=1, compile_clients=False, compression=compression,
                             **options)
    module.attach_data(data)
    return module


def adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def base(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


@pytest.mark.parametrize("freeze_a", [False, True], ids=["lora", "ffa_lora"])
@pytest.mark.parametrize("store", ["memory", "disk"])
def test_topk_keeps_k_of_the_adapter_coordinates_and_an_adapter_sized_residual(freeze_a: bool, store: str,
                                                                               data: Any, tmp_path: Any) -> None:
    module = bound(data, freeze_a, TOPK, client_state=store, client_state_dir=str(tmp_path))
    model = module.model
    trainable = adapters(model)
    d = sum(v.numel() for v in trainable.values())
    # the residual store: one adapter-shaped float32 row per client, no base tensor
    residuals = module.engine.compression.residuals
    assert isinstance(residuals, DiskClientStateStore) == (store == "disk")
    shapes = {k: tuple(v.shape[1:]) for k, v in flatten_state(residuals.tensors).items()}
    assert shapes == {k: tuple(v.shape) for k, v in trainable.items()}
    if store == "disk":
        assert residuals.row_bytes() == 4 * d
    frozen = base(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    for r in range(2):
        result = module.engine.compute(r)
        assert result is not None
        sent = result.output.delta  # the decoded compressed uploads: adapters only
        assert set(sent) == set(trainable)
        rows = flat_rows(sent)
        assert rows.shape == (COHORT, d)
        assert (rows != 0).sum(1).tolist() == [math.ceil(0.1 * d)] * COHORT
        uploads = module.engine.combine(result)
        assert uploads is not None and uploads.update is not None
        apply_server_step(optimizer, model, uploads.update.delta)
        module.engine.commit(result, uploads.update.server_state)
    kept = flatten_state(residuals.state_dict())
    assert set(kept) == set(trainable) and any(bool(v.any()) for v in kept.values())  # error feedback at work
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"the frozen {n} changed under compression"
    assert any(not torch.equal(p, trainable[n]) for n, p in model.named_parameters() if n in trainable)


@pytest.mark.parametrize("freeze_a", [False, True], ids=["lora", "ffa_lora"])
def test_qsgd_quantises_the_adapter_row_and_leaves_the_base_alone(freeze_a: bool, data: Any) -> None:
    """4-bit QSGD in buckets of 64 of the adapter row: each decoded value is ``‖v_b‖ sgn(v_i) ξ_i / 7`` with ``ξ_i``
    an integer level next to ``7|v_i|/‖v_b‖``, ``v_b`` the bucket of the raw adapter update (the same round run
    without upload compression gives the raw rows)."""
    qsgd = {"upload": "qsgd", "bits": 4, "bucket_size": 64, "download": "float16"}
    module, raw_module = bound(data, freeze_a, qsgd), bound(data, freeze_a, {"download": "float16"})
    model = module.model
    frozen, trainable = base(model), adapters(model)
    result, raw_result = module.engine.compute(0), raw_module.engine.compute(0)
    assert result is not None and raw_result is not None
    assert torch.equal(result.clients, raw_result.clients)
    rows, raw = flat_rows(result.output.delta), flat_rows(raw_result.output.delta)
    assert rows.shape == raw.shape == (COHORT, sum(v.numel() for v in trainable.values()))
    for start in range(0, rows.shape[1], 64):
        norm = raw[:, start:start + 64].norm(dim=1, keepdim=True)
        levels = rows[:, start:start + 64] * 7 / norm
        exact = raw[:, start:start + 64] * 7 / norm
        torch.testing.assert_close(levels, levels.round(), rtol=0, atol=1e-4)
        assert bool(((levels - exact).abs() < 1 + 1e-4).all())
    assert not torch.equal(rows, raw)
    uploads = module.engine.combine(result)
    assert uploads is not None and uploads.update is not None
    apply_server_step(torch.optim.SGD(model.parameters(), lr=1.0), model, uploads.update.delta)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n])
    assert any(not torch.equal(p, trainable[n]) for n, p in model.named_parameters() if n in trainable)


def test_fedsa_lora_refuses_upload_compression_and_says_why(data: Any) -> None:
    why = (r"model\.compression\.upload='topk.*compresses uploads that are parameter deltas combined by a weighted "
           r"mean; fedsa_lora combines its uploads with its own aggregate.*download: float16 stays possible.*fedavg")
    with pytest.raises(ValueError, match=why):
        bound(data, False, TOPK, algorithm="fedsa_lora")
