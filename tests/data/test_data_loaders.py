"""IDX / CIFAR readers and dataset loaders on small files written by the tests; synthetic data."""

from __future__ import annotations

import gzip
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_fedmeta.data import (
    DEFAULT_FASHION_MNIST_ROOT,
    load_cifar10,
    load_fashion_mnist,
    load_mnist,
    make_synthetic,
    read_cifar_batch,
    read_idx,
    read_idx_images,
    read_idx_labels,
)


def _idx_bytes(array: np.ndarray, type_code: int) -> bytes:
    """IDX encoding written independently of the reader: 0, 0, type, ndim, >u4 dims, >data."""
    header = struct.pack(">BBBB", 0, 0, type_code, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    big_endian = {0x08: ">u1", 0x0C: ">i4", 0x0D: ">f4"}[type_code]
    return header + array.astype(big_endian).tobytes()


def _write(path: Path, payload: bytes, gz: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)
    return path


def _write_mnist_like(folder: Path, n_train: int, n_test: int, gz: bool) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    arrays = (
        rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n_train).astype(np.uint8),
        rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n_test).astype(np.uint8),
    )
    stems = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte")
    stems += ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    for stem, arr in zip(stems, arrays, strict=True):
        _write(folder / stem, _idx_bytes(arr, 0x08), gz)
    return arrays


@pytest.mark.parametrize("gz", [False, True])
def test_idx_reader_reads_images_and_labels_plain_and_gz(tmp_path: Path, gz: bool) -> None:
    images = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    labels = np.array([7, 2], dtype=np.uint8)
    img = read_idx_images(_write(tmp_path / "img-idx3-ubyte", _idx_bytes(images, 0x08), gz))
    lbl = read_idx_labels(_write(tmp_path / "lbl-idx1-ubyte", _idx_bytes(labels, 0x08), gz))
    assert img.dtype == torch.uint8 and img.shape == (2, 3, 4)
    assert torch.equal(img, torch.from_numpy(images))
    assert lbl.dtype == torch.int64 and lbl.tolist() == [7, 2]


def test_idx_reader_converts_big_endian_multibyte_types(tmp_path: Path) -> None:
    ints = np.array([[1, -2], [300000, 4]], dtype=np.int32)
    floats = np.array([1.5, -0.25], dtype=np.float32)
    assert read_idx(_write(tmp_path / "i", _idx_bytes(ints, 0x0C), False)).tolist() == ints.tolist()
    assert read_idx(_write(tmp_path / "f", _idx_bytes(floats, 0x0D), True)).tolist() == floats.tolist()


def test_idx_reader_rejects_a_size_mismatch(tmp_path: Path) -> None:
    payload = _idx_bytes(np.zeros((3, 2, 2), dtype=np.uint8), 0x08)[:-1]
    with pytest.raises(ValueError, match="header says shape"):
        read_idx(_write(tmp_path / "bad", payload, False))


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_loader_reads_a_torchvision_style_root(tmp_path: Path, gz: bool) -> None:
    train_img, train_lbl, test_img, test_lbl = _write_mnist_like(tmp_path / "MNIST" / "raw", 12, 5, gz)
    train_x, train_y, test_x, test_y = load_mnist(tmp_path)
    assert train_x.shape == (12, 1, 28, 28) and test_x.shape == (5, 1, 28, 28)
    assert train_x.dtype == torch.float32 and train_y.dtype == torch.int64
    assert train_y.tolist() == train_lbl.tolist() and test_y.tolist() == test_lbl.tolist()
    expected = (torch.from_numpy(train_img).float() / 255 - 0.1307) / 0.3081
    torch.testing.assert_close(train_x[:, 0], expected)


def test_fashion_mnist_loader_reads_a_flat_root_like_the_debian_package(tmp_path: Path) -> None:
    _write_mnist_like(tmp_path, 6, 4, gz=True)
    train_x, train_y, test_x, test_y = load_fashion_mnist(tmp_path)
    assert train_x.shape == (6, 1, 28, 28) and test_y.shape == (4,)


def test_missing_fashion_mnist_files_raise_with_apt_hint_and_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        load_fashion_mnist(tmp_path / "nowhere")
    message = str(info.value)
    assert "apt-get install -y dataset-fashion-mnist" in message
    assert "download: true" in message
    assert str(tmp_path / "nowhere" / "FashionMNIST" / "raw" / "train-images-idx3-ubyte.gz") in message


def test_missing_mnist_and_cifar_files_suggest_download(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="download: true"):
        load_mnist(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"cifar-10-batches-py[/\\]data_batch_1"):
        load_cifar10(tmp_path)


