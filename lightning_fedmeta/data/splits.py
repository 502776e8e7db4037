"""The splits of PFLlib, FL-bench and Flower Datasets, reproduced so their published protocols can be run here.

Every function is a pure function of its arguments: randomness comes from ``seed``, an ``int`` (a fresh
``numpy.random.RandomState(seed)``) or a ``RandomState`` passed on, so that several steps draw from one stream
in a fixed order, as PFLlib's dataset scripts do with the global NumPy generator.

* :func:`pathological` and :func:`dirichlet_min_size` -- PFLlib's ``separate_data`` (``partition="pat"`` and
  ``"dir"``, ``dataset/utils/dataset_utils.py`` of https://github.com/TsingZ0/PFLlib).
* :func:`per_client_train_test` -- PFLlib's ``split_data``: each client's rows split at random, ``train_ratio``
  0.75 (``sklearn.model_selection.train_test_split(train_size=0.75, shuffle=True)``).
* :func:`user_split` -- FL-bench's ``--split user`` (``generate_data.py`` of https://github.com/KarhouTam/FL-bench):
  whole clients held out for validation and testing.
* :func:`flower_partition` -- any ``flwr_datasets.partitioner.Partitioner`` used as-is on arrays.

Same numbers as PFLlib: PFLlib seeds ``np.random.seed(1)`` and then calls ``separate_data`` and ``split_data`` on
the global generator. Passing one ``RandomState(1)`` to :func:`pathological` (or :func:`dirichlet_min_size`) and
then to :func:`per_client_train_test` makes the same calls in the same order, so the clients' index sets are
PFLlib's (for its data order: the train set followed by the test set). Parts are returned in PFLlib's row order
(the per-client split permutes that order), not sorted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "PFLLIB_BATCH_SIZE",
    "PFLLIB_TRAIN_RATIO",
    "dirichlet_min_size",
    "flower_partition",
    "pathological",
    "per_client_train_test",
    "pfllib_least_samples",
    "user_split",
]

#: PFLlib's ``batch_size`` and ``train_ratio`` of ``dataset/utils/dataset_utils.py``, which fix its ``least_samples``.
PFLLIB_BATCH_SIZE = 10
PFLLIB_TRAIN_RATIO = 0.75

Seed = int | np.random.RandomState


def _rng(seed: Seed) -> np.random.RandomState:
    if isinstance(seed, np.random.RandomState):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer):
        raise ValueError(f"seed must be an integer or a numpy RandomState, got {seed!r}")
    return np.random.RandomState(int(seed))


def _labels(labels: Tensor | Sequence[int] | np.ndarray) -> np.ndarray:
    y = np.asarray(torch.as_tensor(labels).reshape(-1).cpu().numpy())
    if y.dtype.kind not in "iu":
        raise ValueError(f"labels must be integers, got dtype {y.dtype}")
    if y.size and int(y.min()) < 0:
        raise ValueError(f"labels must be >= 0, got minimum {int(y.min())}")
    return y.astype(np.int64)


def _check_clients(num_clients: object, n: int) -> int:
    if isinstance(num_clients, bool) or not isinstance(num_clients, int) or num_clients < 1:
        raise ValueError(f"num_clients must be a positive integer, got {num_clients!r}")
    if num_clients > n:
        raise ValueError(f"num_clients={num_clients} exceeds the number of samples ({n})")
    return num_clients


def pfllib_least_samples(num_samples: int, num_clients: int) -> int:
    """PFLlib's minimum client size: ``int(min(B / (1 - r), N / K / 2))`` with ``B = 10``, ``r = 0.75``.

    "Guarantee that each client must have at least one batch of data for testing" (PFLlib's comment): 40 rows, or
    half the mean client size when that is smaller.
    """
    return int(min(PFLLIB_BATCH_SIZE / (1 - PFLLIB_TRAIN_RATIO), num_samples / num_clients / 2))


def _pathological_sizes(
    n_class: int, n_selected: int, balance: bool, least_samples: int, num_classes: int, rng: np.random.RandomState,
) -> list[int]:
    """How many rows of one class each of its ``n_selected`` clients gets (PFLlib's ``num_samples``).

    ``m = n_class / n_selected``; balanced: ``int(m)`` each, the last client the rest; unbalanced: the first
    ``n_selected - 1`` draw ``randint(max(m / 10, least_samples / C), m)``, the last the rest.
    """
    per = n_class / n_selected
    if balance:
        sizes = [int(per)] * (n_selected - 1)
    else:
        low = max(per / 10, least_samples / num_classes)
        if n_selected > 1 and not low < per:
            raise ValueError(
                f"pathological (balance=false) cannot draw class sizes: the lower bound max(m/10, least_samples/C) = "
                f"{low:g} is not below m = {per:g} rows per client; use balance=true, fewer clients or a smaller "
                "min_client_samples"
            )
        sizes = rng.randint(low, per, n_selected - 1).tolist() if n_selected > 1 else []
    return [*sizes, n_class - sum(sizes)]


def pathological(
    labels: Tensor | Sequence[int] | np.ndarray, num_clients: int, classes_per_client: int,
    balance: bool = False, least_samples: int | None = None, seed: Seed = 0, num_classes: int | None = None,
) -> list[np.ndarray]:
    """PFLlib's pathological split (``separate_data(..., niid=True, partition="pat")``).

    Every client has ``classes_per_client`` class slots. For each class ``c = 0 .. C-1`` in turn, the clients with a
    free slot are listed in index order and the first ``ceil(K / C * classes_per_client)`` of them share class
    ``c``'s rows, *in their dataset order* (PFLlib does not shuffle here), in the sizes of
    :func:`_pathological_sizes`; each uses up a slot. Clients therefore get classes ``c, c+1, ...`` in a rotating
    pattern, and a class met when no client has a slot left is not used.

    Args:
        labels: the class of every row (``0 .. C-1``).
        num_clients: ``K``.
        classes_per_client: slots per client (PFLlib's ``class_per_client``; its scripts use 2).
        balance: equal shares of a class (``True``) or random shares (``False``, PFLlib's default ``-``).
        least_samples: the lower bound of the random shares is ``least_samples / C``; ``None`` takes
            :func:`pfllib_least_samples`.
        seed: an ``int`` or a ``RandomState`` to continue (only ``balance=False`` draws).
        num_classes: ``C``; ``None`` takes ``max(labels) + 1``.

    Returns:
        One int64 index array per client, in PFLlib's order (class by class, dataset order within a class).

    Raises:
        ValueError: bad arguments, or a client left without rows (PFLlib fails there with a ``KeyError``).
    """
    y = _labels(labels)
    _check_clients(num_clients, y.size)
    num_classes = int(y.max()) + 1 if num_classes is None else int(num_classes)
    if isinstance(classes_per_client, bool) or not isinstance(classes_per_client, int) or classes_per_client < 1:
        raise ValueError(f"classes_per_client must be an integer >= 1, got {classes_per_client!r}")
    least = pfllib_least_samples(y.size, num_clients) if least_samples is None else int(least_samples)
    rng = _rng(seed)
    slots = [classes_per_client] * num_clients
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    width = int(np.ceil((num_clients / num_classes) * classes_per_client))
    for c in range(num_classes):
        selected = [k for k in range(num_clients) if slots[k] > 0][:width]
        if not selected:
            break
        rows = np.flatnonzero(y == c)
        start = 0
        for k, n in zip(selected, _pathological_sizes(rows.size, len(selected), balance, least, num_classes, rng),
                        strict=True):
            parts[k].append(rows[start : start + n])
            start += n
            slots[k] -= 1
    return _concatenate(parts, "pathological", f"classes_per_client={classes_per_client}")


def _concatenate(parts: list[list[np.ndarray]], name: str, detail: str) -> list[np.ndarray]:
    out = [np.concatenate(p).astype(np.int64) if p else np.empty(0, np.int64) for p in parts]
    empty = [k for k, p in enumerate(out) if p.size == 0]
    if empty:
        raise ValueError(f"{name} ({detail}) leaves {len(empty)} of {len(out)} clients without rows (e.g. client "
                         f"{empty[0]}); use fewer clients or more classes per client")
    return out


def _dirichlet_round(
    y: np.ndarray, num_clients: int, alpha: float, num_classes: int, rng: np.random.RandomState,
) -> list[list[int]]:
    """One attempt of PFLlib's Dirichlet split (after Yurochkin et al., ICML 2019, IBM's PFNM ``experiment.py``).

    For each class ``k``: shuffle its rows, draw ``p ~ Dir(alpha 1_K)``, zero ``p_j`` for clients already holding
    ``>= N / K`` rows, renormalise, and cut at ``int(cumsum(p) * n_k)``.
    """
    n = y.size
    batches: list[list[int]] = [[] for _ in range(num_clients)]
    for k in range(num_classes):
        idx = np.where(y == k)[0]
        rng.shuffle(idx)
        p = rng.dirichlet(np.repeat(alpha, num_clients))
        p = np.array([q * (len(b) < n / num_clients) for q, b in zip(p, batches, strict=True)])
        p = p / p.sum()
        cuts = (np.cumsum(p) * len(idx)).astype(int)[:-1]
        batches = [b + chunk.tolist() for b, chunk in zip(batches, np.split(idx, cuts), strict=True)]
    return batches


def dirichlet_min_size(
    labels: Tensor | Sequence[int] | np.ndarray, num_clients: int, alpha: float,
    least_samples: int | None = None, max_retries: int = 100, seed: Seed = 0, num_classes: int | None = None,
) -> list[np.ndarray]:
    """PFLlib's Dirichlet split (``separate_data(..., partition="dir")``): :func:`_dirichlet_round` is repeated,
    continuing the same generator, until every client has at least ``least_samples`` rows.

    PFLlib retries without end; here at most ``max_retries`` attempts are made, then a ``ValueError`` says the
    smallest client size reached. ``least_samples=None`` takes :func:`pfllib_least_samples`. ``alpha`` is PFLlib's
    module constant (0.1 in its scripts). Parts are in PFLlib's order (class by class, shuffled within a class).
    """
    if not alpha > 0:
        raise ValueError(f"dirichlet alpha must be > 0, got {alpha!r}")
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 1:
        raise ValueError(f"max_retries must be an integer >= 1, got {max_retries!r}")
    y = _labels(labels)
    _check_clients(num_clients, y.size)
    num_classes = int(y.max()) + 1 if num_classes is None else int(num_classes)
    least = pfllib_least_samples(y.size, num_clients) if least_samples is None else int(least_samples)
    rng = _rng(seed)
    smallest = 0
    for _ in range(max_retries):
        batches = _dirichlet_round(y, num_clients, float(alpha), num_classes, rng)
        smallest = min(len(b) for b in batches)
        if smallest >= least:
            return [np.asarray(b, dtype=np.int64) for b in batches]
    raise ValueError(
        f"dirichlet_min_size: after {max_retries} attempts the smallest of {num_clients} clients still has {smallest} "
        f"rows, fewer than the minimum {least}; raise dirichlet_alpha, lower min_client_samples or num_clients, or "
        "allow more max_retries"
    )


def per_client_train_test(
    parts: Sequence[np.ndarray | Tensor], train_fraction: float = PFLLIB_TRAIN_RATIO, seed: Seed = 0,
) -> tuple[list[Tensor], list[Tensor]]:
    """Split each client's rows at random into train and test (PFLlib's ``split_data``).

    For a client with ``n`` rows, ``n_train = floor(f n)`` and ``n_test = n - n_train``; one permutation ``π`` of
    ``0 .. n-1`` per client (``rng.permutation(n)``, clients in order) gives test rows ``π[:n_test]`` and train rows
    ``π[n_test:]`` of the client's list -- what ``sklearn``'s ``train_test_split(train_size=f, shuffle=True)``
    (``ShuffleSplit``) does with the same generator. Returned as sorted int64 tensors.

    Raises:
        ValueError: ``train_fraction`` outside ``(0, 1)``, or a client whose split leaves a side empty.
    """
    if isinstance(train_fraction, bool) or not 0 < float(train_fraction) < 1:
        raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction!r}")
    rng = _rng(seed)
    train, test = [], []
    for k, part in enumerate(parts):
        rows = np.asarray(torch.as_tensor(part).cpu().numpy(), dtype=np.int64)
        n_train = math.floor(float(train_fraction) * rows.size)
        n_test = rows.size - n_train
        if n_train == 0 or n_test == 0:
            raise ValueError(f"client {k} has {rows.size} rows: train_fraction={train_fraction} leaves "
                             f"{n_train} train and {n_test} test rows; each side needs one")
        perm = rng.permutation(rows.size)
        test.append(torch.from_numpy(np.sort(rows[perm[:n_test]])))
        train.append(torch.from_numpy(np.sort(rows[perm[n_test:]])))
    return train, test


def user_split(num_clients: int, test_ratio: float = 0.25, val_ratio: float = 0.0) -> dict[str, list[int]]:
    """FL-bench's ``--split user``: the clients are cut, by index, into training, validation and test clients.

    ``n_test = int(K * test_ratio)``, ``n_val = int(K * val_ratio)``; clients ``0 .. K - n_val - n_test - 1`` train,
    the next ``n_val`` validate and the last ``n_test`` test, each with *all* of its rows (FL-bench
    ``generate_data.py``). Not random: FL-bench's partition already placed rows at random.
    """
    _check_clients(num_clients, num_clients)
    for name, r in (("test_ratio", test_ratio), ("val_ratio", val_ratio)):
        if not 0 <= r < 1:
            raise ValueError(f"{name} must be in [0, 1), got {r!r}")
    n_test, n_val = int(num_clients * test_ratio), int(num_clients * val_ratio)
    n_train = num_clients - n_test - n_val
    if n_train < 1:
        raise ValueError(f"user_split leaves no training client of {num_clients} (test {n_test}, val {n_val})")
    clients = list(range(num_clients))
    return {"train": clients[:n_train], "val": clients[n_train : n_train + n_val], "test": clients[n_train + n_val :]}


def flower_partition(partitioner: Any, labels: Tensor | Sequence[int] | np.ndarray,
                     label_column: str = "label") -> list[Tensor]:
    """The row indices of every partition of a Flower Datasets partitioner, used as-is on ``labels``.

    ``partitioner`` is any object with Flower Datasets' ``Partitioner`` API (``flwr_datasets.partitioner``:
    ``IidPartitioner``, ``DirichletPartitioner(partition_by="label", ...)``, ``PathologicalPartitioner``, ...):
    a ``dataset`` property to assign, ``num_partitions`` and ``load_partition(i)``. It is given a Hugging Face
    ``datasets.Dataset`` with the columns ``label_column`` (the labels) and ``"row"`` (``0 .. N-1``), and partition
    ``i``'s ``row`` column is client ``i``'s rows -- the split a Flower user gets, with the partitioner's own
    seed. Without the ``datasets`` package (``pip install lightning-fedmeta[flower-datasets]``) a dict-backed
    stand-in with ``select``, ``__getitem__`` and ``__len__`` is given instead, enough for a partitioner that only
    selects rows by index and reads columns.
    """
    y = _labels(labels)
    for attr in ("num_partitions", "load_partition"):
        if not hasattr(type(partitioner), attr) and not hasattr(partitioner, attr):
            raise ValueError(f"{type(partitioner).__name__} is not a Flower Datasets partitioner: it has no "
                             f"{attr!r} (expected flwr_datasets.partitioner.Partitioner's API)")
    columns = {label_column: y.tolist(), "row": list(range(y.size))}
    try:
        import datasets

        partitioner.dataset = datasets.Dataset.from_dict(columns)
    except ImportError:
        partitioner.dataset = _ColumnTable(columns)
    parts = []
    for i in range(int(partitioner.num_partitions)):
        rows = np.asarray(partitioner.load_partition(i)["row"], dtype=np.int64)
        parts.append(torch.from_numpy(np.sort(rows)))
    return parts


class _ColumnTable:
    """The part of ``datasets.Dataset`` a partitioner reads: ``len``, ``table[column]``, ``select(indices)``."""

    def __init__(self, columns: dict[str, list[Any]]) -> None:
        self.columns = columns
        self.column_names = list(columns)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values())))

    def __getitem__(self, column: str) -> list[Any]:
        return self.columns[column]

    def select(self, indices: Sequence[int]) -> _ColumnTable:
        return _ColumnTable({k: [v[int(i)] for i in indices] for k, v in self.columns.items()})
