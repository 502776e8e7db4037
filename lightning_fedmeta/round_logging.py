"""What the Lightning module logs: each round's training metrics and each evaluation's summaries.

Per round (on the rounds a logger writes with ``log_every_n_steps = n``, and the last): ``train/<metric>`` (the
clients' metrics, weighted by ``w_i``), ``clients``, ``round``, under DP ``dp/clip`` and ``dp/clipped_fraction``,
and every round ``privacy/epsilon`` with ``privacy/secure_mode`` (1: the noise was secret; 0: reproducible
from ``model.seed``, so ε holds only against someone who does not know the seed). Per evaluation:
``<stage>/<metric>_{weighted,mean,worst10}`` for the training
clients and ``<stage>/<group>/...`` for the held-out (``new``) and honest clients.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_fedmeta.loop.round import RoundReport

__all__ = ["log_round", "log_summary", "logs_round"]

_STEP = {"on_step": True, "on_epoch": False, "batch_size": 1}


def logs_round(trainer: Any, round_idx: int) -> bool:
    """Whether round ``round_idx`` logs its training metrics: the rounds a logger writes with
    ``log_every_n_steps = n`` (round ≡ 0 or n − 1 mod n) and the last round (each ``log`` costs ~0.5 ms)."""
    if trainer is None:
        return True
    n = max(1, int(trainer.log_every_n_steps or 1))
    last = trainer.max_steps is not None and 0 < trainer.max_steps <= round_idx + 1
    return n == 1 or last or round_idx % n == 0 or (round_idx + 1) % n == 0


def log_round(module: Any, report: RoundReport) -> None:
    """Log a finished round through ``module.log`` (a skipped round logs ``clients = 0`` and its number)."""
    r = report.round_idx
    if report.skipped is not None:
        module.log("clients", 0.0, prog_bar=True, **_STEP)
        module.log("round", float(r + 1), **_STEP)
        return
    if logs_round(module._trainer, r):
        for k, v in report.metrics.items():
            module.log(f"train/{k}", v, prog_bar=(k == "loss"), **_STEP)
        module.log("clients", float(report.clients.numel()), prog_bar=True, **_STEP)
        module.log("round", float(r + 1), **_STEP)
        for k, value in (report.privacy.logged() if report.privacy is not None else {}).items():
            module.log(k, float(value), **_STEP)
    if module.reliability.dp is not None:
        module.log("privacy/epsilon", module.epsilon_spent(r + 1), prog_bar=True, **_STEP)
        # next to ε: whether it holds against a reader of the seed (0: the noise is reproducible from model.seed)
        module.log("privacy/secure_mode", float(module.reliability.dp.secure_mode), **_STEP)


def log_summary(module: Any, stage: str, summary: dict[str, dict[str, Tensor]], sample: Tensor | None) -> None:
    """Log an evaluation's summaries (``sample``: the clients of a sampled validation, else ``None``)."""
    for group, values in summary.items():
        if group.startswith("_"):
            continue
        prefix = f"{stage}/" if group == "clients" else f"{stage}/{group}/"
        for name, v in values.items():
            bar = group == "clients" and name == f"{module.primary_metric}_weighted"
            module.log(prefix + name, v.float(), prog_bar=bar, batch_size=1, sync_dist=False)
    if sample is not None:
        module.log(f"{stage}/evaluated_clients", float(sample.numel()), batch_size=1, sync_dist=False)
