"""``fedmeta compare LOGDIR [LOGDIR ...]``: a paper figure (mean and band over seeds) and tables of runs.

Each LOGDIR is a run's log folder (or a file inside it). The run's history is read from
``fedmeta_history.json`` (written by :class:`~lightning_fedmeta.frontends.callbacks.PlotCallback`) or, when
there is none, from a CSVLogger ``metrics.csv`` (see :func:`_read_csv` for how rounds are read). When a folder
holds several versions (``lightning_logs/version_*``), the most recently written one is used.

The metric compared is ``--metric NAME`` (a metric key the module logs as ``{stage}/{NAME}_weighted``
and ``{stage}/{NAME}_worst10``, e.g. ``acc``, ``f1``, ``mse``, ``loss``); by default, the primary
metric stored in the runs' history files (runs with different primary metrics need ``--metric``),
else ``acc`` (for CSV files: the only metric besides the loss when there is no ``acc``). Its direction
is ``--mode max|min`` when given, else the one stored in the history files, else guessed from the
name (``loss``, ``mse``, ``mae``, ``rmse``, ``nll``, ``error``, ... are lower-is-better). "Best" is
the maximum of a higher-is-better metric and the minimum of a lower-is-better one.

Runs whose configuration (the ``config.yaml`` or ``hparams.yaml`` next to the history) differs only in
its seeds (:data:`SEED_KEYS`) form a group, named after its algorithm. The figure (PDF, SVG or PNG by the
``--out`` extension; a folder gets ``compare.png``) draws each group's mean over its seeds with a band
(``--band minmax|std|none``) and y-limits from the data. Printed (markdown; also ``--table FILE.md``): per
group, final weighted value, final worst decile, (when recorded) the final standard deviation of the per-client
values over the training clients and the final weighted value of the held-out (unseen, ``new``) clients, and the
best round's weighted value with its round, as mean ± sample std over its runs; the best-round column is labelled
"best round (chosen on test data)" when the runs evaluated the test split, "best round (validation)" under
``data.validation_fraction`` (the history's ``eval_split``). With ``--baseline NAME``: the paired differences of
every other group against it, seed by seed.
docs/cli.md, section ``fedmeta compare``, has an example.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from lightning_fedmeta.evaluation.fairness import best_round, best_round_label
from lightning_fedmeta.frontends.callbacks import HISTORY_FILE, read_history
from lightning_fedmeta.frontends.plots import (
    BANDS,
    FIGURE_FORMATS,
    metric_label,
    metric_series,
    plot_groups,
    save_figure,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "CONFIG_FILES",
    "SEED_KEYS",
    "CompareError",
    "Comparison",
    "Group",
    "GroupSummary",
    "Run",
    "RunInfo",
    "RunSummary",
    "algorithm_name",
    "available_metrics",
    "best_label",
    "compare_main",
    "default_higher_is_better",
    "difference_table",
    "find_history_file",
    "group_runs",
    "group_table",
    "load_run",
    "load_run_info",
    "load_runs",
    "markdown_table",
    "mean_std",
    "name_groups",
    "output_paths",
    "paired_differences",
    "read_run_config",
    "resolve_direction",
    "resolve_metric",
    "run_seed",
    "seed_text",
    "summarize_group",
    "summarize_run",
    "uploaded_megabytes",
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
    if "comm" in record:  # the byte counts (--x bytes)
        comm = record["comm"]
        if not isinstance(comm, Mapping):
            return f"has comm {comm!r}, not an object of byte counts"
        for name, value in comm.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                return f"has {name} = {value!r}, not a number"
    return None


def _read_json_history(source: Path) -> dict[str, Any]:
    """:func:`~lightning_fedmeta.frontends.callbacks.read_history` with every way the file can be malformed (unreadable,
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
        ``"acc"`` (see :func:`~lightning_fedmeta.frontends.callbacks.read_history`).

    Raises:
        FileNotFoundError: no run at ``logdir``.
        CompareError: the file is malformed (unreadable, not JSON or CSV, a record or cell of the wrong shape):
            one line naming the file and what is wrong.
    """
    source = find_history_file(logdir)
    if source.suffix == ".csv":
        return {"history": _read_csv(source), "primary_metric": None, "metric_directions": {}, "source": source,
                "algorithm": None, "eval_split": None}
    doc = _read_json_history(source)
    return {
        "history": list(doc["history"]),
        "primary_metric": doc["primary_metric"],
        "metric_directions": dict(doc["metric_directions"]),
        "source": source,
        "algorithm": doc.get("algorithm") if isinstance(doc.get("algorithm"), str) else None,
        "eval_split": doc.get("eval_split") if doc.get("eval_split") in ("test", "validation") else None,
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
    """Final and best weighted value (and the best round), final worst decile, final standard deviation over the
    training clients, final weighted value of the held-out clients, and the last evaluated round of one metric.

    Returns:
        ``{"final_{metric}_weighted", "final_{metric}_worst10", "final_{metric}_std", "final_new_{metric}_weighted",
        "best_{metric}_weighted", "best_round", "rounds"}``; "best" is the maximum when ``higher_is_better``, else
        the minimum (the earliest round on a tie; :func:`~lightning_fedmeta.evaluation.fairness.best_round`);
        ``nan`` (``best_round``: ``None``) where the run never logged the value.
    """
    rounds, weighted = metric_series(history, f"{stage}/{metric}_weighted")
    worst_rounds, worst = metric_series(history, f"{stage}/{metric}_worst10")
    _, std = metric_series(history, f"{stage}/{metric}_std")
    _, new = metric_series(history, f"{stage}/new/{metric}_weighted")
    best = best_round(history, f"{stage}/{metric}_weighted", higher_is_better, None)
    return {
        f"final_{metric}_weighted": weighted[-1] if weighted else math.nan,
        f"final_{metric}_worst10": worst[-1] if worst else math.nan,
        f"final_{metric}_std": std[-1] if std else math.nan,
        f"final_new_{metric}_weighted": new[-1] if new else math.nan,
        f"best_{metric}_weighted": best["value"] if best else math.nan,
        "best_round": best["round"] if best else None,
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



# ------------------------------------------------------------------------------------------------
# a run's configuration: its algorithm, its seeds, and the settings that make its group
# ------------------------------------------------------------------------------------------------
#: the settings that only choose randomness: runs differing only in these are seeds of one configuration
#: (``fedmeta fit``'s config.yaml: the first three; a Python run's hparams.yaml: the last two)
SEED_KEYS = ("seed_everything", "data.data_seed", "model.seed", "data_seed", "seed")

#: settings that say where or how a run wrote, not what it computed: not part of a configuration
_BOOKKEEPING_KEYS = frozenset({
    "trainer.default_root_dir", "trainer.logger", "trainer.enable_progress_bar", "trainer.enable_model_summary",
    "trainer.enable_checkpointing", "ckpt_path", "weights_only", "plots", "_instantiator", "model.client_state_dir",
    "client_state_dir", "data.root", "root", "data.download", "download",
})
_BOOKKEEPING_LEAVES = frozenset({"dirpath", "save_dir", "filename"})

#: the files next to a run's history that record its configuration, most complete first
CONFIG_FILES = ("config.yaml", "hparams.yaml")


#: the most values a run's configuration may hold once its YAML aliases are expanded (a ``fedmeta fit`` config.yaml
#: holds hundreds; aliases can make a few hundred bytes expand to 10⁹, which ``_flatten`` and ``json.dumps`` walk)
MAX_CONFIG_VALUES = 100_000


def _check_expanded_size(doc: Any, path: Path, limit: int = MAX_CONFIG_VALUES) -> None:
    """A :class:`CompareError` naming ``path`` when ``doc`` (as ``yaml.safe_load`` builds it: an alias is the
    same object again) refers to itself or holds more than ``limit`` values with every alias expanded. Each
    object is counted once (its expanded size kept), so the check costs the file's size, not the expansion's."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(obj: Any) -> int:
        if not isinstance(obj, Mapping | list):
            return 1
        if id(obj) in sizes:
            return sizes[id(obj)]
        if id(obj) in open_:
            raise CompareError(f"{path}: refers to itself (a YAML alias inside its own anchor); a run's "
                               "configuration is a tree: fix or remove the file")
        open_.add(id(obj))
        total = 1
        for child in obj.values() if isinstance(obj, Mapping) else obj:
            total += size(child)
            if total > limit:
                raise CompareError(f"{path}: its YAML aliases expand to more than {limit} values; a run's "
                                   "configuration is far smaller: fix or remove the file")
        open_.discard(id(obj))
        sizes[id(obj)] = total
        return total

    size(doc)


def _flatten(doc: Any, prefix: str = "") -> dict[str, Any]:
    """``{"model": {"seed": 0}}`` -> ``{"model.seed": 0}``; lists and other values are kept as leaves."""
    if not isinstance(doc, Mapping) or not doc:
        return {prefix: doc} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in doc.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def read_run_config(source: Path) -> dict[str, Any] | None:
    """The flattened configuration of the run whose history is ``source``: the ``config.yaml`` that
    ``fedmeta fit`` saves next to it, else the logger's ``hparams.yaml``; ``None`` when neither is there or
    readable (such a run forms a group of its own).

    Raises:
        CompareError: the file refers to itself, is nested too deeply, or its aliases expand to more than
            :data:`MAX_CONFIG_VALUES` values (:func:`_check_expanded_size`).
    """
    import yaml

    for name in CONFIG_FILES:
        path = source.parent / name
        if not path.is_file():
            continue
        try:
            doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        except RecursionError:
            raise CompareError(f"{path}: is nested too deeply for a run's configuration") from None
        if isinstance(doc, Mapping):
            _check_expanded_size(doc, path)
            return _flatten(doc)
    return None


def algorithm_name(config: Mapping[str, Any] | None) -> str | None:
    """The algorithm a configuration ran: ``model.algorithm`` (a name, ``{name: ...}`` or a ``class_path``,
    whose class name is used), or the same under ``algorithm`` in an ``hparams.yaml``."""
    if not config:
        return None
    for prefix in ("model.algorithm", "algorithm"):
        for key in (prefix, f"{prefix}.name", f"{prefix}.class_path"):
            value = config.get(key)
            if isinstance(value, str) and value:
                return value.rsplit(".", 1)[-1] if key.endswith("class_path") else value
    return None


def _is_setting(key: str) -> bool:
    return key not in _BOOKKEEPING_KEYS and key not in SEED_KEYS and key.rsplit(".", 1)[-1] not in _BOOKKEEPING_LEAVES


def run_seed(config: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    """The seed settings of a configuration (``(("seed_everything", 0), ("data.data_seed", 0), ...)``), or
    ``None`` when it records none."""
    if not config:
        return None
    found = tuple((k, config[k]) for k in SEED_KEYS if config.get(k) is not None)
    return found or None


def seed_text(seed: tuple[tuple[str, Any], ...] | None) -> str:
    """A seed for the table: ``"1"`` when every seed setting is 1, else ``"seed_everything=0 model.seed=1"``;
    ``"?"`` when unknown."""
    if seed is None:
        return "?"
    values = {str(v) for _, v in seed}
    return values.pop() if len(values) == 1 else " ".join(f"{k}={v}" for k, v in seed)


@dataclass
class Run:
    """One run to compare: its name (from its folder), history, algorithm, seeds and settings.

    ``settings`` is its configuration without the seed and bookkeeping keys, values as JSON text (``None``
    when no configuration file was found: the run is a group of its own).
    """

    name: str
    info: RunInfo
    algorithm: str | None
    seed: tuple[tuple[str, Any], ...] | None
    settings: dict[str, str] | None


@dataclass
class Group:
    """Runs of one configuration (they differ only in their seeds), under one legend label."""

    label: str
    runs: list[Run] = field(default_factory=list)


def _run_names(logdirs: Sequence[str]) -> list[str]:
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


def load_runs(logdirs: Sequence[str]) -> list[Run]:
    """Each LOGDIR's history (:func:`load_run_info`) with its configuration (:func:`read_run_config`)."""
    runs = []
    for name, logdir in zip(_run_names(logdirs), logdirs, strict=True):
        info = load_run_info(logdir)
        config = read_run_config(Path(info["source"]))
        settings = None if config is None else {
            k: json.dumps(v, sort_keys=True, default=str) for k, v in config.items() if _is_setting(k)
        }
        runs.append(Run(name, info, algorithm_name(config) or info.get("algorithm"), run_seed(config), settings))
    return runs


def group_runs(runs: Sequence[Run], grouped: bool = True) -> list[Group]:
    """Runs with the same settings (differing only in seeds) as one group each, in order of first appearance;
    ``grouped=False``: one group per run. Labels: :func:`_group_labels`.

    Raises:
        CompareError: two runs of one group have the same seeds (the same run twice).
    """
    members: dict[str, list[Run]] = {}
    for run in runs:
        key = json.dumps(run.settings, sort_keys=True) if grouped and run.settings is not None else f"run:{run.name}"
        members.setdefault(key, []).append(run)
    for group in members.values():
        seen: dict[Any, str] = {}
        for run in group:
            if run.seed in seen:
                raise CompareError(
                    f"runs {seen[run.seed]!r} and {run.name!r} have the same configuration and the same seed "
                    f"({seed_text(run.seed)}): the same run twice would count twice in the mean; pass one of them"
                )
            seen[run.seed] = run.name
    groups = [sorted(g, key=lambda run: _seed_order(run.seed)) for g in members.values()]
    return [Group(label, g) for label, g in zip(_group_labels(groups, grouped), groups, strict=True)]


def _seed_order(seed: tuple[tuple[str, Any], ...] | None) -> tuple[Any, ...]:
    """Sort key of a seed: numbers by value, unknown seeds last."""
    if seed is None:
        return (1,)
    return (0, *((0, float(v), "") if isinstance(v, int | float) else (1, 0.0, str(v)) for _, v in seed))


def _group_labels(groups: Sequence[Sequence[Run]], grouped: bool) -> list[str]:
    """Each group's algorithm (a run without configuration, or ``grouped=False``: the run's folder name); where
    two groups share an algorithm, the settings in which they differ follow it: ``fedavg (local_lr=0.1)``."""
    bases = [g[0].algorithm if grouped and g[0].settings is not None and g[0].algorithm else g[0].name for g in groups]
    labels = list(bases)
    for base in {b for b in bases if bases.count(b) > 1}:
        same = [i for i, b in enumerate(bases) if b == base and groups[i][0].settings is not None]
        keys = sorted({k for i in same for k in groups[i][0].settings or {}})
        differ = [k for k in keys if len({(groups[i][0].settings or {}).get(k) for i in same}) > 1]
        for i in same:
            shown = ", ".join(f"{k.rsplit('.', 1)[-1]}={(groups[i][0].settings or {}).get(k, 'unset')}"
                              for k in differ[:3])
            labels[i] = f"{base} ({shown}{', ...' if len(differ) > 3 else ''})" if shown else base
    for i, label in enumerate(labels):
        while label in labels[:i]:
            label = f"{label}'"
        labels[i] = label
    return labels


def name_groups(groups: Sequence[Group], labels: Sequence[str] | None) -> None:
    """Rename the groups to ``labels`` (``--labels``), in order.

    Raises:
        CompareError: not one label per group, or a label given twice.
    """
    if not labels:
        return
    if len(labels) != len(groups):
        found = "; ".join(f"{g.label}: {', '.join(r.name for r in g.runs)}" for g in groups)
        raise CompareError(
            f"--labels has {len(labels)} names for {len(groups)} groups ({found}); runs that differ only in their "
            "seeds form one group: give one name per group, in this order (or --no-group for one per run)"
        )
    if len(set(labels)) != len(labels):
        raise CompareError(f"--labels names a group twice ({', '.join(labels)}); give each group its own name")
    for group, label in zip(groups, labels, strict=True):
        group.label = label


# ------------------------------------------------------------------------------------------------
# statistics over seeds and the paired differences
# ------------------------------------------------------------------------------------------------
GroupSummary = dict[str, Any]


def _stat_keys(metric: str) -> tuple[str, ...]:
    """The values summarised over seeds, in the order of the table's columns."""
    return (f"final_{metric}_weighted", f"final_{metric}_worst10", f"final_{metric}_std",
            f"final_new_{metric}_weighted", f"best_{metric}_weighted")


def _shown_keys(summaries: Mapping[str, GroupSummary], metric: str) -> list[str]:
    """:func:`_stat_keys` without the spread and unseen-client columns when no run records them (older histories,
    no held-out clients)."""
    optional = (f"final_{metric}_std", f"final_new_{metric}_weighted")
    return [k for k in _stat_keys(metric)
            if k not in optional or any(math.isfinite(v) for s in summaries.values() for v in _finite_runs(s, k))]


def _finite_runs(summary: GroupSummary, key: str) -> list[float]:
    """The per-run values of ``key`` in a group summary, or in a paired-difference row (its mean)."""
    runs = summary.get("per_run")
    return [float(r[key]) for r in runs] if runs is not None else [float(summary.get(key, math.nan))]


def best_label(infos: Sequence[RunInfo]) -> str:
    """The best-round label of a comparison: the runs' common ``eval_split`` (``"test"``: chosen on test data;
    ``"validation"``); runs that differ or do not record it: "split not recorded"."""
    splits = {info.get("eval_split") for info in infos}
    return best_round_label(splits.pop() if len(splits) == 1 else None)


def mean_std(values: Sequence[float]) -> tuple[float, float, int]:
    """Mean, sample standard deviation (n − 1; ``nan`` for fewer than two) and count of the finite ``values``."""
    finite = [float(v) for v in values if math.isfinite(float(v))]
    if not finite:
        return math.nan, math.nan, 0
    mean = math.fsum(finite) / len(finite)
    if len(finite) < 2:
        return mean, math.nan, len(finite)
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in finite) / (len(finite) - 1)), len(finite)


