"""``fedmeta compare --x bytes`` (issue 28): accuracy against cumulative uploaded megabytes, from the byte counts
that a fit writes into ``fedmeta_history.json`` and its logger."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.frontends.callbacks import HISTORY_FILE, PlotCallback, read_history
from lightning_fedmeta.frontends.compare import UPLOAD_AXIS, CompareError, compare_main
from tests.helpers import make_trainer

M, ROUNDS = 3, 4  # clients per round, rounds


def _fit(root: Path, name: str, logger: bool = False) -> FederatedModule:
    dm = FederatedDataModule(dataset="synthetic", num_clients=10, eval_every=2)
    module = FederatedModule(algorithm={"name": name, "local_steps": 2}, clients_per_round=M)
    options = {}
    if logger:
        from lightning.pytorch.loggers import CSVLogger  # noqa: PLC0415 - only this test logs to a file

        options["logger"] = CSVLogger(str(root), name="csv")
    trainer = make_trainer(ROUNDS, default_root_dir=str(root), callbacks=[PlotCallback()], **options)
    trainer.fit(module, dm)
    return module


def _floats(module: FederatedModule) -> int:
    return sum(p.numel() for p in module.model.parameters())


def test_history_and_logger_record_the_cumulative_bytes(tmp_path: Path) -> None:
    module = _fit(tmp_path, "scaffold", logger=True)
    up_per_round = M * 4 * 2 * _floats(module)  # SCAFFOLD: Δy and Δc, float32, per client
    history = read_history(next(tmp_path.rglob(HISTORY_FILE)))["history"]
    assert [(h["round"], h["comm"]["comm/up_bytes_cumulative"]) for h in history] == \
        [(r, r * up_per_round) for r in (2, 4)]
    assert history[-1]["comm"]["comm/down_bytes_cumulative"] == ROUNDS * up_per_round  # w and c down
    rows = list(csv.DictReader(open(next((tmp_path / "csv").rglob("metrics.csv")), encoding="utf-8")))
    logged = [(int(r["step"]), float(r["comm/up_bytes"]), float(r["comm/up_bytes_cumulative"]))
              for r in rows if r.get("comm/up_bytes")]
    # the rounds a logger writes with log_every_n_steps = 50: the first and the last; the cumulative sum stays exact
    assert logged == [(r, up_per_round, (r + 1) * up_per_round) for r in (0, ROUNDS - 1)]


def test_compare_x_bytes_draws_accuracy_against_uploaded_megabytes(tmp_path: Path) -> None:
    fedavg, scaffold = _fit(tmp_path / "fedavg", "fedavg"), _fit(tmp_path / "scaffold", "scaffold")
    result = compare_main([str(tmp_path / "fedavg"), str(tmp_path / "scaffold"), "--x", "bytes",
                           "--out", str(tmp_path / "cmp.png")])
    ax = result.figure.axes[0]
    assert ax.get_xlabel() == UPLOAD_AXIS
    lines = {line.get_label(): list(line.get_xdata()) for line in ax.get_lines()}
    per_round = {"fedavg": M * 4 * _floats(fedavg) / 1e6, "scaffold": M * 4 * 2 * _floats(scaffold) / 1e6}
    for label, mb in per_round.items():
        assert lines[label] == pytest.approx([2 * mb, 4 * mb], rel=1e-12)
    assert (tmp_path / "cmp.png").is_file()


def test_compare_x_bytes_refuses_a_history_without_byte_counts(tmp_path: Path) -> None:
    _fit(tmp_path / "run", "fedavg")
    path = tmp_path / "run" / HISTORY_FILE
    doc = read_history(path)
    for h in doc["history"]:
        h.pop("comm")
    import json  # noqa: PLC0415

    path.write_text(json.dumps(doc), encoding="utf-8")
    with pytest.raises(CompareError, match="no byte counts"):
        compare_main([str(tmp_path / "run"), "--x", "bytes", "--out", str(tmp_path / "cmp.png")])
