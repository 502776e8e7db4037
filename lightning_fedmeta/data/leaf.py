"""Read LEAF-format federated datasets (FEMNIST, Shakespeare) from their JSON files.

Source: Caldas, Duddu, Wu, Li, Konečný, McMahan, Smith & Talwalkar, "LEAF: A Benchmark for Federated
Settings", arXiv:1812.01097 (2018); https://github.com/TalwalkarLab/leaf (file formats as written by
its ``preprocess.sh``; the Shakespeare vocabulary from ``models/utils/language_utils.py``).

Layout: ``root/train/*.json`` and ``root/test/*.json`` (LEAF writes them to
``leaf/data/<dataset>/data/{train,test}``; ``root`` may be that ``data`` folder or its parent
``leaf/data/<dataset>``). Every file holds::

    {"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}},
     "hierarchies": [...]}                     # "hierarchies" optional, ignored

A user's samples may be spread over several files of a split; they are concatenated in file-name
order. ``num_samples`` is not needed (the lengths of ``x`` and ``y`` are used and checked).
Each client is one LEAF user that appears in both train and test -- so the data must be made with
LEAF's per-sample split (``preprocess.sh ... -t sample``); its per-user split (``-t user``) gives
disjoint train and test users, which is an error here.

* FEMNIST: ``x`` = 784 pixel values per sample, ``y`` = class ids in ``[0, 62)`` (digits, upper- and
  lower-case letters). Pixels are kept as stored: LEAF stores 1.0 for the white background and values
  near 0 for the ink (the opposite polarity of MNIST; use ``1 - x`` for MNIST-like images). Inputs
  ``[n, 1, 28, 28]`` float32, targets ``[n]`` int64, task ``"classification"``, 62 classes.
* Shakespeare: ``x`` = 80-character strings, ``y`` = the next character. Characters map to their index
  in LEAF's vocabulary :data:`ALL_LETTERS` (80 characters; LEAF's ``letter_to_index`` is
  ``ALL_LETTERS.find(c)``, which gives -1 for a character outside it -- here such characters are
  replaced by ``unknown_char``, a space by default, and counted in an info message, or raise with
  ``unknown_char=None``). Inputs ``[n, 80]`` int64, targets ``[n]`` int64, task ``"next_token"``,
  ``num_classes = 80``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_fedmeta.data.lazy_clients import ClientTensors, LazyClientData

__all__ = ["ALL_LETTERS", "FEMNIST_NUM_CLASSES", "LEAF_KINDS", "LeafDataset"]

#: LEAF's Shakespeare vocabulary (``models/utils/language_utils.py``): token id = position here.
ALL_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
#: FEMNIST's classes: 10 digits, 26 upper-case and 26 lower-case letters.
FEMNIST_NUM_CLASSES = 62
#: The LEAF datasets this reader understands.
LEAF_KINDS: tuple[str, ...] = ("femnist", "shakespeare")

_LAYOUT = (
    "a LEAF dataset folder holds train/*.json and test/*.json (LEAF writes them to "
    "leaf/data/<dataset>/data/train and .../data/test with a per-sample split, e.g. "
    "`./preprocess.sh -s niid --sf 0.05 -k 0 -t sample`); pass that data folder (or its parent) as root"
)

_Arrays = tuple[np.ndarray, np.ndarray]


class LeafDataset(LazyClientData):
    """A LEAF dataset (FEMNIST or Shakespeare) with one client per LEAF user.

    The files are read on first use (``client_data()``, or ``num_classes``/``task``/``client_names``
    with ``kind="auto"``) and kept. Clients are the users present in both train and test, with at
    least ``min_samples`` train samples and one test sample, in sorted user-id order (deterministic),
    the first ``max_clients`` of them if given. Users found only in train or only in test, or with too
    few samples, are skipped and counted in an info message.

    Args:
        root: the folder with ``train/`` and ``test/`` (or its parent with ``data/train``, ``data/test``).
        kind: ``"femnist"``, ``"shakespeare"``, or ``"auto"`` (strings as ``x``: Shakespeare; lists of
            784 numbers: FEMNIST).
        max_clients: keep only the first ``max_clients`` users (sorted by id); ``None`` keeps all.
        min_samples: minimum number of train samples of a kept user, ``>= 1``.
        unknown_char: the character that replaces Shakespeare characters outside :data:`ALL_LETTERS`
            (must be in it); ``None`` raises a ``ValueError`` on such characters instead.

    Raises:
        ValueError: a missing folder (the message gives the expected layout), bad arguments, and on
            reading: files without ``users``/``user_data``, ``x``/``y`` of different lengths, samples of
            the wrong form for the kind, no user in both splits, or no user left after filtering.
    """

    def __init__(
        self,
        root: str,
        kind: Literal["femnist", "shakespeare", "auto"] = "auto",
        max_clients: int | None = None,
        min_samples: int = 1,
        unknown_char: str | None = " ",
    ) -> None:
        if kind not in (*LEAF_KINDS, "auto"):
            raise ValueError(f"kind must be one of {[*LEAF_KINDS, 'auto']}, got {kind!r}")
        if max_clients is not None and (isinstance(max_clients, bool) or not isinstance(max_clients, int)
                                        or max_clients < 1):
            raise ValueError(f"max_clients must be a positive integer or None, got {max_clients!r}")
        if isinstance(min_samples, bool) or not isinstance(min_samples, int) or min_samples < 1:
            raise ValueError(f"min_samples must be an integer >= 1, got {min_samples!r}")
        if unknown_char is not None and (len(unknown_char) != 1 or unknown_char not in ALL_LETTERS):
            raise ValueError(f"unknown_char must be one character of ALL_LETTERS or None, got {unknown_char!r}")
        self.root = root
        self.kind = kind
        self.max_clients = max_clients
        self.min_samples = min_samples
        self.unknown_char = unknown_char
        self._train_dir, self._test_dir = _resolve_layout(Path(root))
        self._clients: list[ClientTensors] | None = None
        self._names: list[str] = []
        self._kind: str | None = None if kind == "auto" else kind

    # -- the FederatedDataset members -------------------------------------------------------------

    @property
    def resolved_kind(self) -> str:
        """``"femnist"`` or ``"shakespeare"`` (reads the files first when ``kind="auto"``)."""
        if self._kind is None:
            self._load()
        assert self._kind is not None
        return self._kind

    @property
    def num_classes(self) -> int:  # type: ignore[override]
        """62 for FEMNIST, 80 (the vocabulary size) for Shakespeare."""
        return FEMNIST_NUM_CLASSES if self.resolved_kind == "femnist" else len(ALL_LETTERS)

    @property
    def task(self) -> str:
        """``"classification"`` for FEMNIST, ``"next_token"`` for Shakespeare."""
        return "classification" if self.resolved_kind == "femnist" else "next_token"

    @property
    def client_names(self) -> list[str]:
        """The LEAF user ids of the clients, in client order."""
        self._load()
        return list(self._names)

    # -- reading ------------------------------------------------------------------------------------

    def _read_clients(self) -> list[ClientTensors]:
        """One ``(train_x, train_y, test_x, test_y)`` per kept user (see the class docstring); keeps their ids."""
        train = self._read_split(self._train_dir, "train")
        test = self._read_split(self._test_dir, "test")
        both = sorted(set(train) & set(test))
        only_train, only_test = len(set(train) - set(test)), len(set(test) - set(train))
        if not both:
            raise ValueError(
                f"no LEAF user of {self.root!r} is in both train ({len(train)} users) and test ({len(test)} users); "
                "each client needs its own train and test samples, so make the data with LEAF's per-sample "
                "split (`-t sample`), not the per-user split (`-t user`)"
            )
        kept = [u for u in both if len(train[u][1]) >= self.min_samples and len(test[u][1]) >= 1]
        too_small = len(both) - len(kept)
        if not kept:
            raise ValueError(
                f"no LEAF user of {self.root!r} has >= min_samples={self.min_samples} train samples and a test "
                f"sample ({len(both)} users are in both splits)"
            )
        if self.max_clients is not None:
            kept = kept[: self.max_clients]
        skipped = []
        if only_train:
            skipped.append(f"{only_train} only in train")
        if only_test:
            skipped.append(f"{only_test} only in test")
        if too_small:
            skipped.append(f"{too_small} with < {self.min_samples} train or no test samples")
        rank_zero_info(
            f"LEAF {self._kind} from {self.root}: {len(kept)} clients"
            + (f"; skipped users: {', '.join(skipped)}" if skipped else "")
            + (f"; kept the first {self.max_clients} by user id" if self.max_clients is not None else "")
        )
        shapes = {arrays[u][0].shape[1:] for arrays in (train, test) for u in kept}
        if len(shapes) != 1:
            raise ValueError(
                f"LEAF {self._kind} samples of {self.root!r} differ in shape between users: {sorted(shapes)}"
            )
        self._names = kept
        return [
            (torch.from_numpy(train[u][0]), torch.from_numpy(train[u][1]),
             torch.from_numpy(test[u][0]), torch.from_numpy(test[u][1]))
            for u in kept
        ]

    def _read_split(self, folder: Path, split: str) -> dict[str, _Arrays]:
        files = sorted(folder.glob("*.json"))
        if not files:
            raise ValueError(f"no *.json files in {str(folder)!r}: {_LAYOUT}")
        parts: dict[str, list[_Arrays]] = {}
        unknown: dict[str, int] = {}
        for path in files:
            for user, data in _read_file(path).items():
                xs, ys = _samples(user, data, path)
                if not xs:
                    continue
                if self._kind is None:
                    self._kind = _detect_kind(xs[0], path)
                where = f"user {user!r} in {str(path)!r}"
                if self._kind == "femnist":
                    arrays = _femnist(xs, ys, where)
                else:
                    arrays = _shakespeare(xs, ys, where, unknown)
                parts.setdefault(str(user), []).append(arrays)
        if unknown:
            total = sum(unknown.values())
            shown = ", ".join(f"{c!r} ({n})" for c, n in sorted(unknown.items(), key=lambda t: -t[1])[:10])
            if self.unknown_char is None:
                raise ValueError(
                    f"{total} characters of the {split} split are not in LEAF's vocabulary ALL_LETTERS: {shown}; "
                    "pass unknown_char (e.g. ' ') to replace them"
                )
            rank_zero_info(
                f"LEAF shakespeare {split}: replaced {total} characters outside ALL_LETTERS by "
                f"{self.unknown_char!r}: {shown}"
            )
            for user, user_parts in parts.items():
                parts[user] = [(np.where(x < 0, ALL_LETTERS.index(self.unknown_char), x),
                                np.where(y < 0, ALL_LETTERS.index(self.unknown_char), y)) for x, y in user_parts]
        return {u: (np.concatenate([p[0] for p in ps]), np.concatenate([p[1] for p in ps])) for u, ps in parts.items()}


def _resolve_layout(root: Path) -> tuple[Path, Path]:
    if not root.is_dir():
        raise ValueError(f"LEAF root {str(root)!r} is not a folder: {_LAYOUT}")
    for base in (root, root / "data"):
        if (base / "train").is_dir() and (base / "test").is_dir():
            return base / "train", base / "test"
    missing = [name for name in ("train", "test") if not (root / name).is_dir()]
    raise ValueError(f"LEAF root {str(root)!r} has no {' or '.join(f'{m}/' for m in missing)} folder: {_LAYOUT}")


def _read_file(path: Path) -> dict[str, Any]:
    """The ``user_data`` of one LEAF file, after checking it is JSON with a ``users`` list and a ``user_data``
    object naming the same users (a ``ValueError`` naming the file and what is wrong)."""
    try:
        with open(path, encoding="utf-8") as f:
            content = json.load(f)
    except UnicodeDecodeError as err:
        raise ValueError(f"{str(path)!r} is not a LEAF file: it is not UTF-8 text ({err})") from err
    except json.JSONDecodeError as err:
        raise ValueError(f"{str(path)!r} is not valid JSON: {err}") from err
    except RecursionError:
        raise ValueError(f"{str(path)!r} is not a LEAF file: its JSON is nested too deeply") from None
    except ValueError as err:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise ValueError(f"{str(path)!r} is not a LEAF file: {err}") from None
    if not isinstance(content, dict) or not isinstance(content.get("user_data"), dict):
        raise ValueError(
            f"{str(path)!r} is not a LEAF file: it needs a 'user_data' object mapping each user to "
            "{'x': [...], 'y': [...]} (and a 'users' list)"
        )
    users = content.get("users")
    if not isinstance(users, list):
        raise ValueError(f"{str(path)!r} is not a LEAF file: it needs a 'users' list of the user ids in 'user_data', "
                         f"got {type(users).__name__ if users is not None else 'none'}")
    listed, given = {str(u) for u in users}, set(content["user_data"])
    if listed != given:
        odd = sorted(given - listed)[:3] or sorted(listed - given)[:3]
        raise ValueError(f"{str(path)!r}: 'users' and 'user_data' name different users (e.g. {odd}); a LEAF file "
                         "lists every user of 'user_data' in 'users'")
    return content["user_data"]


def _samples(user: str, data: Any, path: Path) -> tuple[list[Any], list[Any]]:
    """A user's ``x`` and ``y`` lists, of the same length (a ``ValueError`` naming the user and the file)."""
    if not isinstance(data, dict) or "x" not in data or "y" not in data:
        raise ValueError(f"user {user!r} in {str(path)!r} needs 'x' and 'y' lists")
    xs, ys = data["x"], data["y"]
    if not isinstance(xs, list) or not isinstance(ys, list):
        raise ValueError(f"user {user!r} in {str(path)!r}: 'x' and 'y' must be lists, got {type(xs).__name__} and "
                         f"{type(ys).__name__}")
    if len(xs) != len(ys):
        raise ValueError(f"user {user!r} in {str(path)!r} has {len(xs)} x but {len(ys)} y")
    return xs, ys


