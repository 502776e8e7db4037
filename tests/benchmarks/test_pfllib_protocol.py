"""benchmarks/pfllib_protocol.py: the phase configs, the epoch fallback, the --quick run, its records, resume
and report, the budgeted order, and a run cut at its budget's deadline that resumes from its checkpoint."""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback

from benchmarks import pfllib_protocol as pp
from benchmarks.harness import REPO, read_records


def test_the_stop_phase_validates_with_early_stopping_and_the_final_phase_tests() -> None:
    settings = pp.Settings()
    stop = pp.run_config("FedAvg", "dir", "stop", 2000, settings)
    final = pp.run_config("FedAvg", "dir", "final", 137, settings)
    assert stop["data"]["validation_fraction"] == 0.2 and final["data"]["validation_fraction"] == 0.0
    assert stop["data"]["eval_every"] == final["data"]["eval_every"] == 1
    assert stop["data"]["partition"] == "dirichlet_min_size" and stop["data"]["dirichlet_alpha"] == 0.1
    (callback,) = stop["trainer"]["callbacks"]
    assert callback["class_path"].endswith("EarlyStopping")
    assert callback["init_args"] == {"monitor": "val/acc_weighted", "mode": "max", "min_delta": 0.001, "patience": 20}
    assert "callbacks" not in final["trainer"] and final["trainer"]["max_steps"] == 137
    algorithm = final["model"]["algorithm"]
    assert (algorithm["local_epochs"], algorithm["batch_size"], algorithm["local_lr"], algorithm["drop_last"]) == (
        1, 10, 0.005, True)
    assert pp.run_config("FedAvg", "pat", "final", 137, settings)["data"]["partition"] == "pathological"


def test_an_algorithm_refusing_local_epochs_runs_the_median_clients_epoch_of_steps(monkeypatch) -> None:
    monkeypatch.setattr(pp, "_train_counts", lambda split, phase, settings: [35, 20, 99, 400, 61])
    settings = pp.Settings()
    for label in ("FedAvg", "Ditto", "Per-FedAvg"):  # every built-in algorithm takes local epochs now
        assert pp.local_work(label, "pat", "final", settings) == ({"local_epochs": 1}, "1 epoch")
    from lightning_fedmeta.algorithms.ditto import Ditto
    from lightning_fedmeta.algorithms.perfedavg import PerFedAvg

    def refuse(self) -> None:  # as a plugin algorithm that cannot count epochs
        raise ValueError("this algorithm refuses local_epochs")

    monkeypatch.setattr(Ditto, "check_epoch_plans", refuse)
    monkeypatch.setattr(PerFedAvg, "check_epoch_plans", refuse)
    work, label = pp.local_work("Ditto", "pat", "final", settings)
    assert work == {"local_steps": 6, "personal_steps": 6} and "local_epochs refused" in label  # ⌊61/10⌋
    work, _ = pp.local_work("Per-FedAvg", "pat", "final", settings)
    assert work == {"local_steps": 3}  # two batches of 10 a step, PFLlib's loader of 20: ⌊61/20⌋
    config = pp.run_config("Ditto", "pat", "final", 5, settings, work={"local_steps": 6})
    assert "local_epochs" not in config["model"]["algorithm"] and config["model"]["algorithm"]["local_steps"] == 6


def test_summary_takes_the_finals_of_the_stop_rounds_and_cites_pfllib() -> None:
    def rec(phase: str, seed: int, rounds: int, acc: float, max_rounds: int = 2000) -> dict:
        return {"algorithm": "FedAvg", "split": "pat", "phase": phase, "seed": seed, "rounds": rounds, "acc": acc,
                "best_acc": acc + 0.01, "client_std": 0.1, "max_rounds": max_rounds, "local_work": "1 epoch"}

    records = [rec("stop", 0, 40, 0.7), rec("final", 0, 40, 0.80, 40), rec("final", 1, 40, 0.82, 40),
               rec("final", 2, 30, 0.99, 30)]  # seed 2 ran an older stop's rounds: not counted
    (row,) = pp.summarise(records, ["FedAvg"], "pat")
    assert row["seeds"] == [0, 1] and row["acc"][0] == pytest.approx(0.81)
    assert row["best_acc"][0] == pytest.approx(0.82) and row["published"] == "80.41 ± 0.08"


@pytest.mark.spawns
def test_quick_run_writes_records_and_report_and_resumes(tmp_path: Path, capsys) -> None:
    out = tmp_path / "pfllib"
    argv = ["--quick", "--only", "FedAvg", "--out", str(out)]
    assert pp.main(argv) == 0
    records = read_records(out.with_suffix(".jsonl"))
    assert [(r["phase"], r["seed"]) for r in records] == [("stop", 0), ("final", 0)]
    stop, final = records
    assert stop["eval_split"] == "validation" and final["eval_split"] == "test"
    assert stop["rounds"] == 2 < stop["max_rounds"] == 3  # the quick stop rule (patience 1, min_delta 1) fired
    assert final["max_rounds"] == final["rounds"] == 2 and len(final["curve"]) == 2
    assert final["best_label"] == "best round (chosen on test data)" and 0 <= final["acc"] <= 1
    report = out.with_suffix(".md").read_text()
    assert "| FedAvg | 1 epoch | 2 (val" in report and "80.41 ± 0.08" in report and out.with_suffix(".png").exists()
    capsys.readouterr()
    assert pp.main(argv) == 0  # every run is stored: nothing runs again
    assert "0 to run" in capsys.readouterr().out and len(read_records(out.with_suffix(".jsonl"))) == 2


