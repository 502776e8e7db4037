"""What the Lightning module logs: each round's training metrics and each evaluation's summaries.

Per round (on the rounds a logger writes with ``log_every_n_steps = n``, and the last): ``train/<metric>`` (the
clients' metrics, weighted by ``w_i``), ``clients``, ``round``, under DP ``dp/clip`` and ``dp/clipped_fraction``,
and every round ``privacy/epsilon`` with ``privacy/secure_mode`` (1: the noise was secret; 0: reproducible
from ``model.seed``, so ε holds only against someone who does not know the seed), and the round's bytes
``comm/up_bytes``, ``comm/down_bytes`` with the run's totals ``comm/{up,down}_bytes_cumulative``
(docs/communication.md; written to the loggers directly). Under ``model.dp`` with ``secure_mode`` and
``sampling: poisson`` the cohort's size is secret, so ``clients`` and ``comm/*`` are not logged. Per evaluation:
``<stage>/<metric>_{weighted,mean,worst10}`` for the training
clients and ``<stage>/<group>/...`` for the held-out (``new``) and honest clients, and the spread of the per-client
values, unweighted over clients, ``<stage>/[<group>/]<metric>_{std,q10,q25,q50,q75,q90}``
(:mod:`~lightning_fedmeta.evaluation.fairness`), written to the loggers directly (not through ``module.log``:
``trainer.callback_metrics``, which checkpoint monitors and the run fingerprints read, stays as it was; the history
reads them from ``last_summary``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lightning_fedmeta.communication.accounting import TrafficCounter
from lightning_fedmeta.evaluation.fairness import flat_spread
from lightning_fedmeta.frontends.fit_state import FitState
from lightning_fedmeta.loop.round import RoundReport
from lightning_fedmeta.privacy.mechanism import DPSpec, hides_cohort_size

if TYPE_CHECKING:
    from lightning.pytorch import LightningModule, Trainer

#: ``LightningModule.log``
LogFn = Callable[..., None]

__all__ = ["log_round", "log_spread", "log_summary", "log_traffic", "logs_round", "pending_evaluation_round",
           "record_outside_validation", "spread_metrics"]

_STEP = {"on_step": True, "on_epoch": False, "batch_size": 1}


def logs_round(trainer: Trainer | None, round_idx: int) -> bool:
    """Whether round ``round_idx`` logs its training metrics: the rounds a logger writes with
    ``log_every_n_steps = n`` (round ≡ 0 or n − 1 mod n) and the last round (each ``log`` costs ~0.5 ms)."""
    if trainer is None:
        return True
    n = max(1, int(trainer.log_every_n_steps or 1))
    last = trainer.max_steps is not None and 0 < trainer.max_steps <= round_idx + 1
    return n == 1 or last or round_idx % n == 0 or (round_idx + 1) % n == 0


def log_round(log: LogFn, trainer: Trainer | None, report: RoundReport, dp: DPSpec | None,
              traffic: TrafficCounter, epsilon: Callable[[int], float]) -> None:
    """Log a finished round through the module's ``log`` (a skipped round logs ``clients = 0`` and its number);
    ``epsilon(rounds)`` is ε after that many rounds of this fit (under ``dp``)."""
    r = report.round_idx
    if logs_round(trainer, r):
        log_traffic(trainer, report, traffic)
    if report.skipped is not None:
        if not hides_cohort_size(dp):
            log("clients", 0.0, prog_bar=True, **_STEP)
        log("round", float(r + 1), **_STEP)
        return
    if logs_round(trainer, r):
        for k, v in report.metrics.items():
            log(f"train/{k}", v, prog_bar=(k == "loss"), **_STEP)
        if not hides_cohort_size(dp):  # a Poisson cohort's size under secure_mode is secret
            log("clients", float(report.clients.numel()), prog_bar=True, **_STEP)
        log("round", float(r + 1), **_STEP)
        for k, value in (report.privacy.logged() if report.privacy is not None else {}).items():
            log(k, float(value), **_STEP)
    if dp is not None:
        log("privacy/epsilon", epsilon(r + 1), prog_bar=True, **_STEP)
        # next to ε: whether it holds against a reader of the seed (0: the noise is reproducible from model.seed)
        log("privacy/secure_mode", float(dp.secure_mode), **_STEP)


def log_traffic(trainer: Trainer | None, report: RoundReport, traffic: TrafficCounter) -> None:
    """The round's bytes and the run's cumulative bytes (``comm/*``) to every logger at the round's step. They go
    to the loggers, not through ``module.log``: ``callback_metrics`` (checkpoint monitors, the summaries) stays as
    it was, and byte counts keep their exact value (float64, not float32)."""
    if report.traffic is None or trainer is None:
        return
    values = {k: float(v) for k, v in traffic.logged(report.traffic).items()}
    if not values:  # a Poisson cohort's size under secure_mode (TrafficCounter.hidden)
        return
    for logger in trainer.loggers:
        logger.log_metrics(values, step=report.round_idx)


def summary_metrics(stage: str, summary: dict[str, dict[str, Tensor]], sample: Tensor | None) -> dict[str, Tensor]:
    """An evaluation's summaries by logged name: ``<stage>/<metric>`` for the training clients, ``<stage>/<group>/
    <metric>`` for the other groups, and ``<stage>/evaluated_clients`` for a sampled evaluation."""
    out: dict[str, Tensor] = {}
    for group, values in summary.items():
        if group.startswith("_"):
            continue
        prefix = f"{stage}/" if group == "clients" else f"{stage}/{group}/"
        out.update({prefix + name: v.float() for name, v in values.items()})
    if sample is not None:
        out[f"{stage}/evaluated_clients"] = torch.tensor(float(sample.numel()))
    return out


def spread_metrics(stage: str, summary: dict[str, Any]) -> dict[str, float]:
    """An evaluation's per-client spreads (``summary["_spread"]``) by logged name: ``<stage>/<metric>_std``,
    ``<stage>/<metric>_q10`` ... for the training clients, ``<stage>/<group>/...`` for the other groups."""
    return flat_spread(summary, f"{stage}/")


def log_spread(trainer: Trainer | None, stage: str, summary: dict[str, Any], step: int | None = None) -> None:
    """Write the spreads (:func:`spread_metrics`) to every logger at ``step`` (default: the step Lightning logs
    this evaluation's summaries at), on rank zero."""
    values = spread_metrics(stage, summary)
    if trainer is None or not values or not trainer.is_global_zero:
        return
    if step is None:
        step = int(trainer.fit_loop.epoch_loop._batches_that_stepped)  # Lightning's own default step
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)


def log_summary(log: LogFn, trainer: Trainer | None, stage: str, summary: dict[str, dict[str, Tensor]],
                sample: Tensor | None, primary_metric: str) -> None:
    """Log an evaluation's summaries (``sample``: the clients of a sampled validation, else ``None``) through the
    module's ``log``, and their per-client spreads to the loggers (:func:`log_spread`)."""
    primary = f"{stage}/{primary_metric}_weighted"
    for name, value in summary_metrics(stage, summary, sample).items():
        log(name, value, prog_bar=name == primary, batch_size=1, sync_dist=False)
    log_spread(trainer, stage, summary)


def record_outside_validation(trainer: Trainer, module: LightningModule, summary: dict[str, dict[str, Tensor]],
                              round_idx: int) -> None:
    """Record a validation that ran outside Lightning's validation loop (a resume's pending evaluation): its values
    go to every logger at the step Lightning's own validation after ``round_idx`` logs at, and to
    ``trainer.callback_metrics``, and every callback's ``on_validation_end(trainer, module)`` runs, as after a
    validation loop (the plots' history records it at this round)."""
    metrics = summary_metrics("val", summary, None)
    trainer.callback_metrics.update(metrics)
    for logger in trainer.loggers:  # at the step Lightning gives a validation after round r: r − 1 (its counter
        logger.log_metrics({k: float(v) for k, v in metrics.items()}, step=round_idx - 1)  # moves on after it)
    log_spread(trainer, "val", summary, step=round_idx - 1)
    for callback in trainer.callbacks:
        callback.on_validation_end(trainer, module)


def pending_evaluation_round(trainer: Trainer, fit: FitState, global_step: int) -> int | None:
    """The round to evaluate after a resume from a checkpoint of an evaluation round written before that round's
    evaluation (``ModelCheckpoint(every_n_train_steps=...)`` saves after the training step, and Lightning skips the
    validation on resume); ``None`` when there is none."""
    r, evaluated = fit.loaded_round, fit.evaluated_round
    eval_every = getattr(getattr(trainer, "datamodule", None), "eval_every", None)
    if r <= 0 or global_step != r or evaluated is None or evaluated == r or not eval_every:
        return None
    if r % int(eval_every) or not trainer.limit_val_batches:
        return None
    rank_zero_info(f"[lightning_fedmeta] the checkpoint was written after round {r}, before its evaluation: "
                   "evaluating it now")
    return r
