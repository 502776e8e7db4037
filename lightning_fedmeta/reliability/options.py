"""The reliability options of a run, parsed and checked (docs/reliability.md).

Client dropout and over-selection (:mod:`lightning_fedmeta.reliability.participation`), per-client budgets of local
steps,
the server's aggregation rule (:mod:`lightning_fedmeta.reliability.robust`), simulated Byzantine clients
(:mod:`lightning_fedmeta.reliability.attacks`) and client-level differential privacy
(:mod:`lightning_fedmeta.privacy.mechanism`).
The round engine uses them: :class:`~lightning_fedmeta.loop.federation.Federation` decides who answers and how
many steps each takes; :meth:`~lightning_fedmeta.loop.server.ServerPipeline.from_reliability` turns them into
the server's stages:

    Δ_i   ← attack(Δ_i)                    Byzantine clients' uploads replaced  (model.byzantine, model poisoning)
    Δ_i   ← Δ_i · min(1, C / ‖Δ_i‖)        client-level DP clipping             (model.dp; C adaptive or fixed)
    Δ     = rule({Δ_i}, p)                 mean (the algorithm's own aggregate), median, trimmed mean, Krum,
                                           Multi-Krum, Bulyan, geometric median, FedNova, or an installed
                                           package's rule (lightning_fedmeta.aggregators)  (model.aggregator)
    Δ     ← Δ + (σ_Δ C / m) ξ,  ξ ~ N(0, I)   DP noise on the sum, m = clients sampled per round

Combinations that cannot mean what they say are refused at setup by :meth:`Reliability.check`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_fedmeta.algorithms.base import Algorithm
from lightning_fedmeta.communication.compressors import CompressionSpec, check_composition, parse_compression
from lightning_fedmeta.privacy.mechanism import DPSpec, noise_multipliers, parse_dp
from lightning_fedmeta.reliability.attacks import ByzantineSpec, choose_byzantine_clients, parse_byzantine
from lightning_fedmeta.reliability.participation import (
    StepBudget,
    check_budget_with_epochs,
    check_dropout,
    check_over_selection,
    parse_local_steps_dist,
)
from lightning_fedmeta.reliability.robust import (
    AggregatorSpec,
    check_aggregator,
    parse_aggregator,
)

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
        compression: the uploads' and downloads' compression, client side (``None``: off; docs/communication.md).
    """

    dropout: float = 0.0
    over_selection: float = 0.0
    budget: StepBudget | None = None
    aggregator: AggregatorSpec = field(default_factory=AggregatorSpec)
    byzantine: ByzantineSpec | None = None
    dp: DPSpec | None = None
    compression: CompressionSpec | None = None

    @classmethod
    def from_options(
        cls,
        client_dropout: Any = 0.0,
        over_selection: Any = 0.0,
        local_steps_dist: Any = None,
        aggregator: Any = None,
        byzantine: Any = None,
        dp: Any = None,
        compression: Any = None,
    ) -> Reliability:
        """Parse the module's options (each error names its ``model.*`` option)."""
        return cls(
            dropout=check_dropout(client_dropout),
            over_selection=check_over_selection(over_selection),
            budget=parse_local_steps_dist(local_steps_dist),
            aggregator=parse_aggregator(aggregator),
            byzantine=parse_byzantine(byzantine),
            dp=parse_dp(dp),
            compression=parse_compression(compression),
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
        self._check_budget(algorithm, name, num_clients)
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
        if self.compression is not None:
            check_composition(self.compression, algorithm_name=name, uploads_delta=uploads_delta(algorithm),
                              aggregator=self.aggregator.name)
        f = self.assumed_byzantine(num_sampled)
        if self.aggregator.needs_f and self.aggregator.f is None and self.byzantine is None:
            raise ValueError(
                f"model.aggregator.f is required for {self.aggregator.name!r}: the number of Byzantine updates per "
                "round it must tolerate"
            )
        check_aggregator(self.aggregator, num_sampled, f)
        if self.dp is not None:
            self._check_dp(aggregation, num_sampled)

    def _check_budget(self, algorithm: Algorithm, name: str, num_clients: int) -> None:
        """``model.local_steps_dist`` needs an algorithm that honours empty steps, step counts, and no epochs."""
        if self.budget is None:
            return
        if not type(algorithm).step_budget:
            raise ValueError(
                f"model.local_steps_dist: {name} does not support per-client budgets of local steps (its "
                "client_update does not declare step_budget = True: an empty step would still move it); every "
                "built-in algorithm but mocha declares it"
            )
        check_budget_with_epochs(getattr(algorithm, "local_epochs", None))
        self.budget.check(algorithm.round_plan().steps, num_clients)

    def _check_dp(self, aggregation: str, num_sampled: int) -> None:
        """``model.dp`` needs uniform weights, no robust rule, no over-selection under Poisson sampling, and a
        noise split adaptive clipping can make."""
        assert self.dp is not None
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
        if self.dp.sampling == "poisson" and self.over_selection > 0:
            raise ValueError(
                f"model.dp.sampling: poisson samples each client independently, so there is no cohort to "
                f"over-select; remove model.over_selection (got {self.over_selection!r})"
            )
        noise_multipliers(self.dp, num_sampled)  # refuses an impossible split of the noise (adaptive clipping)

    # ------------------------------------------------------------------------------------------
    def byzantine_clients(self, seed: int, eligible: Tensor) -> Tensor:
        """The run's Byzantine clients (sorted indices; empty without ``model.byzantine``)."""
        if self.byzantine is None:
            return torch.zeros(0, dtype=torch.long)
        return choose_byzantine_clients(seed, eligible, self.byzantine.fraction)
