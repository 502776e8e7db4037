"""A client's state on its own disk, so it survives a SuperNode restart.

Flower keeps ``context.state`` in the SuperNode's memory, per run and node: a restarted SuperNode starts with
an empty one and a new node id. The client's row of the state store (a personal model, control variates,
dual variables: whatever the algorithm's ``client_update`` returns as ``state``) is therefore written to a
file keyed by the deployment's run key and the node's ``partition-id``::

    <state-dir>/run-<run key>/partition-<p>/round-<r>.pt      the client's state after round r

The server tells each message which round's state to start from (``state-round``: the last round whose reply
from this client it aggregated; −1 before the first one, when the state is the algorithm's initial state).
A round the server did not aggregate (a lost reply) therefore never leaks into the next one, and a retried
round recomputes from the same state: exactly the in-process loop, where a failed client's state is untouched.
The folder also holds ``run-token``: the random token of the deployment that owns it (the ServerApp draws it
once and keeps it in its checkpoint, so a resumed server keeps it). A second deployment that reuses the run key
on the same node is refused with a message naming both tokens, instead of overwriting (or reading) the first
one's personal state. Files are written atomically (:func:`lightning_fedmeta.persistence.atomic_io.atomic_torch_save`:
temporary file in the same folder, ``fsync``, ``os.replace``, folder ``fsync``), so a crash never leaves a
half-written state.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from lightning_fedmeta.persistence.atomic_io import (  # atomic_torch_save re-exported: flower/server.py imports it
# from here
    atomic_torch_save,
    atomic_write_bytes,
)
from lightning_fedmeta.persistence.memory_store import flatten_state, unflatten_state

__all__ = ["ClientStateFile", "atomic_torch_save", "default_state_dir"]

_ROUND_FILE = re.compile(r"^round-(-?\d+)\.pt$")


def default_state_dir() -> str:
    """``$FEDMETA_FLOWER_STATE_DIR``, else ``$FLWR_HOME/fedmeta-state``, else ``~/.flwr/fedmeta-state``."""
    explicit = os.environ.get("FEDMETA_FLOWER_STATE_DIR")
    if explicit:
        return explicit
    home = os.environ.get("FLWR_HOME") or os.path.join(os.path.expanduser("~"), ".flwr")
    return os.path.join(home, "fedmeta-state")


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


class ClientStateFile:
    """The state files of one client (``partition_id``) in one deployment (``run_key``; ``run_token``: the
    deployment's identity, checked against the folder's owner before any read or write; ``None`` skips the check,
    for tools that only inspect a folder)."""

    def __init__(self, root: str | os.PathLike[str], run_key: str, partition_id: int,
                 run_token: str | None = None) -> None:
        self.directory = Path(root) / f"run-{_safe(str(run_key))}" / f"partition-{int(partition_id)}"
        self.partition_id = int(partition_id)
        self.run_key = str(run_key)
        self.run_token = run_token

    def claim(self) -> None:
        """Make sure this folder belongs to this deployment: adopt it when it has no owner yet (a new run, or a
        folder written before tokens existed), refuse it (``ValueError``) when another deployment owns it."""
        if self.run_token is None:
            return
        marker = self.directory / "run-token"
        if marker.is_file():
            owner = marker.read_text().strip()
            if owner != self.run_token:
                raise ValueError(
                    f"the state folder {self.directory} belongs to another deployment (run token {owner}; this one "
                    f"is {self.run_token}) that uses the same run-key {self.run_key!r}: its personal state is "
                    "neither read nor overwritten. Give this deployment another run config run-key, or delete that "
                    "folder if its run is over"
                )
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(marker, self.run_token.encode())

    def path(self, round_idx: int) -> Path:
        return self.directory / f"round-{int(round_idx)}.pt"

    def save(self, round_idx: int, state: dict[str, Any]) -> Path:
        """Write the state after round ``round_idx`` (atomically)."""
        self.claim()
        path = self.path(round_idx)
        flat = {k: v.detach().cpu().clone() for k, v in flatten_state(state).items()}
        atomic_torch_save({"round": int(round_idx), "partition_id": self.partition_id, "state": flat}, path)
        return path

    def load(self, round_idx: int) -> dict[str, Any]:
        """The state after round ``round_idx``; ``ValueError`` naming the file when it is missing."""
        self.claim()
        path = self.path(round_idx)
        if not path.is_file():
            raise ValueError(
                f"the state of partition-id {self.partition_id} after round {round_idx} is missing ({path}): this "
                "node lost its state directory (node config state-dir), so its personal state cannot be restored"
            )
        saved = torch.load(path, map_location="cpu", weights_only=True)
        return unflatten_state(saved["state"])

    def rounds(self) -> list[int]:
        """The rounds whose state is on disk, ascending."""
        if not self.directory.is_dir():
            return []
        found = (_ROUND_FILE.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def prune(self, keep: set[int]) -> None:
        """Remove the files of rounds older than the newest kept one and not in ``keep``."""
        if not keep:
            return
        newest = max(keep)
        for r in self.rounds():
            if r not in keep and r < newest:
                self.path(r).unlink(missing_ok=True)