def summarize_group(
    group: Group, stage: str = "val", metric: str = "acc", higher_is_better: bool = True
) -> GroupSummary:
    """Each of :func:`summarize_run`'s values as mean and sample std over the group's runs.

    Returns:
        ``{"n", "seeds": [text], "runs": [name], "rounds": [last round per run], "best_rounds": [best round per
        run], "per_run": [RunSummary], key: mean, f"{key}_std": std}`` for the keys of :func:`_stat_keys`.
    """
    per_run = [summarize_run(r.info["history"], stage, metric, higher_is_better) for r in group.runs]
    out: GroupSummary = {"n": len(per_run), "seeds": [seed_text(r.seed) for r in group.runs],
                         "runs": [r.name for r in group.runs], "rounds": [s["rounds"] for s in per_run],
                         "best_rounds": [s["best_round"] for s in per_run if s["best_round"] is not None],
                         "per_run": per_run}
    for key in _stat_keys(metric):
        out[key], out[f"{key}_std"], _ = mean_std([s[key] for s in per_run])
    return out


def paired_differences(groups: Sequence[Group], summaries: Mapping[str, GroupSummary], baseline: str,
                       metric: str = "acc") -> dict[str, GroupSummary]:
    """Each group minus the ``baseline`` group, seed by seed (same seeds paired), as mean and sample std.

    Returns:
        label -> ``{"seeds": [text of the paired seeds], key: mean difference, f"{key}_std": std}`` for every
        group but the baseline (``nan`` and no seeds where the two share none).

    Raises:
        CompareError: no group is called ``baseline``, or a run of it records no seed.
    """
    by_label = {g.label: g for g in groups}
    if baseline not in by_label:
        raise CompareError(f"--baseline {baseline!r} is not a group; the groups are {', '.join(by_label)} "
                           "(algorithm names, or the names given with --labels)")
    base = _runs_by_seed(by_label[baseline], summaries[baseline], for_baseline=True)
    out: dict[str, GroupSummary] = {}
    for group in groups:
        if group.label == baseline:
            continue
        other = _runs_by_seed(group, summaries[group.label], for_baseline=False)
        common = [s for s in base if s in other]
        row: GroupSummary = {"seeds": [seed_text(s) for s in common]}
        for key in _stat_keys(metric):
            row[key], row[f"{key}_std"], _ = mean_std([other[s][key] - base[s][key] for s in common])
        out[group.label] = row
    return out


