"""A checkpoint's checksum: one SHA-256 tree digest per top-level entry, sealed on save, verified on load.

:func:`seal_checkpoint` (called last in ``FederatedModule.on_save_checkpoint``, itself the last step of Lightning's
``dump_checkpoint``) stores ``checkpoint["fedmeta_checksum"]``: one SHA-256 digest per top-level entry of the
checkpoint (``state_dict``, ``optimizer_states``, ``lr_schedulers``, ``global_step``, ``loops``, ``callbacks``,
``hyper_parameters``, ``fedmeta``, ...; all but ``pytorch-lightning_version``, which Lightning rewrites when it
migrates a file). A digest is a deterministic walk over the nested structure: dict keys in sorted order, every
scalar by type and exact ``repr``, every tensor by dtype, shape and its bytes (:func:`checkpoint_digests`).
:func:`verify_checkpoint` recomputes them on load; a mismatch, a file torch cannot read that is not an intact zip
archive (truncated, overwritten, random bytes: :func:`diagnose_file`) or a record failing its CRC all raise
:class:`CheckpointDamagedError` with one message, ``checkpoint PATH is damaged (...)``. A checkpoint without a
checksum (written before it existed) loads with a :class:`CheckpointWithoutChecksumWarning`.

The file format is described in docs/api/checkpoint.md; the guarantees in docs/reliability.md ("Crashes and
checkpoints").
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import os
import warnings
import zipfile
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:

    pass

__all__ = [
    "CHECKSUM_KEY",
    "CHECKSUM_SCHEME",
    "NOT_CHECKSUMMED",
    "VERIFIED_MARK",
    "CheckpointDamagedError",
    "CheckpointWithoutChecksumWarning",
    "checkpoint_digests",
    "damaged_message",
    "diagnose_file",
    "seal_checkpoint",
    "verify_checkpoint",
]


#: where the checksum is stored: ``{"scheme": CHECKSUM_SCHEME, "digests": {top-level key: hex digest}}``
CHECKSUM_KEY = "fedmeta_checksum"


#: the digest function and walk (:func:`checkpoint_digests`); another scheme is refused, never guessed
CHECKSUM_SCHEME = "sha256-tree/v1"


#: top-level entries the checksum leaves out: itself, and the version string Lightning rewrites on migration
NOT_CHECKSUMMED = frozenset({CHECKSUM_KEY, "pytorch-lightning_version"})


#: marks a loaded checkpoint dict already verified (by :class:`AtomicCheckpointIO` or :func:`load_module_checkpoint`,
#: before Lightning's migration or ``hparams_file`` could change it); ``on_load_checkpoint`` pops it
VERIFIED_MARK = "_fedmeta_checksum_verified"


_CHUNK_BYTES = 8 * 2**20  # tensors are hashed in chunks of this size (a tree hash, so chunks can run in parallel)


_PARALLEL_BYTES = 32 * 2**20  # states at least this large are hashed by a thread pool


class CheckpointDamagedError(ValueError):
    """A checkpoint file that cannot be trusted: unreadable, truncated, or its contents differ from its checksum."""


class CheckpointWithoutChecksumWarning(UserWarning):
    """A checkpoint written before checksums existed: loaded without verification."""


# ----------------------------------------------------------------------------------------------
# checksum
# ----------------------------------------------------------------------------------------------
class _Leaf:
    """The bytes of one tensor, hashed in ``_CHUNK_BYTES`` chunks."""

    __slots__ = ("chunks", "owner")

    def __init__(self, data: memoryview, owner: Any) -> None:
        self.owner = owner  # keeps the (possibly copied) tensor alive while its bytes are hashed
        self.chunks = [data[i : i + _CHUNK_BYTES] for i in range(0, data.nbytes, _CHUNK_BYTES)]


def _token(out: list[Any], tag: bytes, text: str | bytes) -> None:
    data = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    out.append(tag + len(data).to_bytes(8, "little") + data)


def _order(key: Any) -> tuple[str, str]:
    return type(key).__name__, str(key)


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _walk_tensor(t: Tensor, out: list[Any]) -> None:
    t = t.detach()
    _token(out, b"T", f"{t.dtype}|{tuple(t.shape)}|{t.layout}|{t.is_quantized}")
    if t.device.type == "meta":
        return
    if t.is_sparse:
        t = t.coalesce()
        _walk_tensor(t.indices(), out)
        _walk_tensor(t.values(), out)
        return
    if t.layout != torch.strided:  # CSR and friends: their dense values
        t = t.to_dense()
    if t.is_quantized:
        with contextlib.suppress(RuntimeError):  # per-tensor quantisation parameters
            _token(out, b"Q", f"{t.q_scale()!r}|{t.q_zero_point()!r}")
        t = t.int_repr()
    t = t.resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
    if t.numel() == 0:
        out.append(_Leaf(memoryview(b""), None))
        return
    raw = t.view(torch.uint8)
    out.append(_Leaf(memoryview(raw.numpy()), raw))


def _walk(obj: Any, out: list[Any]) -> None:
    """Append ``obj``'s tokens (type-tagged, length-prefixed bytes) and tensor leaves to ``out``, in an order
    that depends only on the values (dict keys sorted), so a structure and its ``torch.load``-ed copy agree."""
    if isinstance(obj, Tensor):
        _walk_tensor(obj, out)
    elif obj is None:
        out.append(b"N")
    elif isinstance(obj, bool):
        out.append(b"B1" if obj else b"B0")
    elif isinstance(obj, enum.Enum):
        _token(out, b"E", f"{_qualname(obj)}.{obj.name}")
    elif isinstance(obj, int):
        _token(out, b"I", int.__repr__(obj))
    elif isinstance(obj, float):
        _token(out, b"F", float.__repr__(obj))
    elif isinstance(obj, complex):
        _token(out, b"C", complex.__repr__(obj))
    elif isinstance(obj, str):
        _token(out, b"S", str(obj))
    elif isinstance(obj, bytes | bytearray):
        _token(out, b"Y", bytes(obj))
    elif isinstance(obj, Mapping):
        _token(out, b"D", str(len(obj)))
        for key in sorted(obj, key=_order):
            _walk(key, out)
            _walk(obj[key], out)
    elif isinstance(obj, list | tuple):
        _token(out, b"L" if isinstance(obj, list) else b"U", str(len(obj)))
        for item in obj:
            _walk(item, out)
    elif isinstance(obj, set | frozenset):
        _token(out, b"Z", str(len(obj)))
        for item in sorted(obj, key=_order):
            _walk(item, out)
    elif isinstance(obj, torch.dtype | torch.device | torch.layout | torch.memory_format):
        _token(out, b"O", f"{_qualname(obj)}:{obj}")
    elif type(obj).__module__ == "numpy" and hasattr(obj, "tobytes") and hasattr(obj, "dtype"):
        _token(out, b"A", f"{obj.dtype}|{getattr(obj, 'shape', ())}")
        _token(out, b"Y", obj.tobytes())
    elif hasattr(obj, "__dict__"):  # e.g. a Namespace: its attributes
        _token(out, b"O", _qualname(obj))
        _walk(dict(vars(obj)), out)
    else:  # an object without attributes: its type only (a repr may hold a memory address)
        _token(out, b"O", _qualname(obj))


def _chunk_digests(chunks: list[memoryview]) -> list[bytes]:
    """SHA-256 of every chunk, in order; a thread pool when they are large (hashlib releases the GIL)."""
    total = sum(c.nbytes for c in chunks)
    workers = min(8, os.cpu_count() or 1)
    if total < _PARALLEL_BYTES or workers < 2 or len(chunks) < 2:
        return [hashlib.sha256(c).digest() for c in chunks]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda c: hashlib.sha256(c).digest(), chunks))


def checkpoint_digests(checkpoint: Mapping[str, Any], keys: Iterable[str] | None = None) -> dict[str, str]:
    """One hex digest per top-level entry (default: all but :data:`NOT_CHECKSUMMED` and the private ``_`` ones).

    Each digest is SHA-256 over the entry's walk (:func:`_walk`): every scalar by its type tag and exact
    ``repr``, dict entries in sorted key order, every tensor by dtype, shape, layout and its bytes. A tensor's
    bytes count as the SHA-256 of its ``_CHUNK_BYTES`` chunks' SHA-256 digests, so large states hash in
    parallel; the result does not depend on the number of threads.
    """
    if keys is None:
        keys = [k for k in checkpoint if k not in NOT_CHECKSUMMED and not str(k).startswith("_")]
    walks: dict[str, list[Any]] = {}
    for key in sorted(keys, key=str):
        parts: list[Any] = []
        _walk(checkpoint[key], parts)
        walks[key] = parts
    chunks = [c for parts in walks.values() for p in parts if isinstance(p, _Leaf) for c in p.chunks]
    digests = iter(_chunk_digests(chunks))
    out: dict[str, str] = {}
    for key, parts in walks.items():
        h = hashlib.sha256()
        for part in parts:
            if isinstance(part, _Leaf):
                h.update(b"R" + len(part.chunks).to_bytes(8, "little"))
                for _ in part.chunks:
                    h.update(next(digests))
            else:
                h.update(part)
        out[key] = h.hexdigest()
    return out


def seal_checkpoint(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Store the checksum of every entry of ``checkpoint`` in ``checkpoint[CHECKSUM_KEY]`` (and return it).

    ``FederatedModule.on_save_checkpoint`` calls it last. Call it yourself after editing a checkpoint on
    purpose, or loading will report it as damaged.
    """
    checkpoint.pop(CHECKSUM_KEY, None)
    checkpoint[CHECKSUM_KEY] = {"scheme": CHECKSUM_SCHEME, "digests": checkpoint_digests(checkpoint)}
    return checkpoint