@pytest.mark.skipif(
    not os.path.isdir(DEFAULT_FASHION_MNIST_ROOT), reason="Debian package dataset-fashion-mnist not installed"
)
def test_real_fashion_mnist_loads_with_standard_shapes() -> None:
    train_x, train_y, test_x, test_y = load_fashion_mnist()
    assert train_x.shape == (60000, 1, 28, 28) and test_x.shape == (10000, 1, 28, 28)
    assert train_y.shape == (60000,) and test_y.shape == (10000,)
    assert torch.equal(torch.bincount(train_y), torch.full((10,), 6000))
    assert abs(float(train_x.mean())) < 0.01 and abs(float(train_x.std()) - 1.0) < 0.01


def _write_cifar_batch(path: Path, n: int, seed: int, str_keys: bool = False) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    labels = rng.integers(0, 10, n).tolist()
    batch = {"data": data, "labels": labels} if str_keys else {b"data": data, b"labels": labels}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(batch, f)
    return data, labels


def test_cifar_batch_reader_keeps_channel_planes(tmp_path: Path) -> None:
    data, labels = _write_cifar_batch(tmp_path / "b", 3, seed=0)
    x, y = read_cifar_batch(tmp_path / "b")
    assert x.shape == (3, 3, 32, 32) and x.dtype == torch.uint8 and y.tolist() == labels
    # first 1024 bytes of a row are the red plane, row-major
    assert torch.equal(x[1, 0].flatten(), torch.from_numpy(data[1, :1024]))
    assert int(x[2, 2, 31, 0]) == int(data[2, 2048 + 31 * 32])


def test_cifar10_loader_reads_pickle_batches(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-10-batches-py"
    written = [_write_cifar_batch(folder / f"data_batch_{i}", 4, seed=i) for i in range(1, 6)]
    _, test_labels = _write_cifar_batch(folder / "test_batch", 2, seed=9, str_keys=True)
    train_x, train_y, test_x, test_y = load_cifar10(tmp_path)
    assert train_x.shape == (20, 3, 32, 32) and test_x.shape == (2, 3, 32, 32)
    assert train_y.tolist() == sum((lab for _, lab in written), [])
    assert test_y.tolist() == test_labels
    raw = torch.from_numpy(written[0][0][0].reshape(3, 32, 32)).float() / 255
    mean = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
    std = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)
    torch.testing.assert_close(train_x[0], (raw - mean) / std)


def test_synthetic_is_reproducible_from_seed() -> None:
    a, b = make_synthetic(1.0, 1.0, num_clients=10, seed=3), make_synthetic(1.0, 1.0, num_clients=10, seed=3)
    c = make_synthetic(1.0, 1.0, num_clients=10, seed=4)
    for name in ("train_x", "train_y", "train_offsets", "test_x", "test_y", "test_offsets"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert not torch.equal(a.train_offsets, c.train_offsets) or not torch.equal(a.train_x, c.train_x)


def test_synthetic_has_fedprox_shapes_sizes_and_split() -> None:
    data = make_synthetic(0.5, 0.5, num_clients=30, seed=0)
    assert data.num_clients == 30 and data.input_shape == (60,) and data.num_classes == 10
    assert data.train_x.dtype == torch.float32 and data.train_y.dtype == torch.int64
    total = data.train_counts + data.test_counts
    assert bool((total >= 50).all())
    assert torch.equal(data.train_counts, (0.9 * total.double()).long())
    data.check_no_empty_client()


def test_synthetic_clients_have_different_label_distributions() -> None:
    data = make_synthetic(1.0, 1.0, num_clients=10, seed=0)
    hists = []
    for i in range(data.num_clients):
        _, y = data.client_train(i)
        hists.append(torch.bincount(y, minlength=10).double() / y.numel())
    h = torch.stack(hists)
    majority = h.argmax(1)
    assert majority.unique().numel() > 1
    total_variation = 0.5 * (h[:, None, :] - h[None, :, :]).abs().sum(-1)
    assert float(total_variation.max()) > 0.5


def test_synthetic_iid_clients_share_one_labelling_model() -> None:
    data = make_synthetic(0.0, 0.0, num_clients=5, seed=0, iid=True)
    hists = [torch.bincount(data.client_train(i)[1], minlength=10).double() for i in range(5)]
    h = torch.stack([x / x.sum() for x in hists])
    niid = make_synthetic(1.0, 1.0, num_clients=5, seed=0)
    hn = torch.stack([torch.bincount(niid.client_train(i)[1], minlength=10).double() for i in range(5)])
    hn = hn / hn.sum(1, keepdim=True)

    def spread(m: torch.Tensor) -> float:
        return float((m - m.mean(0)).abs().sum(1).mean())

    assert spread(h) < spread(hn)


def test_synthetic_rejects_negative_alpha() -> None:
    with pytest.raises(ValueError, match="alpha=-1"):
        make_synthetic(-1.0, 0.0)
