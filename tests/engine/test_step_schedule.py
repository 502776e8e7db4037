"""The local-epoch schedules (lightning_fedmeta/loop/schedule.py): the cost model's optimum checked by brute force,
the measured cost kept in checkpoints, compaction skipping exactly the padded steps, and compiled calls of changing
sizes that never recompile."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.func import vmap

from lightning_fedmeta.client.compiled import PrimitiveCompiler, client_buckets
from lightning_fedmeta.client.functional import Batch, ClientContext
from lightning_fedmeta.client.sampling import epoch_steps
from lightning_fedmeta.loop.grouping import step_groups
from lightning_fedmeta.loop.schedule import (
    StepCost,
    StepSchedule,
    cheapest_groups,
    fit_step_cost_points,
    group_seconds,
    sequential_steps,
)
from tests.engine.test_local_epochs import SIZES, _assert_trees_close, _module


def _partitions(items: list[int]) -> list[list[list[int]]]:
    """Every set partition of ``items``."""
    if not items:
        return [[]]
    first, rest = items[0], items[1:]
    out = []
    for smaller in _partitions(rest):
        for i in range(len(smaller)):
            out.append(smaller[:i] + [[first, *smaller[i]]] + smaller[i + 1:])
        out.append([[first], *smaller])
    return out


def _modelled(steps: torch.Tensor, groups: list[list[int]] | list[torch.Tensor], cost: StepCost, chunk: int | None
              ) -> float:
    return sum(group_seconds(int(steps[torch.as_tensor(g)].max()), len(g), cost, chunk) for g in groups)


@pytest.mark.parametrize("seed", range(6))
def test_cheapest_groups_is_the_optimum_over_every_partition(seed: int) -> None:
    """Against brute force over all set partitions (not only contiguous ones) of 7 clients, for random step counts,
    costs and chunk sizes: the dynamic programme's partition has the least modelled time and covers every client
    once."""
    g = torch.Generator().manual_seed(seed)
    steps = torch.randint(1, 40, (7,), generator=g)
    cost = StepCost(float(torch.rand(1, generator=g)) * 3, float(torch.rand(1, generator=g)))
    chunk = [None, 2, 3][seed % 3]
    groups = cheapest_groups(steps, cost, chunk)
    assert sorted(torch.cat(groups).tolist()) == list(range(7))
    best = min(_modelled(steps, p, cost, chunk) for p in _partitions(list(range(7))))
    assert _modelled(steps, groups, cost, chunk) == pytest.approx(best, rel=1e-12)


def test_the_cost_model_picks_lockstep_when_latency_dominates_and_groups_when_clients_do() -> None:
    steps = torch.tensor([641, 6, 300, 299, 120, 40, 641, 80])
    launch_bound = cheapest_groups(steps, StepCost(latency=1e-3, per_client=1e-6), None)
    assert len(launch_bound) == 1 and sequential_steps(steps, launch_bound) == 641
    flop_bound = cheapest_groups(steps, StepCost(latency=0.0, per_client=1.0), None)
    assert [sorted(steps[grp].tolist()) for grp in flop_bound] == [[641, 641], [300], [299], [120], [80], [40], [6]]
    assert sequential_steps(steps, flop_bound) == 641 + 300 + 299 + 120 + 80 + 40 + 6  # no padding at all


def test_clients_without_steps_form_the_last_group_as_in_step_groups() -> None:
    steps = torch.tensor([0, 5, 0, 7])
    groups = cheapest_groups(steps, StepCost(1.0, 1.0), None)
    assert groups[-1].tolist() == [0, 2]
    assert step_groups(steps)[-1].tolist() == [0, 2]


def test_sequential_steps_counts_chunks_and_the_empty_step() -> None:
    steps = torch.tensor([10, 10, 10, 0])
    assert sequential_steps(steps, [torch.tensor([0, 1, 2]), torch.tensor([3])], chunk=2) == 2 * 10 + 1


def test_fit_step_cost_points_recovers_a_line_and_clamps_noise() -> None:
    cost = fit_step_cost_points([(1, 0.003 + 0.002), (5, 0.003 + 0.010), (10, 0.003 + 0.020)])
    assert cost is not None
    assert cost.latency == pytest.approx(0.003) and cost.per_client == pytest.approx(0.002)
    noisy = fit_step_cost_points([(1, 0.010), (10, 0.009)])  # slower alone than together: no negative rate
    assert noisy is not None and noisy.per_client == 0.0
    assert fit_step_cost_points([(4, 1.0), (4, 2.0)]) is None
    with pytest.raises(ValueError, match="latency"):
        StepCost(-1.0, 0.0)


def test_schedule_refuses_unknown_modes_and_checkpoints_its_cost() -> None:
    with pytest.raises(ValueError, match="step_schedule must be one of"):
        StepSchedule("fastest")  # type: ignore[arg-type]
    schedule = StepSchedule("auto")
    assert schedule.needs_cost("vmap") and not schedule.needs_cost("loop")
    schedule.cost = StepCost(2e-3, 1e-3)
    restored = StepSchedule("auto")
    restored.load_state_dict(schedule.state_dict())
    assert restored.cost == schedule.cost and not restored.needs_cost("vmap")
    restored.load_state_dict({"step_cost": ["x", None]})  # a malformed entry is ignored, never trusted
    assert restored.cost == schedule.cost
    steps = torch.tensor([50, 3, 48, 20])
    assert [g.tolist() for g in restored.groups(steps, "vmap", None)] == \
        [g.tolist() for g in cheapest_groups(steps, schedule.cost, None)]


def test_the_loop_runs_clients_of_equal_steps_together_and_never_pads() -> None:
    steps = torch.tensor([7, 7, 3, 9, 3])
    groups = StepSchedule("lockstep").groups(steps, "loop", None)
    assert all(len(set(steps[g].tolist())) == 1 for g in groups)


def test_the_module_refuses_an_unknown_schedule() -> None:
    with pytest.raises(ValueError, match="step_schedule must be one of"):
        _module({"name": "fedavg", "local_epochs": 1}, sizes=SIZES, step_schedule="fast")


def _round(schedule: str, rounds: int = 2) -> tuple[dict, object]:
    m = _module({"name": "fedavg", "local_epochs": 2, "batch_size": 4, "local_lr": 0.1}, sizes=SIZES,
                batching="vmap", step_schedule=schedule)
    for r in range(rounds):
        m.engine.run_round(r, torch.optim.SGD(m.model.parameters(), lr=1.0))
    return m.engine.global_params(), m


def test_compacted_rounds_skip_exactly_the_padded_client_steps_and_agree_with_lockstep() -> None:
    """FedAvg, 8 clients of 3 to 40 rows, E = 2, B = 4, two rounds in one group: the compacted primitives compute
    Σ_c s_c client-steps and skip Σ_c (max s − s_c), and the model equals the lockstep one to 1e-6."""
    lockstep, _ = _round("lockstep")
    compacted, m = _round("compacted")
    steps = torch.tensor([epoch_steps(n, m.algorithm.round_plan()) for n in SIZES])
    computed, skipped = m.engine.compile.compiler.compacted_steps
    # steps below min s_c have every client active (run whole, not counted); each later step computes the active
    assert skipped == 2 * int((steps.max() - steps).sum())
    assert computed == 2 * int(steps.sum() - steps.numel() * steps.min())
    _assert_trees_close(lockstep, compacted, atol=1e-6)


def test_auto_measures_its_cost_once_and_a_resume_keeps_it() -> None:
    _, m = _round("auto", rounds=1)
    cost = m.engine.schedule.cost
    assert isinstance(cost, StepCost)
    m.engine.run_round(1, torch.optim.SGD(m.model.parameters(), lr=1.0))
    assert m.engine.schedule.cost is cost  # measured once per fit
    saved = m.engine.state_dict(2)
    other = _module({"name": "fedavg", "local_epochs": 2, "batch_size": 4, "local_lr": 0.1}, sizes=SIZES,
                    batching="vmap", step_schedule="auto")
    other.engine.load_state_dict(saved)
    assert other.engine.schedule.cost == cost and not other.engine.schedule.needs_cost("vmap")


def test_client_buckets() -> None:
    assert client_buckets(10) == [8, 2] and client_buckets(7) == [4, 2, 1] and client_buckets(8) == [8]
    assert client_buckets(10, {10}) == [10]
    assert all(sum(client_buckets(n)) == n for n in range(1, 130))
    with pytest.raises(ValueError):
        client_buckets(0)


def test_compiled_calls_of_changing_sizes_never_recompile_nor_warn() -> None:
    """A compiled step called with 1 to 12 clients (the sizes step groups, compaction and dropout produce): every
    result equals the eager one, no call falls back to eager, no warning is printed, and the programs are the
    bucket sizes (1, 2, 4, 8), each compiled once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    compiler = PrimitiveCompiler(enabled=True, backend="eager")
    ctx = ClientContext(model, compiler=compiler)
    eager_ctx = ClientContext(model)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def step(c: ClientContext, p: dict, x: torch.Tensor, y: torch.Tensor) -> tuple:
        return c.sgd_step(p, Batch(x, y, torch.ones(y.shape[0])), 0.1)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a dynamo recompile-limit warning (or any other) fails the test
        for n in [*range(1, 13), *range(12, 0, -1)]:
            stacked = {k: v.expand(n, *v.shape).clone() for k, v in params.items()}
            x, y = torch.randn(n, 5, 3), torch.randint(0, 2, (n, 5))
            got = vmap(lambda p, x, y: step(ctx, p, x, y))(stacked, x, y)
            want = vmap(lambda p, x, y: step(eager_ctx, p, x, y))(stacked, x, y)
            _assert_trees_close(got[0], want[0], atol=1e-6)
    assert compiler.stats.eager_calls == 0 and not compiler.stats.failures
    assert len(_partitions(list(range(4)))) == 15  # the brute force above enumerates every partition (Bell numbers)
    assert compiler.stats.programs == 4  # sizes 1, 2, 4, 8 serve every count from 1 to 12 (all of them once)
    assert math.isfinite(compiler.stats.compile_seconds)


