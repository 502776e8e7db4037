"""Figures for papers (issue 31): the round of a test-only evaluation, ``fedmeta compare`` over seeds
(groups, bands, paired differences, PDF/SVG/PNG), and the y-limits and legends of every figure."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.callbacks import HISTORY_FILE, PlotCallback, read_history
from lightning_fedmeta.data import FederatedDataModule
from tests.helpers import make_trainer


def _synthetic_module() -> tuple[FederatedModule, FederatedDataModule]:
    dm = FederatedDataModule(dataset="synthetic", num_clients=8, eval_every=2)
    module = FederatedModule(algorithm={"name": "fedavg", "local_lr": 0.05, "local_steps": 2}, clients_per_round=3)
    return module, dm


def test_a_test_of_a_checkpoint_is_recorded_at_the_checkpoint_round(tmp_path: Path) -> None:
    module, dm = _synthetic_module()
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    make_trainer(4, callbacks=[saver], enable_checkpointing=True, default_root_dir=str(tmp_path)).fit(module, dm)
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    assert ckpt.is_file()

    fresh, dm = _synthetic_module()  # what `fedmeta test --ckpt_path` builds: a new module and a test-only Trainer
    plots = PlotCallback(tmp_path / "test")
    make_trainer(0, callbacks=[plots]).test(fresh, dm, ckpt_path=str(ckpt))
    doc = read_history(tmp_path / "test" / HISTORY_FILE)
    assert [(h["round"], h["stage"]) for h in doc["history"] if h["stage"] == "test"] == [(4, "test")]
    assert doc["per_client_round"] == 4  # the histogram's "after round 4"