def _runs_by_seed(group: Group, summary: GroupSummary, for_baseline: bool) -> dict[Any, RunSummary]:
    """seed -> the run's summary; runs without a recorded seed are left out (the baseline's are refused)."""
    found: dict[Any, RunSummary] = {}
    for run, run_summary in zip(group.runs, summary["per_run"], strict=True):
        if run.seed is None and for_baseline:
            raise CompareError(
                f"--baseline {group.label!r}: run {run.name!r} records no seed (no config.yaml or hparams.yaml "
                "next to its history), so no run can be paired with it; compare runs written by `fedmeta fit`, "
                "or leave out --baseline"
            )
        if run.seed is not None:
            found[run.seed] = run_summary
    return dict(sorted(found.items(), key=lambda item: seed_text(item[0])))


# ------------------------------------------------------------------------------------------------
# the tables
# ------------------------------------------------------------------------------------------------
def _cell(mean: float, std: float, signed: bool = False) -> str:
    """``0.8424 ± 0.0100`` (``+0.0312 ± ...`` when ``signed``); the mean alone without a std; ``n/a`` without one."""
    if math.isnan(mean):
        return "n/a"
    text = f"{mean:+.4f}" if signed else f"{mean:.4f}"
    return text if math.isnan(std) else f"{text} ± {std:.4f}"


