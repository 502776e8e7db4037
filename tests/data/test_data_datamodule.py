"""FederatedDataModule: argument validation, building the clients, round dataloaders."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from lightning_fedmeta.data import FederatedData, FederatedDataModule
from tests.helpers import make_trainer


class _TinyUserDataset:
    """A user dataset following the FederatedDataset protocol."""

    num_classes = 3

    def __init__(self, empty_client: int | None = None) -> None:
        self.client_names = ["alice", "bob", "carol"]
        self.empty_client = empty_client

    def client_data(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        out = []
        for i in range(3):
            n = 0 if i == self.empty_client else 4 + i
            y = i % 3
            out.append((torch.randn(n, 5), torch.full((n,), y), torch.randn(2, 5), torch.full((2,), y)))
        return out


def _write_tiny_mnist(root: Path, per_class_train: int, per_class_test: int) -> None:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)

    def idx(array: np.ndarray) -> bytes:
        head = struct.pack(">BBBB", 0, 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
        return gzip.compress(head + array.astype(np.uint8).tobytes())

    for prefix, per_class in (("train", per_class_train), ("t10k", per_class_test)):
        labels = rng.permutation(np.repeat(np.arange(10), per_class))
        images = rng.integers(0, 256, (labels.size, 28, 28))
        (raw / f"{prefix}-images-idx3-ubyte.gz").write_bytes(idx(images))
        (raw / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(idx(labels))


def test_train_dataloader_yields_eval_every_items_and_eval_loaders_one() -> None:
    dm = FederatedDataModule(eval_every=7)
    assert [int(t) for t in dm.train_dataloader()] == list(range(7))
    assert len(list(dm.val_dataloader())) == 1 and len(list(dm.test_dataloader())) == 1


def test_synthetic_setup_builds_federated_data_once() -> None:
    dm = FederatedDataModule(dataset="synthetic", num_clients=12, data_seed=1)
    dm.setup("fit")
    data = dm.federated_data
    assert isinstance(data, FederatedData) and data.num_clients == 12 and data.input_shape == (60,)
    dm.setup("validate")
    assert dm.federated_data is data
    assert dm.num_classes == 10


def test_user_dataset_keeps_client_names() -> None:
    dm = FederatedDataModule(dataset=_TinyUserDataset())
    dm.setup("fit")
    assert dm.federated_data is not None
    assert dm.federated_data.client_names == ["alice", "bob", "carol"]
    assert dm.federated_data.train_counts.tolist() == [4, 5, 6]


def test_a_partition_that_leaves_a_client_empty_raises_naming_the_client() -> None:
    dm = FederatedDataModule(dataset=_TinyUserDataset(empty_client=1))
    with pytest.raises(ValueError, match=r"bob \(index 1\)"):
        dm.setup("fit")


def test_mnist_perfedavg_paper_pipeline_matches_train_classes_in_test(tmp_path: Path) -> None:
    _write_tiny_mnist(tmp_path, per_class_train=40, per_class_test=12)
    dm = FederatedDataModule(
        dataset="mnist", root=str(tmp_path), partition="perfedavg_paper", num_clients=10, samples_per_class=6
    )
    dm.setup("fit")
    data = dm.federated_data
    assert data is not None and data.num_clients == 10 and data.input_shape == (1, 28, 28)
    for i in range(10):
        train_classes = set(data.client_train(i)[1].tolist())
        test_classes = set(data.client_test(i)[1].tolist())
        assert test_classes <= train_classes
        assert len(train_classes) == (5 if i < 5 else 2)
    assert int(data.train_counts[0]) == 30 and int(data.train_counts[9]) == 3 + 12


def test_max_samples_per_client_caps_each_client(tmp_path: Path) -> None:
    _write_tiny_mnist(tmp_path, per_class_train=30, per_class_test=5)
    dm = FederatedDataModule(
        dataset="mnist", root=str(tmp_path), partition="iid", num_clients=4, max_samples_per_client=20
    )
    dm.setup("fit")
    assert dm.federated_data is not None and dm.federated_data.train_counts.tolist() == [20] * 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dataset": "imagenet"}, "unknown dataset 'imagenet'; choose one of.*fashion_mnist"),
        ({"partition": "by_writer"}, "unknown partition 'by_writer'"),
        ({"num_clients": 0}, r"num_clients must be an integer >= 1, got 0"),
        ({"dirichlet_alpha": 0.0}, r"dirichlet_alpha must be > 0, got 0.0"),
        ({"dataset": "fashion_mnist", "classes_per_client": 11}, r"classes_per_client .*\[1, 10\], got 11"),
        ({"samples_per_class": 1}, r"samples_per_class must be an integer >= 2, got 1"),
        ({"max_samples_per_client": 0}, "max_samples_per_client"),
        ({"eval_every": 0}, "eval_every must be an integer >= 1, got 0"),
        ({"dataset": "mnist"}, "needs a `root` folder, got root=None"),
        ({"dataset": "cifar10", "download": True}, "needs a `root` folder, got root=None"),
    ],
)
def test_invalid_arguments_raise_with_value_and_range(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FederatedDataModule(**kwargs)


def test_one_training_epoch_is_eval_every_rounds_with_one_validation_step() -> None:
    class Recorder(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.rounds: list[int] = []
            self.val_steps = 0

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            assert self.trainer.datamodule.federated_data is not None
            self.rounds.append(int(batch))
            return (self.w**2).sum()

        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            self.val_steps += 1

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Recorder()
    trainer = make_trainer(-1, max_epochs=2)  # two epochs of the round loader
    trainer.fit(model, datamodule=FederatedDataModule(num_clients=5, eval_every=3))
    assert model.rounds == [0, 1, 2, 0, 1, 2]
    assert model.val_steps == 2
