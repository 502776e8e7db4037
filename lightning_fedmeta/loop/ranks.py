"""The rank split: which of a round's clients this process computes, and how the ranks' outputs combine.

Under ``W`` processes, rank ``k`` computes the clients at positions ``≡ k (mod W)``. Each rank writes its rows
into zero-filled ``[n, ...]`` tensors and an all-reduce (sum) gives every rank all ``n`` rows, bit for bit the
single-process tensors (each entry is written by exactly one rank; adding zeros is exact).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["RankSplit"]


@dataclass(frozen=True)
class RankSplit:
    """One process's share of the work. ``reduce`` sums a tensor over the processes (``None`` with one)."""

    world: int = 1
    rank: int = 0
    reduce: Callable[[Tensor], Tensor] | None = None

    @classmethod
    def of(cls, trainer: Any) -> RankSplit:
        """This process's split under a Lightning Trainer (its strategy's all-reduce)."""
        if trainer.world_size == 1:
            return cls()
        strategy = trainer.strategy
        return cls(trainer.world_size, trainer.global_rank, lambda t: strategy.reduce(t, reduce_op="sum"))

    def share(self, num: int) -> Tensor:
        """Positions ``0..num-1`` this process computes (≡ rank mod world size)."""
        return torch.arange(self.rank, num, self.world)

    def combine(self, local_out: Any, positions: Tensor, total: int) -> Any:
        """Zero-filled all-reduce: every rank ends with all ``total`` rows, bit for bit."""
        if self.world == 1:
            return local_out
        assert self.reduce is not None, "a RankSplit of several processes needs a reduce function"
        reduce = self.reduce

        def fill(t: Tensor) -> Tensor:
            full = torch.zeros((total, *t.shape[1:]), dtype=t.dtype, device=t.device)
            if positions.numel():
                full[positions.to(t.device)] = t[: positions.numel()]
            return reduce(full)

        return torch.utils._pytree.tree_map(fill, local_out)
