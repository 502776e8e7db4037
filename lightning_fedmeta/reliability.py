"""The round's server side under unreliable, Byzantine and private clients (docs/reliability.md).

The loop (:mod:`lightning_fedmeta.module`) asks this module three questions each round: which sampled clients
answer (:mod:`lightning_fedmeta.participation`), how many local steps each one takes, and how their uploads
combine. The combination, for an algorithm whose upload is a parameter delta (its ``aggregate`` is the default
``Σ_i p_i Δ_i``):

    Δ_i   ← attack(Δ_i)                    Byzantine clients' uploads replaced  (model.byzantine, model poisoning)
    Δ_i   ← Δ_i · min(1, C / ‖Δ_i‖)        client-level DP clipping             (model.dp; C adaptive or fixed)
    Δ     = rule({Δ_i}, p)                 mean (the algorithm's own aggregate), median, trimmed mean, Krum,
                                           Multi-Krum, Bulyan, geometric median, FedNova  (model.aggregator)
    Δ     ← Δ + (σ_Δ C / m) ξ,  ξ ~ N(0, I)   DP noise on the sum, m = clients sampled per round

With DP the weights are ``1/m`` for every answering client (a fixed denominator, McMahan et al. 2018), so a
client's influence on ``Δ`` is at most ``C/m``. Every random draw is a pure function of ``(seed, tag, round)``.

Combinations that cannot mean what they say are refused at setup by :meth:`Reliability.check`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_fedmeta.algorithms.base import Algorithm, ClientOutput, ClientRecord
from lightning_fedmeta.attacks import ByzantineSpec, attack_rows, choose_byzantine_clients, parse_byzantine
from lightning_fedmeta.functional import Params
from lightning_fedmeta.participation import (
    StepBudget,
    check_dropout,
    check_over_selection,
    parse_local_steps_dist,
)
from lightning_fedmeta.privacy import DPSpec, adapt_clip, clip_rows, gaussian_noise, noise_multipliers, parse_dp
from lightning_fedmeta.robust import (
    AggregatorSpec,
    aggregate_rows,
    check_aggregator,
    flatten_rows,
    parse_aggregator,
    unflatten_row,
)
from lightning_fedmeta.sampling import generator_for

__all__ = ["Reliability", "uploads_delta"]


def uploads_delta(algorithm: Algorithm) -> bool:
    """Whether the algorithm's upload is a parameter delta combined by the default weighted mean: its ``aggregate``
    is :meth:`Algorithm.aggregate` and the server optimizer applies the result. Robust rules, model-poisoning
    attacks and DP act on such uploads only."""
    cls = type(algorithm)
    return cls.aggregate is Algorithm.aggregate and cls.server_optimizer_applies


def _name(algorithm: Algorithm) -> str:
    return type(algorithm).name or type(algorithm).__name__


@dataclass
class Reliability:
    """The reliability options of a :class:`~lightning_fedmeta.FederatedModule`, parsed and checked.

    Attributes:
        dropout: ``p``, the probability that a sampled client fails in a round.
        over_selection: ``f``: ``⌈(1 + f)·m⌉`` clients are sampled and the first ``m`` to answer are kept.
        budget: per-client budgets of local steps (``None``: every client takes the algorithm's steps).
        aggregator: the server's combination rule.
        byzantine: the simulated Byzantine clients and their attack (``None``: every client is honest).
        dp: client-level differential privacy (``None``: off).
    """

    dropout: float = 0.0
    over_selection: float = 0.0
    budget: StepBudget | None = None
    aggregator: AggregatorSpec = field(default_factory=AggregatorSpec)
    byzantine: ByzantineSpec | None = None
    dp: DPSpec | None = None

    @classmethod
    def from_options(
        cls,
        client_dropout: Any = 0.0,
        over_selection: Any = 0.0,
        local_steps_dist: Any = None,
        aggregator: Any = None,
        byzantine: Any = None,
        dp: Any = None,
    ) -> Reliability:
        """Parse the module's options (each error names its ``model.*`` option)."""
        return cls(
            dropout=check_dropout(client_dropout),
            over_selection=check_over_selection(over_selection),
            budget=parse_local_steps_dist(local_steps_dist),
            aggregator=parse_aggregator(aggregator),
            byzantine=parse_byzantine(byzantine),
            dp=parse_dp(dp),
        )

    # ------------------------------------------------------------------------------------------
    @property
    def transforms_uploads(self) -> bool:
        """Whether the round's uploads go through this module instead of straight to ``algorithm.aggregate``."""
        return (
            self.aggregator.name != "mean" or self.aggregator.clip is not None or self.dp is not None
            or (self.byzantine is not None and self.byzantine.poisons_model)
        )

    def assumed_byzantine(self, num_sampled: int) -> int:
        """``f``, the Byzantine updates a rule tolerates per round: ``model.aggregator.f``, else
        ``⌈fraction · m⌉`` of ``model.byzantine``, else 0."""
        if self.aggregator.f is not None:
            return int(self.aggregator.f)
        if self.byzantine is not None:
            return math.ceil(self.byzantine.fraction * num_sampled - 1e-9)
        return 0

    def check(
        self, algorithm: Algorithm, *, num_clients: int, num_sampled: int, aggregation: str, task: str,
    ) -> None:
        """Refuse, before training, the combinations that are not meaningful (docs/reliability.md)."""
        name = _name(algorithm)
        if self.budget is not None:
            if not type(algorithm).step_budget:
                raise ValueError(
                    f"model.local_steps_dist: {name} does not support per-client budgets of local steps (its "
                    "client_update does not declare step_budget = True: an empty step would still move it); "
                    "supported: fedavg, fedprox, reptile, scaffold, perfedavg"
                )
            self.budget.check(algorithm.round_plan().steps, num_clients)
        delta_only = []
        if self.aggregator.name != "mean" or self.aggregator.clip is not None:
            delta_only.append(f"model.aggregator={self.aggregator.name!r}")
        if self.byzantine is not None and self.byzantine.poisons_model:
            delta_only.append(f"model.byzantine.attack={self.byzantine.attack!r}")
        if self.dp is not None:
            delta_only.append("model.dp")
        if delta_only and not uploads_delta(algorithm):
            raise ValueError(
                f"{', '.join(delta_only)} act on uploads that are parameter deltas combined by a weighted mean; "
                f"{name} combines its uploads with its own aggregate (or updates models outside the server "
                "optimizer), so it cannot be used with them. Use an algorithm with the default aggregate "
                "(fedavg, fedprox, reptile, perfedavg, fedmaml, ditto, fedrep, fedper, ...)"
            )
        if self.byzantine is not None and self.byzantine.attack == "label_flip" and task != "classification":
            raise ValueError(f"model.byzantine.attack='label_flip' flips class labels; this data's task is {task!r}")
        f = self.assumed_byzantine(num_sampled)
        if self.aggregator.needs_f and self.aggregator.f is None and self.byzantine is None:
            raise ValueError(
                f"model.aggregator.f is required for {self.aggregator.name!r}: the number of Byzantine updates per "
                "round it must tolerate"
            )
        check_aggregator(self.aggregator, num_sampled, f)
        if self.dp is not None:
            if aggregation != "uniform":
                raise ValueError(
                    "model.dp bounds each client's influence by giving every client the weight 1/m (m clients per "
                    "round); set model.aggregation: uniform (got 'samples', whose weights are unbounded)"
                )
            if self.aggregator.name != "mean" or self.aggregator.clip is not None:
                raise ValueError(
                    f"model.dp clips and averages the updates itself; remove model.aggregator (got "
                    f"{self.aggregator.name!r}{', clip' if self.aggregator.clip is not None else ''})"
                )
            noise_multipliers(self.dp, num_sampled)  # refuses an impossible split of the noise (adaptive clipping)

    # ------------------------------------------------------------------------------------------
    def byzantine_clients(self, seed: int, eligible: Tensor) -> Tensor:
        """The run's Byzantine clients (sorted indices; empty without ``model.byzantine``)."""
        if self.byzantine is None:
            return torch.zeros(0, dtype=torch.long)
        return choose_byzantine_clients(seed, eligible, self.byzantine.fraction)

    def combine(
        self,
        algorithm: Algorithm,
        params: Params,
        out: ClientOutput,
        weights: Tensor,
        server_state: dict[str, Tensor],
        records: ClientRecord,
        *,
        seed: int,
        round_idx: int,
        byzantine: Tensor,
        steps: Tensor,
        cohort: int,
        clip: float,
    ) -> tuple[Any, dict[str, float]] | None:
        """The round's aggregate ``((Δ, server_state), info)``; ``None`` when the rule cannot run on this round's
        clients (too few answered for Krum or Bulyan): the round then leaves the model unchanged. The pair is
        what ``algorithm.aggregate`` returned (unchecked: the loop validates it) whenever the algorithm's own
        aggregate combines the uploads.

        Args:
            byzantine: bool ``[n]``, which of the round's clients are Byzantine.
            steps: int ``[n]``, the local steps each client took (FedNova).
            cohort: ``m``, the clients sampled per round (the DP denominator).
            clip: the current DP clipping norm ``C`` (adaptive clipping changes it; see ``info["dp_clip"]``).
        """
        info: dict[str, float] = {}
        if not self.transforms_uploads:
            return algorithm.aggregate(params, out, weights, server_state, records), info
        n = int(weights.numel())
        f = self.assumed_byzantine(cohort)
        if self.aggregator.needs_f:
            try:
                check_aggregator(self.aggregator, n, f)
            except ValueError:
                return None
        rows = flatten_rows(out.delta)
        if self.byzantine is not None and self.byzantine.poisons_model and bool(byzantine.any()):
            generator = generator_for(seed, "attack", round_idx)
            rows = attack_rows(self.byzantine, rows, byzantine.to(rows.device), generator)
        if self.dp is not None:
            rows, norms = clip_rows(rows, clip)
            weights = torch.ones(n, dtype=weights.dtype, device=weights.device) / cohort
        if self.aggregator.name == "mean" and self.aggregator.clip is None:
            # the algorithm's own aggregate on the transformed uploads: bit for bit the plain run when nothing changed
            result = algorithm.aggregate(
                params, out._replace(delta=unflatten_row_tree(rows, out.delta)), weights, server_state, records
            )
            if self.dp is None:
                return result, info
            delta, new_server_state = result
        else:
            vector = aggregate_rows(self.aggregator, rows, weights, f=f, steps=steps.to(rows.device))
            delta, new_server_state = unflatten_row(vector, out.delta), server_state
        if self.dp is not None:
            sigma, _ = noise_multipliers(self.dp, cohort)
            if sigma > 0:
                generator = generator_for(seed, "dp-noise", round_idx)
                std = sigma * clip / cohort
                delta = {k: v + gaussian_noise(v, std, generator) for k, v in delta.items()}
            info["dp_clip"] = clip
            if self.dp.adaptive is not None:
                generator = generator_for(seed, "dp-clip", round_idx)
                # b̄ counts the answering clients under C over the cohort m: a client that did not answer counts
                # as above C (norm +inf), so it adds nothing to the count and the denominator stays m
                missing = torch.full((cohort - n,), math.inf, dtype=norms.dtype, device=norms.device)
                info["dp_next_clip"] = adapt_clip(clip, torch.cat([norms, missing]), cohort, self.dp, generator)
            info["dp_clipped_fraction"] = float((norms > clip).to(torch.float64).mean())
        return (delta, new_server_state), info


def unflatten_row_tree(rows: Tensor, like: Params) -> Params:
    """``[n, d]`` rows back to a tree of ``[n, ...]`` leaves shaped like ``like`` (the inverse of ``flatten_rows``)."""
    out, start = {}, 0
    for k, v in like.items():
        size = v[0].numel() if v.shape[0] else int(math.prod(v.shape[1:]))
        out[k] = rows[:, start:start + size].reshape(v.shape).to(v.dtype)
        start += size
    return out
