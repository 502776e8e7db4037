"""Byzantine-robust aggregation rules for the server's combination of client deltas.

Every rule maps the round's client deltas ``rows [n, d]`` (one flattened parameter delta per
client, :func:`flatten_rows`) to one update ``Δ [d]``; :func:`aggregate_rows` dispatches on an
:class:`AggregatorSpec` (parsed from ``FederatedModule(aggregator=...)`` by :func:`parse_aggregator`).

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

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from lightning_fedmeta.functional import weighted_sum

__all__ = [
    "AGGREGATORS",
    "AggregatorSpec",
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

#: the keys each rule accepts besides ``name`` and ``clip``
_RULE_KEYS: dict[str, tuple[str, ...]] = {
    "mean": (),
    "median": (),
    "trimmed_mean": ("beta",),
    "krum": ("f",),
    "multi_krum": ("f", "m"),
    "bulyan": ("f",),
    "geometric_median": ("iterations", "eps"),
    "fednova": (),
}
_NEEDS_F = ("krum", "multi_krum", "bulyan")


@dataclass(frozen=True)
class AggregatorSpec:
    """Which rule combines the round's client deltas, and its parameters.

    Attributes:
        name: one of :data:`AGGREGATORS`.
        beta: ``trimmed_mean``: the fraction trimmed at each end of every coordinate, in [0, 0.5).
        f: ``krum``/``multi_krum``/``bulyan``: Byzantine updates assumed per round (``None``: the
            module fills it from ``byzantine``).
        m: ``multi_krum``: the number of rows averaged (``None``: ``n − f``).
        clip: every row is first clipped to this L2 norm (any rule); ``None``: no clipping.
        iterations: ``geometric_median``: the most Weiszfeld iterations.
        eps: ``geometric_median``: the smoothing ν of the distances and the relative tolerance on a step
            that stops the iterations.
    """

    name: str = "mean"
    beta: float = 0.1
    f: int | None = None
    m: int | None = None
    clip: float | None = None
    iterations: int = 100
    eps: float = 1e-8

    @property
    def needs_f(self) -> bool:
        """Whether the rule needs the number f of Byzantine updates (krum, multi_krum, bulyan)."""
        return self.name in _NEEDS_F


# ----------------------------------------------------------------------------------------------
# parsing and checks
# ----------------------------------------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_value(name: str, key: str, value: Any, option: str) -> Any:
    """``value`` of ``key`` for rule ``name``, validated (a ValueError naming ``option.key`` otherwise)."""
    where = f"{option}.{key}"
    if key == "beta":
        if not _is_number(value) or not 0.0 <= float(value) < 0.5:
            raise ValueError(f"{where} must be a number in [0, 0.5), got {value!r}")
        return float(value)
    if key == "f":
        if value is None:
            return None
        if not _is_int(value) or value < 0:
            raise ValueError(f"{where} must be an integer >= 0 (or null: taken from model.byzantine), got {value!r}")
        return value
    if key == "m":
        if value is None:
            return None
        if not _is_int(value) or value < 1:
            raise ValueError(f"{where} must be an integer >= 1 (or null: n - f), got {value!r}")
        return value
    if key == "clip":
        if value is None:
            return None
        if not _is_number(value) or not math.isfinite(float(value)) or float(value) <= 0:
            raise ValueError(f"{where} must be a finite number > 0 (or null: no clipping), got {value!r}")
        return float(value)
    if key == "iterations":
        if not _is_int(value) or value < 1:
            raise ValueError(f"{where} must be an integer >= 1, got {value!r}")
        return value
    if key == "eps":
        if not _is_number(value) or not math.isfinite(float(value)) or float(value) <= 0:
            raise ValueError(f"{where} must be a finite number > 0, got {value!r}")
        return float(value)
    raise AssertionError(key)  # pragma: no cover - keys are filtered by the caller


def _check_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or name not in AGGREGATORS:
        raise ValueError(f"{where}: unknown aggregator {name!r}; choose one of {', '.join(AGGREGATORS)}")
    return name


def parse_aggregator(spec: str | Mapping[str, Any] | AggregatorSpec | None,
                     option: str = "model.aggregator") -> AggregatorSpec:
    """The :class:`AggregatorSpec` a user wrote: ``None`` (mean), a rule's name, or a mapping
    ``{"name": ..., key: value}`` (``name`` defaults to ``"mean"``).

    Only the keys of the chosen rule are accepted (``clip`` for every rule, ``beta`` for
    ``trimmed_mean``, ``f`` for ``krum``/``multi_krum``/``bulyan``, ``m`` for ``multi_krum``,
    ``iterations`` and ``eps`` for ``geometric_median``). An unknown name, an unknown key, a key of
    another rule, a wrong type or an out-of-range value is a ``ValueError`` naming ``option.key``.
    An :class:`AggregatorSpec` is validated the same way and returned.
    """
    if spec is None:
        return AggregatorSpec()
    if isinstance(spec, AggregatorSpec):
        defaults = AggregatorSpec()
        given = {k.name: getattr(spec, k.name) for k in fields(spec)
                 if k.name == "name" or getattr(spec, k.name) != getattr(defaults, k.name)}
        return parse_aggregator(given, option)
    if isinstance(spec, str):
        return AggregatorSpec(name=_check_name(spec, option))
    if not isinstance(spec, Mapping):
        raise ValueError(f"{option} must be a rule's name, a mapping with 'name' and its parameters, or null; "
                         f"got {type(spec).__name__} {spec!r}")
    name = _check_name(spec.get("name", "mean"), f"{option}.name")
    allowed = ("name", "clip", *_RULE_KEYS[name])
    known = {k.name for k in fields(AggregatorSpec)}
    values: dict[str, Any] = {"name": name}
    for key, value in spec.items():
        if not isinstance(key, str) or key not in known:
            raise ValueError(f"{option}.{key}: unknown key; {name} accepts {', '.join(allowed)}")
        if key not in allowed:
            raise ValueError(f"{option}.{key} does not apply to the {name} rule; {name} accepts {', '.join(allowed)}")
        if key != "name":
            values[key] = _check_value(name, key, value, option)
    return AggregatorSpec(**values)


def check_aggregator(spec: AggregatorSpec, n: int, f: int, option: str = "model.aggregator") -> None:
    """Refuse a rule that cannot run on ``n`` updates of which ``f`` may be Byzantine.

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
    name = spec.name
    if name in ("krum", "multi_krum") and not n > 2 * f + 2:
        raise ValueError(
            f"{option}: {name} needs n > 2f + 2 updates per round, got n={n}, f={f} (2f + 2 = {2 * f + 2}); "
            f"sample more clients per round or assume fewer Byzantine updates ({option}.f)"
        )
    if name == "bulyan" and not n >= 4 * f + 3:
        raise ValueError(
            f"{option}: bulyan needs n >= 4f + 3 updates per round, got n={n}, f={f} (4f + 3 = {4 * f + 3}); "
            f"sample more clients per round or assume fewer Byzantine updates ({option}.f)"
        )
    if name == "multi_krum" and spec.m is not None and not 1 <= spec.m <= n - f:
        raise ValueError(f"{option}.m must be in [1, n - f] = [1, {n - f}] with n={n}, f={f}, got m={spec.m}")
    if name == "trimmed_mean":
        trimmed = _trim_count(spec.beta, n)
        if 2 * trimmed >= n:
            raise ValueError(
                f"{option}.beta={spec.beta} trims 2*floor(beta*n) = {2 * trimmed} of n={n} updates (f={f}): "
                f"nothing is left; need 2*floor(beta*n) < n (lower beta or sample more clients per round)"
            )


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

    ``mean`` without clipping is exactly :func:`lightning_fedmeta.functional.weighted_sum` ``(weights, rows)``.
    The selection rules check their conditions (:func:`check_aggregator`) on the rows that take part.
    """
    if rows.dim() != 2 or weights.shape != rows.shape[:1]:
        raise ValueError(f"aggregate_rows: rows must be [n, d] and weights [n], got {tuple(rows.shape)} "
                         f"and {tuple(weights.shape)}")
    if spec.clip is not None:
        rows = clip_rows(rows, spec.clip)
    name = spec.name
    if name == "mean":
        return weighted_sum(weights, rows)
    if name == "geometric_median":
        return geometric_median(rows, weights, spec.iterations, spec.eps)
    if name == "fednova":
        if steps is None:
            raise ValueError("aggregate_rows: fednova needs the local steps each client took (steps)")
        return fednova(rows, weights, steps)
    present = weights > 0
    if not bool(present.all()):
        rows = rows[present.to(rows.device)]
    n = rows.shape[0]
    f_used = spec.f if spec.f is not None else f
    check_aggregator(spec, n, f_used)
    if name == "median":
        return coordinate_median(rows)
    if name == "trimmed_mean":
        return trimmed_mean(rows, spec.beta)
    if name == "krum":
        return krum(rows, f_used)
    if name == "multi_krum":
        return multi_krum(rows, f_used, spec.m)
    if name == "bulyan":
        return bulyan(rows, f_used)
    raise ValueError(f"aggregate_rows: unknown aggregator {name!r}; choose one of {', '.join(AGGREGATORS)}")
