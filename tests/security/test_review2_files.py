"""Issue 41 (the second security review), items 3, 6, 7, 10, 11 and 12 (docs/security.md): every size a file
declares is bounded before anything is allocated, a store deletes only what it can prove is its own, and every
reader's failure is one line naming the file."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import tracemalloc
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.data.datasets import _load_pixels, read_cifar_batch
from lightning_fedmeta.data.idx import read_idx_array
from lightning_fedmeta.data.leaf import LeafDataset
from lightning_fedmeta.persistence import disk_store as disk_state
from lightning_fedmeta.persistence.checksums import CHECKSUM_KEY, CheckpointDamagedError, seal_checkpoint
from lightning_fedmeta.persistence.disk_store import DiskClientStateStore, read_segment
from tests.helpers import make_trainer, tiny_datamodule


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


# ----------------------------------------------------------------------------------------------
# item 11: readers fail in one line naming the file, and the IDX reader inflates only what its header declares
# ----------------------------------------------------------------------------------------------
def _leaf(root: Path, train: bytes) -> Path:
    good = {"users": ["u"], "num_samples": [1], "user_data": {"u": {"x": [[0.5] * 784], "y": [1]}}}
    for split in ("train", "test"):
        (root / split).mkdir(parents=True)
    (root / "test" / "t.json").write_text(json.dumps(good))
    (root / "train" / "t.json").write_bytes(train)
    return root


def _femnist_user(x: str, y: str) -> bytes:
    return ('{"users": ["u"], "user_data": {"u": {"x": [[' + ", ".join(["0.5"] * 783 + [x]) + ']], "y": [' + y
            + "]}}}").encode()


@pytest.mark.parametrize(("train", "match"), [
    (b'{"users": ["u"], "user_data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", r"nested too deeply"),
    (b'{"users": [' + b"7" * 5000 + b"]}", r"is not a LEAF file: Exceeds the limit \(\d+ digits\) for integer string"),
    (_femnist_user("1" + "0" * 400, "1"), r"x must be lists of 784 numbers and y class ids"),
    (_femnist_user("0.5", "1" + "0" * 400), r"x must be lists of 784 numbers and y class ids"),
], ids=["deep", "long-integer", "pixel-overflow", "label-overflow"])
def test_structurally_wrong_leaf_json_is_refused_in_one_line_naming_the_file(tmp_path: Path, train: bytes,
                                                                            match: str) -> None:
    """Before: a RecursionError, a ValueError that did not name the file, an OverflowError."""
    with pytest.raises(ValueError, match=r"train/t\.json'.*" + match) as info:
        LeafDataset(str(_leaf(tmp_path, train))).client_data()
    assert "\n" not in str(info.value)


def test_a_segment_header_nested_too_deeply_is_a_damaged_checkpoint(tmp_path: Path) -> None:
    head = b"[" * 100_000 + b"]" * 100_000
    prefix = b"FEDSEG01" + struct.pack("<Q", len(head)) + head
    path = tmp_path / "seg-000000001-0123456789abcdef.fseg"
    path.write_bytes(prefix + b"\0" * (-len(prefix) % 64))
    with pytest.raises(CheckpointDamagedError, match=r"header is not JSON \(nested too deeply\)"):
        read_segment(str(path))


def _gzip_idx(path: Path, shape: tuple[int, ...], payload: int) -> None:
    """A gzip IDX file of uint8 ``shape`` whose body is ``payload`` zero bytes, compressed in 1 MiB blocks."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, 31)
    with open(path, "wb") as fh:
        fh.write(deflate.compress(bytes([0, 0, 8, len(shape)]) + struct.pack(f">{len(shape)}I", *shape)))
        block = bytes(2**20)
        for start in range(0, payload, len(block)):
            fh.write(deflate.compress(block[:payload - start]))
        fh.write(deflate.flush())


def test_the_idx_reader_inflates_no_more_than_its_header_declares(tmp_path: Path) -> None:
    """A 32 KiB file that inflates to 32 MiB behind a header of 10 bytes: the reader reads the header first and
    stops one byte past what it declares (before: it inflated the whole file, ~1000x its size)."""
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    _gzip_idx(path, (10,), 32 * 2**20)
    assert path.stat().st_size < 64 * 2**10
    raised, peak = _peak(lambda: read_idx_array(path))
    assert isinstance(raised, ValueError), raised
    assert re.search(r"ubyte\.gz': header says shape \(10,\) of uint8 \(10 bytes\) but the file holds more",
                     str(raised)), raised
    assert peak < 4 * 2**20, peak


