"""Atomic file writes: a crash leaves the old file or the new one, never a torn one.

Every file the library writes for crash safety (checkpoints, client-state segments, Flower client state files)
goes through this protocol:

1. the bytes go to a temporary file **in the target's own folder** (``.<name>.<pid>.<random>.partial``, so the
   rename below never crosses file systems and is never a copy), created exclusively;
2. the temporary file is flushed and ``fsync``-ed, so its bytes are on the disk before it gets the target's name;
3. ``os.replace`` moves it over the target: atomic on POSIX and Windows, a reader sees the old file or the new
   one, whole;
4. the folder is ``fsync``-ed, so the rename itself survives a power loss (skipped on Windows, where a folder
   cannot be opened and the rename is durable with the file).

If anything fails before the rename (serialisation raises, the disk is full, ``os.replace`` fails), the
temporary file is removed and the target is untouched. A process killed mid-write leaves its ``.partial``
file behind; its name carries the writer's process id, so a later writer can tell it is stale (the checkpoint
writer removes those of dead processes; the disk store's carry its owner id and are removed only when their owner
is proven gone, :func:`lightning_fedmeta.persistence.disk_store._remove_stale_work`).

:func:`atomic_write` (a callback writes the file object), :func:`atomic_write_bytes` and
:func:`atomic_torch_save` cover a target whose name is known in advance. A writer that names the file after
its content (a segment named by its SHA-256) uses the parts: :func:`partial_file` for the temporary path,
:func:`sync_file` and :func:`publish` (``os.replace`` + folder ``fsync``).

Only the standard library is imported here (``torch`` inside :func:`atomic_torch_save`): the Flower ClientApp
uses it without importing Lightning.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Iterator
from typing import IO, Any

__all__ = [
    "PARTIAL_SUFFIX", "atomic_torch_save", "atomic_write", "atomic_write_bytes", "fsync_directory", "partial_file",
    "hold_writer_lock", "writer_gone",
    "publish", "sync_file",
]

#: the ending of every temporary file of an atomic write
PARTIAL_SUFFIX = ".partial"


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """``fsync`` a folder, so the renames in it survive a power loss (a no-op on Windows)."""
    if os.name == "nt":  # directories cannot be opened for fsync there; the rename is durable with the file
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_file(fh: IO[Any]) -> None:
    """Flush ``fh`` and ``fsync`` its bytes to the disk."""
    fh.flush()
    os.fsync(fh.fileno())


@contextlib.contextmanager
def partial_file(directory: str | os.PathLike[str], prefix: str, sep: str = ".") -> Iterator[str]:
    """A fresh temporary path ``<directory>/<prefix><sep><pid><sep><random>.partial``; removed if the block raises.

    The folder must exist. The block writes the file (and :func:`sync_file`-s it) and, to keep it,
    :func:`publish`-es it under its final name before the block ends.
    """
    tmp = os.path.join(os.fspath(directory), f"{prefix}{sep}{os.getpid()}{sep}{secrets.token_hex(4)}{PARTIAL_SUFFIX}")
    try:
        yield tmp
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def hold_writer_lock(fh: IO[Any]) -> None:
    """Take an exclusive ``flock`` on the open temporary file ``fh`` for as long as it stays open: the kernel
    releases it when the writer closes the file or dies, in any PID namespace, so a clean-up that can take the lock
    (:func:`writer_gone`) knows the writer is gone. Nothing on Windows (no ``fcntl``)."""
    try:
        import fcntl
    except ImportError:
        return
    fcntl.flock(fh.fileno(), fcntl.LOCK_EX)


def writer_gone(path: str | os.PathLike[str]) -> bool:
    """Whether the temporary file ``path`` belongs to no live writer: its :func:`hold_writer_lock` lock can be
    taken. ``False`` when it cannot be checked (no ``fcntl``, the file cannot be opened): kept, never deleted.
    Never call it on a file this process may be writing (on NFS ``flock`` is a POSIX lock, which a second open in
    the same process would release on close)."""
    try:
        import fcntl
    except ImportError:
        return False
    try:
        with open(path, "rb") as fh:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held: a writer is alive
                return False
            return True
    except OSError:
        return False


def publish(tmp: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """``os.replace`` the synced temporary file ``tmp`` over ``target`` (same folder), then ``fsync`` the folder."""
    os.replace(tmp, target)
    fsync_directory(os.path.dirname(os.path.abspath(os.fspath(target))))


def atomic_write(path: str | os.PathLike[str], write: Callable[[IO[bytes]], Any]) -> None:
    """Write ``path`` atomically: ``write(fh)`` fills a temporary binary file in the same folder (created, with
    its parents, if missing), which is synced and renamed over ``path``. On any error ``path`` is untouched and the
    temporary file is gone."""
    target = os.path.abspath(os.fspath(path))
    directory, name = os.path.split(target)
    os.makedirs(directory, exist_ok=True)
    with partial_file(directory, f".{name}") as tmp:
        with open(tmp, "xb") as fh:
            hold_writer_lock(fh)  # held until the file is renamed: a clean-up never takes a live writer's file
            write(fh)
            sync_file(fh)
            publish(tmp, target)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (:func:`atomic_write`)."""
    atomic_write(path, lambda fh: fh.write(data))


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)`` that never leaves ``path`` half-written (:func:`atomic_write`)."""
    import torch

    atomic_write(path, lambda fh: torch.save(obj, fh))
