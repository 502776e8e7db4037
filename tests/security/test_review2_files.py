"""Issue 41 (the second security review), items 3, 6, 7, 10, 11 and 12 (docs/security.md): every size a file
declares is bounded before anything is allocated, a store deletes only what it can prove is its own, and every
reader's failure is one line naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_fedmeta.data.datasets import _load_pixels


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
