"""Contracts of the federated loop: looped = batched clients, pure sampling, untouched state, metrics."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch import Tensor

from lightning_fedmeta import BatchPlan, FederatedModule
from lightning_fedmeta.client.sampling import draw_batch_indices, sample_clients
from lightning_fedmeta.evaluation.metrics import ClientMetrics
from lightning_fedmeta.persistence.memory_store import flatten_state
from tests.helpers import make_trainer, tiny_data, tiny_datamodule, tiny_linear

ALGORITHMS = {
    "fedavg": {"name": "fedavg", "local_lr": 0.2, "local_steps": 3, "batch_size": 4},
    "fedprox": {"name": "fedprox", "mu": 0.5, "local_lr": 0.2, "local_steps": 3, "batch_size": 4},
    "scaffold": {"name": "scaffold", "local_lr": 0.2, "local_steps": 3, "batch_size": 4},
}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_loop_and_vmap_client_paths_give_the_same_global_model(name: str) -> None:
    results = {}
    for mode in ("loop", "vmap"):
        module = FederatedModule(model=tiny_linear(), algorithm=ALGORITHMS[name], clients_per_round=4,
                                 client_batching=mode, seed=3)
        make_trainer(3).fit(module, tiny_datamodule(eval_every=10))
        assert module.batching == mode
        results[mode] = module
    loop, vmapped = results["loop"], results["vmap"]
    for k, v in loop.model.state_dict().items():
        torch.testing.assert_close(vmapped.model.state_dict()[k], v, atol=1e-6, rtol=0)
    for k, v in flatten_state(loop.client_states.tensors).items():
        torch.testing.assert_close(flatten_state(vmapped.client_states.tensors)[k], v, atol=1e-6, rtol=0)
    for k, v in flatten_state(loop.server_state).items():
        torch.testing.assert_close(flatten_state(vmapped.server_state)[k], v, atol=1e-6, rtol=0)
    assert not torch.equal(loop.model.weight, tiny_linear().weight)


def test_vmap_chunks_give_the_same_round_as_one_call() -> None:
    outs = []
    for chunk in (None, 2):
        module = FederatedModule(model=tiny_linear(), algorithm=ALGORITHMS["scaffold"], clients_per_round=5,
                                 client_batching="vmap", client_chunk_size=chunk)
        module.attach_data(tiny_data())
        outs.append(module.compute_round(0))
    (s1, o1, w1), (s2, o2, w2) = outs
    assert torch.equal(s1, s2)
    torch.testing.assert_close(o2.delta, o1.delta, atol=1e-6, rtol=0)
    torch.testing.assert_close(o2.state, o1.state, atol=1e-6, rtol=0)


def test_one_training_step_is_one_round() -> None:
    module = FederatedModule(model=tiny_linear(), algorithm=ALGORITHMS["fedavg"], clients_per_round=2)
    trainer = make_trainer(5)
    trainer.fit(module, tiny_datamodule(eval_every=2))
    assert trainer.global_step == 5
    assert trainer.callback_metrics["round"] == 5.0
    assert trainer.callback_metrics["clients"] == 2.0


# ----------------------------------------------------------------------------------------------
# sampling
# ----------------------------------------------------------------------------------------------
def _round_draw(module: FederatedModule, r: int) -> tuple[Tensor, Tensor]:
    assert module.data is not None
    clients = sample_clients(module.seed, r, module.eligible, module.num_sampled)
    idx, _ = draw_batch_indices(module.seed, "train", r, clients, module.data.train_offsets,
                                module.algorithm.round_plan(), int(module.data.train_counts.max()))
    return clients, idx


def test_sampling_is_a_pure_function_of_seed_and_round() -> None:
    draws = []
    for global_seed in (1, 12345):
        torch.manual_seed(global_seed)  # the global RNG must not matter
        module = FederatedModule(model=tiny_linear(), algorithm=ALGORITHMS["fedavg"], clients_per_round=3, seed=5)
        module.attach_data(tiny_data())
        torch.rand(100)
        draws.append([_round_draw(module, r) for r in range(4)])
    for (c1, i1), (c2, i2) in zip(*draws, strict=True):
        assert torch.equal(c1, c2) and torch.equal(i1, i2)
    # the module's own round uses the same clients
    module = FederatedModule(model=tiny_linear(), algorithm=ALGORITHMS["fedavg"], clients_per_round=3, seed=5)
    module.attach_data(tiny_data())
    sampled, _, _ = module.compute_round(2)
    assert torch.equal(sampled, draws[0][2][0])
    # different rounds differ (in clients or in the batches drawn)
    rounds = draws[0]
    for a in range(4):
        for b in range(a + 1, 4):
            same_clients = torch.equal(rounds[a][0], rounds[b][0])
            assert not (same_clients and torch.equal(rounds[a][1], rounds[b][1])), (a, b)
    assert len({tuple(c.tolist()) for c, _ in rounds}) > 1


def test_each_client_and_each_round_draws_its_own_batches() -> None:
    """The mini-batch seed is ``(seed, tag, round, client)``: with clients of equal sizes (so only the seed can
    tell them apart), two clients of one round draw different rows of their own data, one client draws
    different rows in two rounds, and a client's draw does not depend on which other clients share the call."""
    size, clients = 20, torch.arange(4)
    offsets = torch.arange(5) * size  # four clients of 20 samples each
    plan = BatchPlan(steps=3, per_step=2, batch_size=5)

    def local_rows(round_idx: int, which: Tensor = clients) -> Tensor:
        index, mask = draw_batch_indices(7, "train", round_idx, which, offsets, plan, size)
        assert index.shape == (which.numel(), 3, 2, 5) and bool(mask.all())
        return index - offsets[which].view(-1, 1, 1, 1)  # each client's own row numbers, 0..19

    first, second = local_rows(0), local_rows(1)
    assert bool((first >= 0).all() and (first < size).all())
    for a in range(4):
        for b in range(a + 1, 4):
            assert not torch.equal(first[a], first[b]), f"clients {a} and {b} drew the same rows in round 0"
        assert not torch.equal(first[a], second[a]), f"client {a} drew the same rows in rounds 0 and 1"
        assert torch.equal(local_rows(0, clients[a : a + 1])[0], first[a])


