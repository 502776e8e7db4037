"""Lightning callbacks for federated runs: pictures of the personalised metric and a per-round progress bar.

* :class:`PlotCallback` records the personalised metrics after every evaluation (round = the number of
  completed communication rounds: ``trainer.global_step``, or a loaded checkpoint's round under ``test``)
  and writes the curve and per-client histogram of the module's primary metric (``accuracy_vs_round.png`` and
  ``client_accuracy_hist.png`` for accuracy, ``{metric}_vs_round.png`` and
  ``client_{metric}_hist.png`` otherwise) and ``fedmeta_history.json`` into the log dir at fit end
  and test end (rank zero writes; every rank resolves the log dir, a collective call under DDP).
  ``fedmeta compare`` reads the JSON.
* :class:`RoundProgressBar` is a ``TQDMProgressBar`` whose training bar counts communication
  rounds over the whole run (``total = trainer.max_steps``) instead of batches per epoch, and shows
  the primary metric's ``val/{metric}_weighted``.

The metric comes from the module: ``pl_module.primary_metric`` (the first metric key the user chose;
``"acc"`` by default for classification, ``"loss"`` when no metric was chosen),
``pl_module.metric_directions`` (metric key -> higher is better, the loss last) and
``pl_module.last_per_client`` (metric key -> ``[K]`` values of the last evaluation). A module
without these attributes is treated as an accuracy module (``last_per_client_accuracy``).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_only

from lightning_fedmeta.evaluation.fairness import best_round, eval_split
from lightning_fedmeta.frontends.plots import metric_file_names, plot_client_metric_hist, plot_metric_vs_round
from lightning_fedmeta.frontends.round_logging import spread_metrics

__all__ = ["HISTORY_FILE", "PlotCallback", "RoundProgressBar", "evaluation_round", "module_algorithm",
           "module_metrics", "read_history"]

HISTORY_FILE = "fedmeta_history.json"
# 1: accuracy only ("per_client_accuracy"); 2: any metric ("primary_metric", "higher_is_better",
# "metric_directions", "per_client"; "per_client_accuracy" kept when the primary metric is "acc")
HISTORY_VERSION = 2

# the directions assumed for a module (or a version-1 history) that predates chosen metrics
_ACCURACY_DIRECTIONS: dict[str, bool] = {"acc": True, "loss": False}


def read_history(path: str | Path) -> dict[str, Any]:
    """Load a ``fedmeta_history.json`` written by :class:`PlotCallback`, in the current layout.

    A version-1 file (accuracy only, written before metrics could be chosen) is upgraded on load:
    ``primary_metric = "acc"``, ``higher_is_better = True``, ``metric_directions = {"acc": True,
    "loss": False}`` and ``per_client = {"acc": per_client_accuracy}``. Missing optional keys of a
    version-2 file get the same defaults, so every reader finds all keys.

    Raises:
        ValueError: the file is not a JSON object with a ``history`` list.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("history"), list):
        raise ValueError(f"{path} is not a fedmeta history file (expected a JSON object with a 'history' list)")
    return _upgrade_history(data)


def _upgrade_history(data: dict[str, Any]) -> dict[str, Any]:
    """Fill in the version-2 keys of a history document (in place; returned for chaining)."""
    primary = data.get("primary_metric")
    if not isinstance(primary, str) or not primary:
        primary = "acc"
    directions = data.get("metric_directions")
    directions = (
        {str(k): bool(v) for k, v in directions.items()} if isinstance(directions, Mapping) and directions
        else dict(_ACCURACY_DIRECTIONS)
    )
    higher = data.get("higher_is_better")
    if not isinstance(higher, bool):
        higher = directions.get(primary, primary != "loss")
    directions.setdefault(primary, higher)
    per_client = data.get("per_client")
    if not isinstance(per_client, Mapping):
        per_client = {}
        if isinstance(data.get("per_client_accuracy"), list):
            per_client["acc"] = data["per_client_accuracy"]
    data.update(primary_metric=primary, higher_is_better=higher, metric_directions=directions,
                per_client=dict(per_client))
    if primary == "acc" and "per_client_accuracy" not in data:
        data["per_client_accuracy"] = per_client.get("acc")
    data.setdefault("is_new_client", None)
    data.setdefault("client_names", None)
    data.setdefault("per_client_round", None)
    data.setdefault("algorithm", None)
    data.setdefault("eval_split", None)
    return data


