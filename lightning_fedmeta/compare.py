"""``fedmeta compare LOGDIR [LOGDIR ...]``: several runs on one metric-vs-round plot, and a table.

Each LOGDIR is a run's log folder (or a file inside it). The run's history is read from
``fedmeta_history.json`` (written by :class:`~lightning_fedmeta.callbacks.PlotCallback`) or, when
there is none, from a CSVLogger ``metrics.csv`` (see :func:`_read_csv` for how rounds are read). When a folder
holds several versions (``lightning_logs/version_*``), the most recently written one is used.

The metric compared is ``--metric NAME`` (a metric key the module logs as ``{stage}/{NAME}_weighted``
and ``{stage}/{NAME}_worst10``, e.g. ``acc``, ``f1``, ``mse``, ``loss``); by default, the primary
metric stored in the runs' history files (runs with different primary metrics need ``--metric``),
else ``acc`` (for CSV files: the only metric besides the loss when there is no ``acc``). Its direction
is ``--mode max|min`` when given, else the one stored in the history files, else guessed from the
name (``loss``, ``mse``, ``mae``, ``rmse``, ``nll``, ``error``, ... are lower-is-better). "Best" is
the maximum of a higher-is-better metric and the minimum of a lower-is-better one.

Printed (markdown): run, final weighted value, final worst-decile value, best weighted value, and
rounds (the last evaluated round); the headings name the metric. ``compare.png`` goes to ``--out``
(default ``.``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from lightning_fedmeta.callbacks import HISTORY_FILE, read_history
from lightning_fedmeta.plots import metric_label, metric_series, plot_compare

__all__ = [
    "CompareError",
    "RunInfo",
    "RunSummary",
    "available_metrics",
    "compare_main",
    "default_higher_is_better",
    "find_history_file",
    "load_run",
    "load_run_info",
    "markdown_table",
    "resolve_direction",
    "resolve_metric",
    "summarize_run",
]

RunSummary = dict[str, Any]
RunInfo = dict[str, Any]

# name fragments of lower-is-better metrics, for runs whose history does not store the direction
_LOWER_IS_BETTER_HINTS = ("loss", "mse", "mae", "rmse", "msle", "mape", "nll", "error", "perplexity", "distance")


class CompareError(ValueError):
    """A ``fedmeta compare`` request that cannot be answered (the ``fedmeta`` command prints its message alone)."""


def find_history_file(logdir: str | Path) -> Path:
    """The history source of a run: ``fedmeta_history.json`` if present, else ``metrics.csv``.

    ``logdir`` may be either file itself, or a folder searched recursively (newest file wins).
    """
    path = Path(logdir)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"no such run folder or file: {str(path)!r}")
    for name in (HISTORY_FILE, "metrics.csv"):
        direct = path / name
        if direct.is_file():
            return direct
        found = sorted(path.rglob(name), key=lambda p: p.stat().st_mtime)
        if found:
            return found[-1]
    raise FileNotFoundError(
        f"{str(path)!r} has no {HISTORY_FILE} (written by PlotCallback, on by default in `fedmeta fit`) "
        "and no metrics.csv (written by CSVLogger); point to a run's log folder"
    )


def _csv_number(value: str, path: Path, line: int, column: str) -> float:
    """``float(value)`` of a ``metrics.csv`` cell; a cell that is not a number is a :class:`CompareError` naming
    the file, the line and the column."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise CompareError(f"{path}: line {line}, column {column!r} holds {value!r}, not a number; "
                           "metrics.csv is not a CSVLogger file, or it is damaged") from None


def _read_csv(path: Path) -> list[dict[str, Any]]:
    """History records from a CSVLogger ``metrics.csv`` (its ``val/`` and ``test/`` columns).

    The round of a row is its ``{stage}/round`` column when the module logs one; otherwise it is
    derived from ``step``: Lightning logs a validation inside ``fit`` at ``step = rounds - 1`` (before
    the step counter of the round that triggered it advances) and a test at ``step = rounds``.

    Raises:
        CompareError: the file cannot be read, is not text, or a cell that must be a number is not one.
    """
    by_key: dict[tuple[int, str], dict[str, float]] = {}
    try:
        with open(path, newline="", encoding="utf-8") as f:
            for line, row in enumerate(csv.DictReader(f), start=2):
                if row.get("step") in (None, ""):
                    continue
                step = int(_csv_number(row["step"], path, line, "step"))
                for stage in ("val", "test"):
                    values = {
                        str(name): _csv_number(v, path, line, str(name)) for name, v in row.items()
                        if str(name).startswith(f"{stage}/") and name != f"{stage}/round" and v not in (None, "")
                    }
                    if not values:
                        continue
                    explicit = row.get(f"{stage}/round")
                    r = (int(_csv_number(explicit, path, line, f"{stage}/round")) if explicit not in (None, "")
                         else step + (1 if stage == "val" else 0))
                    by_key.setdefault((r, stage), {}).update(values)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise CompareError(f"{path}: cannot be read as a CSVLogger metrics.csv ({type(exc).__name__}: {exc})") from None
    ordered = sorted(by_key.items(), key=lambda item: (item[0][0], item[0][1] != "val"))
    return [{"round": r, "stage": s, "metrics": m} for (r, s), m in ordered]


