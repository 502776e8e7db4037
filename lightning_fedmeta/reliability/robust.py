"""Byzantine-robust aggregation rules for the server's combination of client deltas.

Every rule maps the round's client deltas ``rows [n, d]`` (one flattened parameter delta per
client, :func:`flatten_rows`) to one update ``Δ [d]``; :func:`aggregate_rows` calls the rule an
:class:`AggregatorSpec` names (parsed from ``FederatedModule(aggregator=...)`` by :func:`parse_aggregator`). Every
rule, built-in or an installed package's, is a class registered in the ``lightning_fedmeta.aggregators``
entry-point group and built with its options (:class:`RobustRule` states the contract); the built-ins below are
this package's own entries of that group.

========================  ================================================================  ==========
rule                      Δ                                                                 weights
========================  ================================================================  ==========
``mean``                  ``Σ_i w_i Δ_i`` (FedAvg)                                          used
``median``                coordinate-wise median (Yin et al. 2018, Def. 1)                  unweighted
``trimmed_mean``          coordinate-wise β-trimmed mean (Yin et al. 2018, Def. 2)          unweighted
``krum``                  the row with the least Krum score (Blanchard et al. 2017)         unweighted
``multi_krum``            mean of the m rows with the least scores (Blanchard et al. 2017)  unweighted
``bulyan``                Krum selections, then a trimmed mean around the median
                          (El Mhamdi et al. 2018, Alg. 1)                                   unweighted
``geometric_median``      ``argmin_z Σ_i w_i ‖z − Δ_i‖`` by smoothed Weiszfeld (RFA,
                          Pillutla et al. 2022)                                             used
``fednova``               ``(Σ_i w_i τ_i) Σ_i w_i Δ_i / τ_i`` (Wang et al. 2020)            used
========================  ================================================================  ==========

``clip`` (any rule) first scales every row to at most that L2 norm: ``Δ_i · min(1, c / ‖Δ_i‖)``.

A row whose weight is 0 (a client that did not upload, e.g. dropped this round) takes no part in
the unweighted rules; the weighted rules give it no mass anyway. Everything is pure torch and
deterministic (ties are broken by the lowest row index), on any device and floating dtype;
distances and scores of half-precision rows are computed in float32.

References:
    Blanchard, El Mhamdi, Guerraoui, Stainer. Machine learning with adversaries: Byzantine tolerant
    gradient descent. NeurIPS 2017.
    Yin, Chen, Ramchandran, Bartlett. Byzantine-robust distributed learning: towards optimal
    statistical rates. ICML 2018.
    El Mhamdi, Guerraoui, Rouault. The hidden vulnerability of distributed learning in Byzantium.
    ICML 2018.
    Pillutla, Kakade, Harchaoui. Robust aggregation for federated learning. IEEE Trans. Signal
    Processing 70, 2022 (arXiv:1912.13445).
    Wang, Liu, Liang, Joshi, Poor. Tackling the objective inconsistency problem in heterogeneous
    federated optimization. NeurIPS 2020.
    Allouah et al. ByzFL (EPFL), byzfl/aggregators/aggregators.py: the reference implementations
    compared against (differences are noted in each rule's docstring).
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_fedmeta.client.functional import weighted_sum

__all__ = [
    "AGGREGATORS",
    "AggregatorSpec",
    "RobustRule",
    "canonical_aggregator",
    "Mean",
    "Median",
    "TrimmedMean",
    "Krum",
    "MultiKrum",
    "Bulyan",
    "GeometricMedian",
    "FedNova",
    "parse_aggregator",
    "check_aggregator",
    "flatten_rows",
    "unflatten_row",
    "aggregate_rows",
    "clip_rows",
    "coordinate_median",
    "trimmed_mean",
    "krum_scores",
    "krum",
    "multi_krum",
    "bulyan",
    "geometric_median",
    "fednova",
]

#: the built-in rules (each registered in the ``lightning_fedmeta.aggregators`` entry-point group, as a plugin's)
AGGREGATORS: tuple[str, ...] = (
    "mean",
    "median",
    "trimmed_mean",
    "krum",
    "multi_krum",
    "bulyan",
    "geometric_median",
    "fednova",
)


class RobustRule:
    """The contract of an aggregation rule (``lightning_fedmeta.aggregators`` entry points).

    A rule is a class registered under its name; ``model.aggregator: {name: <name>, <option>: <value>}`` builds
    it as ``Rule(**options)`` (its constructor's keyword arguments are its options, validated there: a
    ``ValueError`` whose message starts with the option's name is reported as ``model.aggregator.<message>``).
    ``rule(rows, weights, f=f, steps=steps)`` maps the round's client deltas ``rows [n, d]`` and weights ``[n]``
    (summing to 1) to the update ``Δ [d]``. Subclassing is optional; these are the attributes read (with these
    defaults):

    * ``weighted``: ``False``: the rule is unweighted; rows of weight 0 (clients that did not upload) are
      dropped before it is called. ``True``: it gets every row with its weight.
    * ``needs_f``: the rule takes ``f``, the Byzantine updates per round (``model.aggregator.f``, else from
      ``model.byzantine``); without it ``model.aggregator.f`` is refused.
    * ``needs_steps``: the rule reads ``steps [n]``, the local steps each client took (FedNova).
    * ``exchangeable``: the result does not depend on the order of the rows (``True``); ``False`` where a tie
      broken by the lowest row index occurs on generic data (Bulyan's last selections compare the two rows of the
      closest pair, whose scores are equal).
    * ``average_statistics``: the clients' BatchNorm statistics are averaged with the weights rather than passed
      through the rule (a re-weighting, not a defence).
    * ``check(n, f)``: raises ``ValueError`` when the rule cannot run on ``n`` rows of which ``f`` are Byzantine
      (the round is then skipped; at setup the run is refused).
    """

    weighted: ClassVar[bool] = False
    needs_f: ClassVar[bool] = False
    needs_steps: ClassVar[bool] = False
    exchangeable: ClassVar[bool] = True
    average_statistics: ClassVar[bool] = False

    def check(self, n: int, f: int) -> None:
        """Raise ``ValueError`` when the rule cannot combine ``n`` rows, ``f`` of them Byzantine."""

    def __call__(self, rows: Tensor, weights: Tensor, *, f: int = 0, steps: Tensor | None = None) -> Tensor:
        """The combined row of ``rows`` ``[n, d]`` (weights ``[n]``): every rule defines it."""
        raise NotImplementedError(f"{type(self).__name__} is a RobustRule but defines no __call__(rows, weights, *, "
                                  "f, steps) returning the combined row (docs/plugins.md, robust rules)")


class Mean(RobustRule):
    """``Σ_i w_i Δ_i`` (FedAvg's weighted mean; with ``clip``, the mean of norm-bounded updates)."""

    weighted = True

    def __call__(self, rows: Tensor, weights: Tensor, *, f: int = 0, steps: Tensor | None = None) -> Tensor:
        return weighted_sum(weights, rows)


class Median(RobustRule):
    """Coordinate-wise median (:func:`coordinate_median`)."""

    def __call__(self, rows: Tensor, weights: Tensor, *, f: int = 0, steps: Tensor | None = None) -> Tensor:
        return coordinate_median(rows)


class TrimmedMean(RobustRule):
    """Coordinate-wise β-trimmed mean (:func:`trimmed_mean`); ``beta`` in [0, 0.5)."""

    def __init__(self, beta: float = 0.1) -> None:
        if not _is_number(beta) or not 0.0 <= float(beta) < 0.5:
            raise ValueError(f"beta must be a number in [0, 0.5), got {beta!r}")
        self.beta = float(beta)

    def check(self, n: int, f: int) -> None:
        trimmed = _trim_count(self.beta, n)
        if 2 * trimmed >= n:
            raise ValueError(
                f"beta={self.beta} trims 2*floor(beta*n) = {2 * trimmed} of n={n} updates (f={f}): "
                f"nothing is left; need 2*floor(beta*n) < n (lower beta or sample more clients per round)"
            )

    def __call__(self, rows: Tensor, weights: Tensor, *, f: int = 0, steps: Tensor | None = None) -> Tensor:
        return trimmed_mean(rows, self.beta)


class _KrumFamily(RobustRule):
    needs_f = True
    label = "krum"

    def check(self, n: int, f: int) -> None:
        if not n > 2 * f + 2:
            raise ValueError(
                f"{self.label} needs n > 2f + 2 updates per round, got n={n}, f={f} (2f + 2 = {2 * f + 2}); "
                "sample more clients per round or assume fewer Byzantine updates (f)"
            )


class Krum(_KrumFamily):
    """Krum (:func:`krum`); needs ``n > 2f + 2``."""

    def __call__(self, rows: Tensor, weights: Tensor, *, f: int = 0, steps: Tensor | None = None) -> Tensor:
        return krum(rows, f)


class MultiKrum(_KrumFamily):
    """Multi-Krum (:func:`multi_krum`): the mean of the ``m`` best-scored rows (``None``: ``n − f``)."""

    label = "multi_krum"

    def __init__(self, m: int | None = None) -> None:
        if m is not None and (not _is_int(m) or m < 1):
            raise ValueError(f"m must be an integer >= 1 (or null: n - f), got {m!r}")
        self.m = m

    def check(self, n: int, f: int) -> None:
        super().check(n, f)
        if self.m is not None and not 1 <= self.m <= n - f:
            raise ValueError(f"m must be in [1, n - f] = [1, {n - f}] with n={n}, f={f}, got m={self.m}")

    def __call__(self, rows: Tensor, weights: Tensor, *, f: int = 0, steps: Tensor | None = None) -> Tensor:
        return multi_krum(rows, f, self.m)


class Bulyan(RobustRule):
    """Bulyan over Krum (:func:`bulyan`); needs ``n ≥ 4f + 3``. Not exchangeable: its last Krum selections score
    the rows by their nearest neighbour, so the two rows of the closest pair tie and the lower index is taken."""

    needs_f = True
    exchangeable = False

    def check(self, n: int, f: int) -> None:
        if not n >= 4 * f + 3:
            raise ValueError(
                f"bulyan needs n >= 4f + 3 updates per round, got n={n}, f={f} (4f + 3 = {4 * f + 3}); "
                "sample more clients per round or assume fewer Byzantine updates (f)"
            )

    def __call__(self, rows: Tensor, weights: Tensor, *, f: int = 0, steps: Tensor | None = None) -> Tensor:
        return bulyan(rows, f)


class GeometricMedian(RobustRule):
    """Weighted geometric median by smoothed Weiszfeld (:func:`geometric_median`)."""

    weighted = True

    def __init__(self, iterations: int = 100, eps: float = 1e-8) -> None:
        if not _is_int(iterations) or iterations < 1:
            raise ValueError(f"iterations must be an integer >= 1, got {iterations!r}")
        if not _is_number(eps) or not math.isfinite(float(eps)) or float(eps) <= 0:
            raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
        self.iterations, self.eps = iterations, float(eps)

    def __call__(self, rows: Tensor, weights: Tensor, *, f: int = 0, steps: Tensor | None = None) -> Tensor:
        return geometric_median(rows, weights, self.iterations, self.eps)


class FedNova(RobustRule):
    """FedNova's normalised averaging (:func:`fednova`); reads the clients' local steps."""

    weighted = True
    needs_steps = True
    average_statistics = True

    def __call__(self, rows: Tensor, weights: Tensor, *, f: int = 0, steps: Tensor | None = None) -> Tensor:
        if steps is None:
            raise ValueError("aggregate_rows: fednova needs the local steps each client took (steps)")
        return fednova(rows, weights, steps)


# ----------------------------------------------------------------------------------------------
# parsing and checks
# ----------------------------------------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _rule_options(cls: Any) -> dict[str, Any]:
    """The options a rule's constructor takes, with their defaults (``inspect.Parameter.empty``: required)."""
    target = cls.__init__ if inspect.isclass(cls) else cls
    if target is object.__init__:
        return {}
    params = inspect.signature(target).parameters
    return {n: p.default for n, p in params.items()
            if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _named(option: str, message: str, keys: Any) -> str:
    """``message`` under ``option``: ``option.<message>`` when it starts with one of ``keys``, else
    ``option: <message>``."""
    for key in keys:
        if re.match(rf"{re.escape(key)}\b(?![.(])", message):
            return f"{option}.{message}"
    return f"{option}: {message}"


def _load_rule(name: Any, where: str) -> Any:
    from lightning_fedmeta.registry import AGGREGATORS as REGISTRY

    if not isinstance(name, str):
        raise ValueError(f"{where}: unknown aggregator {name!r}; choose one of {', '.join(_installed())}")
    try:
        entry = REGISTRY.resolve(name)
    except ValueError as exc:
        if not any(e.builtin for e in REGISTRY.list()):  # stale metadata: the registry's message says so
            raise ValueError(f"{where}: {exc}") from None
        raise ValueError(f"{where}: unknown aggregator {name!r}; choose one of {', '.join(_installed())}") from None
    return REGISTRY.load_entry(entry)


def _installed() -> list[str]:
    """Built-in rules first (in :data:`AGGREGATORS` order), then the installed plugins' by name."""
    from lightning_fedmeta.registry import AGGREGATORS as REGISTRY

    return [*AGGREGATORS, *(n for n in REGISTRY.names() if n not in AGGREGATORS)]


class AggregatorSpec:
    """Which rule combines the round's client deltas, and its options.

    ``AggregatorSpec(name, f=None, clip=None, **options)``. ``f`` and ``clip`` apply to every rule; ``options`` are
    the rule's own (its constructor's keyword arguments), held with the rule's defaults filled in, and read as
    attributes (``spec.beta``).

    Attributes:
        name: a registered rule (:data:`AGGREGATORS` or a plugin's ``lightning_fedmeta.aggregators`` entry point).
        f: rules with ``needs_f`` (``krum``, ``multi_krum``, ``bulyan``): Byzantine updates assumed per round
            (``None``: the module fills it from ``byzantine``).
        clip: every row is first clipped to this L2 norm (any rule); ``None``: no clipping.
        options: the rule's options (``trimmed_mean``: ``beta``; ``multi_krum``: ``m``; ``geometric_median``:
            ``iterations``, ``eps``; a plugin's: its own).
    """

    __slots__ = ("name", "f", "clip", "options", "rule_class")

    def __init__(self, name: str = "mean", f: int | None = None, clip: float | None = None, **options: Any) -> None:
        cls = _load_rule(name, "model.aggregator.name")
        known = _rule_options(cls)
        missing = [k for k, v in known.items() if v is inspect.Parameter.empty and k not in options]
        if missing:
            raise ValueError(f"model.aggregator: the {name} rule needs {', '.join(missing)}")
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "f", f)
        object.__setattr__(self, "clip", clip)
        object.__setattr__(self, "options", {**{k: v for k, v in known.items() if k not in missing}, **options})
        object.__setattr__(self, "rule_class", cls)

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("AggregatorSpec is immutable")

    def __getattr__(self, key: str) -> Any:
        options = object.__getattribute__(self, "options")
        if key in options:
            return options[key]
        raise AttributeError(f"the {object.__getattribute__(self, 'name')} rule has no option {key!r}")

    def _key(self) -> tuple[Any, ...]:
        return (self.name, self.f, self.clip, tuple(sorted(self.options.items())))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AggregatorSpec) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"AggregatorSpec({self.name!r}, f={self.f!r}, clip={self.clip!r}{extra})"

    def __reduce__(self) -> Any:
        return (_rebuild_spec, (self.name, self.f, self.clip, dict(self.options)))

    @property
    def needs_f(self) -> bool:
        """Whether the rule needs the number f of Byzantine updates (krum, multi_krum, bulyan)."""
        return bool(getattr(self.rule_class, "needs_f", False))

    def given(self) -> dict[str, Any]:
        """The spec as a user would write it: ``name`` and every value that differs from its default."""
        defaults = _rule_options(self.rule_class)
        out: dict[str, Any] = {"name": self.name}
        out.update({k: v for k, v in (("f", self.f), ("clip", self.clip)) if v is not None})
        out.update({k: v for k, v in self.options.items() if defaults.get(k) != v})
        return out

    def rule(self) -> Any:
        """The rule built with its options (``rule_class(**options)``)."""
        return self.rule_class(**self.options)


def _rebuild_spec(name: str, f: int | None, clip: float | None, options: dict[str, Any]) -> AggregatorSpec:
    return AggregatorSpec(name, f, clip, **options)


def canonical_aggregator(value: Any) -> Any:
    """``model.aggregator`` in the form its meaning is compared in (the checkpoint resume check): the rule's name,
    ``f``, ``clip`` and every option with the rule's defaults filled in, so ``median`` and ``{name: median}`` are one
    setting and a plugin rule's options are compared without being listed anywhere; as given when it does not
    parse (the rule's package is not installed, say)."""
    try:
        spec = parse_aggregator(value)
    except (ValueError, ImportError, TypeError):
        return value
    return {"name": spec.name, "f": spec.f, "clip": spec.clip, **spec.options}


def _check_common(key: str, value: Any, where: str) -> Any:
    if key == "f":
        if value is None:
            return None
        if not _is_int(value) or value < 0:
            raise ValueError(f"{where} must be an integer >= 0 (or null: taken from model.byzantine), got {value!r}")
        return value
    if value is None:
        return None
    if not _is_number(value) or not math.isfinite(float(value)) or float(value) <= 0:
        raise ValueError(f"{where} must be a finite number > 0 (or null: no clipping), got {value!r}")
    return float(value)


#: the options of the built-in rules, for naming a key that belongs to another rule
_BUILTIN_KEYS = ("beta", "m", "iterations", "eps", "f")


def parse_aggregator(spec: str | Mapping[str, Any] | AggregatorSpec | None,
                     option: str = "model.aggregator") -> AggregatorSpec:
    """The :class:`AggregatorSpec` a user wrote: ``None`` (mean), a rule's name, or a mapping
    ``{"name": ..., key: value}`` (``name`` defaults to ``"mean"``).

    The rule is looked up in the ``lightning_fedmeta.aggregators`` entry-point group (built-ins and plugins
    alike). ``clip`` is accepted for every rule, ``f`` for rules with ``needs_f``, and otherwise only the keys the
    rule's constructor takes (``beta`` for ``trimmed_mean``, ``m`` for ``multi_krum``, ``iterations`` and ``eps``
    for ``geometric_median``); the constructor validates their values. An unknown name (the message lists the
    installed rules), an unknown key, a key of another rule, a wrong type or an out-of-range value is a
    ``ValueError`` naming ``option.key``. An :class:`AggregatorSpec` is validated the same way and returned.
    """
    if spec is None:
        spec = "mean"
    if isinstance(spec, AggregatorSpec):
        return parse_aggregator(spec.given(), option)
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, Mapping):
        raise ValueError(f"{option} must be a rule's name, a mapping with 'name' and its parameters, or null; "
                         f"got {type(spec).__name__} {spec!r}")
    name = spec.get("name", "mean")
    where = f"{option}.name" if "name" in spec and not isinstance(name, str) else option
    cls = _load_rule(name, where)
    own = _rule_options(cls)
    needs_f = bool(getattr(cls, "needs_f", False))
    allowed = ("name", "clip", *(("f",) if needs_f else ()), *own)
    common: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for key, value in spec.items():
        if key == "name":
            continue
        if key not in allowed:
            if isinstance(key, str) and key in _BUILTIN_KEYS:
                raise ValueError(f"{option}.{key} does not apply to the {name} rule; {name} accepts "
                                 f"{', '.join(allowed)}")
            raise ValueError(f"{option}.{key}: unknown key; {name} accepts {', '.join(allowed)}")
        if key in ("f", "clip"):
            common[key] = _check_common(key, value, f"{option}.{key}")
        else:
            options[key] = value
    try:
        cls(**options)  # the rule's constructor validates its options
    except ValueError as exc:
        raise ValueError(_named(option, str(exc), own)) from None
    except TypeError as exc:
        raise ValueError(f"{option}: the {name} rule refused its options {options!r}: {exc}") from None
    return AggregatorSpec(name, common.get("f"), common.get("clip"), **options)


