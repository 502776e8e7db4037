"""Pictures of a federated run: a personalised metric against communication rounds, and per client.

Every function draws on a fresh :class:`matplotlib.figure.Figure` rendered by the Agg canvas
(no ``pyplot``, no global backend switch, no display needed) and writes one PNG.

A run's *history* is the list written to ``fedmeta_history.json`` by
:class:`~lightning_fedmeta.frontends.callbacks.PlotCallback`: one record per evaluation,
``{"round": r, "stage": "val" | "test", "metrics": {"val/acc_weighted": ..., ...}}``, where
``round`` is the number of completed communication rounds (``trainer.global_step``) and the
metric names are the ones :class:`~lightning_fedmeta.FederatedModule` logs for every metric key
``m`` it evaluates (``acc`` by default for classification, ``loss`` always):

* ``{stage}/{m}_weighted`` = the metric over the training clients' pooled test samples
  (for accuracy: Σ_c correct_c / Σ_c total_c),
* ``{stage}/{m}_worst10``  = mean of the worst ⌈K/10⌉ training clients, *worst* following the
  metric's direction (the lowest accuracies, the highest errors),
* ``{stage}/new/...``      = the same over held-out (never trained) clients.

Each drawing function takes the metric key (``metric``, default ``"acc"``) and its direction
(``higher_is_better``, default ``True``). The y-axis of a curve spans the values drawn plus a margin
(:func:`data_ylim`; an accuracy never beyond 0..1), so 0.83 against 0.88 is visible; the per-client
histogram of an accuracy keeps its 0..1 x-axis.

:func:`plot_groups` draws the paper figure of ``fedmeta compare``: per group of runs (one configuration,
several seeds) the mean curve and a band over the seeds; :func:`save_figure` writes it as PDF, SVG or
PNG by the file's extension.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # matplotlib is imported on the first drawing, not with the callbacks (start-up time)
    from matplotlib.figure import Figure

__all__ = [
    "BANDS",
    "FIGURE_FORMATS",
    "HistoryRecord",
    "data_ylim",
    "group_curve",
    "metric_file_names",
    "metric_label",
    "metric_series",
    "metric_vs_round_figure",
    "plot_accuracy_vs_round",
    "plot_client_accuracy_hist",
    "plot_client_metric_hist",
    "plot_compare",
    "plot_groups",
    "plot_metric_vs_round",
    "save_figure",
    "worst_decile_mean",
]

HistoryRecord = Mapping[str, Any]

# metric keys drawn as an accuracy: labelled "accuracy", on a fixed 0..1 axis
_ACCURACY_KEYS = ("acc", "accuracy")

# (metric-name suffix after "{metric}", legend text, line style) of the curves of one run
_CURVES: tuple[tuple[str, str, str], ...] = (
    ("_weighted", "weighted mean", "-"),
    ("_worst10", "worst 10% of clients", "--"),
    ("new/_weighted", "new clients: weighted mean", "-."),
    ("new/_worst10", "new clients: worst 10%", ":"),
)


def _curve_name(metric: str, suffix: str) -> str:
    """``"_weighted"`` -> ``"acc_weighted"``; ``"new/_worst10"`` -> ``"new/acc_worst10"``."""
    head, _, tail = suffix.rpartition("/")
    return f"{head}/{metric}{tail}" if head else f"{metric}{tail}"


def metric_label(metric: str) -> str:
    """The words for a metric key on an axis: ``"acc"`` -> ``"accuracy"``, anything else unchanged."""
    return "accuracy" if metric in _ACCURACY_KEYS else metric


def metric_file_names(metric: str = "acc") -> tuple[str, str]:
    """The PNG names of :class:`~lightning_fedmeta.frontends.callbacks.PlotCallback` for a metric key:
    ``(curve, histogram)``.

    ``"acc"`` keeps the historical ``("accuracy_vs_round.png", "client_accuracy_hist.png")``; any
    other key gives ``("{metric}_vs_round.png", "client_{metric}_hist.png")``, with characters
    other than letters, digits, ``_``, ``-`` and ``.`` replaced by ``_``.
    """
    name = "accuracy" if metric == "acc" else (re.sub(r"[^A-Za-z0-9_.-]", "_", metric) or "metric")
    return f"{name}_vs_round.png", f"client_{name}_hist.png"


def metric_series(history: Sequence[HistoryRecord], name: str) -> tuple[list[int], list[float]]:
    """The ``(rounds, values)`` of metric ``name`` (e.g. ``"val/acc_weighted"``), in round order.

    Records without the metric, or with a non-finite value, are skipped; a round evaluated twice
    keeps its last value.
    """
    points: dict[int, float] = {}
    for rec in history:
        value = rec.get("metrics", {}).get(name)
        if value is None or not math.isfinite(float(value)):
            continue
        points[int(rec["round"])] = float(value)
    rounds = sorted(points)
    return rounds, [points[r] for r in rounds]


def worst_decile_mean(values: Sequence[float] | np.ndarray, higher_is_better: bool = True) -> float:
    """Mean of the worst ⌈K/10⌉ of ``values`` (non-finite ones left out), as ``{metric}_worst10``.

    Worst means lowest when ``higher_is_better`` (accuracy, F1), highest otherwise (loss, MSE);
    ``nan`` when no value is finite.
    """
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    arr = np.sort(arr[np.isfinite(arr)])
    if arr.size == 0:
        return math.nan
    k = max(1, math.ceil(arr.size / 10))
    return float((arr[:k] if higher_is_better else arr[-k:]).mean())


def _new_figure(width: float = 7.0, height: float = 4.5) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out


def _default_title(metric: str) -> str:
    return f"Personalised {metric_label(metric)} vs. round"


def _fixed_unit_range(metric: str, values: Sequence[float] | np.ndarray) -> bool:
    """Whether to draw on the fixed 0..1 axis: an accuracy whose values all lie in [0, 1]."""
    arr = np.asarray(values, dtype=np.float64)
    return metric in _ACCURACY_KEYS and bool(np.all((arr >= 0.0) & (arr <= 1.0)))


def data_ylim(values: Sequence[float] | np.ndarray, metric: str = "acc", margin: float = 0.08) -> tuple[float, float]:
    """Y-limits that show the spread of ``values``: their range widened by ``margin`` of it on each side.

    A range of zero width is widened by 5% of the value (0.05 around zero). An accuracy whose values lie in
    0..1 is kept within 0..1. Non-finite values are left out; none left gives ``(0, 1)``.
    """
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    arr = arr[np.isfinite(arr)]
    if arr.size == 0:
        return 0.0, 1.0
    lo, hi = float(arr.min()), float(arr.max())
    pad = margin * (hi - lo) if hi > lo else 0.05 * max(abs(lo), 1.0 if lo == 0.0 else 0.0)
    low, high = lo - pad, hi + pad
    if _fixed_unit_range(metric, arr):
        low, high = max(low, 0.0), min(high, 1.0)
    return low, high


def _style_metric_axes(ax: Any, title: str, metric: str, higher_is_better: bool, drawn: Sequence[float]) -> None:
    ax.set_title(title)
    ax.set_xlabel("communication round")
    direction = "" if higher_is_better else " (lower is better)"
    ax.set_ylabel(f"personalised test {metric_label(metric)}{direction}")
    if len(drawn):
        ax.set_ylim(*data_ylim(drawn, metric))
    ax.grid(True, alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)


def plot_metric_vs_round(
    history: Sequence[HistoryRecord],
    path: str | Path,
    title: str | None = None,
    *,
    metric: str = "acc",
    higher_is_better: bool = True,
    algorithm: str | None = None,
) -> Path:
    """A personalised metric of the clients' models after each evaluation.

    Draws the validation curves of ``{stage}/{metric}_weighted`` and ``_worst10`` (plus the
    new-client curves when held-out clients exist) and the test evaluations as separate markers.
    The y-axis spans the values drawn (:func:`data_ylim`); the y label names the metric and says
    "lower is better" when ``higher_is_better`` is false; the legend names the algorithm.

    Args:
        history: the evaluation records (see the module docstring).
        path: the PNG to write.
        title: the plot's title; ``None`` gives ``"Personalised {metric} vs. round"``.
        metric: the metric key, e.g. ``"acc"``, ``"f1"``, ``"mse"``.
        higher_is_better: the metric's direction (only the label depends on it: the logged worst
            decile already follows the direction).
        algorithm: the algorithm's name, which starts every legend entry (``"fedavg: weighted mean"``,
            ``"fedavg, test: weighted mean"``); ``None``: ``"validation: ..."`` and ``"test: ..."``.

    Returns:
        The PNG path.
    """
    return _save(metric_vs_round_figure(history, title, metric=metric, higher_is_better=higher_is_better,
                                        algorithm=algorithm), path)


def metric_vs_round_figure(
    history: Sequence[HistoryRecord],
    title: str | None = None,
    *,
    metric: str = "acc",
    higher_is_better: bool = True,
    algorithm: str | None = None,
) -> Figure:
    """The figure :func:`plot_metric_vs_round` saves (its legend and limits can be read from ``figure.axes[0]``)."""
    fig = _new_figure(9.0, 4.5)
    val_prefix, test_prefix = (f"{algorithm}: ", f"{algorithm}, test: ") if algorithm else ("validation: ", "test: ")
    ax = fig.add_subplot()
    drawn: list[float] = []
    for stage, marker in (("val", "o"), ("test", "*")):
        for suffix, label, style in _CURVES:
            rounds, values = metric_series(history, f"{stage}/{_curve_name(metric, suffix)}")
            if not rounds:
                continue
            color = "tab:blue" if not suffix.startswith("new/") else "tab:orange"
            if stage == "test":
                ax.plot(rounds, values, linestyle="none", marker=marker, markersize=11, color=color,
                        markeredgecolor="black", label=f"{test_prefix}{label}")
            else:
                ax.plot(rounds, values, linestyle=style, marker=marker, markersize=4, color=color,
                        label=f"{val_prefix}{label}")
            drawn.extend(values)
    if not drawn:
        ax.text(0.5, 0.5, "no evaluation recorded yet", ha="center", va="center", transform=ax.transAxes)
    _style_metric_axes(ax, title or _default_title(metric), metric, higher_is_better, drawn)
    if drawn:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return fig


def _hist_edges(values: np.ndarray, bins: int, unit_range: bool) -> np.ndarray:
    if unit_range or values.size == 0:
        return np.linspace(0.0, 1.0, bins + 1)
    lo, hi = float(values.min()), float(values.max())
    if hi - lo <= 1e-12 * max(1.0, abs(lo)):
        pad = 0.5 if lo == 0.0 else 0.05 * abs(lo)
        lo, hi = lo - pad, hi + pad
    return np.linspace(lo, hi, bins + 1)


def plot_client_metric_hist(
    values: Sequence[float] | np.ndarray,
    path: str | Path,
    is_new: Sequence[bool] | np.ndarray | None = None,
    round_idx: int | None = None,
    bins: int = 20,
    *,
    metric: str = "acc",
    higher_is_better: bool = True,
) -> Path:
    """Histogram of a per-client personalised metric (training and new clients stacked).

    Vertical lines mark the unweighted mean and the worst-decile mean of the training clients. The
    worst decile is the mean of the ⌈K/10⌉ worst clients by the metric's direction, as in
    ``{metric}_worst10``: the lowest values when ``higher_is_better``, else the highest (so it lies
    at the high end of the histogram for an error such as ``mse``). Accuracy is binned over 0..1,
    other metrics over their range. Clients with a non-finite value are left out.

    Args:
        values: one value per client.
        path: the PNG to write.
        is_new: one flag per client, true for held-out clients; ``None``: all are training clients.
        round_idx: the round of the evaluation, shown in the title.
        bins: the number of bins.
        metric: the metric key, e.g. ``"acc"``, ``"f1"``, ``"mse"``.
        higher_is_better: the metric's direction.

    Returns:
        The PNG path.

    Raises:
        ValueError: ``is_new`` does not have one entry per client.
    """
    vals = np.asarray(values, dtype=np.float64).reshape(-1)
    new = np.zeros(vals.shape, dtype=bool) if is_new is None else np.asarray(is_new, dtype=bool).reshape(-1)
    if new.shape != vals.shape:
        raise ValueError(f"is_new has {new.size} entries but {metric_label(metric)} has {vals.size}")
    finite = np.isfinite(vals)
    vals, new = vals[finite], new[finite]
    unit_range = _fixed_unit_range(metric, vals)
    fig = _new_figure()
    ax = fig.add_subplot()
    edges = _hist_edges(vals, bins, unit_range)
    groups = [(vals[~new], f"training clients ({int((~new).sum())})", "tab:blue")]
    if new.any():
        groups.append((vals[new], f"new clients ({int(new.sum())})", "tab:orange"))
    ax.hist([g[0] for g in groups], bins=edges, stacked=True, color=[g[2] for g in groups],
            label=[g[1] for g in groups], edgecolor="white")
    trained = vals[~new] if (~new).any() else vals
    if trained.size:
        worst = worst_decile_mean(trained, higher_is_better)
        fmt = ".3f" if unit_range else ".4g"
        which = "" if higher_is_better else " (highest)"
        ax.axvline(trained.mean(), color="black", linestyle="-", label=f"mean {trained.mean():{fmt}}")
        ax.axvline(worst, color="tab:red", linestyle="--", label=f"worst 10% mean{which} {worst:{fmt}}")
    label = metric_label(metric)
    when = "" if round_idx is None else f" after round {round_idx}"
    ax.set_title(f"Per-client personalised {label}{when}")
    direction = "" if higher_is_better else " (lower is better)"
    ax.set_xlabel(f"client test {label}{direction}")
    ax.set_ylabel("number of clients")
    if unit_range:
        ax.set_xlim(0.0, 1.0)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper left" if higher_is_better else "best", fontsize="small")
    return _save(fig, path)


# the historical names: the same functions, accuracy by default
plot_accuracy_vs_round = plot_metric_vs_round
plot_client_accuracy_hist = plot_client_metric_hist


def plot_compare(
    runs: Mapping[str, Sequence[HistoryRecord]],
    path: str | Path,
    stage: str = "val",
    title: str | None = None,
    *,
    metric: str = "acc",
    higher_is_better: bool = True,
) -> Path:
    """Several runs on one plot: ``{stage}/{metric}_weighted`` (solid) and ``_worst10`` (dashed) per run.

    Args:
        runs: run name -> history records.
        path: the PNG to write.
        stage: ``"val"`` or ``"test"``.
        title: the plot's title; ``None`` gives ``"Personalised {metric} vs. round"``.
        metric: the metric key to draw.
        higher_is_better: the metric's direction (shown in the y label).

    Returns:
        The PNG path.
    """
    fig = _new_figure(9.5, 5.0)
    ax = fig.add_subplot()
    colors = [f"C{i % 10}" for i in range(len(runs))]
    drawn: list[float] = []
    for color, (name, history) in zip(colors, runs.items(), strict=True):
        for suffix, label, style in _CURVES[:2]:
            rounds, values = metric_series(history, f"{stage}/{_curve_name(metric, suffix)}")
            if rounds:
                ax.plot(rounds, values, linestyle=style, marker="o", markersize=3, color=color,
                        label=f"{name}: {label}")
                drawn.extend(values)
    if not drawn:
        ax.text(0.5, 0.5, f"no '{stage}/' {metric_label(metric)} in these runs", ha="center", va="center",
                transform=ax.transAxes)
    _style_metric_axes(ax, title or _default_title(metric), metric, higher_is_better, drawn)
    if drawn:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return _save(fig, path)


#: the figure formats of :func:`save_figure`, by file extension
FIGURE_FORMATS = ("pdf", "svg", "png")

#: the band choices of :func:`plot_groups`: what the shaded area around a group's mean shows
BANDS = {"minmax": "band: min–max over seeds", "std": "band: ±1 sample std over seeds", "none": "no band"}


def group_curve(
    histories: Sequence[Sequence[HistoryRecord]], name: str
) -> tuple[list[int], np.ndarray]:
    """The rounds every run of a group evaluated ``name`` at, and the ``[runs, rounds]`` values there.

    Rounds that only some runs reached (a run stopped early) are left out, so the mean and the band
    are always over the same runs.
    """
    series = [dict(zip(*metric_series(h, name), strict=True)) for h in histories]
    common = sorted(set.intersection(*(set(s) for s in series))) if series else []
    return common, np.array([[s[r] for r in common] for s in series], dtype=np.float64).reshape(len(series), -1)


def _band(values: np.ndarray, band: str) -> tuple[np.ndarray, np.ndarray] | None:
    """The lower and upper edge of a group's band over its runs (rows), or ``None`` (one run, or no band)."""
    if band == "none" or values.shape[0] < 2:
        return None
    if band == "minmax":
        return values.min(axis=0), values.max(axis=0)
    mean, std = values.mean(axis=0), values.std(axis=0, ddof=1)
    return mean - std, mean + std


