"""What a Flower node is told of the population (``flower.client.population_view``: the number of clients, the
largest training-set size, its own record and label histogram) and the contract that makes it enough: a client's
own computations read only its own row and that maximum (``check_population_view`` of the testing kit; every
registered algorithm passes it in tests/algorithms/test_algorithm_conformance.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_fedmeta.algorithms.base import ClientOutput, ClientRecord
from lightning_fedmeta.algorithms.fedavg import FedAvg
from lightning_fedmeta.algorithms.fedrod import FedRoD
from lightning_fedmeta.client.functional import tree_scale
from lightning_fedmeta.flower.client import population_view
from lightning_fedmeta.testing import CHECKS, check_algorithm

ONLY_VIEW = [c for c in CHECKS if c != "check_population_view"]


def test_the_view_holds_the_clients_own_row_and_the_largest_size_only() -> None:
    record = ClientRecord(index=torch.tensor(2), weight=torch.tensor(0.25, dtype=torch.float64),
                          is_new=torch.tensor(False), seen=torch.tensor(True), num_samples=torch.tensor(7))
    view, labels = population_view(record, 4, 9, torch.tensor([[4, 0, 3]]))
    assert view.index.tolist() == [0, 1, 2, 3]
    assert view.num_samples.tolist() == [9, 9, 7, 9]  # the others' sizes are not sent: the maximum stands in
    assert view.weight.tolist() == [0, 0, 0.25, 0] and view.weight.dtype == torch.float64
    assert view.is_new.tolist() == [False] * 4 and view.seen.tolist() == [False] * 4
    assert labels.tolist() == [[0, 0, 0], [0, 0, 0], [4, 0, 3], [0, 0, 0]]
    held_out = record._replace(is_new=torch.tensor(True), weight=torch.tensor(0.0, dtype=torch.float64))
    assert population_view(held_out, 4, 9, torch.tensor([4, 0, 3]))[0].is_new.tolist() == [False, False, True, False]


class _FedAvgWithThePopulationsSize(FedAvg):
    """Reads the other clients' sizes on the client: its step is scaled by the population's mean size."""

    def bind_clients(self, clients: ClientRecord, label_counts: torch.Tensor) -> None:
        self._mean_size = float(clients.num_samples.float().mean())

    def client_update(self, ctx, params, batches, state, server_state, client) -> ClientOutput:  # type: ignore[override]
        out = super().client_update(ctx, params, batches, state, server_state, client)
        return out._replace(delta=tree_scale(out.delta, 10.0 / self._mean_size))


class _FedAvgScaledByThePopulation(FedAvg):
    """Reads the whole population's label histogram on the client: its step is scaled by the share of class 0."""

    def bind_clients(self, clients: ClientRecord, label_counts: torch.Tensor) -> None:
        totals = label_counts.sum(0).to(torch.float32)
        self._share = float(totals[0] / totals.sum().clamp_min(1))

    def client_update(self, ctx, params, batches, state, server_state, client) -> ClientOutput:  # type: ignore[override]
        out = super().client_update(ctx, params, batches, state, server_state, client)
        return out._replace(delta=tree_scale(out.delta, 0.5 + self._share))


class _FedRoDWithTheOthersWeights(FedRoD):
    """Initial personal heads that depend on every client's weight (not the client's own row)."""

    def bind_clients(self, clients: ClientRecord, label_counts: torch.Tensor) -> None:
        super().bind_clients(clients, label_counts)
        self._spread = float(clients.weight.std())

    def init_client_states(self, params, clients):  # type: ignore[override]
        states = super().init_client_states(params, clients)
        return {k: (v + self._spread if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in states.items()}


@pytest.mark.parametrize(("cls", "what"), [(_FedAvgScaledByThePopulation, "client_update"),
                                           (_FedAvgWithThePopulationsSize, "client_update"),
                                           (_FedRoDWithTheOthersWeights, "init_client_states")])
def test_the_check_refuses_a_client_that_reads_other_clients_rows(cls: type, what: str) -> None:
    with pytest.raises(AssertionError, match=f"check_population_view: client \\d+'s {what} differs"):
        check_algorithm(cls, skip=ONLY_VIEW)
