"""Local epochs (issue 26 item 1): ``local_epochs``/``finetune_epochs``/``drop_last``, the epoch draws, the step
groups of the engine, the refusals, and the empty-step contract (``step_budget``) of every algorithm that declares it.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.base import BatchPlan
from lightning_fedmeta.client.execution import run_clients
from lightning_fedmeta.client.functional import Batch
from lightning_fedmeta.client.sampling import draw_batch_indices, epoch_steps
from lightning_fedmeta.data.federated import from_client_tensors
from lightning_fedmeta.loop.grouping import GROUP_RATIO, padding_waste, step_groups
from lightning_fedmeta.registry import list_algorithms, load_algorithm
from tests.helpers import NUM_CLASSES, NUM_FEATURES, make_tiny_clients


def _budget_algorithms() -> list[str]:
    """Every registered algorithm that declares ``step_budget`` (entry points of the installed distribution that
    this checkout does not hold are passed over)."""
    names = []
    for entry in list_algorithms():
        try:
            cls = load_algorithm(entry.name)
        except ImportError:
            continue
        if cls.step_budget:
            names.append(entry.name)
    return sorted(set(names))


def _module(algorithm: dict, *, sizes: list[int], batching: str = "loop", seed: int = 3, **kwargs) -> FederatedModule:
    """A module on tiny clients of the given training ``sizes`` (every client in every round)."""
    cls = load_algorithm(algorithm["name"])
    torch.manual_seed(0)
    model = cls.example_model((NUM_FEATURES,), NUM_CLASSES) or nn.Sequential(
        nn.Linear(NUM_FEATURES, 8), nn.Tanh(), nn.Linear(8, NUM_CLASSES))
    m = FederatedModule(model=model, algorithm={**cls.example_arguments(), **algorithm},
                        clients_per_round=len(sizes), client_batching=batching, compile_clients=False, seed=seed,
                        **kwargs)
    m.attach_data(from_client_tensors(make_tiny_clients(len(sizes), train_sizes=sizes), NUM_CLASSES))
    return m


def _assert_trees_close(a, b, atol: float) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_trees_close(a[k], b[k], atol)
    elif isinstance(a, tuple):
        for x, y in zip(a, b, strict=True):
            _assert_trees_close(x, y, atol)
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


# ----------------------------------------------------------------------------------------------
# the empty-step contract
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", _budget_algorithms())
def test_appended_empty_steps_change_nothing(name: str) -> None:
    """For every registered algorithm with ``step_budget = True``: client_update on batches of T steps (clients of
    unequal sizes, some with their last steps already empty) equals client_update on the same batches with k
    all-masked steps appended."""
    m = _module({"name": name, "local_steps": 3, "batch_size": 4}, sizes=[3, 9, 14, 6])
    eng = m.engine
    clients = torch.arange(4)
    b = eng.gatherer.batches("train", 0, clients, eng.algorithm.round_plan())
    b = Batch(b.x.clone(), b.y.clone(), b.mask.clone())
    b.mask[0, 1:] = 0  # unequal clients: client 0 takes one step, client 3 two
    b.mask[3, 2:] = 0
    k = 2
    padded = Batch(torch.cat([b.x, b.x[:, :k]], 1), torch.cat([b.y, b.y[:, :k]], 1),
                   torch.cat([b.mask, torch.zeros_like(b.mask[:, :k])], 1))
    shared = (eng.global_params(), eng.server_state)

    def run(batches: Batch):
        per_client = (batches, eng.client_states.gather(clients), eng.records(clients), eng.starting_buffers(clients))
        return run_clients(eng._client_fn, shared, per_client, 4, "loop", None, eng.loop_seeds("dropout", 0, clients))

    _assert_trees_close(run(b), run(padded), atol=1e-6)


def test_the_audited_algorithms_declare_step_budget() -> None:
    """The audit's outcome (docs/concepts.md): these honour empty steps (the two-phase Ditto and FedRep in each
    phase: tests/engine/test_local_epochs_phases.py; apfl … pfedme: tests/engine/test_local_epochs_more.py); MOCHA
    does not."""
    declared = set(_budget_algorithms())
    assert {"fedavg", "fedprox", "scaffold", "reptile", "perfedavg", "ifca", "cfl", "mtl_mean", "mtl_pairwise",
            "mtl_graph", "ditto", "fedrep", "fedmaml", "perfedmaml", "apfl", "fedala", "feddbe", "fedfomo",
            "fedrod"} <= declared
    assert "mocha" not in declared
    if "pfedme" in {entry.name for entry in list_algorithms()}:
        assert load_algorithm("pfedme").step_budget


# ----------------------------------------------------------------------------------------------
# epoch draws, by hand
# ----------------------------------------------------------------------------------------------
def _draw(plan: BatchPlan, sizes: list[int], clients: list[int], width: int = 100, round_idx: int = 0):
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
    return draw_batch_indices(7, "train", round_idx, torch.tensor(clients), offsets, plan, width), offsets


def test_every_row_is_used_exactly_once_per_epoch_in_per_step_chunks() -> None:
    """Client 1 (rows 5..15, n = 11), B = 3, per_step = 2, E = 3: ⌈11/6⌉ = 2 steps per epoch, 6 steps; each epoch's
    two steps hold every row once (batch 0 filled before batch 1; the last chunk partial, masked); then empty."""
    plan = BatchPlan(steps=8, per_step=2, batch_size=3, epochs=3)
    (index, mask), offsets = _draw(plan, [5, 11, 4], [1])
    assert epoch_steps(11, plan) == 6
    assert index.shape == mask.shape == (1, 8, 2, 3)
    for e in range(3):
        rows = index[0, 2 * e:2 * e + 2].reshape(-1)
        real = mask[0, 2 * e:2 * e + 2].reshape(-1).bool()
        assert sorted(rows[real].tolist()) == list(range(5, 16))
        assert real.tolist() == [True] * 11 + [False]  # the last chunk (5 rows) is partial: its last slot masked
    assert mask[0, 6:].sum() == 0  # beyond s_c: empty steps
    firsts = [index[0, 2 * e:2 * e + 2].reshape(-1)[:11].tolist() for e in range(3)]
    assert firsts[0] != firsts[1] != firsts[2]  # a fresh permutation per epoch


def test_drop_last_drops_the_partial_chunk_and_small_clients_take_no_step() -> None:
    plan = BatchPlan(steps=4, per_step=1, batch_size=4, epochs=2, drop_last=True)
    (index, mask), _ = _draw(plan, [10, 3], [0, 1])
    assert [epoch_steps(10, plan), epoch_steps(3, plan)] == [4, 0]
    assert mask[0].sum() == 16 and mask[0].reshape(4, 4).sum(1).tolist() == [4, 4, 4, 4]
    for e in range(2):
        used = index[0, 2 * e:2 * e + 2].reshape(-1).tolist()
        assert len(set(used)) == 8 and set(used) <= set(range(10))  # 8 distinct rows: 2 of 10 dropped per epoch
    assert mask[1].sum() == 0


def test_full_batch_epochs_take_one_step_of_all_rows_per_epoch() -> None:
    plan = BatchPlan(steps=0, per_step=1, batch_size=None, epochs=2)  # steps=0: the axis is the longest s_c
    (index, mask), _ = _draw(plan, [6, 3], [1], width=6)
    assert epoch_steps(3, plan) == 2 and index.shape == (1, 2, 1, 6)
    for t in range(2):
        assert sorted(index[0, t, 0][mask[0, t, 0].bool()].tolist()) == [6, 7, 8]


@pytest.mark.parametrize(("n", "b", "e", "drop", "steps"), [
    (10, 4, 1, False, 3), (10, 4, 1, True, 2), (12, 4, 2, False, 6), (1, 10, 1, False, 1), (1, 10, 1, True, 0),
    (600, 10, 5, False, 300), (0, 4, 3, False, 0),
])
def test_step_counts_per_client(n: int, b: int, e: int, drop: bool, steps: int) -> None:
    assert epoch_steps(n, BatchPlan(steps=0, batch_size=b, epochs=e, drop_last=drop)) == steps


def test_a_clients_batches_do_not_depend_on_who_else_is_drawn() -> None:
    plan = BatchPlan(steps=10, per_step=1, batch_size=4, epochs=2)
    sizes = [5, 17, 9, 12]
    (alone_i, alone_m), _ = _draw(plan, sizes, [2], round_idx=3)
    (many_i, many_m), _ = _draw(plan, sizes, [0, 1, 2, 3], round_idx=3)
    assert torch.equal(alone_i[0], many_i[2]) and torch.equal(alone_m[0], many_m[2])
    (other_i, _), _ = _draw(plan, sizes, [2], round_idx=4)
    assert not torch.equal(other_i[0], alone_i[0])  # a new round, new permutations


# ----------------------------------------------------------------------------------------------
# grouping
# ----------------------------------------------------------------------------------------------
def test_step_groups_bound_the_padding_and_cover_every_client_once() -> None:
    g = torch.Generator().manual_seed(0)
    steps = (torch.rand(300, generator=g) ** 4 * 500).long()
    groups = step_groups(steps)
    assert sorted(torch.cat(groups).tolist()) == list(range(300))
    for grp in groups:
        s = steps[grp]
        if int(s.max()) > 0:
            assert int((s.max() - s).sum()) <= 0.1 * int(s.max()) * s.numel()
    padded, real = padding_waste(steps, groups)
    assert padded <= (1 - GROUP_RATIO) / GROUP_RATIO * real
    one = step_groups(steps, 0.0)
    assert len(one) == 1 and one[0].tolist() == list(range(300))


# ----------------------------------------------------------------------------------------------
# the engine: looped == batched == ungrouped; real steps; refusals
# ----------------------------------------------------------------------------------------------
SIZES = [3, 25, 9, 40, 14, 5, 31, 11]
#: the executions whose numbers must agree: looped, and batched under each explicit schedule (loop/schedule.py)
SCHEDULE_RUNS = (("loop", "grouped"), ("vmap", "grouped"), ("vmap", "lockstep"), ("vmap", "compacted"))


@pytest.mark.parametrize("algorithm", [{"name": "fedavg"}, {"name": "scaffold"}, {"name": "fedprox", "mu": 0.1}])
def test_a_fit_with_local_epochs_is_the_same_looped_batched_and_ungrouped(algorithm: dict) -> None:
    """Three rounds of 4 of 8 unequal clients (3 to 40 rows, B = 4, E = 2, finetune_epochs = 1 for the evaluation):
    the global parameters and the clients' states agree to 1e-5 across the three executions."""
    finals = []
    for batching, schedule in SCHEDULE_RUNS:
        m = _module({**algorithm, "local_epochs": 2, "finetune_epochs": 1, "batch_size": 4, "local_lr": 0.1},
                    sizes=SIZES, batching=batching, step_schedule=schedule)
        m.engine.federation.num_sampled = 4
        for r in range(3):
            m.engine.run_round(r, torch.optim.SGD(m.model.parameters(), lr=1.0))
        finals.append((m.engine.global_params(), m.engine.client_states.tensors, m.engine._last.steps))
    assert finals[0][2].tolist() == [epoch_steps(SIZES[int(c)], m.algorithm.round_plan())
                                     for c in m.engine._last.clients]
    for other in finals[1:]:
        _assert_trees_close(finals[0][0], other[0], atol=1e-5)
        _assert_trees_close(dict(finals[0][1]), dict(other[1]), atol=1e-5)


