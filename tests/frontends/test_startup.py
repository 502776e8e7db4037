"""The start-up speed work of issue #12 changes no number, and its shortcuts behave as the slow paths did.

* Data pinning: SHA-256 digests of the partitions, the loaders' tensors and the data modules'
  ``FederatedData`` (train/test inputs, targets and offsets: the samples, their order and values),
  computed with the code **before** the start-up changes (gzip via ``gzip.decompress``, per-class
  ``nonzero``, standardise everything then gather) and compared with what the code computes now
  (one-pass zlib, threaded reads, one stable sort, gather then standardise). Fake MNIST/CIFAR files
  are written from a seeded generator; Fashion-MNIST is pinned too where the Debian files exist.
* ``_gunzip`` = ``gzip.decompress`` (members, padding, errors); ``_indices_by_class`` = ``nonzero``.
* ``fedmeta fit ...`` builds only the fit parser; other command lines build all four.
* ``RoundProgressBar`` counts every round but redraws at most every ``mininterval`` seconds.
"""

from __future__ import annotations

import gzip
import hashlib
import pickle
import struct
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from lightning_fedmeta.cli import FedMetaCLI, _requested_subcommand, run
from lightning_fedmeta.data import (
    DEFAULT_FASHION_MNIST_ROOT,
    FederatedData,
    FederatedDataModule,
    cap_client_sizes,
    dirichlet,
    iid,
    load_cifar10,
    load_fashion_mnist,
    load_mnist,
    matching_test_split,
    perfedavg_paper,
    read_idx,
    shards,
)
from lightning_fedmeta.data.idx import _gunzip, read_idx_array, read_idx_arrays
from lightning_fedmeta.data.partition import _indices_by_class
from lightning_fedmeta.frontends.callbacks import RoundProgressBar
from tests.helpers import REPO

QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
HAS_FASHION_MNIST = Path(DEFAULT_FASHION_MNIST_ROOT, "train-images-idx3-ubyte.gz").is_file()

#: digests computed with the code of commit ac9e910, before the start-up changes (see the module docstring)
PINNED = {
    "perfedavg_paper_rand": "6b5a843396c6a3e0",
    "iid": "fffb57647988c46a",
    "dirichlet": "f6bf62fc7310cde7",
    "shards": "8672ec866455e337",
    "cap": "d007fdeba1835c43",
    "matching": "ca1a5fe2e32d3a4b",
    "load_mnist_fake": "b9cfee816a5960a0",
    "mnist_fake_perfedavg_paper": "81dcabc64ebf7987",
    "mnist_fake_iid": "e55ab55835dd0be0",
    "mnist_fake_dirichlet": "da1aa777c0e3896d",
    "mnist_fake_shards": "1d7e97ae9b8aeebe",
    "load_cifar_fake": "8834c5d01d1fe7c9",
    "cifar_fake_dirichlet": "895762296a7f3850",
    "synthetic": "d2b31f00e6525cd8",
}
PINNED_FASHION_MNIST = {
    "load_fmnist": "c88c9027ad15f4c3",
    "fmnist_perfedavg_paper": "235d1b15ab4c16fd",
    "fmnist_iid": "b3e5ba4a65d57724",
    "fmnist_dirichlet": "3a318558e3c40ff2",
}


