"""benchmarks/gpu.py runs on the CPU with its CUDA parts skipped: a smoke run of the speed section on tiny work,
the plain loop against a hand count, and the report's flags."""

from __future__ import annotations

import json

import torch
from torch import nn

from benchmarks import gpu


def test_the_speed_section_runs_on_the_cpu_and_writes_its_report(tmp_path) -> None:
    res = gpu.main(["--device", "cpu", "--quick", "--sections", "speed", "--workloads", "W", "CNN",
                    "--out", str(tmp_path)])
    rows = res["speed"]
    assert [(r["workload"], r["clients_per_round"]) for r in rows] == [("W", 2), ("W", 3), ("CNN", 2), ("CNN", 3)]
    for r in rows:
        assert "error" not in r, r.get("traceback")
        assert r["project"]["s_per_round"] > 0 and r["plain_loop"]["s_per_round"] > 0
        assert "peak_memory_gib" not in r["project"]  # CUDA only
    assert rows[1]["plain_loop"]["scaled"] and rows[1]["plain_loop"]["timed_clients"] == 2  # --quick loop cap
    saved = json.loads((tmp_path / "gpu.json").read_text())
    assert saved["failures"] == [] and "speed" in saved and "equivalence" not in saved
    report = (tmp_path / "gpu.md").read_text()
    assert "| CNN | 3 |" in report and "(scaled from 2)" in report and "- none" in report


def test_the_plain_loop_round_is_fedavg_by_hand() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    xs, ys = torch.randn(2, 5, 3), torch.randint(0, 2, (2, 5))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    gpu.plain_loop_round(model, xs, ys, clients=2, steps=1, batch=5, lr=0.5, generator=torch.Generator())
    expected = {k: torch.zeros_like(v) for k, v in start.items()}
    for c in range(2):  # one full-batch step per client (batch = all 5 rows, order irrelevant), then the mean
        local = nn.Linear(3, 2)
        local.load_state_dict(start)
        nn.functional.cross_entropy(local(xs[c]), ys[c]).backward()
        for k, p in local.named_parameters():
            expected[k] += (p.detach() - 0.5 * p.grad) / 2
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, expected[k])


def test_failures_are_collected_from_every_section() -> None:
    res = {"equivalence": [{"algorithm": "FedAvg", "flag": True}],
           "precision": [{"algorithm": "Ditto", "precision": "16-mixed", "finite": False}],
           "speed": [{"workload": "CNN", "clients_per_round": 10, "error": "OutOfMemoryError"}]}
    failures = gpu.collect_failures(res)
    assert len(failures) == 3 and "16-mixed" in failures[1] and "OutOfMemoryError" in failures[2]


def test_a_row_runs_in_a_fresh_process_as_on_the_gpu() -> None:
    """On CUDA each speed row runs in a spawned process (an out-of-memory attempt leaves nothing behind): the same
    numbers as in process, on the CPU."""
    data = gpu.RandomImages(2, (1, 28, 28), 10, train=12)
    isolated = gpu.project_row("cpu", "W", True, 2, 2, data, isolate=True)
    in_process = gpu.project_row("cpu", "W", True, 2, 2, data, isolate=False)
    assert isolated["client_chunk_size"] == gpu.CHUNK_SIZES[0]
    assert isolated["final_loss"] == in_process["final_loss"]  # same seed, same data: the same run


def test_every_algorithm_script_compares_loop_and_vmap_and_lists_what_the_budget_left(tmp_path) -> None:
    """benchmarks/gpu_algorithms.py on the CPU: the newest algorithms first, a row per algorithm with the loop/vmap
    differences (tiny, unflagged) and the held-out clients scored; a spent budget lists the rest as not run."""
    from benchmarks import gpu_algorithms as ga

    res = ga.main(["--device", "cpu", "--rounds", "1", "--algorithms", "fedavg", "fedpac", "--out", str(tmp_path)])
    assert [r["algorithm"] for r in res["rows"]] == ["fedpac", "fedavg"] and not res["not_run"]
    for row in res["rows"]:
        assert not row["flag"] and row["params"]["rel"] < ga.REL_TOL and row["params"]["keys"] > 0
        assert any(k.startswith("val/") and "new" in k for k in row["val_keys"]), row["val_keys"]
    assert "| fedpac |" in (tmp_path / "gpu_algorithms.md").read_text()
    torch.manual_seed(12345)  # whatever ran before: a row's model does not depend on it
    alone = ga.main(["--device", "cpu", "--rounds", "1", "--algorithms", "fedavg", "--out", str(tmp_path / "a")])
    assert alone["rows"][0]["val"] == res["rows"][1]["val"] and alone["rows"][0]["val_acc"] == res["rows"][1]["val_acc"]
    spent = ga.main(["--device", "cpu", "--budget", "-1", "--algorithms", "fedavg", "--out", str(tmp_path / "b")])
    assert spent["rows"] == [] and spent["not_run"] == ["fedavg"]
    assert "Not run" in (tmp_path / "b" / "gpu_algorithms.md").read_text()
