"""benchmarks/communication.py: the --quick smoke run, its resumable records, the report and the cheapest pick."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import communication as comm
from benchmarks.harness import read_records


def test_quick_run_writes_records_report_and_plot_and_resumes(tmp_path: Path, capsys) -> None:
    out = tmp_path / "communication"
    argv = ["--quick", "--algorithms", "fedavg_ft", "ditto", "--compressions", "none", "topk1", "--out", str(out)]
    assert comm.main(argv) == 0
    records = read_records(out.with_suffix(".jsonl"))
    assert len(records) == 4 and {r["compression"] for r in records} == {"none", "topk1"}
    for r in records:
        assert len(r["curve"]) == 2 and r["curve"][-1][1] == r["upload_mb"]
    sizes = {r["compression"]: r["bytes_per_client_round"] for r in records}
    assert sizes["none"] == 4 * records[0]["params"] and sizes["topk1"] == 8  # k = 1: one value, one int32 index
    report = out.with_suffix(".md").read_text()
    assert "cheapest" in report.lower() and out.with_suffix(".png").exists()
    capsys.readouterr()
    assert comm.main(argv) == 0  # every run is stored: nothing runs again
    assert "0 to run" in capsys.readouterr().out
    assert len(read_records(out.with_suffix(".jsonl"))) == 4


def test_the_cheapest_configuration_is_within_one_point_of_uncompressed() -> None:
    def rec(c: str, acc: float, mb: float, seed: int) -> dict:
        return {"algorithm": "ditto", "compression": c, "acc": acc, "upload_mb": mb, "seed": seed}

    rows = comm.summarise([rec("none", 0.80, 100, 0), rec("none", 0.82, 100, 1), rec("float16", 0.81, 50, 0),
                           rec("float16", 0.81, 50, 1), rec("qsgd4", 0.80, 13, 0), rec("qsgd4", 0.81, 13, 1),
                           rec("topk1", 0.70, 2, 0), rec("topk1", 0.71, 2, 1)])
    cheapest = [r for r in rows if r.get("cheapest")]
    assert [r["compression"] for r in cheapest] == ["qsgd4"]  # 80.5 % ≥ 81 % − 1 point; top-k is 10 points down
    assert json.dumps(rows)  # plain values, storable


def test_upload_bytes_follow_the_compressors() -> None:
    d = 68270  # the paper's MLP 784-80-60-10
    assert comm.upload_bytes("none", d) == 4 * d and comm.upload_bytes("float16", d) == 2 * d
    assert comm.upload_bytes("qsgd8", d) == 4 * 134 + d and comm.upload_bytes("qsgd4", d) == 4 * 134 + d // 2
    assert comm.upload_bytes("topk1", d) == 683 * 8