def _rounds_text(rounds: Sequence[int]) -> str:
    if not rounds:
        return "n/a"
    lo, hi = min(rounds), max(rounds)
    return str(hi) if lo == hi else f"{lo}–{hi}"


def _headings(metric: str, higher_is_better: bool, label: str) -> dict[str, str]:
    """Column heading of each :func:`_stat_keys` value."""
    return {f"final_{metric}_weighted": f"final weighted {metric}", f"final_{metric}_worst10": "final worst decile",
            f"final_{metric}_std": "final std over clients",
            f"final_new_{metric}_weighted": f"final unseen clients weighted {metric}",
            f"best_{metric}_weighted": f"{label}: weighted {metric}" + ("" if higher_is_better else " (min)")}


def group_table(groups: Sequence[Group], summaries: Mapping[str, GroupSummary], metric: str = "acc",
                higher_is_better: bool = True, label: str | None = None) -> str:
    """The markdown table of groups: runs, seeds, and each value as mean ± sample std over the runs; the final
    round first (the headline), the best round's value labelled with the split it was chosen on (``label``,
    :func:`best_label`), its round and the last round."""
    label = label or best_round_label(None)
    keys = _shown_keys(summaries, metric)
    heads = _headings(metric, higher_is_better, label)
    lines = ["| group | runs | seeds | " + " | ".join(heads[k] for k in keys) + " | best round | rounds |",
             "|---|---:|---|" + "---:|" * (len(keys) + 2)]
    for g in groups:
        s = summaries[g.label]
        cells = " | ".join(_cell(s[k], s[f"{k}_std"]) for k in keys)
        lines.append(f"| {g.label} | {s['n']} | {', '.join(s['seeds'])} | {cells} | "
                     f"{_rounds_text(s['best_rounds'])} | {_rounds_text(s['rounds'])} |")
    lines.append("\nValues: mean ± sample standard deviation (n − 1) over the runs of a group (one run: its value). "
                 "Std over clients: unweighted over the training clients; unseen clients: the held-out (`new`) ones.")
    return "\n".join(lines)


