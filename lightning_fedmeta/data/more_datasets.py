"""CIFAR-100, EMNIST and Tiny-ImageNet, read from the files users have (torchvision's layouts, Tiny-ImageNet's zip).

Each reader returns ``uint8 [N, C, H, W]`` pixels and int64 labels for the train and test pools, as
:func:`lightning_fedmeta.data.datasets._load_pixels` does for the other image datasets; the data module
standardises the rows the clients get with :data:`NORMALIZATION_MORE`.

* CIFAR-100 (Krizhevsky, 2009): ``root/cifar-100-python/{train,test}``, pickled dicts with ``data`` and
  ``fine_labels`` (100 classes), read by the restricted unpickler of CIFAR-10 (a pickle never runs code).
* EMNIST (Cohen, Afshar, Tapson & van Schaik, 2017, arXiv:1702.05373): ``emnist-<split>-{train,test}-
  {images-idx3,labels-idx1}-ubyte[.gz]`` directly in ``root`` or in torchvision's ``root/EMNIST/raw``. The files
  store every image transposed (column-major) relative to MNIST; torchvision's ``EMNIST`` returns them as stored.
  Here they are transposed back (``x[..., h, w] = stored[..., w, h]``), so letters and digits stand upright as in
  MNIST and in LEAF's FEMNIST (made with PIL from the NIST images). ``letters`` labels 1-26 are shifted to 0-25.
* Tiny-ImageNet (Stanford CS231n): ``root/tiny-imagenet-200`` (or ``root`` itself) with ``wnids.txt``,
  ``train/<wnid>/images/*.JPEG`` and ``val/images/*.JPEG`` + ``val/val_annotations.txt``; class ``c`` is the
  ``c``-th of the sorted wnids (the order of torchvision's ``ImageFolder``, which PFLlib uses). The validation
  images are the test pool (the official test images have no labels). Images are 64x64; grayscale ones are
  converted to RGB. Reading needs Pillow (a torchvision dependency).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from lightning_fedmeta.data.cifar import read_cifar_batch
from lightning_fedmeta.data.idx import check_idx_images, idx_labels_tensor, read_idx_arrays

__all__ = [
    "EMNIST_CLASSES",
    "MORE_DATASETS",
    "NORMALIZATION_MORE",
    "download_more",
    "has_more_files",
    "load_more_pixels",
]

#: Classes of each EMNIST split (Cohen et al., 2017, Table II; ``letters`` shifted to 0-25).
EMNIST_CLASSES: dict[str, int] = {"byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26, "digits": 10,
                                  "mnist": 10}
#: Names this module reads, with their numbers of classes.
MORE_DATASETS: dict[str, int] = {"cifar100": 100, **{f"emnist_{s}": n for s, n in EMNIST_CLASSES.items()},
                                 "tiny_imagenet": 200}
#: Per-channel ``(mean, std)`` after scaling to ``[0, 1]``: the values customarily quoted for each training set.
NORMALIZATION_MORE: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    **{f"emnist_{s}": ((0.1751,), (0.3332,)) for s in EMNIST_CLASSES},
    "tiny_imagenet": ((0.4802, 0.4481, 0.3975), (0.2770, 0.2691, 0.2821)),
}

Pixels = tuple[np.ndarray, Tensor, np.ndarray, Tensor]
_TINY = "tiny-imagenet-200"
_TINY_SIZE = (64, 64)
#: a wnid names one folder of the dataset: a plain name, never ``..``, a separator or an absolute path
_WNID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _check_name(name: str) -> None:
    if name not in MORE_DATASETS:
        raise ValueError(f"unknown dataset {name!r}; this reader knows {list(MORE_DATASETS)}")


def _cifar100_paths(root: str | os.PathLike[str]) -> list[Path]:
    return [Path(root) / "cifar-100-python" / f for f in ("train", "test")]


def _emnist_paths(split: str, root: str | os.PathLike[str]) -> tuple[list[Path] | None, list[Path]]:
    """The four EMNIST files of ``split`` (raw or ``.gz``) in ``root`` or ``root/EMNIST/raw``: ``(found, looked)``."""
    looked, found = [], []
    for part in ("train-images-idx3", "train-labels-idx1", "test-images-idx3", "test-labels-idx1"):
        stem = f"emnist-{split}-{part}-ubyte"
        hits = [d / f for d in (Path(root), Path(root) / "EMNIST" / "raw") for f in (stem, f"{stem}.gz")]
        looked += hits
        hit = next((h for h in hits if h.is_file()), None)
        if hit is None:
            return None, looked
        found.append(hit)
    return found, looked


def _tiny_root(root: str | os.PathLike[str]) -> Path:
    base = Path(root)
    return base if (base / "wnids.txt").is_file() else base / _TINY


def has_more_files(name: str, root: str | os.PathLike[str]) -> bool:
    """Whether the files :func:`load_more_pixels` reads for ``name`` are under ``root``."""
    _check_name(name)
    if name == "cifar100":
        return all(p.is_file() for p in _cifar100_paths(root))
    if name == "tiny_imagenet":
        base = _tiny_root(root)
        return (base / "wnids.txt").is_file() and (base / "val" / "val_annotations.txt").is_file()
    return _emnist_paths(name.removeprefix("emnist_"), root)[0] is not None


def download_more(name: str, root: str | os.PathLike[str]) -> None:
    """Fetch CIFAR-100 or EMNIST with ``torchvision.datasets`` into ``root`` unless the files are there.

    Raises:
        ValueError: Tiny-ImageNet, which torchvision does not download (the message says where to get it).
    """
    _check_name(name)
    if has_more_files(name, root):
        return
    if name == "tiny_imagenet":
        raise ValueError(f"torchvision cannot download Tiny-ImageNet; unzip tiny-imagenet-200.zip (CS231n) into "
                         f"{os.fspath(root)!r} and set download: false")
    import torchvision.datasets as tvd

    os.makedirs(root, exist_ok=True)
    if name == "cifar100":
        tvd.CIFAR100(os.fspath(root), train=True, download=True)
    else:
        tvd.EMNIST(os.fspath(root), split=name.removeprefix("emnist_"), train=True, download=True)


def _missing(name: str, looked: list[Path]) -> FileNotFoundError:
    shown = "\n  ".join(str(p) for p in looked)
    fix = ("unzip tiny-imagenet-200.zip there (torchvision cannot download it)" if name == "tiny_imagenet"
           else "set `download: true` with a writable `root` to fetch them with torchvision")
    return FileNotFoundError(f"{name} files not found. Looked at:\n  {shown}\nFix: {fix}")


def load_more_pixels(name: str, root: str | os.PathLike[str]) -> Pixels:
    """``(train_pixels, train_y, test_pixels, test_y)`` of ``name`` under ``root`` (see the module docstring).

    Raises:
        FileNotFoundError: files missing (the message lists the paths tried).
        ValueError: a malformed file (one line naming it).
    """
    _check_name(name)
    if name == "cifar100":
        paths = _cifar100_paths(root)
        if not all(p.is_file() for p in paths):
            raise _missing(name, paths)
        (train_x, train_y), (test_x, test_y) = (read_cifar_batch(p, label_key="fine_labels") for p in paths)
        for path, y in zip(paths, (train_y, test_y), strict=True):
            _check_labels(y, 100, path)
        return train_x.numpy(), train_y, test_x.numpy(), test_y
    if name == "tiny_imagenet":
        return _load_tiny(root)
    return _load_emnist(name.removeprefix("emnist_"), root)


def _check_labels(y: Tensor, num_classes: int, path: Path) -> None:
    if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
        raise ValueError(f"{str(path)!r}: labels must be in [0, {num_classes}), got [{int(y.min())}, {int(y.max())}]")


def _load_emnist(split: str, root: str | os.PathLike[str]) -> Pixels:
    found, looked = _emnist_paths(split, root)
    if found is None:
        raise _missing(f"emnist_{split}", looked)
    arrays = read_idx_arrays(found)
    out: list[np.ndarray | Tensor] = []
    for images, labels, img_path, lbl_path in ((arrays[0], arrays[1], found[0], found[1]),
                                               (arrays[2], arrays[3], found[2], found[3])):
        x = np.ascontiguousarray(check_idx_images(images, img_path).transpose(0, 2, 1))[:, None]
        y = idx_labels_tensor(labels, lbl_path) - (1 if split == "letters" else 0)
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"{str(img_path)!r} holds {x.shape[0]} images but {str(lbl_path)!r} {y.shape[0]} labels")
        _check_labels(y, EMNIST_CLASSES[split], lbl_path)
        out += [x, y]
    return out[0], out[1], out[2], out[3]  # type: ignore[return-value]


def _read_jpeg(path: Path) -> np.ndarray:
    """One 64x64 JPEG as ``uint8 [3, 64, 64]``; the size is checked from the header before decoding."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path, formats=["JPEG"]) as img:
            if img.size != _TINY_SIZE:
                width, height = img.size
                raise ValueError(f"{str(path)!r}: a Tiny-ImageNet image is 64x64, this one is {width}x{height}")
            return np.asarray(img.convert("RGB"), dtype=np.uint8).transpose(2, 0, 1)
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"{str(path)!r} is not a readable JPEG ({err})") from None


