"""Reporting beside published tables (issue 26, item 4): the spread of per-client accuracy, the best round labelled
with the split it was chosen on, and the unseen (held-out) clients in every report."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.evaluation import format_summary
from lightning_fedmeta.evaluation.fairness import best_round, spread, spread_summary
from lightning_fedmeta.frontends.callbacks import HISTORY_FILE, PlotCallback, read_history
from lightning_fedmeta.frontends.compare import compare_main, summarize_run
from tests.helpers import make_trainer

# five clients' accuracies: sorted 0.2, 0.4, 0.5, 0.8, 1.0; mean 0.58
ACCS = [0.8, 0.2, 1.0, 0.5, 0.4]


def test_spread_is_the_population_std_and_linear_quantiles_by_hand() -> None:
    got = {k: float(v) for k, v in spread(torch.tensor(ACCS, dtype=torch.float64)).items()}
    # std: sqrt(mean of squared deviations) = sqrt((0.22² + 0.38² + 0.42² + 0.08² + 0.18²) / 5) = sqrt(0.408 / 5)
    assert got["std"] == pytest.approx(math.sqrt(0.408 / 5), abs=1e-12)
    # h = p (K − 1) = 4p over the sorted values: q10 at h = 0.4: 0.2 + 0.4·0.2 = 0.28; q25 at h = 1: 0.4;
    # q50 at h = 2: 0.5; q75 at h = 3: 0.8; q90 at h = 3.6: 0.8 + 0.6·0.2 = 0.92
    expected = {"q10": 0.28, "q25": 0.4, "q50": 0.5, "q75": 0.8, "q90": 0.92}
    assert {k: got[k] for k in expected} == pytest.approx(expected, abs=1e-12)


def test_spread_leaves_out_undefined_clients_and_is_unweighted() -> None:
    with_nan = spread(torch.tensor([*ACCS, math.nan]))
    assert float(with_nan["std"]) == pytest.approx(math.sqrt(0.408 / 5))
    assert all(math.isnan(float(v)) for v in spread(torch.tensor([math.nan])).values())
    per_client = {"acc": torch.tensor([*ACCS, 0.0, 1.0], dtype=torch.float64)}
    groups = {"clients": torch.arange(5), "new": torch.tensor([5, 6]), "honest": torch.tensor([], dtype=torch.long)}
    out = spread_summary(per_client, groups, ["acc"])
    assert set(out) == {"clients", "new"}  # an empty group is not reported
    assert float(out["new"]["acc_std"]) == pytest.approx(0.5) and float(out["new"]["acc_q50"]) == pytest.approx(0.5)


def _history(values: list[tuple[int, float]], stage: str = "val") -> list[dict]:
    return [{"round": r, "stage": stage, "metrics": {f"{stage}/acc_weighted": v, f"{stage}/acc_worst10": v / 2}}
            for r, v in values]


def test_best_round_picks_the_maximum_or_minimum_and_labels_the_split() -> None:
    hist = _history([(2, 0.5), (4, 0.7), (6, 0.7), (8, 0.6)])
    best = best_round(hist, "val/acc_weighted", True, "test")
    assert best == {"metric": "val/acc_weighted", "value": 0.7, "round": 4, "final_value": 0.6, "final_round": 8,
                    "label": "best round (chosen on test data)"}  # a tie: the earliest round
    low = best_round(hist, "val/acc_weighted", False, "validation")
    assert low is not None and (low["value"], low["round"], low["label"]) == (0.5, 2, "best round (validation)")
    assert best_round(hist, "val/f1_weighted", True, "test") is None


def _fit(root: Path, validation_fraction: float = 0.0) -> tuple[FederatedModule, PlotCallback]:
    dm = FederatedDataModule(dataset="synthetic", num_clients=10, eval_every=2,
                             validation_fraction=validation_fraction)
    module = FederatedModule(algorithm={"name": "fedavg", "local_lr": 0.05, "local_steps": 3}, clients_per_round=3,
                             holdout_clients=3)
    plots = PlotCallback()
    trainer = make_trainer(4, default_root_dir=str(root), callbacks=[plots], logger=CSVLogger(str(root)))
    trainer.fit(module, dm)
    return module, plots


def test_a_fit_logs_prints_and_records_the_spread_and_the_unseen_clients(tmp_path: Path) -> None:
    module, _ = _fit(tmp_path)
    pc, holdout = module.last_per_client["acc"], module.engine.federation.holdout
    training = module.engine.federation.eligible
    summary = module.last_summary
    for group, idx in (("clients", training), ("new", holdout)):  # the spread is over each group's own clients
        expected = spread(pc[idx])
        assert {k: float(v) for k, v in summary["_spread"][group].items()} == {
            f"acc_{k}": pytest.approx(float(v)) for k, v in expected.items()}
    table = format_summary(summary, 4)
    assert "\nnew " in table and "Spread over clients (unweighted" in table
    assert f"{float(summary['_spread']['new']['acc_q90']):.4f}" in table.splitlines()[-1]
    doc = read_history(next(tmp_path.rglob(HISTORY_FILE)))
    last = doc["history"][-1]["metrics"]
    assert last["val/acc_std"] == pytest.approx(float(spread(pc[training])["std"]))
    assert last["val/new/acc_q25"] == pytest.approx(float(spread(pc[holdout])["q25"]))
    assert "val/new/acc_weighted" in last  # the unseen clients' accuracy beside the training clients'
    assert doc["eval_split"] == "test" and doc["best"]["val"]["label"] == "best round (chosen on test data)"
    values = {h["round"]: h["metrics"]["val/acc_weighted"] for h in doc["history"]}
    assert doc["best"]["val"]["value"] == max(values.values()) and doc["best"]["val"]["final_round"] == 4
    # logged to the loggers beside Lightning's own values (same step), kept out of callback_metrics
    assert "val/acc_std" not in module.trainer.callback_metrics
    csv_text = next(tmp_path.rglob("metrics.csv")).read_text()
    assert "val/acc_q90" in csv_text.splitlines()[0] and "val/new/acc_std" in csv_text.splitlines()[0]


def test_compare_reports_spread_unseen_clients_and_the_labelled_best_round(tmp_path: Path) -> None:
    _fit(tmp_path / "val_run", validation_fraction=0.2)
    doc = read_history(next((tmp_path / "val_run").rglob(HISTORY_FILE)))
    assert doc["eval_split"] == "validation" and doc["best"]["val"]["label"] == "best round (validation)"
    out = io.StringIO()
    result = compare_main([str(tmp_path / "val_run"), "--out", str(tmp_path)], stream=out)
    head, row = [ln for ln in result.table.splitlines() if ln.startswith("| ")][:2]
    assert head == ("| group | runs | seeds | final weighted acc | final worst decile | final std over clients | "
                    "final unseen clients weighted acc | best round (validation): weighted acc | best round | rounds |")
    final = doc["history"][-1]["metrics"]
    cells = row.split(" | ")
    assert cells[5:9] == [f"{final['val/acc_std']:.4f}", f"{final['val/new/acc_weighted']:.4f}",
                          f"{doc['best']['val']['value']:.4f}", str(doc["best"]["val"]["round"])]
    summary = summarize_run(doc["history"])
    assert summary["final_new_acc_weighted"] == final["val/new/acc_weighted"]


def test_compare_labels_a_best_round_chosen_on_test_data(tmp_path: Path) -> None:
    doc = {"version": 2, "history": _history([(2, 0.6), (4, 0.8), (6, 0.7)]), "primary_metric": "acc",
           "eval_split": "test"}
    (tmp_path / HISTORY_FILE).write_text(json.dumps(doc))
    result = compare_main([str(tmp_path), "--out", str(tmp_path)], stream=io.StringIO())
    rows = [ln for ln in result.table.splitlines() if ln.startswith("| ")]
    assert "best round (chosen on test data): weighted acc | best round | rounds |" in rows[0]
    assert rows[1].endswith("| 0.7000 | 0.3500 | 0.8000 | 4 | 6 |")  # final first (the headline), then the best
