"""The Per-FedAvg paper's setting (Fallah, Mokhtari, Ozdaglar, NeurIPS 2020, §6), shared by
:mod:`benchmarks.reproduce` (the paper's grid) and :mod:`benchmarks.equal_work` (every algorithm at equal work):
n = 50 users on the paper's split, 10 per round, batch 40, 5 users held out as new clients, 1000 rounds,
seeds 0, 1, 2."""

from __future__ import annotations

__all__ = ["BATCH", "CLIENTS_PER_ROUND", "HOLDOUT", "NUM_CLIENTS", "ROUNDS", "SEEDS"]

BATCH = 40
NUM_CLIENTS = 50
CLIENTS_PER_ROUND = 10
HOLDOUT = 5
ROUNDS = 1000
SEEDS: tuple[int, ...] = (0, 1, 2)
