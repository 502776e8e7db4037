"""Lightning callbacks for federated runs: pictures of personalised accuracy and a per-round progress bar.

* :class:`PlotCallback` records the personalised metrics after every evaluation (round =
  ``trainer.global_step``, the number of completed communication rounds) and writes
  ``accuracy_vs_round.png``, ``client_accuracy_hist.png`` and ``fedmeta_history.json`` into the
  log dir at fit end and test end (rank zero writes; every rank resolves the log dir, a collective
  call under DDP). ``fedmeta compare`` reads the JSON.
* :class:`RoundProgressBar` is a ``TQDMProgressBar`` whose training bar counts communication
  rounds over the whole run (``total = trainer.max_steps``) instead of batches per epoch.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_only

from lightning_fedmeta.plots import plot_accuracy_vs_round, plot_client_accuracy_hist

__all__ = ["HISTORY_FILE", "PlotCallback", "RoundProgressBar", "read_history"]

HISTORY_FILE = "fedmeta_history.json"
HISTORY_VERSION = 1


def read_history(path: str | Path) -> dict[str, Any]:
    """Load a ``fedmeta_history.json`` written by :class:`PlotCallback`."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("history"), list):
        raise ValueError(f"{path} is not a fedmeta history file (expected a JSON object with a 'history' list)")
    return data


