"""Loaders for the centralized image datasets that the partitioners split among clients.

Every loader returns ``(train_x, train_y, test_x, test_y)`` with ``x`` float32 ``[N, C, H, W]``
and ``y`` int64 ``[N]``. Pixels are scaled to ``[0, 1]`` and standardized per channel,

    x = (p / 255 - mean_c) / std_c,

with the statistics customarily used for each training set:

* Fashion-MNIST: mean 0.2860, std 0.3530 (Xiao, Rasul & Vollgraf, 2017, arXiv:1708.07747);
* MNIST: mean 0.1307, std 0.3081 (PyTorch ``examples/mnist``);
* CIFAR-10: mean (0.4914, 0.4822, 0.4465), std (0.2470, 0.2435, 0.2616) (Krizhevsky, 2009).

Files are read from disk with :mod:`lightning_fedmeta.data.idx` (MNIST, Fashion-MNIST) or from the
"python version" pickle batches (CIFAR-10). With ``download=True`` missing files are fetched
with ``torchvision.datasets`` into ``root``, in torchvision's layout, then read the same way.

The standardisation is element-wise (each float depends on its pixel value and channel alone), so
:class:`~lightning_fedmeta.data.datamodule.FederatedDataModule` reads the ``uint8`` pixels
(:func:`_load_pixels`), gathers the clients' rows and standardises only those: the same floats as
standardising everything first, without converting and copying the images no client uses.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from lightning_fedmeta.data.cifar import read_cifar_batch
from lightning_fedmeta.data.idx import check_idx_images, idx_labels_tensor, read_idx_arrays
from lightning_fedmeta.data.more_datasets import (
    MORE_DATASETS,
    NORMALIZATION_MORE,
    download_more,
    has_more_files,
    load_more_pixels,
)

__all__ = [
    "DEFAULT_FASHION_MNIST_ROOT",
    "IMAGE_DATASETS",
    "NORMALIZATION",
    "download_dataset",
    "has_dataset_files",
    "load_cifar10",
    "load_dataset",
    "load_fashion_mnist",
    "load_mnist",
    "read_cifar_batch",
]

CentralizedData = tuple[Tensor, Tensor, Tensor, Tensor]
#: ``(train_pixels, train_y, test_pixels, test_y)``: ``uint8 [N, C, H, W]`` arrays (possibly read-only
#: views of the decompressed files) and int64 label tensors, before standardisation.
CentralizedPixels = tuple[np.ndarray, Tensor, np.ndarray, Tensor]

#: Where the Debian package ``dataset-fashion-mnist`` installs the four ``.gz`` IDX files.
DEFAULT_FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"

#: Names accepted by :func:`load_dataset`.
IMAGE_DATASETS: tuple[str, ...] = ("fashion_mnist", "mnist", "cifar10", *MORE_DATASETS)

#: Per-channel ``(mean, std)`` applied after scaling pixels to ``[0, 1]``.
NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    **NORMALIZATION_MORE,  # CIFAR-100, EMNIST, Tiny-ImageNet: lightning_fedmeta.data.more_datasets
}

_IDX_STEMS = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
# torchvision stores MNIST-like datasets under root/<ClassName>/raw.
_TORCHVISION_FOLDER = {"fashion_mnist": "FashionMNIST", "mnist": "MNIST"}
_CIFAR_FOLDER = "cifar-10-batches-py"
_CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
_CIFAR_TEST = "test_batch"
_APT_HINT = "apt-get update && apt-get install -y dataset-fashion-mnist"


def _standardize(pixels: Tensor | np.ndarray, name: str) -> Tensor:
    """``uint8 [N, C, H, W]`` (tensor or array) -> float32 ``(p / 255 - mean_c) / std_c``, element-wise."""
    mean, std = NORMALIZATION[name]
    if isinstance(pixels, np.ndarray):  # a read-only view is fine: the float32 copy is made by NumPy
        x = torch.from_numpy(pixels.astype(np.float32)).div_(255.0)
    else:
        x = pixels.to(torch.float32).div_(255.0)
    m = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return x.sub_(m).div_(s)


def _idx_dirs(name: str, root: str | os.PathLike[str]) -> list[Path]:
    base = Path(root)
    return [base, base / _TORCHVISION_FOLDER[name] / "raw"]


def _find_idx_files(name: str, root: str | os.PathLike[str]) -> tuple[list[Path] | None, list[Path]]:
    """Locate the four IDX files (raw or ``.gz``) in ``root`` or ``root/<Folder>/raw``.

    Returns ``(found, looked_at)``; ``found`` is ``None`` when any file is missing.
    """
    looked: list[Path] = []
    found: list[Path] = []
    for stem in _IDX_STEMS:
        hit = None
        for d in _idx_dirs(name, root):
            for candidate in (d / stem, d / f"{stem}.gz"):
                looked.append(candidate)
                if hit is None and candidate.is_file():
                    hit = candidate
        if hit is None:
            return None, looked
        found.append(hit)
    return found, looked


def _cifar_paths(root: str | os.PathLike[str]) -> list[Path]:
    folder = Path(root) / _CIFAR_FOLDER
    return [folder / f for f in (*_CIFAR_TRAIN, _CIFAR_TEST)]


def _missing_message(name: str, looked: Sequence[Path]) -> str:
    shown = "\n  ".join(str(p) for p in looked)
    pretty = {"fashion_mnist": "Fashion-MNIST", "mnist": "MNIST", "cifar10": "CIFAR-10"}[name]
    if name == "fashion_mnist":
        fix = (
            f"Install the Debian package (files go to {DEFAULT_FASHION_MNIST_ROOT}): `{_APT_HINT}`, "
            "or set `download: true` with a writable `root` to fetch the files with torchvision."
        )
    else:
        fix = "Set `download: true` with a writable `root` to fetch the files with torchvision."
    return f"{pretty} files not found. Looked at:\n  {shown}\n{fix}"


def has_dataset_files(name: str, root: str | os.PathLike[str]) -> bool:
    """Whether every file :func:`load_dataset` reads for ``name`` exists under ``root``."""
    if name == "cifar10":
        return all(p.is_file() for p in _cifar_paths(root))
    if name in MORE_DATASETS:
        return has_more_files(name, root)
    if name not in _TORCHVISION_FOLDER:
        raise ValueError(f"unknown dataset {name!r}; known image datasets are {list(IMAGE_DATASETS)}")
    return _find_idx_files(name, root)[0] is not None


def download_dataset(name: str, root: str | os.PathLike[str] | None) -> None:
    """Fetch ``name`` into ``root`` with ``torchvision.datasets`` unless its files are already there.

    Uses ``torchvision.datasets.{FashionMNIST, MNIST, CIFAR10}(root, download=True)``, which writes
    ``root/FashionMNIST/raw``, ``root/MNIST/raw`` or ``root/cifar-10-batches-py``.

    Raises:
        ValueError: unknown ``name`` or ``root`` is ``None`` (a download needs a writable folder).
    """
    if name not in IMAGE_DATASETS:
        raise ValueError(f"unknown dataset {name!r}; downloadable datasets are {list(IMAGE_DATASETS)}")
    if root is None:
        raise ValueError(f"downloading {name} needs a writable `root` folder, got root=None")
    if name in MORE_DATASETS:
        download_more(name, root)
        return
    if has_dataset_files(name, root):
        return
    import torchvision.datasets as tvd

    cls = {"fashion_mnist": tvd.FashionMNIST, "mnist": tvd.MNIST, "cifar10": tvd.CIFAR10}[name]
    os.makedirs(root, exist_ok=True)
    cls(os.fspath(root), train=True, download=True)


def _standardized(pixels: CentralizedPixels, name: str) -> CentralizedData:
    train_px, train_y, test_px, test_y = pixels
    return _standardize(train_px, name), train_y, _standardize(test_px, name), test_y


def _load_idx_pixels(name: str, root: str | os.PathLike[str]) -> CentralizedPixels:
    """The four IDX files of ``name`` under ``root``, read concurrently: ``uint8 [N, 1, H, W]`` views and labels."""
    found, looked = _find_idx_files(name, root)
    if found is None:
        raise FileNotFoundError(_missing_message(name, looked))
    train_img, train_lbl, test_img, test_lbl = found
    arrays = read_idx_arrays(found)
    train_x = check_idx_images(arrays[0], train_img)[:, None]
    train_y = idx_labels_tensor(arrays[1], train_lbl)
    test_x = check_idx_images(arrays[2], test_img)[:, None]
    test_y = idx_labels_tensor(arrays[3], test_lbl)
    for split, x, y in (("train", train_x, train_y), ("test", test_x, test_y)):
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"{name} {split}: {x.shape[0]} images but {y.shape[0]} labels under {root}")
    return train_x, train_y, test_x, test_y


def _load_idx_dataset(name: str, root: str | os.PathLike[str]) -> CentralizedData:
    return _standardized(_load_idx_pixels(name, root), name)


def load_fashion_mnist(root: str | os.PathLike[str] | None = None, download: bool = False) -> CentralizedData:
    """Fashion-MNIST (Xiao et al., 2017): 60000 train / 10000 test images ``[1, 28, 28]``, 10 classes.

    Args:
        root: folder holding ``train-images-idx3-ubyte[.gz]``, ``train-labels-idx1-ubyte[.gz]``,
            ``t10k-images-idx3-ubyte[.gz]``, ``t10k-labels-idx1-ubyte[.gz]``, either directly or in
            torchvision's ``root/FashionMNIST/raw``. ``None`` means ``/usr/share/datasets/fashion-mnist``
            (Debian package ``dataset-fashion-mnist``).
        download: fetch missing files with ``torchvision.datasets.FashionMNIST`` (needs a writable root).

    Raises:
        FileNotFoundError: files missing; the message lists the paths tried and how to get them.
    """
    if download and (root is not None or not has_dataset_files("fashion_mnist", DEFAULT_FASHION_MNIST_ROOT)):
        download_dataset("fashion_mnist", root)  # root=None raises: the default folder is not writable
    return _load_idx_dataset("fashion_mnist", DEFAULT_FASHION_MNIST_ROOT if root is None else root)


def load_mnist(root: str | os.PathLike[str], download: bool = False) -> CentralizedData:
    """MNIST (LeCun et al., 1998): 60000 train / 10000 test images ``[1, 28, 28]``, 10 classes.

    Args:
        root: folder holding the four IDX files (raw or ``.gz``) directly or in ``root/MNIST/raw``.
        download: fetch missing files with ``torchvision.datasets.MNIST``.

    Raises:
        FileNotFoundError: files missing; the message lists the paths tried and how to get them.
    """
    if download:
        download_dataset("mnist", root)
    return _load_idx_dataset("mnist", root)


def load_cifar10(root: str | os.PathLike[str], download: bool = False) -> CentralizedData:
    """CIFAR-10 (Krizhevsky, 2009): 50000 train / 10000 test images ``[3, 32, 32]``, 10 classes.

    Args:
        root: folder containing ``cifar-10-batches-py/data_batch_1..5`` and ``test_batch``.
        download: fetch missing files with ``torchvision.datasets.CIFAR10``.

    Raises:
        FileNotFoundError: batches missing; the message lists the paths tried and how to get them.
    """
    if download:
        download_dataset("cifar10", root)
    return _standardized(_load_cifar_pixels(root), "cifar10")


def _load_cifar_pixels(root: str | os.PathLike[str]) -> CentralizedPixels:
    paths = _cifar_paths(root)
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(_missing_message("cifar10", paths))
    train = [read_cifar_batch(p) for p in paths[:-1]]
    test_pixels, test_y = read_cifar_batch(paths[-1])
    train_x = torch.cat([x for x, _ in train]).numpy()
    train_y = torch.cat([y for _, y in train])
    return train_x, train_y, test_pixels.numpy(), test_y


def load_dataset(
    name: str, root: str | os.PathLike[str] | None = None, download: bool = False
) -> CentralizedData:
    """Dispatch to :func:`load_fashion_mnist`, :func:`load_mnist` or :func:`load_cifar10` by name.

    Raises:
        ValueError: unknown name, or ``root`` is ``None`` for a dataset without a default location.
    """
    return _standardized(_load_pixels(name, root, download), name)


def _load_pixels(
    name: str, root: str | os.PathLike[str] | None = None, download: bool = False
) -> CentralizedPixels:
    """:func:`load_dataset` before the standardisation: ``uint8 [N, C, H, W]`` arrays (maybe read-only
    views of the files' bytes) and int64 labels, with the same checks and errors."""
    if name == "fashion_mnist":
        if download and (root is not None or not has_dataset_files(name, DEFAULT_FASHION_MNIST_ROOT)):
            download_dataset(name, root)  # root=None raises: the default folder is not writable
        return _load_idx_pixels(name, DEFAULT_FASHION_MNIST_ROOT if root is None else root)
    if name not in IMAGE_DATASETS:
        raise ValueError(f"unknown dataset {name!r}; known image datasets are {list(IMAGE_DATASETS)}")
    if root is None:
        raise ValueError(
            f"dataset {name!r} needs a `root` folder (set `root:`; add `download: true` to fetch it)"
        )
    if download:
        download_dataset(name, root)
    if name in MORE_DATASETS:
        return load_more_pixels(name, root)
    return _load_idx_pixels(name, root) if name == "mnist" else _load_cifar_pixels(root)
