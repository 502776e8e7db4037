"""DiskClientStateStore: the client state store with its ``[K, ...]`` rows on disk, for populations whose state
does not fit in memory (Ditto's personal models at K = 100,000 clients: 27 GB).

What lives where (docs/scale.md, "Client state on disk"):

* **working files** ``<root>/rank-<r>/work-<owner>/<i>.rows``: one raw file per flattened state entry,
  ``K × row bytes``, row ``i`` at byte ``i × row bytes``, created sparse (no disk blocks until a row is written).
  :meth:`gather` reads the sampled rows straight into the output tensor, :meth:`scatter` writes them back in
  place; a row never written reads as the *template* (the value ``init_client_states`` gives every client). Only
  the gathered copies, the template and two ``[K]`` byte masks (written, dirty) are process memory. The working
  files are scratch, removed when the store goes: the durable copy of the state is the segments below, so a crash
  never corrupts a checkpoint. Beside them, the owner file ``work-<owner>.lock`` (``<owner>`` = ``<pid>-<random
  token>``, naming the kernel it runs on) is held ``flock``-ed while the store lives; a new store removes the working
  files and partial segments of a store whose owner file names this kernel and whose lock it can take (the kernel
  released it when that process died), and nothing else: never by a process id, which means nothing in another PID
  namespace (two containers sharing a volume), and never the files of another kernel (another host on NFS, an
  earlier boot: delete those by hand when no run uses them).
* **segments** ``<root>/rank-<r>/segments/seg-<round>-<sha256[:16]>.fseg``: at every checkpoint the rows written
  since the previous checkpoint go into one immutable file (written to a temporary name, ``fsync``-ed, renamed,
  the folder ``fsync``-ed). Its name holds its SHA-256, so a name is never reused for other bytes, and a later
  checkpoint never changes the files an earlier one references.
* **the checkpoint** holds a small manifest (:meth:`checkpoint_state`): entries, template rows and the ordered
  list of segments with their SHA-256. Restoring any checkpoint (:meth:`restore`) rebuilds fresh working files
  from the template and those segments, in order, after checking every checksum, so a run resumes bit for bit
  from the last *or any earlier* checkpoint. A checkpoint costs the rows written since the last one (not K rows).
  The store is always rebuilt in the current run's folder; the folder a manifest names is only read (its segments
  are linked or copied over), and every field of a manifest and of a segment header is checked before it is used
  (:mod:`lightning_fedmeta.persistence.disk_manifest`): the manifest is data whoever wrote the checkpoint controls.

Why raw row-major files: a gather/scatter of ``C`` rows touches ``C`` rows of the file and nothing else; any torch
dtype works (bytes viewed as the dtype, so ``bfloat16`` too); there is no format library to keep up with; and the
layout is exactly a memory map's, so :attr:`DiskClientStateStore.tensors` gives zero-copy ``numpy.memmap`` views.
Rows are moved with positional I/O (``seek`` + ``readinto``/``write`` on the tensor's own buffer, one call per run
of consecutive rows) rather than through the mapping: the first touch of a mapped page costs a page fault, measured
at 63 ms for 10 fresh Ditto rows (273 KB each) against 1–5 ms with positional I/O (docs/scale.md). Segments use a
fixed, documented layout (:func:`write_segment`) that is byte-for-byte deterministic, so the ranks of a DDP run,
which apply the same scatters, write identical segments.

Under DDP every rank applies the same scatter of all sampled rows (``FederatedModule.commit_round``), so every rank
keeps its own store in ``rank-<r>`` (ranks on different nodes share no files) and the checkpoint written by rank 0
references segments every rank has under the same names.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import struct
import tempfile
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_fedmeta.persistence.atomic_io import PARTIAL_SUFFIX, partial_file, publish, sync_file
from lightning_fedmeta.persistence.checksums import CheckpointDamagedError

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None  # type: ignore[assignment]
from lightning_fedmeta.persistence.disk_manifest import (
    Block,
    check_manifest,
    check_segment_header,
    refuse,
    segment_path,
)
from lightning_fedmeta.persistence.memory_store import flatten_state, unflatten_state

__all__ = [
    "DISK_STATE_THRESHOLD_BYTES", "DiskClientStateStore", "MANIFEST_FORMAT", "check_directory", "describe",
    "gathered_bytes", "is_disk_manifest", "read_segment", "write_segment",
]

#: ``client_state: auto`` keeps the state on disk when ``K × row bytes`` exceeds this (2 GiB)
DISK_STATE_THRESHOLD_BYTES = 2 * 2**30
#: the ``format`` of the manifest a checkpoint holds for a disk store
MANIFEST_FORMAT = "lightning_fedmeta.persistence.disk_store/1"
_MAGIC = b"FEDSEG01"
_ALIGN = 64
_COPY_ROWS_BYTES = 64 * 2**20  # rows are copied between files in blocks of at most this many bytes
_HASH_BLOCK = 8 * 2**20


def _row_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()


def _sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def is_disk_manifest(entry: Any) -> bool:
    """Whether a checkpoint's ``client_state`` entry is a disk store's manifest (else: flat tensors)."""
    return isinstance(entry, Mapping) and entry.get("format") == MANIFEST_FORMAT


def _map_rows(path: str, num_rows: int, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """``[num_rows, *shape]`` tensor over the file at ``path`` (mapped shared: zero-copy, nothing read until used)."""
    nbytes = num_rows * _row_bytes(shape, dtype)
    if nbytes == 0:
        return torch.empty((num_rows, *shape), dtype=dtype)
    raw = np.memmap(path, dtype=np.uint8, mode="r+", shape=(nbytes,))
    return torch.from_numpy(raw).view(dtype).view(num_rows, *shape)


def _runs(index: list[int]) -> list[tuple[int, int, int]]:
    """``(position, first row, count)`` of the runs of consecutive rows in ``index`` (one system call each)."""
    runs: list[tuple[int, int, int]] = []
    for pos, row in enumerate(index):
        if runs and runs[-1][1] + runs[-1][2] == row and runs[-1][0] + runs[-1][2] == pos:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((pos, row, 1))
    return runs


def _kernel_id() -> str:
    """Which kernel this process runs on: its boot id (shared by the containers of one host, new at every boot),
    else the host name. A store's lock is only trusted by stores on the same kernel (module docstring)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return f"boot:{fh.read().strip()}"
    except OSError:
        return f"host:{socket.gethostname()}"