def damaged_message(path: Any, detail: str) -> str:
    """The one message of a damaged checkpoint: it names the file and says it is damaged (``detail``: how)."""
    where = f"checkpoint {os.fspath(path)}" if isinstance(path, str | os.PathLike) else "the checkpoint being loaded"
    return (
        f"{where} is damaged ({detail}); it cannot be used. Resume from another checkpoint (an earlier file "
        "in its folder) or start the run again"
    )


def verify_checkpoint(checkpoint: Mapping[str, Any], path: Any = None) -> bool:
    """Check ``checkpoint`` against its stored checksum: ``True`` when it matches, ``False`` (with a
    :class:`CheckpointWithoutChecksumWarning`) when it has none.

    Raises:
        CheckpointDamagedError: an entry differs from its digest, or a checksummed entry is missing.
        ValueError: a checksum of an unknown scheme (a file written by a newer lightning_fedmeta).
    """
    entry = checkpoint.get(CHECKSUM_KEY)
    if entry is None:
        where = f"checkpoint {os.fspath(path)}" if isinstance(path, str | os.PathLike) else "this checkpoint"
        warnings.warn(
            f"{where} has no checksum (written before lightning_fedmeta checked checkpoints): it is loaded "
            "without verification",
            CheckpointWithoutChecksumWarning,
            stacklevel=2,
        )
        return False
    if not isinstance(entry, Mapping) or not isinstance(entry.get("digests"), Mapping):
        raise CheckpointDamagedError(damaged_message(path, f"its checksum entry {CHECKSUM_KEY!r} is unreadable"))
    if entry.get("scheme") != CHECKSUM_SCHEME:
        where = f"checkpoint {os.fspath(path)}" if isinstance(path, str | os.PathLike) else "this checkpoint"
        raise ValueError(
            f"{where} has a checksum of scheme {entry.get('scheme')!r}, this lightning_fedmeta knows "
            f"{CHECKSUM_SCHEME!r}: it was written by another version; load it with that one"
        )
    expected: Mapping[str, str] = entry["digests"]
    missing = [k for k in expected if k not in checkpoint]
    actual = checkpoint_digests(checkpoint, [k for k in expected if k in checkpoint])
    bad = sorted(missing + [k for k, v in actual.items() if v != expected[k]])
    if bad:
        raise CheckpointDamagedError(
            damaged_message(path, f"its contents differ from the checksum written with it, in {', '.join(bad)}")
        )
    return True


def diagnose_file(path: Any) -> str | None:
    """Why a local file torch could not load is damaged, or ``None`` when it is an intact archive (or cannot be
    judged: not a local file, or torch's legacy non-zip format), so the original error stands.

    A checkpoint written by ``torch.save`` is a zip archive whose records carry CRC-32 checksums: a truncated or
    overwritten file has no readable central directory, and a changed byte in a record fails its CRC.
    """
    if not isinstance(path, str | os.PathLike):
        return None
    p = os.fspath(path)
    if "://" in p or not os.path.isfile(p):
        return None
    try:
        with open(p, "rb") as fh:
            head = fh.read(4)
    except OSError:
        return None
    if not head:
        return "the file is empty"
    if head[:1] == b"\x80":  # a pickle: torch's legacy format, which has no checksums to judge by
        return None
    try:
        with zipfile.ZipFile(p) as archive:
            bad = archive.testzip()
    except Exception:  # noqa: BLE001 - any failure to read the archive means it is not intact
        return "not a complete checkpoint archive: truncated, or overwritten with other data"
    if bad is not None:
        return f"its record {bad} fails its CRC check"
    return None
