"""Where the clients' state lives: the state store (memory or disk) and the per-client BatchNorm statistics.

The store holds one ``[K, ...]`` row tensor per state entry (personal models, control variates, duals, cluster
ids): in memory (:class:`~lightning_fedmeta.persistence.memory_store.ClientStateStore`) or in memory-mapped files
(:class:`~lightning_fedmeta.persistence.disk_store.DiskClientStateStore`), with the same numbers bit for bit.

BatchNorm running statistics are kept **per client** (as FedBN keeps normalisation local, Li et al., ICLR 2021):
a client's step advances its own running mean and variance and returns them; the model's own buffers are the
sample-weighted mean ``Σ_i w_i b_i`` of the last round's clients' statistics, and a client that never trained
starts from, and is evaluated with, those.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from lightning_fedmeta.algorithms.base import Algorithm, ClientRecord
from lightning_fedmeta.client.batchnorm_stats import client_buffers, prepare_model
from lightning_fedmeta.client.functional import Params, weighted_sum
from lightning_fedmeta.loop.validation import validate_init_client_states
from lightning_fedmeta.persistence.disk_store import DiskClientStateStore, is_disk_manifest
from lightning_fedmeta.persistence.disk_store import describe as disk_state_line
from lightning_fedmeta.persistence.memory_store import ClientStateStore, flatten_state, map_state, unflatten_state

__all__ = ["AnyStore", "RunningStatistics", "StoreLocation", "build_client_store", "restore_client_store"]

AnyStore = ClientStateStore | DiskClientStateStore


class StoreLocation:
    """``model.client_state`` (``auto``/``memory``/``disk``), its folder and this process's rank."""

    def __init__(self, mode: str, directory: str | None, default_root: str | None = None, rank: int = 0) -> None:
        self.mode, self.directory, self.default_root, self.rank = mode, directory, default_root, rank

    def root(self) -> str:
        """``model.client_state_dir``, else ``<trainer.default_root_dir>/client_state``, else a temporary folder."""
        if self.directory is not None:
            return self.directory
        if self.default_root is not None:
            return os.path.join(self.default_root, "client_state")
        return tempfile.mkdtemp(prefix="fedmeta_client_state_")


def _row_bytes(algorithm: Algorithm, params: Params, everyone: ClientRecord, per_client: bool) -> tuple[Any, Any, int]:
    """``(template, sample, bytes of one row)``: one client's initial state, to size the store."""
    one = ClientRecord(*(t[:1] for t in everyone))
    template = None if per_client else algorithm.init_client_state(params)
    try:  # a malformed state is reported by the validation of the path taken
        sample = algorithm.init_client_states(params, one) if per_client else map_state(
            lambda t: t.unsqueeze(0), template)
        return template, sample, sum(v.numel() * v.element_size() for v in flatten_state(sample).values())
    except (AttributeError, TypeError, ValueError):
        return template, None, 0


def build_client_store(algorithm: Algorithm, params: Params, everyone: ClientRecord, where: StoreLocation) -> AnyStore:
    """The clients' initial state, in memory or on disk ("auto": disk above
    :data:`~lightning_fedmeta.persistence.disk_store.DISK_STATE_THRESHOLD_BYTES` of ``K × row bytes``).

    On disk, an algorithm that keeps :meth:`Algorithm.init_client_states`'s default (every client starts from
    ``init_client_state(w0)``) is initialised lazily: a row never written reads as that template, exactly the
    values of the eager initialisation. One that overrides it is initialised in blocks of clients, never all
    ``K`` rows in memory at once."""
    from lightning_fedmeta.persistence import (
        disk_store as disk_state,  # the threshold is read at call time (tests lower it)
    )

    k = int(everyone.index.numel())
    per_client = type(algorithm).init_client_states is not Algorithm.init_client_states
    if where.mode == "memory":
        states = algorithm.init_client_states(params, everyone)
        validate_init_client_states(algorithm, states, k)
        return ClientStateStore(states)
    template, sample, row_bytes = _row_bytes(algorithm, params, everyone, per_client)
    disk = where.mode == "disk" or k * row_bytes > disk_state.DISK_STATE_THRESHOLD_BYTES
    if where.mode == "disk" and row_bytes == 0:  # nothing to keep, but a bad folder is still an error
        disk_state.check_directory(where.root(), where.rank)
    if not disk or row_bytes == 0:
        states = algorithm.init_client_states(params, everyone)
        validate_init_client_states(algorithm, states, k)
        store: AnyStore = ClientStateStore(states)
    elif per_client:
        validate_init_client_states(algorithm, sample, 1)
        store = DiskClientStateStore.from_rows(
            where.root(), k, lambda c: algorithm.init_client_states(params, ClientRecord(*(t[c] for t in everyone))),
            rank=where.rank, who=f"{type(algorithm).__name__}.init_client_states",
        )
    else:
        validate_init_client_states(algorithm, sample, 1)
        store = DiskClientStateStore.lazy(where.root(), k, template, rank=where.rank)
    rank_zero_info(
        f"[lightning_fedmeta] model.client_state={where.mode}: {disk_state.describe(store)}; {k} clients x "
        f"{row_bytes} bytes per client (disk above {disk_state.DISK_STATE_THRESHOLD_BYTES / 2**30:g} GiB)"
    )
    return store


