"""CIFAR-100, EMNIST, Tiny-ImageNet and LEAF's FEMNIST / Shakespeare, read from small files the tests write in each
format, through the loaders and FederatedDataModule; malformed files give one line naming the file."""

from __future__ import annotations

import gzip
import json
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.data.datasets import _load_pixels, has_dataset_files
from lightning_fedmeta.data.leaf import ALL_LETTERS


def write_idx(path: Path, array: np.ndarray, compress: bool = False) -> None:
    """An IDX file (uint8) as MNIST-like datasets store them."""
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(raw) if compress else raw)


def _write_cifar100(root: Path, n_train: int = 40, n_test: int = 20) -> tuple[np.ndarray, np.ndarray]:
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    rs = np.random.RandomState(0)
    data = rs.randint(0, 256, (n_train, 3072)).astype(np.uint8)
    labels = (np.arange(n_train) * 7 % 100).tolist()
    for name, x, y in (("train", data, labels), ("test", data[:n_test], labels[:n_test])):
        with open(folder / name, "wb") as f:
            pickle.dump({b"data": x, b"fine_labels": y, b"coarse_labels": [0] * len(y)}, f, protocol=2)
    return data, np.asarray(labels)


def test_cifar100_reads_fine_labels(tmp_path):
    data, labels = _write_cifar100(tmp_path)
    assert has_dataset_files("cifar100", tmp_path)
    train_x, train_y, test_x, test_y = _load_pixels("cifar100", tmp_path)
    assert train_x.shape == (40, 3, 32, 32) and test_x.shape == (20, 3, 32, 32)
    assert np.array_equal(train_x[3, 1], data[3, 1024:2048].reshape(32, 32))  # channel-major rows
    assert train_y.tolist() == labels.tolist()


def test_cifar100_pickle_that_would_run_code_is_refused(tmp_path):
    _write_cifar100(tmp_path)
    path = tmp_path / "cifar-100-python" / "train"
    path.write_bytes(b"cos\nsystem\n(S'echo hacked'\ntR.")
    with pytest.raises(ValueError, match=r"train' is not a CIFAR-100 file: it names os\.system"):
        _load_pixels("cifar100", tmp_path)
    path.write_bytes(b"\x80\x02}q\x00")  # truncated
    with pytest.raises(ValueError, match=r"train' is not a readable CIFAR pickle"):
        _load_pixels("cifar100", tmp_path)


def _write_emnist(root: Path, split: str, labels: np.ndarray, compress: bool = True) -> np.ndarray:
    raw = root / "EMNIST" / "raw"
    images = np.random.RandomState(1).randint(0, 256, (labels.size, 28, 28)).astype(np.uint8)
    ext = ".gz" if compress else ""
    for part in ("train", "test"):
        write_idx(raw / f"emnist-{split}-{part}-images-idx3-ubyte{ext}", images, compress)
        write_idx(raw / f"emnist-{split}-{part}-labels-idx1-ubyte{ext}", labels, compress)
    return images


def test_emnist_is_transposed_upright_and_letters_start_at_zero(tmp_path):
    images = _write_emnist(tmp_path, "balanced", np.arange(12) % 47)
    train_x, train_y, _, test_y = _load_pixels("emnist_balanced", tmp_path)
    assert train_x.shape == (12, 1, 28, 28)
    assert np.array_equal(train_x[5, 0], images[5].T)  # stored column-major: read back transposed
    assert train_y.tolist() == (np.arange(12) % 47).tolist()
    _write_emnist(tmp_path, "letters", np.arange(1, 27), compress=False)
    _, letters_y, _, _ = _load_pixels("emnist_letters", tmp_path)
    assert letters_y.tolist() == list(range(26))


def test_emnist_bad_labels_name_the_file(tmp_path):
    _write_emnist(tmp_path, "digits", np.array([0, 1, 12]))
    with pytest.raises(ValueError, match=r"emnist-digits-train-labels-idx1-ubyte.gz'.*labels must be in \[0, 10\)"):
        _load_pixels("emnist_digits", tmp_path)


def test_emnist_missing_files_list_where_they_were_looked_for(tmp_path):
    with pytest.raises(FileNotFoundError,
                       match=r"(?s)emnist_byclass files not found.*EMNIST/raw/emnist-byclass-train-images"):
        _load_pixels("emnist_byclass", tmp_path)


