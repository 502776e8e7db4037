"""What a disk store's checkpoint manifest and its segment headers may say, checked before any file is read.

A checkpoint is data that whoever writes the file controls (it can be re-sealed with a fresh checksum), and so
are the segment files beside it. Nothing they say is used unchecked (docs/security.md, "The client-state store
and input data"):

* a segment is named only by a plain file name of the form the store writes (``seg-<round>-<sha256[:16]>.fseg``,
  no separator, no ``..``), and the file it names must resolve inside the folder it is looked for in (a symbolic
  link out of the folder is refused before anything is read or hashed);
* counts, shapes and dtypes are integers and dtype names of the kinds the store writes, bounded
  (:data:`MAX_CLIENTS`, :data:`MAX_DIMS`, :data:`MAX_STATE_BYTES`) and consistent with each other, with the
  template rows and with the segment file's size.

A refusal raises :class:`~lightning_fedmeta.persistence.checksums.CheckpointDamagedError` naming the manifest entry
(``segments[2].file``, ``entries['personal/0.weight'].shape``) or the segment and its header field.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import Tensor

from lightning_fedmeta.persistence.checksums import CheckpointDamagedError

__all__ = [
    "MAX_CLIENTS", "MAX_DIMS", "MAX_STATE_BYTES", "Block", "Manifest", "check_count", "check_dtype", "check_manifest",
    "check_segment_header", "check_shape", "refuse", "row_bytes", "segment_path",
]

#: the most clients a manifest may name (row indices are ``int64``; the store keeps two ``[K]`` byte masks)
MAX_CLIENTS = 2**31 - 1
#: the most dimensions of one state entry's row
MAX_DIMS = 16
#: the most bytes of the whole state, ``K × row bytes`` (1 PiB)
MAX_STATE_BYTES = 2**50
_SEGMENT_NAME = re.compile(r"seg-[0-9]{9,18}-(?P<sha>[0-9a-f]{16})\.fseg")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DTYPES = {
    str(dt): dt for dt in (
        torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
        torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
    )
}


def refuse(where: str, what: str) -> NoReturn:
    raise CheckpointDamagedError(
        f"the checkpoint's client state is refused: {where} {what}. The checkpoint or its segment files are "
        "damaged or were not written by lightning_fedmeta's disk store: resume from another checkpoint of the run"
    )


def row_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of one ``shape`` row of ``dtype``."""
    count = 1
    for d in shape:
        count *= d
    return count * torch.empty((), dtype=dtype).element_size()


def check_count(value: Any, where: str, upper: int) -> int:
    """``value`` as an int in ``[0, upper]`` (a bool, a float or a string is refused, naming ``where``)."""
    if not isinstance(value, int) or isinstance(value, bool):
        refuse(where, f"must be an integer, got {value!r}")
    if not 0 <= value <= upper:
        refuse(where, f"is {value}, outside 0..{upper}")
    return int(value)


