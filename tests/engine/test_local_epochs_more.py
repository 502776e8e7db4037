"""Local epochs for the algorithms audited last (issue 26 item 1): APFL, FedALA, FedDBE, FedFomo, FedRoD and pFedMe
take ``local_epochs`` (``step_budget``), FedALA, FedEM, FedFomo and pFedMe lay out their own plans in epochs
(``finetune_epochs`` too), and a fit runs the same looped, batched in step groups, and batched in one group,
evaluation-time personalisation included. The empty-step contract of each is
tests/engine/test_local_epochs.py::test_appended_empty_steps_change_nothing."""

from __future__ import annotations

import pytest
import torch

from lightning_fedmeta.algorithms.base import BatchPlan
from lightning_fedmeta.client.execution import run_clients
from lightning_fedmeta.client.functional import Batch
from lightning_fedmeta.client.sampling import epoch_steps
from lightning_fedmeta.registry import load_algorithm
from tests.engine.test_local_epochs import SCHEDULE_RUNS, SIZES, _assert_trees_close, _module

pytest.importorskip("fedmeta_pfedme")

AUDITED = ["apfl", "fedala", "feddbe", "fedfomo", "fedrod", "pfedme"]


def _personalized(m, round_idx: int):
    """Every client's evaluation model (``personalize`` on its ``eval_plan`` batches), run the module's way."""
    eng, alg = m.engine, m.algorithm
    clients = torch.arange(len(SIZES))
    adapt = eng.gatherer.batches("adapt", round_idx, clients, alg.eval_plan())
    ctx = eng.make_context()

    def personalize(params, server_state, batches, state, record):
        return alg.personalize(ctx, params, batches, state, server_state, record)

    return run_clients(personalize, (eng.global_params(), eng.server_state),
                       (adapt, eng.client_states.gather(clients), eng.records(clients)), clients.numel(),
                       m.batching)


@pytest.mark.parametrize("algorithm", [
    {"name": "apfl"},
    {"name": "fedala", "ala_steps": 2, "ala_start_steps": 4},
    {"name": "feddbe", "kappa": 1.0},
    {"name": "fedfomo", "models_per_client": 3},
    {"name": "fedrod"},
    {"name": "pfedme", "lam": 5.0, "personal_lr": 0.05, "eval_batch_size": 4},
    {"name": "fedem", "num_components": 2},
])
def test_a_fit_with_local_epochs_is_the_same_looped_batched_and_ungrouped(algorithm: dict) -> None:
    """Three rounds of 4 of 8 unequal clients (3 to 40 rows, B = 4, E = 2, finetune_epochs = 1): the global
    parameters, the clients' states and every client's evaluation model agree to 1e-5 across loop and every vmap
    schedule (grouped, lockstep, compacted, auto); the round's step counts are E·⌈n_c/B⌉."""
    finals = []
    tune = {} if algorithm["name"] == "pfedme" else {"finetune_batch_size": 4}  # pFedMe: eval_batch_size
    for batching, schedule in SCHEDULE_RUNS:
        m = _module({**algorithm, **tune, "local_epochs": 2, "finetune_epochs": 1, "batch_size": 4,
                     "local_lr": 0.1}, sizes=SIZES, batching=batching, step_schedule=schedule)
        m.engine.federation.num_sampled = 4
        for r in range(3):
            m.engine.run_round(r, torch.optim.SGD(m.model.parameters(), lr=1.0))
        finals.append((m.engine.global_params(), m.engine.client_states.tensors, m.engine._last.steps,
                       _personalized(m, 3)))
    plan = m.algorithm.round_plan()
    assert finals[0][2].tolist() == [epoch_steps(SIZES[int(c)], plan) for c in m.engine._last.clients]
    for other in finals[1:]:
        _assert_trees_close(finals[0][0], other[0], atol=1e-5)
        _assert_trees_close(dict(finals[0][1]), dict(other[1]), atol=1e-5)
        _assert_trees_close(finals[0][3], other[3], atol=1e-5)
    assert all(torch.isfinite(v).all() for v in finals[0][3].values())


@pytest.mark.parametrize("name", AUDITED)
def test_the_audited_algorithms_take_local_and_finetune_epochs(name: str) -> None:
    """Built with epochs, each plan carries them (``check_epoch_plans`` passes) with a step axis set per call."""
    cls = load_algorithm(name)
    alg = cls(**cls.example_arguments(), local_epochs=2, finetune_epochs=3, drop_last=True)
    alg.check_epoch_plans()
    assert cls.step_budget
    assert (alg.round_plan().epochs, alg.round_plan().steps, alg.round_plan().drop_last) == (2, 0, True)
    assert (alg.eval_plan().epochs, alg.eval_plan().steps, alg.eval_plan().drop_last) == (3, 0, True)


