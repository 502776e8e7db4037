"""Plugin registries over entry-point groups: algorithms (``lightning_fedmeta.algorithms``), robust
aggregation rules (``lightning_fedmeta.aggregators``), datasets (``lightning_fedmeta.datasets``) and
partitioners (``lightning_fedmeta.partitioners``), one :class:`PluginRegistry` each.

Built-ins are registered through this package's own ``pyproject.toml`` entry points,
exactly as a third-party package registers its own. Listing reads the installed metadata only
(nothing is imported); loading imports just the requested entry point. A plugin that fails to
import is reported as a warning naming its distribution and the exception, and the others stay
usable. Two distributions claiming one name give a warning; ``"distribution:name"`` picks one.
Setting ``LIGHTNING_FEDMETA_DISABLE_PLUGINS=1`` ignores every distribution but this one.
"""

from __future__ import annotations

import difflib
import inspect
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from lightning_fedmeta.algorithms.base import Algorithm, unused_args_message

__all__ = [
    "AGGREGATORS",
    "AGGREGATOR_GROUP",
    "ALGORITHMS",
    "DATASETS",
    "DATASET_GROUP",
    "PARTITIONERS",
    "PARTITIONER_GROUP",
    "PluginRegistry",
    "ENTRY_POINT_GROUP",
    "DISABLE_PLUGINS_ENV",
    "AlgorithmEntry",
    "PluginLoadWarning",
    "list_algorithms",
    "load_algorithm",
    "create_algorithm",
    "describe_algorithms",
]

ENTRY_POINT_GROUP = "lightning_fedmeta.algorithms"
AGGREGATOR_GROUP = "lightning_fedmeta.aggregators"
DATASET_GROUP = "lightning_fedmeta.datasets"
PARTITIONER_GROUP = "lightning_fedmeta.partitioners"
DISABLE_PLUGINS_ENV = "LIGHTNING_FEDMETA_DISABLE_PLUGINS"
BUILTIN_DISTRIBUTION = "lightning-fedmeta"


class PluginLoadWarning(UserWarning):
    """A registered plugin could not be loaded, or two distributions claim one name."""


@dataclass(frozen=True)
class AlgorithmEntry:
    """One registered algorithm, known from metadata alone."""

    name: str
    distribution: str
    value: str
    entry_point: EntryPoint

    @property
    def qualified_name(self) -> str:
        return f"{self.distribution}:{self.name}"

    @property
    def builtin(self) -> bool:
        return _normalize(self.distribution) == _normalize(BUILTIN_DISTRIBUTION)


def _normalize(dist: str) -> str:
    return dist.lower().replace("_", "-")


