"""The validation split: sizes, disjointness, determinism, and that a run evaluates on it, not on the test set."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import Tensor

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.data import FederatedDataModule, from_client_tensors
from lightning_fedmeta.data.validation_split import validation_sizes, validation_split
from tests.helpers import NUM_CLASSES, make_tiny_clients, make_trainer

SIZES = [2, 5, 8, 11, 14, 40]


def _rows(x: Tensor) -> list[tuple[float, ...]]:
    return sorted(tuple(r.tolist()) for r in x)


def test_sizes_follow_the_formula_for_unequal_clients() -> None:
    counts = torch.tensor(SIZES)
    # min(n − 1, max(1, round_half_even(f n))) for f = 0.25: 0.5→0→1, 1.25→1, 2, 2.75→3, 3.5→4, 10
    assert validation_sizes(counts, 0.25).tolist() == [1, 1, 2, 3, 4, 10]
    # a large fraction still leaves one training sample: 0.9 · 2 = 1.8 → 2 → capped at 1
    assert validation_sizes(counts, 0.9).tolist() == [1, 4, 7, 10, 13, 36]


def test_split_moves_rows_from_train_to_evaluation_and_drops_the_test_set() -> None:
    data = from_client_tensors(make_tiny_clients(6, train_sizes=SIZES), NUM_CLASSES)
    split = validation_split(data, 0.25, seed=3)
    assert split.train_counts.tolist() == [1, 4, 6, 8, 10, 30]
    assert split.test_counts.tolist() == [1, 1, 2, 3, 4, 10]
    for i in range(6):
        x, y = data.client_train(i)
        kx, ky = split.client_train(i)
        vx, vy = split.client_test(i)
        # every training row goes to exactly one side, with its label
        assert _rows(torch.cat([kx, vx])) == _rows(x)
        assert sorted(torch.cat([ky, vy]).tolist()) == sorted(y.tolist())
        assert not set(_rows(kx)) & set(_rows(vx))
        # none of the original test rows is evaluated
        tx, _ = data.client_test(i)
        assert not set(_rows(vx)) & set(_rows(tx))
        # the kept rows stay in their original order
        order = [next(j for j, r in enumerate(x) if torch.equal(r, k)) for k in kx]
        assert order == sorted(order)


def test_split_is_a_pure_function_of_the_seed() -> None:
    data = from_client_tensors(make_tiny_clients(6, train_sizes=SIZES), NUM_CLASSES)
    a, b, c = validation_split(data, 0.3, 1), validation_split(data, 0.3, 1), validation_split(data, 0.3, 2)
    assert torch.equal(a.test_x, b.test_x) and torch.equal(a.train_x, b.train_x)
    assert not torch.equal(a.test_x, c.test_x)


@pytest.mark.parametrize("fraction", [1.0, -0.1, 1.5, True])
def test_bad_fraction_is_refused_by_the_datamodule(fraction: float) -> None:
    with pytest.raises(ValueError, match="validation_fraction must be 0"):
        FederatedDataModule(dataset="synthetic", num_clients=4, validation_fraction=fraction)


def test_a_client_with_one_training_sample_cannot_be_split() -> None:
    data = from_client_tensors(make_tiny_clients(3, train_sizes=[1, 5, 6]), NUM_CLASSES)
    with pytest.raises(ValueError, match=r"at least 2 training samples per client; client\(s\) \[0\]"):
        validation_split(data, 0.2, 0)


class _Clients:
    """A user dataset of fixed client tensors."""

    num_classes = NUM_CLASSES

    def __init__(self, clients: list[tuple[Tensor, Tensor, Tensor, Tensor]]) -> None:
        self.clients = clients

    def client_data(self) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
        return self.clients


def _fit(dm: FederatedDataModule) -> dict[str, float]:
    L.seed_everything(0)  # the model's initialisation
    module = FederatedModule(
        algorithm={"name": "fedavg", "local_steps": 2, "local_lr": 0.1, "batch_size": 4, "finetune_steps": 1},
        clients_per_round=3, seed=0, holdout_clients=1,
    )
    trainer = make_trainer(4)
    trainer.fit(module, datamodule=dm)
    return {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}


def test_a_run_evaluates_on_the_validation_rows_and_never_reads_the_test_set() -> None:
    clients = make_tiny_clients(6, train_sizes=[6, 9, 12, 7, 10, 13], test_size=5)
    # test inputs that would make every loss inf if they were read (finite, so the loader accepts them; NaN
    # inputs are refused at load, tests/security/test_store_and_inputs.py)
    poisoned = [(x, y, torch.full_like(tx, 3e38), ty) for x, y, tx, ty in clients]
    dm = FederatedDataModule(dataset=_Clients(poisoned), eval_every=2, validation_fraction=0.3, data_seed=5)
    got = _fit(dm)
    assert got and all(math.isfinite(v) for v in got.values())  # the poisoned test rows were never evaluated
    # the same run on the split written out by hand as ordinary train/test data
    split = validation_split(from_client_tensors(clients, NUM_CLASSES), 0.3, 5)
    by_hand = [(*split.client_train(i), *split.client_test(i)) for i in range(6)]
    want = _fit(FederatedDataModule(dataset=_Clients(by_hand), eval_every=2, data_seed=5))
    assert got.keys() == want.keys()
    for k in got:
        assert got[k] == pytest.approx(want[k], abs=1e-6), k
