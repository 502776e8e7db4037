"""Issue 25, items 8 and 15 (docs/security.md, "The client-state store and input data"): the disk store writes
only to the current run's folder and trusts nothing a checkpoint's manifest or a segment header says; input data
with non-finite values, out-of-range labels or malformed LEAF files is refused at load, naming what is wrong."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.checkpointing import CheckpointDamagedError
from lightning_fedmeta.disk_state import DiskClientStateStore
from lightning_fedmeta.state import flatten_state
from tests.helpers import make_trainer, tiny_datamodule

DITTO = {"name": "ditto", "lam": 0.1, "local_steps": 2, "local_lr": 0.1, "batch_size": 4, "finetune_steps": 1}


# ----------------------------------------------------------------------------------------------
# item 8: the disk store's folder
# ----------------------------------------------------------------------------------------------
def _ditto(client_state: str) -> FederatedModule:
    torch.manual_seed(0)
    return FederatedModule(
        model=nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)), algorithm=DITTO, clients_per_round=3,
        seed=3, client_state=client_state, server_optimizer=lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9),
    )


def _fit_in(root: Path, rounds: int, ckpt_path: Path | None = None) -> FederatedModule:
    """A disk-state Ditto run whose only folder is ``root`` (no client_state_dir: <root>/client_state)."""
    module = _ditto("disk")
    callback = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = make_trainer(rounds, enable_checkpointing=True, callbacks=[callback], default_root_dir=str(root))
    trainer.fit(module, tiny_datamodule(eval_every=2), ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return module


def _tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*") if p.is_file()}


def test_a_run_resumed_into_another_folder_writes_only_there_and_survives_the_old_folders_deletion(
        tmp_path: Path) -> None:
    straight = _ditto("memory")
    make_trainer(6).fit(straight, tiny_datamodule(eval_every=2))
    _fit_in(tmp_path / "old", 2)
    before = _tree(tmp_path / "old" / "client_state")
    moved = _fit_in(tmp_path / "new", 4, tmp_path / "old" / "ckpt" / "step=2.ckpt")
    assert Path(moved.client_states.directory) == tmp_path / "new" / "client_state" / "rank-0"
    assert _tree(tmp_path / "old" / "client_state") == before  # the old run's folder was only read
    manifest = torch.load(tmp_path / "new" / "ckpt" / "step=4.ckpt", weights_only=True)["fedmeta"]["client_state"]
    assert manifest["directory"] == str(tmp_path / "new" / "client_state") and len(manifest["segments"]) == 2
    shutil.rmtree(tmp_path / "old")
    again = _fit_in(tmp_path / "third", 6, tmp_path / "new" / "ckpt" / "step=4.ckpt")
    for name, value in straight.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], value), name
    for name, value in straight.client_states.state_dict().items():
        assert torch.equal(again.client_states.state_dict()[name], value), name
    for name, value in flatten_state(straight.server_state).items():
        assert torch.equal(flatten_state(again.server_state)[name], value), name


# ----------------------------------------------------------------------------------------------
# item 8: what a manifest and a segment may say
# ----------------------------------------------------------------------------------------------
@pytest.fixture
def saved(tmp_path: Path) -> dict[str, Any]:
    """The manifest of a 4-client store with rows 1 and 2 written (its segments in ``tmp_path/a``)."""
    store = DiskClientStateStore.lazy(tmp_path / "a", 4, {"c": torch.zeros(3)})
    store.scatter(torch.tensor([1, 2]), {"c": torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])})
    manifest = store.checkpoint_state(1)
    store.close()
    return manifest


def _segments(root: Path) -> Path:
    return root / "rank-0" / "segments"


def _restore_refused(manifest: dict[str, Any], root: Path, match: str) -> str:
    with pytest.raises(CheckpointDamagedError, match=match) as info:
        DiskClientStateStore.restore(manifest, root)
    return str(info.value)


def test_the_honest_manifest_restores_into_a_new_folder(tmp_path: Path, saved: dict[str, Any]) -> None:
    store = DiskClientStateStore.restore(saved, tmp_path / "b")
    assert torch.equal(store.gather(torch.tensor([2, 0]))["c"], torch.tensor([[4.0, 5.0, 6.0], [0.0, 0.0, 0.0]]))
    assert (_segments(tmp_path / "b") / saved["segments"][0]["file"]).is_file()


@pytest.mark.parametrize("name", ["../../../../../../../../etc/hostname", "/etc/hostname",
                                  "seg-000000001-0123456789abcdef.fseg/../../x", "sub/seg-000000001-0.fseg"])
def test_a_segment_name_that_leaves_the_folder_is_refused_before_anything_is_read(
        tmp_path: Path, saved: dict[str, Any], name: str) -> None:
    saved["segments"][0]["file"] = name
    message = _restore_refused(saved, tmp_path / "b", r"manifest entry segments\[0\]\.file")
    if os.path.isfile("/etc/hostname"):  # the old reader hashed the file and printed its SHA-256
        assert hashlib.sha256(Path("/etc/hostname").read_bytes()).hexdigest() not in message


def test_a_segment_that_links_out_of_the_folder_is_refused(tmp_path: Path, saved: dict[str, Any]) -> None:
    """A symbolic link in the segment folder, to a file elsewhere with exactly the recorded bytes: refused."""
    record = saved["segments"][0]
    segment = _segments(tmp_path / "a") / record["file"]
    outside = tmp_path / "elsewhere.bin"
    shutil.move(segment, outside)
    segment.symlink_to(outside)
    _restore_refused(saved, tmp_path / "b", r"segments\[0\]\.file .*outside the segment folder")
    _restore_refused(saved, tmp_path / "a", r"segments\[0\]\.file .*outside the segment folder")


def _forge(segments: Path, record: dict[str, Any], header: Callable[[dict[str, Any]], None] | None = None,
           body: Callable[[dict[str, Any], bytearray], None] | None = None, cut: int = 0) -> dict[str, Any]:
    """A re-sealed copy of a segment (a name and SHA-256 that match its bytes) with its header or body edited,
    or its last ``cut`` bytes removed: what someone who writes the folder and the checkpoint can produce."""
    raw = (segments / record["file"]).read_bytes()
    (length,) = struct.unpack("<Q", raw[8:16])
    head = json.loads(raw[16:16 + length])
    data = bytearray(raw[16 + length + (-(16 + length) % 64):])
    if header is not None:
        header(head)
    if body is not None:
        body(head, data)
    encoded = json.dumps(head, sort_keys=True).encode()
    prefix = b"FEDSEG01" + struct.pack("<Q", len(encoded)) + encoded
    blob = prefix + b"\0" * (-len(prefix) % 64) + bytes(data)
    blob = blob[:len(blob) - cut]
    sha = hashlib.sha256(blob).hexdigest()
    name = f"seg-000000007-{sha[:16]}.fseg"
    (segments / name).write_bytes(blob)
    return {"file": name, "sha256": sha, "rows": record["rows"]}


def _with_segment(manifest: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    return {**manifest, "segments": [record]}


def test_segment_sizes_that_disagree_with_the_file_are_refused(tmp_path: Path, saved: dict[str, Any]) -> None:
    segments, record = _segments(tmp_path / "a"), saved["segments"][0]
    bigger = _forge(segments, record, header=lambda h: h["entries"]["c"].update(nbytes=24000))
    _restore_refused(_with_segment(saved, bigger), tmp_path / "b", r"header entries\['c'\]\.nbytes is 24000, not")

    def more_rows(h: dict[str, Any]) -> None:  # sizes consistent with 1000 rows, a file with 2
        h["rows"] = 1000
        h["clients"]["nbytes"] = 8000
        h["entries"]["c"].update(nbytes=12000, offset=8000)

    past = _forge(segments, record, header=more_rows)
    _restore_refused(_with_segment(saved, past), tmp_path / "b", r"runs past the end of the file")
    truncated = _forge(segments, record, cut=50)
    _restore_refused(_with_segment(saved, truncated), tmp_path / "b",
                     r"header entries\['c'\]\.nbytes = 24 at offset 64 runs past the end of the file \(78 bytes")
    huge_header = _forge(segments, record, header=lambda h: h.update(rows=2**40))
    _restore_refused(_with_segment(saved, huge_header), tmp_path / "b", r"header rows is 1099511627776, outside")


def test_client_indices_outside_the_population_are_refused(tmp_path: Path, saved: dict[str, Any]) -> None:
    """The old reader wrote row 99 of a 4-client store past the end of its working file, without a word."""
    def far(h: dict[str, Any], data: bytearray) -> None:
        data[0:8] = struct.pack("<q", 99)

    record = _forge(_segments(tmp_path / "a"), saved["segments"][0], body=far)
    _restore_refused(_with_segment(saved, record), tmp_path / "b", r"client indices 2\.\.99, outside .*0\.\.3")


@pytest.mark.parametrize(("edit", "match"), [
    (lambda m: m["segments"][0].update(rows=-1), r"segments\[0\]\.rows is -1, outside 0\.\.4"),
    (lambda m: m["segments"][0].update(rows=10**12), r"segments\[0\]\.rows is 1000000000000, outside 0\.\.4"),
    (lambda m: m["segments"][0].update(rows=2.0), r"segments\[0\]\.rows must be an integer"),
    (lambda m: m.update(num_clients=10**18), r"num_clients is 1000000000000000000, outside"),
    (lambda m: m.update(num_clients=-4), r"num_clients is -4, outside"),
    (lambda m: m["entries"]["c"].update(dtype="torch.Tensor"), r"entries\['c'\]\.dtype names the dtype 'torch.Te"),
    (lambda m: m["entries"]["c"].update(dtype="float99"), r"entries\['c'\]\.dtype names the dtype 'float99'"),
    (lambda m: m["entries"]["c"].update(shape=[-3]), r"entries\['c'\]\.shape\[0\] is -3"),
    (lambda m: m["entries"]["c"].update(shape=[2**40, 2**40]), r"entries\['c'\]\.shape is \[1099511627776, "),
    (lambda m: m["template"].update(c=torch.zeros(5)), r"template\['c'\] is \(5,\) torch.float32, not"),
    (lambda m: m["segments"][0].update(sha256="0" * 64), r"segments\[0\]\.file .* does not carry .* sha256"),
], ids=["rows-negative", "rows-huge", "rows-float", "clients-huge", "clients-negative", "dtype-class", "dtype-unknown",
        "shape-negative", "shape-huge", "template-shape", "name-not-its-hash"])
def test_manifest_counts_shapes_and_dtypes_are_checked_before_anything_is_read(
        tmp_path: Path, saved: dict[str, Any], edit: Callable[[dict[str, Any]], None], match: str) -> None:
    edit(saved)
    _restore_refused(saved, tmp_path / "b", match)
    assert not (tmp_path / "b").exists()  # refused before the store made its folder
