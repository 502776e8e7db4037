"""benchmarks/streaming_memory.py: its measurement, the pairing of both modes, the resumable records and the report
(the measurement runs in this process here instead of a fresh one; the memory figures are the benchmark's, never
asserted in a test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from benchmarks import streaming_memory
from benchmarks.harness import read_records


def test_both_modes_agree_and_a_rerun_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, bool]] = []

    def in_process(clients: int, chunk: int, width: int, stream: bool, params_out: str) -> dict[str, Any]:
        calls.append((clients, stream))
        return streaming_memory.measure_round(clients, chunk, width, stream, params_out)

    monkeypatch.setattr(streaming_memory, "_run_child", in_process)
    args = ["--clients", "6", "9", "--chunk", "4", "--width", "16", "--results", str(tmp_path)]
    streaming_memory.main(args)
    assert sorted(calls) == [(6, False), (6, True), (9, False), (9, True)]
    records = read_records(tmp_path / "streaming_memory.jsonl")
    assert [r["key"] for r in records] == ["16/6/4", "16/9/4"]
    for r in records:
        assert r["max_param_diff"] < 1e-6  # the two modes differ by float reassociation only
        assert r["streamed"]["parameters"] == 784 * 16 + 16 + 16 * 16 + 16 + 16 * 10 + 10
        assert r["streamed"]["stacked_mib"] == pytest.approx(r["clients"] * r["streamed"]["parameters"] * 4 / 2**20)
    streaming_memory.main(args)  # every cell is recorded: nothing runs again
    assert len(calls) == 4
    table = (tmp_path / "streaming_memory.md").read_text()
    assert "| 6 | 4 | 13,002 |" in table and "| 9 | 4 | 13,002 |" in table
    assert (tmp_path / "streaming_memory.png").stat().st_size > 0

