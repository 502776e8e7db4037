"""Atomic checkpoint writes: Lightning's checkpoint I/O replaced by a temp-file, fsync, rename write.

:class:`AtomicCheckpointIO` writes a checkpoint to a temporary file in the target's folder, flushes and
``fsync``-s it, ``os.replace``-s it over the target and ``fsync``-s the folder, so a crash at any point leaves
either the previous file or the new one, both complete. ``FederatedModule.setup`` installs it when the Trainer's
strategy uses Lightning's plain ``TorchCheckpointIO`` (:func:`install_atomic_checkpoint_io`);
:func:`remove_stale_partials` deletes the temporary files of writers proven gone.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem

from lightning_fedmeta.persistence.atomic_io import PARTIAL_SUFFIX, atomic_write, writer_gone

if TYPE_CHECKING:

    pass
from lightning_fedmeta.persistence.checksums import VERIFIED_MARK, verify_checkpoint
from lightning_fedmeta.persistence.safe_loading import _is_local, load_checkpoint_file, refuse_unsafe_load

__all__ = [
    "AtomicCheckpointIO",
    "atomic_save",
    "install_atomic_checkpoint_io",
    "remove_stale_partials",
]


# ----------------------------------------------------------------------------------------------
# atomic writes
# ----------------------------------------------------------------------------------------------
_serialize: Callable[[Any, Any], None] = torch.save  # indirection for tests that interrupt a write


#: the temporary file of an interrupted atomic write: ``.<name>.<pid>.<random>.partial``
# (lightning_fedmeta.persistence.atomic_io)
_PARTIAL_NAME = re.compile(rf"^\..+\.(\d+)\.[0-9a-f]+{re.escape(PARTIAL_SUFFIX)}$")


def remove_stale_partials(directory: str | os.PathLike[str]) -> list[str]:
    """Remove the temporary files that interrupted saves left in ``directory``, whatever checkpoint they were
    writing (a killed save of ``epoch=0-step=2.ckpt`` is never retried under that name), when their writer is
    proven gone: the exclusive lock every writer holds on its file until the rename
    (:func:`~lightning_fedmeta.persistence.atomic_io.hold_writer_lock`) can be taken. Not by process id: a run in
    another PID
    namespace (a container on the same volume) has live writers whose ids are not alive here (issue 41, the class
    of item 3). Files named with this process's id are never touched (they may be this process's own saves).
    Returns the paths removed. Not on Windows (no ``flock``)."""
    removed: list[str] = []
    if os.name == "nt":
        return removed
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            match = _PARTIAL_NAME.match(entry.name)
            if match and entry.is_file() and int(match.group(1)) != os.getpid() and writer_gone(entry.path):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed.append(entry.path)
    return removed


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)`` that never leaves ``path`` incomplete.

    Writes ``.<name>.<pid>.<random>.partial`` in the same folder (so the rename cannot cross file systems),
    flushes and ``fsync``-s it, ``os.replace``-s it over ``path`` (atomic on POSIX and Windows) and
    ``fsync``-s the folder so the rename itself survives a power loss
    (:func:`lightning_fedmeta.persistence.atomic_io.atomic_write`). On any error the temporary file is removed and
    ``path`` is
    untouched; temporary files of a killed writer are removed by the next save into the folder
    (:func:`remove_stale_partials`).
    """
    target = os.path.abspath(os.fspath(path))
    remove_stale_partials(os.path.dirname(target))
    atomic_write(target, lambda fh: _serialize(obj, fh))


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with crash-safe local writes and named damage on load.

    * ``save_checkpoint``: :func:`atomic_save` for local paths (temporary file in the same folder, ``fsync``,
      ``os.replace``, folder ``fsync``). Lightning's own ``_atomic_save`` serialises into memory and writes
      through an fsspec transaction whose temporary file is made by ``tempfile.mkstemp()`` in the system
      temporary folder and moved with ``shutil.move``: across file systems (``/tmp`` on tmpfs) that move is a
      copy into the target, which a crash leaves truncated, and nothing is ``fsync``-ed. Remote paths
      (``s3://`` ...) keep Lightning's behaviour.
    * ``load_checkpoint``: every file, local or remote (a URL included), is read with ``weights_only=True``
      and ``weights_only=False`` is refused (:func:`load_checkpoint_file`; Lightning's own reads a URL with
      ``weights_only=False``, so the file could run code); a file torch cannot read raises
      :class:`CheckpointDamagedError` when it is not an intact archive (:func:`diagnose_file`), and the checksum
      is verified on the raw file before Lightning migrates it.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        atomic_save(checkpoint, path)

    def load_checkpoint(
        self, path: Any, map_location: Any = lambda storage, loc: storage, weights_only: bool | None = None
    ) -> dict[str, Any]:
        refuse_unsafe_load(weights_only, path)
        if not get_filesystem(path).exists(os.fspath(path)):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        checkpoint = load_checkpoint_file(path, map_location=map_location)
        if isinstance(checkpoint, dict) and "fedmeta" in checkpoint:
            verify_checkpoint(checkpoint, path)
            checkpoint[VERIFIED_MARK] = True
        return checkpoint


def install_atomic_checkpoint_io(trainer: Any) -> bool:
    """Give ``trainer``'s strategy an :class:`AtomicCheckpointIO` if it uses Lightning's plain
    ``TorchCheckpointIO`` (the default); a CheckpointIO of the user's (any other class) is kept.
    Returns whether it was installed."""
    strategy = getattr(trainer, "strategy", None)
    if strategy is None:
        return False
    current = strategy.checkpoint_io
    if type(current) is not TorchCheckpointIO:
        return False
    strategy.checkpoint_io = AtomicCheckpointIO()
    return True
