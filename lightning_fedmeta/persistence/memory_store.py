"""ClientStateStore: every per-client tensor of an algorithm, one row per client.

SCAFFOLD's control variates, personal models, dual variables and cluster ids all live here,
stacked along axis 0 (row i = client i). The store is saved in Lightning checkpoints by the
FederatedModule (``on_save_checkpoint``), so a resumed run sees exactly the state it left.

The state is a dict of tensors, or a nested dict of them (a pytree: e.g. a personal model kept as
``{"personal": {parameter name: tensor}}``). It is flattened only in :meth:`ClientStateStore.state_dict`
(:func:`flatten_state`: nested keys joined by ``/``, so a flat dict is saved as it is) and rebuilt by
:meth:`ClientStateStore.load_state_dict` (:func:`unflatten_state`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["ClientStateStore", "SEPARATOR", "flatten_state", "unflatten_state", "map_state"]

#: joins the keys of nested levels in a flattened state (parameter names use ``.``, so ``/`` does not clash)
SEPARATOR = "/"

State = Mapping[str, Any]  # a (nested) dict of tensors


def flatten_state(state: State, prefix: str = "") -> dict[str, Tensor]:
    """``{"a/b": tensor}`` for ``{"a": {"b": tensor}}`` (a flat dict is returned as a copy of itself).

    Raises ``ValueError`` for a key that contains ``/`` or is empty, or a leaf that is not a tensor.
    """
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        if not isinstance(key, str) or not key or SEPARATOR in key:
            raise ValueError(f"state key {prefix + str(key)!r}: keys must be non-empty strings without {SEPARATOR!r}")
        if isinstance(value, Mapping):
            out.update(flatten_state(value, prefix + key + SEPARATOR))
        elif isinstance(value, Tensor):
            out[prefix + key] = value
        else:
            raise ValueError(f"state entry {prefix + key!r} is a {type(value).__name__}, not a tensor or a dict")
    return out


def unflatten_state(flat: Mapping[str, Tensor]) -> dict[str, Any]:
    """The nested dict :func:`flatten_state` flattened (keys split at ``/``)."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *path, last = key.split(SEPARATOR)
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def map_state(fn: Callable[[Tensor], Tensor], state: State) -> dict[str, Any]:
    """``state`` with ``fn`` applied to every tensor, nesting kept."""
    return {k: map_state(fn, v) if isinstance(v, Mapping) else fn(v) for k, v in state.items()}


class ClientStateStore:
    """A (nested) dict of ``[K, ...]`` tensors with row gather/scatter for the sampled clients."""

    def __init__(self, tensors: State | None = None) -> None:
        self.tensors: dict[str, Any] = dict(tensors or {})
        flatten_state(self.tensors)  # refuse keys and leaves a checkpoint could not hold, before training

    def __len__(self) -> int:
        return len(flatten_state(self.tensors))

    def keys(self) -> list[str]:
        """The flattened entry names (as in :meth:`state_dict`)."""
        return list(flatten_state(self.tensors))

    def gather(self, clients: Tensor) -> dict[str, Any]:
        """Rows of the given clients, ``{name: [C, ...]}`` (copies; nesting kept)."""
        return map_state(lambda v: v.index_select(0, clients.to(v.device)), self.tensors)

    def scatter(self, clients: Tensor, rows: State) -> None:
        """Write the rows of the given clients back (entries must match the store's)."""
        stored, given = flatten_state(self.tensors), flatten_state(rows)
        if set(given) != set(stored):
            raise KeyError(f"client state keys changed: stored {sorted(stored)}, got {sorted(given)}")
        for k, v in given.items():
            dst = stored[k]
            dst.index_copy_(0, clients.to(dst.device), v.to(dst.dtype))

    def to(self, device: torch.device | str) -> ClientStateStore:
        self.tensors = map_state(lambda v: v.to(device), self.tensors)
        return self

    def state_dict(self) -> dict[str, Tensor]:
        """Flat ``{name: tensor}`` on the CPU (:func:`flatten_state`), for checkpoints."""
        return {k: v.detach().cpu().clone() for k, v in flatten_state(self.tensors).items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        self.tensors = unflatten_state({k: v.clone() for k, v in state.items()})

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in flatten_state(self.tensors).values())

    def resident_bytes(self) -> int:
        """Process memory the store holds: all of it (:meth:`nbytes`); see the disk-backed store for large K."""
        return self.nbytes()

    def checkpoint_state(self, tag: int = 0) -> dict[str, Tensor]:
        """What a checkpoint holds: :meth:`state_dict` (``tag``, the round, is for the disk-backed store)."""
        return self.state_dict()
