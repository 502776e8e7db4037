"""lightning_fedmeta.persistence.atomic_io: a failed write leaves the old file and no temporary file; the folder is
fsync-ed."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_fedmeta.persistence import atomic_io
from lightning_fedmeta.persistence.atomic_io import (
    atomic_torch_save,
    atomic_write,
    atomic_write_bytes,
    partial_file,
    publish,
)


class Unpicklable:
    def __reduce__(self) -> Any:
        raise RuntimeError("cannot pickle this")


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_write_replaces_the_file_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "x.bin"  # missing folders are created
    atomic_write_bytes(path, b"old")
    atomic_write_bytes(path, b"new")
    assert path.read_bytes() == b"new"
    atomic_torch_save({"w": torch.arange(3)}, path)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(3))
    assert _names(path.parent) == ["x.bin"]


def test_serialisation_failing_midway_leaves_the_old_file_and_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "state.pt"
    atomic_torch_save({"round": 1}, path)
    before = path.read_bytes()
    with pytest.raises(RuntimeError, match="cannot pickle"):
        atomic_torch_save({"round": 2, "x": torch.zeros(2**16), "bad": Unpicklable()}, path)
    assert path.read_bytes() == before
    assert _names(tmp_path) == ["state.pt"]

    def half_then_disk_full(fh: Any) -> None:
        fh.write(b"half of the new file")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, half_then_disk_full)
    assert path.read_bytes() == before and _names(tmp_path) == ["state.pt"]


def test_a_failing_rename_leaves_the_old_file_and_no_temporary_file(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "x.bin"
    atomic_write_bytes(path, b"old")
    seen: list[str] = []

    def failing_replace(src: str, dst: str) -> None:
        seen.append(src)
        assert os.path.isfile(src) and Path(src).read_bytes() == b"new"  # written in full before the rename
        raise OSError("rename failed")

    monkeypatch.setattr(atomic_io.os, "replace", failing_replace)
    with pytest.raises(OSError, match="rename failed"):
        atomic_write_bytes(path, b"new")
    monkeypatch.undo()
    (tmp,) = seen
    assert os.path.dirname(tmp) == str(tmp_path)  # the temporary file is in the target's folder
    assert os.path.basename(tmp).startswith(f".x.bin.{os.getpid()}.") and tmp.endswith(".partial")
    assert path.read_bytes() == b"old" and _names(tmp_path) == ["x.bin"]


def test_the_file_and_then_its_folder_are_fsynced(tmp_path: Path, monkeypatch) -> None:
    synced: list[tuple[bool, str]] = []  # (is a folder, what the target holds at that moment)
    real_fsync = os.fsync
    path = tmp_path / "x.bin"

    def spy(fd: int) -> None:
        synced.append((stat.S_ISDIR(os.fstat(fd).st_mode), path.read_bytes().decode() if path.exists() else ""))
        real_fsync(fd)

    monkeypatch.setattr(atomic_io.os, "fsync", spy)
    atomic_write_bytes(path, b"data")
    if os.name == "nt":
        assert synced == [(False, "")]
    else:  # the file before the rename, the folder after it
        assert synced == [(False, ""), (True, "data")]


def test_the_parts_name_the_file_after_its_content(tmp_path: Path) -> None:
    """A writer that learns the final name only after writing (a segment named by its hash)."""
    with partial_file(tmp_path, ".seg", sep="-") as tmp:
        assert os.path.basename(tmp).startswith(f".seg-{os.getpid()}-")
        Path(tmp).write_bytes(b"abc")
        publish(tmp, tmp_path / "seg-abc")
    assert _names(tmp_path) == ["seg-abc"]
    with pytest.raises(ValueError), partial_file(tmp_path, ".seg", sep="-") as tmp:
        Path(tmp).write_bytes(b"half")
        raise ValueError("the writer failed")
    assert _names(tmp_path) == ["seg-abc"]