def _to_float(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.item()
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


class PlotCallback(Callback):
    """Record personalised metrics each evaluation and draw them at fit/test end.

    After every (non-sanity) validation and test, the metrics under ``val/`` (``test/``) in
    ``trainer.callback_metrics`` are stored with ``round = trainer.global_step``, together with
    ``pl_module.last_per_client_accuracy``. At fit end and test end, rank zero writes into
    ``dirpath`` (default: ``trainer.log_dir``, which is ``default_root_dir`` without a logger):

    * ``accuracy_vs_round.png``: weighted mean and worst decile against the round (plus the
      new-client curves when clients are held out, and test evaluations as stars);
    * ``client_accuracy_hist.png``: the per-client accuracy of the last evaluation;
    * ``fedmeta_history.json``: ``{"version", "history": [{"round", "stage", "metrics"}],
      "per_client_accuracy", "is_new_client", "client_names"}``.

    The history is part of the callback's checkpoint state, so a resumed run keeps its curve.

    Args:
        dirpath: folder for the files; ``None`` uses the trainer's log dir.
    """

    def __init__(self, dirpath: str | Path | None = None) -> None:
        super().__init__()
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.history: list[dict[str, Any]] = []
        self.per_client_accuracy: list[float] | None = None
        self.is_new_client: list[bool] | None = None
        self.client_names: list[str] | None = None
        self.last_round: int | None = None

    # -- recording ------------------------------------------------------------------------------
    def _record(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        metrics = {
            name: v for name, value in trainer.callback_metrics.items()
            if name.startswith(f"{stage}/") and (v := _to_float(value)) is not None
        }
        if not metrics:
            return
        r = int(trainer.global_step)
        self.history = [h for h in self.history if not (h["round"] == r and h["stage"] == stage)]
        self.history.append({"round": r, "stage": stage, "metrics": metrics})
        per_client = getattr(pl_module, "last_per_client_accuracy", None)
        if isinstance(per_client, torch.Tensor):
            self.per_client_accuracy = [float(a) for a in per_client.detach().cpu().reshape(-1)]
            is_new = getattr(pl_module, "is_holdout", None)
            self.is_new_client = (
                [bool(b) for b in is_new.cpu().reshape(-1)] if isinstance(is_new, torch.Tensor) else None
            )
            data = getattr(pl_module, "data", None)
            self.client_names = list(getattr(data, "client_names", []) or []) or None
            self.last_round = r

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._record(trainer, pl_module, "val")

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record(trainer, pl_module, "test")
        self.write(trainer, self.output_dir(trainer))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.write(trainer, self.output_dir(trainer))

    # -- output -----------------------------------------------------------------------------------
    def output_dir(self, trainer: pl.Trainer) -> Path:
        """Where the files go: ``dirpath``, else ``trainer.log_dir``, else ``default_root_dir``.

        ``trainer.log_dir`` is a collective call under DDP (rank zero broadcasts it), so every rank
        must call this, as the fit-end and test-end hooks do before the rank-zero-only :meth:`write`.
        """
        if self.dirpath is not None:
            return self.dirpath
        return Path(trainer.log_dir or trainer.default_root_dir)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document written to ``fedmeta_history.json``."""
        return {
            "version": HISTORY_VERSION,
            "history": sorted(self.history, key=lambda h: (h["round"], h["stage"] != "val")),
            "per_client_accuracy": self.per_client_accuracy,
            "is_new_client": self.is_new_client,
            "client_names": self.client_names,
            "per_client_round": self.last_round,
        }

    @rank_zero_only
    def write(self, trainer: pl.Trainer, dirpath: str | Path | None = None) -> None:
        """Write the JSON history and both PNGs into ``dirpath`` (rank zero; nothing before the first
        evaluation, and nothing under ``fast_dev_run``, which Lightning treats as a dry run without
        outputs).

        Under DDP pass ``dirpath`` (from :meth:`output_dir`, called on every rank): without it,
        rank zero alone would call the collective ``trainer.log_dir`` and fail.
        """
        if not self.history or trainer.fast_dev_run:
            return
        out = Path(dirpath) if dirpath is not None else self.output_dir(trainer)
        out.mkdir(parents=True, exist_ok=True)
        doc = self.to_dict()
        (out / HISTORY_FILE).write_text(json.dumps(doc, indent=1), encoding="utf-8")
        plot_accuracy_vs_round(doc["history"], out / "accuracy_vs_round.png")
        if self.per_client_accuracy:
            plot_client_accuracy_hist(
                self.per_client_accuracy, out / "client_accuracy_hist.png", self.is_new_client, self.last_round
            )

    # -- checkpointing ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))


class RoundProgressBar(TQDMProgressBar):
    """A progress bar over communication rounds.

    The training bar is created once, labelled ``Rounds``, runs from the resumed round to
    ``trainer.max_steps`` across epochs (one epoch is ``eval_every`` rounds), and its postfix shows
    ``round``, ``clients`` (sampled this round), ``loss`` (weighted mean client loss) and the last
    personalised ``val/acc_weighted``. Validation and test bars are TQDM's.
    """

    def _total_rounds(self, trainer: pl.Trainer) -> int | None:
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return int(trainer.max_steps)
        per_epoch, epochs = trainer.num_training_batches, trainer.max_epochs
        if epochs is not None and epochs > 0 and math.isfinite(per_epoch):
            return int(per_epoch * epochs)
        return None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.train_progress_bar = self.init_train_tqdm()
        self.train_progress_bar.reset(total=self._total_rounds(trainer))
        self.train_progress_bar.initial = 0
        self.train_progress_bar.n = int(trainer.global_step)
        self.train_progress_bar.unit = "round"
        self.train_progress_bar.set_description("Rounds")
        self.train_progress_bar.refresh()

    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        self.train_progress_bar.set_description("Rounds")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        bar = self.train_progress_bar
        n = int(trainer.global_step)
        if bar is not None and not bar.disable and self._should_update(n, bar.total or 0):
            bar.n = n
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """``round``, ``clients``, ``loss`` and the last ``val/acc_weighted`` (plus other bar metrics)."""
        items = dict(super().get_metrics(trainer, pl_module))
        items.pop("v_num", None)
        shown: dict[str, Any] = {"round": int(trainer.global_step)}
        clients = items.pop("clients", None)
        if clients is not None:
            shown["clients"] = int(float(clients))
        for key in ("train/loss", "loss"):
            if key in items:
                shown["loss"] = items.pop(key)
                break
        shown.update(items)
        return shown