def _plugins_disabled() -> bool:
    return os.environ.get(DISABLE_PLUGINS_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


class PluginRegistry:
    """The installed plugins of one entry-point group: listing (metadata only) and loading by name.

    ``kind`` names the extension point in messages (``"algorithm"``, ``"aggregator"``, ...);
    ``accepts(obj)`` says whether a loaded object keeps the group's contract and ``expected``
    describes that contract in the refusal.
    """

    def __init__(self, group: str, kind: str, accepts: Callable[[Any], bool], expected: str) -> None:
        self.group, self.kind, self.accepts, self.expected = group, kind, accepts, expected

    def list(self) -> list[AlgorithmEntry]:
        """Every registered entry of the group, from installed metadata (no import), sorted by name;
        duplicate (name, distribution) pairs are listed once."""
        seen: set[tuple[str, str]] = set()
        entries = []
        for ep in entry_points(group=self.group):
            dist = ep.dist.name if ep.dist is not None else "<unknown distribution>"
            key = (ep.name, _normalize(dist))
            if key in seen:
                continue
            seen.add(key)
            entry = AlgorithmEntry(ep.name, dist, ep.value, ep)
            if _plugins_disabled() and not entry.builtin:
                continue
            entries.append(entry)
        return sorted(entries, key=lambda e: (e.name, not e.builtin, _normalize(e.distribution)))

    def names(self) -> list[str]:
        """The registered names, sorted (metadata only)."""
        return sorted({e.name for e in self.list()})

    def resolve(self, name: str) -> AlgorithmEntry:
        """The entry registered as ``name`` or ``"distribution:name"``; ``ValueError`` listing the installed
        names (and the closest one) when there is none."""
        if not isinstance(name, str):
            raise ValueError(f"a {self.kind} is chosen by its registered name (a string), got {name!r}")
        entries = self.list()
        if ":" in name:
            dist, _, short = name.partition(":")
            matches = [e for e in entries if e.name == short and _normalize(e.distribution) == _normalize(dist)]
        else:
            matches = [e for e in entries if e.name == name]
        if not matches:
            names = sorted({e.name for e in entries})
            available = ", ".join(names) or "(none installed)"
            hint = (f" (third-party plugins are hidden because {DISABLE_PLUGINS_ENV} is set)"
                    if _plugins_disabled() else "")
            close = difflib.get_close_matches(name.rpartition(":")[2], names, n=1, cutoff=0.6)
            suggestion = f"; did you mean {close[0]!r}?" if close else ""
            if not any(e.builtin for e in entries):  # the installed metadata predates this group
                hint += (f" (no built-in {self.kind} is registered: the installed metadata of {BUILTIN_DISTRIBUTION} "
                         f"has no {self.group!r} entry points, it is older than its pyproject.toml; reinstall it, "
                         "e.g. pip install --no-deps -e .)")
            raise ValueError(f"unknown {self.kind} {name!r}; available: {available}{hint}{suggestion}")
        if len(matches) > 1:
            chosen = matches[0]
            others = ", ".join(e.qualified_name for e in matches[1:])
            warnings.warn(
                f"{self.kind} name {name!r} is registered by several distributions; using "
                f"{chosen.qualified_name} (also: {others}). Pick one with 'distribution:name'.",
                PluginLoadWarning,
                stacklevel=3,
            )
        return matches[0]

    def load_entry(self, entry: AlgorithmEntry) -> Any:
        """The object behind ``entry``; ``ImportError`` naming the distribution when it fails to import,
        ``TypeError`` when it does not keep the group's contract."""
        try:
            obj = entry.entry_point.load()
        except Exception as exc:  # a broken plugin must not break the others
            raise ImportError(
                f"{self.kind} {entry.name!r} from distribution {entry.distribution!r} failed to load "
                f"({entry.value}): {type(exc).__name__}: {exc}"
            ) from exc
        if not self.accepts(obj):
            raise TypeError(
                f"entry point {entry.name!r} of {entry.distribution!r} ({entry.value}) is not {self.expected}"
            )
        return obj

    def load(self, name: str) -> Any:
        """The object registered as ``name`` (or ``"distribution:name"``)."""
        return self.load_entry(self.resolve(name))


def _is_algorithm(obj: Any) -> bool:
    return inspect.isclass(obj) and issubclass(obj, Algorithm)


ALGORITHMS = PluginRegistry(ENTRY_POINT_GROUP, "algorithm", _is_algorithm, "an lightning_fedmeta.Algorithm subclass")
#: robust aggregation rules (:mod:`lightning_fedmeta.reliability.robust`): classes built with their options, called on
# rows
AGGREGATORS = PluginRegistry(AGGREGATOR_GROUP, "aggregator", callable,
                             "a class (or factory) whose instances combine rows: rule(rows, weights, f=, steps=)")
#: named datasets (:mod:`lightning_fedmeta.data.plugins`): callables returning a FederatedData
DATASETS = PluginRegistry(DATASET_GROUP, "dataset", callable,
                          "a callable returning a FederatedData or a FederatedDataset")
#: label partitioners (:mod:`lightning_fedmeta.data.plugins`): callables returning one index tensor per client
PARTITIONERS = PluginRegistry(PARTITIONER_GROUP, "partitioner", callable,
                              "a callable returning one index tensor per client")


def list_algorithms() -> list[AlgorithmEntry]:
    """Every registered algorithm, from installed metadata (no import), sorted by name.

    Duplicate (name, distribution) pairs — e.g. a package installed twice on ``sys.path`` — are
    listed once.
    """
    return ALGORITHMS.list()


def _resolve(name: str) -> AlgorithmEntry:
    return ALGORITHMS.resolve(name)


def _load_entry(entry: AlgorithmEntry) -> type[Algorithm]:
    return ALGORITHMS.load_entry(entry)


def load_algorithm(name: str) -> type[Algorithm]:
    """The class registered as ``name`` (or ``"distribution:name"``)."""
    return _load_entry(_resolve(name))


def create_algorithm(name: str, **hparams: Any) -> Algorithm:
    """Instantiate the algorithm registered as ``name`` with ``hparams`` (validated by its constructor).

    Every algorithm takes the common arguments (``lightning_fedmeta.algorithms.base.COMMON_ARGS``),
    even when its ``__init__`` does not name them, except those it lists in ``unused_args``: these
    are refused with the algorithm's reason.
    """
    cls = load_algorithm(name)
    unused = [k for k in hparams if k in cls.unused_args]
    if unused:
        raise ValueError(unused_args_message(cls, unused))
    sig = inspect.signature(cls.__init__)
    accepts_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    allowed = [
        n for n, p in sig.parameters.items()
        if n != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    unknown = [k for k in hparams if k not in allowed]
    if unknown and not accepts_kwargs:
        raise ValueError(
            f"algorithm {name!r} has no hyper-parameter(s) {', '.join(map(repr, unknown))}; "
            f"accepted: {', '.join(allowed)}"
        )
    return cls(**hparams)


def describe_algorithms() -> list[dict[str, str]]:
    """Name, distribution, status and one-line summary of every algorithm (imports each one;
    failures become a :class:`PluginLoadWarning` and a row with the error)."""
    rows = []
    entries = list_algorithms()
    by_name: dict[str, list[str]] = {}
    for e in entries:
        by_name.setdefault(e.name, []).append(e.qualified_name)
    for entry in entries:
        try:
            cls = _load_entry(entry)
            doc_lines = (cls.__doc__ or "").strip().splitlines()
            summary, status = cls.summary or (doc_lines[0] if doc_lines else ""), "ok"
        except (ImportError, TypeError) as exc:
            warnings.warn(str(exc), PluginLoadWarning, stacklevel=2)
            summary, status = str(exc), "failed"
        claimants = by_name[entry.name]
        if len(claimants) > 1 and entry.qualified_name == claimants[0]:  # one warning per contested name
            warnings.warn(
                f"algorithm name {entry.name!r} is claimed by several distributions "
                f"({', '.join(claimants)}); pick one with 'distribution:name'",
                PluginLoadWarning,
                stacklevel=2,
            )
        rows.append({"name": entry.name, "distribution": entry.distribution, "status": status, "summary": summary})
    return rows