#: the shape of a history record, for the messages about a malformed one
_RECORD_SHAPE = '{"round": integer, "stage": "val" or "test", "metrics": {name: number}}'


def _record_problem(record: Any) -> str | None:
    """What is wrong with one record of a history file's ``history`` list, or ``None``."""
    if not isinstance(record, Mapping):
        return f"is {type(record).__name__} {record!r}, not an object"
    if "round" not in record:
        return "has no 'round'"
    r = record["round"]
    if isinstance(r, bool) or not isinstance(r, int):
        return f"has round {r!r}, not an integer"
    if not isinstance(record.get("stage", ""), str):
        return f"has stage {record['stage']!r}, not a string"
    metrics = record.get("metrics", {})
    if not isinstance(metrics, Mapping):
        return f"has metrics {metrics!r}, not an object"
    for name, value in metrics.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            return f"has metric {name!r} = {value!r}, not a number"
    return None


def _read_json_history(source: Path) -> dict[str, Any]:
    """:func:`~lightning_fedmeta.callbacks.read_history` with every way the file can be malformed (unreadable,
    not UTF-8, not JSON, not a history object, a record of the wrong shape) a one-line :class:`CompareError`
    naming the file and what is wrong."""
    try:
        doc = read_history(source)
    except OSError as exc:
        raise CompareError(f"{source}: cannot be read ({exc.strerror or exc})") from None
    except UnicodeDecodeError:
        raise CompareError(f"{source} is not a fedmeta history file (not UTF-8 text)") from None
    except json.JSONDecodeError as exc:
        raise CompareError(f"{source} is not a fedmeta history file (not JSON: {exc.msg} at line {exc.lineno}, "
                           f"column {exc.colno})") from None
    except RecursionError:
        raise CompareError(f"{source} is not a fedmeta history file (nested too deeply)") from None
    except ValueError as exc:  # read_history's own message names the file
        raise CompareError(str(exc)) from None
    for i, record in enumerate(doc["history"]):
        problem = _record_problem(record)
        if problem is not None:
            raise CompareError(f"{source}: history record {i} {problem}; each record is {_RECORD_SHAPE}")
    return doc


def load_run_info(logdir: str | Path) -> RunInfo:
    """The history of one run and what it says about its metrics.

    Returns:
        ``{"history": [{"round", "stage", "metrics"}, ...], "primary_metric": str | None,
        "metric_directions": {metric: higher_is_better}, "source": Path}``; a CSVLogger file stores no
        primary metric (``None``) and no directions (``{}``), a version-1 history file reads as
        ``"acc"`` (see :func:`~lightning_fedmeta.callbacks.read_history`).

    Raises:
        FileNotFoundError: no run at ``logdir``.
        CompareError: the file is malformed (unreadable, not JSON or CSV, a record or cell of the wrong shape):
            one line naming the file and what is wrong.
    """
    source = find_history_file(logdir)
    if source.suffix == ".csv":
        return {"history": _read_csv(source), "primary_metric": None, "metric_directions": {}, "source": source}
    doc = _read_json_history(source)
    return {
        "history": list(doc["history"]),
        "primary_metric": doc["primary_metric"],
        "metric_directions": dict(doc["metric_directions"]),
        "source": source,
    }


def load_run(logdir: str | Path) -> list[dict[str, Any]]:
    """The history records (``{"round", "stage", "metrics"}``) of one run."""
    return load_run_info(logdir)["history"]