@pytest.mark.parametrize("schedule", ["grouped", "lockstep", "compacted", "auto"])
def test_every_schedule_counts_the_real_steps_in_the_round_result(schedule: str) -> None:
    _, m = _round(schedule, rounds=1)
    plan = m.algorithm.round_plan()
    assert m.engine._last.steps.tolist() == [epoch_steps(SIZES[int(c)], plan) for c in m.engine._last.clients]



# ----------------------------------------------------------------------------------------------
# captured steps (lightning_fedmeta/client/graphs.py): the static-buffer logic, on the CPU with the recording backend
# ----------------------------------------------------------------------------------------------
def test_captured_primitives_replay_the_uncaptured_numbers_once_captured_per_shape() -> None:
    from lightning_fedmeta.client.graphs import RecordedGraphs

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    backend = RecordedGraphs()
    compiler = PrimitiveCompiler(graphs=True, graph_backend=backend)
    ctx, eager_ctx = ClientContext(model, compiler=compiler), ClientContext(model)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def steps(c: ClientContext, p: dict, x: torch.Tensor, y: torch.Tensor) -> tuple:
        losses = []
        for t in range(x.shape[0]):  # three local steps, each one primitive call; every step's loss kept
            p, loss = c.sgd_step(p, Batch(x[t], y[t], torch.ones(y.shape[1])), 0.1)
            losses.append(loss)
        return p, torch.stack(losses)

    for n in (4, 4, 3):
        stacked = {k: v.expand(n, *v.shape).clone() for k, v in params.items()}
        x, y = torch.randn(n, 3, 5, 3), torch.randint(0, 2, (n, 3, 5))
        got = vmap(lambda p, x, y: steps(ctx, p, x, y))(stacked, x, y)
        want = vmap(lambda p, x, y: steps(eager_ctx, p, x, y))(stacked, x, y)
        _assert_trees_close(got[0], want[0], atol=1e-6)
        # the three losses differ: each step's loss is a copy, not the static output the next replay overwrites
        assert torch.allclose(got[1], want[1], atol=1e-6) and not torch.equal(got[1][:, 0], got[1][:, 2])
    assert backend.captures == 2 and compiler.stats.graphs == 2  # one capture per shape (4 and 3 clients)
    assert compiler.stats.replays == 9 and backend.replays == 9  # every call replayed, the first ones included