def _digest(*tensors: Tensor) -> str:
    """SHA-256 (16 hex digits) over each tensor's dtype, shape and bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def _data_digest(data: FederatedData | None) -> str:
    assert data is not None
    return _digest(data.train_x, data.train_y, data.train_offsets, data.test_x, data.test_y, data.test_offsets)


def _write_idx(path: Path, array: np.ndarray, code: int) -> None:
    header = struct.pack(">BBBB", 0, 0, code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.tobytes()
    path.write_bytes(gzip.compress(payload) if path.suffix == ".gz" else payload)


def _pipeline_digests(tmp: Path) -> dict[str, str]:
    """The digests of :data:`PINNED`, in the exact order (one generator) they were first computed."""
    out: dict[str, str] = {}
    rng = np.random.default_rng(5)
    labels = torch.from_numpy(rng.integers(0, 10, 6000))
    out["perfedavg_paper_rand"] = _digest(*perfedavg_paper(labels, 20, 20, 3))
    parts = iid(labels, 7, 1)
    out["iid"] = _digest(*parts)
    out["dirichlet"] = _digest(*dirichlet(labels, 7, 0.3, 1))
    out["shards"] = _digest(*shards(labels, 7, 2, 1))
    out["cap"] = _digest(*cap_client_sizes(parts, 100, 2))
    test_labels = torch.from_numpy(rng.integers(0, 10, 1000))
    train_parts = dirichlet(labels, 7, 0.3, 1)
    out["matching"] = _digest(*matching_test_split([labels[p] for p in train_parts], test_labels, 4))
    n_train, n_test = 3000, 500
    y_train = rng.integers(0, 10, n_train).astype(np.uint8)
    y_test = rng.integers(0, 10, n_test).astype(np.uint8)
    _write_idx(tmp / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (n_train, 28, 28)).astype(np.uint8), 8)
    _write_idx(tmp / "train-labels-idx1-ubyte.gz", y_train, 8)
    _write_idx(tmp / "t10k-images-idx3-ubyte", rng.integers(0, 256, (n_test, 28, 28)).astype(np.uint8), 8)
    _write_idx(tmp / "t10k-labels-idx1-ubyte", y_test, 8)
    out["load_mnist_fake"] = _digest(*load_mnist(tmp))
    partitions: list[tuple[str, dict[str, Any]]] = [
        ("perfedavg_paper", {"samples_per_class": 20}), ("iid", {}), ("dirichlet", {}),
        ("shards", {"max_samples_per_client": 50}),
    ]
    for partition, kwargs in partitions:
        dm = FederatedDataModule(dataset="mnist", root=str(tmp), partition=partition, num_clients=10, data_seed=3,
                                 **kwargs)
        dm.setup("fit")
        out[f"mnist_fake_{partition}"] = _data_digest(dm.federated_data)
    cifar = tmp / "cifar-10-batches-py"
    cifar.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (200, 3072)).astype(np.uint8),
                 b"labels": list(rng.integers(0, 10, 200))}
        with open(cifar / name, "wb") as f:
            pickle.dump(batch, f)
    out["load_cifar_fake"] = _digest(*load_cifar10(tmp))
    dm = FederatedDataModule(dataset="cifar10", root=str(tmp), partition="dirichlet", num_clients=5, data_seed=1)
    dm.setup("fit")
    out["cifar_fake_dirichlet"] = _data_digest(dm.federated_data)
    dm = FederatedDataModule(dataset="synthetic", num_clients=30)
    dm.setup("fit")
    out["synthetic"] = _data_digest(dm.federated_data)
    return out


@pytest.fixture(scope="module")
def digests() -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        return _pipeline_digests(Path(tmp))


@pytest.mark.parametrize("key", sorted(PINNED))
def test_partitions_loaders_and_data_modules_are_bit_identical_to_before(digests: dict[str, str], key: str) -> None:
    assert digests[key] == PINNED[key]


@pytest.mark.skipif(not HAS_FASHION_MNIST, reason="Fashion-MNIST files not installed (dataset-fashion-mnist)")
def test_fashion_mnist_splits_are_bit_identical_to_before() -> None:
    got = {"load_fmnist": _digest(*load_fashion_mnist())}
    for partition in ("perfedavg_paper", "iid", "dirichlet"):
        dm = FederatedDataModule(dataset="fashion_mnist", partition=partition, num_clients=50)
        dm.setup("fit")
        got[f"fmnist_{partition}"] = _data_digest(dm.federated_data)
    assert got == PINNED_FASHION_MNIST


# -- the IDX reader's fast paths --------------------------------------------------------------------
def test_gunzip_matches_gzip_for_one_member_several_members_and_zero_padding() -> None:
    a, b = bytes(range(256)) * 400, b"second member"
    for raw in (gzip.compress(a), gzip.compress(a) + gzip.compress(b), gzip.compress(a) + b"\0\0\0" + gzip.compress(b),
                gzip.compress(b"")):
        assert _gunzip(raw) == gzip.decompress(raw)


@pytest.mark.parametrize("damage", ["truncated", "bad crc", "trailing garbage"])
def test_gunzip_raises_what_gzip_raises_on_a_damaged_file(damage: str) -> None:
    raw = bytearray(gzip.compress(bytes(range(256)) * 100))
    if damage == "truncated":
        raw = raw[:-20]
    elif damage == "bad crc":
        raw[-8] ^= 0xFF
    else:
        raw += b"not gzip"
    with pytest.raises(Exception) as expected:
        gzip.decompress(bytes(raw))
    with pytest.raises(type(expected.value)) as got:
        _gunzip(bytes(raw))
    assert str(got.value) == str(expected.value)


def test_idx_arrays_are_the_reader_tensors_and_the_tensor_reader_stays_writable(tmp_path: Path) -> None:
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    ints = np.array([[1, -2], [300, 4]], dtype=">i4")
    _write_idx(tmp_path / "img.gz", images, 0x08)
    _write_idx(tmp_path / "ints", ints, 0x0C)
    arrays = read_idx_arrays([tmp_path / "img.gz", tmp_path / "ints"])
    assert np.array_equal(arrays[0], images) and not arrays[0].flags.writeable  # a view of the file's bytes
    assert arrays[1].dtype == np.dtype("=i4") and np.array_equal(arrays[1], ints)
    assert np.array_equal(read_idx_array(tmp_path / "img.gz"), images)
    tensor = read_idx(tmp_path / "img.gz")
    tensor[0, 0, 0] = 7  # writable memory of its own: no NumPy "not writable" warning, no shared bytes
    assert tensor.dtype == torch.uint8 and torch.equal(tensor[1], torch.from_numpy(images[1]))


@pytest.mark.parametrize("num_classes", [3, 10])
def test_indices_by_class_equals_nonzero_per_class(num_classes: int) -> None:
    y = torch.tensor([4, 0, 2, 2, 7, 0, 4, 4, 9, 1, 2])  # classes above num_classes and missing ones
    got = _indices_by_class(y, num_classes)
    assert len(got) == num_classes
    for c in range(num_classes):
        assert torch.equal(got[c], (y == c).nonzero().flatten())


# -- the CLI builds only the parser it uses -------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "expected"),
    [(["fit", "--config", "x"], "fit"), (["validate"], "validate"), (["--config", "x", "fit"], None),
     (["--help"], None), ([], None), ({"fit": {}}, None), (["algorithms"], None)],
)
def test_requested_subcommand_is_the_first_word_only(args: Any, expected: str | None) -> None:
    assert _requested_subcommand(args, ("fit", "validate", "test", "predict")) == expected


def test_fit_builds_the_fit_parser_alone_and_still_runs(tmp_path: Path) -> None:
    cli = run(["fit", "--config", QUICKSTART, "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path),
               "--plots", "false", "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"])
    assert isinstance(cli, FedMetaCLI) and cli.trainer.global_step == 1
    parsers = cli._subcommand_parsers
    assert set(parsers) == {"fit", "validate", "test"}  # no predict (issue 31)
    fit_keys = {a.dest for a in parsers["fit"]._actions}
    assert {"trainer", "model", "data"} <= {k.split(".")[0] for k in fit_keys}
    for name in ("validate", "test"):  # registered, never parsed in this run
        assert not any(a.dest.startswith(("trainer", "model", "data")) for a in parsers[name]._actions)


def test_help_without_a_leading_subcommand_builds_and_lists_every_subcommand(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        run(["--help"])
    assert exit_info.value.code == 0
    shown = capsys.readouterr().out
    assert all(name in shown for name in ("fit", "validate", "test", "algorithms", "compare"))


def test_validate_help_still_offers_untrained_and_the_trainer_flags(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        run(["validate", "--help"])
    shown = capsys.readouterr().out
    assert "--untrained" in shown and "--trainer.max_steps" in shown and "--data.dataset" in shown


# -- the progress bar redraws at most every mininterval ---------------------------------------------------
class _FakeBar:
    def __init__(self, total: int, mininterval: float) -> None:
        self.n, self.total, self.disable, self.mininterval = 0, total, False, mininterval
        self.redraws: list[tuple[int, dict[str, Any]]] = []

    def set_postfix(self, values: dict[str, Any]) -> None:
        self.redraws.append((self.n, dict(values)))


class _QuietBar(RoundProgressBar):
    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
        return {"round": int(trainer.global_step)}


@pytest.mark.parametrize(("mininterval", "redrawn"), [(3600.0, [6]), (0.0, [1, 2, 3, 4, 5, 6])])
def test_round_progress_bar_counts_every_round_and_redraws_at_most_every_mininterval(
    mininterval: float, redrawn: list[int]
) -> None:
    bar, fake = _QuietBar(), _FakeBar(total=6, mininterval=mininterval)
    bar._train_progress_bar = fake
    bar._last_redraw = time.monotonic()  # as on_train_start leaves it
    trainer = SimpleNamespace(global_step=0)
    for step in range(1, 7):
        trainer.global_step = step
        bar.on_train_batch_end(trainer, None, None, None, step - 1)  # type: ignore[arg-type]
        assert fake.n == step  # the count never lags
    assert [n for n, _ in fake.redraws] == redrawn
    assert fake.redraws[-1][1] == {"round": 6}
    bar.on_train_epoch_end(trainer, None)  # type: ignore[arg-type]
    assert fake.redraws[-1] == (6, {"round": 6})