def _lock(fd: int, wait: bool) -> bool:
    """Take the exclusive ``flock`` of ``fd`` (waiting for it when ``wait``); whether it was taken. Without
    ``fcntl`` (Windows) no lock is ever taken, so no store's files are ever proven stale there."""
    if fcntl is None:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except OSError:
        return False
    return True


#: the owner files (device, inode) of the stores of this process: never opened by its own clean-up (on NFS, flock
#: is a POSIX lock, which this process's own test would take and whose close would release)
_HELD: set[tuple[int, int]] = set()
_OWNER_FILE = re.compile(r"work-(?P<pid>[0-9]+)-[0-9a-f]+\.lock")
_OWNED_PARTIAL = re.compile(r"\.(?:seg|copy)-(?P<owner>[0-9]+-[0-9a-f]+)-.*" + re.escape(PARTIAL_SUFFIX))


def _take_ownership(directory: str) -> tuple[str, int]:
    """``(owner, fd)``: a fresh owner id ``<pid>-<token>`` and the open, ``flock``-ed owner file
    ``work-<owner>.lock`` that proves this store's working files are in use (held until :func:`_remove_work`)."""
    while True:
        owner = f"{os.getpid()}-{secrets.token_hex(8)}"
        path = os.path.join(directory, f"work-{owner}.lock")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        except FileExistsError:
            continue
        _lock(fd, wait=True)  # a store inspecting it holds it a moment, sees no kernel written yet and lets go
        os.write(fd, json.dumps({"kernel": _kernel_id(), "host": socket.gethostname(), "pid": os.getpid()}).encode())
        info = os.fstat(fd)
        _HELD.add((info.st_dev, info.st_ino))
        return owner, fd