def difference_table(differences: Mapping[str, GroupSummary], baseline: str, metric: str = "acc",
                     higher_is_better: bool = True, label: str | None = None) -> str:
    """The markdown table of :func:`paired_differences` against ``baseline``."""
    keys = _shown_keys(differences, metric)
    heads = _headings(metric, higher_is_better, label or best_round_label(None))
    lines = [f"Paired differences against {baseline} (group − {baseline}, seed by seed over the seeds both ran; "
             "mean ± sample std):\n",
             "| group | paired seeds | " + " | ".join(f"Δ {heads[k]}" for k in keys) + " |",
             "|---|---|" + "---:|" * len(keys)]
    for name, d in differences.items():
        cells = " | ".join(_cell(d[k], d[f"{k}_std"], signed=True) for k in keys)
        lines.append(f"| {name} | {', '.join(d['seeds']) or 'none in common'} | {cells} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# the command
# ------------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedmeta compare",
        description="Compare runs for a paper: runs that differ only in their seeds form a group; one figure "
        "(mean over seeds with a band) and markdown tables (mean ± std, paired differences against a baseline).",
    )
    p.add_argument("logdirs", nargs="+", metavar="LOGDIR", help="a run's log folder (or its fedmeta_history.json)")
    p.add_argument("--out", nargs="+", default=["."], metavar="PATH",
                   help="figure files by extension (.pdf, .svg, .png), or a folder for compare.png (default: .)")
    p.add_argument("--table", default=None, metavar="FILE.md", help="also write the tables to this markdown file")
    p.add_argument("--labels", nargs="+", default=None, help="names of the groups, in the order of first appearance")
    p.add_argument("--baseline", default=None, metavar="NAME",
                   help="a group (its label) to subtract from each other group, seed by seed")
    p.add_argument("--band", choices=tuple(BANDS), default="minmax",
                   help="the shaded band around each group's mean: min–max over seeds (default), ±1 sample std, none")
    p.add_argument("--no-group", dest="grouped", action="store_false", help="one curve and row per run")
    p.add_argument("--worst10", action="store_true", help="also draw each group's worst-decile curve (dashed)")
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
    p.add_argument("--x", choices=("round", "bytes"), default="round",
                   help="the x axis: the communication round (default) or the cumulative uploaded megabytes "
                   "(comm/up_bytes_cumulative / 10^6, from the history files; docs/communication.md)")
    p.add_argument("--title", default=None, help="title over the plot (default: none; a paper's caption says it)")
    p.add_argument("--ylim", nargs=2, type=float, default=None, metavar=("LOW", "HIGH"),
                   help="y-axis limits (default: the data drawn plus a margin)")
    p.add_argument("--size", nargs=2, type=float, default=(6.4, 4.0), metavar=("WIDTH", "HEIGHT"),
                   help="figure size in inches (default: 6.4 4.0)")
    p.add_argument("--dpi", type=int, default=300, help="resolution of a PNG (default: 300)")
    return p


