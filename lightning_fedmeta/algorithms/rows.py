"""One client's row of a stacked ``[K, ...]`` table, read without indexing by a tensor (vmap-safe).

Under ``torch.func.vmap`` a client's index is a batched 0-d tensor, and ``table[index]`` would be data-dependent
indexing; a comparison with ``arange(K)`` and a masked sum read the same row with tensor operations only:

    e_index = [0 == index, 1 == index, …, K−1 == index] ∈ {0, 1}^K,      row = Σ_j (e_index)_j · table_j.

Every product is by an exact 0 or 1 and at most one term is not zero, so the row is ``table[index]`` (zeros for an
index outside ``[0, K)``: a client outside the federation). Both are written as matrix products (``e · table``,
``matrix · e``), so every caller gets the same kernel and the same bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["one_hot", "take_column", "take_row", "take_rows"]


def one_hot(
    index: Tensor, k: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None
) -> Tensor:
    """``e_index ∈ {0, 1}^k`` built by comparison (vmap-safe; an index outside ``[0, k)`` gives zeros), on
    ``device`` (default: the index's)."""
    return (torch.arange(k, device=index.device if device is None else device) == index).to(dtype)


def take_row(table: Tensor, index: Tensor) -> Tensor:
    """Row ``index`` of ``table [K, ...]``: ``e_indexᵀ · table`` over the first axis (zeros for an index outside
    ``[0, K)``)."""
    pick = one_hot(index, table.shape[0], table.dtype, table.device)
    return (pick @ table.reshape(table.shape[0], -1)).reshape(table.shape[1:])


def take_column(matrix: Tensor, index: Tensor) -> Tensor:
    """Column ``index`` of ``matrix [N, K]``: ``matrix · e_index`` (zeros for an index outside ``[0, K)``)."""
    return matrix @ one_hot(index, matrix.shape[-1], matrix.dtype, matrix.device)


def take_rows(stacked: dict[str, Tensor], index: Tensor) -> dict[str, Tensor]:
    """:func:`take_row` of every ``[K, ...]`` tensor of ``stacked``."""
    return {name: take_row(t, index) for name, t in stacked.items()}
