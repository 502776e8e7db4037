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

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.data.federated import from_client_tensors
from lightning_fedmeta.data.leaf import LeafDataset
from lightning_fedmeta.data.lightning_adapter import LightningDataPartition
from lightning_fedmeta.persistence.checksums import CheckpointDamagedError
from lightning_fedmeta.persistence.disk_store import DiskClientStateStore
from lightning_fedmeta.persistence.memory_store import flatten_state
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
    _fit_in(tmp_path / "old", 2).client_states.close()  # the old run ended: its working files are gone
    before = _tree(tmp_path / "old" / "client_state")
    moved = _fit_in(tmp_path / "new", 4, tmp_path / "old" / "ckpt" / "step=2.ckpt")
    assert Path(moved.client_states.directory) == tmp_path / "new" / "client_state" / "rank-0"
    assert _tree(tmp_path / "old" / "client_state") == before  # the old run's folder was only read
    manifest = torch.load(tmp_path / "new" / "ckpt" / "step=4.ckpt", weights_only=True)["fedmeta"]
    manifest = manifest["engine"]["client_state"]
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


# ----------------------------------------------------------------------------------------------
# item 15: input data
# ----------------------------------------------------------------------------------------------
def _leaf_root(root: Path, train: Any = None, raw: bytes | None = None) -> Path:
    """A FEMNIST-shaped LEAF folder: one good test file, and a train file with ``train`` (JSON) or ``raw`` bytes."""
    good = {"users": ["u"], "num_samples": [1], "user_data": {"u": {"x": [[0.5] * 784], "y": [1]}}}
    for split in ("train", "test"):
        (root / split).mkdir(parents=True)
    (root / "test" / "t.json").write_text(json.dumps(good))
    (root / "train" / "t.json").write_bytes(raw if raw is not None else json.dumps(train).encode())
    return root


def _leaf_user(x: Any, y: Any) -> dict[str, Any]:
    return {"users": ["f0007"], "user_data": {"f0007": {"x": x, "y": y}}}


@pytest.mark.parametrize(("pixel", "bad"), [(float("nan"), "NaN"), (float("inf"), "Infinity"), (1e39, "1e+39")])
def test_leaf_non_finite_pixels_are_refused_naming_the_user_and_the_count(tmp_path: Path, pixel: float,
                                                                          bad: str) -> None:
    """JSON's NaN/Infinity, and a number past float32's range (it becomes inf), in 3 pixels of one sample."""
    train = json.dumps(_leaf_user([[0.5] * 784, [0.5] * 781 + [pixel] * 3], [1, 2]))
    assert bad in train
    root = _leaf_root(tmp_path, raw=train.encode())
    with pytest.raises(ValueError, match=r"FEMNIST user 'f0007' in '.*train/t.json': x holds 3 non-finite pixel"):
        LeafDataset(str(root)).client_data()


@pytest.mark.parametrize(("content", "match"), [
    ({"user_data": {"u": {"x": [[0.5] * 784], "y": [1]}}}, r"t.json' is not a LEAF file: it needs a 'users' list"),
    ({"users": ["u"], "num_samples": [1]}, r"t.json' is not a LEAF file: it needs a 'user_data' object"),
    ({"users": ["u", "v"], "user_data": {"u": {"x": [[0.5] * 784], "y": [1]}}},
     r"t.json': 'users' and 'user_data' name different users \(e.g. \['v'\]\)"),
    (_leaf_user(5, [1]), r"user 'f0007' in '.*t.json': 'x' and 'y' must be lists, got int and list"),
    (_leaf_user([[0.5] * 784], None), r"user 'f0007' in '.*t.json': 'x' and 'y' must be lists, got list and NoneType"),
    (_leaf_user([[0.5] * 784], [1, 2]), r"user 'f0007' in '.*t.json' has 1 x but 2 y"),
    (_leaf_user([[0.5] * 10 + ["a"] * 774], [1]), r"FEMNIST user 'f0007' in '.*t.json': x must be lists of 784 num"),
    (_leaf_user([[0.5] * 784], ["one"]), r"FEMNIST user 'f0007' in '.*t.json': x must be lists of 784 numbers and y"),
    (_leaf_user([[0.5] * 784], [62]), r"FEMNIST user 'f0007' in '.*t.json': y must be integer class ids in \[0, 62\)"),
    ([1, 2], r"t.json' is not a LEAF file: it needs a 'user_data' object"),
], ids=["no-users", "no-user_data", "users-differ", "x-number", "y-null", "length", "x-text", "y-text",
        "y-range", "a-list"])
