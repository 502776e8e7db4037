"""Unreliable clients: dropouts, over-selection and per-client budgets of local steps.

Every draw is a pure function of ``(seed, tag, round, client)`` (docs/design.md, contract 1), so which
clients answer a round, in which order, and how many local steps each one takes are the same whether the run
is looped, batched, split over processes or resumed from a checkpoint.

Round ``r`` with ``m`` clients per round, dropout probability ``p`` and over-selection ``f``:

    candidates = sample_clients(seed, r, ⌈(1 + f)·m⌉)
    client c fails         iff  u_c < p                      u_c ~ U[0, 1) from (seed, "availability", r, c)
    answering clients      = the candidates that did not fail, in order of their arrival time a_c ~ U[0, 1)
    the round's clients    = the first m to arrive (all of them when fewer answer)

A straggler with a budget of ``τ_c`` local steps (``local_steps_dist``) takes the first ``τ_c`` steps of the
round's plan; its later steps see an empty batch (every mask entry 0), which an algorithm that declares
``Algorithm.step_budget = True`` treats as no step at all. Clients still run batched: the missing steps are
masked, not removed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_fedmeta.client.sampling import generator_for

__all__ = [
    "StepBudget",
    "answering_clients",
    "check_budget_with_epochs",
    "check_dropout",
    "expected_answers",
    "check_over_selection",
    "mask_missing_steps",
    "num_candidates",
    "parse_local_steps_dist",
]


def check_dropout(p: Any, option: str = "model.client_dropout") -> float:
    """``p`` as a float in ``[0, 1)`` (``1`` would fail every client of every round)."""
    if isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p < 1:
        raise ValueError(f"{option} must be a probability in [0, 1), got {p!r}")
    return float(p)


def check_over_selection(f: Any, option: str = "model.over_selection") -> float:
    """``f`` as a float ``>= 0`` (``f = 0.3`` samples 30 % more clients than are kept)."""
    if isinstance(f, bool) or not isinstance(f, int | float) or not (0 <= f < math.inf):
        raise ValueError(f"{option} must be a finite number >= 0 (the extra fraction of clients sampled), got {f!r}")
    return float(f)


def num_candidates(num_kept: int, over_selection: float, num_eligible: int) -> int:
    """``⌈(1 + f)·m⌉`` clients sampled to keep ``m``, at most every eligible client."""
    return min(num_eligible, math.ceil((1.0 + over_selection) * num_kept - 1e-9))


def expected_answers(num_candidates: int, dropout: float, keep: int) -> float:
    """``E[min(keep, A)]`` with ``A ~ Binomial(num_candidates, 1 − dropout)``: the expected number of clients of a
    round that answer (:func:`answering_clients`), exactly, from the binomial probabilities."""
    if dropout == 0:
        return float(min(keep, num_candidates))
    answer = 1.0 - dropout
    return float(sum(min(keep, k) * math.comb(num_candidates, k) * answer ** k * dropout ** (num_candidates - k)
                     for k in range(num_candidates + 1)))


def answering_clients(seed: int, round_idx: int, candidates: Tensor, dropout: float, keep: int) -> Tensor:
    """The round's clients: the first ``keep`` candidates to answer, sorted by index.

    Each candidate ``c`` fails with probability ``dropout`` (``u_c < p``) and otherwise answers at time ``a_c``;
    both uniforms come from one generator seeded by ``(seed, "availability", round, c)``. With ``dropout = 0`` and
    ``keep ≥ len(candidates)`` the candidates are returned unchanged (nothing is drawn)."""
    if dropout == 0 and keep >= candidates.numel():
        return candidates
    ids = candidates.tolist()
    draws = torch.stack([torch.rand(2, generator=generator_for(seed, "availability", round_idx, c)) for c in ids])
    answered = draws[:, 0] >= dropout
    arrival = draws[:, 1].masked_fill(~answered, math.inf)
    order = torch.argsort(arrival, stable=True)[: min(keep, int(answered.sum()))]
    return candidates[order].sort().values


def mask_missing_steps(mask: Tensor, budget: Tensor) -> Tensor:
    """Zero the batch masks of the steps a client does not take: ``mask[c, t] = 0`` for ``t ≥ τ_c``.

    ``mask`` is ``[C, steps, per_step, B]``; ``budget`` ``[C]`` (int). Returns ``mask`` (modified in place)."""
    steps = torch.arange(mask.shape[1], device=mask.device)
    taken = steps.unsqueeze(0) < budget.to(mask.device).unsqueeze(1)  # [C, steps]
    mask.mul_(taken.to(mask.dtype).reshape(*taken.shape, *([1] * (mask.dim() - 2))))
    return mask


@dataclass(frozen=True)
class StepBudget:
    """How many local steps each client takes in a round (system heterogeneity: slow devices do fewer).

    One of:

    * ``per_client``: a fixed budget per client (``local_steps_dist: [10, 10, 2, ...]``, one entry per client of
      the federation, held-out clients included);
    * ``uniform``: ``τ_c ~ U{low, …, high}`` drawn per round and client
      (``local_steps_dist: {distribution: uniform, low: 1, high: 10}``);
    * ``choice``: ``τ_c`` drawn from ``values`` with probabilities ``probs`` (uniform when omitted) per round and
      client (``local_steps_dist: {distribution: choice, values: [2, 10], probs: [0.3, 0.7]}``).

    Draws are pure functions of ``(seed, "steps", round, client)``.
    """

    kind: str
    per_client: tuple[int, ...] = ()
    low: int = 1
    high: int = 1
    values: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()

    def largest(self) -> int:
        """The largest budget this distribution can give."""
        if self.kind == "per_client":
            return max(self.per_client)
        if self.kind == "uniform":
            return self.high
        return max(v for v, p in zip(self.values, self.probs, strict=True) if p > 0)

    def check(self, plan_steps: int, num_clients: int, option: str = "model.local_steps_dist") -> None:
        """Refuse budgets the round's plan cannot honour (above its ``plan_steps`` steps) or a list of the wrong
        length."""
        if self.kind == "per_client" and len(self.per_client) != num_clients:
            raise ValueError(
                f"{option} as a list needs one budget per client: {num_clients} entries, got {len(self.per_client)}"
            )
        if self.largest() > plan_steps:
            raise ValueError(
                f"{option} gives budgets up to {self.largest()} local steps, but the algorithm's round takes "
                f"{plan_steps}: a budget is at most the algorithm's local_steps"
            )

    def draw(self, seed: int, round_idx: int, clients: Tensor) -> Tensor:
        """The budgets ``τ_c`` (int64 ``[C]``) of the given clients in round ``round_idx``."""
        ids = clients.tolist()
        if self.kind == "per_client":
            return torch.tensor([self.per_client[c] for c in ids], dtype=torch.long)
        out = []
        for c in ids:
            g = generator_for(seed, "steps", round_idx, c)
            if self.kind == "uniform":
                out.append(int(torch.randint(self.low, self.high + 1, (1,), generator=g)))
            else:
                k = int(torch.multinomial(torch.tensor(self.probs, dtype=torch.float64), 1, generator=g))
                out.append(self.values[k])
        return torch.tensor(out, dtype=torch.long)


def check_budget_with_epochs(local_epochs: int | None, option: str = "model.local_steps_dist") -> None:
    """Refuse budgets of local steps together with ``local_epochs``: a budget counts steps of a fixed-length round,
    while under epochs each client's step count is its own (``E·⌈n_c/B⌉``)."""
    if local_epochs is not None:
        raise ValueError(
            f"{option} gives straggler budgets in local steps, but the algorithm counts its local work in epochs "
            f"(local_epochs={local_epochs}): use local_steps with {option}, or local_epochs without it"
        )


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} must be an integer >= 1 (local steps), got {value!r}")
    return value


