"""PlotCallback's files, the plotting functions and ``fedmeta compare``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.cli import FedMetaConfigError, main, run
from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.frontends.callbacks import HISTORY_FILE, PlotCallback, RoundProgressBar, read_history
from lightning_fedmeta.frontends.compare import (
    CompareError,
    available_metrics,
    compare_main,
    load_run,
    markdown_table,
    summarize_run,
)
from lightning_fedmeta.frontends.plots import (
    metric_file_names,
    metric_series,
    plot_accuracy_vs_round,
    plot_client_accuracy_hist,
    plot_client_metric_hist,
    plot_compare,
    plot_metric_vs_round,
    worst_decile_mean,
)
from tests.helpers import make_trainer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# the head of `fedmeta compare`'s table of groups (issue 31: a row per group of seeds, mean ± std)
# (issue 26: the best round's value is labelled with the split it was chosen on, and its round follows it)
GROUP_HEAD = ("| group | runs | seeds | final weighted acc | final worst decile | "
              "best round (split not recorded): weighted acc | best round | rounds |")
# runs written by a fit on the clients' test sets record the spread over clients and their split
FIT_HEAD = ("| group | runs | seeds | final weighted acc | final worst decile | final std over clients | "
            "best round (chosen on test data): weighted acc | best round | rounds |")
CORE = ("final_acc_weighted", "final_acc_worst10", "best_acc_weighted", "rounds")


def _core(summary: dict, metric: str = "acc") -> dict:
    """The final, worst-decile, best and last-round values of a run summary (the keys before issue 26)."""
    return {k.replace("acc", metric): summary[k.replace("acc", metric)] for k in CORE}


def _history(values: list[tuple[int, float, float]], stage: str = "val") -> list[dict]:
    return [{"round": r, "stage": stage, "metrics": {f"{stage}/acc_weighted": w, f"{stage}/acc_worst10": q}}
            for r, w, q in values]


def _is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000


def _fit(root: Path, local_lr: float, holdout: int = 0) -> tuple[L.Trainer, FederatedModule]:
    dm = FederatedDataModule(dataset="synthetic", num_clients=10, eval_every=2)
    module = FederatedModule(algorithm={"name": "fedavg", "local_lr": local_lr, "local_steps": 3},
                             clients_per_round=3, holdout_clients=holdout)
    trainer = make_trainer(4, default_root_dir=str(root), callbacks=[PlotCallback()])
    trainer.fit(module, dm)
    return trainer, module


def test_metric_series_is_sorted_keeps_last_value_and_skips_missing_or_nan() -> None:
    hist = _history([(4, 0.5, 0.1), (2, 0.3, 0.0), (4, 0.6, 0.2)]) + [
        {"round": 6, "stage": "val", "metrics": {"val/acc_weighted": math.nan}},
        {"round": 8, "stage": "val", "metrics": {}},
    ]
    assert metric_series(hist, "val/acc_weighted") == ([2, 4], [0.3, 0.6])


def test_plot_functions_write_pngs(tmp_path: Path) -> None:
    hist = _history([(2, 0.3, 0.1), (4, 0.5, 0.2)]) + _history([(4, 0.55, 0.25)], stage="test")
    assert _is_png(plot_accuracy_vs_round(hist, tmp_path / "a.png"))
    assert _is_png(plot_client_accuracy_hist([0.2, 0.9, 1.0, 0.5], tmp_path / "h.png", [False, False, True, False], 4))
    assert _is_png(plot_compare({"x": hist, "y": _history([(2, 0.1, 0.0)])}, tmp_path / "c.png"))


def test_client_histogram_rejects_a_mask_of_the_wrong_length(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is_new has 2 entries but accuracy has 3"):
        plot_client_accuracy_hist([0.1, 0.2, 0.3], tmp_path / "h.png", [True, False])


def test_plot_callback_writes_history_and_both_pictures_after_fit(tmp_path: Path) -> None:
    trainer, module = _fit(tmp_path, 0.05, holdout=2)
    out = Path(trainer.log_dir or trainer.default_root_dir)
    assert _is_png(out / "accuracy_vs_round.png") and _is_png(out / "client_accuracy_hist.png")
    doc = read_history(out / HISTORY_FILE)
    assert [(h["round"], h["stage"]) for h in doc["history"]] == [(2, "val"), (4, "val")]
    last = doc["history"][-1]["metrics"]
    assert last["val/acc_weighted"] == pytest.approx(float(module.last_summary["clients"]["acc_weighted"]))
    assert "val/new/acc_weighted" in last  # held-out clients are recorded separately
    assert len(doc["per_client_accuracy"]) == 10 and sum(doc["is_new_client"]) == 2
    assert doc["per_client_round"] == 4
    # version 2: the primary metric (accuracy by default for classification) and all per-client values
    assert doc["version"] == 2 and doc["primary_metric"] == "acc" and doc["higher_is_better"] is True
    assert doc["per_client"]["acc"] == doc["per_client_accuracy"]


def test_plot_callback_history_survives_its_state_dict() -> None:
    cb = PlotCallback()
    cb.history = _history([(2, 0.3, 0.1)])
    restored = PlotCallback()
    restored.load_state_dict(cb.state_dict())
    assert restored.history == cb.history


def test_compare_two_runs_prints_table_and_writes_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fit(tmp_path / "slow", 0.01)
    _fit(tmp_path / "fast", 0.1)
    capsys.readouterr()
    run(["compare", str(tmp_path / "slow"), str(tmp_path / "fast"), "--out", str(tmp_path / "cmp")])
    printed = capsys.readouterr().out
    assert _is_png(tmp_path / "cmp" / "compare.png")
    lines = [ln for ln in printed.splitlines() if ln.startswith("| ")]
    assert lines[0] == FIT_HEAD
    for name in ("slow", "fast"):  # no config file next to these histories: one group per run, named by folder
        hist = read_history(tmp_path / name / HISTORY_FILE)["history"]
        final = hist[-1]["metrics"]
        row = next(ln for ln in lines if ln.startswith(f"| {name} |"))
        best = max(hist, key=lambda h: h["metrics"]["val/acc_weighted"])
        assert row == (f"| {name} | 1 | ? | {final['val/acc_weighted']:.4f} | {final['val/acc_worst10']:.4f} | "
                       f"{final['val/acc_std']:.4f} | {best['metrics']['val/acc_weighted']:.4f} | "
                       f"{best['round']} | 4 |")


def test_compare_reads_csv_logger_files_with_lightning_step_convention(tmp_path: Path) -> None:
    run_dir = tmp_path / "csvrun" / "version_0"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.csv").write_text(
        "epoch,step,train/loss,val/acc_weighted,val/acc_worst10,test/acc_weighted\n"
        "0,0,2.0,,,\n0,1,1.5,,,\n0,1,,0.40,0.10,\n1,3,,0.60,0.30,\n1,4,,,,0.65\n"
    )
    hist = load_run(tmp_path / "csvrun")
    assert [(h["round"], h["stage"]) for h in hist] == [(2, "val"), (4, "val"), (4, "test")]
    assert _core(summarize_run(hist)) == {"final_acc_weighted": 0.6, "final_acc_worst10": 0.3,
                                          "best_acc_weighted": 0.6, "rounds": 4}
    assert summarize_run(hist)["best_round"] == 4


def test_compare_explains_a_folder_without_history(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="has no fedmeta_history.json"):
        compare_main([str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="no such run folder or file"):
        compare_main([str(tmp_path / "missing")])


def test_compare_rejects_labels_that_do_not_match_the_runs(tmp_path: Path) -> None:
    (tmp_path / HISTORY_FILE).write_text(json.dumps({"version": 1, "history": _history([(2, 0.5, 0.1)])}))
    with pytest.raises(ValueError, match=r"--labels has 2 names for 1 groups \(.*\); runs that differ only"):
        compare_main([str(tmp_path), "--labels", "a", "b", "--out", str(tmp_path)])


def test_markdown_table_marks_runs_without_evaluations() -> None:
    table = markdown_table({"empty": summarize_run([])})
    assert table.splitlines()[-1] == "| empty | n/a | n/a | n/a | 0 |"


# ------------------------------------------------------------------------------------------------
# chosen metrics: a regression-like run ("mse", lower is better) and a custom classification metric
# ("f1"), with fake trainers and modules (the module's side is tested in its own files)
# ------------------------------------------------------------------------------------------------
def _metric_history(metric: str, values: list[tuple[int, float, float]], stage: str = "val") -> list[dict]:
    return [{"round": r, "stage": stage,
             "metrics": {f"{stage}/{metric}_weighted": w, f"{stage}/{metric}_worst10": q, f"{stage}/loss_weighted": w}}
            for r, w, q in values]


def _fake_module(primary: str, directions: dict[str, bool], per_client: dict[str, list[float]],
                 holdout: list[bool] | None = None) -> SimpleNamespace:
    """What PlotCallback and RoundProgressBar read from a FederatedModule with chosen metrics."""
    k = len(next(iter(per_client.values())))
    return SimpleNamespace(
        primary_metric=primary, metric_directions=directions,
        last_per_client={**{m: torch.tensor(v) for m, v in per_client.items()}, "total": torch.full((k,), 20.0)},
        is_holdout=torch.tensor(holdout if holdout is not None else [False] * k),
        data=SimpleNamespace(client_names=[f"client{i}" for i in range(k)]),
    )


def _fake_trainer(tmp_path: Path, step: int, metrics: dict[str, float]) -> SimpleNamespace:
    return SimpleNamespace(sanity_checking=False, global_step=step, fast_dev_run=False, log_dir=None,
                           default_root_dir=str(tmp_path), loggers=[], progress_bar_metrics={},
                           callback_metrics={k: torch.tensor(v) for k, v in metrics.items()})


def _record_run(out: Path, module: SimpleNamespace, history: list[dict]) -> PlotCallback:
    """Feed ``history`` to a PlotCallback as the trainer would, then end the fit (writes into ``out``)."""
    cb = PlotCallback(out)
    for rec in history:
        trainer = _fake_trainer(out, rec["round"], rec["metrics"])
        (cb.on_validation_end if rec["stage"] == "val" else cb.on_test_end)(trainer, module)  # type: ignore[arg-type]
    cb.on_fit_end(trainer, module)  # type: ignore[arg-type]
    return cb


MSE_DIRECTIONS = {"mse": False, "loss": False}
F1_DIRECTIONS = {"f1": True, "acc": True, "loss": False}


def _mse_run(out: Path, values: list[tuple[int, float, float]]) -> PlotCallback:
    module = _fake_module("mse", MSE_DIRECTIONS, {"mse": [0.1, 0.2, 3.0, 0.4, 0.5], "loss": [0.1, 0.2, 3.0, 0.4, 0.5]},
                          holdout=[False, False, False, False, True])
    return _record_run(out, module, _metric_history("mse", values))


def test_metric_file_names_keep_the_accuracy_names() -> None:
    assert metric_file_names() == ("accuracy_vs_round.png", "client_accuracy_hist.png")
    assert metric_file_names("mse") == ("mse_vs_round.png", "client_mse_hist.png")
    assert metric_file_names("f1") == ("f1_vs_round.png", "client_f1_hist.png")
    assert metric_file_names("top/1 err") == ("top_1_err_vs_round.png", "client_top_1_err_hist.png")


def test_worst_decile_follows_the_direction() -> None:
    values = [0.1, 0.9, 0.5, 0.3, 0.7, 0.2, 0.8, 0.4, 0.6, 1.0, 0.05, math.nan]  # 11 finite values: 2 worst
    assert worst_decile_mean(values) == pytest.approx((0.05 + 0.1) / 2)
    assert worst_decile_mean(values, higher_is_better=False) == pytest.approx((0.9 + 1.0) / 2)
    assert math.isnan(worst_decile_mean([math.nan]))


def test_plot_functions_draw_any_metric(tmp_path: Path) -> None:
    hist = _metric_history("mse", [(2, 4.0, 9.5), (4, 2.5, 7.0)]) + _metric_history("mse", [(4, 2.4, 6.9)], "test")
    assert _is_png(plot_metric_vs_round(hist, tmp_path / "m.png", metric="mse", higher_is_better=False))
    assert _is_png(plot_client_metric_hist([0.5, 12.0, 3.0, math.nan, 3.0], tmp_path / "h.png",
                                           [False, False, True, False, False], 4, metric="mse", higher_is_better=False))
    assert _is_png(plot_client_metric_hist([2.0, 2.0], tmp_path / "same.png", metric="mse", higher_is_better=False))
    assert _is_png(plot_compare({"x": hist}, tmp_path / "c.png", metric="mse", higher_is_better=False))
    assert plot_accuracy_vs_round is plot_metric_vs_round and plot_client_accuracy_hist is plot_client_metric_hist
    with pytest.raises(ValueError, match="is_new has 1 entries but mse has 2"):
        plot_client_metric_hist([1.0, 2.0], tmp_path / "x.png", [True], metric="mse")


def test_plot_callback_names_files_after_a_lower_is_better_metric(tmp_path: Path) -> None:
    cb = _mse_run(tmp_path, [(2, 4.0, 9.5), (4, 2.5, 7.0)])
    assert _is_png(tmp_path / "mse_vs_round.png") and _is_png(tmp_path / "client_mse_hist.png")
    assert not list(tmp_path.glob("*accuracy*"))
    raw = json.loads((tmp_path / HISTORY_FILE).read_text())
    assert raw["version"] == 2 and raw["primary_metric"] == "mse" and raw["higher_is_better"] is False
    assert raw["metric_directions"] == MSE_DIRECTIONS
    assert raw["per_client"]["mse"] == pytest.approx([0.1, 0.2, 3.0, 0.4, 0.5])
    assert set(raw["per_client"]) == {"mse", "loss"}
    assert "per_client_accuracy" not in raw  # only written for accuracy runs
    assert raw["is_new_client"] == [False, False, False, False, True] and raw["per_client_round"] == 4
    assert raw["client_names"][0] == "client0"
    assert [(h["round"], h["stage"]) for h in raw["history"]] == [(2, "val"), (4, "val")]
    assert cb.per_client_primary == raw["per_client"]["mse"] and cb.per_client_accuracy is None


def test_plot_callback_follows_a_custom_classification_metric(tmp_path: Path) -> None:
    module = _fake_module("f1", F1_DIRECTIONS, {"f1": [0.5, 0.7, 0.9], "acc": [0.6, 0.8, 0.9], "loss": [1.0, 0.5, 0.2]})
    history = _metric_history("f1", [(2, 0.6, 0.5)]) + _metric_history("f1", [(2, 0.62, 0.5)], "test")
    cb = _record_run(tmp_path, module, history)
    assert _is_png(tmp_path / "f1_vs_round.png") and _is_png(tmp_path / "client_f1_hist.png")
    assert not (tmp_path / "accuracy_vs_round.png").exists()
    doc = read_history(tmp_path / HISTORY_FILE)
    assert doc["primary_metric"] == "f1" and doc["higher_is_better"] is True
    assert set(doc["per_client"]) == {"f1", "acc", "loss"} and doc["per_client"]["f1"] == pytest.approx([0.5, 0.7, 0.9])
    assert [(h["round"], h["stage"]) for h in doc["history"]] == [(2, "val"), (2, "test")]
    restored = PlotCallback()
    restored.load_state_dict(cb.state_dict())
    assert (restored.primary_metric, restored.higher_is_better, restored.history) == ("f1", True, cb.history)


def test_plot_callback_still_reads_a_module_without_chosen_metrics(tmp_path: Path) -> None:
    old_module = SimpleNamespace(last_per_client_accuracy=torch.tensor([0.2, 0.9, 0.6]))
    _record_run(tmp_path, old_module, _history([(2, 0.5, 0.2)]))
    assert _is_png(tmp_path / "accuracy_vs_round.png") and _is_png(tmp_path / "client_accuracy_hist.png")
    doc = json.loads((tmp_path / HISTORY_FILE).read_text())
    assert doc["primary_metric"] == "acc" and doc["higher_is_better"] is True
    assert doc["per_client_accuracy"] == pytest.approx([0.2, 0.9, 0.6]) == doc["per_client"]["acc"]


def test_an_old_history_file_still_loads_and_compares(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = {"version": 1, "history": _history([(2, 0.5, 0.1), (4, 0.4, 0.2)]), "per_client_accuracy": [0.5, 0.3],
           "is_new_client": None, "client_names": None, "per_client_round": 4}
    for rec, loss in zip(old["history"], (0.9, 1.2), strict=True):
        rec["metrics"]["val/loss_weighted"] = rec["metrics"]["val/loss_worst10"] = loss
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / HISTORY_FILE).write_text(json.dumps(old))
    doc = read_history(tmp_path / "old" / HISTORY_FILE)
    assert (doc["primary_metric"], doc["higher_is_better"]) == ("acc", True)
    assert doc["per_client"] == {"acc": [0.5, 0.3]} and doc["per_client_accuracy"] == [0.5, 0.3]
    assert doc["metric_directions"] == {"acc": True, "loss": False}
    cb = PlotCallback()
    cb.load_state_dict({"history": old["history"]})  # a checkpoint of a version-1 callback
    assert (cb.primary_metric, cb.higher_is_better) == ("acc", True)

    capsys.readouterr()
    summaries = compare_main([str(tmp_path / "old"), "--out", str(tmp_path)]).summaries
    assert [_core(s) for s in summaries["old"]["per_run"]] == [{"final_acc_weighted": 0.4, "final_acc_worst10": 0.2,
                                                                "best_acc_weighted": 0.5, "rounds": 4}]
    assert GROUP_HEAD in capsys.readouterr().out
    summaries = compare_main([str(tmp_path / "old"), "--metric", "loss", "--out", str(tmp_path)]).summaries
    assert summaries["old"]["best_loss_weighted"] == 0.9  # the loss is lower-is-better: best = min


def test_summarize_run_takes_the_minimum_of_a_lower_is_better_metric() -> None:
    hist = _metric_history("mse", [(2, 4.0, 9.5), (4, 2.5, 7.0), (6, 3.0, 8.0)])
    assert _core(summarize_run(hist, metric="mse", higher_is_better=False), "mse") == {
        "final_mse_weighted": 3.0, "final_mse_worst10": 8.0, "best_mse_weighted": 2.5, "rounds": 6}
    assert summarize_run(hist, metric="mse")["best_mse_weighted"] == 4.0
    table = markdown_table({"r": summarize_run(hist, metric="mse", higher_is_better=False)}, "mse", False)
    head = "| run | final weighted mse | final worst decile | best weighted mse (min) | rounds |"
    assert table.splitlines()[0] == head
    assert table.splitlines()[-1] == "| r | 3.0000 | 8.0000 | 2.5000 | 6 |"


def _table_rows(printed: str) -> list[str]:
    return [ln for ln in printed.splitlines() if ln.startswith("| ")]


def test_compare_uses_the_stored_primary_metric_and_its_direction(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _mse_run(tmp_path / "a", [(2, 4.0, 9.5), (4, 2.5, 7.0), (6, 3.0, 8.0)])
    _mse_run(tmp_path / "b", [(2, 5.0, 9.0), (4, 4.5, 8.5)])
    capsys.readouterr()
    run(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "cmp")])
    rows = _table_rows(capsys.readouterr().out)
    assert rows[0] == ("| group | runs | seeds | final weighted mse | final worst decile | "
                       "best round (split not recorded): weighted mse (min) | best round | rounds |")
    assert rows[1:] == ["| a | 1 | ? | 3.0000 | 8.0000 | 2.5000 | 4 | 6 |",
                        "| b | 1 | ? | 4.5000 | 8.5000 | 4.5000 | 4 | 4 |"]
    assert _is_png(tmp_path / "cmp" / "compare.png")


def test_compare_metric_option_picks_the_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    module = _fake_module("f1", F1_DIRECTIONS, {"f1": [0.5, 0.7], "acc": [0.6, 0.8], "loss": [1.0, 0.5]})
    history = [{"round": r, "stage": "val", "metrics": {"val/f1_weighted": f, "val/f1_worst10": f - 0.2,
                                                        "val/acc_weighted": a, "val/acc_worst10": a - 0.3,
                                                        "val/loss_weighted": lo, "val/loss_worst10": lo + 1}}
               for r, f, a, lo in ((2, 0.50, 0.70, 1.1), (4, 0.60, 0.65, 0.8), (6, 0.55, 0.75, 0.9))]
    _record_run(tmp_path / "f1run", module, history)
    capsys.readouterr()
    expected = {
        None: ("| group | runs | seeds | final weighted f1 | final worst decile | "
               "best round (split not recorded): weighted f1 | best round | rounds |",
               "| f1run | 1 | ? | 0.5500 | 0.3500 | 0.6000 | 4 | 6 |"),
        "acc": (GROUP_HEAD, "| f1run | 1 | ? | 0.7500 | 0.4500 | 0.7500 | 6 | 6 |"),
        "loss": ("| group | runs | seeds | final weighted loss | final worst decile | "
                 "best round (split not recorded): weighted loss (min) | best round | rounds |",
                 "| f1run | 1 | ? | 0.9000 | 1.9000 | 0.8000 | 4 | 6 |"),
    }
    for metric, (head, row) in expected.items():
        extra = [] if metric is None else ["--metric", metric]
        run(["compare", str(tmp_path / "f1run"), "--out", str(tmp_path), *extra])
        rows = _table_rows(capsys.readouterr().out)
        assert (rows[0], rows[1]) == (head, row), metric
    # --mode overrides the direction
    run(["compare", str(tmp_path / "f1run"), "--metric", "acc", "--mode", "min", "--out", str(tmp_path)])
    assert _table_rows(capsys.readouterr().out)[1] == "| f1run | 1 | ? | 0.7500 | 0.4500 | 0.6500 | 4 | 6 |"


def test_compare_refuses_runs_with_different_primary_metrics(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    _mse_run(tmp_path / "reg", [(2, 4.0, 9.5)])
    (tmp_path / "cls").mkdir()
    (tmp_path / "cls" / HISTORY_FILE).write_text(json.dumps({"version": 1, "history": _history([(2, 0.5, 0.1)])}))
    dirs = [str(tmp_path / "reg"), str(tmp_path / "cls")]
    with pytest.raises(CompareError, match=r"different primary metrics \(reg: mse, cls: acc\); .*--metric NAME"):
        compare_main([*dirs, "--out", str(tmp_path)])
    with pytest.raises(FedMetaConfigError, match="different primary metrics"):
        run(["compare", *dirs, "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", *dirs, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "fedmeta: error: the runs have different primary metrics" in capsys.readouterr().err
    with pytest.raises(CompareError, match="no run logs 'val/f1_weighted'; the runs log mse, loss, acc"):
        compare_main([*dirs, "--metric", "f1", "--out", str(tmp_path)])
    # a metric both runs log can be compared
    summaries = compare_main([*dirs, "--metric", "loss", "--out", str(tmp_path)]).summaries
    assert summaries["reg"]["final_loss_weighted"] == 4.0 and math.isnan(summaries["cls"]["final_loss_weighted"])


def test_compare_reads_a_regression_csv_logger_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "csvreg" / "version_0"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.csv").write_text(
        "epoch,step,train/loss,val/loss_weighted,val/mse_weighted,val/mse_worst10\n"
        "0,0,2.0,,,\n0,1,,1.9,1.8,5.0\n1,3,,1.2,1.1,4.0\n2,5,,1.3,1.25,4.5\n"
    )
    hist = load_run(tmp_path / "csvreg")
    assert [(h["round"], h["stage"]) for h in hist] == [(2, "val"), (4, "val"), (6, "val")]
    assert available_metrics(hist) == ["loss", "mse"]
    capsys.readouterr()
    summaries = compare_main([str(tmp_path / "csvreg"), "--out", str(tmp_path)]).summaries  # the only one but loss
    assert [_core(s, "mse") for s in summaries["csvreg"]["per_run"]] == [
        {"final_mse_weighted": 1.25, "final_mse_worst10": 4.5, "best_mse_weighted": 1.1, "rounds": 6}]  # lower: best
    assert "best round (split not recorded): weighted mse (min)" in capsys.readouterr().out
    with pytest.raises(CompareError, match="no run logs 'val/acc_weighted'"):
        compare_main([str(tmp_path / "csvreg"), "--metric", "acc", "--out", str(tmp_path)])


def test_round_progress_bar_shows_the_primary_metric(tmp_path: Path) -> None:
    module = _fake_module("mse", MSE_DIRECTIONS, {"mse": [0.1], "loss": [0.1]})
    trainer = _fake_trainer(tmp_path, 4, {"val/mse_weighted": 0.25, "val/loss_weighted": 0.3})
    trainer.progress_bar_metrics = {"clients": 3.0, "train/loss": 0.5}
    shown = RoundProgressBar().get_metrics(trainer, module)  # type: ignore[arg-type]
    assert shown == {"round": 4, "clients": 3, "loss": 0.5, "val/mse_weighted": 0.25}
    old = SimpleNamespace()  # a module without chosen metrics: accuracy
    trainer.callback_metrics = {"val/acc_weighted": torch.tensor(0.75)}
    assert RoundProgressBar().get_metrics(trainer, old)["val/acc_weighted"] == 0.75  # type: ignore[arg-type]