def _remove_stale_work(directory: str) -> None:
    """Remove the working folders and partial segments of stores that no longer run (killed before they could
    clean up), and only those: a store's files are ``work-<owner>``, ``segments/.seg-<owner>-*.partial`` and
    ``segments/.copy-<owner>-*.partial`` beside its owner file ``work-<owner>.lock``, which the store holds
    ``flock``-ed while it lives. A store is proven gone when its owner file says it ran on this kernel (the same
    boot id: this host, any container) and its lock can be taken: the kernel released it when the process died.
    Files of a store on another kernel (another host on NFS, an earlier boot), files without an owner file, and
    the files of a store whose lock is held are never touched: a process id says nothing across PID namespaces."""
    kernel = _kernel_id()
    segments = os.path.join(directory, "segments")
    for entry in os.scandir(directory):
        match = _OWNER_FILE.fullmatch(entry.name)
        if match is None or int(match["pid"]) == os.getpid():  # this process's own (or its pid's: kept)
            continue
        try:
            info = os.stat(entry.path)
            if (info.st_dev, info.st_ino) in _HELD:
                continue
            fd = os.open(entry.path, os.O_RDWR)
        except OSError:
            continue
        try:
            if not _lock(fd, wait=False):  # its store runs
                continue
            try:
                said = json.loads(os.read(fd, 4096).decode())
                same_file = os.fstat(fd).st_ino == os.stat(entry.path).st_ino  # not removed and replaced meanwhile
            except (OSError, ValueError):
                continue
            if not isinstance(said, dict) or said.get("kernel") != kernel or not same_file:
                continue
            owner = entry.name[len("work-"):-len(".lock")]
            shutil.rmtree(os.path.join(directory, f"work-{owner}"), ignore_errors=True)
            for partial in os.scandir(segments) if os.path.isdir(segments) else ():
                found = _OWNED_PARTIAL.fullmatch(partial.name)
                if found is not None and found["owner"] == owner:
                    with contextlib.suppress(OSError):
                        os.unlink(partial.path)
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
        finally:
            os.close(fd)