def test_the_cost_paragraph_quotes_the_measured_round_and_the_recorded_runs(tmp_path: Path) -> None:
    settings = pp.Settings(records=tmp_path / "pp.jsonl")
    (tmp_path / "pp_timing.json").write_text('{"text": "One FedAvg round took 190 s at load 9."}')
    records = [{"wall_s": 300.0, "rounds": 3}, {"wall_s": 50.0, "rounds": 1}, {"error": "boom", "wall_s": 9.0}]
    text = "\n".join(pp._timing_lines(records, settings))
    assert "One FedAvg round took 190 s at load 9." in text and "Recorded runs: 2" in text
    assert "median 75 s per round" in text  # the median of 100 and 50 s per round


class HangAtRound(Callback):
    """Loaded by ``fedmeta fit`` from a test's config: with ``FEDMETA_TEST_HANG_AT_ROUND=R`` in the environment it
    writes the file ``FEDMETA_TEST_HANG_MARKER`` and sleeps at the start of round ``R`` (after the checkpoints of
    the rounds before), so the budget's deadline comes while the run is in progress; without it, it does nothing
    (the same config runs through)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        at = os.environ.get("FEDMETA_TEST_HANG_AT_ROUND")
        if at and trainer.global_step + 1 == int(at):
            Path(os.environ["FEDMETA_TEST_HANG_MARKER"]).touch()
            time.sleep(600)


def test_the_budget_runs_the_issue_order_dir_first_then_pat_then_the_rest() -> None:
    cells = pp.budget_plan(["FedBN", "Ditto", "FedAvg", "FedDBE"], ["pat", "dir"])
    assert cells == [("FedAvg", "dir"), ("Ditto", "dir"), ("FedDBE", "dir"), ("FedAvg", "pat"), ("Ditto", "pat"),
                     ("FedDBE", "pat"), ("FedBN", "dir"), ("FedBN", "pat")]
    assert pp.budget_plan(list(pp.SPECS), ["dir", "pat"])[:8] == [(label, "dir") for label in pp.FIRST]


def test_checkpoints_over_16_mib_travel_in_pieces_and_join_back(tmp_path: Path) -> None:
    big, small = tmp_path / "Ditto_dir_stop_s0_abc-r5.ckpt", tmp_path / "FedAvg_dir_stop_s0_abc-r5.ckpt"
    payload = os.urandom(2500)
    big.write_bytes(payload)
    small.write_bytes(b"x" * 10)
    pieces = pp.split_checkpoints(tmp_path, part_bytes=1000)
    assert [p.name for p in pieces] == [big.name + f".part0{i}" for i in range(3)] and not big.exists()
    assert small.exists()  # small enough to travel whole
    assert pp.join_checkpoints(tmp_path) == [big] and big.read_bytes() == payload
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([big.name, small.name])


@pytest.mark.spawns
def test_a_budgeted_run_cut_at_its_deadline_resumes_to_the_uncut_record(tmp_path: Path, monkeypatch,
                                                                        capsys) -> None:
    hang = (("callbacks", [{"class_path": f"{__name__}.HangAtRound"}]),)
    quick = pp._settings
    # the stop phase alone (no finals), with the hanging callback in every run's config (same keys in all three)
    monkeypatch.setattr(pp, "_settings", lambda args: replace(quick(args), seeds=(), trainer=hang))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    ref, cut, state = tmp_path / "ref", tmp_path / "cut", tmp_path / "state"
    base = ["--quick", "--only", "FedAvg", "--ckpt-every", "1"]
    assert pp.main([*base, "--out", str(ref)]) == 0
    (reference,) = read_records(ref.with_suffix(".jsonl"))
    assert reference["rounds"] == 2 and reference["resumed_from_round"] == 0

    # the run hangs in round 2, and the budget's clock jumps past any deadline once it does: the deadline ends it
    marker = tmp_path / "hanging"
    monkeypatch.setenv("FEDMETA_TEST_HANG_AT_ROUND", "2")
    monkeypatch.setenv("FEDMETA_TEST_HANG_MARKER", str(marker))
    monkeypatch.setattr(pp, "CLOCK", lambda: math.inf if marker.exists() else time.monotonic())
    argv = [*base, "--out", str(cut), "--state-dir", str(state), "--min-start-s", "0"]
    capsys.readouterr()
    assert pp.main([*argv, "--budget-minutes", "10"]) == 0
    printed = capsys.readouterr().out
    assert "stopped at the budget's deadline" in printed and "Remaining: 1 runs (FedAvg pat stop)" in printed
    assert read_records(cut.with_suffix(".jsonl")) == []  # nothing recorded for a run that did not finish
    (ckpt,) = state.iterdir()
    assert ckpt.name.startswith("FedAvg_pat_stop_s0_") and ckpt.name.endswith("-r1.ckpt")
    assert "Remaining: 1 runs" in cut.with_suffix(".md").read_text()

    monkeypatch.delenv("FEDMETA_TEST_HANG_AT_ROUND")
    marker.unlink()
    assert pp.main([*argv, "--budget-minutes", "10"]) == 0
    assert "resuming at round 1" in capsys.readouterr().out
    (resumed,) = read_records(cut.with_suffix(".jsonl"))
    assert resumed["resumed_from_round"] == 1 and resumed["key"] == reference["key"]
    for field in ("rounds", "acc", "best_acc", "best_round", "client_std", "curve", "eval_split"):
        assert resumed[field] == reference[field], field  # bit for bit: the same floats
    assert list(state.iterdir()) == []  # recorded: its checkpoint is gone