def test_a_capture_that_fails_warns_once_and_runs_uncaptured() -> None:
    class Refusing:
        def capture(self, fn, static_in):  # noqa: ANN001, ANN202
            raise RuntimeError("operation not permitted when stream is capturing")

    model = nn.Linear(3, 2)
    compiler = PrimitiveCompiler(graphs=True, graph_backend=Refusing())
    ctx = ClientContext(model, compiler=compiler)
    params = {k: v.detach().expand(2, *v.shape).clone() for k, v in model.named_parameters()}
    x, y = torch.randn(2, 4, 3), torch.randint(0, 2, (2, 4))
    with pytest.warns(UserWarning, match="could not be captured"):
        first = vmap(lambda p, x, y: ctx.sgd_step(p, Batch(x, y, torch.ones(4)), 0.1))(params, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = vmap(lambda p, x, y: ctx.sgd_step(p, Batch(x, y, torch.ones(4)), 0.1))(params, x, y)
    _assert_trees_close(first[0], again[0], atol=0.0)
    assert compiler.stats.graphs == 0 and "graph capture" in compiler.stats.failures[0]


def test_cuda_graphs_true_refuses_a_run_off_the_gpu() -> None:
    m = _module({"name": "fedavg", "local_epochs": 1}, sizes=SIZES, batching="vmap", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        m.engine.place(torch.device("cpu"))
    with pytest.raises(ValueError, match="cuda_graphs must be"):
        _module({"name": "fedavg", "local_epochs": 1}, sizes=SIZES, cuda_graphs="yes")


def test_a_round_with_captured_steps_equals_the_eager_round() -> None:
    """Lockstep FedAvg with every primitive replayed from a (recorded) graph: the model equals the eager one."""
    from lightning_fedmeta.client.graphs import RecordedGraphs

    eager, _ = _round("lockstep")
    m = _module({"name": "fedavg", "local_epochs": 2, "batch_size": 4, "local_lr": 0.1}, sizes=SIZES,
                batching="vmap", step_schedule="lockstep")
    compiler = m.engine.compile.compiler
    compiler.graphs, compiler.graph_backend = True, RecordedGraphs()
    for r in range(2):
        m.engine.run_round(r, torch.optim.SGD(m.model.parameters(), lr=1.0))
    _assert_trees_close(eager, m.engine.global_params(), atol=1e-6)
    assert compiler.stats.graphs >= 1 and compiler.stats.replays >= 2 * 20