def parse_local_steps_dist(spec: Any, option: str = "model.local_steps_dist") -> StepBudget | None:
    """A :class:`StepBudget` from the option's value (``None``: every client takes the algorithm's local steps)."""
    if spec is None:
        return None
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        if not spec:
            raise ValueError(f"{option} as a list needs one budget per client, got an empty list")
        budgets = tuple(_positive_int(v, f"{option}[{i}]") for i, v in enumerate(spec))
        return StepBudget("per_client", per_client=budgets)
    if not isinstance(spec, Mapping):
        raise ValueError(
            f"{option} must be a list (one budget per client) or a mapping {{distribution: uniform|choice, ...}}, "
            f"got {spec!r}"
        )
    spec = dict(spec)
    kind = spec.pop("distribution", None)
    allowed = {"uniform": {"low", "high"}, "choice": {"values", "probs"}}
    if kind not in allowed:
        raise ValueError(f"{option}.distribution must be 'uniform' or 'choice', got {kind!r}")
    unknown = sorted(set(spec) - allowed[kind])
    if unknown:
        raise ValueError(f"{option} with distribution {kind!r} takes {sorted(allowed[kind])}; unknown: {unknown}")
    if kind == "uniform":
        if "low" not in spec or "high" not in spec:
            raise ValueError(f"{option} with distribution 'uniform' needs low and high")
        low, high = _positive_int(spec["low"], f"{option}.low"), _positive_int(spec["high"], f"{option}.high")
        if high < low:
            raise ValueError(f"{option}.high must be >= {option}.low, got low={low}, high={high}")
        return StepBudget("uniform", low=low, high=high)
    values = spec.get("values")
    if not isinstance(values, Sequence) or isinstance(values, str) or not values:
        raise ValueError(f"{option}.values must be a non-empty list of local step counts, got {values!r}")
    values_t = tuple(_positive_int(v, f"{option}.values[{i}]") for i, v in enumerate(values))
    probs = spec.get("probs")
    if probs is None:
        probs_t = tuple(1.0 / len(values_t) for _ in values_t)
    else:
        if (
            not isinstance(probs, Sequence) or isinstance(probs, str) or len(probs) != len(values_t)
            or any(isinstance(p, bool) or not isinstance(p, int | float) or not 0 <= p <= 1 for p in probs)
            or abs(sum(probs) - 1) > 1e-6
        ):
            raise ValueError(
                f"{option}.probs must be {len(values_t)} probabilities in [0, 1] summing to 1 (one per value), "
                f"got {probs!r}"
            )
        probs_t = tuple(float(p) for p in probs)
    return StepBudget("choice", values=values_t, probs=probs_t)