def test_fedem_takes_finetune_epochs_and_keeps_its_step_plan() -> None:
    fedem = load_algorithm("fedem")
    fedem(finetune_epochs=2).check_epoch_plans()
    assert fedem(finetune_epochs=2).eval_plan() == BatchPlan(steps=0, batch_size=32, epochs=2)
    assert fedem(finetune_steps=0).eval_plan() == BatchPlan(steps=1, batch_size=32)  # a new client's EM batch


def test_step_plans_are_unchanged() -> None:
    """Without epochs FedFomo still draws τ + 1 batches (V first), FedALA ``max(ala_steps, ala_start_steps) + τ``,
    pFedMe's evaluation one batch of ``eval_batch_size``."""
    assert load_algorithm("fedfomo")(local_steps=3, finetune_steps=2).round_plan() == BatchPlan(steps=4)
    assert load_algorithm("fedfomo")(local_steps=3, finetune_steps=2).eval_plan() == BatchPlan(steps=3)
    fedala = load_algorithm("fedala")(ala_steps=2, ala_start_steps=5, local_steps=3, finetune_steps=1)
    assert (fedala.round_plan().steps, fedala.eval_plan().steps) == (8, 6)
    assert load_algorithm("pfedme")(eval_batch_size=7).eval_plan() == BatchPlan(steps=1, batch_size=7)


def _client_inputs(m, clients: torch.Tensor):
    eng = m.engine
    batches = eng.gatherer.batches("train", 0, clients, eng.algorithm.round_plan())
    return eng, batches, (eng.global_params(), eng.server_state)


def test_fedfomo_under_epochs_validates_on_the_first_batch_and_trains_on_every_batch() -> None:
    """FedFomo with local_epochs = 1: V is batch 0 of the epoch, and the SGD steps walk all ⌈n/B⌉ batches (batch 0
    included), so the trained model is the first-order combination on batch 0 followed by SGD on every batch."""
    from lightning_fedmeta.algorithms.fedfomo import first_order_combination
    from lightning_fedmeta.algorithms.local_steps import local_sgd

    m = _module({"name": "fedfomo", "local_epochs": 1, "batch_size": 4, "local_lr": 0.1}, sizes=SIZES)
    eng, batches, (params, server_state) = _client_inputs(m, torch.tensor([3]))
    assert batches.x.shape[1] == epoch_steps(SIZES[3], m.algorithm.round_plan()) == 10  # ⌈40/4⌉, no extra batch
    one = Batch(batches.x[0], batches.y[0], batches.mask[0])
    ctx = eng.make_context()
    state = {k: v[0] for k, v in eng.client_states.gather(torch.tensor([3]))["personal"].items()}
    record = type(eng.records(torch.tensor([3])))(*(t[0] for t in eng.records(torch.tensor([3]))))
    out = m.algorithm.client_update(ctx, params, one, {"personal": state}, server_state, record)
    candidates = m.algorithm.download(params, server_state, record)["models"]
    combined, _ = first_order_combination(ctx, state, candidates, one.at(0, 0))
    expected, _ = local_sgd(ctx, combined, one, 0.1)
    _assert_trees_close(out.state["personal"], expected, atol=0)


def test_fedala_under_epochs_takes_its_w_steps_on_the_first_batches_only_as_many_as_a_client_has() -> None:
    """FedALA with local_epochs = 1 and ala_start_steps = 4: a client of 3 rows (one batch of B = 4) takes one W
    step and one SGD step; its W steps on the padding change nothing (the same update as on its batch alone)."""
    m = _module({"name": "fedala", "local_epochs": 1, "batch_size": 4, "ala_steps": 2, "ala_start_steps": 4},
                sizes=SIZES)
    eng, batches, (params, server_state) = _client_inputs(m, torch.tensor([0, 3]))
    assert batches.x.shape[1] == 10 and batches.mask[0].sum() == 3 and batches.mask[0, 1:].sum() == 0
    ctx = eng.make_context()
    states = eng.client_states.gather(torch.tensor([0, 3]))
    state = {k: ({n: t[0] for n, t in v.items()} if isinstance(v, dict) else v[0]) for k, v in states.items()}
    record = type(eng.records(torch.tensor([0])))(*(t[0] for t in eng.records(torch.tensor([0]))))
    padded = Batch(batches.x[0], batches.y[0], batches.mask[0])
    alone = Batch(batches.x[0, :1], batches.y[0, :1], batches.mask[0, :1])
    a = m.algorithm.client_update(ctx, params, padded, state, server_state, record)
    b = m.algorithm.client_update(ctx, params, alone, state, server_state, record)
    _assert_trees_close((a.delta, a.state), (b.delta, b.state), atol=0)