def test_the_idx_reader_still_reads_gzip_files_of_several_members(tmp_path: Path) -> None:
    body = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    raw = bytes([0, 0, 8, 3]) + struct.pack(">3I", 2, 3, 4) + body.tobytes()
    path = tmp_path / "images.gz"
    path.write_bytes(gzip.compress(raw[:7]) + b"\0" * 3 + gzip.compress(raw[7:]))
    assert np.array_equal(read_idx_array(path), body)
    path.write_bytes(gzip.compress(raw)[:-6])  # cut: a one-line error naming the file
    with pytest.raises(ValueError, match=r"images\.gz' is not a readable gzip file"):
        read_idx_array(path)


# ----------------------------------------------------------------------------------------------
# item 12: fedmeta compare: a config.yaml's aliases are not expanded without bound; a malformed comm entry
# ----------------------------------------------------------------------------------------------
def _history(folder: Path, comm: Any = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    record = {"round": 2, "stage": "val", "metrics": {"val/acc_weighted": 0.5}}
    if comm is not None:
        record["comm"] = comm
    (folder / "fedmeta_history.json").write_text(json.dumps({"history": [record]}))
    return folder


def _compare_fails(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``fedmeta compare ARGS`` through the console entry point: status 2 and one line of stderr, returned."""
    from lightning_fedmeta.cli import main

    with pytest.raises(SystemExit) as info:
        main(["compare", *args])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedmeta: error: "), lines
    return lines[0]


def _laughs(levels: int) -> str:
    """A YAML document whose aliases expand to 10**levels values in a few hundred bytes (billion laughs)."""
    lines = ["l0: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, levels + 1)]
    return "model:\n  seed: 0\ndata:\n  " + "\n  ".join(lines) + "\n"


@pytest.mark.parametrize("config", [
    _laughs(6),
    "model:\n  seed: 0\n  a: &a [1, *a]\n",
    "model:\n  seed: 0\n  a: &a {b: *a}\n",
    "model:\n  seed: 0\n  a: " + "[" * 20_000 + "]" * 20_000 + "\n",
], ids=["laughs", "cyclic-list", "cyclic-mapping", "deep"])
def test_compare_refuses_a_config_yaml_whose_aliases_expand_without_bound(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], config: str) -> None:
    """Before: 10**6 values went through json.dumps here (10**9 from a 600-byte file in the review), a cycle
    ended in a traceback (ValueError: Circular reference / RecursionError)."""
    run = _history(tmp_path / "run")
    (run / "config.yaml").write_text(config)
    assert len(config) < 50_000
    line = _compare_fails([str(run), "--out", str(tmp_path / "cmp.png")], capsys)
    assert str(run / "config.yaml") in line
    assert re.search(r"more than 100000 values|refers to itself|nested too deeply", line), line


def test_compare_still_reads_a_config_yaml_with_an_alias(tmp_path: Path) -> None:
    from lightning_fedmeta.frontends.compare import read_run_config

    run = _history(tmp_path / "run")
    (run / "config.yaml").write_text("model:\n  seed: 3\n  sizes: &s [1, 2]\ndata:\n  sizes: *s\n")
    assert read_run_config(run / "fedmeta_history.json") == {"model.seed": 3, "model.sizes": [1, 2],
                                                             "data.sizes": [1, 2]}


@pytest.mark.parametrize(("comm", "match"), [
    ("lots", r"history record 0 has comm 'lots', not an object of byte counts"),
    ({"comm/up_bytes_cumulative": "x"}, r"has comm/up_bytes_cumulative = 'x', not a number"),
    ({"comm/up_bytes": 10}, r"records no byte counts"),
], ids=["a-string", "a-word", "no-cumulative"])
def test_compare_x_bytes_names_the_file_of_a_malformed_comm_entry(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], comm: Any, match: str) -> None:
    """Before: TypeError / KeyError tracebacks."""
    run = _history(tmp_path / "run", comm)
    line = _compare_fails([str(run), "--x", "bytes", "--out", str(tmp_path / "cmp.png")], capsys)
    assert re.search(match, line), line


# ----------------------------------------------------------------------------------------------
# item 10: a disk-store manifest names the run's own number of clients
# ----------------------------------------------------------------------------------------------
def _disk_run(root: Path, rounds: int, ckpt_path: Path | None = None) -> FederatedModule:
    """A 6-client disk-state Ditto run in ``root``, checkpointing every 2 rounds."""
    torch.manual_seed(0)
    module = FederatedModule(
        model=nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)), clients_per_round=3, seed=3,
        algorithm={"name": "ditto", "lam": 0.1, "local_steps": 1, "local_lr": 0.1, "batch_size": 4},
        client_state="disk",
    )
    callback = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = make_trainer(rounds, enable_checkpointing=True, callbacks=[callback], default_root_dir=str(root))
    trainer.fit(module, tiny_datamodule(eval_every=2), ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return module


def _forged(ckpt: Path, num_clients: int) -> Path:
    """``ckpt`` with its manifest's num_clients changed, re-sealed (a checksum that matches the new bytes)."""
    checkpoint = torch.load(ckpt, weights_only=True)
    checkpoint.pop(CHECKSUM_KEY, None)
    checkpoint["fedmeta"]["engine"]["client_state"]["num_clients"] = num_clients
    forged = ckpt.with_name("forged.ckpt")
    torch.save(seal_checkpoint(checkpoint), forged)
    return forged


def test_a_manifest_naming_more_clients_than_the_run_has_is_refused_before_allocating(tmp_path: Path) -> None:
    """Before: 2**24 clients for a 6-client run were accepted (two [2**24] masks, working files of 2**24 rows,
    carried into later checkpoints); the review's 2**30 allocated 2 GiB."""
    _disk_run(tmp_path / "a", 2).client_states.close()
    forged = _forged(tmp_path / "a" / "ckpt" / "step=2.ckpt", 2**24)
    with pytest.raises(CheckpointDamagedError, match=r"manifest entry num_clients is 16777216, not the run's 6 "):
        _disk_run(tmp_path / "b", 4, forged)
    assert all(p.stat().st_size < 2**16 for p in (tmp_path / "b").rglob("*.rows"))  # the run's own 6 rows only
    with pytest.raises(CheckpointDamagedError, match=r"num_clients is 16777216, not the run's 6 "):
        FederatedModule.load_from_checkpoint(forged)  # no data: the count is the checkpoint's own 'seen' flags


# ----------------------------------------------------------------------------------------------
# item 3: a disk store deletes only the working files it can prove are its own, never by a pid
# ----------------------------------------------------------------------------------------------
_NOT_HERE = 999_999_999  # above any pid_max: no process of this namespace has it


def _leftover(rank: Path, owner: str, kernel: str | None) -> tuple[Path, Path, Path]:
    """The working folder, owner file and partial segment a store of ``owner`` (``<pid>-<token>``) leaves in
    ``rank``; the owner file says which kernel the store ran on (``None``: no owner file, as before this fix)."""
    work = rank / f"work-{owner}"
    work.mkdir(parents=True)
    (work / "0.rows").write_bytes(b"x" * 100)
    (rank / "segments").mkdir(exist_ok=True)
    partial = rank / "segments" / f".seg-{owner}-{owner.split('-')[0]}-0badc0de.partial"
    partial.write_bytes(b"half a segment")
    lock = rank / f"work-{owner}.lock"
    if kernel is not None:
        lock.write_text(json.dumps({"kernel": kernel, "host": "elsewhere", "pid": int(owner.split("-")[0])}))
    return work, lock, partial


def test_a_store_never_deletes_the_working_files_of_a_run_in_another_pid_namespace(tmp_path: Path) -> None:
    """Two containers on one volume (or NFS) share client_state_dir; run B's pids mean nothing in run A's namespace.
    Before: A deleted B's live working folder and partial segment (B's pid is not alive here), and B's next
    checkpoint failed with FileNotFoundError."""
    import fcntl

    rank = tmp_path / "rank-0"
    kernel = disk_state._kernel_id()
    live = _leftover(rank, f"{_NOT_HERE}-00000001", kernel)  # same kernel (containers): its owner holds the lock
    held = os.open(live[1], os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    other_host = _leftover(rank, f"{_NOT_HERE}-00000002", "another-boot-id")  # NFS: a lock there is not seen here
    unowned = _leftover(rank, f"{_NOT_HERE}-00000003", None)  # no owner file: nothing proves whose it is
    try:
        store = DiskClientStateStore.lazy(tmp_path, 4, {"c": torch.zeros(3)})
        for work, _lock, partial in (live, other_host, unowned):
            assert work.is_dir() and (work / "0.rows").is_file() and partial.is_file(), work
        assert live[1].is_file() and other_host[1].is_file()
        store.close()
    finally:
        os.close(held)


_CRASH = """
import os, sys, torch
from lightning_fedmeta.persistence.disk_store import DiskClientStateStore
store = DiskClientStateStore.lazy(sys.argv[1], 4, {"c": torch.zeros(3)})
store.scatter(torch.tensor([1]), {"c": torch.ones(1, 3)})
open(os.path.join(store.segment_directory, f".seg-{store.owner}-{os.getpid()}-0badc0de.partial"), "wb").close()
print(store.work, flush=True)
os._exit(0)  # no clean-up: as a process killed mid-run
"""


@pytest.mark.spawns
@pytest.mark.skipif(os.name == "nt", reason="the working files' owner lock is POSIX flock")
def test_the_working_files_of_this_machines_crashed_store_are_still_removed(tmp_path: Path) -> None:
    """A store that died without cleaning up released its lock: provably gone, its files are removed."""
    done = subprocess.run([sys.executable, "-c", _CRASH, str(tmp_path)], capture_output=True, text=True, check=True,
                          timeout=240, cwd=Path(__file__).resolve().parents[2],
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    work = Path(done.stdout.strip())
    rank = work.parent
    assert work.is_dir() and list(rank.glob("work-*.lock")) and list((rank / "segments").glob(".seg-*.partial"))
    store = DiskClientStateStore.lazy(tmp_path, 4, {"c": torch.zeros(3)})
    assert not work.exists() and not list((rank / "segments").glob("*.partial"))
    assert sorted(p.name for p in rank.glob("work-*")) == [f"work-{store.owner}", f"work-{store.owner}.lock"]
    store.close()
    assert not list(rank.glob("work-*"))


# ----------------------------------------------------------------------------------------------
# the class of item 3 for checkpoints: a save's temporary file is removed only when its writer is proven gone
# ----------------------------------------------------------------------------------------------
def test_a_checkpoint_save_in_another_pid_namespace_is_never_removed(tmp_path) -> None:  # noqa: ANN001
    """A ``.partial`` named with a process id that is not alive here (a container writing to the same volume) whose
    writer holds its lock survives the clean-up every save runs first; an unlocked one of a dead writer is removed;
    this process's own are never touched. On 0d0f78d the live one was deleted (its pid is not alive here)."""
    import fcntl
    import os

    from lightning_fedmeta.persistence.checkpoint_files import atomic_save, remove_stale_partials

    foreign_pid = 999_999_999  # no such process in this namespace
    live = tmp_path / f".last.ckpt.{foreign_pid}.0a1b2c3d.partial"
    dead = tmp_path / f".last.ckpt.{foreign_pid}.deadbeef.partial"
    mine = tmp_path / f".last.ckpt.{os.getpid()}.00ff00ff.partial"
    for path in (live, dead, mine):
        path.write_bytes(b"PK\x03\x04 half a checkpoint")
    with open(live, "rb") as writer:  # another open file description: as another process's writer
        fcntl.flock(writer.fileno(), fcntl.LOCK_EX)
        assert remove_stale_partials(tmp_path) == [str(dead)]
        atomic_save({"x": 1}, tmp_path / "other.ckpt")  # every save cleans up first: the live file stays
        assert live.exists() and mine.exists() and not dead.exists()
    assert remove_stale_partials(tmp_path) == [str(live)]  # its writer closed the file without renaming it
    assert mine.exists()


def test_an_atomic_write_holds_its_lock_until_the_rename(tmp_path) -> None:  # noqa: ANN001
    import fcntl

    from lightning_fedmeta.persistence.atomic_io import atomic_write, writer_gone

    seen = {}

    def write(fh) -> None:  # noqa: ANN001
        seen["held"] = not writer_gone(fh.name)
        with open(fh.name, "rb") as other:
            try:
                fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen["free"] = True
            except OSError:
                seen["free"] = False
        fh.write(b"data")

    atomic_write(tmp_path / "out.bin", write)
    assert seen == {"held": True, "free": False} and (tmp_path / "out.bin").read_bytes() == b"data"
    assert not list(tmp_path.glob("*.partial"))
