"""The in-memory form of a federated dataset: every client's train and test tensors.

Any supervised task fits: the inputs ``x`` and targets ``y`` keep their shapes and dtypes
(float features or int64 token ids; int64 class ids, float regression values, ``{0, 1}``
multi-label rows, or int64 token sequences). The ``task`` names which, so the module can pick
a default loss, metrics and model (:data:`TASKS`).

All clients' samples are concatenated into one tensor per split, and ``offsets`` marks where
each client's block starts and ends: client ``i`` owns rows ``offsets[i]:offsets[i + 1]``.
This layout lets the training loop gather any client's mini-batch by index from one tensor on
the module's device (no DataLoader per client) and lets many clients be served at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["TASKS", "FederatedData", "FederatedDataset", "from_client_tensors", "infer_task"]

#: The task kinds a ``FederatedData`` can hold:
#: ``classification`` (``y [N]`` int64 class ids), ``multilabel`` (``y [N, C]`` float in {0, 1}),
#: ``regression`` (``y [N]`` or ``[N, D]`` float) and ``next_token`` (``x [N, T]`` int64 tokens,
#: ``y [N, T]`` int64 next tokens, or ``y [N]`` for the next token after the sequence).
TASKS: tuple[str, ...] = ("classification", "multilabel", "regression", "next_token")


def infer_task(x: Tensor, y: Tensor) -> str:
    """The task of ``(x, y)`` when none is named: float targets are regression (multi-label must be
    named: its targets look like regression's), int64 targets with int64 inputs are next-token
    prediction, other int64 targets are classification."""
    if y.is_floating_point():
        return "regression"
    if not x.is_floating_point() and not x.is_complex():
        return "next_token"
    return "classification"


def _as_inputs(t: object) -> Tensor:
    """Inputs keep integer dtypes (token ids, as int64); anything else becomes float32."""
    t = torch.as_tensor(t)
    if t.dtype == torch.bool or t.is_floating_point():
        return t.to(torch.float32)
    return t.to(torch.long)


def _as_targets(t: object) -> Tensor:
    """Integer targets become int64 (class ids, tokens) and keep their shape (a ``[N, 1]`` column of
    class ids becomes ``[N]``); float and bool targets become float32."""
    t = torch.as_tensor(t)
    if t.dtype == torch.bool or t.is_floating_point():
        return t.to(torch.float32)
    t = t.to(torch.long)
    return t.reshape(-1) if t.dim() == 2 and t.shape[1] == 1 else t


@dataclass
class FederatedData:
    """Per-client train/test tensors in concatenated form.

    Attributes:
        train_x: ``[N_train, *input_shape]`` inputs of every client, client-major (float32 features,
            or int64 token ids).
        train_y: ``[N_train, *target_shape]`` targets (int64 class ids or tokens; float32 values or
            multi-label rows).
        train_offsets: ``[K + 1]`` int64; client ``i`` owns ``train_x[train_offsets[i]:train_offsets[i+1]]``.
        test_x: ``[N_test, *input_shape]``, the same for the clients' test sets.
        test_y: ``[N_test, *target_shape]`` test targets.
        test_offsets: ``[K + 1]`` int64; client ``i`` owns ``test_x[test_offsets[i]:test_offsets[i+1]]``.
        num_classes: number of classes (classification, multi-label: labels per row; next-token: the
            vocabulary size); ``None`` for regression.
        client_names: optional human-readable client names (defaults to ``client_0``...).
        task: one of :data:`TASKS`; ``None`` infers it from the dtypes (:func:`infer_task`).
    """

    train_x: Tensor
    train_y: Tensor
    train_offsets: Tensor
    test_x: Tensor
    test_y: Tensor
    test_offsets: Tensor
    num_classes: int | None
    client_names: list[str] = field(default_factory=list)
    task: str | None = None

    def __post_init__(self) -> None:
        for name in ("train", "test"):
            x, y, off = getattr(self, f"{name}_x"), getattr(self, f"{name}_y"), getattr(self, f"{name}_offsets")
            if x.shape[0] != y.shape[0]:
                raise ValueError(f"{name}_x has {x.shape[0]} rows but {name}_y has {y.shape[0]}")
            if off.ndim != 1 or off[0].item() != 0 or off[-1].item() != x.shape[0]:
                raise ValueError(f"{name}_offsets must start at 0 and end at {x.shape[0]}, got {off.tolist()[:3]}...")
        if self.train_offsets.numel() != self.test_offsets.numel():
            raise ValueError(
                f"train has {self.train_offsets.numel() - 1} clients but test has {self.test_offsets.numel() - 1}"
            )
        if not self.client_names:
            self.client_names = [f"client_{i}" for i in range(self.num_clients)]
        if self.task is None:
            self.task = infer_task(self.train_x, self.train_y)
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose one of {list(TASKS)}")
        if self.train_y.shape[1:] != self.test_y.shape[1:] or self.train_y.dtype != self.test_y.dtype:
            raise ValueError(
                f"train and test targets differ: {tuple(self.train_y.shape[1:])} {self.train_y.dtype} against "
                f"{tuple(self.test_y.shape[1:])} {self.test_y.dtype}"
            )
        classes = self.task in ("classification", "next_token")
        if classes and (self.train_y.is_floating_point() or not self.num_classes or self.num_classes < 1):
            raise ValueError(
                f"a {self.task} dataset needs int64 class ids and num_classes >= 1, got targets of dtype "
                f"{self.train_y.dtype} and num_classes={self.num_classes!r}"
            )
        if self.task == "multilabel" and (self.train_y.dim() != 2 or self.num_classes != self.train_y.shape[1]):
            raise ValueError(
                f"multi-label targets must be [N, num_classes] rows of 0/1, got shape {tuple(self.train_y.shape)} "
                f"with num_classes={self.num_classes!r}"
            )
        if self.task == "regression" and not self.train_y.is_floating_point():
            raise ValueError(f"regression targets must be floating point, got {self.train_y.dtype}")

    @property
    def has_class_labels(self) -> bool:
        """Whether each sample has one int64 class id (classification), so label histograms exist."""
        return self.task == "classification"

    @property
    def target_shape(self) -> tuple[int, ...]:
        """The shape of one sample's target (``()`` for a class id or a scalar value)."""
        return tuple(self.train_y.shape[1:])

    @property
    def num_clients(self) -> int:
        return int(self.train_offsets.numel() - 1)

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])

    @property
    def train_counts(self) -> Tensor:
        """``[K]`` number of training samples of each client."""
        return self.train_offsets[1:] - self.train_offsets[:-1]

    @property
    def test_counts(self) -> Tensor:
        """``[K]`` number of test samples of each client."""
        return self.test_offsets[1:] - self.test_offsets[:-1]

    @property
    def label_counts(self) -> Tensor:
        """``[K, num_classes]`` number of training samples of each class at each client (``[K, 0]`` for
        tasks without one class id per sample)."""
        k = self.num_clients
        if not self.has_class_labels:
            return torch.zeros(k, 0, dtype=torch.long, device=self.train_y.device)
        assert self.num_classes is not None
        owner = torch.repeat_interleave(torch.arange(k, device=self.train_y.device), self.train_counts)
        counts = torch.zeros(k, self.num_classes, dtype=torch.long, device=self.train_y.device)
        counts.index_put_((owner, self.train_y), torch.ones_like(self.train_y), accumulate=True)
        return counts

    def client_train(self, i: int) -> tuple[Tensor, Tensor]:
        a, b = int(self.train_offsets[i]), int(self.train_offsets[i + 1])
        return self.train_x[a:b], self.train_y[a:b]

    def client_test(self, i: int) -> tuple[Tensor, Tensor]:
        a, b = int(self.test_offsets[i]), int(self.test_offsets[i + 1])
        return self.test_x[a:b], self.test_y[a:b]

    def check_no_empty_client(self) -> None:
        """Raise a ``ValueError`` naming the first client without train or test samples."""
        for split, counts in (("train", self.train_counts), ("test", self.test_counts)):
            empty = (counts == 0).nonzero().flatten().tolist()
            if empty:
                names = ", ".join(f"{self.client_names[i]} (index {i})" for i in empty[:5])
                raise ValueError(
                    f"the partition leaves {len(empty)} client(s) with no {split} samples: {names}. "
                    "Use fewer clients, more samples per client, or another partition."
                )

    def check_values(self) -> None:
        """Refuse values training cannot use, naming the first client that has them and how many: non-finite
        (NaN, inf) float inputs or targets, and class ids or next tokens outside ``[0, num_classes)``.

        :func:`from_client_tensors` (every user dataset, LEAF, ``LightningDataPartition``) calls it; call it on a
        ``FederatedData`` you build yourself. Without it a NaN input surfaces rounds later as a non-finite
        update that looks like a learning-rate problem, and a label past ``num_classes`` as an ``IndexError``."""
        for split in ("train", "test"):
            x, y = getattr(self, f"{split}_x"), getattr(self, f"{split}_y")
            for what, t in (("inputs", x), ("targets", y)):
                if t.is_floating_point() or t.is_complex():
                    self._refuse_rows(split, what, t, ~torch.isfinite(t), "non-finite values (NaN or inf)",
                                      "clean or drop them before training")
            if self.task in ("classification", "next_token") and self.num_classes is not None:
                self._refuse_rows(split, "targets", y, (y < 0) | (y >= self.num_classes),
                                  f"labels outside [0, num_classes={self.num_classes})",
                                  "fix the labels, or pass the dataset's true num_classes")

    def _refuse_rows(self, split: str, what: str, values: Tensor, bad: Tensor, kind: str, fix: str) -> None:
        """A ``ValueError`` naming the first client with a ``True`` in ``bad`` (``[N, ...]``), if any, its count
        of such values and the first of them."""
        flat_bad = bad.reshape(bad.shape[0], -1)
        per_row = flat_bad.sum(1)
        if not bool(per_row.any()):
            return
        offsets = getattr(self, f"{split}_offsets").to(per_row.device)
        owner = torch.searchsorted(offsets, torch.arange(per_row.numel(), device=per_row.device), right=True) - 1
        per_client = torch.zeros(self.num_clients, dtype=torch.long, device=per_row.device)
        per_client.index_add_(0, owner, per_row.long())
        first = int(per_client.nonzero()[0, 0])
        row = int(per_row.nonzero()[0, 0])  # rows are client-major: the first bad row is the first client's
        value = values.reshape(values.shape[0], -1)[row][flat_bad[row]][0].item()
        raise ValueError(
            f"client {self.client_names[first]!r} (index {first}) has {int(per_client[first])} {kind} in its "
            f"{split} {what} (the first: {value!r}); {int((per_client > 0).sum())} of {self.num_clients} clients "
            f"have such values: {fix}"
        )

    def to(self, device: torch.device | str) -> FederatedData:
        return FederatedData(
            self.train_x.to(device), self.train_y.to(device), self.train_offsets.to(device),
            self.test_x.to(device), self.test_y.to(device), self.test_offsets.to(device),
            self.num_classes, list(self.client_names), self.task,
        )