def plot_groups(
    groups: Mapping[str, Sequence[Sequence[HistoryRecord]]],
    *,
    stage: str = "val",
    metric: str = "acc",
    higher_is_better: bool = True,
    band: str = "minmax",
    worst10: bool = False,
    title: str | None = None,
    ylim: tuple[float, float] | None = None,
    size: tuple[float, float] = (6.4, 4.0),
    x_of: Mapping[str, Mapping[int, float]] | None = None,
    xlabel: str | None = None,
) -> Figure:
    """The paper figure of ``fedmeta compare``: per group, the mean over its runs and a band over them.

    Args:
        groups: legend label (e.g. the algorithm) -> the histories of the group's runs (one per seed).
        stage: ``"val"`` or ``"test"``.
        metric: the metric key; the curve is ``{stage}/{metric}_weighted``.
        higher_is_better: the metric's direction (shown in the y label).
        band: ``"minmax"`` (the runs' minimum to maximum), ``"std"`` (mean ± one sample standard deviation)
            or ``"none"``; the legend's title states it. A group of one run has no band.
        worst10: also draw the worst-decile curve (``_worst10``, dashed) of each group.
        title: the axes title; ``None`` for none (a paper's caption says it).
        ylim: the y-limits; ``None``: the values and bands drawn plus a margin (:func:`data_ylim`).
        size: the figure's width and height in inches.
        x_of: label -> round -> the x value drawn there (``fedmeta compare --x bytes``: cumulative uploaded
            megabytes); ``None``: the round.
        xlabel: the x-axis label (default: "communication round").

    Returns:
        The figure (not yet saved: :func:`save_figure`).

    Raises:
        ValueError: an unknown ``band``.
    """
    if band not in BANDS:
        raise ValueError(f"band must be one of {', '.join(BANDS)}, got {band!r}")
    fig = _new_figure(*size)
    ax = fig.add_subplot()
    curves = _CURVES[:2] if worst10 else _CURVES[:1]
    drawn: list[float] = []
    for i, (label, histories) in enumerate(groups.items()):
        for suffix, what, style in curves:
            rounds, values = group_curve(histories, f"{stage}/{_curve_name(metric, suffix)}")
            if not rounds:
                continue
            n = values.shape[0]
            name = label + (f" ({n} seeds)" if n > 1 else "") + ("" if suffix == "_weighted" else f", {what}")
            xs = [x_of[label][r] for r in rounds] if x_of is not None else rounds
            ax.plot(xs, values.mean(axis=0), linestyle=style, color=f"C{i % 10}", label=name)
            drawn.extend(values.mean(axis=0))
            edges = _band(values, band)
            if edges is not None:
                ax.fill_between(xs, *edges, color=f"C{i % 10}", alpha=0.2, linewidth=0)
                drawn.extend(np.concatenate(edges))
    _draw_group_axes(ax, title, stage, metric, higher_is_better, drawn, ylim, band)
    if xlabel is not None:
        ax.set_xlabel(xlabel)
    return fig