def test_malformed_leaf_files_are_refused_in_one_line_naming_the_file(tmp_path: Path, content: Any,
                                                                     match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        LeafDataset(str(_leaf_root(tmp_path, content))).client_data()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(("raw", "match"), [(b"\xff\xfe\x00binary", r"t.json' is not a LEAF file: it is not UTF-8"),
                                            (b'{"users": [', r"t.json' is not valid JSON")], ids=["binary", "cut"])
def test_leaf_files_that_are_not_json_are_refused_naming_the_file(tmp_path: Path, raw: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LeafDataset(str(_leaf_root(tmp_path, raw=raw))).client_data()


def _clients(**change: Tensor) -> list[tuple[Tensor, ...]]:
    """Three clients of 4 train and 2 test samples, 3 features, labels in 0..2; ``change`` replaces client 1's
    ``trx``/``try_``/``tex``/``tey``."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(3):
        parts = {"trx": torch.randn(4, 3, generator=g), "try_": torch.tensor([0, 1, 2, 0]),
                 "tex": torch.randn(2, 3, generator=g), "tey": torch.tensor([1, 2])}
        if i == 1:
            parts.update(change)
        out.append((parts["trx"], parts["try_"], parts["tex"], parts["tey"]))
    return out


def test_non_finite_client_data_is_refused_naming_the_client_and_the_count() -> None:
    x = torch.randn(4, 3)
    x[1, 2], x[3, 0] = float("nan"), float("-inf")
    with pytest.raises(ValueError, match=r"client 'bob' \(index 1\) has 2 non-finite values \(NaN or inf\) in its "
                                         r"train inputs \(the first: nan\); 1 of 3 clients"):
        from_client_tensors(_clients(trx=x), 3, ["amy", "bob", "cat"])
    regression = [(trx, trx.sum(1), tex, tex.sum(1)) for trx, _, tex, _ in _clients()]
    regression[2] = (*regression[2][:3], torch.tensor([0.0, float("inf")]))
    with pytest.raises(ValueError, match=r"client 'client_2' \(index 2\) has 1 non-finite .* test targets"):
        from_client_tensors(regression, None)


_OUTSIDE = r"1 labels outside \[0, num_classes=3\) in its"


@pytest.mark.parametrize(("change", "match"), [
    ({"try_": torch.tensor([0, 1, 3, 0])}, _OUTSIDE + r" train targets \(the first: 3\)"),
    ({"tey": torch.tensor([7, 1])}, _OUTSIDE + r" test targets \(the first: 7\)"),
    ({"try_": torch.tensor([0, -1, 2, 0])}, _OUTSIDE + r" train targets \(the first: -1\)"),
], ids=["train-too-big", "test-too-big", "negative"])
def test_labels_outside_num_classes_are_refused_naming_the_client(change: dict[str, Tensor], match: str) -> None:
    """A label past num_classes was a raw IndexError at the first label count; -1 was counted as the last class."""
    with pytest.raises(ValueError, match=r"client 'client_1' \(index 1\) has " + match):
        from_client_tensors(_clients(**change), 3)


class _Loaders(L.LightningDataModule):
    """20 train and 12 test samples of 4 features, labels 0..2, ``num_classes = 3``; ``train_y``/``test_y``/
    ``train_x`` replace the defaults."""

    num_classes = 3

    def __init__(self, **given: Tensor) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.data = {"train_x": torch.randn(20, 4, generator=g), "train_y": torch.arange(20) % 3,
                     "test_x": torch.randn(12, 4, generator=g), "test_y": torch.arange(12) % 3, **given}

    def _loader(self, split: str) -> Any:
        return DataLoader(TensorDataset(self.data[f"{split}_x"], self.data[f"{split}_y"]), batch_size=8)

    def train_dataloader(self) -> Any:
        return self._loader("train")

    def test_dataloader(self) -> Any:
        return self._loader("test")


def _with(values: Tensor, index: int, value: float) -> Tensor:
    out = values.clone()
    out.view(-1)[index] = value
    return out


@pytest.mark.parametrize(("given", "partition", "match"), [
    ({"train_y": _with(torch.arange(20) % 3, 5, 5)}, "iid",
     r"train_dataloader\(\) gave 1 labels outside \[0, num_classes=3\), the first in sample 5 \(5\)"),
    ({"train_y": _with(torch.arange(20) % 3, 5, 5)}, "dirichlet", r"train_dataloader\(\) gave 1 labels outside"),
    ({"test_y": _with(torch.arange(12) % 3, 9, 7)}, "iid",
     r"test_dataloader\(\) gave 1 labels outside \[0, num_classes=3\), the first in sample 9 \(7\)"),
    ({"train_x": _with(torch.zeros(20, 4), 13, float("nan"))}, "iid",
     r"train_dataloader\(\) gave 1 input values that are not finite \(NaN or inf\), the first in sample 3 \(nan\)"),
], ids=["train-label", "train-label-dirichlet", "test-label", "nan-input"])
def test_lightning_data_partition_refuses_bad_samples_naming_the_loader_and_sample(
        given: dict[str, Tensor], partition: str, match: str) -> None:
    """Before: an IndexError at the first label count, a test label past num_classes dropped by the matching test
    split without a word, a NaN input accepted."""
    with pytest.raises(ValueError, match=match):
        LightningDataPartition(_Loaders(**given), num_clients=2, partition=partition).client_data()
