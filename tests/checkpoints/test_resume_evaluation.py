"""A resume from a checkpoint written after an evaluation round's training step but before its evaluation
(``ModelCheckpoint(every_n_train_steps=...)``) records that evaluation (issue 25, item 13): Lightning skips the
pending validation on resume, so before the fix the round was never evaluated in the resumed run's logs and plots.
"""

from __future__ import annotations

import csv
import warnings
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_fedmeta.frontends.callbacks import PlotCallback
from tests.helpers import make_trainer, tiny_datamodule, tiny_module

FEDAVG = {"name": "fedavg", "local_lr": 0.3, "local_steps": 2, "batch_size": 4}


class _Evaluations(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def on_validation_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        self.seen.append((int(trainer.global_step), float(trainer.callback_metrics["val/acc_weighted"])))


def test_a_resume_records_the_evaluation_its_checkpoint_was_written_before(tmp_path: Path) -> None:
    straight = _Evaluations()
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(4, callbacks=[straight, saver], enable_checkpointing=True,
                     logger=CSVLogger(tmp_path / "logs", name="", version="straight")).fit(
            tiny_module(FEDAVG, seed=1), tiny_datamodule(eval_every=2))
        resumed = _Evaluations()
        plots = PlotCallback()
        logger = CSVLogger(tmp_path / "logs", name="", version="v")
        make_trainer(4, callbacks=[resumed, plots], logger=logger).fit(
            tiny_module(FEDAVG, seed=1), tiny_datamodule(eval_every=2),
            ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=2.ckpt"))
    assert [r for r, _ in straight.seen] == [2, 4]
    assert resumed.seen == straight.seen  # round 2 evaluated again, with the uninterrupted run's values
    assert [(h["round"], h["stage"]) for h in plots.history] == [(2, "val"), (4, "val")]
    assert _logged(tmp_path / "logs" / "v") == _logged(tmp_path / "logs" / "straight")  # same steps, same values


def _logged(folder: Path) -> list[tuple[str, str]]:
    with open(folder / "metrics.csv") as f:
        return [(row["step"], row["val/acc_weighted"]) for row in csv.DictReader(f) if row.get("val/acc_weighted")]