def _draw_group_axes(ax: Any, title: str | None, stage: str, metric: str, higher_is_better: bool,
                     drawn: Sequence[float], ylim: tuple[float, float] | None, band: str) -> None:
    """Labels, limits and the legend (titled with what the lines and bands show) of :func:`plot_groups`."""
    if title:
        ax.set_title(title)
    ax.set_xlabel("communication round")
    direction = "" if higher_is_better else " (lower is better)"
    which = "validation" if stage == "val" else "test"
    ax.set_ylabel(f"personalised {which} {metric_label(metric)}{direction}")
    ax.grid(True, alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)
    if not drawn:
        ax.text(0.5, 0.5, f"no '{stage}/' {metric_label(metric)} in these runs", ha="center", va="center",
                transform=ax.transAxes)
        return
    ax.set_ylim(*(ylim if ylim is not None else data_ylim(drawn, metric)))
    ax.legend(title=f"mean over seeds; {BANDS[band]}", fontsize="small", title_fontsize="small",
              loc="best")


def save_figure(fig: Figure, path: str | Path, dpi: int = 300, title: str | None = None) -> Path:
    """Write ``fig`` as PDF, SVG or PNG, by ``path``'s extension; ``dpi`` applies to PNG.

    The file carries its title and the program that wrote it in its metadata, and no date, so the same
    runs give the same PDF and SVG bytes.

    Raises:
        ValueError: an extension other than ``.pdf``, ``.svg`` and ``.png``.
    """
    out = Path(path)
    fmt = out.suffix.lower().lstrip(".")
    if fmt not in FIGURE_FORMATS:
        raise ValueError(f"cannot write a figure to {str(out)!r}: the extension must be .pdf, .svg or .png")
    import matplotlib

    creator = "lightning_fedmeta (fedmeta compare)"
    metadata: dict[str, Any] = {
        "pdf": {"Title": title, "Creator": creator, "CreationDate": None},
        "svg": {"Title": title, "Creator": creator, "Date": None},
        "png": {"Title": title, "Software": creator},
    }[fmt]
    out.parent.mkdir(parents=True, exist_ok=True)
    with matplotlib.rc_context({"svg.hashsalt": "lightning_fedmeta"}):
        fig.savefig(out, format=fmt, dpi=dpi if fmt == "png" else "figure",
                    metadata={k: v for k, v in metadata.items() if v is not None or k in ("CreationDate", "Date")})
    return out
