"""Local epochs for the two-phase rounds (Ditto, FedRep: per-phase epochs ``(E_1, E_2)``) and the algorithms with
their own plans (Per-FedAvg's 2–3 batches per step, FedMAML/PerFedMAML's support/query halves, IFCA's evaluation
batches): the phase layout by hand, purity, the empty steps at the end of each phase, loop == vmap == ungrouped.
"""

from __future__ import annotations

import pytest
import torch

from lightning_fedmeta.algorithms.base import BatchPlan
from lightning_fedmeta.client.execution import run_clients
from lightning_fedmeta.client.functional import Batch
from lightning_fedmeta.client.sampling import draw_batch_indices, epoch_steps, phase_lengths
from lightning_fedmeta.registry import load_algorithm
from tests.engine.test_local_epochs import SCHEDULE_RUNS, SIZES, _assert_trees_close, _module

PHASES = BatchPlan(steps=0, per_step=1, batch_size=3, epochs=(2, 1))


def _draw(plan: BatchPlan, sizes: list[int], clients: list[int], round_idx: int = 0):
    offsets = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()])
    return draw_batch_indices(5, "train", round_idx, torch.tensor(clients), offsets, plan, 100)


# ----------------------------------------------------------------------------------------------
# the phase layout, by hand
# ----------------------------------------------------------------------------------------------
def test_each_phase_uses_every_row_once_per_epoch_in_its_own_padded_block() -> None:
    """Clients of 7 and 4 rows (rows 0..6, 7..10), B = 3, epochs (2, 1): nb = 3 and 2, s_c = 9 and 6; the step
    axis T = 3·3 = 9 holds phase 1 in steps 0..5 and phase 2 in steps 6..8. Client 1's phase 1 takes steps 0..3
    (two epochs of 2 steps), steps 4, 5 are its phase-1 padding, phase 2 takes steps 6, 7, step 8 is padding."""
    assert [epoch_steps(7, PHASES), epoch_steps(4, PHASES)] == [9, 6]
    index, mask = _draw(PHASES, [7, 4], [0, 1])
    assert index.shape == (2, 9, 1, 3) and phase_lengths(9, PHASES) == [6, 3]
    taken = mask.sum((2, 3))
    assert taken[0].tolist() == [3, 3, 1, 3, 3, 1, 3, 3, 1]
    assert taken[1].tolist() == [3, 1, 3, 1, 0, 0, 3, 1, 0]
    for row, (lo, n) in enumerate(((0, 7), (7, 4))):
        rows = index[row, :, 0][mask[row, :, 0] > 0]
        epochs = rows.split(n)
        assert len(epochs) == 3
        for e in epochs:
            assert sorted(e.tolist()) == list(range(lo, lo + n))  # every row once per epoch, in each phase
        assert epochs[0].tolist() != epochs[1].tolist()  # a fresh permutation per epoch
    # client 1's phase 2 starts at the block boundary, not after its own phase 1
    assert index[1, 6, 0, :3].tolist() == epochs[2][:3].tolist()


def test_the_step_axis_is_a_multiple_of_the_epochs_and_phase_lengths_refuse_others() -> None:
    """A direct caller (steps=0) gets T = ΣE·max nb, a longer request is rounded up to a multiple of ΣE, and
    clients with no step (drop_last, fewer rows than B) still get ΣE empty steps."""
    assert _draw(PHASES, [7, 4], [1])[0].shape[1] == 6
    assert _draw(BatchPlan(steps=10, batch_size=3, epochs=(2, 1)), [7, 4], [0])[0].shape[1] == 12
    index, mask = _draw(BatchPlan(steps=1, batch_size=3, epochs=(2, 1), drop_last=True), [2, 2], [0, 1])
    assert index.shape[1] == 3 and mask.sum() == 0
    with pytest.raises(ValueError, match="multiple of 3"):
        phase_lengths(10, PHASES)
    assert phase_lengths(10, BatchPlan(steps=0, epochs=2)) == [10]


