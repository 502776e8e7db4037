"""The spread of per-client values (fairness) and the best round of a history, as published pFL tables report.

Spread, per client group and metric, **unweighted over clients** (every client counts once, whatever its test
size; PFLlib prints ``np.std`` of the per-client accuracies, FL-bench and the fairness literature, e.g. q-FFL,
Li et al. 2020, report the variance and the percentiles of the per-client accuracy over clients):

* ``{m}_std``  = ``sqrt((1/K) Σ_c (m_c − m̄)²)``, the population standard deviation (``np.std``, ddof = 0);
* ``{m}_q10``, ``_q25``, ``_q50``, ``_q75``, ``_q90``: the quantiles of the ``m_c`` by linear interpolation between
  the order statistics (``numpy.quantile``'s default, ``torch.quantile``): ``q_p = v_(⌊h⌋) + (h − ⌊h⌋)
  (v_(⌊h⌋+1) − v_(⌊h⌋))`` with ``h = p (K − 1)`` over the sorted values ``v_(0) ≤ … ≤ v_(K−1)``.

Clients with an undefined value (NaN) are left out, as in :func:`~lightning_fedmeta.evaluation.metrics.summarize`.

The best round: the evaluation whose weighted value is the best (maximum of a higher-is-better metric, minimum
otherwise; the earliest such round on a tie), labelled with the split it was chosen on: ``"best round (chosen on
test data)"`` when the evaluations scored the clients' test sets (PFLlib's "best accuracy" is this number: an
optimistic one, since the round is picked by looking at the test data), ``"best round (validation)"`` when they
scored a validation split (``data.validation_fraction > 0``). The final round's value stays the headline.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["QUANTILES", "SPREAD_KEY", "best_round", "best_round_label", "eval_split", "flat_spread", "spread",
           "spread_keys", "spread_summary", "summaries_with_spread"]

#: the quantiles reported, as ``(suffix, p)``
QUANTILES: tuple[tuple[str, float], ...] = (("q10", 0.10), ("q25", 0.25), ("q50", 0.50), ("q75", 0.75),
                                            ("q90", 0.90))
#: the key of an evaluation summary that holds the spreads (``summary[SPREAD_KEY][group][f"{m}_std"]``)
SPREAD_KEY = "_spread"


def spread(values: Tensor) -> dict[str, Tensor]:
    """``std`` (population, ddof = 0) and the quantiles of :data:`QUANTILES` of per-client values, unweighted;
    NaN values left out (all NaN, or none: every entry NaN)."""
    v = values.detach().to(torch.float64).reshape(-1)
    v = v[~torch.isnan(v)]
    if v.numel() == 0:
        nan = torch.tensor(math.nan, dtype=torch.float64)
        return {"std": nan, **{name: nan.clone() for name, _ in QUANTILES}}
    ps = torch.tensor([p for _, p in QUANTILES], dtype=torch.float64, device=v.device)
    qs = torch.quantile(v, ps, interpolation="linear")
    out = {"std": v.std(correction=0)}
    out.update({name: qs[i] for i, (name, _) in enumerate(QUANTILES)})
    return out


def spread_keys(directions: Mapping[str, bool]) -> list[str]:
    """The metric keys whose spread is reported: every chosen metric, not the loss (the loss alone when no
    metric was chosen)."""
    keys = [k for k in directions if k != "loss"]
    return keys or ["loss"]


def summaries_with_spread(metrics: Any, groups: Mapping[str, Tensor]) -> dict[str, Any]:
    """``metrics.summaries(groups)`` (a :class:`~lightning_fedmeta.evaluation.metrics.ClientMetrics`) with the
    per-client spread
    of every reported metric (:func:`spread_keys` of ``metrics.directions``) under ``summary[SPREAD_KEY]``: the one
    place an evaluation's summary is formed, for the Lightning module's evaluator and the Flower ServerApp."""
    summary = metrics.summaries(groups)
    summary[SPREAD_KEY] = spread_summary(summary["_per_client"], groups, spread_keys(dict(metrics.directions)))
    return summary


def flat_spread(summary: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """A summary's spreads by name: ``{prefix}{m}_std``, ``{prefix}{m}_q10`` ... for the training clients and
    ``{prefix}{group}/{m}_std`` ... for the other groups (held-out ``new``, ``honest``)."""
    out: dict[str, float] = {}
    for group, values in (summary.get(SPREAD_KEY) or {}).items():
        head = prefix if group == "clients" else f"{prefix}{group}/"
        out.update({head + name: float(v) for name, v in values.items()})
    return out


def spread_summary(per_client: Mapping[str, Tensor], groups: Mapping[str, Tensor], keys: Sequence[str]
                   ) -> dict[str, dict[str, Tensor]]:
    """``{group: {f"{key}_std": ..., f"{key}_q10": ..., ...}}`` over each non-empty group's clients."""
    out: dict[str, dict[str, Tensor]] = {}
    for group, idx in groups.items():
        if idx.numel() == 0:
            continue
        i = idx.cpu()
        out[group] = {f"{key}_{stat}": value for key in keys
                      for stat, value in spread(per_client[key].cpu()[i]).items()}
    return out


def eval_split(datamodule: Any) -> str | None:
    """Which split the evaluations of a run score: ``"validation"`` (``validation_fraction > 0``), ``"test"``, or
    ``None`` for a datamodule that does not say."""
    fraction = getattr(datamodule, "validation_fraction", None)
    if fraction is None:
        return None
    return "validation" if float(fraction) > 0 else "test"


def best_round_label(split: str | None) -> str:
    """The label of a best-round number: says whether the round was chosen on test data."""
    return {"test": "best round (chosen on test data)", "validation": "best round (validation)"}.get(
        str(split), "best round (split not recorded)")


def best_round(history: Sequence[Mapping[str, Any]], name: str, higher_is_better: bool, split: str | None
               ) -> dict[str, Any] | None:
    """The best and the final value of logged metric ``name`` over a history's records (``{"round", "metrics"}``):
    ``{"metric", "value", "round", "final_value", "final_round", "label"}``, or ``None`` when no record has a
    finite value. The best is the max (``higher_is_better``) or min, the earliest round on a tie."""
    points: dict[int, float] = {}
    for rec in history:
        value = rec.get("metrics", {}).get(name)
        if value is not None and math.isfinite(float(value)):
            points[int(rec["round"])] = float(value)
    if not points:
        return None
    rounds = sorted(points)
    sign = 1.0 if higher_is_better else -1.0
    best = max(rounds, key=lambda r: (sign * points[r], -r))
    return {"metric": name, "value": points[best], "round": best, "final_value": points[rounds[-1]],
            "final_round": rounds[-1], "label": best_round_label(split)}
