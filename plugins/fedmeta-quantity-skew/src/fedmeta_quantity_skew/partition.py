"""``quantity_skew``: IID labels, Dirichlet client sizes (Li et al., ICDE 2022, Sec. 4.3 "quantity-based skew").

    q ~ Dir(β · 1_K),   n_i = m + ⌊q_i (N − K m)⌋, the rows left over going one each to the largest remainders,

then the ``N`` row indices, shuffled, are cut into parts of sizes ``n_i`` (each part sorted). Draws come from
``numpy.random.default_rng(seed)``: the same seed gives the same parts, whatever other split ran before.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

__all__ = ["quantity_skew"]


def quantity_skew(labels: Tensor, num_clients: int, seed: int, beta: float = 0.5, min_size: int = 2) -> list[Tensor]:
    """One sorted int64 index tensor per client, sizes skewed by ``Dir(beta)`` and at least ``min_size``."""
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not math.isfinite(beta) or beta <= 0:
        raise ValueError(f"beta must be a finite number > 0, got {beta!r}")
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
        raise ValueError(f"min_size must be an integer >= 1, got {min_size!r}")
    n = int(labels.shape[0])
    if num_clients * min_size > n:
        raise ValueError(f"quantity_skew: {num_clients} clients of at least min_size={min_size} rows need "
                         f"{num_clients * min_size} rows, the data has {n}")
    rng = np.random.default_rng(seed)
    q = rng.dirichlet(np.full(num_clients, float(beta)))
    spare = n - num_clients * min_size
    raw = q * spare
    sizes = np.floor(raw).astype(np.int64)
    left = spare - int(sizes.sum())
    sizes[np.argsort(-(raw - sizes), kind="stable")[:left]] += 1
    sizes += min_size
    order = torch.from_numpy(rng.permutation(n))
    return [part.sort().values for part in torch.split(order, sizes.tolist())]