def module_metrics(pl_module: pl.LightningModule) -> tuple[str, dict[str, bool]]:
    """``(primary_metric, metric_directions)`` of a module, with accuracy defaults for old modules.

    ``metric_directions`` maps each metric key to *higher is better* and always contains the primary
    metric. A module without ``primary_metric`` is an accuracy module (``"acc"``); one without
    ``metric_directions`` gets ``{"acc": True, "loss": False}`` (``loss`` is lower-is-better, any
    other unknown primary metric higher-is-better).
    """
    raw = getattr(pl_module, "metric_directions", None)
    directions = {str(k): bool(v) for k, v in raw.items()} if isinstance(raw, Mapping) else dict(_ACCURACY_DIRECTIONS)
    primary = getattr(pl_module, "primary_metric", None)
    if not isinstance(primary, str) or not primary:
        primary = "acc"
    directions.setdefault(primary, primary != "loss")
    return primary, directions


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


def _as_list(values: Any) -> list[float] | None:
    if isinstance(values, torch.Tensor):
        return [float(v) for v in values.detach().cpu().reshape(-1)]
    return None


def evaluation_round(trainer: pl.Trainer, pl_module: pl.LightningModule) -> int:
    """The round an evaluation belongs to: the module's own count of trained rounds when it keeps one.

    A :class:`~lightning_fedmeta.FederatedModule` counts ``global_step`` or, under ``test``/``validate`` of a
    loaded checkpoint, the checkpoint's round (a test-only Trainer's ``global_step`` is 0, so a round-200
    checkpoint would otherwise be recorded as round 0). Any other module: ``trainer.global_step``.
    """
    module_round = getattr(pl_module, "trained_rounds", None)
    if callable(module_round):
        return int(module_round())
    return int(trainer.global_step)


def module_algorithm(pl_module: pl.LightningModule) -> str | None:
    """The name of the module's algorithm (``"fedavg"``; its class name when it has no registered name), or
    ``None`` for a module without ``algorithm``: it labels the per-run figures and is stored in the history."""
    algorithm = getattr(pl_module, "algorithm", None)
    if algorithm is None or isinstance(algorithm, Mapping):
        return None
    if isinstance(algorithm, str):
        return algorithm
    return str(getattr(type(algorithm), "name", "") or type(algorithm).__name__)