def _remove_work(work: str, files: list[_RowFile], owner_file: str, owner_fd: int) -> None:
    for rowfile in files:
        rowfile.close()
    shutil.rmtree(work, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.unlink(owner_file)
    info = os.fstat(owner_fd)
    os.close(owner_fd)  # releases the lock, last
    _HELD.discard((info.st_dev, info.st_ino))


class _RowFile:
    """One entry's ``[K, *shape]`` rows in a raw file (row ``i`` at byte ``i × row bytes``), read and written with
    positional I/O straight into / out of the tensors' memory (no intermediate copy in Python)."""

    def __init__(self, path: str, num_rows: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.path, self.num_rows, self.shape, self.dtype = path, num_rows, shape, dtype
        self.row_bytes = _row_bytes(shape, dtype)
        with open(path, "wb") as fh:
            fh.truncate(num_rows * self.row_bytes)  # sparse: blocks are allocated when rows are written
        self.fh = open(path, "r+b", buffering=0)  # noqa: SIM115 - closed by close()

    def read(self, index: Tensor) -> Tensor:
        out = torch.empty((index.numel(), *self.shape), dtype=self.dtype)
        if self.row_bytes == 0 or index.numel() == 0:
            return out
        buffer = memoryview(out.view(-1).view(torch.uint8).numpy())
        for pos, row, count in _runs(index.tolist()):
            view = buffer[pos * self.row_bytes:(pos + count) * self.row_bytes]
            self.fh.seek(row * self.row_bytes)
            done = 0
            while done < len(view):
                got = self.fh.readinto(view[done:])
                if not got:
                    raise OSError(f"{self.path} is shorter than its {self.num_rows} rows")
                done += got
        return out

    def write(self, index: Tensor, values: Tensor) -> None:
        if self.row_bytes == 0 or index.numel() == 0:
            return
        values = values.detach().to("cpu", self.dtype).contiguous()
        buffer = memoryview(values.view(-1).view(torch.uint8).numpy())
        for pos, row, count in _runs(index.tolist()):
            self.fh.seek(row * self.row_bytes)
            view = buffer[pos * self.row_bytes:(pos + count) * self.row_bytes]
            done = 0
            while done < len(view):
                done += self.fh.write(view[done:])

    def close(self) -> None:
        self.fh.close()


# ----------------------------------------------------------------------------------------------
# segments
# ----------------------------------------------------------------------------------------------
def write_segment(directory: str, tag: int, clients: Tensor, rows: Callable[[str, Tensor], Tensor],
                  entries: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                  owner: str | None = None) -> dict[str, Any]:
    """Write the rows of ``clients`` (sorted ``int64``) as one immutable segment file; returns its manifest record
    ``{"file", "sha256", "rows"}``.

    Layout (the machine's byte order: little-endian on x86 and ARM): ``FEDSEG01``, the header's length
    (``uint64``), the header (JSON: ``rows``, ``clients`` and per entry ``dtype``, ``shape``, ``offset``,
    ``nbytes``), then the client indices and each entry's ``[rows, *shape]`` values, every block at a multiple
    of 64 bytes. ``rows(name, block)`` gives the values of a block of clients. The file is written under a
    temporary name (``.seg-<owner>-<pid>-<random>.partial``: a store's ``owner`` id, so another store can tell
    whose it is, :func:`_remove_stale_work`), ``fsync``-ed and renamed to ``seg-<tag>-<sha256[:16]>.fseg`` (the
    folder ``fsync``-ed), so a segment is complete or absent.
    """
    n = int(clients.numel())
    header: dict[str, Any] = {"rows": n, "entries": {}}
    offset = 0

    def block(nbytes: int) -> dict[str, int]:
        nonlocal offset
        out = {"offset": offset, "nbytes": nbytes}
        offset += -(-nbytes // _ALIGN) * _ALIGN
        return out

    header["clients"] = block(n * 8)
    for name, (shape, dtype) in entries.items():
        header["entries"][name] = {"dtype": str(dtype), "shape": list(shape), **block(n * _row_bytes(shape, dtype))}
    head = json.dumps(header, sort_keys=True).encode()
    prefix = _MAGIC + struct.pack("<Q", len(head)) + head
    prefix += b"\0" * (-len(prefix) % _ALIGN)
    os.makedirs(directory, exist_ok=True)
    digest = hashlib.sha256()
    with partial_file(directory, ".seg" if owner is None else f".seg-{owner}", sep="-") as tmp:
        with open(tmp, "wb") as fh:
            def put(data: bytes | memoryview) -> None:
                fh.write(data)
                digest.update(data)

            put(prefix)
            put(clients.to(torch.int64).numpy().tobytes())
            put(b"\0" * (-(n * 8) % _ALIGN))
            for name, (shape, dtype) in entries.items():
                per_row = max(1, _row_bytes(shape, dtype))
                step = max(1, _COPY_ROWS_BYTES // per_row)
                for start in range(0, n, step):
                    values = rows(name, clients[start:start + step]).contiguous()
                    if values.numel():
                        put(memoryview(values.view(-1).view(torch.uint8).numpy()))
                put(b"\0" * (-(n * _row_bytes(shape, dtype)) % _ALIGN))
            sync_file(fh)
        sha = digest.hexdigest()
        name = f"seg-{tag:09d}-{sha[:16]}.fseg"
        publish(tmp, os.path.join(directory, name))
    return {"file": name, "sha256": sha, "rows": n}


def _verify(path: str, sha256: str) -> None:
    """:class:`CheckpointDamagedError` unless the file at ``path`` has the SHA-256 ``sha256``."""
    if (actual := _sha256_file(path)) != sha256:
        raise CheckpointDamagedError(
            f"the client state segment {path} is damaged: its SHA-256 is {actual}, the checkpoint recorded {sha256}"
        )


def _segment_header(path: str, raw: np.ndarray) -> tuple[Any, int]:
    """The parsed JSON header of a segment and the offset of its first block (refused if it runs past the end)."""
    if len(raw) < 16 or bytes(raw[:8]) != _MAGIC:
        raise CheckpointDamagedError(f"{path} is not a client state segment (bad magic bytes)")
    (head_len,) = struct.unpack("<Q", bytes(raw[8:16]))
    base = 16 + head_len + (-(16 + head_len) % _ALIGN)
    if base > len(raw):
        refuse(f"the segment {path}, header length", f"= {head_len} runs past the end of the file ({len(raw)} bytes)")
    try:
        return json.loads(bytes(raw[16:16 + head_len])), base
    except ValueError as exc:  # not JSON, or not UTF-8
        refuse(f"the segment {path}, header", f"is not JSON ({exc})")
    except RecursionError:
        refuse(f"the segment {path}, header", "is not JSON (nested too deeply)")


def read_segment(path: str, sha256: str | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The client indices and ``{name: [rows, *shape]}`` values of a segment (memory-mapped, read-only views),
    after checking its SHA-256 against ``sha256`` when given (:class:`CheckpointDamagedError` if it differs) and
    every offset, size, shape and dtype of its header against the file
    (:func:`~lightning_fedmeta.persistence.disk_manifest.check_segment_header`)."""
    if not os.path.isfile(path):
        raise CheckpointDamagedError(
            f"the client state segment {path} that this checkpoint references is missing: the checkpoint's "
            "client state cannot be rebuilt (model.client_state_dir must point at the folder the run wrote, with "
            "its rank-<r>/segments files)"
        )
    if sha256 is not None:
        _verify(path, sha256)
    size = os.path.getsize(path)
    raw = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, dtype=np.uint8)
    header, base = _segment_header(path, raw)
    n, clients, blocks = check_segment_header(path, header, len(raw) - base)

    def view(block: Block) -> Tensor:
        if block.nbytes == 0:
            return torch.empty((n, *block.shape), dtype=block.dtype)
        chunk = raw[base + block.offset:base + block.offset + block.nbytes]
        with warnings.catch_warnings():  # a read-only mapping: the views are only read
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(chunk, dtype=torch.uint8)
        return flat.view(block.dtype).view(n, *block.shape)

    return view(clients), {name: view(block) for name, block in blocks.items()}


def _copy_segment(path: str, directory: str, sha256: str, owner: str | None = None) -> str:
    """Put the segment at ``path`` into ``directory`` (a hard link when the file system allows, else a copy;
    atomic either way) after checking the SHA-256 of what arrived, so the checkpoints of a run that resumed into
    another folder reference only its own files. ``path``'s folder is only read. Returns the new path."""
    target = os.path.join(directory, os.path.basename(path))
    with partial_file(directory, ".copy" if owner is None else f".copy-{owner}", sep="-") as tmp:
        try:
            os.link(os.path.realpath(path), tmp)
        except OSError:
            shutil.copyfile(path, tmp)
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        _verify(tmp, sha256)
        publish(tmp, target)
    return target


# ----------------------------------------------------------------------------------------------
# the store
# ----------------------------------------------------------------------------------------------
def check_directory(root: str | os.PathLike[str], rank: int = 0, option: str = "model.client_state_dir") -> str:
    """``<root>/rank-<rank>``, created; a ``ValueError`` naming ``option`` when it cannot be."""
    root = os.path.abspath(os.fspath(root))
    if os.path.exists(root) and not os.path.isdir(root):
        raise ValueError(f"{option} must be a folder, got {root!r}, which is a file")
    path = os.path.join(root, f"rank-{rank}")
    try:
        os.makedirs(os.path.join(path, "segments"), exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, prefix=".probe-", delete=True)  # noqa: SIM115
        probe.close()
    except OSError as exc:
        raise ValueError(f"{option}={root!r} is not a writable folder: {exc}") from exc
    return path


class DiskClientStateStore:
    """The rows of a :class:`~lightning_fedmeta.persistence.memory_store.ClientStateStore` in files on disk (module
    docstring).

    Same interface as the in-memory store (``gather``, ``scatter``, ``keys``, ``tensors``, ``to``,
    ``state_dict``, ``load_state_dict``, ``nbytes``) plus :meth:`checkpoint_state` / :meth:`restore` (the
    manifest a checkpoint holds) and :meth:`resident_bytes`.

    Args:
        root: the store's folder; this process uses ``<root>/rank-<rank>``.
        num_clients: ``K``.
        entries: ``{flattened name: (row shape, dtype)}``.
        template: ``{flattened name: row}``, the value of every row not written yet (lazy initialisation); ``None``
            when every row is written at construction (:meth:`from_rows`).
        rank: the process's global rank.
        option: the option named in errors about ``root``.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        num_clients: int,
        entries: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        template: Mapping[str, Tensor] | None,
        rank: int = 0,
        option: str = "model.client_state_dir",
    ) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.rank = int(rank)
        self.directory = check_directory(self.root, self.rank, option)
        self.segment_directory = os.path.join(self.directory, "segments")
        self.num_clients = int(num_clients)
        self.entries = {k: (tuple(int(d) for d in s), dt) for k, (s, dt) in entries.items()}
        flatten_state(unflatten_state({k: torch.empty(0) for k in self.entries}))  # names a checkpoint can hold
        self.template = None if template is None else {k: template[k].detach().cpu().clone() for k in self.entries}
        self.device = torch.device("cpu")
        self.segments: list[dict[str, Any]] = []  # the chain: applied in order, they give the state
        self.written = torch.zeros(self.num_clients, dtype=torch.bool)  # rows that differ from the template
        self.dirty = torch.zeros(self.num_clients, dtype=torch.bool)  # rows written since the last segment
        _remove_stale_work(self.directory)
        self.owner, owner_fd = _take_ownership(self.directory)
        owner_file = os.path.join(self.directory, f"work-{self.owner}.lock")
        self.work = os.path.join(self.directory, f"work-{self.owner}")
        try:
            os.makedirs(self.work)
            self._files = {k: _RowFile(os.path.join(self.work, f"{i}.rows"), self.num_clients, s, dt)
                           for i, (k, (s, dt)) in enumerate(self.entries.items())}
        except BaseException:
            _remove_work(self.work, [], owner_file, owner_fd)
            raise
        self._finalizer = weakref.finalize(self, _remove_work, self.work, list(self._files.values()), owner_file,
                                           owner_fd)
        self._maps: dict[str, Tensor] | None = None
        self.rows_gathered = 0  # counters (rows copied out / in), for benchmarks and tests
        self.rows_scattered = 0

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def lazy(cls, root: str | os.PathLike[str], num_clients: int, template: Mapping[str, Any], rank: int = 0,
             option: str = "model.client_state_dir") -> DiskClientStateStore:
        """A store whose every row starts as ``template`` (``{name: row}``, nesting allowed), none materialised."""
        flat = flatten_state(template)
        entries = {k: (tuple(v.shape), v.dtype) for k, v in flat.items()}
        return cls(root, num_clients, entries, flat, rank, option)

    @classmethod
    def from_rows(
        cls, root: str | os.PathLike[str], num_clients: int, rows: Callable[[Tensor], Mapping[str, Any]],
        chunk: int = 4096, rank: int = 0, option: str = "model.client_state_dir", who: str = "init_client_states",
    ) -> DiskClientStateStore:
        """A store filled chunk by chunk: ``rows(clients)`` gives the ``[len(clients), ...]`` rows of a sorted
        block of client indices (``chunk`` at a time, so at most ``chunk`` rows are in memory). Every block must
        give the same entries with the same row shapes and dtypes (a ``ValueError`` naming ``who`` if not)."""
        if num_clients < 1:
            raise ValueError("a disk-backed client state needs at least one client")
        first = flatten_state(rows(torch.arange(min(chunk, num_clients))))
        entries = {k: (tuple(v.shape[1:]), v.dtype) for k, v in first.items()}
        store = cls(root, num_clients, entries, None, rank, option)
        block = first
        for start in range(0, num_clients, chunk):
            clients = torch.arange(start, min(start + chunk, num_clients))
            if start:
                block = flatten_state(rows(clients))
            got = {k: (tuple(v.shape[1:]), v.dtype) for k, v in block.items()}
            if got != entries:
                raise ValueError(
                    f"model.client_state: disk initialises the clients' state in blocks of {chunk}, and {who} gave "
                    f"clients {start}..{start + clients.numel() - 1} rows {got}, not the {entries} of the first block: "
                    "the row of a client must not depend on which other clients are initialised with it; use "
                    "model.client_state: memory for this algorithm"
                )
            store.scatter(clients, unflatten_state(block))
        return store

    @classmethod
    def from_tensors(cls, root: str | os.PathLike[str], tensors: Mapping[str, Any], rank: int = 0,
                     option: str = "model.client_state_dir") -> DiskClientStateStore:
        """A store holding the rows of an in-memory state (``{name: [K, ...]}``, nesting allowed)."""
        flat = flatten_state(tensors)
        k = int(next(iter(flat.values())).shape[0])
        return cls.from_rows(
            root, k, lambda c: unflatten_state({n: v.index_select(0, c.to(v.device)).cpu() for n, v in flat.items()}),
            rank=rank, option=option, who="the loaded state",
        )

    # -- the in-memory store's interface ------------------------------------------------------
    def __len__(self) -> int:
        return len(self.entries)

    def keys(self) -> list[str]:
        """The flattened entry names."""
        return list(self.entries)

    @property
    def tensors(self) -> dict[str, Any]:
        """The ``[K, ...]`` files as tensors (zero-copy views of the mappings, on the CPU), nested as the state.

        For shapes and dtypes (``validate_client_output``); a row not written yet reads as zeros here, not as its
        initial value: read values with :meth:`gather`."""
        if self._maps is None:
            self._maps = {k: _map_rows(f.path, f.num_rows, f.shape, f.dtype) for k, f in self._files.items()}
        return unflatten_state(dict(self._maps))

    def gather(self, clients: Tensor) -> dict[str, Any]:
        """Rows of the given clients, ``{name: [C, ...]}`` (copies on the store's device; nesting kept)."""
        index = clients.detach().cpu().long().reshape(-1)
        fresh = None if self.template is None else ~self.written.index_select(0, index)
        out: dict[str, Tensor] = {}
        for name, rowfile in self._files.items():
            rows = rowfile.read(index)
            if fresh is not None and bool(fresh.any()):
                rows[fresh] = self.template[name].to(rows.dtype)  # type: ignore[index]
            out[name] = rows.to(self.device)
        self.rows_gathered += int(index.numel())
        return unflatten_state(out)

    def scatter(self, clients: Tensor, rows: Mapping[str, Any]) -> None:
        """Write the rows of the given clients back into the files (entries must match the store's)."""
        given = flatten_state(rows)
        if set(given) != set(self.entries):
            raise KeyError(f"client state keys changed: stored {sorted(self.entries)}, got {sorted(given)}")
        index = clients.detach().cpu().long().reshape(-1)
        for name, value in given.items():
            self._files[name].write(index, value)
        self.written[index] = True
        self.dirty[index] = True
        self.rows_scattered += int(index.numel())

    def to(self, device: torch.device | str) -> DiskClientStateStore:
        """Gathered rows go to ``device`` (the rows themselves stay in the files)."""
        self.device = torch.device(device)
        return self

    def state_dict(self) -> dict[str, Tensor]:
        """Every row, ``{name: [K, ...]}`` on the CPU: ``K × row bytes`` of memory, for small stores and tests
        (checkpoints hold :meth:`checkpoint_state`)."""
        rows = self.gather(torch.arange(self.num_clients))
        self.rows_gathered -= self.num_clients
        return {k: v.cpu() for k, v in flatten_state(rows).items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Overwrite every row with ``state`` (``{name: [K, ...]}``, the entries of this store)."""
        if set(state) != set(self.entries):
            raise KeyError(f"client state keys changed: stored {sorted(self.entries)}, got {sorted(state)}")
        self.scatter(torch.arange(self.num_clients), unflatten_state(dict(state)))

    def nbytes(self) -> int:
        """Bytes of the whole state (``K × row bytes``), as the in-memory store would hold."""
        return self.num_clients * self.row_bytes()

    # -- what the disk store adds -------------------------------------------------------------
    def row_bytes(self) -> int:
        """Bytes of one client's row, all entries."""
        return sum(_row_bytes(s, dt) for s, dt in self.entries.values())

    def resident_bytes(self) -> int:
        """Process memory the store holds: template rows and the two ``[K]`` bit masks. The mapped pages of the
        working files are page cache (the kernel writes them back and drops them under pressure), and gathered
        rows belong to the caller."""
        template = sum(v.numel() * v.element_size() for v in (self.template or {}).values())
        return template + self.written.numel() + self.dirty.numel()

    def checkpoint_state(self, tag: int) -> dict[str, Any]:
        """Write the rows changed since the last call as a new segment (``tag``: the round) and return the manifest
        a checkpoint holds: entries, template rows, and every segment so far with its SHA-256."""
        dirty = self.dirty.nonzero().flatten()
        if dirty.numel():
            record = write_segment(
                self.segment_directory, tag, dirty,
                lambda name, block: self._files[name].read(block), self.entries, self.owner,
            )
            self.segments.append(record)
            self.dirty.zero_()
        return {
            "format": MANIFEST_FORMAT,
            "num_clients": self.num_clients,
            "entries": {k: {"dtype": str(dt), "shape": list(s)} for k, (s, dt) in self.entries.items()},
            "template": None if self.template is None else {k: v.clone() for k, v in self.template.items()},
            "segments": [dict(s) for s in self.segments],
            "directory": self.root,
        }

    @classmethod
    def restore(cls, manifest: Mapping[str, Any], root: str | os.PathLike[str], rank: int = 0,
                option: str = "model.client_state_dir", num_clients: int | None = None) -> DiskClientStateStore:
        """The store a checkpoint's manifest describes, rebuilt in fresh working files under ``root`` (the current
        run's folder: every later segment is written there) from its template and its segments.

        The manifest is checked first (:func:`~lightning_fedmeta.persistence.disk_manifest.check_manifest`: names,
        counts,
        shapes, dtypes; ``num_clients``, when given, is the run's own number of clients, which the manifest's
        must equal). Segments are looked for in ``<root>/rank-<rank>/segments``, then ``rank-0`` (a shared
        folder), then the same in the folder the manifest was written from, which is only read: a segment found
        there is hard-linked or copied into this store's folder and its SHA-256 checked there. A missing, damaged
        or inconsistent segment raises :class:`~lightning_fedmeta.persistence.checksums.CheckpointDamagedError`."""
        if not is_disk_manifest(manifest):
            raise ValueError("not a disk client state manifest")
        spec = check_manifest(manifest, num_clients)
        store = cls(root, spec.num_clients, spec.entries, spec.template, rank, option)
        try:
            sources = store._segment_sources(spec.directory)
            for i, record in enumerate(spec.segments):
                path = store._adopt_segment(record, sources, f"manifest entry segments[{i}].file")
                store._apply_segment(path, record, *read_segment(path))
                store.segments.append(record)
        except BaseException:
            store.close()
            raise
        return store

    def _segment_sources(self, written: str | None) -> list[str]:
        """The folders a segment is looked for in: this store's own first, then the run that wrote the manifest."""
        roots = [self.root] + ([os.path.abspath(written)] if written else [])
        return list(dict.fromkeys(os.path.join(r, sub, "segments") for r in roots
                                  for sub in (f"rank-{self.rank}", "rank-0")))

    def _adopt_segment(self, record: Mapping[str, Any], sources: list[str], where: str) -> str:
        """The path, in this store's own folder, of the segment ``record`` names, its SHA-256 checked (copied or
        linked there from the first other folder that has it)."""
        for directory in sources:
            found = segment_path(directory, record["file"], where)
            if found is not None and directory == self.segment_directory:
                _verify(found, record["sha256"])
                return found
            if found is not None:
                break
        else:
            raise CheckpointDamagedError(
                f"the client state segment {record['file']} that this checkpoint references is missing: looked for "
                f"in {', '.join(sources)}; the checkpoint's client state cannot be rebuilt (model.client_state_dir, or "
                "the folder the checkpoint was written from, must hold the run's rank-<r>/segments files)"
            )
        return _copy_segment(found, self.segment_directory, record["sha256"], self.owner)

    def _apply_segment(self, path: str, record: Mapping[str, Any], clients: Tensor,
                       values: Mapping[str, Tensor]) -> None:
        """Write a segment's rows into the working files, after checking it holds the manifest's entries and
        ``record["rows"]`` rows of clients inside ``0..K-1``."""
        got = {k: (tuple(v.shape[1:]), v.dtype) for k, v in values.items()}
        if got != self.entries or clients.numel() != record["rows"]:
            raise CheckpointDamagedError(
                f"the client state segment {path} does not match its checkpoint: it holds {clients.numel()} rows "
                f"of {got}, the manifest {record['rows']} rows of {self.entries}"
            )
        if clients.numel() and not (0 <= int(clients.min()) and int(clients.max()) < self.num_clients):
            refuse(f"the segment {path}", f"holds client indices {int(clients.min())}..{int(clients.max())}, "
                   f"outside the manifest's 0..{self.num_clients - 1}")
        step = max(1, _COPY_ROWS_BYTES // max(1, self.row_bytes()))
        for start in range(0, clients.numel(), step):
            block = clients[start:start + step]
            for name, rowfile in self._files.items():
                rowfile.write(block, values[name][start:start + step])
            self.written[block] = True

    def close(self) -> None:
        """Remove the working files (segments stay: checkpoints reference them)."""
        self._files, self._maps = {}, None
        self._finalizer()


def describe(store: Any) -> str:
    """One line about a store, for the log."""
    total = store.nbytes() / 2**30
    if isinstance(store, DiskClientStateStore):
        return f"client state on disk ({total:.2f} GiB in {store.directory})"
    return f"client state in memory ({total:.2f} GiB)"


def gathered_bytes(rows: Mapping[str, Any]) -> int:
    """Bytes of gathered rows (``{name: [C, ...]}``)."""
    return sum(v.numel() * v.element_size() for v in flatten_state(rows).values())
