"""Who takes part: the population's records, hold-outs, aggregation weights, sampling and participation.

For ``K`` clients with ``n_i`` training samples (docs/design.md, contracts 1 and 6):

    H      = choose_holdout(seed, K, holdout_clients)          held out: never sampled, evaluated as new clients
    E      = {0..K-1} \\ H                                       the training clients
    p_i    = s_i / Σ_{j∈E} s_j   (i ∈ E; 0 on H),  s_i = n_i ("samples") or 1 ("uniform")
    S_r    = answering(seed, r, sample(seed, r, E, ⌈(1 + f)·m⌉), dropout, m)   pure in (seed, r)
             (under model.dp: r is the release index; Poisson or secret draws as its options ask)
    w_i^r  = s_i / Σ_{j∈S_r} s_j                                 the round's weights, renormalised over S_r
    τ_i^r  = budget(seed, r, i) or the algorithm's steps        local steps (stragglers do fewer)
    seen_i ← seen_i ∨ (i ∈ S_r)                                  after the round is committed

Every quantity is a pure function of the seed, the round and the client, so every frontend (the Lightning
module, a Flower ServerApp, the testing kit) that holds the same :class:`Federation` draws the same clients.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_fedmeta.algorithms.base import Algorithm, ClientRecord
from lightning_fedmeta.client.sampling import choose_holdout, sample_clients
from lightning_fedmeta.privacy.draws import DPDraws, SeededDraws
from lightning_fedmeta.reliability.options import Reliability
from lightning_fedmeta.reliability.participation import answering_clients, expected_answers, num_candidates

__all__ = ["Federation"]


class Federation:
    """The clients of one run and the pure rules that decide each round's participants and weights.

    Args:
        seed: the run's seed (client sampling, participation, step budgets).
        clients_per_round: ``m``, or ``None`` with ``fraction``.
        fraction: ``m = ⌈fraction · |E|⌉`` when given.
        holdout_clients: clients never sampled (a count, or a fraction in [0, 1)).
        aggregation: ``"samples"`` (``s_i = n_i``) or ``"uniform"`` (``s_i = 1``).
        reliability: dropout, over-selection, step budgets and Byzantine clients (``model.*`` options).
    """

    def __init__(self, seed: int, clients_per_round: int | None, fraction: float | None,
                 holdout_clients: int | float, aggregation: str, reliability: Reliability) -> None:
        self.seed = seed
        self.clients_per_round = clients_per_round
        self.fraction = fraction
        self.holdout_clients = holdout_clients
        self.aggregation = aggregation
        self.reliability = reliability
        self.seen: Tensor | None = None  # [K] bool: took part in a committed round
        self.byzantine_clients = torch.zeros(0, dtype=torch.long)
        self.round_offset = 0  # rounds the model released in earlier fits (warm starts): DP draws continue after them
        self.cohort_draws: DPDraws | None = None  # the secret stream under model.dp.secure_mode

    def bind(self, train_counts: Tensor, algorithm: Algorithm, task: str) -> None:
        """Fix the population (``n_i`` per client): hold-outs, ``m``, candidates, ``p_i``, Byzantine clients.
        Raises ``ValueError`` for a setting that does not fit (more clients per round than training clients, a
        reliability option this algorithm or round size cannot support)."""
        self.counts = train_counts.cpu()
        k = int(self.counts.numel())
        self.holdout = choose_holdout(self.seed, k, self.holdout_clients)
        is_holdout = torch.zeros(k, dtype=torch.bool)
        is_holdout[self.holdout] = True
        self.is_holdout = is_holdout
        self.eligible = (~is_holdout).nonzero().flatten()
        n_eligible = self.eligible.numel()
        if self.fraction is not None:
            self.num_sampled = max(1, math.ceil(self.fraction * n_eligible))
        else:
            self.num_sampled = int(self.clients_per_round)  # type: ignore[arg-type]
            if self.num_sampled > n_eligible:
                raise ValueError(
                    f"clients_per_round={self.num_sampled} exceeds the {n_eligible} training clients "
                    f"({k} clients, {k - n_eligible} held out)"
                )
        self.reliability.check(algorithm, num_clients=k, num_sampled=self.num_sampled,
                               aggregation=self.aggregation, task=task)
        self.num_candidates = num_candidates(self.num_sampled, self.reliability.over_selection, n_eligible)
        self.byzantine_clients = self.reliability.byzantine_clients(self.seed, self.eligible)
        counts = self.counts.to(torch.float64)
        share = counts if self.aggregation == "samples" else torch.ones_like(counts)
        share = share * (~is_holdout).to(torch.float64)
        self.client_weight = share / share.sum()  # p_i over the training clients, 0 when held out
        if self.seen is None or self.seen.numel() != k:
            self.seen = torch.zeros(k, dtype=torch.bool)

    @property
    def num_clients(self) -> int:
        return int(self.counts.numel())

    def records(self, clients: Tensor, device: torch.device | str = "cpu") -> ClientRecord:
        """The stacked :class:`ClientRecord` of the given client indices."""
        assert self.seen is not None
        idx = clients.cpu().long()
        return ClientRecord(
            index=idx.to(device), weight=self.client_weight[idx].to(device), is_new=self.is_holdout[idx].to(device),
            seen=self.seen[idx].to(device), num_samples=self.counts[idx].long().to(device),
        )

    def round_clients(self, round_idx: int) -> Tensor:
        """The clients that take part in round ``round_idx`` (sorted): the sampled ones, or under ``client_dropout``
        / ``over_selection`` the first ``m`` of ``⌈(1 + f)·m⌉`` candidates that answer (possibly none).

        Under ``model.dp`` the draw is made for the round's release ``round_offset + round_idx`` (a warm start
        never repeats an earlier fit's cohorts); with ``model.dp.sampling: poisson`` each training client is a
        candidate independently with probability ``q = m / |E|`` (the cohort's size varies; none is dropped for
        being beyond ``m``), and with ``cohort_draws`` set (``model.dp.secure_mode``) the uniforms come from the
        secret stream instead of the seed."""
        candidates = self.round_candidates(round_idx)
        dp = self.reliability.dp
        if dp is None:
            return answering_clients(self.seed, round_idx, candidates, self.reliability.dropout, self.num_sampled)
        keep = int(self.eligible.numel()) if dp.sampling == "poisson" else self.num_sampled
        return answering_clients(self.seed, self.round_offset + round_idx, candidates, self.reliability.dropout, keep)

    def round_candidates(self, round_idx: int) -> Tensor:
        """The clients sent the model in round ``round_idx`` (sorted): the ``⌈(1 + f)·m⌉`` sampled candidates (under
        ``model.dp``: the release's draw, Poisson or secret as :meth:`round_clients` says), before dropout and
        before the late ones are cut; :meth:`round_clients` is the subset that answers."""
        dp = self.reliability.dp
        if dp is None:
            return sample_clients(self.seed, round_idx, self.eligible, self.num_candidates)
        release = self.round_offset + round_idx
        n = int(self.eligible.numel())
        if dp.sampling == "poisson":
            draws = self.cohort_draws or SeededDraws(self.seed)
            return self.eligible[draws.uniform(n, "poisson-clients", release) < self.num_sampled / n]
        if self.cohort_draws is not None:
            order = torch.argsort(self.cohort_draws.uniform(n, "clients", release))
            return self.eligible[order[: self.num_candidates]].sort().values
        return sample_clients(self.seed, release, self.eligible, self.num_candidates)

    def expected_answers(self) -> float:
        """``m̂``: the expected number of a round's clients that answer (``m`` without dropout; ``q·|E|·(1 − p)``
        under Poisson sampling) — adaptive clipping's denominator."""
        dropout = self.reliability.dropout
        dp = self.reliability.dp
        if dp is not None and dp.sampling == "poisson":
            return self.num_sampled * (1.0 - dropout)
        return expected_answers(self.num_candidates, dropout, self.num_sampled)

    def weights(self, clients: Tensor, device: torch.device | str = "cpu") -> Tensor:
        """``w_i = s_i / Σ_{j∈S} s_j`` over the listed clients (float32)."""
        if self.aggregation == "uniform":
            w = torch.ones(clients.numel(), dtype=torch.float32)
        else:
            w = self.counts[clients.cpu()].to(torch.float32)
        return (w / w.sum()).to(device)

    def round_steps(self, round_idx: int, clients: Tensor, planned: int) -> Tensor:
        """``τ_i``: each client's budget (``local_steps_dist``), else the algorithm's ``planned`` steps."""
        budget = self.reliability.budget
        if budget is None:
            return torch.full((clients.numel(),), planned, dtype=torch.long)
        return budget.draw(self.seed, round_idx, clients)

    def is_byzantine(self, clients: Tensor) -> Tensor:
        """bool ``[n]``: which of the listed clients are simulated Byzantine clients."""
        return torch.isin(clients, self.byzantine_clients)

    def mark_seen(self, clients: Tensor) -> None:
        assert self.seen is not None
        self.seen[clients.cpu()] = True

    def summary_groups(self, evaluated: Tensor | None = None) -> dict[str, Tensor]:
        """The client groups a summary reports: training (``clients``), held out (``new``) and, under
        ``model.byzantine``, the honest training clients; restricted to ``evaluated`` (``None``: all evaluated)."""
        groups = {"clients": self.eligible, "new": self.holdout}
        if self.byzantine_clients.numel():
            groups["honest"] = self.eligible[~torch.isin(self.eligible, self.byzantine_clients)]
        if evaluated is None:
            return groups
        return {name: idx[torch.isin(idx, evaluated.to(idx.device))] for name, idx in groups.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"seen": None if self.seen is None else self.seen.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seen") is not None:
            self.seen = state["seen"].clone().to(torch.bool)
        elif self.seen is not None:
            self.seen.zero_()
