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

__all__ = ["tree_to_record", "record_to_tree", "client_record_to_record", "record_to_client_record", "sent_delta",
           "sent_params", "completed_params"]


def tree_to_record(tree: dict[str, Any]) -> ArrayRecord:
    """A (nested) dict of tensors as an ``ArrayRecord`` (keys flattened with ``/``; values copied to the CPU)."""
    flat = {k: v.detach().cpu().contiguous() for k, v in flatten_state(tree).items()}
    return ArrayRecord(torch_state_dict=flat)


def sent_delta(algorithm: Any, output: Any) -> dict[str, Tensor]:
    """The entries of one client's delta that travel in its reply (flattened keys): those the algorithm's
    ``upload`` declares. A personal part's delta, zero by contract (FedRep/FedPer's head, FedSA-LoRA's ``B``,
    LG-FedAvg's local layers), stays on the node, and the server puts zeros in its place
    (:func:`~lightning_fedmeta.flower.replies.check_train_reply`), so the reply carries what the byte accounting
    counts (docs/communication.md)."""
    declared = flatten_state(dict(algorithm.upload(output).get("delta", {})))
    return {k: v for k, v in flatten_state(dict(output.delta)).items() if k in declared}


def sent_params(algorithm: Any, params: dict[str, Tensor], server_state: dict[str, Any], client: ClientRecord,
                state_keys: Any) -> dict[str, Tensor]:
    """The global parameters a train message carries: all of them but a personal part, i.e. a parameter the
    algorithm's ``download`` leaves out (a ``download`` that is a sub-dict of the parameters) *and* of which the
    client state keeps the client's own copy (a flattened state key ``.../<name>``; ``state_keys``: those of an
    honest client's state). LG-FedAvg's local layers, FedBN's normalisation layers, FedSA-LoRA's ``B`` and FedBABU's
    initial head stay out; a parameter ``download`` leaves out that the client keeps no copy of is sent all the
    same, so the node never trains on a value it lacks. The node completes the parameters
    (:func:`completed_params`)."""
    declared = algorithm.download(params, server_state, client)
    if not (set(declared) <= set(params) and all(isinstance(v, Tensor) for v in declared.values())):
        return dict(params)
    kept = {key.rsplit("/", 1)[-1] for key in state_keys}
    return {k: v for k, v in params.items() if k in declared or k not in kept}


def completed_params(params: dict[str, Tensor], model: Any, init_params: dict[str, Tensor] | None
                     ) -> dict[str, Tensor]:
    """A train message's parameters (:func:`sent_params`) with the personal part left out put back, in the model's
    order: the initial model's value when the message carries it (a client that has not been aggregated yet: it
    starts from the initial personal part, e.g. LG-FedAvg's ``π⁰``), else zeros, which the algorithm does not read
    (an aggregated client trains its own copy, from its state)."""
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name in params:
            out[name] = params[name]
        elif init_params is not None and name in init_params:
            out[name] = init_params[name].clone()
        else:
            out[name] = torch.zeros_like(p, memory_format=torch.contiguous_format).detach()
    extra = set(params) - set(out)
    if extra:
        raise ValueError(f"the message carries parameters the model does not train: {sorted(extra)[:5]}")
    return out


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
