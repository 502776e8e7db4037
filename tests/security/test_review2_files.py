"""Issue 41 (the second security review), items 3, 6, 7, 10, 11 and 12 (docs/security.md): every size a file
declares is bounded before anything is allocated, a store deletes only what it can prove is its own, and every
reader's failure is one line naming the file."""

from __future__ import annotations

import pickle
import re
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_fedmeta.data.datasets import _load_pixels, read_cifar_batch


# ----------------------------------------------------------------------------------------------
# item 6: Tiny-ImageNet's wnids name folders inside the dataset
# ----------------------------------------------------------------------------------------------
def _tiny(root: Path, wnid: str) -> Path:
    """A Tiny-ImageNet folder whose wnids.txt lists ``n01`` and ``wnid``; beside it, ``outside/images`` holds a
    JPEG that is not part of the dataset."""
    from PIL import Image

    base = root / "data" / "tiny-imagenet-200"
    for folder in ("n01", "../../../outside"):
        (base / "train" / folder / "images").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (64, 64), (1, 2, 3)).save(base / "train" / folder / "images" / "x_0.JPEG")
    (base / "val" / "images").mkdir(parents=True)
    Image.new("RGB", (64, 64), (1, 2, 3)).save(base / "val" / "images" / "val_0.JPEG")
    (base / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn01\t0\t0\t63\t63\n")
    (base / "wnids.txt").write_text(f"n01\n{wnid}\n")
    return base


@pytest.mark.parametrize("wnid", ["../../../outside", "ABSOLUTE", "n01/../../../../outside", "..", "."],
                         ids=["dotdot", "absolute", "nested", "parent", "itself"])
def test_a_tiny_imagenet_wnid_that_leaves_the_dataset_is_refused(tmp_path: Path, wnid: str) -> None:
    """Before: every *.JPEG of the folder a wnid named (anywhere on the disk) joined the training set."""
    outside = tmp_path / "outside"
    wnid = str(outside) if wnid == "ABSOLUTE" else wnid
    base = _tiny(tmp_path, wnid)
    assert (outside / "images" / "x_0.JPEG").is_file()
    with pytest.raises(ValueError, match=r"wnids\.txt' line 2: .* not a class folder name") as info:
        _load_pixels("tiny_imagenet", base.parent)
    assert "\n" not in str(info.value)


def test_a_tiny_imagenet_class_folder_that_links_out_of_the_dataset_is_refused(tmp_path: Path) -> None:
    base = _tiny(tmp_path, "n02")
    (base / "train" / "n02").symlink_to(tmp_path / "outside")
    with pytest.raises(ValueError, match=r"n02/images': the images of class n02 .* resolve to .*outside the data"):
        _load_pixels("tiny_imagenet", base.parent)


# ----------------------------------------------------------------------------------------------
# item 7: a CIFAR pickle is not a memory bomb
# ----------------------------------------------------------------------------------------------
def _text(value: str) -> bytes:
    """Pickle's BINUNICODE opcode: push ``value``."""
    raw = value.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _batch(data: bytes) -> bytes:
    """A pickle of ``{b"data": <data's opcodes>, b"labels": []}`` (``C``: SHORT_BINBYTES, ``u``: SETITEMS)."""
    return b"\x80\x02}(C\x04data" + data + b"C\x06labels]u."


def _peak(read: Callable[[], Any]) -> tuple[BaseException | None, int]:
    """What ``read()`` raised (or ``None``) and the peak of memory traced while it ran."""
    tracemalloc.start()
    try:
        read()
        raised = None
    except BaseException as exc:  # noqa: BLE001 - the test inspects it
        raised = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return raised, peak


def test_a_cifar_pickle_that_nests_hex_encodings_is_refused_before_it_grows(tmp_path: Path) -> None:
    """``_codecs.encode(..., 'hex')`` doubles a string each time; 16 nestings of 1 KiB ask for 64 MiB here (30 for
    the gigabytes of the review's 391-byte file). Only ``latin1`` (how protocol 2 writes bytes) is allowed."""
    expr = b"h\x00" + _text("A" * 1024) + _text("latin1") + b"\x86R"
    for _ in range(16):
        expr = b"h\x00" + expr + _text("hex") + b"\x86R"
    path = tmp_path / "data_batch_1"
    path.write_bytes(b"\x80\x02c_codecs\nencode\nq\x00" + b"0" + _batch(expr)[2:])
    raised, peak = _peak(lambda: read_cifar_batch(path))
    assert isinstance(raised, ValueError), raised
    assert re.search(r"data_batch_1' is not a CIFAR-10 batch: it asks _codecs\.encode for the 'hex' encoding",
                     str(raised)) and "\n" not in str(raised)
    assert peak < 8 * 2**20, peak


@pytest.mark.parametrize("module", ["numpy.core.multiarray", "numpy._core.multiarray"])
def test_a_cifar_pickle_that_declares_a_huge_array_is_refused_before_it_is_allocated(tmp_path: Path,
                                                                                   module: str) -> None:
    """``_reconstruct(ndarray, (2**40,), b'b')``: 1 TiB (the review's 78-byte file asked for 12 GiB). Before: a
    ``MemoryError`` escaped the reader's one-line error."""
    shape = b"\x8a\x06" + (2**40).to_bytes(6, "little") + b"\x85"  # LONG1 2**40, TUPLE1
    call = (f"c{module}\n_reconstruct\n".encode() + b"cnumpy\nndarray\n" + shape + b"C\x01b" + b"\x87R")
    path = tmp_path / "data_batch_1"
    path.write_bytes(_batch(call))
    with pytest.raises(ValueError, match=r"data_batch_1' is not a CIFAR-10 batch: it declares an array of "
                                         r"1099511627776 bytes, more than the file's \d+") as info:
        read_cifar_batch(path)
    assert "\n" not in str(info.value)


def test_cifar_labels_that_repeat_one_list_are_refused_before_they_are_expanded(tmp_path: Path) -> None:
    """Pickle's memo makes ``[[[0] * 200] * 200] * 200]`` a few kilobytes; as an array it is 8 million labels
    (``numpy.asarray`` of 1000-fold nesting: 8 GB). Labels are a flat list of integers, counted before they are
    converted."""
    inner = [0] * 200
    middle = [inner] * 200
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": np.zeros((1, 3072), np.uint8), b"labels": [middle] * 200}, protocol=2))
    assert path.stat().st_size < 20_000
    raised, peak = _peak(lambda: read_cifar_batch(path))
    assert isinstance(raised, ValueError), raised
    assert re.search(r"data_batch_1': 'labels' must be a flat list of integers", str(raised))
    assert peak < 8 * 2**20, peak


def test_a_genuine_cifar_batch_reads_under_every_protocol(tmp_path: Path) -> None:
    data = np.arange(3 * 3072, dtype=np.uint8).reshape(3, 3072) % 251
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        path = tmp_path / f"batch{protocol}"
        path.write_bytes(pickle.dumps({b"data": data, b"labels": [3, 7, np.int64(1)], b"batch_label": b"x"},
                                      protocol=protocol))
        x, y = read_cifar_batch(path)
        assert torch.equal(x.reshape(3, -1), torch.from_numpy(data)) and y.tolist() == [3, 7, 1]