class FederatedDataset(ABC):
    """What a user's own federated data must provide to ``FederatedDataModule``.

    ``client_data()`` returns one ``(train_x, train_y, test_x, test_y)`` tuple per client
    (tensors, or anything ``torch.as_tensor`` accepts); ``num_classes`` is the number of labels
    (``None`` for regression); optional ``client_names: list[str]`` and ``task`` (one of
    :data:`TASKS`; inferred from the dtypes when absent).

    Subclass it (then LightningCLI can build your dataset from ``class_path``/``init_args`` in
    YAML), or just give any object these two members: the check is structural, like
    ``collections.abc``, so ``isinstance(obj, FederatedDataset)`` holds for duck-typed objects too.
    """

    num_classes: int | None

    @abstractmethod
    def client_data(self) -> Sequence[tuple[Tensor, Tensor, Tensor, Tensor]]:
        """One ``(train_x, train_y, test_x, test_y)`` tuple per client."""

    @classmethod
    def __subclasshook__(cls, other: type) -> bool:
        if cls is FederatedDataset and any("client_data" in vars(base) for base in other.__mro__):
            return True
        return NotImplemented


def from_client_tensors(
    clients: Sequence[tuple[Tensor, Tensor, Tensor, Tensor]],
    num_classes: int | None,
    client_names: Sequence[str] | None = None,
    task: str | None = None,
) -> FederatedData:
    """Concatenate per-client ``(train_x, train_y, test_x, test_y)`` into a ``FederatedData``.

    Inputs keep integer dtypes as int64 (tokens) and become float32 otherwise; integer targets become
    int64 (a ``[n, 1]`` column of class ids is flattened to ``[n]``), float or bool targets float32.
    Non-finite values and labels outside ``[0, num_classes)`` are refused, naming the client
    (:meth:`FederatedData.check_values`).
    """
    if len(clients) == 0:
        raise ValueError("a federated dataset needs at least one client")
    parts: dict[str, list[Tensor]] = {"trx": [], "try": [], "tex": [], "tey": []}
    for trx, try_, tex, tey in clients:
        parts["trx"].append(_as_inputs(trx))
        parts["try"].append(_as_targets(try_))
        parts["tex"].append(_as_inputs(tex))
        parts["tey"].append(_as_targets(tey))

    def offsets(ts: list[Tensor]) -> Tensor:
        counts = torch.tensor([0] + [t.shape[0] for t in ts], dtype=torch.long)
        return counts.cumsum(0)

    data = FederatedData(
        train_x=torch.cat(parts["trx"]), train_y=torch.cat(parts["try"]), train_offsets=offsets(parts["try"]),
        test_x=torch.cat(parts["tex"]), test_y=torch.cat(parts["tey"]), test_offsets=offsets(parts["tey"]),
        num_classes=None if num_classes is None else int(num_classes),
        client_names=list(client_names) if client_names else [], task=task,
    )
    data.check_values()
    return data
