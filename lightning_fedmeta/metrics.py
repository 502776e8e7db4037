"""Personalised evaluation metrics: per-client accuracy and loss, summarised three ways.

Each client c is evaluated with its own model on its own test set, giving ``correct_c``,
``total_c`` and ``loss_sum_c``. Reported (docs/design.md, contract 6):

* ``acc_weighted``  = Σ_c correct_c / Σ_c total_c        (sample-weighted mean)
* ``acc_mean``      = (1/K) Σ_c correct_c / total_c      (every client counts once)
* ``acc_worst10``   = mean accuracy of the worst ⌈K/10⌉ clients (worst decile)

and the same for the loss (where "worst" means highest). The class follows torchmetrics'
pattern: the state is three ``[K]`` sums with ``dist_reduce_fx="sum"``, so processes that each
evaluate a subset of the clients combine exactly.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = ["PersonalizedMetrics", "summarize_clients"]


def summarize_clients(correct: Tensor, total: Tensor, loss_sum: Tensor) -> dict[str, Tensor]:
    """The weighted mean, unweighted mean and worst decile of per-client accuracy and loss."""
    if total.numel() == 0:
        raise ValueError("no client to summarize")
    total_f = total.to(torch.float64)
    acc = correct.to(torch.float64) / total_f.clamp_min(1)
    loss = loss_sum.to(torch.float64) / total_f.clamp_min(1)
    worst = max(1, math.ceil(acc.numel() / 10))
    return {
        "acc_weighted": correct.sum().to(torch.float64) / total_f.sum().clamp_min(1),
        "acc_mean": acc.mean(),
        "acc_worst10": acc.sort().values[:worst].mean(),
        "loss_weighted": loss_sum.sum().to(torch.float64) / total_f.sum().clamp_min(1),
        "loss_mean": loss.mean(),
        "loss_worst10": loss.sort(descending=True).values[:worst].mean(),
    }


class PersonalizedMetrics(Metric):
    """Accumulates per-client correct/total/loss sums for ``num_clients`` clients.

    ``update(clients, correct, total, loss_sum)`` adds the counts of the listed clients;
    ``compute()`` summarizes all clients; :meth:`summaries` summarizes named groups of clients.
    """

    full_state_update = False
    higher_is_better = True

    def __init__(self, num_clients: int, **kwargs: object) -> None:
        super().__init__(**kwargs)
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        self.num_clients = num_clients
        self.add_state("correct", torch.zeros(num_clients, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", torch.zeros(num_clients, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("loss_sum", torch.zeros(num_clients, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, clients: Tensor, correct: Tensor, total: Tensor, loss_sum: Tensor) -> None:
        idx = clients.to(self.correct.device)
        self.correct.index_add_(0, idx, correct.to(self.correct))
        self.total.index_add_(0, idx, total.to(self.total))
        self.loss_sum.index_add_(0, idx, loss_sum.to(self.loss_sum))

    def compute(self) -> dict[str, Tensor]:
        return summarize_clients(self.correct, self.total, self.loss_sum)

    def summaries(self, groups: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
        """:func:`summarize_clients` for each named group of client indices, after syncing
        the sums across processes (empty groups are skipped)."""
        out: dict[str, dict[str, Tensor]] = {}
        with self.sync_context():
            for name, idx in groups.items():
                if idx.numel() == 0:
                    continue
                i = idx.to(self.correct.device)
                out[name] = summarize_clients(self.correct[i], self.total[i], self.loss_sum[i])
            per_client = self.correct / self.total.clamp_min(1)
            per_client_loss = self.loss_sum / self.total.clamp_min(1)
            totals = self.total.clone()
        out["_per_client"] = {"accuracy": per_client.clone(), "loss": per_client_loss.clone(), "total": totals}
        return out
