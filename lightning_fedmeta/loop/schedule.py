"""The schedule of a round's local steps under ``local_epochs``: which clients run together, in lockstep.

Under ``local_epochs`` client ``c`` takes ``s_c = E·⌈n_c/B⌉`` steps. Clients that run in one ``vmap`` call share one
step axis as long as the longest of them; the others take empty (masked) steps to its end. Four schedules
(``model.step_schedule``), all with the same numbers (to floating-point reassociation; tested to 1e-5):

* ``"grouped"``: groups of similar ``s_c`` with at most ~10 % padding
  (:func:`~lightning_fedmeta.loop.grouping.step_groups`): the fewest padded steps, the most sequential ones;
* ``"lockstep"``: every client in one group, finished clients masked: the fewest sequential steps
  (``max_c s_c``), every padded step computed;
* ``"compacted"``: one group, and each step's primitive computes only the clients whose batch holds a sample
  (:mod:`lightning_fedmeta.client.compiled`, ``PrimitiveCompiler.compact``): ``max_c s_c`` sequential steps and no
  padded
  step of a primitive that knows its empty-batch result (``sgd_step``, ``loss_and_grad``, ``grad``, ``loss``, the
  proximal step); other work runs padded as in ``"lockstep"``;
* ``"auto"``: the partition that minimises the round's time under a cost model the engine measures on the model
  itself (:class:`StepCost`): a batched step of ``n`` clients costs ``a + b·n`` seconds, ``a`` its fixed latency
  (kernel launches, Python, functorch's dispatch), ``b`` each client's share (the FLOPs). A group ``g`` of
  ``n_g`` clients run in ``⌈n_g / chunk⌉`` calls of ``max_g`` steps costs ``max_g·(a·⌈n_g/chunk⌉ + b·n_g)``, and
  :func:`cheapest_groups` finds the exact optimum over partitions of the clients sorted by ``s_c`` (a contiguous
  partition is optimal: swapping two clients across groups never lowers both maxima). On a GPU ``a ≫ b`` and the
  optimum is one group (lockstep); on a CPU ``b`` dominates and the optimum is close to ``"grouped"``.

The measured cost is part of the checkpoint, so a resumed run forms the same groups (and computes the same numbers)
as the run it resumes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_fedmeta.loop.grouping import GROUP_RATIO, step_groups

__all__ = [
    "SCHEDULES",
    "ScheduleMode",
    "StepCost",
    "StepSchedule",
    "cheapest_groups",
    "fit_step_cost_points",
    "group_seconds",
    "measure_step_cost",
    "sequential_steps",
    "time_calls",
]

ScheduleMode = Literal["auto", "grouped", "lockstep", "compacted"]
SCHEDULES: tuple[str, ...] = ("auto", "grouped", "lockstep", "compacted")


@dataclass(frozen=True)
class StepCost:
    """A batched step of ``n`` clients costs ``latency + per_client·n`` seconds (:func:`fit_step_cost_points`)."""

    latency: float
    per_client: float

    def __post_init__(self) -> None:
        for name in ("latency", "per_client"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"StepCost.{name} must be a finite number >= 0, got {value!r}")

    def state(self) -> list[float]:
        return [float(self.latency), float(self.per_client)]

    @classmethod
    def from_state(cls, state: Any) -> StepCost | None:
        """The cost saved by :meth:`state` (``None`` for a checkpoint without one, or a malformed entry)."""
        if not isinstance(state, (list, tuple)) or len(state) != 2:
            return None
        try:
            return cls(float(state[0]), float(state[1]))
        except (TypeError, ValueError):
            return None


def fit_step_cost_points(points: list[tuple[int, float]]) -> StepCost | None:
    """``a`` and ``b`` of ``seconds ≈ a + b·n`` by least squares over measured ``(n, seconds)`` points, both clamped
    at 0 (timing noise); ``None`` with fewer than two distinct ``n``."""
    ns = [float(n) for n, _ in points]
    if len(set(ns)) < 2:
        return None
    ts = [float(t) for _, t in points]
    n_mean, t_mean = sum(ns) / len(ns), sum(ts) / len(ts)
    spread = sum((n - n_mean) ** 2 for n in ns)
    per_client = max(0.0, sum((n - n_mean) * (t - t_mean) for n, t in zip(ns, ts, strict=True)) / spread)
    return StepCost(max(0.0, t_mean - per_client * n_mean), per_client)


def time_calls(call: Callable[[], Any], repeats: int = 3, sync: Callable[[], None] | None = None) -> float:
    """The fastest of ``repeats`` timed calls of ``call`` (after one untimed warm-up call), in seconds; ``sync``
    (``torch.cuda.synchronize``) waits for the device before each clock reading."""
    sync = sync or (lambda: None)
    call()
    sync()
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        sync()
        best = min(best, time.perf_counter() - started)
    return best


def measure_step_cost(ctx: Any, params: dict[str, Tensor], batch: Any, most: int, repeats: int = 3) -> StepCost | None:
    """``a`` and ``b`` of a batched step on this model and device: the fastest of ``repeats`` eager
    ``vmap(ctx.loss_and_grad)`` calls on ``batch`` (one client's, repeated) for 1, about half and ``most`` clients,
    fitted by :func:`fit_step_cost_points`. ``ctx`` is a :class:`~lightning_fedmeta.client.functional.ClientContext`
    without
    a compiler (the eager step is what is timed)."""
    device = next(iter(params.values())).device
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    step = torch.func.vmap(ctx.loss_and_grad)

    def seconds(n: int) -> float:
        stacked = {k: v.unsqueeze(0).expand(n, *v.shape).contiguous() for k, v in params.items()}
        repeated = type(batch)(*(t.unsqueeze(0).expand(n, *t.shape) for t in batch))
        return time_calls(lambda: step(stacked, repeated), repeats=repeats, sync=sync)

    return fit_step_cost_points([(n, seconds(n)) for n in sorted({1, max(1, (most + 1) // 2), most})])


def _calls(clients: int, chunk: int | None) -> int:
    return 1 if chunk is None else math.ceil(clients / chunk)


def group_seconds(max_steps: int, clients: int, cost: StepCost, chunk: int | None) -> float:
    """The modelled time of one group: ``max_g·(a·⌈n_g/chunk⌉ + b·n_g)``."""
    return max_steps * (cost.latency * _calls(clients, chunk) + cost.per_client * clients)


def cheapest_groups(steps: Tensor, cost: StepCost, chunk: int | None) -> list[Tensor]:
    """The partition of the clients (positions into ``steps``) with the least modelled time
    ``Σ_g max_g·(a·⌈n_g/chunk⌉ + b·n_g)``, by dynamic programming over the clients sorted by ``s_c`` descending
    (ties by position): ``f(j) = min_{i<j} f(i) + cost(sorted[i:j])``, ``O(K²)``. Clients with ``s_c = 0`` form the
    last group, as in :func:`~lightning_fedmeta.loop.grouping.step_groups`. Each group lists its positions in
    ascending order."""
    order = torch.argsort(-steps, stable=True)
    ranked = steps[order].tolist()
    positive = sum(1 for s in ranked if s > 0)
    tops = torch.tensor(ranked[:positive], dtype=torch.float64)
    best = torch.zeros(positive + 1, dtype=torch.float64)
    cut = [0] * (positive + 1)
    for j in range(1, positive + 1):  # one vector over every start i < j of the last group
        sizes = torch.arange(j, 0, -1, dtype=torch.float64)  # n = j − i for i = 0..j−1
        calls = sizes if chunk == 1 else (torch.ceil(sizes / chunk) if chunk is not None else torch.ones_like(sizes))
        values = best[:j] + tops[:j] * (cost.latency * calls + cost.per_client * sizes)
        i = int(torch.argmin(values))  # the first minimum: ties keep the longest last group
        best[j], cut[j] = values[i], i
    bounds = []
    j = positive
    while j > 0:
        bounds.append((cut[j], j))
        j = cut[j]
    groups = [order[i:j] for i, j in reversed(bounds)]
    if positive < len(ranked):
        groups.append(order[positive:])
    return [g.sort().values for g in groups]


def sequential_steps(steps: Tensor, groups: list[Tensor], chunk: int | None = None) -> int:
    """How many batched steps run one after the other: ``Σ_g ⌈n_g/chunk⌉·max(1, max_g)`` (a group of clients with no
    step runs one empty step)."""
    return sum(_calls(g.numel(), chunk) * max(1, int(steps[g].max())) for g in groups)


class StepSchedule:
    """Plans a round's groups for ``model.step_schedule`` (see the module docstring) and keeps the measured cost.

    Args:
        mode: ``"auto"``, ``"grouped"``, ``"lockstep"`` or ``"compacted"``.
    """

    def __init__(self, mode: ScheduleMode = "auto") -> None:
        if mode not in SCHEDULES:
            raise ValueError(f"step_schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {mode!r}")
        self.mode: ScheduleMode = mode
        #: the measured cost model of ``"auto"`` (``None`` until measured; checkpointed)
        self.cost: StepCost | None = None
        self._cache: dict[tuple[tuple[int, ...], int | None, str], list[Tensor]] = {}

    @property
    def compacts(self) -> bool:
        """Whether the primitives skip the clients whose step is empty (``"compacted"``)."""
        return self.mode == "compacted"

    def needs_cost(self, batching: str) -> bool:
        """Whether :meth:`groups` needs a measured :attr:`cost` first (``"auto"`` on the batched path)."""
        return self.mode == "auto" and batching == "vmap" and self.cost is None

    def groups(self, steps: Tensor, batching: str, chunk: int | None) -> list[Tensor]:
        """The groups (positions into ``steps``) this round's clients run in."""
        key = (tuple(int(s) for s in steps.tolist()), chunk, batching)
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._plan(steps, batching, chunk)
            if len(self._cache) > 256:  # rounds of sampled clients rarely repeat: keep the cache small
                self._cache.pop(next(iter(self._cache)))
        return hit

    def _plan(self, steps: Tensor, batching: str, chunk: int | None) -> list[Tensor]:
        if batching == "loop":  # each client runs alone: any client in a longer group takes padded steps
            return cheapest_groups(steps, StepCost(0.0, 1.0), 1)
        if self.mode in ("lockstep", "compacted"):
            return step_groups(steps, 0.0)
        if self.mode == "grouped" or self.cost is None:
            return step_groups(steps, GROUP_RATIO)
        return cheapest_groups(steps, self.cost, chunk)

    def state_dict(self) -> dict[str, Any]:
        return {"step_cost": None if self.cost is None else self.cost.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = StepCost.from_state(state.get("step_cost"))
        if saved is not None and self.mode == "auto":
            self.cost = saved
            self._cache.clear()
