"""Unreliable clients (issue 13, part 1): dropouts, over-selection, stragglers' budgets of local steps, FedNova.

Reference computations are written out by hand here (the availability draws, the survivors' local SGD and the
renormalised weighted mean), with unequal client sizes, partial participation and held-out clients.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.client.sampling import generator_for, sample_clients
from lightning_fedmeta.persistence.memory_store import flatten_state
from lightning_fedmeta.reliability.participation import (
    StepBudget,
    answering_clients,
    mask_missing_steps,
    num_candidates,
    parse_local_steps_dist,
)
from tests.helpers import make_trainer, tiny_data, tiny_datamodule, tiny_module


def _linear_module(**kwargs) -> FederatedModule:
    options = dict(algorithm={"name": "fedavg", "local_steps": 3, "local_lr": 0.3, "batch_size": None},
                   clients_per_round=4, client_batching="vmap", compile_clients=False, seed=5)
    options.update(kwargs)
    return tiny_module(**options)


def _survivors_by_hand(seed: int, r: int, candidates: list[int], p: float, keep: int) -> list[int]:
    answered = []
    for c in candidates:
        u_fail, arrival = torch.rand(2, generator=generator_for(seed, "availability", r, c)).tolist()
        if u_fail >= p:
            answered.append((arrival, c))
    return sorted(c for _, c in sorted(answered)[:keep])


def _fedavg_round_by_hand(w: dict, data, clients: list[int], steps: int, lr: float, budgets=None) -> dict:
    """Full-batch FedAvg of the listed clients with weights n_c / Σ n_c (float32, autograd)."""
    offsets = data.train_offsets.tolist()
    counts = [offsets[c + 1] - offsets[c] for c in clients]
    total = sum(counts)
    new = {k: torch.zeros_like(v) for k, v in w.items()}
    for c, n_c, tau in zip(clients, counts, budgets or [steps] * len(clients), strict=True):
        x = data.train_x[offsets[c]:offsets[c + 1]]
        y = data.train_y[offsets[c]:offsets[c + 1]]
        wc = {k: v.clone() for k, v in w.items()}
        for _ in range(tau):
            p = {k: v.clone().requires_grad_(True) for k, v in wc.items()}
            loss = nn.functional.cross_entropy(x @ p["weight"].T + p["bias"], y)
            grads = torch.autograd.grad(loss, list(p.values()))
            wc = {k: (v - lr * g).detach() for (k, v), g in zip(p.items(), grads, strict=True)}
        for k in w:
            new[k] += (n_c / total) * (wc[k] - w[k])
    return {k: w[k] + new[k] for k in w}


# ----------------------------------------------------------------------------------------------
# dropout
# ----------------------------------------------------------------------------------------------
def test_dropout_equals_the_run_over_the_survivors_computed_by_hand() -> None:
    data = tiny_data(num_clients=8)
    module = _linear_module(client_dropout=0.4, holdout_clients=1)
    module.attach_data(data)
    w = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    some_dropped = False
    for r in range(6):
        candidates = sample_clients(5, r, module.eligible, 4).tolist()
        survivors = _survivors_by_hand(5, r, candidates, 0.4, 4)
        some_dropped |= len(survivors) < len(candidates)
        sampled, out, weights = module.compute_round(r)
        assert sampled.tolist() == survivors
        if not survivors:
            continue
        assert math.isclose(float(weights.sum()), 1.0, rel_tol=1e-6)  # renormalised over the survivors
        counts = data.train_counts[sampled].double()
        torch.testing.assert_close(weights.double(), counts / counts.sum(), rtol=1e-6, atol=0)
        delta, state = module.algorithm.aggregate(module._global_params(), out, weights, module.server_state,
                                                  module.records(sampled))
        with torch.no_grad():
            for name, p in module.model.named_parameters():
                p.add_(delta[name])
        module.commit_round(sampled, out, state)
        w = _fedavg_round_by_hand(w, data, survivors, 3, 0.3)
        for name, p in module.model.named_parameters():
            torch.testing.assert_close(p.detach(), w[name], rtol=0, atol=2e-6)
    assert some_dropped


def test_dropped_clients_state_is_untouched_and_not_marked_seen() -> None:
    data = tiny_data(num_clients=8)
    module = FederatedModule(model=nn.Linear(5, 3), algorithm={"name": "ditto", "local_steps": 2, "personal_steps": 2},
                             clients_per_round=6, client_dropout=0.5, compile_clients=False, seed=1)
    module.attach_data(data)
    before = {k: v.clone() for k, v in flatten_state(module.client_states.tensors).items()}
    trainer = make_trainer(1)
    trainer.fit(module, tiny_datamodule(8, eval_every=100))
    candidates = sample_clients(1, 0, module.eligible, 6)
    sampled = module.round_clients(0)
    failed = sorted(set(candidates.tolist()) - set(sampled.tolist()))
    assert failed and sampled.numel()
    for name, t in flatten_state(module.client_states.tensors).items():
        assert torch.equal(t[failed], before[name][failed]), name
        assert not torch.equal(t[sampled], before[name][sampled]), name
    assert module.seen[sampled].all() and not module.seen[failed].any()


def test_a_round_nobody_answers_leaves_everything_unchanged_and_is_logged(caplog) -> None:
    module = _linear_module(client_dropout=0.9, clients_per_round=1, seed=3)
    module.attach_data(tiny_data(num_clients=6))
    empty = [r for r in range(20) if module.round_clients(r).numel() == 0]
    answered = [r for r in range(20) if module.round_clients(r).numel() == 1]
    assert empty and answered and empty[0] == 0, (empty, answered)  # seed 3: round 0 has no survivor
    rounds = max(answered[0] + 1, 2)
    module = _linear_module(client_dropout=0.9, clients_per_round=1, seed=3,
                            server_optimizer=lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.9))
    start = {k: v.detach().clone() for k, v in module.model.named_parameters()}
    with caplog.at_level(logging.INFO):
        trainer = make_trainer(1)
        trainer.fit(module, tiny_datamodule(6, eval_every=100))
    assert int(trainer.global_step) == 1  # the empty round counts as a round
    for name, p in module.model.named_parameters():
        assert torch.equal(p.detach(), start[name])  # momentum too: the optimizer stepped without gradients
    assert not module.seen.any()
    assert "round 0: no sampled client answered" in caplog.text
    trainer = make_trainer(rounds)
    module2 = _linear_module(client_dropout=0.9, clients_per_round=1, seed=3)
    trainer.fit(module2, tiny_datamodule(6, eval_every=100))
    assert module2.seen.sum() >= 1


def test_resumed_run_with_dropout_and_budgets_is_bit_exact(tmp_path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    def build() -> FederatedModule:
        torch.manual_seed(0)
        return FederatedModule(
            model=nn.Linear(5, 3), algorithm={"name": "scaffold", "local_steps": 4, "local_lr": 0.1},
            clients_per_round=4, client_dropout=0.3, over_selection=0.5,
            local_steps_dist={"distribution": "uniform", "low": 1, "high": 4}, seed=2, compile_clients=False,
        )

    full = build()
    make_trainer(8).fit(full, tiny_datamodule(8, eval_every=100))
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)
    first = build()
    make_trainer(4, callbacks=[ckpt], enable_checkpointing=True).fit(first, tiny_datamodule(8, eval_every=100))
    resumed = build()
    path = next(tmp_path.glob("*step=4*.ckpt"))
    make_trainer(8).fit(resumed, tiny_datamodule(8, eval_every=100), ckpt_path=str(path))
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    resumed_states = flatten_state(resumed.client_states.tensors)
    for name, t in flatten_state(full.client_states.tensors).items():
        assert torch.equal(t, resumed_states[name]), name


# ----------------------------------------------------------------------------------------------
# over-selection
# ----------------------------------------------------------------------------------------------
def test_over_selection_keeps_the_first_m_that_answer() -> None:
    assert num_candidates(10, 0.3, 50) == 13
    assert num_candidates(10, 0.0, 50) == 10
    assert num_candidates(10, 2.0, 25) == 25  # at most every eligible client
    module = _linear_module(over_selection=0.5, client_dropout=0.2, clients_per_round=4, seed=7)
    module.attach_data(tiny_data(num_clients=12))
    assert module.num_candidates == 6
    for r in range(10):
        candidates = sample_clients(7, r, module.eligible, 6).tolist()
        kept = module.round_clients(r).tolist()
        assert kept == _survivors_by_hand(7, r, candidates, 0.2, 4)
        assert len(kept) <= 4 and set(kept) <= set(candidates)


def test_answering_clients_draws_nothing_when_everyone_answers() -> None:
    candidates = torch.tensor([1, 4, 9])
    assert answering_clients(0, 3, candidates, 0.0, 3) is candidates


# ----------------------------------------------------------------------------------------------
# stragglers: budgets of local steps
# ----------------------------------------------------------------------------------------------
def test_mask_missing_steps_zeroes_steps_beyond_each_budget() -> None:
    mask = torch.ones(2, 4, 3, 5)
    mask_missing_steps(mask, torch.tensor([1, 3]))
    assert mask[0, :1].eq(1).all() and mask[0, 1:].eq(0).all()
    assert mask[1, :3].eq(1).all() and mask[1, 3:].eq(0).all()


@pytest.mark.parametrize("algorithm", [
    {"name": "fedavg", "local_lr": 0.2},
    {"name": "fedprox", "local_lr": 0.2, "mu": 0.5},
    {"name": "reptile", "alpha": 0.2},
    {"name": "scaffold", "local_lr": 0.2},
    {"name": "perfedavg", "variant": "hf", "alpha": 0.05, "beta": 0.1},
])
@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_a_straggler_takes_exactly_its_budget_of_steps(algorithm: dict, batching: str) -> None:
    """A client with a budget of 2 out of 5 steps uploads (and stores) what it would after a 2-step round."""
    data = tiny_data(num_clients=6)
    budgets = [2, 5, 1, 5, 3, 5]

    def module(steps: int, dist) -> FederatedModule:
        torch.manual_seed(0)
        m = FederatedModule(model=nn.Linear(5, 3), algorithm={**algorithm, "local_steps": steps, "batch_size": 4},
                            clients_per_round=6, local_steps_dist=dist, client_batching=batching,
                            compile_clients=False, seed=4)
        m.attach_data(data)
        return m

    hetero = module(5, budgets)
    sampled, out, _ = hetero.compute_round(0)
    assert sampled.tolist() == list(range(6))
    for tau in (1, 2, 3, 5):
        plain = module(tau, None)
        _, ref, _ = plain.compute_round(0)
        for row, b in enumerate(budgets):
            if b != tau:
                continue
            for k in out.delta:
                torch.testing.assert_close(out.delta[k][row], ref.delta[k][row], rtol=0, atol=1e-6)
            for k, v in out.state.items():
                ref_v = ref.state[k]
                for name in (v if isinstance(v, dict) else {"": v}):
                    a = v[name][row] if isinstance(v, dict) else v[row]
                    b_ = ref_v[name][row] if isinstance(ref_v, dict) else ref_v[row]
                    torch.testing.assert_close(a, b_, rtol=0, atol=1e-5)
            torch.testing.assert_close(out.metrics["loss"][row], ref.metrics["loss"][row], rtol=0, atol=1e-6)


def test_step_budget_distributions_are_pure_and_in_range() -> None:
    uniform = parse_local_steps_dist({"distribution": "uniform", "low": 2, "high": 5})
    clients = torch.arange(200)
    a = uniform.draw(0, 3, clients)
    assert torch.equal(a, uniform.draw(0, 3, clients)) and not torch.equal(a, uniform.draw(0, 4, clients))
    assert a.min() == 2 and a.max() == 5
    choice = parse_local_steps_dist({"distribution": "choice", "values": [1, 10], "probs": [0.25, 0.75]})
    b = choice.draw(1, 0, torch.arange(4000))
    assert set(b.unique().tolist()) == {1, 10}
    assert abs(float((b == 1).double().mean()) - 0.25) < 0.03
    assert parse_local_steps_dist([3, 1, 2]) == StepBudget("per_client", per_client=(3, 1, 2))


@pytest.mark.parametrize(("spec", "message"), [
    ([], "empty list"),
    ([1, 0], r"model.local_steps_dist\[1\] must be an integer >= 1"),
    ({"distribution": "normal"}, "distribution must be 'uniform' or 'choice'"),
    ({"distribution": "uniform", "low": 3, "high": 2}, "high must be >= model.local_steps_dist.low"),
    ({"distribution": "uniform", "low": 1}, "needs low and high"),
    ({"distribution": "choice", "values": [1, 2], "probs": [0.5]}, "probs must be 2 probabilities"),
    ({"distribution": "uniform", "low": 1, "high": 2, "p": 1}, "unknown"),
    ("3", "must be a list"),
])
def test_bad_step_budgets_are_refused_with_the_option_named(spec, message) -> None:
    with pytest.raises(ValueError, match=message):
        FederatedModule(local_steps_dist=spec)


def test_budgets_are_checked_against_the_algorithm_and_the_clients() -> None:
    with pytest.raises(ValueError, match="does not support per-client budgets"):
        FederatedModule(model=nn.Linear(5, 3), algorithm="mocha", clients_per_round=2,
                        local_steps_dist=[1] * 6).attach_data(tiny_data())
    with pytest.raises(ValueError, match="up to 12 local steps"):
        _linear_module(local_steps_dist={"distribution": "uniform", "low": 1, "high": 12}).attach_data(tiny_data())
    with pytest.raises(ValueError, match="one budget per client: 6 entries, got 2"):
        _linear_module(local_steps_dist=[1, 2]).attach_data(tiny_data())
    with pytest.raises(ValueError, match=r"model.client_dropout must be a probability in \[0, 1\)"):
        FederatedModule(client_dropout=1.0)
    with pytest.raises(ValueError, match="model.over_selection must be a finite number >= 0"):
        FederatedModule(over_selection=-0.1)


def test_fednova_normalises_by_each_clients_steps() -> None:
    """Δ = (Σ p_i τ_i) Σ p_i Δ_i / τ_i (Wang et al. 2020) through the module, unequal sizes and budgets."""
    data = tiny_data(num_clients=6)
    budgets = [2, 5, 1, 5, 3, 4]
    torch.manual_seed(0)
    module = FederatedModule(model=nn.Linear(5, 3), algorithm={"name": "fedavg", "local_steps": 5, "batch_size": 4},
                             clients_per_round=4, local_steps_dist=budgets, aggregator="fednova",
                             compile_clients=False, seed=9)
    module.attach_data(data)
    result = module.engine.compute(0)
    sampled, out, weights = result
    steps = torch.tensor([budgets[c] for c in sampled.tolist()], dtype=torch.float64)
    p = data.train_counts[sampled].double()
    p = p / p.sum()
    combined = module.engine.combine(result)
    assert combined is not None and combined.update is not None
    delta = combined.update.delta
    tau_eff = float((p * steps).sum())
    for k, v in out.delta.items():
        expected = tau_eff * sum(p[i] * v[i].double() / steps[i] for i in range(4))
        torch.testing.assert_close(delta[k].double(), expected, rtol=1e-5, atol=1e-7)
    plain = sum(p[i] * out.delta["weight"][i].double() for i in range(4))
    assert not torch.allclose(delta["weight"].double(), plain, atol=1e-4)  # the normalisation changed something
