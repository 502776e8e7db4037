"""benchmarks/scale.py's adapters case (``--adapters``): its population, its measurement of both stores and the
report, run in this process on a few clients instead of in fresh ones (the memory figures are the benchmark's,
never asserted in a test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import scale
from benchmarks.harness import read_records


def test_the_population_is_tiny_fixed_size_next_token_clients() -> None:
    data = scale.adapter_population(50)
    assert data.num_clients == 50 and data.task == "next_token"
    assert data.train_counts.tolist() == [scale.ADAPTER_WINDOWS] * 50
    assert tuple(data.train_x.shape) == (50 * scale.ADAPTER_WINDOWS, scale.ADAPTER_LM["max_len"])
    assert torch.equal(data.train_y[:, :-1], data.train_x[:, 1:])  # next-token targets of the same windows


def test_the_adapters_case_measures_both_stores_and_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    threads = torch.get_num_threads()

    def in_process(spec: dict[str, Any], state_dir: str | None, timeout: float) -> dict[str, Any]:
        calls.append(spec)
        try:
            result = scale.child({**spec, "state_dir": None})
        finally:
            torch.set_num_threads(threads)
        return {**result, "peak_rss_mb": 1000.0 + spec["K"] / 10}

    monkeypatch.setattr(scale, "run_child", in_process)
    out = tmp_path / "adapters.jsonl"
    args = ["--adapters", "--ks", "30", "60", "--rounds", "1", "--out", str(out)]
    assert scale.main(args) == 0
    assert sorted((c["store"], c["K"]) for c in calls) == [("disk", 30), ("disk", 60), ("memory", 30),
                                                           ("memory", 60)]
    records = {(r["spec"]["store"], r["spec"]["K"]): r["result"] for r in read_records(out)}
    # FedSA-LoRA's personal lora_B per client: 2 blocks × (qkv 192 × 4 + proj 64 × 4) + head 64 × 4 float32
    row = 4 * (2 * (192 * 4 + 64 * 4) + 64 * 4)
    for (store, k), result in records.items():
        assert result["store"] == {"disk": "DiskClientStateStore", "memory": "ClientStateStore"}[store]
        assert result["row_bytes"] == row and result["state_mb"] == pytest.approx(k * row / 1e6)
        assert result["base_params"] > 10 * result["adapter_params"]
        assert result["up_bytes_per_round"] > 0
    assert records[("disk", 60)]["store_resident_mb"] == pytest.approx((row + 2 * 60) / 1e6)
    assert 0 < records[("disk", 60)]["rows_written"] <= 30  # 3 rounds of 10: the sampled rows only
    assert records[("memory", 60)]["rows_written"] is None
    scale.main(args)  # every cell is recorded: nothing runs again
    assert len(calls) == 4
    table = out.with_suffix(".md").read_text()
    assert "## Adapters: FedSA-LoRA's personal B matrices per client" in table
    assert f"| disk | 60 | 10 | {row:,} |" in table
    assert "* disk store, 10/round: K = 30 → 60: peak RSS +3 MB" in table
