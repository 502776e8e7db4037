"""Reader for the IDX file format used by MNIST and Fashion-MNIST, plain or gzip-compressed.

Format (LeCun, Cortes & Burges, "THE MNIST DATABASE of handwritten digits",
http://yann.lecun.com/exdb/mnist/, section "FILE FORMATS FOR THE MNIST DATABASE"):

* bytes 0-1: zero;
* byte 2: element type code, ``0x08`` uint8, ``0x09`` int8, ``0x0B`` int16, ``0x0C`` int32,
  ``0x0D`` float32, ``0x0E`` float64 (multi-byte types are big-endian);
* byte 3: number of dimensions ``d``;
* then ``d`` big-endian uint32 dimension sizes, then the elements in C (row-major) order.

MNIST/Fashion-MNIST image files are ``uint8 [N, 28, 28]`` (magic ``0x00000803``) and label
files ``uint8 [N]`` (magic ``0x00000801``). Compression is detected from the gzip magic bytes
``1f 8b``, not from the file name.

Speed (the data module reads Fashion-MNIST at every start-up): a gzip file is inflated by one
``zlib`` pass that checks the CRC-32 and length itself (``gzip.decompress`` copies the compressed
payload and runs a second CRC pass), and :func:`read_idx_arrays` reads several files in threads
(``zlib`` releases the GIL while inflating) into read-only arrays without the copy that a writable
tensor needs; the data module gathers the clients' rows from those.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "check_idx_images",
    "idx_labels_tensor",
    "read_idx",
    "read_idx_array",
    "read_idx_arrays",
    "read_idx_images",
    "read_idx_labels",
]

_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_GZIP_MAGIC = b"\x1f\x8b"


def _gunzip(raw: bytes, limit: int | None = None) -> bytes:
    """Inflate every gzip member of ``raw``, as ``gzip.decompress`` does, in one ``zlib`` pass per member; with
    ``limit``, stop after ``limit`` bytes of output (the bytes inflated so far are returned, never more).

    ``wbits=31`` makes zlib parse the gzip header and check the trailer's CRC-32 and length. Without ``limit``,
    anything zlib refuses (a corrupt or truncated file, trailing bytes that are not a gzip member) is handed to
    ``gzip.decompress``, so errors are the ones it raises; with ``limit`` it raises ``zlib.error`` itself (handing
    a file to ``gzip.decompress`` would inflate all of it).
    """
    members = []
    rest = raw
    total = 0
    try:
        while rest and (limit is None or total < limit):
            inflater = zlib.decompressobj(wbits=31)
            members.append(inflater.decompress(rest, 0 if limit is None else limit - total))
            total += len(members[-1])
            if limit is not None and total >= limit:  # stopped at the limit (input or pending output left)
                break
            if not inflater.eof:
                raise zlib.error("truncated gzip member")
            rest = inflater.unused_data.lstrip(b"\x00")  # gzip.decompress skips zero padding between members
    except zlib.error:
        if limit is not None:
            raise
        return gzip.decompress(raw)
    return members[0] if len(members) == 1 else b"".join(members)


#: the longest IDX header: 4 bytes, then up to 255 uint32 dimension sizes
_MAX_HEADER = 4 + 4 * 255


def _declared_size(head: bytes) -> int:
    """Header and payload bytes the IDX header at the start of ``head`` declares (``len(head)`` when it cannot
    be parsed: the full parse then reports what is wrong)."""
    if len(head) < 4 or head[2] not in _IDX_DTYPES or len(head) < 4 + 4 * head[3]:
        return len(head)
    shape = struct.unpack(f">{head[3]}I", head[4:4 + 4 * head[3]])
    return 4 + 4 * head[3] + int(np.prod(shape, dtype=object)) * _IDX_DTYPES[head[2]].itemsize


def _read_bytes(path: str | os.PathLike[str]) -> tuple[bytes, bool]:
    """The IDX bytes of a file and whether it was gzip (inflated): the header is inflated first and the rest only up to
    one byte past the size it declares, so a small file cannot inflate into more memory than its header admits
    (zlib reaches ~1000x), and a damaged gzip file is a ``ValueError`` naming it."""
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = _gunzip(raw, _declared_size(_gunzip(raw, _MAX_HEADER)) + 1)
        except (zlib.error, EOFError, OSError) as exc:
            raise ValueError(f"{os.fspath(path)!r} is not a readable gzip file ({exc})") from None
        return raw, True
    return raw, False


def read_idx_array(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file (plain or ``.gz``) into a NumPy array of its stored element type and shape.

    Single-byte element types come back as a **read-only** view of the file's bytes (no copy);
    multi-byte big-endian types are converted to a native-order (writable) copy. :func:`read_idx`
    is the writable tensor form.

    Raises:
        ValueError: if the header is malformed, the payload size does not match the header or a gzip file is
            damaged (one line naming the file).
    """
    raw, inflated = _read_bytes(path)
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{os.fspath(path)!r} is not an IDX file: it must start with two zero bytes")
    type_code, ndim = raw[2], raw[3]
    if type_code not in _IDX_DTYPES:
        known = ", ".join(f"0x{c:02X}" for c in _IDX_DTYPES)
        raise ValueError(f"{os.fspath(path)!r}: unknown IDX element type 0x{type_code:02X} (known: {known})")
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise ValueError(f"{os.fspath(path)!r}: truncated IDX header ({len(raw)} bytes, need {header_len})")
    shape = struct.unpack(f">{ndim}I", raw[4:header_len])
    dtype = _IDX_DTYPES[type_code]
    expected = int(np.prod(shape, dtype=object)) * dtype.itemsize
    payload = len(raw) - header_len
    if payload != expected:
        holds = "more" if inflated and payload > expected else f"{payload} data bytes"  # inflated: not all of it
        raise ValueError(
            f"{os.fspath(path)!r}: header says shape {tuple(shape)} of {dtype} ({expected} bytes) "
            f"but the file holds {holds}"
        )
    array = np.frombuffer(raw, dtype=dtype, offset=header_len).reshape(shape)
    native = dtype.newbyteorder("=")
    return array if array.dtype == native else array.astype(native)