def test_the_fit_above_runs_several_groups() -> None:
    """The sizes of the fit test give step counts far enough apart that the round runs in several groups."""
    plan = BatchPlan(steps=0, batch_size=4, epochs=2)
    steps = torch.tensor([epoch_steps(n, plan) for n in SIZES])
    assert len(step_groups(steps)) >= 4


def test_finetune_epochs_draw_the_evaluation_batches_by_the_same_rule() -> None:
    m = _module({"name": "fedavg", "local_steps": 2, "finetune_epochs": 2, "batch_size": 4, "finetune_batch_size": 3},
                sizes=SIZES)
    for client in (0, 3):
        batches, *_ = m.engine.personal_inputs(client, 0)
        s = epoch_steps(SIZES[client], m.algorithm.eval_plan())
        assert batches.x.shape[0] == s == 2 * math.ceil(SIZES[client] / 3)
        assert batches.mask.sum() == 2 * SIZES[client]


def test_epoch_arguments_are_checked_and_left_out_of_hparams_by_default() -> None:
    alg = load_algorithm("fedavg")()
    assert not {"local_epochs", "finetune_epochs", "drop_last"} & set(alg.hparams())
    alg = load_algorithm("fedavg")(local_epochs=1, drop_last=True)
    assert alg.hparams()["local_epochs"] == 1 and alg.hparams()["drop_last"] is True
    assert alg.round_plan() == BatchPlan(steps=0, per_step=1, batch_size=32, epochs=1, drop_last=True)
    for bad in ({"local_epochs": 0}, {"finetune_epochs": 1.5}, {"drop_last": "yes"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            load_algorithm("fedavg")(**bad)


@pytest.mark.parametrize(("name", "message"), [
    ("mocha", "SDCA"),
])
def test_algorithms_that_cannot_count_epochs_refuse_them_when_built(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_algorithm(name)(**load_algorithm(name).example_arguments(), local_epochs=1)


def test_algorithms_with_their_own_plans_refuse_epochs_when_bound() -> None:
    """An algorithm whose round_plan / eval_plan lays its batches out without the epochs is refused (perfedavg,
    fedmaml, perfedmaml and ifca now pass them: tests/engine/test_local_epochs_phases.py)."""
    fedavg = load_algorithm("fedavg")

    class OwnPlans(fedavg):
        def round_plan(self) -> BatchPlan:
            return BatchPlan(steps=2, batch_size=self.batch_size)

        def eval_plan(self) -> BatchPlan:
            return BatchPlan(steps=1, batch_size=self.finetune_batch_size)

    with pytest.raises(ValueError, match="local_epochs: .* lays out its batches with its own round_plan"):
        OwnPlans(local_epochs=1).check_epoch_plans()
    with pytest.raises(ValueError, match="finetune_epochs: .* lays out its batches with its own eval_plan"):
        OwnPlans(finetune_epochs=1).check_epoch_plans()


def test_straggler_budgets_are_refused_with_local_epochs() -> None:
    with pytest.raises(ValueError, match="local_steps_dist gives straggler budgets in local steps"):
        _module({"name": "fedavg", "local_epochs": 1}, sizes=SIZES, local_steps_dist=[1] * len(SIZES))


@pytest.mark.parametrize("num_clients", [20, 100])
def test_grouping_keeps_the_padding_of_a_dirichlet_split_under_ten_percent(num_clients: int) -> None:
    """benchmarks/epoch_grouping.py's figure: Fashion-MNIST sizes, Dirichlet(0.1), B = 10, E = 1."""
    from benchmarks.epoch_grouping import client_steps

    steps = client_steps(num_clients, 0)
    padded, real = padding_waste(steps, step_groups(steps))
    assert padded < 0.1 * real
    flat, _ = padding_waste(steps, step_groups(steps, 0.0))
    assert flat > real  # one group: more padding than work
