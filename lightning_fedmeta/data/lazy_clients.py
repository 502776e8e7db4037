"""A federated dataset that reads its clients once, on first use.

:class:`~lightning_fedmeta.data.leaf.LeafDataset` (LEAF's JSON files) and
:class:`~lightning_fedmeta.data.lightning_adapter.LightningDataPartition` (a ``LightningDataModule`` split among
clients) are built cheaply (the CLI builds them from YAML) and read their samples only when first asked:
:meth:`LazyClientData._load` calls :meth:`LazyClientData._read_clients` once and keeps what it returns.
"""

from __future__ import annotations

from abc import abstractmethod

from torch import Tensor

from lightning_fedmeta.data.federated import FederatedDataset

__all__ = ["ClientTensors", "LazyClientData"]

#: one client's ``(train_x, train_y, test_x, test_y)``
ClientTensors = tuple[Tensor, Tensor, Tensor, Tensor]


class LazyClientData(FederatedDataset):
    """A :class:`~lightning_fedmeta.data.federated.FederatedDataset` whose clients are read on first use.

    ``self._clients`` is ``None`` until :meth:`_load` has run :meth:`_read_clients`; a subclass sets it back to
    ``None`` to have the clients read again (when an option they depend on changes). A failed read keeps it
    ``None``, so the next use tries again and raises the same error.
    """

    _clients: list[ClientTensors] | None = None

    def client_data(self) -> list[ClientTensors]:
        """One ``(train_x, train_y, test_x, test_y)`` per client (read on the first call)."""
        self._load()
        assert self._clients is not None
        return list(self._clients)

    def _load(self) -> None:
        """Read the clients once (later calls return at once)."""
        if self._clients is None:
            self._clients = self._read_clients()

    @abstractmethod
    def _read_clients(self) -> list[ClientTensors]:
        """Read every client's samples (and whatever else the subclass learns from them: names, task, classes)."""
