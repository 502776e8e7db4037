"""Plain helpers shared by the tests (no fixtures: those are in ``tests/conftest.py``).

Import them as ``from tests.helpers import ...`` (``tests`` is a package; pytest puts the repository root on
``sys.path``, and the scripts the tests launch, such as ``tests/distributed/ddp_worker.py``, put it there
themselves).

* the tiny federation: :func:`make_tiny_clients` (the clients' tensors), :func:`tiny_data` (as
  ``FederatedData``), :class:`TinyDataset` and :func:`tiny_datamodule` (as a user dataset and its DataModule).
  Its samples are drawn by :class:`lightning_fedmeta.testing.TinyClients`, the plugin kit's generator (here six
  clients of 5 to 14 samples, seed 0, four test samples each; the kit's own defaults are eight clients);
* :class:`SmallClients`: six clients of 7 to 30 samples with threshold labels (the meta-learning tests);
* models initialised after ``torch.manual_seed(seed)`` (the global generator is reseeded, as the tests always
  did): :func:`tiny_linear` (``Linear(5, 3)``) and :func:`tanh_mlp` (``Linear(5, 8) → Tanh → Linear(8, 3)``);
  :func:`flat_params` concatenates a model's parameters;
* runs: :func:`make_trainer` (a quiet CPU ``Trainer``), :func:`fit` (``make_trainer(rounds).fit(...)``, returns
  the module), :func:`tiny_module` (reseed, then a ``FederatedModule`` of a tiny model), :func:`momentum_module`
  (the same with a server optimizer that has state) and :func:`train_small` (a short fit of :func:`tanh_mlp` on
  :class:`SmallClients`);
* :func:`one_client`: one client's record, for calling ``client_update`` and friends directly (the kit's
  :func:`lightning_fedmeta.testing.client_record`);
* :data:`REPO`: the repository root.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.data import FederatedData, FederatedDataModule, from_client_tensors
from lightning_fedmeta.testing import TinyClients, client_record

__all__ = [
    "NUM_CLASSES", "NUM_FEATURES", "REPO", "SmallClients", "TinyDataset", "fit", "flat_params", "make_tiny_clients",
    "make_trainer", "momentum_module", "one_client", "tanh_mlp", "tiny_data", "tiny_datamodule", "tiny_linear",
    "tiny_module", "tiny_sizes", "train_small",
]

# The suite runs many tiny models: one intra-op thread avoids the thread wake-up overhead that
# dominates at these sizes (and oversubscription when a test starts extra processes).
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
"""The repository root."""

NUM_FEATURES = 5
NUM_CLASSES = 3


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------
def tiny_sizes(num_clients: int) -> list[int]:
    """The tests' default training-set sizes: 5, 8, 11, 14, 5, 8, ..."""
    return [5 + 3 * (i % 4) for i in range(num_clients)]


def make_tiny_clients(
    num_clients: int = 6, seed: int = 0, train_sizes: list[int] | None = None, test_size: int = 4
) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    """``num_clients`` clients of a 3-class, 5-feature problem with unequal sizes (``train_sizes``, default
    :func:`tiny_sizes`), feature shift and label skew, drawn by :class:`~lightning_fedmeta.testing.TinyClients`."""
    sizes = train_sizes or tiny_sizes(num_clients)
    return TinyClients(sizes, test_size, NUM_FEATURES, NUM_CLASSES, seed).client_data()


def tiny_data(num_clients: int = 6, seed: int = 0) -> FederatedData:
    """The tiny dataset as :class:`FederatedData` (for ``module.attach_data``)."""
    return from_client_tensors(make_tiny_clients(num_clients, seed), NUM_CLASSES)


class TinyDataset(TinyClients):
    """The tiny dataset as a user :class:`~lightning_fedmeta.data.FederatedDataset` (for a DataModule)."""

    def __init__(self, num_clients: int = 6, seed: int = 0) -> None:
        super().__init__(tiny_sizes(num_clients), 4, NUM_FEATURES, NUM_CLASSES, seed)