def check_aggregator(spec: AggregatorSpec, n: int, f: int, option: str = "model.aggregator") -> None:
    """Refuse a rule that cannot run on ``n`` updates of which ``f`` may be Byzantine: ``n >= 1``, ``f >= 0``,
    then the rule's own ``check(n, f)``:

    * ``krum``, ``multi_krum``: ``n > 2f + 2`` (Blanchard et al. 2017, Prop. 1: the score sums over
      the ``n − f − 2`` nearest others);
    * ``bulyan``: ``n ≥ 4f + 3`` (El Mhamdi et al. 2018, Sec. 4);
    * ``multi_krum``: ``1 ≤ m ≤ n − f``;
    * ``trimmed_mean``: ``2⌊βn⌋ < n`` (something is left after trimming).

    The message names ``option``, n, f and the condition.
    """
    if not _is_int(n) or n < 1:
        raise ValueError(f"{option}: the number of updates per round must be >= 1, got n={n!r}")
    if not _is_int(f) or f < 0:
        raise ValueError(f"{option}.f must be an integer >= 0, got f={f!r}")
    try:
        rule = spec.rule()  # a hand-made spec's options are validated here, as parse_aggregator validates them
        check = getattr(rule, "check", None)
        if check is not None:
            check(n, f)
    except ValueError as exc:
        raise ValueError(_named(option, str(exc), (*spec.options, "f"))) from None


