"""Every registered algorithm, with held-out and never-sampled clients (docs/design.md, contract 9).

A client is known by its explicit record (index, weight, held out or not, trained or not). For
every algorithm in the registry (built-ins and installed plugins alike) these tests check, on
clients of unequal sizes with 2 of 8 held out and 3 sampled per round:

(a) a client known only by its data (``personalize((x, y))``: index −1, new, never trained) gets the
    model a held-out client gets;
(b) the records the loop passes are right: weights over the training clients only, ``seen`` after a round.

That the logged evaluation of every client equals ``personalize(i)`` and that never-trained clients do
not read their initial state is checked for every algorithm by ``lightning_fedmeta.testing``
(tests/algorithms/test_algorithm_conformance.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_fedmeta import FederatedModule, from_client_tensors
from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.models.lora import add_lora
from lightning_fedmeta.registry import list_algorithms
from lightning_fedmeta.testing import tiny_clients
from tests.helpers import make_tiny_clients, make_trainer, tanh_mlp, tiny_linear

NUM_CLIENTS = 8
HOLDOUT = 2
SIZES = [6, 20, 9, 14, 5, 30, 8, 11]

#: extra hyper-parameters some algorithms need on this tiny problem
OVERRIDES: dict[str, dict[str, Any]] = {
    "mtl_graph": {"knn": 2},
    "mocha": {"local_iters": 20, "omega_every": 2},
    "fedmaml": {"alpha": 0.1},
}
LINEAR_ONLY = {"mocha"}
LORA_ONLY = {"fedsa_lora", "hetlora"}  # need LoRA adapters (lora_A shared, lora_B personal; ranks truncated)


def _names() -> list[str]:
    return sorted(entry.name for entry in list_algorithms())


def _model(name: str) -> nn.Module:
    if name in LORA_ONLY:
        return add_lora(tanh_mlp(), rank=2)
    return tiny_linear() if name in LINEAR_ONLY else tanh_mlp()


def _module(name: str, **kwargs: Any) -> FederatedModule:
    return FederatedModule(
        model=_model(name), algorithm={"name": name, **OVERRIDES.get(name, {})}, clients_per_round=3,
        holdout_clients=HOLDOUT, seed=1, **kwargs,
    )


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(-1) == y).float().mean())


@pytest.fixture(scope="module")
def trained() -> dict[str, FederatedModule]:
    """Each algorithm trained for 4 rounds (evaluation after rounds 2 and 4), shared by the tests below."""
    runs = {}
    for name in _names():
        module = _module(name)
        make_trainer(4).fit(module, FederatedDataModule(dataset=tiny_clients(), eval_every=2))
        runs[name] = module
    return runs


@pytest.mark.parametrize("name", _names())
def test_a_new_client_known_by_its_data_gets_the_held_out_clients_model(
    trained: dict[str, FederatedModule], name: str
) -> None:
    """``personalize((x, y))`` (index −1, new, never trained) adapts like a held-out client does: with the
    adaptation drawn from the same data (full batch), both give the same model."""
    module = trained[name]
    assert module.data is not None
    full_batch = [a for a in ("finetune_batch_size", "eval_batch_size") if hasattr(module.algorithm, a)]
    for attr in full_batch:
        setattr(module.algorithm, attr, None)
    held_out = int(module.holdout[0])
    by_index = module.personalize(held_out).state_dict()
    by_data = module.personalize(module.data.client_train(held_out)).state_dict()
    for k, v in by_index.items():
        torch.testing.assert_close(by_data[k], v, atol=1e-5, rtol=0, msg=f"{name}: {k}")


def test_records_weigh_the_training_clients_only_and_mark_who_has_trained() -> None:
    data = from_client_tensors(make_tiny_clients(NUM_CLIENTS, seed=4, train_sizes=SIZES), 3)
    for aggregation in ("samples", "uniform"):
        module = FederatedModule(model=_model("fedavg"), clients_per_round=3, holdout_clients=HOLDOUT,
                                 aggregation=aggregation)
        module.attach_data(data)
        rec = module.records(torch.arange(NUM_CLIENTS))
        train = ~module.is_holdout
        counts = torch.tensor(SIZES, dtype=torch.float64)
        expected = counts * train if aggregation == "samples" else train.to(torch.float64)
        torch.testing.assert_close(rec.weight, expected / expected.sum())
        assert torch.equal(rec.is_new, module.is_holdout)
        assert torch.equal(rec.index, torch.arange(NUM_CLIENTS))
        assert torch.equal(rec.num_samples, torch.tensor(SIZES))
        assert not bool(rec.seen.any())
    # seen flips for exactly the clients of a completed round
    module = FederatedModule(model=_model("fedavg"), clients_per_round=3, holdout_clients=HOLDOUT)
    make_trainer(1).fit(module, FederatedDataModule(dataset=tiny_clients(), eval_every=1))
    assert module.seen is not None and int(module.seen.sum()) == 3
    assert not bool(module.seen[module.holdout].any())


def test_client_update_receives_each_clients_own_record_batched_and_looped() -> None:
    from lightning_fedmeta.algorithms.fedavg import FedAvg

    sampled_by_mode: list[tuple[int, ...]] = []

    class Recording(FedAvg):
        def client_update(self, ctx, params, batches, state, server_state, client):  # noqa: ANN001, ANN201
            out = super().client_update(ctx, params, batches, state, server_state, client)
            # the record travels into the client's metrics so it can be read after vmap
            return out._replace(metrics={**out.metrics, "index": client.index.to(torch.float64),
                                         "weight": client.weight, "n": client.num_samples.to(torch.float64)})

    data = from_client_tensors(make_tiny_clients(NUM_CLIENTS, seed=4, train_sizes=SIZES), 3)
    for batching in ("vmap", "loop"):
        module = FederatedModule(model=_model("fedavg"), algorithm=Recording(local_steps=1), clients_per_round=4,
                                 holdout_clients=HOLDOUT, client_batching=batching)
        module.attach_data(data)
        sampled, out, _ = module.compute_round(0)
        assert torch.equal(out.metrics["index"].long(), sampled)
        torch.testing.assert_close(out.metrics["weight"], module.client_weight[sampled])
        assert torch.equal(out.metrics["n"].long(), torch.tensor(SIZES)[sampled])
        sampled_by_mode.append(tuple(sampled.tolist()))
    assert sampled_by_mode[0] == sampled_by_mode[1]
