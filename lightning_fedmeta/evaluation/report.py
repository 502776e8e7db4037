"""The text table of a personalised evaluation (printed after ``fit`` and ``test``)."""

from __future__ import annotations

from torch import Tensor

__all__ = ["format_summary"]


def format_summary(summary: dict[str, dict[str, Tensor]], round_idx: int) -> str:
    """A small text table of every personalised metric (weighted mean, mean, worst decile) per client group."""
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
    return "\n".join(lines)
