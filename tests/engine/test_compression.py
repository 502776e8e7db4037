"""Compression of uploads and downloads (issue 28): QSGD's moments against Alistarh et al.'s Lemma 3.1, top-k with
error feedback at k = d equal to no compression bit for bit, the residual through a resume (memory and disk
stores), every compressor looped and batched with the same numbers, and the refused compositions."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.communication.compressors import (
    QSGD,
    HalfPrecision,
    RandomK,
    TopK,
    compression_noise,
    parse_compression,
    sparse_bytes,
)
from lightning_fedmeta.loop.compression_stage import run_rows
from lightning_fedmeta.persistence.memory_store import flatten_state
from tests.helpers import make_trainer, tiny_datamodule

COMPRESSORS = [HalfPrecision(torch.float16), HalfPrecision(torch.bfloat16), QSGD(8), QSGD(4, bucket_size=16),
               QSGD(4, bucket_size=None), TopK(0.1), RandomK(0.25)]


def _draws(compressor: Any, v: torch.Tensor, n: int) -> torch.Tensor:
    noise = compression_noise(3, 0, torch.arange(n), v.numel())
    return run_rows(compressor, v.expand(n, -1).contiguous(), torch.zeros(n, v.numel()), noise, "vmap")[0]


@pytest.mark.parametrize("bits,bucket", [(8, None), (4, None), (4, 8), (2, None)])
def test_qsgd_is_unbiased_and_within_lemma_3_1(bits: int, bucket: int | None) -> None:
    """Mean of n draws within 5 standard errors of v per coordinate; E‖Q(v)−v‖² ≤ min(b/s², √b/s)‖v‖² per bucket."""
    torch.manual_seed(0)
    v = torch.randn(64) * torch.linspace(0.1, 3, 64)
    q, n = QSGD(bits, bucket_size=bucket), 4000
    draws = _draws(q, v, n)
    err = draws - v
    per_coord_sd = err.std(0)
    assert ((draws.mean(0) - v).abs() <= 5 * per_coord_sd / math.sqrt(n) + 1e-6).all()
    b, s = (64 if bucket is None else bucket), q.levels
    buckets = v.reshape(-1, b)
    bound = sum(min(b / s**2, math.sqrt(b) / s) * float(x.pow(2).sum()) for x in buckets)
    variance = float(err.pow(2).sum(1).mean())
    assert variance <= bound * 1.05  # the bound plus sampling error of the mean of n squared norms
    # each coordinate's variance is exactly (‖v‖/s)² (r − ⌊r⌋)(1 − r + ⌊r⌋), r = s|v_i|/‖v‖
    norm = buckets.norm(dim=1).repeat_interleave(b)
    r = v.abs() * s / norm
    exact = (norm / s) ** 2 * (r - r.floor()) * (1 - r + r.floor())
    assert abs(variance - float(exact.sum())) <= 0.1 * float(exact.sum()) + 1e-9


def test_qsgd_levels_sign_bit_and_bytes() -> None:
    assert QSGD(8).levels == 127 and QSGD(4).levels == 7
    signed, norms = QSGD(4, bucket_size=4).encode(torch.tensor([3.0, -4.0, 0.0, 0.0, 1.0]), torch.rand(5))
    assert signed.dtype == torch.int8 and signed.abs().max() <= 7 and norms.tolist() == [5.0, 1.0]
    assert signed[1] < 0 and signed[2] == 0
    assert QSGD(8, bucket_size=512).encoded_bytes(1000) == 2 * 4 + 1000
    assert QSGD(4, bucket_size=None).encoded_bytes(1001) == 4 + 501


def test_randomk_is_unbiased() -> None:
    v = torch.randn(40)
    draws = _draws(RandomK(0.25), v, 6000)
    assert ((draws.mean(0) - v).abs() <= 5 * (draws - v).std(0) / math.sqrt(6000)).all()


def test_sparse_bytes_take_the_cheaper_index_code() -> None:
    assert sparse_bytes(68270, 683) == 683 * 8  # 1 %: int32 indices (2732 B) beat the bitmap (8534 B)
    assert sparse_bytes(1000, 500) == 500 * 4 + 125  # 50 %: the bitmap
    assert TopK(0.01).encoded_bytes(68270) == 683 * 8
    assert HalfPrecision().encoded_bytes(10) == 20


def test_topk_error_feedback_keeps_what_it_does_not_send() -> None:
    v, e = torch.tensor([0.1, -2.0, 0.3, 0.05]), torch.tensor([0.0, 0.0, 0.5, 0.0])
    sent, kept = TopK(0.5).step(v, e)
    assert torch.equal(sent, torch.tensor([0.0, -2.0, 0.8, 0.0]))
    assert torch.equal(kept, torch.tensor([0.1, 0.0, 0.0, 0.05]))
    assert torch.equal(sent + kept, v + e)


@pytest.mark.parametrize("compressor", COMPRESSORS, ids=lambda c: c.describe())
def test_every_compressor_runs_looped_and_batched_with_equal_numbers(compressor: Any) -> None:
    rows, residual = torch.randn(5, 37), torch.randn(5, 37) * 0.1
    noise = compression_noise(1, 2, torch.tensor([0, 3, 4, 7, 9]), 37)
    looped = run_rows(compressor, rows, residual, noise, "loop")
    batched = run_rows(compressor, rows, residual, noise, "vmap")
    for a, b in zip(looped, batched, strict=True):
        assert torch.equal(a, b)


def test_noise_is_a_function_of_seed_round_and_client() -> None:
    a = compression_noise(0, 3, torch.tensor([2, 5]), 10)
    b = compression_noise(0, 3, torch.tensor([5]), 10)
    assert torch.equal(a[1], b[0]) and not torch.equal(a[0], a[1])
    assert not torch.equal(compression_noise(0, 4, torch.tensor([5]), 10), b)


# ----------------------------------------------------------------------------------------------------------------
# whole runs
# ----------------------------------------------------------------------------------------------------------------
def _module(compression: Any = None, algorithm: Any = None, batching: str = "auto", **kwargs: Any) -> FederatedModule:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))
    return FederatedModule(model=model, algorithm=algorithm or {"name": "fedavg", "local_steps": 3, "local_lr": 0.1},
                           clients_per_round=3, seed=4, compile_clients=False, client_batching=batching,
                           compression=compression, **kwargs)


def _fit(module: FederatedModule, rounds: int, ckpt: str | None = None) -> FederatedModule:
    make_trainer(rounds).fit(module, tiny_datamodule(6, eval_every=100), ckpt_path=ckpt)
    return module


def _params(module: FederatedModule) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}


@pytest.mark.parametrize("algorithm", [{"name": "fedavg", "local_steps": 3, "local_lr": 0.1},
                                       {"name": "ditto", "local_steps": 2, "local_lr": 0.1}], ids=["fedavg", "ditto"])
def test_topk_with_k_equal_d_is_no_compression_bit_for_bit(algorithm: dict[str, Any]) -> None:
    plain = _fit(_module(None, dict(algorithm)), 3)
    full = _fit(_module({"upload": "topk", "fraction": 1.0}, dict(algorithm)), 3)
    for name, value in _params(plain).items():
        assert torch.equal(_params(full)[name], value), name
    residual = flatten_state(full.engine.compression.residuals.tensors)
    assert residual and all(not v.any() for v in residual.values())


@pytest.mark.parametrize("option", ["float16", {"upload": "qsgd", "bits": 4, "bucket_size": 16}, "randomk",
                                    {"upload": "topk", "fraction": 0.2}, {"upload": "none", "download": "bfloat16"}])
def test_compressed_runs_agree_looped_and_batched(option: Any) -> None:
    looped = _fit(_module(option, batching="loop"), 2)
    batched = _fit(_module(option, batching="vmap"), 2)
    plain = _fit(_module(None, batching="vmap"), 2)
    changed = False
    for name, value in _params(looped).items():
        torch.testing.assert_close(_params(batched)[name], value, atol=1e-6, rtol=1e-5)
        changed |= not torch.equal(_params(plain)[name], value)
    assert changed  # the compression did something


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_the_topk_residual_survives_a_resume_bit_exactly(store: str, tmp_path: Path) -> None:
    option = {"upload": "topk", "fraction": 0.2}

    def build(folder: str) -> FederatedModule:
        return _module(option, client_state=store, client_state_dir=str(tmp_path / folder))

    straight = _fit(build("straight"), 4)
    first = build("first")
    trainer = make_trainer(2)
    trainer.fit(first, tiny_datamodule(6, eval_every=100))
    trainer.save_checkpoint(tmp_path / "half.ckpt")
    resumed = _fit(build("resumed"), 4, str(tmp_path / "half.ckpt"))
    for name, value in _params(straight).items():
        assert torch.equal(_params(resumed)[name], value), name
    assert (type(resumed.engine.compression.residuals).__name__ == "DiskClientStateStore") == (store == "disk")
    kept, again = (flatten_state(m.engine.compression.residuals.state_dict()) for m in (straight, resumed))
    assert kept and any(v.any() for v in kept.values())
    for name, value in kept.items():
        assert torch.equal(again[name], value), name


def test_refused_compositions_say_why() -> None:
    with pytest.raises(ValueError, match="combines each coordinate separately"):
        _fit(_module("topk", aggregator={"name": "median"}), 1)
    with pytest.raises(ValueError, match="compresses uploads that are parameter deltas"):
        _fit(_module("qsgd", algorithm={"name": "ifca"}), 1)
    with pytest.raises(ValueError, match="download must be one of"):
        parse_compression({"upload": "qsgd", "download": "qsgd"})
    with pytest.raises(ValueError, match="unknown or unused keys"):
        parse_compression({"upload": "topk", "bits": 8})


def test_dp_clips_the_decoded_upload() -> None:
    """Compression then the server's DP clip: a DP run with top-k trains and reports its privacy."""
    module = _fit(_module({"upload": "topk", "fraction": 0.3}, aggregation="uniform",
                          dp={"clip": 0.5, "noise_multiplier": 0.5, "delta": 1e-5, "adaptive_clip": False}), 2)
    assert all(torch.isfinite(p).all() for p in _params(module).values())


@pytest.mark.parametrize("compressor", [HalfPrecision(), HalfPrecision(torch.bfloat16), QSGD(8), QSGD(4),
                                        QSGD(2, bucket_size=7), TopK(0.01), TopK(0.5), RandomK(0.1)],
                         ids=lambda c: c.describe())
def test_the_flower_message_carries_the_compressed_form_and_decodes_as_in_simulation(compressor: Any) -> None:
    """The record's arrays are exactly encoded_bytes (values + indices or bitmap, packed levels + norms, 16-bit),
    and the ServerApp's decoding equals the simulation's roundtrip bit for bit."""
    pytest.importorskip("flwr")
    from lightning_fedmeta.flower.compressed import decode_upload, encode_upload, payload_bytes_of

    d = 1003
    row, noise = torch.randn(d), compression_noise(0, 1, torch.tensor([2]), d)[0]
    record = encode_upload(compressor, row, noise)
    assert payload_bytes_of(record) == compressor.encoded_bytes(d) < 4 * d
    assert torch.equal(decode_upload(compressor, record, d), compressor.roundtrip(row, noise))
