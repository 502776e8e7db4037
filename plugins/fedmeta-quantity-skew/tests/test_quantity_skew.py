"""quantity_skew: the partitioner contract (one call of the kit), then what is its own: sizes and options.

Run against the INSTALLED distribution (``pip install ./plugins/fedmeta-quantity-skew``)."""

from __future__ import annotations

import pytest
import torch
from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.testing import check_partitioner

from fedmeta_quantity_skew import quantity_skew


def test_quantity_skew_keeps_the_contract_of_a_partitioner() -> None:
    check_partitioner("quantity_skew", {"beta": 0.5, "min_size": 5})


def test_every_row_is_given_once_and_sizes_respect_min_size() -> None:
    labels = torch.randint(0, 10, (1000,), generator=torch.Generator().manual_seed(0))
    parts = quantity_skew(labels, 8, seed=1, beta=0.3, min_size=20)
    assert sorted(torch.cat(parts).tolist()) == list(range(1000))
    assert min(p.numel() for p in parts) >= 20


def test_a_smaller_beta_is_more_skewed() -> None:
    labels = torch.zeros(5000, dtype=torch.long)

    def spread(beta: float) -> float:
        sizes = torch.tensor([[p.numel() for p in quantity_skew(labels, 10, seed=s, beta=beta)] for s in range(20)])
        return float(sizes.float().std(dim=1).mean())

    assert spread(0.1) > 2 * spread(10.0)


def test_options_reach_the_partitioner_by_name_and_bad_ones_are_refused() -> None:
    with pytest.raises(ValueError, match=r"partitioner 'quantity_skew' has no option\(s\) 'alpha'.*accepted: beta, "
                                         r"min_size"):
        FederatedDataModule(dataset="fashion_mnist", partition="quantity_skew", partition_options={"alpha": 1.0})
    with pytest.raises(ValueError, match=r"beta must be a finite number > 0, got 0"):
        quantity_skew(torch.zeros(10, dtype=torch.long), 2, seed=0, beta=0)
    with pytest.raises(ValueError, match=r"need 30 rows, the data has 10"):
        quantity_skew(torch.zeros(10, dtype=torch.long), 3, seed=0, min_size=10)