def _detect_kind(x0: Any, path: Path) -> str:
    if isinstance(x0, str):
        return "shakespeare"
    if isinstance(x0, list) and len(x0) == 784 and all(isinstance(v, (int, float)) for v in x0[:10]):
        return "femnist"
    desc = f"a list of {len(x0)} items" if isinstance(x0, list) else type(x0).__name__
    raise ValueError(
        f"cannot tell the LEAF dataset from the first sample of {str(path)!r} ({desc}); this reader knows "
        "femnist (x = 784 pixel values) and shakespeare (x = strings): pass kind= for one of them"
    )


def _femnist(xs: list[Any], ys: list[Any], where: str) -> _Arrays:
    try:
        x = np.asarray(xs, dtype=np.float32)
        y_raw = np.asarray(ys, dtype=np.float64)
    except (TypeError, ValueError, OverflowError) as err:  # OverflowError: an integer beyond float's range
        raise ValueError(f"FEMNIST {where}: x must be lists of 784 numbers and y class ids ({err})") from err
    if x.ndim != 2 or x.shape[1] != 784:
        raise ValueError(f"FEMNIST {where}: each x must have 784 pixel values, got an array of shape {x.shape}")
    bad = int(np.count_nonzero(~np.isfinite(x)))
    if bad:
        raise ValueError(f"FEMNIST {where}: x holds {bad} non-finite pixel values (NaN, Infinity, or numbers beyond "
                         "float32's range); clean the file (LEAF pixels are in [0, 1])")
    if y_raw.ndim != 1 or np.any(y_raw != np.round(y_raw)) or np.any(y_raw < 0) or np.any(y_raw >= FEMNIST_NUM_CLASSES):
        raise ValueError(f"FEMNIST {where}: y must be integer class ids in [0, {FEMNIST_NUM_CLASSES})")
    return x.reshape(-1, 1, 28, 28), y_raw.astype(np.int64)