def tiny_datamodule(num_clients: int = 6, eval_every: int = 2) -> FederatedDataModule:
    return FederatedDataModule(dataset=TinyDataset(num_clients), eval_every=eval_every)


class SmallClients:
    """Six small clients (FederatedDataset protocol) with sizes below and above the batch size."""

    num_classes = 3

    def client_data(self) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
        g = torch.Generator().manual_seed(1)
        out = []
        for i, n in enumerate((7, 12, 30, 9, 18, 25)):
            x = torch.randn(n + 4, 5, generator=g) + i % 3
            y = (x[:, 0] > i % 3).long() + (x[:, 1] > 1).long()
            out.append((x[:n], y[:n], x[n:], y[n:]))
        return out


one_client = client_record
"""The record of one client (unstacked, as ``client_update`` receives it), for direct calls."""


# ----------------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------------
def tiny_linear(seed: int = 0) -> nn.Linear:
    """``torch.manual_seed(seed)``, then ``nn.Linear(5, 3)``."""
    torch.manual_seed(seed)
    return nn.Linear(NUM_FEATURES, NUM_CLASSES)


def tanh_mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``torch.manual_seed(seed)``, then ``Linear(5, 8) → Tanh → Linear(8, 3)`` in ``dtype``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(NUM_FEATURES, 8), nn.Tanh(), nn.Linear(8, NUM_CLASSES)).to(dtype)


def flat_params(model: nn.Module) -> Tensor:
    """The model's parameters, detached and concatenated into one vector."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ----------------------------------------------------------------------------------------------
# runs
# ----------------------------------------------------------------------------------------------
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


def fit(module: FederatedModule, datamodule: FederatedDataModule, rounds: int, ckpt_path: str | None = None,
        **trainer_kwargs: Any) -> FederatedModule:
    """``make_trainer(rounds, **trainer_kwargs).fit(module, datamodule, ckpt_path=ckpt_path)``; returns ``module``."""
    make_trainer(rounds, **trainer_kwargs).fit(module, datamodule, ckpt_path=ckpt_path)
    return module


def tiny_module(algorithm: Any, *, init_seed: int = 0, model: Callable[[], nn.Module] | None = None,
                clients_per_round: int = 3, **kwargs: Any) -> FederatedModule:
    """``torch.manual_seed(init_seed)``, then ``FederatedModule(model(), algorithm, clients_per_round, **kwargs)``;
    the model is ``nn.Linear(5, 3)`` unless a factory is given (called after the seed)."""
    torch.manual_seed(init_seed)
    net = nn.Linear(NUM_FEATURES, NUM_CLASSES) if model is None else model()
    return FederatedModule(model=net, algorithm=algorithm, clients_per_round=clients_per_round, **kwargs)


def momentum_module(algorithm: Any, init_seed: int = 0) -> FederatedModule:
    """:func:`tiny_module` with ``seed=4`` and a server ``SGD(lr=0.8, momentum=0.9)``, whose state a resumed run
    must restore too (the checkpoint tests)."""
    return tiny_module(algorithm, init_seed=init_seed, seed=4,
                       server_optimizer=lambda p: torch.optim.SGD(p, lr=0.8, momentum=0.9))


def train_small(algorithm: Any, batching: str = "auto", steps: int = 3, eval_every: int | None = None,
                **kwargs: Any) -> FederatedModule:
    """``steps`` rounds of :func:`tanh_mlp` on :class:`SmallClients`, 3 clients a round, evaluated every
    ``eval_every`` rounds (default: once, at the end); ``kwargs`` go to ``FederatedModule``."""
    module = FederatedModule(model=tanh_mlp(), algorithm=algorithm, clients_per_round=3, client_batching=batching,
                             **kwargs)
    return fit(module, FederatedDataModule(dataset=SmallClients(), eval_every=eval_every or steps), steps)
