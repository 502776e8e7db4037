"""``algorithms.rows``: a client's row (or column) of a stacked table by a one-hot product, vmap-safe and exact."""

from __future__ import annotations

import torch
from torch.func import vmap

from lightning_fedmeta.algorithms.clustering import one_hot as clustering_one_hot
from lightning_fedmeta.algorithms.rows import one_hot, take_column, take_row, take_rows


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().numpy().tobytes()


def test_take_row_is_indexing_to_the_bit_looped_and_under_vmap() -> None:
    torch.manual_seed(0)
    table = torch.randn(5, 3, 2, dtype=torch.float64)
    for k in range(5):
        assert _bits(take_row(table, torch.tensor(k))) == _bits(table[k])
    rows = vmap(take_row, in_dims=(None, 0))(table, torch.arange(5))
    assert _bits(rows) == _bits(table)
    assert _bits(take_row(table[:, 0, 0], torch.tensor(3))) == _bits(table[3, 0, 0])  # a [K] table: a scalar


def test_take_column_is_indexing_and_an_index_outside_gives_zeros() -> None:
    torch.manual_seed(1)
    matrix = torch.randn(4, 6)
    assert _bits(vmap(take_column, in_dims=(None, 0))(matrix, torch.arange(6))) == _bits(matrix.mT)
    for outside in (-1, 6):
        assert torch.equal(take_column(matrix, torch.tensor(outside)), torch.zeros(4))
        assert torch.equal(take_row(matrix.mT, torch.tensor(outside)), torch.zeros(4))


def test_take_rows_reads_every_tensor_and_one_hot_keeps_its_old_home() -> None:
    stacked = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(3.0)}
    got = take_rows(stacked, torch.tensor(2))
    assert torch.equal(got["w"], stacked["w"][2]) and torch.equal(got["b"], stacked["b"][2])
    assert clustering_one_hot is one_hot
    assert torch.equal(one_hot(torch.tensor(1), 3, torch.float64), torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))