UPLOAD_AXIS = "cumulative upload per run (MB = 10^6 bytes)"


def uploaded_megabytes(group: Group, stage: str) -> dict[int, float]:
    """Round -> the bytes the group's runs had uploaded by that evaluation (``comm.up_bytes_cumulative`` of the
    history entries, in MB = 10⁶ bytes), the mean over the runs that record the round (runs differing in their
    seeds upload the same sizes unless clients drop out).

    Raises:
        CompareError: a run whose history records no bytes (a CSV log, or a run from before byte accounting).
    """
    sums: dict[int, list[float]] = {}
    for run in group.runs:
        entries = [h for h in run.info["history"] if h.get("stage") == stage]
        if not entries or any("comm/up_bytes_cumulative" not in h.get("comm", {}) for h in entries):
            raise CompareError(f"--x bytes: run {run.name} records no byte counts in its {stage} history (a "
                               "metrics.csv, or a run from before byte accounting); rerun it or compare by round")
        for h in entries:
            sums.setdefault(int(h["round"]), []).append(h["comm"]["comm/up_bytes_cumulative"] / 1e6)
    return {r: sum(v) / len(v) for r, v in sums.items()}


def output_paths(outs: Sequence[str]) -> list[Path]:
    """The figure files of ``--out``: a path ending in ``.pdf``/``.svg``/``.png`` is that file; a folder (or a path
    without an extension) gets ``compare.png``.

    Raises:
        CompareError: another extension.
    """
    paths = []
    for out in outs:
        p = Path(out)
        if p.suffix.lower().lstrip(".") in FIGURE_FORMATS:
            paths.append(p)
        elif p.is_dir() or not p.suffix:
            paths.append(p / "compare.png")
        else:
            raise CompareError(f"--out {out}: cannot write a {p.suffix} figure; give a .pdf, .svg or .png file, "
                               "or a folder for compare.png")
    return paths