def check_dtype(name: Any, where: str) -> torch.dtype:
    """The torch dtype named ``name`` (``"torch.float32"``), one of the plain numeric kinds the store writes."""
    if not isinstance(name, str) or name not in _DTYPES:
        refuse(where, f"names the dtype {name!r}, not one of {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


def check_shape(shape: Any, where: str) -> tuple[int, ...]:
    """A row shape: a list of at most :data:`MAX_DIMS` non-negative integers, at most :data:`MAX_STATE_BYTES`."""
    if not isinstance(shape, list | tuple) or len(shape) > MAX_DIMS:
        refuse(where, f"must be a list of at most {MAX_DIMS} sizes, got {shape!r}")
    dims = tuple(check_count(d, f"{where}[{i}]", MAX_STATE_BYTES) for i, d in enumerate(shape))
    if row_bytes(dims, torch.uint8) > MAX_STATE_BYTES:
        refuse(where, f"is {list(dims)}, more than {MAX_STATE_BYTES} elements a row")
    return dims


@dataclass(frozen=True)
class Manifest:
    """A checked manifest: the values :meth:`DiskClientStateStore.restore` may use."""

    num_clients: int
    entries: dict[str, tuple[tuple[int, ...], torch.dtype]]
    template: dict[str, Tensor] | None
    segments: list[dict[str, Any]]
    directory: str | None


def _check_entries(entries: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    if not isinstance(entries, Mapping) or not entries:
        refuse("manifest entry entries", f"must be a non-empty mapping of state entries, got {type(entries).__name__}")
    out = {}
    for name, spec in entries.items():
        where = f"manifest entry entries[{name!r}]"
        if not isinstance(name, str) or not isinstance(spec, Mapping):
            refuse(where, "must map an entry name to {'dtype': ..., 'shape': [...]}")
        out[name] = (check_shape(spec.get("shape"), f"{where}.shape"), check_dtype(spec.get("dtype"), f"{where}.dtype"))
    return out


Entries = dict[str, tuple[tuple[int, ...], torch.dtype]]


def _check_template(template: Any, entries: Entries) -> dict[str, Tensor] | None:
    if template is None:
        return None
    if not isinstance(template, Mapping) or set(template) != set(entries):
        refuse("manifest entry template", f"must hold one row per entry ({sorted(entries)}), got "
                f"{sorted(template) if isinstance(template, Mapping) else type(template).__name__}")
    for name, (shape, dtype) in entries.items():
        row = template[name]
        if not isinstance(row, Tensor) or tuple(row.shape) != shape or row.dtype != dtype:
            got = f"{tuple(row.shape)} {row.dtype}" if isinstance(row, Tensor) else type(row).__name__
            refuse(f"manifest entry template[{name!r}]", f"is {got}, not the entry's {shape} {dtype}")
    return dict(template)


def _check_segment(i: int, record: Any, num_clients: int) -> dict[str, Any]:
    """``segments[i]``: ``{"file", "sha256", "rows"}``, the name of the form the store writes, holding its hash."""
    where = f"manifest entry segments[{i}]"
    if not isinstance(record, Mapping):
        refuse(where, f"must be {{'file', 'sha256', 'rows'}}, got {type(record).__name__}")
    name, sha = record.get("file"), record.get("sha256")
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        refuse(f"{where}.sha256", f"must be 64 lowercase hex digits, got {sha!r}")
    match = _SEGMENT_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        refuse(f"{where}.file", f"= {name!r} is not a segment file name (seg-<round>-<16 hex digits>.fseg, "
                "a plain name in the store's folder)")
    if match["sha"] != sha[:16]:
        refuse(f"{where}.file", f"= {name!r} does not carry the first 16 digits of its sha256 {sha}")
    rows = check_count(record.get("rows"), f"{where}.rows", num_clients)
    return {"file": name, "sha256": sha, "rows": rows}


def check_manifest(manifest: Mapping[str, Any], expected_clients: int | None = None) -> Manifest:
    """Every field of a disk store's manifest checked (module docstring); :class:`CheckpointDamagedError` naming
    the first entry that is refused. ``expected_clients``: the run's own number of clients (its data's, else the
    checkpoint's ``seen`` flags, which the file holds), which ``num_clients`` must equal, so a manifest cannot make
    the store allocate masks and files for more clients than the run has."""
    num_clients = check_count(manifest.get("num_clients"), "manifest entry num_clients", MAX_CLIENTS)
    if num_clients < 1:
        refuse("manifest entry num_clients", "is 0: a disk store holds at least one client")
    if expected_clients is not None and num_clients != expected_clients:
        refuse("manifest entry num_clients", f"is {num_clients}, not the run's {expected_clients} clients")
    entries = _check_entries(manifest.get("entries"))
    total = num_clients * sum(row_bytes(s, dt) for s, dt in entries.values())
    if total > MAX_STATE_BYTES:
        refuse("manifest entry entries", f"with num_clients={num_clients} make {total} bytes, more than "
               f"{MAX_STATE_BYTES}")
    template = _check_template(manifest.get("template"), entries)
    segments = manifest.get("segments")
    if not isinstance(segments, list | tuple):
        refuse("manifest entry segments", f"must be a list, got {type(segments).__name__}")
    directory = manifest.get("directory")
    if directory is not None and not isinstance(directory, str):
        refuse("manifest entry directory", f"must be a folder path, got {type(directory).__name__}")
    checked = [_check_segment(i, record, num_clients) for i, record in enumerate(segments)]
    return Manifest(num_clients, entries, template, checked, directory)


def segment_path(directory: str, name: str, where: str) -> str | None:
    """``<directory>/<name>`` if it is a file that resolves inside ``directory`` (else ``None`` when absent);
    a path that resolves elsewhere (a symbolic link out of the folder) is refused, naming ``where``, before it is
    opened."""
    path = os.path.join(directory, name)
    if not os.path.lexists(path):
        return None
    real = os.path.realpath(path)
    if os.path.dirname(real) != os.path.realpath(directory) or not os.path.isfile(real):
        refuse(where, f"= {name!r}: {path} resolves to {real}, outside the segment folder {directory} "
                "(a link out of the store's folder is never read)")
    return path


@dataclass(frozen=True)
class Block:
    """One block of a segment: ``[rows, *shape]`` values of ``dtype`` at ``offset`` (after the header)."""

    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _check_block(spec: Any, where: str, rows: int, shape: tuple[int, ...], dtype: torch.dtype, room: int) -> Block:
    """A block whose ``nbytes`` is exactly ``rows`` rows and that lies inside the ``room`` bytes of the file."""
    if not isinstance(spec, Mapping):
        refuse(where, f"must be {{'offset', 'nbytes', ...}}, got {type(spec).__name__}")
    offset = check_count(spec.get("offset"), f"{where}.offset", room)
    nbytes = check_count(spec.get("nbytes"), f"{where}.nbytes", MAX_STATE_BYTES)
    if nbytes != rows * row_bytes(shape, dtype):
        refuse(f"{where}.nbytes", f"is {nbytes}, not the {rows} rows of {list(shape)} {dtype} the header states")
    if offset + nbytes > room:
        refuse(f"{where}.nbytes", f"= {nbytes} at offset {offset} runs past the end of the file ({room} bytes "
               "after the header)")
    return Block(offset, nbytes, shape, dtype)


def check_segment_header(path: str, header: Any, room: int) -> tuple[int, Block, dict[str, Block]]:
    """``(rows, client index block, {entry: block})`` of a segment's header, every block inside the ``room``
    bytes that follow the header and sized exactly for its rows (a refusal names the segment and the field)."""
    where = f"the segment {path}, header"
    if not isinstance(header, Mapping) or not isinstance(header.get("entries"), Mapping):
        refuse(where, "is not a segment header ({'rows', 'clients', 'entries'})")
    rows = check_count(header.get("rows"), f"{where} rows", MAX_CLIENTS)
    clients = _check_block(header.get("clients"), f"{where} clients", rows, (), torch.int64, room)
    blocks = {}
    for name, spec in header["entries"].items():
        field = f"{where} entries[{name!r}]"
        if not isinstance(spec, Mapping):
            refuse(field, f"must be {{'dtype', 'shape', 'offset', 'nbytes'}}, got {type(spec).__name__}")
        shape = check_shape(spec.get("shape"), f"{field}.shape")
        blocks[name] = _check_block(spec, field, rows, shape, check_dtype(spec.get("dtype"), f"{field}.dtype"), room)
    return rows, clients, blocks