def test_a_clients_phases_depend_on_the_others_only_through_the_padding() -> None:
    """Client 1's rows are the same drawn alone or beside a larger client, once each phase's padding is removed."""
    alone_i, alone_m = _draw(PHASES, [7, 4], [1])
    both_i, both_m = _draw(PHASES, [7, 4], [0, 1])

    def phases(index: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
        out, first = [], 0
        for length in phase_lengths(index.shape[0], PHASES):
            block = slice(first, first + length)
            out.append(index[block][mask[block] > 0].tolist())
            first += length
        return out

    assert phases(alone_i[0], alone_m[0]) == phases(both_i[1], both_m[1])
    again = _draw(PHASES, [7, 4], [0, 1])
    assert torch.equal(again[0], both_i) and torch.equal(again[1], both_m)  # pure in (seed, round, client)
    assert not torch.equal(_draw(PHASES, [7, 4], [0, 1], round_idx=1)[0], both_i)


def test_single_epoch_plans_lay_out_as_before() -> None:
    """epochs=E and epochs=(E,) give the same draw (one phase)."""
    one = _draw(BatchPlan(steps=0, batch_size=3, epochs=2), [7, 4], [0, 1])
    tup = _draw(BatchPlan(steps=0, batch_size=3, epochs=(2,)), [7, 4], [0, 1])
    assert torch.equal(one[0], tup[0]) and torch.equal(one[1], tup[1])


# ----------------------------------------------------------------------------------------------
# the algorithms' plans
# ----------------------------------------------------------------------------------------------
def test_the_plans_carry_the_epochs() -> None:
    ditto = load_algorithm("ditto")(local_epochs=2, personal_epochs=3, batch_size=4)
    assert ditto.round_plan() == BatchPlan(steps=0, batch_size=4, epochs=(2, 3))
    assert load_algorithm("ditto")(local_epochs=2).round_plan().epochs == (2, 2)  # personal_epochs = local_epochs
    fedrep = load_algorithm("fedrep")(local_epochs=1, head_epochs=5, drop_last=True)
    assert fedrep.round_plan() == BatchPlan(steps=0, batch_size=32, epochs=(5, 1), drop_last=True)
    assert load_algorithm("perfedavg")(variant="hf", local_epochs=2, batch_size=5).round_plan() == BatchPlan(
        steps=0, per_step=3, batch_size=5, epochs=2)
    for name in ("fedmaml", "perfedmaml"):
        assert load_algorithm(name)(local_epochs=1, batch_size=4).round_plan() == BatchPlan(
            steps=0, batch_size=8, epochs=1)
    assert load_algorithm("ifca")(finetune_epochs=2).eval_plan() == BatchPlan(steps=0, batch_size=None, epochs=2)
    for name in ("ditto", "fedrep", "perfedavg", "fedmaml", "perfedmaml", "ifca", "cfl"):
        cls = load_algorithm(name)
        cls(**cls.example_arguments(), local_epochs=1, finetune_epochs=1).check_epoch_plans()
    # without local_epochs nothing changes
    assert load_algorithm("ditto")(local_steps=3, personal_steps=2).round_plan() == BatchPlan(steps=5, batch_size=32)


@pytest.mark.parametrize(("name", "arg", "steps_arg"), [("ditto", "personal_epochs", "personal_steps"),
                                                        ("fedrep", "head_epochs", "head_steps")])
def test_a_phase_in_epochs_needs_local_epochs(name: str, arg: str, steps_arg: str) -> None:
    with pytest.raises(ValueError, match=f"{arg}=2 counts a phase in epochs, but local_epochs is not set.*{steps_arg}"):
        load_algorithm(name)(**{arg: 2})
    with pytest.raises(ValueError, match=f"{arg} must be an integer >= 1"):
        load_algorithm(name)(local_epochs=1, **{arg: 0})


@pytest.mark.parametrize("name", ["ditto", "fedrep"])
def test_empty_steps_appended_to_each_phase_change_nothing(name: str) -> None:
    """client_update on a phase layout (E = (1, 1), unequal clients) equals client_update on the same batches with
    k empty steps appended at the end of EACH phase (a longer step axis, as in a group with a larger client)."""
    m = _module({"name": name, "local_epochs": 1, "batch_size": 4, "local_lr": 0.1}, sizes=[3, 9, 14, 6])
    eng = m.engine
    clients = torch.arange(4)
    b = eng.gatherer.batches("train", 0, clients, eng.algorithm.round_plan())
    t1, t2 = phase_lengths(b.x.shape[1], eng.algorithm.round_plan())
    assert (t1, t2) == (4, 4) and b.mask.sum() == 2 * 32  # every row once in each phase
    k = 2

    def pad(t: torch.Tensor, empty: bool) -> torch.Tensor:
        fill = torch.zeros_like(t[:, :k]) if empty else t[:, :k]
        return torch.cat([t[:, :t1], fill, t[:, t1:], fill], 1)

    padded = Batch(pad(b.x, False), pad(b.y, False), pad(b.mask, True))
    assert padded.x.shape[1] == t1 + t2 + 2 * k
    shared = (eng.global_params(), eng.server_state)

    def run(batches: Batch):
        per_client = (batches, eng.client_states.gather(clients), eng.records(clients), eng.starting_buffers(clients))
        return run_clients(eng._client_fn, shared, per_client, 4, "loop", None, eng.loop_seeds("dropout", 0, clients))

    _assert_trees_close(run(b), run(padded), atol=1e-6)


# ----------------------------------------------------------------------------------------------
# the engine: looped == batched == ungrouped
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("algorithm", [
    {"name": "ditto", "personal_epochs": 2, "lam": 0.1},
    {"name": "fedrep", "head_epochs": 2},
    {"name": "perfedavg", "variant": "hf", "alpha": 0.05, "beta": 0.05},
    {"name": "fedmaml", "alpha": 0.05},
    {"name": "perfedmaml", "alpha": 0.05, "beta": 0.05},
])
def test_a_fit_with_local_epochs_is_the_same_looped_batched_and_ungrouped(algorithm: dict) -> None:
    """Two rounds of 4 of 8 unequal clients (3 to 40 rows, B = 4, E = 1, finetune_epochs = 1): the global parameters
    and the clients' states agree to 1e-5 across loop, vmap in step groups, and vmap in one group; the round's
    step counts are (ΣE)·⌈n_c/(per_step·B)⌉."""
    finals = []
    extra = {} if algorithm["name"] in ("perfedavg", "fedmaml", "perfedmaml") else {"local_lr": 0.1}
    for batching, schedule in SCHEDULE_RUNS:
        m = _module({**algorithm, **extra, "local_epochs": 1, "finetune_epochs": 1, "batch_size": 4},
                    sizes=SIZES, batching=batching, step_schedule=schedule)
        m.engine.federation.num_sampled = 4
        for r in range(2):
            m.engine.run_round(r, torch.optim.SGD(m.model.parameters(), lr=1.0))
        finals.append((m.engine.global_params(), m.engine.client_states.tensors, m.engine._last.steps))
    plan = m.algorithm.round_plan()
    assert finals[0][2].tolist() == [epoch_steps(SIZES[int(c)], plan) for c in m.engine._last.clients]
    for other in finals[1:]:
        _assert_trees_close(finals[0][0], other[0], atol=1e-5)
        _assert_trees_close(dict(finals[0][1]), dict(other[1]), atol=1e-5)


def test_ifca_evaluates_on_the_finetune_epochs_batches() -> None:
    """IFCA's evaluation batches under finetune_epochs = 2: every training row twice (the cluster is chosen by the
    mean loss over the client's rows), one step per batch."""
    m = _module({"name": "ifca", "finetune_epochs": 2, "finetune_batch_size": 3}, sizes=SIZES)
    for client in (0, 3):
        batches, *_ = m.engine.personal_inputs(client, 0)
        assert batches.x.shape[0] == epoch_steps(SIZES[client], m.algorithm.eval_plan())
        assert batches.mask.sum() == 2 * SIZES[client]
