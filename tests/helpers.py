"""Plain helpers shared by the tests (no fixtures: those are in ``tests/conftest.py``).

Import them as ``from tests.helpers import ...`` (``tests`` is a package; pytest puts the repository root on
``sys.path``, and the scripts the tests launch, such as ``tests/distributed/ddp_worker.py``, put it there
themselves).

* the tiny federation: :func:`make_tiny_clients` (the clients' tensors), :func:`tiny_data` (as
  ``FederatedData``), :class:`TinyDataset` and :func:`tiny_datamodule` (as a user dataset and its DataModule);
* :func:`make_trainer`: a quiet CPU ``Trainer``;
* :func:`one_client`: one client's record, for calling ``client_update`` and friends directly;
* :data:`REPO`: the repository root.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor

from lightning_fedmeta import ClientRecord, client_records
from lightning_fedmeta.data import FederatedData, FederatedDataModule, from_client_tensors

__all__ = [
    "NUM_CLASSES", "NUM_FEATURES", "REPO", "TinyDataset", "make_tiny_clients", "make_trainer",
    "one_client", "tiny_data", "tiny_datamodule",
]

# The suite runs many tiny models: one intra-op thread avoids the thread wake-up overhead that
# dominates at these sizes (and oversubscription when a test starts extra processes).
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
"""The repository root."""

NUM_FEATURES = 5
NUM_CLASSES = 3


def make_tiny_clients(
    num_clients: int = 6, seed: int = 0, train_sizes: list[int] | None = None, test_size: int = 4
) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """``num_clients`` clients of a 3-class, 5-feature problem with unequal sizes and label skew."""
    g = torch.Generator().manual_seed(seed)
    w_true = torch.randn(NUM_FEATURES, NUM_CLASSES, generator=g)
    sizes = train_sizes or [5 + 3 * (i % 4) for i in range(num_clients)]
    clients = []
    for i, n in enumerate(sizes):
        shift = torch.randn(NUM_FEATURES, generator=g) * 0.5 * (i % 3)
        x = torch.randn(n + test_size, NUM_FEATURES, generator=g) + shift
        y = (x @ w_true + 0.3 * torch.randn(n + test_size, NUM_CLASSES, generator=g)).argmax(1)
        clients.append((x[:n], y[:n], x[n:], y[n:]))
    return clients


def one_client(num_samples: int = 10, index: int = 0, weight: float = 1.0, seen: bool = False,
               is_new: bool = False) -> ClientRecord:
    """The record of one client (unstacked, as ``client_update`` receives it), for direct calls."""
    stacked = client_records([num_samples], weight=[weight], is_new=[is_new], seen=[seen], index=[index])
    return ClientRecord(*(t[0] for t in stacked))


def tiny_data(num_clients: int = 6, seed: int = 0) -> FederatedData:
    """The tiny dataset as :class:`FederatedData` (for ``module.attach_data``)."""
    return from_client_tensors(make_tiny_clients(num_clients, seed), NUM_CLASSES)


class TinyDataset:
    """The tiny dataset as a user :class:`~lightning_fedmeta.data.FederatedDataset` (for a DataModule)."""

    num_classes = NUM_CLASSES

    def __init__(self, num_clients: int = 6, seed: int = 0) -> None:
        self.num_clients = num_clients
        self.seed = seed

    def client_data(self) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
        return make_tiny_clients(self.num_clients, self.seed)


def tiny_datamodule(num_clients: int = 6, eval_every: int = 2) -> FederatedDataModule:
    return FederatedDataModule(dataset=TinyDataset(num_clients), eval_every=eval_every)


def make_trainer(max_steps: int, **kwargs: Any) -> L.Trainer:
    """A CPU Trainer with logging, checkpointing, progress bar and sanity checks off unless asked."""
    options: dict[str, Any] = {
        "max_steps": max_steps,
        "max_epochs": -1,
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    options.update(kwargs)
    return L.Trainer(**options)