def _write_tiny(root: Path) -> None:
    from PIL import Image

    base = root / "tiny-imagenet-200"
    wnids = ["n02", "n01"]  # listed unsorted: classes follow the sorted order
    (base / "val" / "images").mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    for k, w in enumerate(wnids):
        (base / "train" / w / "images").mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (64, 64), (10 * k, 100, 200)).save(base / "train" / w / "images" / f"{w}_{i}.JPEG")
    Image.new("L", (64, 64), 77).save(base / "val" / "images" / "val_0.JPEG")  # grayscale -> RGB
    (base / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn02\t0\t0\t63\t63\n")


def test_tiny_imagenet_layout(tmp_path):
    _write_tiny(tmp_path)
    train_x, train_y, test_x, test_y = _load_pixels("tiny_imagenet", tmp_path)
    assert train_x.shape == (4, 3, 64, 64) and train_x.dtype == np.uint8
    assert train_y.tolist() == [0, 0, 1, 1]  # n01 first
    assert test_x.shape == (1, 3, 64, 64) and test_y.tolist() == [1]
    assert abs(int(test_x[0, 2, 5, 5]) - 77) <= 2  # grayscale replicated to three channels


def test_tiny_imagenet_malformed_files_name_the_file(tmp_path):
    _write_tiny(tmp_path)
    base = tmp_path / "tiny-imagenet-200"
    (base / "train" / "n01" / "images" / "n01_0.JPEG").write_bytes(b"not a jpeg")
    with pytest.raises(ValueError, match=r"n01_0.JPEG' is not a readable JPEG"):
        _load_pixels("tiny_imagenet", tmp_path)
    _write_tiny(tmp_path / "b")
    (tmp_path / "b" / "tiny-imagenet-200" / "val" / "val_annotations.txt").write_text("val_0.JPEG\tn99\n")
    with pytest.raises(ValueError, match=r"val_annotations.txt' line 1: expected"):
        _load_pixels("tiny_imagenet", tmp_path / "b")
    with pytest.raises(ValueError, match="torchvision cannot download Tiny-ImageNet"):
        _load_pixels("tiny_imagenet", tmp_path / "c", download=True)


def test_cifar100_through_the_datamodule(tmp_path):
    _write_cifar100(tmp_path, n_train=60, n_test=30)
    dm = FederatedDataModule(dataset="cifar100", root=str(tmp_path), partition="iid", num_clients=3,
                             test_split="per_client", train_fraction=0.5)
    dm.setup()
    assert dm.num_classes == 100
    assert dm.federated_data.train_counts.tolist() == [15, 15, 15] and dm.federated_data.input_shape == (3, 32, 32)


def _write_leaf(root: Path, kind: str) -> None:
    for split in ("train", "test"):
        users = {}
        for u in ("f_b", "f_a", "f_c"):
            if kind == "femnist":
                users[u] = {"x": [[1.0] * 783 + [0.25]] * 2, "y": [3, 61]}
            else:
                users[u] = {"x": [ALL_LETTERS[:80], ALL_LETTERS[::-1]],
                            "y": ["a", "z"]}
        (root / split).mkdir(parents=True, exist_ok=True)
        (root / split / "all.json").write_text(json.dumps({"users": list(users), "num_samples": [2] * 3,
                                                           "user_data": users}))


def test_femnist_by_name_keeps_leaf_pixels_and_writers(tmp_path):
    _write_leaf(tmp_path, "femnist")
    dm = FederatedDataModule(dataset="femnist", root=str(tmp_path), num_clients=2)
    dm.setup()
    data = dm.federated_data
    assert data.client_names == ["f_a", "f_b"] and data.num_classes == 62  # first 2 writers by id
    x, y = data.client_train(0)
    assert x.shape == (2, 1, 28, 28) and float(x[0, 0, 0, 0]) == 1.0 and float(x[0, 0, 27, 27]) == 0.25
    assert y.tolist() == [3, 61]


def test_shakespeare_by_name_gives_80_character_windows(tmp_path):
    _write_leaf(tmp_path, "shakespeare")
    dm = FederatedDataModule(dataset="shakespeare", root=str(tmp_path), num_clients=3)
    dm.setup()
    x, y = dm.federated_data.client_train(0)
    assert x.shape == (2, 80) and x[0].tolist() == list(range(80))
    assert y.tolist() == [ALL_LETTERS.index("a"), ALL_LETTERS.index("z")]
    assert dm.num_classes == 80


def test_leaf_malformed_file_names_the_file(tmp_path):
    _write_leaf(tmp_path, "femnist")
    (tmp_path / "train" / "all.json").write_text("{not json")
    dm = FederatedDataModule(dataset="femnist", root=str(tmp_path))
    with pytest.raises(ValueError, match=r"all.json' is not valid JSON"):
        dm.setup()


def test_new_dataset_names_report_their_classes():
    for name, n in (("emnist_byclass", 62), ("emnist_letters", 26), ("tiny_imagenet", 200), ("cifar100", 100)):
        assert FederatedDataModule(dataset=name, root="/nonexistent").num_classes == n


@pytest.mark.parametrize("config", sorted((Path(__file__).parents[2] / "configs" / "datasets").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_dataset_config_parses_with_print_config(config, capsys):
    import yaml

    from lightning_fedmeta.cli import run

    with pytest.raises(SystemExit) as info:
        run(["fit", "--config", str(config), "--print_config"])
    assert info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    written = yaml.safe_load(config.read_text(encoding="utf-8"))
    assert printed["data"]["dataset"] == written["data"]["dataset"]
    assert printed["model"]["model"]["class_path"] == written["model"]["model"]["class_path"]
    FederatedDataModule(**written["data"])  # every data option in range (checked before any file is read)