class PlotCallback(Callback):
    """Record personalised metrics each evaluation and draw the primary metric at fit/test end.

    After every (non-sanity) validation and test, the metrics under ``val/`` (``test/``) in
    ``trainer.callback_metrics`` are stored with the round of :func:`evaluation_round` (``global_step``, or
    the loaded checkpoint's round under ``fedmeta test --ckpt_path``), together with the
    module's primary metric and its direction and the per-client values of the evaluation
    (``pl_module.last_per_client``, one list per metric key; see :func:`module_metrics` for modules
    without these attributes). At fit end and test end, rank zero writes into ``dirpath`` (default:
    ``trainer.log_dir``, which is ``default_root_dir`` without a logger):

    * ``{metric}_vs_round.png`` (``accuracy_vs_round.png`` for ``acc``): the primary metric's weighted
      mean and worst decile against the round (plus the new-client curves when clients are held
      out, and test evaluations as stars);
    * ``client_{metric}_hist.png`` (``client_accuracy_hist.png`` for ``acc``): the per-client values
      of the last evaluation, the worst decile marked at the low end, or at the high end for a
      lower-is-better metric;
    * ``fedmeta_history.json`` (version 2): ``{"version", "history": [{"round", "stage", "metrics", "comm"}],
      "primary_metric", "higher_is_better", "metric_directions", "per_client": {metric: [K values]},
      "is_new_client", "client_names", "per_client_round", "algorithm", "eval_split", "best"}`` (the algorithm's
      name, which also starts the curve's legend entries), plus ``"per_client_accuracy"`` (the
      version-1 key) when the primary metric is ``acc``. :func:`read_history` reads both versions.
      Each record's ``metrics`` also hold the spread of the per-client values, unweighted over clients
      (``val/acc_std``, ``val/acc_q10`` ... ``val/new/acc_q90``; :mod:`~lightning_fedmeta.evaluation.fairness`).
      ``eval_split`` is the split the evaluations scored (``"test"``, ``"validation"`` under
      ``data.validation_fraction``, ``null`` when unknown) and ``best`` maps each stage to the best round of the
      primary metric's weighted value next to the final one (:func:`~lightning_fedmeta.evaluation.fairness.best_round`:
      ``{"metric", "value", "round", "final_value", "final_round", "label"}``, the label ``"best round (chosen on
      test data)"`` or ``"best round (validation)"``).

    The history, primary metric and direction are part of the callback's checkpoint state, so a
    resumed run keeps its curve.

    Args:
        dirpath: folder for the files; ``None`` uses the trainer's log dir.

    Attributes:
        history: the evaluation records.
        primary_metric: the metric drawn (``"acc"`` until a module says otherwise).
        higher_is_better: the primary metric's direction.
        metric_directions: metric key -> higher is better, for every metric of the module.
        per_client: metric key -> per-client values of the last evaluation (``None`` before one).
    """

    def __init__(self, dirpath: str | Path | None = None) -> None:
        super().__init__()
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.history: list[dict[str, Any]] = []
        self.primary_metric: str = "acc"
        self.higher_is_better: bool = True
        self.metric_directions: dict[str, bool] = dict(_ACCURACY_DIRECTIONS)
        self.per_client: dict[str, list[float]] | None = None
        self.is_new_client: list[bool] | None = None
        self.client_names: list[str] | None = None
        self.last_round: int | None = None
        self.algorithm: str | None = None
        self.eval_split: str | None = None

    @property
    def per_client_accuracy(self) -> list[float] | None:
        """The per-client accuracy of the last evaluation (``per_client["acc"]``), if recorded."""
        return None if self.per_client is None else self.per_client.get("acc")

    @property
    def per_client_primary(self) -> list[float] | None:
        """The per-client values of the primary metric in the last evaluation, if recorded."""
        return None if self.per_client is None else self.per_client.get(self.primary_metric)

    # -- recording ------------------------------------------------------------------------------
    @staticmethod
    def _per_client_values(pl_module: pl.LightningModule, primary: str,
                           directions: Mapping[str, bool]) -> dict[str, list[float]]:
        """Per-client values of every metric key the module reports (the primary one included)."""
        values: dict[str, list[float]] = {}
        last = getattr(pl_module, "last_per_client", None)
        if isinstance(last, Mapping):
            for key in directions:
                if (v := _as_list(last.get(key))) is not None:
                    values[key] = v
        if primary == "acc" and "acc" not in values:  # a module from before chosen metrics
            if (v := _as_list(getattr(pl_module, "last_per_client_accuracy", None))) is not None:
                values["acc"] = v
        return values

    def _record(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        metrics = {
            name: v for name, value in trainer.callback_metrics.items()
            if name.startswith(f"{stage}/") and (v := _to_float(value)) is not None
        }
        if not metrics:
            return
        summary = getattr(pl_module, "last_summary", None)
        if isinstance(summary, Mapping):  # the spreads are logged beside callback_metrics, not in it
            metrics.update(spread_metrics(stage, dict(summary)))
        self.eval_split = eval_split(getattr(trainer, "datamodule", None)) or self.eval_split
        r = evaluation_round(trainer, pl_module)
        self.history = [h for h in self.history if not (h["round"] == r and h["stage"] == stage)]
        entry: dict[str, Any] = {"round": r, "stage": stage, "metrics": metrics}
        traffic = getattr(getattr(pl_module, "engine", None), "traffic", None)
        if traffic is not None and traffic.cumulative():  # the run's bytes up to this evaluation
            entry["comm"] = traffic.cumulative()  # (docs/communication.md; none under TrafficCounter.hidden)
        self.history.append(entry)
        primary, directions = module_metrics(pl_module)
        self.primary_metric, self.metric_directions = primary, directions
        self.algorithm = module_algorithm(pl_module) or self.algorithm
        self.higher_is_better = directions[primary]
        per_client = self._per_client_values(pl_module, primary, directions)
        if per_client:
            self.per_client = per_client
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

    def file_names(self) -> tuple[str, str]:
        """The ``(curve, histogram)`` PNG names of the primary metric
        (:func:`~lightning_fedmeta.frontends.plots.metric_file_names`)."""
        return metric_file_names(self.primary_metric)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document written to ``fedmeta_history.json`` (non-finite per-client values become ``null``)."""
        per_client = (
            None if self.per_client is None
            else {k: [v if math.isfinite(v) else None for v in vals] for k, vals in self.per_client.items()}
        )
        doc: dict[str, Any] = {
            "version": HISTORY_VERSION,
            "history": sorted(self.history, key=lambda h: (h["round"], h["stage"] != "val")),
            "primary_metric": self.primary_metric,
            "higher_is_better": self.higher_is_better,
            "metric_directions": dict(self.metric_directions),
            "per_client": per_client,
            "algorithm": self.algorithm,
            "eval_split": self.eval_split,
            "best": self.best_rounds(),
        }
        if self.primary_metric == "acc":  # the version-1 key, for readers that predate chosen metrics
            doc["per_client_accuracy"] = None if per_client is None else per_client.get("acc")
        doc.update(is_new_client=self.is_new_client, client_names=self.client_names, per_client_round=self.last_round)
        return doc

    def best_rounds(self) -> dict[str, dict[str, Any]]:
        """Stage -> the best and final round of the primary metric's weighted value
        (:func:`~lightning_fedmeta.evaluation.fairness.best_round`), for the stages evaluated."""
        out: dict[str, dict[str, Any]] = {}
        for stage in ("val", "test"):
            entries = [h for h in self.history if h["stage"] == stage]
            found = best_round(entries, f"{stage}/{self.primary_metric}_weighted", self.higher_is_better,
                               self.eval_split)
            if found is not None:
                out[stage] = found
        return out

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
        curve, hist = self.file_names()
        kind = {"metric": self.primary_metric, "higher_is_better": self.higher_is_better}
        plot_metric_vs_round(doc["history"], out / curve, algorithm=self.algorithm, **kind)
        values = self.per_client_primary
        if values:
            plot_client_metric_hist(values, out / hist, self.is_new_client, self.last_round, **kind)

    # -- checkpointing ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "history": list(self.history),
            "primary_metric": self.primary_metric,
            "higher_is_better": self.higher_is_better,
            "metric_directions": dict(self.metric_directions),
            "algorithm": self.algorithm,
            "eval_split": self.eval_split,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
        self.primary_metric = str(state_dict.get("primary_metric", "acc"))
        self.metric_directions = dict(state_dict.get("metric_directions", _ACCURACY_DIRECTIONS))
        algorithm = state_dict.get("algorithm")
        self.algorithm = algorithm if isinstance(algorithm, str) else None
        split = state_dict.get("eval_split")
        self.eval_split = split if isinstance(split, str) else None
        self.higher_is_better = bool(
            state_dict.get("higher_is_better", self.metric_directions.get(self.primary_metric, True))
        )


class RoundProgressBar(TQDMProgressBar):
    """A progress bar over communication rounds.

    The training bar is created once, labelled ``Rounds``, runs from the resumed round to
    ``trainer.max_steps`` across epochs (one epoch is ``eval_every`` rounds), and its postfix shows
    ``round``, ``clients`` (sampled this round), ``loss`` (weighted mean client loss of the latest round, not the
    last logged one: ``train/loss`` is logged every ``log_every_n_steps`` rounds) and the last
    personalised ``val/{metric}_weighted`` of the module's primary metric (``val/acc_weighted`` for
    classification by default; see :func:`module_metrics`). Validation and test bars are TQDM's.

    Where the output is not a terminal (a log file, a pipe; or ``plain=True``), no bar is drawn: each evaluation
    prints one line, ``round 10/100: clients 10, loss 0.9093, val/acc_weighted 0.8460``, so a log file holds one
    line per evaluation instead of every redraw.

    The count advances every round; the bar is redrawn at most every ``mininterval`` seconds of the
    tqdm bar (0.1 s), at the last round and at every epoch end, so fast rounds do not pay for a
    terminal write each.
    """

    _last_redraw: float = -math.inf  # time.monotonic() of the last redraw of the training bar

    def __init__(self, *args: Any, plain: bool | None = None, **kwargs: Any) -> None:
        """``plain``: one printed line per evaluation instead of bars (``None``: when stdout is not a terminal);
        the other arguments are ``TQDMProgressBar``'s."""
        super().__init__(*args, **kwargs)
        self.plain = plain
        self._round_loss: Any = None  # the latest round's loss (a tensor: read only when shown)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.plain is None:
            self.plain = not _is_terminal(sys.stdout)
        if self.plain:
            self.disable()

    def _total_rounds(self, trainer: pl.Trainer) -> int | None:
        if trainer.max_steps is not None and trainer.max_steps > 0:
            return int(trainer.max_steps)
        per_epoch, epochs = trainer.num_training_batches, trainer.max_epochs
        if epochs is not None and epochs > 0 and math.isfinite(per_epoch):
            return int(per_epoch * epochs)
        return None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._round_loss = None
        self.train_progress_bar = self.init_train_tqdm()
        self.train_progress_bar.reset(total=self._total_rounds(trainer))
        self.train_progress_bar.initial = 0
        self.train_progress_bar.n = int(trainer.global_step)
        self.train_progress_bar.unit = "round"
        self.train_progress_bar.set_description("Rounds")
        self.train_progress_bar.refresh()
        self._last_redraw = time.monotonic()

    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        self.train_progress_bar.set_description("Rounds")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Count the round; redraw the bar (metrics and terminal write) at most every ``bar.mininterval`` seconds.

        A redraw (``get_metrics`` + ``set_postfix``, which writes to the terminal) costs about a millisecond,
        as much as a cheap round, so rounds that end within ``mininterval`` (tqdm's own redraw throttle,
        0.1 s) of the last redraw only advance the count; the last round and every epoch end redraw.
        """
        self._round_loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        bar = self.train_progress_bar
        n = int(trainer.global_step)
        if bar is None or bar.disable or not self._should_update(n, bar.total or 0):
            return
        bar.n = n
        now = time.monotonic()
        if n >= (bar.total or math.inf) or now - self._last_redraw >= bar.mininterval:
            self._last_redraw = now
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.train_progress_bar.disable:
            self.train_progress_bar.n = int(trainer.global_step)
            self._last_redraw = time.monotonic()
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Close the validation bar; in plain mode print the evaluation's line (rank zero)."""
        super().on_validation_end(trainer, pl_module)
        if self.plain and trainer.is_global_zero and not trainer.sanity_checking:
            print(self.evaluation_line(trainer, pl_module), flush=True)

    def evaluation_line(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        """``round R/T: clients C, loss L, val/acc_weighted A`` (what the bar's postfix shows), for plain mode."""
        shown = self.get_metrics(trainer, pl_module)
        total = self._total_rounds(trainer)
        head = f"round {shown.pop('round')}" + (f"/{total}" if total else "")
        parts = [f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items()]
        return f"{head}: " + ", ".join(parts)

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """``round``, ``clients``, ``loss`` and the last ``val/{primary}_weighted`` (plus other bar metrics).

        The primary metric's weighted value is taken from ``trainer.callback_metrics`` when the
        module did not log it to the progress bar itself; it is absent before the first evaluation.
        The loss is the latest round's (none for a round nobody answered), else the last logged one.
        """
        items = dict(super().get_metrics(trainer, pl_module))
        primary_key = f"val/{module_metrics(pl_module)[0]}_weighted"
        if primary_key not in items:
            value = _to_float(getattr(trainer, "callback_metrics", {}).get(primary_key))
            if value is not None:
                items[primary_key] = value
        items.pop("v_num", None)
        shown: dict[str, Any] = {"round": int(trainer.global_step)}
        clients = items.pop("clients", None)
        if clients is not None:
            shown["clients"] = int(float(clients))
        logged_loss = next((items.pop(key) for key in ("train/loss", "loss") if key in items), None)
        loss = _to_float(self._round_loss) if self._round_loss is not None else logged_loss
        if loss is not None and shown.get("clients", 1) > 0:
            shown["loss"] = loss
        shown.update(items)
        return shown


def _is_terminal(stream: Any) -> bool:
    """Whether ``stream`` is an interactive terminal (a log file or a pipe is not)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (ValueError, OSError):  # a closed stream
        return False


def round_bar_instead_of_default(trainer: pl.Trainer) -> list[pl.Callback]:
    """For ``FederatedModule.configure_callbacks``: a plain ``Trainer``'s own progress bar counts epochs ("Epoch
    3/-2" with ``max_epochs=-1``), so it is removed and a :class:`RoundProgressBar` returned. Only Lightning's own
    bar classes are replaced (a subclass of them, or ``enable_progress_bar=False``, is left alone)."""
    from lightning.pytorch.callbacks import RichProgressBar

    defaults = [c for c in trainer.callbacks if type(c) in (TQDMProgressBar, RichProgressBar)]
    for bar in defaults:
        trainer.callbacks.remove(bar)
    return [RoundProgressBar()] if defaults else []
