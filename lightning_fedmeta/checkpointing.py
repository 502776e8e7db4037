"""Crash safety of checkpoints: a checksum of the federated state, atomic writes, and resume-settings checks.

* **Checksum.** :func:`seal_checkpoint` (called last in ``FederatedModule.on_save_checkpoint``, itself the last
  step of Lightning's ``dump_checkpoint``) stores ``checkpoint["fedmeta_checksum"]``: one SHA-256 digest per
  top-level entry of the checkpoint (``state_dict``, ``optimizer_states``, ``lr_schedulers``, ``global_step``,
  ``loops``, ``callbacks``, ``hyper_parameters``, ``fedmeta``, ...; all but ``pytorch-lightning_version``, which
  Lightning rewrites when it migrates a file). A digest is a deterministic walk over the nested structure: dict
  keys in sorted order, every scalar by type and exact ``repr``, every tensor by dtype, shape and its bytes
  (:func:`checkpoint_digests`). :func:`verify_checkpoint` recomputes them on load; a mismatch, a file torch cannot
  read that is not an intact zip archive (truncated, overwritten, random bytes: :func:`diagnose_file`) or a record
  failing its CRC all raise :class:`CheckpointDamagedError` with one message, ``checkpoint PATH is damaged (...)``.
  Every read is ``torch.load(weights_only=True)``, URLs included; ``weights_only=False`` is refused
  (:func:`refuse_unsafe_load`, docs/security.md).
  A checkpoint without a checksum (written before it existed) loads with a
  :class:`CheckpointWithoutChecksumWarning`.
* **Atomic writes.** :class:`AtomicCheckpointIO` writes a checkpoint to a temporary file in the target's folder,
  flushes and ``fsync``-s it, ``os.replace``-s it over the target and ``fsync``-s the folder, so a crash at any
  point leaves either the previous file or the new one, both complete. ``FederatedModule.setup`` installs it when
  the Trainer's strategy uses Lightning's plain ``TorchCheckpointIO`` (:func:`install_atomic_checkpoint_io`).
* **Resume settings.** :func:`check_resume_settings` compares a checkpoint's hyper-parameters (the module's, the
  algorithm's and the datamodule's) with the module it is loaded into: every setting must match, except those
  on the allow-lists :data:`CHANGEABLE_MODEL_SETTINGS`, :data:`CHANGEABLE_DATA_SETTINGS` (and, for evaluation
  only, :data:`EVALUATION_ONLY_SETTINGS`); trainer settings (:data:`REPORTED_TRAINER_SETTINGS`) always come from
  the new run and are reported when they changed.

The file format is described in docs/api/checkpoint.md; the guarantees in docs/reliability.md ("Crashes and
checkpoints").
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import hashlib
import inspect
import io
import os
import pickle
import re
import warnings
import zipfile
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from torch import Tensor

from lightning_fedmeta.atomic_io import PARTIAL_SUFFIX, atomic_write, writer_gone

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_fedmeta.data.federated import FederatedData

__all__ = [
    "ResumeCandidate",
    "CHANGEABLE_DATA_SETTINGS",
    "CHANGEABLE_MODEL_SETTINGS",
    "CHECKSUM_KEY",
    "CHECKSUM_SCHEME",
    "CODE_OR_PATH_SETTINGS",
    "canonical_setting",
    "canonical_settings",
    "EVALUATION_ONLY_SETTINGS",
    "NOT_CHECKSUMMED",
    "REPORTED_TRAINER_SETTINGS",
    "RUN_RECORD_KEYS",
    "VERIFIED_MARK",
    "AtomicCheckpointIO",
    "CheckpointDamagedError",
    "CheckpointSettingsError",
    "CheckpointWithoutChecksumWarning",
    "SettingDifference",
    "UnsafeCheckpointLoadError",
    "atomic_save",
    "check_resume_settings",
    "checkpoint_digests",
    "code_or_path_settings",
    "code_or_path_message",
    "compare_algorithms",
    "compare_settings",
    "damaged_message",
    "describe_algorithm",
    "describe_server_optimizer",
    "diagnose_file",
    "fedmeta_run_record",
    "incomplete_record_message",
    "install_atomic_checkpoint_io",
    "load_checkpoint_file",
    "load_module_checkpoint",
    "loading_path",
    "plain_value",
    "refuse_unsafe_load",
    "remove_stale_partials",
    "run_settings",
    "seal_checkpoint",
    "settings_message",
    "signature_defaults",
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

#: module settings that may differ on resume, each with the reason: they change how the rounds are executed,
#: not what they compute (results agree to rounding; bit for bit only when unchanged)
CHANGEABLE_MODEL_SETTINGS: dict[str, str] = {
    "client_batching": "how clients are executed (vmap or loop)",
    "client_chunk_size": "how many clients one vmap call runs",
    "compile_clients": "whether the client steps are compiled",
    "step_schedule": "which clients run their local epochs together",
    "cuda_graphs": "whether the client steps are replayed from CUDA graphs",
    "client_state": "where the client state rows are kept (memory or disk; the same values)",
    "client_state_dir": "the folder of the disk-backed client state",
}
#: datamodule settings that may differ on resume
CHANGEABLE_DATA_SETTINGS: dict[str, str] = {
    "root": "where the data files are",
    "download": "whether missing files are fetched",
    "eval_every": "the evaluation schedule (training is the same)",
    "eval_clients": "which clients the validations score (training is the same)",
}
#: settings that may differ when a checkpoint is only evaluated (validate, test, load_from_checkpoint)
EVALUATION_ONLY_SETTINGS: dict[str, str] = {
    "metrics": "the metrics reported",
    "algorithm.finetune_steps": "the evaluation-time adaptation",
    "algorithm.finetune_lr": "the evaluation-time adaptation",
    "algorithm.finetune_batch_size": "the evaluation-time adaptation",
}
#: settings that name code or a file-system path: never taken from a checkpoint (anyone can write one and re-seal
#: it), only from the user (command line, config file, keyword arguments); :func:`code_or_path_settings`
CODE_OR_PATH_SETTINGS: dict[str, str] = {
    "model.model": "a model class",
    "model.server_optimizer": "an optimizer class",
    "model.server_lr_scheduler": "a learning-rate scheduler class",
    "model.loss": "a loss function to import (the built-in names are plain values)",
    "model.client_state_dir": "a folder",
    "model.algorithm.similarity": "a file to read (mtl_pairwise)",
    "data.root": "a folder to read data files from",
    "data.dataset": "a dataset class (the built-in names are plain values)",
}
#: trainer settings recorded in ``checkpoint["fedmeta"]["record"]["trainer"]``: a resumed run uses its own and says so
REPORTED_TRAINER_SETTINGS: tuple[str, ...] = ("max_steps", "precision", "accelerator", "world_size")

#: the run record :func:`fedmeta_run_record` writes into ``checkpoint["fedmeta"]`` for the resume checks. Every
#: checkpoint with a checksum has all of them (the two came in the same release): one that lacks any is refused by
#: :func:`check_resume_settings`, naming it (without ``server_optimizer`` another optimizer would go unnoticed and
#: fail late in Lightning's optimizer restore, or run with the checkpoint's learning rate)
RUN_RECORD_KEYS: tuple[str, ...] = ("algorithm", "datamodule_class", "server_optimizer", "trainer")

#: module arguments compared by other means than their hyper-parameter value
_COMPARED_ELSEWHERE = {
    "algorithm": "class and hyper-parameters of the built algorithm (compare_algorithms)",
    "loss": "the resolved loss name (FederatedModule.on_load_checkpoint)",
}

_CHUNK_BYTES = 8 * 2**20  # tensors are hashed in chunks of this size (a tree hash, so chunks can run in parallel)
_PARALLEL_BYTES = 32 * 2**20  # states at least this large are hashed by a thread pool


class CheckpointDamagedError(ValueError):
    """A checkpoint file that cannot be trusted: unreadable, truncated, or its contents differ from its checksum."""


class CheckpointSettingsError(ValueError):
    """A checkpoint loaded with settings other than those it was written with."""


class UnsafeCheckpointLoadError(ValueError):
    """A checkpoint refused because reading it could run code: ``weights_only=False`` was asked for, or the file
    holds objects ``torch.load(weights_only=True)`` does not load."""


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


def refuse_unsafe_load(weights_only: bool | None, path: Any = None) -> None:
    """Refuse ``weights_only=False``: every checkpoint is read with ``torch.load(weights_only=True)``.

    Unpickling with ``weights_only=False`` runs whatever code the file names (a ``__reduce__`` calling
    ``os.system``), so whoever wrote or serves the file, or a URL's host, would run code here. A checkpoint of
    :class:`~lightning_fedmeta.FederatedModule` holds plain values only and never needs it.

    Raises:
        UnsafeCheckpointLoadError: ``weights_only`` is ``False``.
    """
    if weights_only is False:
        where = f" {os.fspath(path)}" if isinstance(path, str | os.PathLike) else ""
        raise UnsafeCheckpointLoadError(
            f"refused to load checkpoint{where} with weights_only=False: unpickling it could run code the file "
            "names. lightning_fedmeta reads every checkpoint with torch.load(weights_only=True), which its own "
            "checkpoints need; leave weights_only unset (or True). For a file you wrote and trust that holds other "
            "objects, torch.load it yourself and pass the parts (e.g. model=...) as arguments"
        )


def _torch_load_weights_only(path: Any, map_location: Any) -> Any:
    """``torch.load(..., weights_only=True)`` of a local path, an fsspec URL (``s3://``, ``http://``, ``file://``,
    read into memory; Lightning would send ``http`` to ``torch.hub`` with ``weights_only=False`` and a cache
    keyed by file name alone) or a file object."""
    if not isinstance(path, str | os.PathLike):
        return torch.load(path, map_location=map_location, weights_only=True)
    with get_filesystem(path).open(os.fspath(path), "rb") as fh:
        source = fh if _is_local(path) else io.BytesIO(fh.read())
        return torch.load(source, map_location=map_location, weights_only=True)


def load_checkpoint_file(path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
    """``torch.load`` a checkpoint with ``weights_only=True`` (local or remote: :func:`refuse_unsafe_load`),
    turning a failure on a damaged file into :class:`CheckpointDamagedError` (see :func:`diagnose_file`). The
    checksum is not verified here.

    Raises:
        UnsafeCheckpointLoadError: ``weights_only=False`` was asked for.
    """
    refuse_unsafe_load(weights_only, path)
    return _read_or_refuse(lambda: _torch_load_weights_only(path, map_location), path)


def _refused_objects_message(path: Any, exc: Exception) -> str:
    """The refusal of an intact file that holds objects ``torch.load(weights_only=True)`` does not load (torch's
    own message goes on to suggest ``weights_only=False``, which would run them)."""
    where = f"checkpoint {os.fspath(path)}" if isinstance(path, str | os.PathLike) else "the checkpoint being loaded"
    lines = [ln.strip() for ln in str(exc).splitlines()]
    found = next((ln for ln in lines if "GLOBAL" in ln or "WeightsUnpickler error" in ln), "")
    found = found or "refused by the weights-only unpickler"
    return (
        f"{where} holds objects other than tensors and plain values ({found})"
        "; it is not loaded, since unpickling them could run code. Checkpoints of lightning_fedmeta hold plain "
        "values only: use one FederatedModule wrote"
    )


def _read_or_refuse(read: Any, path: Any) -> dict[str, Any]:
    """``read()``, with a failure on a damaged file turned into :class:`CheckpointDamagedError` naming ``path``."""
    try:
        return read()
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised unless the file is shown to be damaged
        detail = diagnose_file(path)
        if detail is None and isinstance(exc, pickle.UnpicklingError):
            raise UnsafeCheckpointLoadError(_refused_objects_message(path, exc)) from None  # not chained: see below
        if detail is None:
            raise
        # not chained: torch's message about a damaged file would suggest weights_only=False, which is unsafe
        raise CheckpointDamagedError(damaged_message(path, f"{detail}; torch.load: {type(exc).__name__}")) from None


# ----------------------------------------------------------------------------------------------
# atomic writes
# ----------------------------------------------------------------------------------------------
_serialize: Callable[[Any, Any], None] = torch.save  # indirection for tests that interrupt a write


#: the temporary file of an interrupted atomic write: ``.<name>.<pid>.<random>.partial`` (lightning_fedmeta.atomic_io)
_PARTIAL_NAME = re.compile(rf"^\..+\.(\d+)\.[0-9a-f]+{re.escape(PARTIAL_SUFFIX)}$")


def remove_stale_partials(directory: str | os.PathLike[str]) -> list[str]:
    """Remove the temporary files that interrupted saves left in ``directory``, whatever checkpoint they were
    writing (a killed save of ``epoch=0-step=2.ckpt`` is never retried under that name), when their writer is
    proven gone: the exclusive lock every writer holds on its file until the rename
    (:func:`~lightning_fedmeta.atomic_io.hold_writer_lock`) can be taken. Not by process id: a run in another PID
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
    (:func:`lightning_fedmeta.atomic_io.atomic_write`). On any error the temporary file is removed and ``path`` is
    untouched; temporary files of a killed writer are removed by the next save into the folder
    (:func:`remove_stale_partials`).
    """
    target = os.path.abspath(os.fspath(path))
    remove_stale_partials(os.path.dirname(target))
    atomic_write(target, lambda fh: _serialize(obj, fh))


def _is_local(path: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(get_filesystem(path), LocalFileSystem)


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


def load_module_checkpoint(
    cls: type,
    checkpoint_path: Any,
    map_location: Any = None,
    hparams_file: Any = None,
    strict: bool | None = None,
    weights_only: bool | None = None,
    **kwargs: Any,
) -> Any:
    """``LightningModule.load_from_checkpoint`` (Lightning 2.x) with a damaged file named, the checksum verified
    on the raw file, and the hyper-parameters left as saved, so ``on_load_checkpoint`` compares the module built
    with ``kwargs`` against the checkpoint's settings (Lightning would overwrite them with ``kwargs`` first)."""
    from lightning.pytorch.core.saving import (
        _default_map_location,
        _load_state,
        load_hparams_from_tags_csv,
        load_hparams_from_yaml,
    )
    from lightning.pytorch.utilities.migration import pl_legacy_patch
    from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    path = checkpoint_path if isinstance(checkpoint_path, str | os.PathLike) else None
    with pl_legacy_patch():
        checkpoint = load_checkpoint_file(checkpoint_path, map_location or _default_map_location, weights_only)
    if "fedmeta" in checkpoint:
        verify_checkpoint(checkpoint, path)
        checkpoint[VERIFIED_MARK] = True
    checkpoint = _pl_migrate_checkpoint(checkpoint, checkpoint_path=path)
    if hparams_file is not None:
        extension = str(hparams_file).rsplit(".", 1)[-1].lower()
        if extension == "csv":
            checkpoint["hyper_parameters"] = load_hparams_from_tags_csv(hparams_file)
        elif extension in ("yml", "yaml"):
            checkpoint["hyper_parameters"] = load_hparams_from_yaml(hparams_file)
        else:
            raise ValueError(".csv, .yml or .yaml is required for `hparams_file`")
    else:
        _refuse_code_or_paths(cls, checkpoint, kwargs, checkpoint_path)
    checkpoint.setdefault("hyper_parameters", {})
    token = _LOADING_PATH.set(path)
    try:
        model = _load_state(cls, checkpoint, strict=strict, **kwargs)  # kwargs win over the saved values
    finally:
        _LOADING_PATH.reset(token)
    state_dict = checkpoint["state_dict"]
    if not state_dict:
        rank_zero_warn(f"The state dict in {checkpoint_path!r} contains no parameters.")
        return model
    device = next((t for t in state_dict.values() if isinstance(t, Tensor)), torch.tensor(0)).device
    return model.to(device)