def _stack(paths: list[Path], labels: list[int]) -> tuple[np.ndarray, Tensor]:
    x = np.stack([_read_jpeg(p) for p in paths]) if paths else np.empty((0, 3, *_TINY_SIZE), np.uint8)
    return x, torch.tensor(labels, dtype=torch.long)


def _read_wnids(path: Path) -> list[str]:
    """The sorted class ids of ``wnids.txt``, each a plain folder name (``n01443537``: letters, digits, ``_``, ``-``
    and ``.``, not starting with a dot), so ``train/<wnid>`` is a folder of the dataset: a ``..``, a separator or
    an absolute path is refused naming the file and the line."""
    wnids = set()
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        wnid = line.strip()
        if wnid and not _WNID.fullmatch(wnid):
            raise ValueError(f"{str(path)!r} line {n}: {wnid[:80]!r} is not a class folder name (a wnid such as "
                             "'n01443537': letters, digits, '_', '-' and '.', no separator, not starting with a dot)")
        if wnid:
            wnids.add(wnid)
    return sorted(wnids)


def _load_tiny(root: str | os.PathLike[str]) -> Pixels:
    base = _tiny_root(root)
    wnids_file, annotations = base / "wnids.txt", base / "val" / "val_annotations.txt"
    if not wnids_file.is_file() or not annotations.is_file():
        raise _missing("tiny_imagenet", [wnids_file, annotations])
    wnids = _read_wnids(wnids_file)
    index = {w: i for i, w in enumerate(wnids)}
    train_paths, train_labels = [], []
    for w in wnids:
        folder = base / "train" / w / "images"
        real, inside = os.path.realpath(folder), os.path.realpath(base)
        if folder.exists() and os.path.commonpath([real, inside]) != inside:
            raise ValueError(f"{str(folder)!r}: the images of class {w} (listed in {str(wnids_file)!r}) resolve to "
                             f"{real!r}, outside the dataset {inside!r}; a link out of the dataset is never read")
        found = sorted(folder.glob("*.JPEG"))
        if not found:
            raise ValueError(f"{str(base / 'train' / w / 'images')!r} holds no *.JPEG image of class {w} "
                             f"(listed in {str(wnids_file)!r})")
        train_paths += found
        train_labels += [index[w]] * len(found)
    test_paths, test_labels = [], []
    for n, line in enumerate(annotations.read_text(encoding="utf-8").splitlines(), 1):
        fields = line.split("\t")
        if len(fields) < 2 or fields[1] not in index or "/" in fields[0] or "\\" in fields[0]:
            raise ValueError(f"{str(annotations)!r} line {n}: expected '<file>.JPEG<TAB><wnid>...' with a wnid of "
                             f"wnids.txt, got {line[:80]!r}")
        test_paths.append(base / "val" / "images" / fields[0])
        test_labels.append(index[fields[1]])
    train_x, train_y = _stack(train_paths, train_labels)
    test_x, test_y = _stack(test_paths, test_labels)
    return train_x, train_y, test_x, test_y
