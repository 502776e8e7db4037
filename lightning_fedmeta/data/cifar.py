"""Reading one CIFAR "python version" batch (CIFAR-10's ``data_batch_*``/``test_batch``, CIFAR-100's ``train``/
``test``) without trusting its pickle.

Both :mod:`lightning_fedmeta.data.datasets` (CIFAR-10) and :mod:`lightning_fedmeta.data.more_datasets` (CIFAR-100)
read their batches here, so neither imports the other.
"""

from __future__ import annotations

import codecs
import os
import pickle
from typing import Any

import numpy as np
import torch
from torch import Tensor

try:  # numpy 2
    from numpy._core.multiarray import _reconstruct as _np_reconstruct
    from numpy._core.multiarray import scalar as _np_scalar
    from numpy._core.numeric import _frombuffer as _np_frombuffer
except ImportError:  # numpy 1
    from numpy.core.multiarray import _reconstruct as _np_reconstruct
    from numpy.core.multiarray import scalar as _np_scalar
    from numpy.core.numeric import _frombuffer as _np_frombuffer

__all__ = ["read_cifar_batch"]


class _CifarUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals a CIFAR-10 batch needs: numpy array and scalar reconstruction
    (``ndarray``, ``dtype``, ``_reconstruct``, ``scalar``, ``_frombuffer``, under numpy 1's and 2's module names) and
    ``_codecs.encode`` (how protocol 2 writes ``bytes``). Anything else (``os.system``, ``builtins.exec``, any
    class) is refused before it is called, so a crafted batch file cannot run code.

    Nor can it make the reader allocate more than it holds: ``_codecs.encode`` turns only a ``str`` into ``bytes``
    with ``latin1`` (the bytes are the file's; ``hex``, which doubles a string at each nesting, is refused) and
    ``_reconstruct`` builds only an ``ndarray`` of at most ``limit`` bytes (the file's size: an array's values come
    from the file; a genuine pickle asks for an empty one and fills it with ``__setstate__``, which numpy checks
    against the bytes it is given)."""

    _ALLOWED: dict[tuple[str, str], object] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("numpy.core.multiarray", "scalar"): _np_scalar,  # a numpy scalar (np.int64 label) from dtype and bytes
        ("numpy._core.multiarray", "scalar"): _np_scalar,
        ("numpy.core.numeric", "_frombuffer"): _np_frombuffer,  # protocol 5
        ("numpy._core.numeric", "_frombuffer"): _np_frombuffer,
    }

    def __init__(self, file: Any, limit: int, **kwargs: Any) -> None:
        super().__init__(file, **kwargs)
        self.limit = limit

    def find_class(self, module: str, name: str) -> object:
        if (module, name) == ("_codecs", "encode"):
            return self._encode
        if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name == "_reconstruct":
            return self._reconstruct
        found = self._ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a CIFAR batch never holds")
        return found

    @staticmethod
    def _encode(obj: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        if not isinstance(encoding, str) or codecs.lookup(encoding).name != "iso8859-1" or not isinstance(obj, str):
            raise pickle.UnpicklingError(f"it asks _codecs.encode for the {encoding!r} encoding of a "
                                         f"{type(obj).__name__}, where a CIFAR batch only turns text into bytes "
                                         "with 'latin1'")
        return codecs.encode(obj, "latin1", errors)

    def _reconstruct(self, cls: Any, shape: Any, dtype: Any) -> np.ndarray:
        dims = shape if isinstance(shape, tuple) else (shape,)
        if cls is not np.ndarray or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise pickle.UnpicklingError(f"it asks for a {getattr(cls, '__name__', cls)!s} of shape {shape!r}, not "
                                         "a numpy array")
        nbytes = int(np.prod(dims, dtype=object)) * np.dtype(dtype).itemsize
        if nbytes > self.limit:
            raise pickle.UnpicklingError(f"it declares an array of {nbytes} bytes, more than the file's {self.limit}")
        return _np_reconstruct(cls, shape, dtype)


def read_cifar_batch(path: str | os.PathLike[str], label_key: str = "labels") -> tuple[Tensor, Tensor]:
    """Read one CIFAR "python version" batch: a pickled dict with ``data`` and ``labels`` (CIFAR-10) or
    ``fine_labels`` (CIFAR-100's 100 classes, ``label_key="fine_labels"``; its ``train`` and ``test`` files).

    ``data`` is ``uint8 [N, 3072]`` laid out as 1024 red, 1024 green, 1024 blue values of a
    row-major 32x32 image (https://www.cs.toronto.edu/~kriz/cifar.html), returned as
    ``uint8 [N, 3, 32, 32]``; labels as int64 ``[N]``. Keys may be ``bytes`` (the official files)
    or ``str``. The file is unpickled by :class:`_CifarUnpickler`, which builds only what a CIFAR batch holds
    (dicts, lists, bytes, str, numbers, numpy arrays): a file naming anything else (a pickle that would run
    code) raises ``ValueError`` before it runs.
    """
    with open(path, "rb") as f:
        try:
            batch = _CifarUnpickler(f, limit=os.fstat(f.fileno()).st_size, encoding="bytes").load()
        except pickle.UnpicklingError as exc:
            what = "CIFAR-100 file" if label_key == "fine_labels" else "CIFAR-10 batch"
            raise ValueError(f"{os.fspath(path)!r} is not a {what}: {exc}; it was not loaded (unpickling "
                             "it could run code or fill the memory). Use the official files (download: true fetches "
                             "them)") from None
        except (EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError, OverflowError, LookupError,
                MemoryError, RecursionError) as exc:
            raise ValueError(f"{os.fspath(path)!r} is not a readable CIFAR pickle ({type(exc).__name__}: {exc}); "
                             "use the official files (download: true fetches them)") from None
    if not isinstance(batch, dict):
        raise ValueError(f"{os.fspath(path)!r}: expected a pickled dict, got {type(batch).__name__}")

    def get(key: str) -> object:
        for k in (key.encode(), key):
            if k in batch:
                return batch[k]
        raise ValueError(f"{os.fspath(path)!r}: CIFAR batch has no {key!r} entry (keys: {list(batch)})")

    raw_data, raw_labels = get("data"), get(label_key)
    if isinstance(raw_labels, list) and not all(isinstance(v, int | np.integer) for v in raw_labels):
        # a list that repeats one list (pickle's memo) would expand to far more values than the file holds
        raise ValueError(f"{os.fspath(path)!r}: {label_key!r} must be a flat list of integers, got an item of type "
                         f"{next(type(v).__name__ for v in raw_labels if not isinstance(v, int | np.integer))}")
    if not isinstance(raw_data, np.ndarray):  # its size is what the file holds (the unpickler checked it)
        raise ValueError(f"{os.fspath(path)!r}: 'data' must be a numpy array, got {type(raw_data).__name__}")
    try:
        data = np.asarray(raw_data, dtype=np.uint8)
        labels = np.asarray(raw_labels, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError) as err:
        raise ValueError(f"{os.fspath(path)!r}: expected uint8 'data' and integer {label_key!r} ({err})") from None
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or data.shape[0] != labels.shape[0]:
        raise ValueError(
            f"{os.fspath(path)!r}: expected data [N, 3072] and N labels, got {data.shape} and {labels.shape}"
        )
    return torch.from_numpy(data.reshape(-1, 3, 32, 32).copy()), torch.from_numpy(labels.copy())
