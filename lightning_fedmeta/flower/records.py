"""Tensors and client records in Flower's records (``ArrayRecord``, ``ConfigRecord``, ``MetricRecord``).

Pytrees of tensors (parameters, client and server state, extras) travel flattened with
:func:`~lightning_fedmeta.persistence.memory_store.flatten_state` (nested keys joined by ``/``), one ``ArrayRecord``
per tree;
dtypes and shapes are kept exactly (float32, float64, int64, bool, 0-d included), so a tree read back equals
the tree sent bit for bit. A :class:`~lightning_fedmeta.algorithms.base.ClientRecord` travels as an
``ArrayRecord`` of its five fields.
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ArrayRecord
from torch import Tensor

from lightning_fedmeta.algorithms.base import ClientRecord
from lightning_fedmeta.persistence.memory_store import flatten_state, unflatten_state

__all__ = ["tree_to_record", "record_to_tree", "client_record_to_record", "record_to_client_record"]


def tree_to_record(tree: dict[str, Any]) -> ArrayRecord:
    """A (nested) dict of tensors as an ``ArrayRecord`` (keys flattened with ``/``; values copied to the CPU)."""
    flat = {k: v.detach().cpu().contiguous() for k, v in flatten_state(tree).items()}
    return ArrayRecord(torch_state_dict=flat)


def record_to_tree(record: ArrayRecord) -> dict[str, Any]:
    """The nested dict of tensors :func:`tree_to_record` wrote (writable tensors of the same dtypes)."""
    return unflatten_state({k: v.clone() for k, v in record.to_torch_state_dict().items()})


def client_record_to_record(client: ClientRecord) -> ArrayRecord:
    """A client's record (0-d fields, or stacked ``[C]`` fields) as an ``ArrayRecord``."""
    return tree_to_record(dict(client._asdict()))


def record_to_client_record(record: ArrayRecord) -> ClientRecord:
    """The :class:`ClientRecord` :func:`client_record_to_record` wrote."""
    tree: dict[str, Tensor] = record_to_tree(record)
    missing = sorted(set(ClientRecord._fields) - set(tree))
    if missing:
        raise ValueError(f"a client record needs the fields {list(ClientRecord._fields)}; missing {missing}")
    return ClientRecord(**{k: torch.as_tensor(tree[k]) for k in ClientRecord._fields})
