"""Traps a researcher met on an ordinary day (issue 31): options that were silently ignored, a client's model that
could not be inspected after an evaluation, a metric the library's own message suggested that crashed, and a demo
whose numbers looked broken. Each test reproduces what the user did."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.data.lightning_adapter import LightningDataPartition
from tests.data.test_data_tasks import TinyWithTest


# ----------------------------------------------------------------------------------------------
# item 2: the data module's split options reach the partition of a user's LightningDataModule
# ----------------------------------------------------------------------------------------------
def _train_splits(**data: object) -> list[tuple[Tensor, Tensor]]:
    """Each client's ``(train_x, train_y)`` in ``FederatedDataModule(LightningDataPartition(dm), **data)``."""
    dm = FederatedDataModule(dataset=LightningDataPartition(TinyWithTest()), **data)  # type: ignore[arg-type]
    dm.setup("fit")
    assert dm.federated_data is not None
    return [dm.federated_data.client_train(k) for k in range(dm.federated_data.num_clients)]


def _same(a: list[tuple[Tensor, Tensor]], b: list[tuple[Tensor, Tensor]]) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) for x, y in zip(a, b, strict=True))


def test_data_seed_changes_a_lightning_datamodule_split_and_the_same_seed_repeats_it() -> None:
    seed0, seed1, again0 = (_train_splits(num_clients=4, data_seed=s) for s in (0, 1, 0))
    assert not _same(seed0, seed1), "--data.data_seed 0 and 1 must give different splits (three-seed recipe)"
    assert _same(seed0, again0)


def test_num_clients_partition_and_cap_of_the_data_module_reach_the_split() -> None:
    assert len(_train_splits(num_clients=5)) == 5
    shards = _train_splits(num_clients=3, partition="shards", classes_per_client=1)
    assert [y.unique().numel() for _, y in shards] == [1, 1, 1], "one label-sorted shard each: one class"
    skewed = _train_splits(num_clients=3, partition="dirichlet", dirichlet_alpha=0.05)
    assert not _same(skewed, _train_splits(num_clients=3, partition="dirichlet", dirichlet_alpha=100.0))
    assert [len(y) for _, y in _train_splits(num_clients=3, max_samples_per_client=7)] == [7, 7, 7]


@pytest.mark.parametrize(
    ("adapter", "data", "match"),
    [
        ({"num_clients": 20}, {}, r"LightningDataPartition\(num_clients=20\).*data.num_clients=30"),
        ({"seed": 4}, {"data_seed": 1}, r"LightningDataPartition\(seed=4\).*data_seed=1.*--data.data_seed"),
        ({"partition": "dirichlet"}, {"partition": "shards"}, r"partition='dirichlet'.*partition='shards'"),
        ({}, {"partition": "perfedavg_paper"}, r"data.partition must be one of \['iid', 'dirichlet', 'shards'\]"),
    ],
)
def test_a_split_option_given_in_two_places_or_inapplicable_is_refused_by_name(
    adapter: dict[str, object], data: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        FederatedDataModule(dataset=LightningDataPartition(TinyWithTest(), **adapter), **data)  # type: ignore[arg-type]


def test_an_option_given_in_both_places_alike_is_accepted() -> None:
    dm = FederatedDataModule(  # type: ignore[arg-type]
        dataset=LightningDataPartition(TinyWithTest(), num_clients=4, seed=2), num_clients=4, data_seed=2,
    )
    dm.setup("fit")
    assert dm.federated_data is not None and dm.federated_data.num_clients == 4