def available_metrics(history: Sequence[Mapping[str, Any]], stage: str = "val") -> list[str]:
    """The metric keys ``m`` with a ``{stage}/{m}_weighted`` value in the history, in order of appearance."""
    found: dict[str, None] = {}
    prefix, suffix = f"{stage}/", "_weighted"
    for rec in history:
        for name in rec.get("metrics", {}):
            if name.startswith(prefix) and name.endswith(suffix) and not name.startswith(f"{prefix}new/"):
                found.setdefault(name[len(prefix):-len(suffix)], None)
    return list(found)


def default_higher_is_better(metric: str) -> bool:
    """A guess of a metric's direction from its name: ``False`` for losses and errors, else ``True``."""
    name = metric.lower()
    return not any(hint in name for hint in _LOWER_IS_BETTER_HINTS)


def resolve_metric(infos: Mapping[str, RunInfo], metric: str | None = None, stage: str = "val") -> str:
    """The metric to compare: ``metric`` if given, else the runs' common primary metric.

    Runs read from CSV files store no primary metric: when none of the runs does, the result is
    ``"acc"`` if any run logs it, else the single metric besides ``loss`` that all runs log, else
    ``"acc"``.

    Raises:
        CompareError: the history files name different primary metrics and ``metric`` is ``None``.
    """
    if metric:
        return metric
    primaries = {name: info["primary_metric"] for name, info in infos.items() if info.get("primary_metric")}
    if len(set(primaries.values())) > 1:
        listed = ", ".join(f"{name}: {m}" for name, m in primaries.items())
        common = _common_metrics(infos, stage)
        hint = f" (metrics every run logs: {', '.join(common)})" if common else ""
        raise CompareError(
            f"the runs have different primary metrics ({listed}); choose the one to compare with "
            f"--metric NAME{hint}"
        )
    if primaries:
        return next(iter(primaries.values()))
    per_run = [available_metrics(info["history"], stage) for info in infos.values()]
    if any("acc" in ms for ms in per_run):
        return "acc"
    candidates = [m for m in _common_metrics(infos, stage) if m != "loss"]
    return candidates[0] if len(candidates) == 1 else "acc"


def _common_metrics(infos: Mapping[str, RunInfo], stage: str) -> list[str]:
    per_run = [available_metrics(info["history"], stage) for info in infos.values()]
    if not per_run:
        return []
    return [m for m in per_run[0] if all(m in ms for ms in per_run[1:])]


def resolve_direction(infos: Mapping[str, RunInfo], metric: str, mode: str | None = None) -> bool:
    """Whether ``metric`` is higher-is-better: ``mode`` (``"max"``/``"min"``) if given, else the
    direction stored in the history files, else :func:`default_higher_is_better`.

    Raises:
        CompareError: the history files disagree on the direction and ``mode`` is ``None``.
    """
    if mode is not None:
        if mode not in ("max", "min"):
            raise CompareError(f"mode must be 'max' or 'min', got {mode!r}")
        return mode == "max"
    stored = {name: bool(info["metric_directions"][metric]) for name, info in infos.items()
              if metric in info.get("metric_directions", {})}
    if len(set(stored.values())) > 1:
        listed = ", ".join(f"{name}: {'higher' if v else 'lower'} is better" for name, v in stored.items())
        raise CompareError(f"the runs disagree on the direction of {metric!r} ({listed}); pass --mode max or min")
    if stored:
        return next(iter(stored.values()))
    return default_higher_is_better(metric)


def summarize_run(
    history: Sequence[dict[str, Any]], stage: str = "val", metric: str = "acc", higher_is_better: bool = True
) -> RunSummary:
    """Final and best weighted value, final worst decile, and the last evaluated round of one metric.

    Returns:
        ``{"final_{metric}_weighted", "final_{metric}_worst10", "best_{metric}_weighted", "rounds"}``;
        "best" is the maximum when ``higher_is_better``, else the minimum; ``nan`` where the run
        never logged the value.
    """
    rounds, weighted = metric_series(history, f"{stage}/{metric}_weighted")
    worst_rounds, worst = metric_series(history, f"{stage}/{metric}_worst10")
    best = max if higher_is_better else min
    return {
        f"final_{metric}_weighted": weighted[-1] if weighted else math.nan,
        f"final_{metric}_worst10": worst[-1] if worst else math.nan,
        f"best_{metric}_weighted": best(weighted) if weighted else math.nan,
        "rounds": rounds[-1] if rounds else (worst_rounds[-1] if worst_rounds else 0),
    }


def _fmt(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.4f}"