def restore_client_store(entry: Mapping[str, Any], where: StoreLocation, old: AnyStore,
                         num_clients: int | None = None) -> AnyStore:
    """The client state of a checkpoint: a disk store's manifest (rebuilt from its segments) or flat tensors;
    converted when ``model.client_state`` asks for the other kind. ``old`` is closed. ``num_clients``: the run's
    own number of clients, which a manifest must name (checked before anything is allocated).

    A disk store is rebuilt in the *current* run's folder (:meth:`StoreLocation.root`), never in the folder the
    checkpoint was written from: that one is only read (the segments this run needs are linked or copied), so
    the new run's checkpoints stay valid when the old run's folder is deleted."""
    if is_disk_manifest(entry):
        store: AnyStore = DiskClientStateStore.restore(entry, where.root(), rank=where.rank, num_clients=num_clients)
        rank_zero_info(f"[lightning_fedmeta] resumed the {disk_state_line(store)}")
        if where.mode == "memory":
            memory = ClientStateStore(unflatten_state(store.state_dict()))
            store.close()
            store = memory
    elif where.mode == "disk" and entry:
        store = DiskClientStateStore.from_tensors(where.root(), unflatten_state(dict(entry)), rank=where.rank)
    else:
        store = ClientStateStore()
        store.load_state_dict(entry)
    if isinstance(old, DiskClientStateStore):
        old.close()
    return store


class RunningStatistics:
    """Per-client BatchNorm running statistics: ``store`` holds ``[K, ...]`` per buffer of the model."""

    def __init__(self) -> None:
        self.store = ClientStateStore()
        self.names: list[str] = []

    def prepare(self, model: nn.Module, num_clients: int) -> None:
        """Make the model's BatchNorm layers functional
        (:func:`~lightning_fedmeta.client.batchnorm_stats.prepare_model`)
        and keep one row of statistics per client (kept when a loaded checkpoint already has them)."""
        self.names = prepare_model(model)
        if not self.names:
            self.store = ClientStateStore()
            return
        stored = self.store.state_dict()
        if sorted(stored) != sorted(self.names) or next(iter(stored.values())).shape[0] != num_clients:
            self.store = ClientStateStore(client_buffers(model, num_clients, self.names))
        layers = sorted({n.rsplit(".", 1)[0] for n in self.names})
        rank_zero_info(
            f"[lightning_fedmeta] BatchNorm running statistics (layers {', '.join(layers[:3])}"
            f"{', ...' if len(layers) > 3 else ''}) are kept per client: each client trains and is evaluated "
            "with its own; clients that never trained use the average of the last round's"
        )

    def starting(self, clients: Tensor, seen: Tensor, model: nn.Module, device: torch.device) -> dict[str, Tensor]:
        """The statistics each listed client starts from: its own once it trained, else the model's."""
        if not self.names:
            return {}
        rows = self.store.gather(clients)
        trained = seen[clients.cpu()].to(device)
        own = dict(model.named_buffers())
        return {
            name: torch.where(trained.reshape(-1, *([1] * (v.dim() - 1))), v, own[name].to(v.dtype).expand_as(v))
            for name, v in rows.items()
        }

    def commit(self, clients: Tensor, buffers: dict[str, Tensor], weights: Tensor, model: nn.Module) -> None:
        """Store the round's clients' statistics and set the model's to their weighted mean ``Σ_i w_i b_i``."""
        self.store.scatter(clients, buffers)
        own = dict(model.named_buffers())
        with torch.no_grad():
            for name, stacked in buffers.items():
                if stacked.is_floating_point():
                    own[name].copy_(weighted_sum(weights, stacked))
                else:  # num_batches_tracked: the weighted mean, rounded
                    own[name].copy_(weighted_sum(weights.double(), stacked.double()).round().to(own[name].dtype))
