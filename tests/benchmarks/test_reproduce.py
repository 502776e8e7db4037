"""benchmarks/reproduce.py: the Per-FedAvg paper grid driver (issue 14).

One tiny cell runs end to end through the driver (2 rounds, one seed, a tmp results folder), and the
stored record and the report are checked against the run's own ``fedmeta_history.json`` and against
closed-form values; the committed configs must equal the generator's output; the summary's mean ±
std over seeds is checked on hand-made records.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

import pytest
import yaml

from benchmarks import reproduce as rp
from benchmarks.harness import REPO, final_metrics, sha256_text
from lightning_fedmeta.data import DEFAULT_FASHION_MNIST_ROOT, has_dataset_files

HAS_FASHION_MNIST = has_dataset_files("fashion_mnist", DEFAULT_FASHION_MNIST_ROOT)


def test_committed_configs_equal_the_generator_and_the_paper_setting() -> None:
    cells = rp.grid()
    assert len(cells) == 4 * 2 * 2  # 4 methods × τ ∈ {4, 10} × α ∈ {0.001, 0.01}
    for method, tau, alpha in cells:
        path = REPO / rp.config_path(method, tau, alpha)
        assert path.read_text() == rp.render_config(method, tau, alpha), f"{path}: run --write-configs"
        doc = yaml.safe_load(path.read_text())
        algo, model, data = doc["model"]["algorithm"], doc["model"], doc["data"]
        assert algo["local_steps"] == tau and algo["batch_size"] == 40
        assert algo["finetune_steps"] == 1 and algo["finetune_lr"] == alpha and algo["finetune_batch_size"] == 40
        assert model["clients_per_round"] == 10 and model["holdout_clients"] == 5
        assert model["aggregation"] == "uniform"
        assert model["model"]["init_args"] == {"in_features": 784, "hidden": [80, 60], "num_classes": 10,
                                               "activation": "elu"}
        assert data == {"dataset": "fashion_mnist", "partition": "perfedavg_paper", "num_clients": 50,
                        "eval_every": 10, "data_seed": 0}
        assert doc["trainer"]["max_steps"] == 1000
        if method == "fedavg_ft":
            assert algo["name"] == "fedavg" and algo["local_lr"] == alpha
        else:
            assert algo["name"] == "perfedavg" and algo["alpha"] == alpha and algo["beta"] == 0.001
            assert algo["variant"] == method.removeprefix("perfedavg_")


def test_grad_evals_per_cell() -> None:
    # τ for FedAvg, 2τ for FO, 4τ for HF and exact (benchmarks/accuracy.py)
    rows = rp.summarise([], 1000, [0], "fashion_mnist")
    got = {(r["method"], r["tau"]): r["grad_evals_per_client_round"] for r in rows}
    for tau in (4, 10):
        assert got[("fedavg_ft", tau)] == tau
        assert got[("perfedavg_fo", tau)] == 2 * tau
        assert got[("perfedavg_hf", tau)] == 4 * tau
        assert got[("perfedavg_exact", tau)] == 4 * tau
    assert all(r["acc_weighted_mean"] is None and r["seeds_done"] == 0 for r in rows)


def _record(method: str, tau: int, alpha: float, seed: int, acc: float, **kw: object) -> dict:
    rec = {"method": method, "tau": tau, "alpha": alpha, "seed": seed, "rounds": 1000, "dataset": "fashion_mnist",
           "root": None, "config_sha256": sha256_text(rp.render_config(method, tau, alpha)), "acc_weighted": acc,
           "acc_worst10": acc / 2, "new_acc_weighted": acc - 0.1, "best_acc_weighted": acc + 0.01,
           "best_round": 990, "wall_s": 100.0 + seed}
    rec.update(kw)
    return rec


def test_summarise_mean_and_sample_std_over_seeds_ignoring_other_runs() -> None:
    recs = [
        _record("perfedavg_hf", 10, 0.001, 0, 0.80),
        _record("perfedavg_hf", 10, 0.001, 1, 0.84),
        _record("perfedavg_hf", 10, 0.001, 2, 0.88),
        _record("perfedavg_hf", 10, 0.001, 2, 0.10, rounds=3),  # another round count
        _record("perfedavg_hf", 10, 0.001, 1, 0.10, error="boom"),  # a failure
        _record("perfedavg_hf", 10, 0.001, 0, 0.10, config_sha256="stale"),  # an older config text
        _record("perfedavg_hf", 10, 0.001, 7, 0.10),  # a seed not asked for
        _record("fedavg_ft", 4, 0.01, 1, 0.50),
    ]
    rows = {(r["method"], r["tau"], r["alpha"]): r for r in rp.summarise(recs, 1000, [0, 1, 2], "fashion_mnist")}
    hf = rows[("perfedavg_hf", 10, 0.001)]
    assert hf["seeds_done"] == 3
    assert hf["acc_weighted_mean"] == pytest.approx(0.84)
    assert hf["acc_weighted_std"] == pytest.approx(0.04)  # sample std of 0.80, 0.84, 0.88
    assert hf["acc_worst10_mean"] == pytest.approx(0.42) and hf["acc_worst10_std"] == pytest.approx(0.02)
    assert hf["new_acc_weighted_mean"] == pytest.approx(0.74)
    assert hf["wall_s_mean"] == pytest.approx(101.0)
    assert hf["published_mnist"] == 89.35  # issue 14's quoted re-implementation value
    fa = rows[("fedavg_ft", 4, 0.01)]
    assert fa["seeds_done"] == 1 and fa["acc_weighted_mean"] == 0.50 and fa["acc_weighted_std"] is None
    assert rows[("perfedavg_fo", 4, 0.001)]["acc_weighted_mean"] is None


def test_bad_options_name_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        rp.main(["--dataset", "mnist"])
    assert "--root" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rp.main(["--cells", "tau3_alpha0.5"])
    assert "--cells" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_FASHION_MNIST, reason="Fashion-MNIST files not installed (dataset-fashion-mnist)")
@pytest.mark.spawns
def test_one_tiny_cell_end_to_end_and_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res, rep, runs = tmp_path / "res", tmp_path / "rep", tmp_path / "runs"
    argv = ["--rounds", "2", "--seeds", "1", "--cells", "tau4_alpha0.01", "--methods", "fedavg_ft", "--jobs", "1",
            "--threads", "1", "--results", str(res), "--report-dir", str(rep), "--runs", str(runs)]
    assert rp.main(argv) == 0
    lines = (res / "runs_fashion_mnist_2rounds.jsonl").read_text().splitlines()
    assert len(lines) == 1
    rec = json.loads(lines[0])
    assert "error" not in rec
    assert (rec["method"], rec["tau"], rec["alpha"], rec["seed"], rec["rounds"]) == ("fedavg_ft", 4, 0.01, 1, 2)
    assert rec["eval_round"] == 2 and rec["grad_evals_per_client_round"] == 4
    assert rec["wall_s"] > 0

    # the numbers are those `fedmeta fit` wrote, and the seed reached split, init and sampling
    (log_dir,) = [p.parent for p in (runs / "fashion_mnist_2rounds").glob("**/fedmeta_history.json")]
    hist = json.loads((log_dir / "fedmeta_history.json").read_text())
    last = [h for h in hist["history"] if h["stage"] == "val"][-1]["metrics"]
    assert rec["acc_weighted"] == last["val/acc_weighted"]
    assert rec["new_acc_weighted"] == last["val/new/acc_weighted"]
    cfg = yaml.safe_load((log_dir / "config.yaml").read_text())
    assert cfg["seed_everything"] == 1 and cfg["data"]["data_seed"] == 1 and cfg["model"]["seed"] == 1
    assert cfg["trainer"]["max_steps"] == 2

    # per-client values: 50 clients, 5 new; closed-form mean and worst decile of the 45 training clients
    pc, new = rec["per_client_acc"], rec["is_new_client"]
    assert len(pc) == 50 and sum(new) == 5
    train = sorted(v for v, n in zip(pc, new, strict=True) if not n)
    assert rec["acc_mean"] == pytest.approx(statistics.fmean(train), abs=1e-6)
    assert rec["acc_worst10"] == pytest.approx(statistics.fmean(train[: math.ceil(45 / 10)]), abs=1e-6)
    assert rec["curve"][-1][:2] == [2, rec["acc_weighted"]]

    # the report: the finished cell with its numbers, every other cell missing
    with (rep / "reproduction_2rounds.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 16
    done = [r for r in rows if r["seeds_done"] == "1"]
    assert len(done) == 1 and (done[0]["method"], done[0]["tau"], done[0]["alpha"]) == ("fedavg_ft", "4", "0.01")
    assert float(done[0]["acc_weighted_mean"]) == pytest.approx(rec["acc_weighted"])
    assert done[0]["acc_weighted_std"] == ""
    assert all(r["acc_weighted_mean"] == "" for r in rows if r is not done[0])
    md = (rep / "reproduction_2rounds.md").read_text()
    assert "Runs finished: 1 of 16" in md
    assert f"{100 * rec['acc_weighted']:.2f} (1 seed)" in md
    assert md.count("| missing |") >= 15
    for name in ("curves", "heatmap", "per_client"):
        assert (res / f"reproduction_2rounds_{name}.png").stat().st_size > 0

    # a re-run skips the finished run
    capsys.readouterr()
    assert rp.main(argv) == 0
    assert "1 of 1 runs already done; 0 to run" in capsys.readouterr().out
    assert len((res / "runs_fashion_mnist_2rounds.jsonl").read_text().splitlines()) == 1


def test_record_reads_the_history_final_and_best_round() -> None:
    def val(r: int, acc: float) -> dict:
        return {"round": r, "stage": "val", "metrics": {"val/acc_weighted": acc, "val/acc_mean": acc - 0.01,
                                                         "val/acc_worst10": acc / 2, "val/new/acc_weighted": 0.3}}

    doc = {"history": [val(10, 0.5), val(20, 0.7), val(30, 0.6)],
           "per_client": {"acc": [0.1, 0.9]}, "is_new_client": [False, True], "per_client_round": 30}
    rec = final_metrics(doc, 30)
    assert (rec["eval_round"], rec["acc_weighted"], rec["acc_worst10"], rec["new_acc_weighted"]) == (30, 0.6, 0.3, 0.3)
    assert (rec["best_round"], rec["best_acc_weighted"]) == (20, 0.7)
    assert rec["per_client_acc"] == [0.1, 0.9] and rec["is_new_client"] == [False, True]
    assert [c[:2] for c in rec["curve"]] == [[10, 0.5], [20, 0.7], [30, 0.6]]
    assert "not the final round 40" in final_metrics(doc, 40)["error"]
    assert final_metrics({"history": []}, 30) == {"error": "no validation in the history"}


def test_paired_differences_are_per_seed() -> None:
    recs = [
        _record("perfedavg_fo", 4, 0.01, 0, 0.70), _record("fedavg_ft", 4, 0.01, 0, 0.60),
        _record("perfedavg_fo", 4, 0.01, 1, 0.80), _record("fedavg_ft", 4, 0.01, 1, 0.76),
        _record("perfedavg_fo", 4, 0.01, 2, 0.90),  # no FedAvg + FT partner for seed 2
    ]
    rows = rp.summarise(recs, 1000, [0, 1, 2], "fashion_mnist")
    diffs = {(d["method"], d["tau"], d["alpha"]): d for d in rp.paired_differences(rows)}
    d = diffs[("perfedavg_fo", 4, 0.01)]
    assert d["seeds"] == [0, 1]
    assert d["diff_mean"] == pytest.approx(0.07)  # (0.10 + 0.04) / 2
    assert d["diff_std"] == pytest.approx(math.sqrt(2 * 0.03**2))  # sample std of 0.10, 0.04
    assert diffs[("perfedavg_hf", 4, 0.01)]["diff_mean"] is None
    assert len(diffs) == 3 * 4  # three Per-FedAvg variants × four cells
    assert "| Per-FedAvg (FO) | 4 | 0.01 | 2 | +7.00 ± 4.24 |" in rp._paired_lines(rows)