# ----------------------------------------------------------------------------------------------
# flattening
# ----------------------------------------------------------------------------------------------
def flatten_rows(tree: Mapping[str, Tensor]) -> Tensor:
    """Leaves ``[n, ...]`` concatenated to ``[n, d]`` in the mapping's key order (one row per client)."""
    leaves = list(tree.values())
    if not leaves:
        raise ValueError("flatten_rows: the tree has no leaves")
    n = leaves[0].shape[0]
    return torch.cat([v.reshape(n, -1) for v in leaves], dim=1)


def unflatten_row(vector: Tensor, like: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``vector [d]`` split back into leaves shaped ``like[k].shape[1:]`` (the inverse of :func:`flatten_rows`
    for one row); the leaves are views of ``vector``."""
    total = sum(math.prod(leaf.shape[1:]) for leaf in like.values())
    if total != vector.numel():
        raise ValueError(f"unflatten_row: the vector has {vector.numel()} entries, the leaves {total}")
    out: dict[str, Tensor] = {}
    start = 0
    for key, leaf in like.items():
        shape = leaf.shape[1:]
        size = math.prod(shape)
        out[key] = vector[start:start + size].reshape(shape)
        start += size
    return out


# ----------------------------------------------------------------------------------------------
# the rules
# ----------------------------------------------------------------------------------------------
def _work_dtype(rows: Tensor) -> torch.dtype:
    return torch.float32 if rows.dtype in (torch.float16, torch.bfloat16) else rows.dtype


def clip_rows(rows: Tensor, clip: float) -> Tensor:
    """Every row scaled to at most L2 norm ``clip``: ``Δ_i · min(1, clip / ‖Δ_i‖)`` (norm clipping, as in
    ByzFL's ``Clipping`` pre-aggregation; a zero row stays zero)."""
    norms = torch.linalg.vector_norm(rows.to(_work_dtype(rows)), dim=1, keepdim=True)
    factor = torch.where(norms > clip, clip / norms.clamp_min(torch.finfo(norms.dtype).tiny), torch.ones_like(norms))
    return rows * factor.to(rows.dtype)


def _median_of_sorted(sorted_rows: Tensor) -> Tensor:
    n = sorted_rows.shape[0]
    lo, hi = sorted_rows[(n - 1) // 2], sorted_rows[n // 2]
    return lo if n % 2 else (lo + hi) / 2


def coordinate_median(rows: Tensor) -> Tensor:
    """Coordinate-wise median ``[med]_k = median([Δ_1]_k, …, [Δ_n]_k)`` (Yin et al. 2018, Definition 1);
    for even n the mean of the two middle values (as ``numpy.median``; ``torch.median`` would return the
    lower one). Unweighted in the paper, and here."""
    return _median_of_sorted(torch.sort(rows, dim=0).values)


def _trim_count(beta: float, n: int) -> int:
    return int(math.floor(beta * n + 1e-9))  # the tolerance keeps 0.3 * 10 = 3.0000000000000004 at 3


def trimmed_mean(rows: Tensor, beta: float) -> Tensor:
    """Coordinate-wise β-trimmed mean (Yin et al. 2018, Definition 2): for each coordinate, drop the
    ``b = ⌊βn⌋`` largest and ``b`` smallest values and average the ``n − 2b`` left,
    ``[TM]_k = 1/(n − 2b) Σ_{j=b+1}^{n−b} [Δ_(j)]_k``. Unweighted in the paper, and here (ByzFL's
    ``TrMean(f)`` is the same with ``b = f``)."""
    n = rows.shape[0]
    b = _trim_count(beta, n)
    if 2 * b >= n:
        raise ValueError(f"trimmed_mean: beta={beta} trims 2*{b} of n={n} rows; nothing is left")
    if b == 0:
        return rows.mean(dim=0)
    return torch.sort(rows, dim=0).values[b:n - b].mean(dim=0)


def _pairwise_sq_distances(rows: Tensor) -> Tensor:
    """``D[i, j] = ‖Δ_i − Δ_j‖²`` as exact differences (no Gram-matrix cancellation), one row at a time
    (memory n·d); a non-finite distance is +inf."""
    x = rows.to(_work_dtype(rows))
    dist = torch.stack([((x - x[i]) ** 2).sum(dim=1) for i in range(x.shape[0])])
    return torch.nan_to_num(dist, nan=math.inf)


def _scores(dist: Tensor, f: int) -> Tensor:
    """Krum scores from the squared distances of a set of rows: the sum of the ``n − f − 2`` smallest
    distances to the other rows (at least 1 and at most ``n − 1`` of them)."""
    n = dist.shape[0]
    k = min(max(n - f - 2, 1), n - 1)
    if k <= 0:
        return torch.zeros(n, dtype=dist.dtype, device=dist.device)
    others = dist + torch.diag(torch.full((n,), math.inf, dtype=dist.dtype, device=dist.device))
    return torch.sort(others, dim=1).values[:, :k].sum(dim=1)


def krum_scores(rows: Tensor, f: int) -> Tensor:
    """Krum scores ``s(i) = Σ_{j ∈ N_i} ‖Δ_i − Δ_j‖²`` where ``N_i`` are the ``n − f − 2`` rows closest to
    ``Δ_i`` (itself excluded) (Blanchard et al. 2017, Sec. 4). ByzFL's ``Krum`` sums over ``n − f − 1``
    neighbours instead; we keep the paper's count."""
    return _scores(_pairwise_sq_distances(rows), f)


def krum(rows: Tensor, f: int) -> Tensor:
    """Krum (Blanchard et al. 2017, Sec. 4): the row with the least :func:`krum_scores` (the lowest index
    on ties). Needs ``n > 2f + 2``. Unweighted in the paper, and here."""
    return rows[int(torch.argmin(krum_scores(rows, f)))]


def multi_krum(rows: Tensor, f: int, m: int | None = None) -> Tensor:
    """Multi-Krum (Blanchard et al. 2017, Sec. 4, "m-Krum"): the plain mean of the ``m`` rows with the
    least Krum scores (``m = n − f`` by default, as ByzFL's ``MultiKrum``; ties: the lower index).
    ``m = 1`` is Krum, ``m = n`` the mean. Unweighted in the paper, and here."""
    n = rows.shape[0]
    m = n - f if m is None else m
    order = torch.sort(krum_scores(rows, f), stable=True).indices
    return rows[order[:m]].mean(dim=0)


def bulyan(rows: Tensor, f: int) -> Tensor:
    """Bulyan over Krum (El Mhamdi et al. 2018, Algorithm 1; needs ``n ≥ 4f + 3``).

    1. Selection: ``θ = n − 2f`` times, apply Krum (with the same f) to the rows not chosen yet and move
       the chosen row to the selection S. The Krum score on the ``r`` rows left sums over
       ``max(r − f − 2, 1)`` neighbours (the last selections, where ``r − f − 2 < 1``, take the
       row closest to another one rather than an arbitrary one).
    2. Aggregation: for each coordinate, the mean of the ``β = θ − 2f`` values of S closest to their
       median (median of θ values; for even θ the mean of the two middle ones).

    The reference code of the authors (Rouault, AggregaThor/Garfield ``bulyan.py``) implements "Bulyan
    over Multi-Krum" (each selection averages m rows); this is the paper's Krum variant. Unweighted in
    the paper, and here.
    """
    n = rows.shape[0]
    theta = n - 2 * f
    beta = theta - 2 * f
    if beta < 1:
        raise ValueError(f"bulyan needs n >= 4f + 3 rows, got n={n}, f={f}")
    dist = _pairwise_sq_distances(rows)
    left = list(range(n))
    chosen: list[int] = []
    for _ in range(theta):
        idx = torch.tensor(left, device=rows.device)
        scores = _scores(dist[idx][:, idx], f)
        pick = left[int(torch.argmin(scores))]
        chosen.append(pick)
        left.remove(pick)
    selected = rows[torch.tensor(chosen, device=rows.device)]
    med = coordinate_median(selected)
    closest = torch.sort((selected - med).abs(), dim=0, stable=True).indices[:beta]
    return torch.gather(selected, 0, closest).mean(dim=0)


def geometric_median(rows: Tensor, weights: Tensor, iterations: int = 100, eps: float = 1e-8) -> Tensor:
    """Weighted geometric median ``argmin_z Σ_i w_i ‖z − Δ_i‖`` by the smoothed Weiszfeld algorithm
    (RFA, Pillutla et al. 2022, Algorithm 2 with the smoothing of Sec. 3):

        z⁰ = Σ_i w_i Δ_i / Σ_i w_i,   βᵢᵗ = w_i / max(ν, ‖zᵗ − Δ_i‖),   zᵗ⁺¹ = Σ_i βᵢᵗ Δ_i / Σ_i βᵢᵗ,

    with ν = ``eps``, stopped after ``iterations`` steps or once a step moves z by at most ``eps · ‖zᵗ⁺¹‖``
    (a test on the objective, as RFA's ``ftol``, stops far from the minimiser where the objective is flat:
    Weiszfeld converges linearly). Uses the weights (RFA weighs client i by its p_i); ByzFL's
    ``GeometricMedian`` is the unweighted case, started from zero with a fixed number of steps.
    """
    x = rows.to(_work_dtype(rows))
    w = weights.to(device=x.device, dtype=x.dtype)
    z = weighted_sum(w, x) / w.sum()
    for _ in range(iterations):
        beta = w / torch.linalg.vector_norm(x - z, dim=1).clamp_min(eps)
        new = weighted_sum(beta, x) / beta.sum()
        moved = float(torch.linalg.vector_norm(new - z))
        z = new
        if moved <= eps * float(torch.linalg.vector_norm(z)):
            break
    return z.to(rows.dtype)


def fednova(rows: Tensor, weights: Tensor, steps: Tensor) -> Tensor:
    """FedNova's normalised averaging for local SGD (Wang et al. 2020, Sec. 4, Eq. (6)-(7) with
    ``a_i = (1, …, 1)``, ``‖a_i‖₁ = τ_i``):

        Δ = (Σ_i w_i τ_i) · Σ_i w_i Δ_i / τ_i,

    where τ_i is the number of local steps client i took. A client that took no step (τ_i = 0)
    contributes 0. With equal τ_i it is the weighted mean. Uses the weights.
    """
    tau = steps.to(device=rows.device, dtype=_work_dtype(rows))
    w = weights.to(device=rows.device, dtype=tau.dtype)
    tau_eff = (w * tau).sum()
    scale = torch.where(tau > 0, w / tau.clamp_min(1e-30), torch.zeros_like(tau))
    return (tau_eff * weighted_sum(scale, rows.to(tau.dtype))).to(rows.dtype)


def aggregate_rows(
    spec: AggregatorSpec,
    rows: Tensor,
    weights: Tensor,
    f: int = 0,
    steps: Tensor | None = None,
) -> Tensor:
    """The round's update ``Δ [d]`` from the clients' deltas ``rows [n, d]`` by ``spec``'s rule.

    Args:
        spec: the rule and its parameters (:func:`parse_aggregator`).
        rows: one flattened parameter delta per client of the round (:func:`flatten_rows`).
        weights: the round's aggregation weights ``[n]`` (summing to 1); ``mean``, ``geometric_median`` and
            ``fednova`` use them, the other rules are unweighted (they only drop rows of weight 0).
        f: Byzantine updates assumed per round for ``krum``/``multi_krum``/``bulyan`` when ``spec.f`` is
            ``None`` (``spec.f`` wins otherwise).
        steps: ``[n]`` local steps each client took (``fednova`` only; required there).

    ``mean`` without clipping is exactly :func:`lightning_fedmeta.client.functional.weighted_sum` ``(weights, rows)``.
    The selection rules check their conditions (:func:`check_aggregator`) on the rows that take part.
    """
    if rows.dim() != 2 or weights.shape != rows.shape[:1]:
        raise ValueError(f"aggregate_rows: rows must be [n, d] and weights [n], got {tuple(rows.shape)} "
                         f"and {tuple(weights.shape)}")
    if spec.clip is not None:
        rows = clip_rows(rows, spec.clip)
    rule = spec.rule()
    f_used = spec.f if spec.f is not None else f
    if not getattr(rule, "weighted", False):
        present = weights > 0
        if not bool(present.all()):
            rows, weights = rows[present.to(rows.device)], weights[present]
        check_aggregator(spec, rows.shape[0], f_used)
    if getattr(rule, "needs_steps", False) and steps is None:
        raise ValueError(f"aggregate_rows: {spec.name} needs the local steps each client took (steps)")
    return rule(rows, weights, f=f_used, steps=steps)