def markdown_table(summaries: dict[str, RunSummary], metric: str = "acc", higher_is_better: bool = True) -> str:
    """A markdown table with one row per run (summaries from :func:`summarize_run` with the same ``metric``).

    The headings name the metric (``final weighted acc``, ``best weighted mse (min)``, ...); the best
    column of a lower-is-better metric says ``(min)``.
    """
    best = f"best weighted {metric}" + ("" if higher_is_better else " (min)")
    lines = [
        f"| run | final weighted {metric} | final worst decile | {best} | rounds |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, s in summaries.items():
        lines.append(
            f"| {name} | {_fmt(s[f'final_{metric}_weighted'])} | {_fmt(s[f'final_{metric}_worst10'])} | "
            f"{_fmt(s[f'best_{metric}_weighted'])} | {s['rounds']} |"
        )
    return "\n".join(lines)


def _run_names(logdirs: Sequence[str], labels: Sequence[str] | None) -> list[str]:
    if labels:
        if len(labels) != len(logdirs):
            raise CompareError(f"--labels has {len(labels)} names for {len(logdirs)} runs; give one per run")
        return list(labels)
    names: list[str] = []
    for d in logdirs:
        p = Path(d).resolve()
        if p.is_file():
            p = p.parent
        name = p.name if not p.name.startswith("version_") else f"{p.parent.name}/{p.name}"
        while name in names:
            name = f"{name}'"
        names.append(name)
    return names


def _check_metric_logged(infos: Mapping[str, RunInfo], metric: str, stage: str) -> None:
    """Refuse a metric that no run logs while the runs do log others (a typo, or the wrong default)."""
    per_run = {name: available_metrics(info["history"], stage) for name, info in infos.items()}
    if any(metric in ms for ms in per_run.values()):
        return
    logged = list(dict.fromkeys(m for ms in per_run.values() for m in ms))
    if logged:
        raise CompareError(
            f"no run logs '{stage}/{metric}_weighted'; the runs log {', '.join(logged)}: "
            "choose one with --metric NAME"
        )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedmeta compare",
        description="Plot several runs' personalised metric against the round and print a markdown table.",
    )
    p.add_argument("logdirs", nargs="+", metavar="LOGDIR", help="a run's log folder (or its fedmeta_history.json)")
    p.add_argument("--out", default=".", help="folder for compare.png (default: current folder)")
    p.add_argument("--labels", nargs="+", default=None, help="names of the runs, in the LOGDIR order")
    p.add_argument("--stage", choices=("val", "test"), default="val", help="which evaluations to compare")
    p.add_argument(
        "--metric", default=None, metavar="NAME",
        help="the metric key to compare (columns {stage}/NAME_weighted and _worst10, e.g. acc, f1, mse, loss); "
        "default: the primary metric stored in the runs' history, else acc",
    )
    p.add_argument(
        "--mode", choices=("max", "min"), default=None,
        help="whether the best value is the maximum or the minimum; default: the direction stored in the "
        "runs' history, else guessed from the name (losses and errors: min)",
    )
    p.add_argument("--title", default=None, help="title of the plot (default: 'Personalised <metric> vs. round')")
    return p


def compare_main(argv: Sequence[str] | None = None, stream: TextIO | None = None) -> dict[str, RunSummary]:
    """Entry of ``fedmeta compare``: writes ``<out>/compare.png``, prints the table, returns the summaries.

    Raises:
        FileNotFoundError: a LOGDIR holds no run.
        CompareError: mismatched ``--labels``, runs with different primary metrics and no ``--metric``,
            or a metric that no run logs.
    """
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    out = stream or sys.stdout
    names = _run_names(args.logdirs, args.labels)
    infos = {name: load_run_info(d) for name, d in zip(names, args.logdirs, strict=True)}
    metric = resolve_metric(infos, args.metric, args.stage)
    _check_metric_logged(infos, metric, args.stage)
    higher = resolve_direction(infos, metric, args.mode)
    runs = {name: info["history"] for name, info in infos.items()}
    summaries = {name: summarize_run(h, args.stage, metric, higher) for name, h in runs.items()}
    title = args.title or f"Personalised {metric_label(metric)} vs. round"
    png = plot_compare(runs, Path(args.out) / "compare.png", stage=args.stage, title=title,
                       metric=metric, higher_is_better=higher)
    print(markdown_table(summaries, metric, higher), file=out)
    print(f"\nplot: {png}", file=out)
    return summaries