@dataclass
class Comparison:
    """What ``fedmeta compare`` computed and wrote (:func:`compare_main` returns it).

    Attributes:
        metric, higher_is_better, stage: what was compared.
        groups: the groups of runs, in order, with their labels (the figure's legend).
        summaries: label -> :func:`summarize_group`.
        differences: label -> :func:`paired_differences` against ``baseline`` (``None`` without one).
        baseline: the ``--baseline`` group, if any.
        table: the markdown printed (and written to ``--table``).
        figure: the matplotlib figure (legend, limits: ``figure.axes[0]``).
        written: the figure files written.
    """

    metric: str
    higher_is_better: bool
    stage: str
    groups: list[Group]
    summaries: dict[str, GroupSummary]
    differences: dict[str, GroupSummary] | None
    baseline: str | None
    table: str
    figure: Figure
    written: list[Path]


def compare_main(argv: Sequence[str] | None = None, stream: TextIO | None = None) -> Comparison:
    """Entry of ``fedmeta compare``: groups the runs, writes the figure(s), prints the tables.

    Raises:
        FileNotFoundError: a LOGDIR holds no run.
        CompareError: mismatched ``--labels``, an unknown ``--baseline``, a figure extension other than
            ``.pdf``/``.svg``/``.png``, runs with different primary metrics and no ``--metric``, a metric that
            no run logs, or the same configuration and seed twice.
    """
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    paths = output_paths(args.out)
    runs = load_runs(args.logdirs)
    infos = {run.name: run.info for run in runs}
    metric = resolve_metric(infos, args.metric, args.stage)
    _check_metric_logged(infos, metric, args.stage)
    higher = resolve_direction(infos, metric, args.mode)
    groups = group_runs(runs, args.grouped)
    name_groups(groups, args.labels)
    summaries = {g.label: summarize_group(g, args.stage, metric, higher) for g in groups}
    label = best_label([run.info for run in runs])
    table = group_table(groups, summaries, metric, higher, label)
    differences = None
    if args.baseline is not None:
        differences = paired_differences(groups, summaries, args.baseline, metric)
        table += "\n\n" + difference_table(differences, args.baseline, metric, higher, label)
    x_of = {g.label: uploaded_megabytes(g, args.stage) for g in groups} if args.x == "bytes" else None
    figure = plot_groups({g.label: [r.info["history"] for r in g.runs] for g in groups}, stage=args.stage,
                         metric=metric, higher_is_better=higher, band=args.band, worst10=args.worst10,
                         title=args.title, ylim=tuple(args.ylim) if args.ylim else None, size=tuple(args.size),
                         x_of=x_of, xlabel=UPLOAD_AXIS if x_of is not None else None)
    against = "cumulative upload (MB)" if x_of is not None else "round"
    title = args.title or f"Personalised {metric_label(metric)} vs. {against}"
    written = [save_figure(figure, p, dpi=args.dpi, title=title) for p in paths]
    if args.table:
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table).write_text(table + "\n", encoding="utf-8")
    out = stream or sys.stdout
    print(table, file=out)
    print("\n" + "\n".join(f"figure: {p}" for p in written), file=out)
    return Comparison(metric, higher, args.stage, groups, summaries, differences, args.baseline, table, figure, written)