def test_different_module_seeds_draw_different_clients() -> None:
    data = tiny_data()
    picks = []
    for seed in (0, 1):
        module = FederatedModule(model=tiny_linear(), algorithm=ALGORITHMS["fedavg"], clients_per_round=3, seed=seed)
        module.attach_data(data)
        picks.append(torch.stack([_round_draw(module, r)[0] for r in range(6)]))
    assert not torch.equal(picks[0], picks[1])


class StatePerRound(L.Callback):
    def __init__(self) -> None:
        self.states: list[dict[str, Tensor]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        self.states.append({k: v.clone() for k, v in flatten_state(pl_module.client_states.tensors).items()})


def test_partial_participation_leaves_non_sampled_client_state_untouched() -> None:
    rec = StatePerRound()
    module = FederatedModule(model=tiny_linear(), algorithm=ALGORITHMS["scaffold"], clients_per_round=2, seed=11)
    make_trainer(3, callbacks=[rec]).fit(module, tiny_datamodule(eval_every=10))
    previous = {k: torch.zeros_like(v) for k, v in rec.states[0].items()}
    for r, state in enumerate(rec.states):
        sampled = sample_clients(11, r, torch.arange(6), 2)
        others = torch.tensor([c for c in range(6) if c not in sampled.tolist()])
        for k, v in state.items():
            assert torch.equal(v[others], previous[k][others]), (r, k)
            assert not torch.equal(v[sampled], previous[k][sampled]), (r, k)
        previous = state


# ----------------------------------------------------------------------------------------------
# metrics
# ----------------------------------------------------------------------------------------------
def test_personalized_metrics_weighted_mean_unweighted_mean_and_worst_decile() -> None:
    correct = torch.tensor([9, 4, 10, 0, 7, 3, 5, 8, 2, 6, 1, 12], dtype=torch.float64)
    total = torch.tensor([10, 8, 10, 4, 10, 6, 5, 10, 8, 12, 5, 12], dtype=torch.float64)
    loss_sum = torch.tensor([1, 4, 0.5, 6, 2, 3, 0, 2, 8, 6, 5, 1], dtype=torch.float64)
    metric = ClientMetrics({"acc": "accuracy"}, 12)
    order = torch.tensor([3, 0, 11, 5, 1, 7, 2, 10, 4, 9, 6, 8])  # update order must not matter
    for part in (order[:5], order[5:]):
        metric.update(part, {"total": total[part], "loss_sum": loss_sum[part], "builtin": correct[part, None]})
    out = metric.summaries({"all": torch.arange(12)})["all"]

    acc = [c / t for c, t in zip(correct.tolist(), total.tolist(), strict=True)]
    loss = [s / t for s, t in zip(loss_sum.tolist(), total.tolist(), strict=True)]
    worst = math.ceil(12 / 10)  # 2 clients
    assert out["acc_weighted"].item() == pytest.approx(67 / 100)
    assert out["acc_mean"].item() == pytest.approx(sum(acc) / 12)
    assert out["acc_worst10"].item() == pytest.approx((0 / 4 + 1 / 5) / worst)
    assert out["acc_worst10"].item() == pytest.approx(sum(sorted(acc)[:worst]) / worst)
    assert out["loss_weighted"].item() == pytest.approx(38.5 / 100)
    assert out["loss_mean"].item() == pytest.approx(sum(loss) / 12)
    assert out["loss_worst10"].item() == pytest.approx((6 / 4 + 1.0) / worst)  # 1.5 and 8/8 = 5/5 = 1.0

    groups = metric.summaries({"a": torch.tensor([0, 1]), "empty": torch.tensor([], dtype=torch.long)})
    assert "empty" not in groups
    assert groups["a"]["acc_weighted"].item() == pytest.approx(13 / 18)
    assert groups["a"]["acc_mean"].item() == pytest.approx((0.9 + 0.5) / 2)
    torch.testing.assert_close(groups["_per_client"]["acc"], correct / total)
    torch.testing.assert_close(groups["_per_client"]["loss"], loss_sum / total)


def test_an_algorithm_marked_not_batchable_runs_looped() -> None:
    from lightning_fedmeta.algorithms.fedavg import FedAvg

    class LoopOnly(FedAvg):
        batchable = False

    module = FederatedModule(model=torch.nn.Linear(5, 3), algorithm=LoopOnly(), clients_per_round=2)
    module.attach_data(tiny_data())
    assert module.batching == "loop"
    with pytest.raises(ValueError, match="not batchable"):
        FederatedModule(
            model=torch.nn.Linear(5, 3), algorithm=LoopOnly(), clients_per_round=2, client_batching="vmap"
        ).attach_data(tiny_data())
