"""Reading a checkpoint file as data only, and the saved settings that name code or a path.

Every read is ``torch.load(weights_only=True)``, URLs included; ``weights_only=False`` is refused
(:func:`refuse_unsafe_load`, docs/security.md). A saved setting that names code or a folder
(:data:`CODE_OR_PATH_SETTINGS`, a class path) is taken only when passed again (:func:`code_or_path_settings`).
"""

from __future__ import annotations

import inspect
import io
import os
import pickle
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.cloud_io import get_filesystem

if TYPE_CHECKING:

    pass
from lightning_fedmeta.persistence.checksums import CheckpointDamagedError, _qualname, damaged_message, diagnose_file

__all__ = [
    "CODE_OR_PATH_SETTINGS",
    "CheckpointSettingsError",
    "UnsafeCheckpointLoadError",
    "code_or_path_settings",
    "code_or_path_message",
    "load_checkpoint_file",
    "plain_value",
    "refuse_unsafe_load",
    "signature_defaults",
]


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


class CheckpointSettingsError(ValueError):
    """A checkpoint loaded with settings other than those it was written with."""


class UnsafeCheckpointLoadError(ValueError):
    """A checkpoint refused because reading it could run code: ``weights_only=False`` was asked for, or the file
    holds objects ``torch.load(weights_only=True)`` does not load."""


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


def _is_local(path: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(get_filesystem(path), LocalFileSystem)


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


def signature_defaults(cls: type) -> dict[str, Any]:
    """The defaults of ``cls.__init__``'s parameters."""
    try:
        params = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    except (TypeError, ValueError):
        return {}
    return {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}


def _names_a_class(value: Any) -> bool:
    """Whether ``value`` holds a ``class_path`` (jsonargparse imports and builds the class it names) anywhere."""
    value = plain_value(value)
    if isinstance(value, dict):
        return "class_path" in value or any(_names_a_class(v) for v in value.values())
    return isinstance(value, list) and any(_names_a_class(v) for v in value)


def _code_or_path(name: str, value: Any) -> bool:
    """Whether ``value`` of setting ``name`` (``model.loss``, ...) names code or a file-system path."""
    from lightning_fedmeta.client.losses import LOSSES

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
