"""The in-memory form of a federated dataset: every client's train and test tensors.

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

__all__ = ["FederatedData", "FederatedDataset", "from_client_tensors"]


@dataclass
class FederatedData:
    """Per-client train/test tensors in concatenated form.

    Attributes:
        train_x: ``[N_train, *input_shape]`` float features of every client, client-major.
        train_y: ``[N_train]`` int64 labels.
        train_offsets: ``[K + 1]`` int64; client ``i`` owns ``train_x[train_offsets[i]:train_offsets[i+1]]``.
        test_x: ``[N_test, *input_shape]``, the same for the clients' test sets.
        test_y: ``[N_test]`` int64 test labels.
        test_offsets: ``[K + 1]`` int64; client ``i`` owns ``test_x[test_offsets[i]:test_offsets[i+1]]``.
        num_classes: number of label classes.
        client_names: optional human-readable client names (defaults to ``client_0``...).
    """

    train_x: Tensor
    train_y: Tensor
    train_offsets: Tensor
    test_x: Tensor
    test_y: Tensor
    test_offsets: Tensor
    num_classes: int
    client_names: list[str] = field(default_factory=list)

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
        """``[K, num_classes]`` number of training samples of each class at each client."""
        k = self.num_clients
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

    def to(self, device: torch.device | str) -> FederatedData:
        return FederatedData(
            self.train_x.to(device), self.train_y.to(device), self.train_offsets.to(device),
            self.test_x.to(device), self.test_y.to(device), self.test_offsets.to(device),
            self.num_classes, list(self.client_names),
        )


class FederatedDataset(ABC):
    """What a user's own federated data must provide to ``FederatedDataModule``.

    ``client_data()`` returns one ``(train_x, train_y, test_x, test_y)`` tuple per client
    (tensors, or anything ``torch.as_tensor`` accepts); ``num_classes`` is the number of labels;
    optional ``client_names: list[str]``.

    Subclass it (then LightningCLI can build your dataset from ``class_path``/``init_args`` in
    YAML), or just give any object these two members: the check is structural, like
    ``collections.abc``, so ``isinstance(obj, FederatedDataset)`` holds for duck-typed objects too.
    """

    num_classes: int

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
    num_classes: int,
    client_names: Sequence[str] | None = None,
) -> FederatedData:
    """Concatenate per-client ``(train_x, train_y, test_x, test_y)`` into a ``FederatedData``."""
    if len(clients) == 0:
        raise ValueError("a federated dataset needs at least one client")
    parts: dict[str, list[Tensor]] = {"trx": [], "try": [], "tex": [], "tey": []}
    for trx, try_, tex, tey in clients:
        parts["trx"].append(torch.as_tensor(trx, dtype=torch.float32))
        parts["try"].append(torch.as_tensor(try_, dtype=torch.long).reshape(-1))
        parts["tex"].append(torch.as_tensor(tex, dtype=torch.float32))
        parts["tey"].append(torch.as_tensor(tey, dtype=torch.long).reshape(-1))

    def offsets(ts: list[Tensor]) -> Tensor:
        counts = torch.tensor([0] + [t.shape[0] for t in ts], dtype=torch.long)
        return counts.cumsum(0)

    return FederatedData(
        train_x=torch.cat(parts["trx"]), train_y=torch.cat(parts["try"]), train_offsets=offsets(parts["try"]),
        test_x=torch.cat(parts["tex"]), test_y=torch.cat(parts["tey"]), test_offsets=offsets(parts["tey"]),
        num_classes=int(num_classes), client_names=list(client_names) if client_names else [],
    )
