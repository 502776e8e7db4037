"""The text table of a personalised evaluation (printed after ``fit`` and ``test``)."""

from __future__ import annotations

from typing import Any

from lightning_fedmeta.evaluation.fairness import QUANTILES, SPREAD_KEY

__all__ = ["format_spread", "format_summary"]


def format_summary(summary: dict[str, Any], round_idx: int) -> str:
    """A small text table of every personalised metric (weighted mean, mean, worst decile) per client group
    (``clients``: the training clients, ``new``: the held-out, unseen ones, ``honest``), followed by the spread
    of the per-client values (:func:`format_spread`) when the summary has one."""
    groups = [g for g in summary if not g.startswith("_")]
    keys = [k[: -len("_weighted")] for k in summary[groups[0]] if k.endswith("_weighted")] if groups else []
    header = f"{'clients':<10}" + "".join(
        f" {k + ' (weighted)':>18} {k + ' (mean)':>14} {k + ' (worst 10%)':>18}" for k in keys
    )
    lines = [f"Personalized evaluation after round {round_idx}", header]
    for group in groups:
        s = summary[group]
        lines.append(f"{group:<10}" + "".join(
            f" {float(s[k + '_weighted']):>18.4f} {float(s[k + '_mean']):>14.4f} {float(s[k + '_worst10']):>18.4f}"
            for k in keys
        ))
    spread = format_spread(summary)
    return "\n".join(lines + ([spread] if spread else []))


def format_spread(summary: dict[str, Any]) -> str:
    """One line per client group and metric: the standard deviation and the 10/25/50/75/90% quantiles of the
    per-client values, unweighted over clients (``summary["_spread"]``; empty text without it)."""
    spreads = summary.get(SPREAD_KEY) or {}
    rows = [(group, key[: -len("_std")], values) for group, values in spreads.items()
            for key in values if key.endswith("_std")]
    if not rows:
        return ""
    names = ["std"] + [f"{int(round(p * 100))}%" for _, p in QUANTILES]
    lines = ["Spread over clients (unweighted, each client once)",
             f"{'clients':<10} {'metric':<8}" + "".join(f" {n:>8}" for n in names)]
    for group, key, values in rows:
        cells = [values[f"{key}_std"]] + [values[f"{key}_{q}"] for q, _ in QUANTILES]
        lines.append(f"{group:<10} {key:<8}" + "".join(f" {float(c):>8.4f}" for c in cells))
    return "\n".join(lines)