def _refuse_code_or_paths(cls: type, checkpoint: Mapping[str, Any], kwargs: Mapping[str, Any], path: Any) -> None:
    """Refuse hyper-parameters ``load_module_checkpoint`` would take from the checkpoint (not in ``kwargs``, other
    than ``cls``'s defaults) that name code or paths (:func:`code_or_path_settings`; ``_class_path`` included:
    Lightning imports it), naming the keyword arguments that give them."""
    saved = checkpoint.get("hyper_parameters") or {}
    if not isinstance(saved, Mapping):
        return
    defaults = signature_defaults(cls)
    taken = {k: v for k, v in saved.items() if k not in kwargs and not str(k).startswith("_")
             and not (k in defaults and plain_value(v) == plain_value(defaults[k]))}
    refused = code_or_path_settings("model", taken)
    if saved.get("_class_path") is not None:
        refused.append(f"_class_path={saved['_class_path']!r}")
    if refused:
        names = sorted({r.split("=", 1)[0].split(".")[1] for r in refused if r.startswith("model.")})
        how = ", ".join(f"{n}=..." for n in names) or "..."
        raise CheckpointSettingsError(code_or_path_message(
            path if isinstance(path, str | os.PathLike) else None, refused,
            f"If you trust them, pass them yourself: {cls.__name__}.load_from_checkpoint(path, {how})"))