def read_idx_arrays(paths: Sequence[str | os.PathLike[str]]) -> list[np.ndarray]:
    """:func:`read_idx_array` of several files, read concurrently (one thread per file, in order)."""
    if len(paths) <= 1:
        return [read_idx_array(p) for p in paths]
    with ThreadPoolExecutor(max_workers=len(paths), thread_name_prefix="read_idx") as pool:
        return list(pool.map(read_idx_array, paths))


def read_idx(path: str | os.PathLike[str]) -> Tensor:
    """Read an IDX file (plain or ``.gz``) into a tensor of its stored element type and shape.

    Multi-byte big-endian element types are converted to the native byte order. The tensor owns
    writable memory (a copy of the file's bytes).

    Raises:
        ValueError: if the header is malformed or the payload size does not match the header.
    """
    array = read_idx_array(path)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def check_idx_images(array: np.ndarray, path: str | os.PathLike[str]) -> np.ndarray:
    """Return ``array`` if it is an image array ``uint8 [N, H, W]``; raise ``ValueError`` naming ``path`` otherwise."""
    if array.ndim != 3 or array.dtype != np.uint8:
        dtype = torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype  # named as the tensor reader names it
        raise ValueError(f"{os.fspath(path)!r}: expected uint8 images [N, H, W], got {dtype} {tuple(array.shape)}")
    return array


def idx_labels_tensor(array: np.ndarray, path: str | os.PathLike[str]) -> Tensor:
    """The ``int64 [N]`` tensor of a 1-D label array (a copy); raise ``ValueError`` naming ``path`` otherwise."""
    if array.ndim != 1:
        raise ValueError(f"{os.fspath(path)!r}: expected a 1-D label vector, got shape {tuple(array.shape)}")
    return torch.from_numpy(array.copy()).to(torch.long)


def read_idx_images(path: str | os.PathLike[str]) -> Tensor:
    """Read an IDX image file as ``uint8 [N, H, W]`` (e.g. ``[60000, 28, 28]`` for MNIST train)."""
    return torch.from_numpy(check_idx_images(read_idx_array(path), path).copy())


def read_idx_labels(path: str | os.PathLike[str]) -> Tensor:
    """Read an IDX label file as ``int64 [N]``."""
    return idx_labels_tensor(read_idx_array(path), path)