def _encode(strings: list[Any], where: str, what: str, unknown: dict[str, int]) -> np.ndarray:
    """Token ids ``[n, L]`` (``-1`` for characters outside ALL_LETTERS, counted in ``unknown``)."""
    if not all(isinstance(s, str) for s in strings):
        raise ValueError(f"Shakespeare {where}: every {what} must be a string")
    lengths = {len(s) for s in strings}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(f"Shakespeare {where}: every {what} must have the same non-zero length, got {sorted(lengths)}")
    length = lengths.pop()
    codes = np.array(strings, dtype=f"<U{length}").view(np.uint32).reshape(len(strings), length).astype(np.int64)
    lut = np.full(max(int(codes.max()) + 1, 128), -1, dtype=np.int64)
    for i, c in enumerate(ALL_LETTERS):
        lut[ord(c)] = i
    ids = lut[codes]
    if (ids < 0).any():
        for code in codes[ids < 0].tolist():
            unknown[chr(code)] = unknown.get(chr(code), 0) + 1
    return ids


def _shakespeare(xs: list[Any], ys: list[Any], where: str, unknown: dict[str, int]) -> _Arrays:
    x = _encode(xs, where, "x", unknown)
    y = _encode(ys, where, "y", unknown)
    if y.shape[1] != 1:
        raise ValueError(f"Shakespeare {where}: every y must be one character, got strings of length {y.shape[1]}")
    return x, y[:, 0]