# ----------------------------------------------------------------------------------------------
# resume settings
# ----------------------------------------------------------------------------------------------
#: the file ``load_module_checkpoint`` is reading (for messages of ``on_load_checkpoint``, which gets a dict)
_LOADING_PATH: contextvars.ContextVar[Any] = contextvars.ContextVar("fedmeta_loading_path", default=None)


def loading_path(trainer: Trainer | None) -> Any:
    """The file a checkpoint being loaded comes from: ``trainer.ckpt_path``, else the file
    :func:`load_module_checkpoint` is reading (``None`` when not known)."""
    if trainer is not None and getattr(trainer, "ckpt_path", None):
        return trainer.ckpt_path
    return _LOADING_PATH.get()


@dataclass(frozen=True)
class SettingDifference:
    """One setting whose value in a checkpoint differs from the run that loads it."""

    name: str  # e.g. "model.seed", "data.num_clients", "model.algorithm.local_lr"
    saved: Any
    given: Any
    changeable: bool
    reason: str = ""

    def describe(self) -> str:
        return f"{self.name}: checkpoint {self.saved!r}, given {self.given!r}"


def plain_value(value: Any) -> Any:
    """A comparable form: mappings and namespaces as dicts, sequences as lists, other objects by type."""
    if hasattr(value, "as_dict") and callable(value.as_dict) and type(value).__name__ == "Namespace":
        value = value.as_dict()
    elif type(value).__name__ == "Namespace" and hasattr(value, "__dict__"):
        value = vars(value)
    if isinstance(value, Mapping):
        return {str(k): plain_value(v) for k, v in value.items() if not str(k).startswith("__")}
    if isinstance(value, list | tuple):
        return [plain_value(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return f"<{_qualname(value)}>"


def describe_algorithm(spec: Any) -> dict[str, Any] | None:
    """``{"class": import path, "name": registry name, "hparams": Algorithm.hparams()}`` of an algorithm
    instance, name or ``{name: ..., <hyper-parameters>}`` mapping (built to fill in the defaults, so
    ``"scaffold"`` and ``{"name": "scaffold", "local_steps": 10}`` describe the same algorithm);
    ``None`` when the spec cannot be built."""
    from lightning_fedmeta.algorithms.base import Algorithm

    algorithm = spec
    if not isinstance(spec, Algorithm):
        plain = plain_value(spec)
        if isinstance(plain, str):
            name, args = plain, {}
        elif isinstance(plain, dict) and isinstance(plain.get("name"), str):
            args = dict(plain)
            name = args.pop("name")
        else:
            return None
        from lightning_fedmeta.registry import create_algorithm

        try:
            algorithm = create_algorithm(name, **args)
        except Exception:  # noqa: BLE001 - an invalid spec is reported by the constructor, not here
            return None
    cls = type(algorithm)
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "name": cls.name or cls.__name__,
        "hparams": {k: plain_value(v) for k, v in algorithm.hparams().items()},
    }


def compare_algorithms(
    saved: Mapping[str, Any], given: Mapping[str, Any], changeable: Mapping[str, str], prefix: str = "model.algorithm"
) -> list[SettingDifference]:
    """Differences of two :func:`describe_algorithm` descriptions: another class, or a hyper-parameter both
    have with another value (``changeable`` keys: ``"algorithm.<name>"``)."""
    if saved.get("class") != given.get("class"):
        return [SettingDifference(f"{prefix}.name", saved.get("name"), given.get("name"), False)]
    out = []
    saved_hp, given_hp = saved.get("hparams") or {}, given.get("hparams") or {}
    for key in sorted(set(saved_hp) & set(given_hp)):
        if plain_value(saved_hp[key]) != plain_value(given_hp[key]):
            reason = changeable.get(f"algorithm.{key}", "")
            out.append(SettingDifference(f"{prefix}.{key}", saved_hp[key], given_hp[key], bool(reason), reason))
    return out


def compare_settings(
    prefix: str,
    saved: Mapping[str, Any],
    given: Mapping[str, Any],
    changeable: Mapping[str, str],
    defaults: Mapping[str, Any] | None = None,
    skip: Iterable[str] = (),
) -> list[SettingDifference]:
    """Every key of ``given`` whose value differs from ``saved`` (a key the checkpoint lacks counts as its
    default in ``defaults``, the signature's: the option did not exist, so the run had its default), except
    private (``_``) keys and ``skip``. Keys only in ``saved`` are not compared (``given`` leaves them out, e.g.
    an argument that was an object). A key in ``changeable`` is marked changeable, with the reason. The
    settings a plugin's options live in are compared in their canonical form (:func:`canonical_setting`: the
    plugin's defaults filled in); a difference reports the values as written."""
    skipped = set(skip)
    out = []
    for key in sorted(given):
        if key.startswith("_") or key in skipped:
            continue
        if key in saved:
            before = saved[key]
        elif defaults is not None and key in defaults:
            before = defaults[key]
        else:
            continue
        saved_side = {**(defaults or {}), **saved}
        a = canonical_setting(prefix, key, before, saved_side)
        b = canonical_setting(prefix, key, given[key], {**saved_side, **given})
        if plain_value(a) != plain_value(b):
            reason = changeable.get(key, "")
            out.append(SettingDifference(f"{prefix}.{key}", before, given[key], bool(reason), reason))
    return out


def canonical_setting(prefix: str, key: str, value: Any, settings: Mapping[str, Any]) -> Any:
    """``value`` of setting ``prefix.key`` in the form its meaning is compared in, generically (no option of a
    plugin is listed here): ``model.aggregator`` as the rule's full option mapping
    (:func:`~lightning_fedmeta.robust.canonical_aggregator`), ``data.dataset_options`` / ``data.partition_options``
    with the signature defaults of the dataset / partitioner named in ``settings`` filled in
    (:func:`~lightning_fedmeta.data.plugins.canonical_options`); any other value as it is."""
    if prefix == "model" and key == "aggregator":
        from lightning_fedmeta.robust import canonical_aggregator

        return canonical_aggregator(value)
    if prefix == "data" and key in ("dataset_options", "partition_options"):
        from lightning_fedmeta.data.plugins import canonical_options

        kind = "dataset" if key == "dataset_options" else "partition"
        return canonical_options(kind, settings.get(kind), value)
    return value


def canonical_settings(prefix: str, settings: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Every setting of ``settings`` (a key it lacks read as its default in ``defaults``) in its canonical form
    (:func:`canonical_setting`)."""
    merged = {**defaults, **settings}
    return {k: canonical_setting(prefix, k, v, merged) for k, v in merged.items()}


def signature_defaults(cls: type) -> dict[str, Any]:
    """The defaults of ``cls.__init__``'s parameters."""
    try:
        params = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    except (TypeError, ValueError):
        return {}
    return {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}


def settings_message(path: Any, refused: list[SettingDifference], evaluating: bool = False) -> str:
    """The refusal: every setting that differs, checkpoint value against given value, and the allow-list."""
    where = f"checkpoint {os.fspath(path)}" if isinstance(path, str | os.PathLike) else "this checkpoint"
    lines = "\n".join(f"  {d.describe()}" for d in refused)
    allowed = [f"model.{k}" for k in CHANGEABLE_MODEL_SETTINGS] + [f"data.{k}" for k in CHANGEABLE_DATA_SETTINGS]
    if evaluating:
        allowed += [f"model.{k}" for k in EVALUATION_ONLY_SETTINGS]
    action = "evaluating" if evaluating else "resuming"
    return (
        f"{where} was written with other settings than this run's; {action} it would mix two experiments:\n{lines}\n"
        f"Use the checkpoint's values (the configuration of the run that wrote it), or start a new run without "
        f"the checkpoint. Settings that may change: {', '.join(allowed)} and the trainer's"
    )


def _names_a_class(value: Any) -> bool:
    """Whether ``value`` holds a ``class_path`` (jsonargparse imports and builds the class it names) anywhere."""
    value = plain_value(value)
    if isinstance(value, dict):
        return "class_path" in value or any(_names_a_class(v) for v in value.values())
    return isinstance(value, list) and any(_names_a_class(v) for v in value)


def _code_or_path(name: str, value: Any) -> bool:
    """Whether ``value`` of setting ``name`` (``model.loss``, ...) names code or a file-system path."""
    from lightning_fedmeta.losses import LOSSES

    if _names_a_class(value):
        return True
    if value is None or name not in CODE_OR_PATH_SETTINGS:
        return False
    if name == "model.loss" or name == "data.dataset":
        return not (isinstance(value, str) and (name == "data.dataset" or value in LOSSES))
    return True


def code_or_path_settings(prefix: str, taken: Mapping[str, Any]) -> list[str]:
    """The settings among ``taken`` (``{key: value}`` about to be taken from a checkpoint, ``prefix`` ``"model"``
    or ``"data"``) that name code or a file-system path (:data:`CODE_OR_PATH_SETTINGS`, or any ``class_path``),
    as ``"model.loss='pkg.mod.fn'"``; an algorithm's hyper-parameters are looked at one by one."""
    out = []
    for key in sorted(taken, key=str):
        value = plain_value(taken[key])
        if key == "algorithm" and isinstance(value, dict) and not _names_a_class(value):
            out += [f"{prefix}.algorithm.{k}={v!r}" for k, v in sorted(value.items())
                    if _code_or_path(f"{prefix}.algorithm.{k}", v)]
        elif _code_or_path(f"{prefix}.{key}", value):
            out.append(f"{prefix}.{key}={value!r}")
    return out


def code_or_path_message(path: Any, refused: list[str], how: str) -> str:
    """The refusal of checkpoint settings that name code or paths the user did not give; ``how`` says how to give
    them (the command-line flags, or the keyword arguments)."""
    where = f"checkpoint {os.fspath(path)}" if isinstance(path, str | os.PathLike) else "the checkpoint"
    return (
        f"{where} names code or file-system paths for settings this run did not give: {', '.join(refused)}. "
        "Settings taken from a checkpoint must be plain values (anyone who can write the file, or re-seal it, "
        f"chooses them), so these are not used. {how}"
    )


def incomplete_record_message(path: Any, missing: list[str]) -> str:
    """The refusal of a checksummed checkpoint whose run record lacks the entries ``missing``."""
    where = f"checkpoint {os.fspath(path)}" if isinstance(path, str | os.PathLike) else "this checkpoint"
    names = ", ".join(repr(k) for k in missing)
    return (
        f"{where} has no record of {names} in checkpoint['fedmeta']['record'] (every checkpoint FederatedModule "
        f"writes with a checksum records {', '.join(repr(k) for k in RUN_RECORD_KEYS)}): the settings it was "
        "written with cannot be compared with this run's, so it is not used. Resume from a checkpoint "
        "FederatedModule wrote, or start a new run without it"
    )


def run_settings(trainer: Any) -> dict[str, Any]:
    """The trainer settings recorded in a checkpoint (:data:`REPORTED_TRAINER_SETTINGS`)."""
    if trainer is None:
        return {}
    return {
        "max_steps": trainer.max_steps,
        "precision": str(getattr(trainer, "precision", None)),
        "accelerator": type(trainer.accelerator).__name__,
        "world_size": int(trainer.world_size),
    }


@dataclass(frozen=True)
class ResumeCandidate:
    """What the resume checks compare a checkpoint with: the module that loads it, as plain values.

    ``hparams`` are the module's saved hyper-parameters, ``module_class`` its class (whose signature gives the
    defaults), ``data_spec`` the bound data's spec (``None``: none bound), ``configure_optimizers`` builds a
    throwaway server optimizer to compare with the saved one."""

    module_class: type
    hparams: Mapping[str, Any]
    algorithm: Any
    trainer: Trainer | None
    data: FederatedData | None
    data_spec: Mapping[str, Any] | None
    configure_optimizers: Callable[[], Any]


def _saved_clients(engine: Mapping[str, Any]) -> int | None:
    """The number of clients a checkpoint's engine part describes (rows of its client state, or ``seen``)."""
    for value in (engine.get("client_state") or {}).values():
        if isinstance(value, Tensor) and value.dim() > 0:
            return int(value.shape[0])
    seen = (engine.get("federation") or {}).get("seen")
    return int(seen.numel()) if isinstance(seen, Tensor) else None


def check_resume_settings(candidate: ResumeCandidate, checkpoint: Mapping[str, Any],
                          path: Any = None) -> list[SettingDifference]:
    """Compare ``checkpoint``'s settings (its ``fedmeta`` entry in the per-part layout,
    :mod:`~lightning_fedmeta.frontends.checkpoint_layout`) with the loading module and its Trainer's datamodule.

    Every hyper-parameter must match (a key the checkpoint lacks counts as the signature's default) except
    those of :data:`CHANGEABLE_MODEL_SETTINGS` / :data:`CHANGEABLE_DATA_SETTINGS` (and, unless the Trainer is
    fitting, :data:`EVALUATION_ONLY_SETTINGS`); the algorithm is compared by class and hyper-parameters; the
    data must have the checkpoint's number of clients and shapes. Returns the allowed differences (the
    changeable settings and, when fitting, the trainer's :data:`REPORTED_TRAINER_SETTINGS`).

    Raises:
        CheckpointSettingsError: naming every setting that differs, checkpoint value against given value; or
            naming every entry of :data:`RUN_RECORD_KEYS` a checkpoint with a checksum lacks (its settings could
            not be compared). A checkpoint without a checksum predates the record: what it has is compared.
    """
    trainer = candidate.trainer
    fitting = trainer is not None and getattr(trainer.state, "fn", None) == "fit"
    model_allowed = dict(CHANGEABLE_MODEL_SETTINGS)
    if not fitting:
        model_allowed.update(EVALUATION_ONLY_SETTINGS)
    fedmeta = checkpoint.get("fedmeta") or {}
    saved, engine, run = (fedmeta.get(part) or {} for part in ("record", "engine", "run"))
    missing = [key for key in RUN_RECORD_KEYS if key not in saved] if CHECKSUM_KEY in checkpoint else []
    if missing:
        raise CheckpointSettingsError(incomplete_record_message(path, missing))
    saved_hp = dict(checkpoint.get("hyper_parameters") or {})
    diffs = compare_settings(
        "model", saved_hp, dict(candidate.hparams), model_allowed, signature_defaults(candidate.module_class),
        _COMPARED_ELSEWHERE
    )
    saved_algorithm = saved.get("algorithm") or describe_algorithm(saved_hp.get("algorithm"))
    given_algorithm = describe_algorithm(candidate.algorithm)
    if saved_algorithm is not None and given_algorithm is not None:
        diffs += compare_algorithms(saved_algorithm, given_algorithm, model_allowed)
    datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
    saved_dm = checkpoint.get("datamodule_hyper_parameters")
    same_class = saved.get("datamodule_class") in (None, _class_path(datamodule))
    if datamodule is not None and saved_dm is not None and same_class and getattr(datamodule, "hparams", None):
        diffs += compare_settings(
            "data", saved_dm, dict(datamodule.hparams), CHANGEABLE_DATA_SETTINGS, signature_defaults(type(datamodule))
        )
    data = candidate.data
    rows = _saved_clients(engine)
    if data is not None and rows is not None and rows != data.num_clients:
        diffs.append(SettingDifference("number of clients in the data", rows, int(data.num_clients), False))
    saved_spec, spec = run.get("data_spec"), candidate.data_spec
    if data is not None and saved_spec and spec:
        for key in ("input_shape", "num_classes", "task", "target_shape"):
            if key in saved_spec and key in spec and plain_value(saved_spec[key]) != plain_value(spec[key]):
                diffs.append(SettingDifference(f"data: {key}", saved_spec[key], spec[key], False))
    if fitting and saved.get("server_optimizer"):
        given_optimizer = _configured_optimizer(candidate.configure_optimizers)
        if given_optimizer is not None:
            diffs += _compare_optimizers(saved["server_optimizer"], given_optimizer)
    refused = [d for d in diffs if not d.changeable]
    if refused:
        raise CheckpointSettingsError(settings_message(path, refused, evaluating=not fitting))
    allowed = [d for d in diffs if d.changeable]
    if fitting:
        before, now = saved.get("trainer") or {}, run_settings(trainer)
        for key in REPORTED_TRAINER_SETTINGS:
            if key in before and key in now and plain_value(before[key]) != plain_value(now[key]):
                allowed.append(SettingDifference(f"trainer.{key}", before[key], now[key], True, "a trainer setting"))
    return allowed


def _class_path(obj: Any) -> str | None:
    return None if obj is None else _qualname(obj)


def describe_server_optimizer(optimizer: Any, scheduler: Any = None) -> dict[str, Any] | None:
    """``{"class": ..., "defaults": its constructor's hyper-parameters, "scheduler": class or None}`` of a
    server optimizer. Lightning restores the optimizer's state, learning rates included, from a checkpoint: a
    resumed run with other optimizer arguments would silently keep the old ones, another class would fail late."""
    if optimizer is None or not hasattr(optimizer, "defaults"):
        return None
    return {
        "class": _qualname(optimizer),
        "defaults": {str(k): plain_value(v) for k, v in dict(optimizer.defaults).items()},
        "scheduler": _class_path(scheduler),
    }


def _configured_optimizer(configure_optimizers: Callable[[], Any]) -> dict[str, Any] | None:
    """The description of the server optimizer ``configure_optimizers()`` builds (a throwaway one)."""
    try:
        config = configure_optimizers()
    except Exception:  # noqa: BLE001 - no model yet, or an optimizer that needs the Trainer: not compared
        return None
    scheduler = None
    if isinstance(config, list | tuple) and config:
        config = config[0]
    if isinstance(config, Mapping):
        scheduler = config.get("lr_scheduler")
        scheduler = scheduler.get("scheduler") if isinstance(scheduler, Mapping) else scheduler
        config = config.get("optimizer")
    return describe_server_optimizer(config, scheduler)


def _compare_optimizers(saved: Mapping[str, Any], given: Mapping[str, Any]) -> list[SettingDifference]:
    if saved.get("class") != given.get("class"):
        return [SettingDifference("model.server_optimizer", saved.get("class"), given.get("class"), False)]
    out = []
    before, now = saved.get("defaults") or {}, given.get("defaults") or {}
    for key in sorted(set(before) & set(now)):
        if plain_value(before[key]) != plain_value(now[key]):
            out.append(SettingDifference(f"model.server_optimizer.{key}", before[key], now[key], False))
    if saved.get("scheduler") != given.get("scheduler"):
        out.append(
            SettingDifference("model.server_lr_scheduler", saved.get("scheduler"), given.get("scheduler"), False)
        )
    return out


def fedmeta_run_record(algorithm: Any, trainer: Trainer | None) -> dict[str, Any]:
    """The ``record`` part ``on_save_checkpoint`` writes into ``checkpoint["fedmeta"]`` for these checks
    (:data:`RUN_RECORD_KEYS`): the algorithm's description, the datamodule's class, the server optimizer's
    description and the trainer settings."""
    datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
    optimizer = None
    if trainer is not None and getattr(trainer, "optimizers", None):
        schedulers = getattr(trainer, "lr_scheduler_configs", None) or []
        optimizer = describe_server_optimizer(trainer.optimizers[0], schedulers[0].scheduler if schedulers else None)
    return {
        "algorithm": describe_algorithm(algorithm),
        "datamodule_class": _class_path(datamodule),
        "server_optimizer": optimizer,
        "trainer": run_settings(trainer),
    }
