"""pFedMe plugin: the loop's contract (one call of the kit), then what is pFedMe's own: hyper-parameter
validation, the inner prox solve against its closed form, what a client is scored with, registration, and
that it learns.

Run against the INSTALLED distribution (``pip install ./plugins/fedmeta-pfedme``): the ``src``
layout keeps the source tree off ``sys.path``, so these tests see what a user sees.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning_fedmeta import Batch, FederatedModule, list_algorithms, load_algorithm
from lightning_fedmeta.testing import check_algorithm, client_record, quadratic_client

from fedmeta_pfedme import PFedMe

INSTALL_HINT = "install the plugin first: pip install ./plugins/fedmeta-pfedme"


def test_pfedme_keeps_the_contract_of_the_federated_loop() -> None:
    """Rounds, loop == vmap, evaluation == personalize(i), never-trained clients, bit-exact resume, bf16."""
    check_algorithm("pfedme")


# ----------------------------------------------------------------------------------------------
# hyper-parameters
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lam": 0.0}, r"lam \(λ\) must be > 0, got 0.0"),
        ({"lam": -1.0}, r"lam \(λ\) must be > 0, got -1.0"),
        ({"personal_lr": 0.0}, r"personal_lr \(ν\) must be > 0, got 0.0"),
        ({"inner_steps": 0}, r"inner_steps \(K\) must be an integer >= 1, got 0"),
        ({"inner_steps": 2.5}, r"inner_steps \(K\) must be an integer >= 1, got 2.5"),
        ({"lam": 15.0, "personal_lr": 0.2}, r"personal_lr·lam must be < 2 .* lower personal_lr below"),
        ({"lam": 15.0, "local_lr": 0.2}, r"local_lr·lam must be < 2 .* lower local_lr below"),
        ({"local_steps": 0}, r"local_steps must be an integer >= 1, got 0"),
        ({"batch_size": 0}, r"batch_size must be > 0, got 0"),
        ({"eval_batch_size": -3}, r"eval_batch_size must be > 0 \(or None for the whole training set\), got -3"),
    ],
)
def test_pfedme_rejects_impossible_hyperparameters_with_value_and_range(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PFedMe(**kwargs)


def test_pfedme_defaults_are_the_papers_mnist_setting() -> None:
    alg = PFedMe()
    assert (alg.lam, alg.personal_lr, alg.inner_steps, alg.local_steps, alg.local_lr, alg.batch_size) == (
        15.0, 0.1, 5, 20, 0.005, 20,
    )
    assert alg.round_plan().steps == 20 and alg.round_plan().batch_size == 20
    assert alg.eval_plan().steps == 1 and alg.eval_plan().batch_size is None


# ----------------------------------------------------------------------------------------------
# the inner prox solve, on a client whose loss is a known quadratic
# ----------------------------------------------------------------------------------------------
def test_inner_solve_converges_to_the_closed_form_prox_point_on_a_quadratic() -> None:
    """θ̂ = argmin f(θ) + λ/2‖θ − w‖² = (A + λI)⁻¹ (b + λw); the K-step error shrinks to ~0."""
    q = quadratic_client()
    lam = 2.0
    exact = q.prox(q.params, lam)["weight"]
    lipschitz = float(torch.linalg.eigvalsh(q.hessian).max()) + lam
    errors = []
    for k in (1, 5, 25, 200):
        alg = PFedMe(lam=lam, personal_lr=1.0 / lipschitz, inner_steps=k)
        theta, _ = alg.prox_point(q.ctx, q.params, q.batches.at(0, 0), q.params)
        errors.append(float((theta["weight"] - exact).norm()))
    assert all(later < earlier for earlier, later in zip(errors, errors[1:], strict=False)), errors
    assert errors[-1] < 1e-8 * max(1.0, float(exact.norm())), errors


def test_large_lambda_pins_the_personal_model_to_the_global_model() -> None:
    """‖θ̂ − w‖ ≤ ‖∇f(w)‖/λ for convex f, so θ_i → w as λ grows (K steps from θ = w stay within 2‖∇f(w)‖/λ)."""
    q = quadratic_client(dim=5, num_samples=32, seed=1)
    grad_norm = float(q.grad(q.params)["weight"].norm())
    lipschitz = float(torch.linalg.eigvalsh(q.hessian).max())
    distances = []
    for lam in (1.0, 10.0, 100.0, 1000.0, 10000.0):
        alg = PFedMe(lam=lam, personal_lr=1.0 / (lam + lipschitz), inner_steps=50, local_lr=1.0 / lam)
        theta = alg.personalize(q.ctx, q.params, q.batches, alg.init_client_state(q.params), {}, q.record)
        dist = float((theta["weight"] - q.params["weight"]).norm())
        assert dist <= 2.0 * grad_norm / lam + 1e-9, (lam, dist, grad_norm)
        distances.append(dist)
    assert all(later < earlier for earlier, later in zip(distances, distances[1:], strict=False)), distances
    assert distances[-1] < 1e-3


def test_local_model_moves_towards_the_personal_model_by_eta_lambda() -> None:
    """One local round with K inner steps: Δ = −ηλ (w − θ) exactly, θ from prox_point."""
    q = quadratic_client()
    alg = PFedMe(lam=2.0, personal_lr=0.05, inner_steps=3, local_steps=1, local_lr=0.1, batch_size=None)
    theta, _ = alg.prox_point(q.ctx, q.params, q.batches.at(0, 0), q.params)
    out = alg.client_update(q.ctx, q.params, q.batches, alg.init_client_state(q.params), {}, q.record)
    torch.testing.assert_close(out.delta["weight"], -0.1 * 2.0 * (q.params["weight"] - theta["weight"]))


# ----------------------------------------------------------------------------------------------
# what a client is scored with (README, "Evaluation")
# ----------------------------------------------------------------------------------------------
def test_client_state_starts_as_a_copy_of_the_parameters() -> None:
    w = quadratic_client().params
    state = PFedMe().init_client_state(w)
    assert set(state) == {"theta"} and set(state["theta"]) == {"weight"}
    torch.testing.assert_close(state["theta"]["weight"], w["weight"], atol=0, rtol=0)
    assert state["theta"]["weight"].data_ptr() != w["weight"].data_ptr()


def test_trained_client_is_scored_with_the_theta_of_its_local_training_not_a_fresh_prox_solve() -> None:
    """After a round, the evaluated model of a sampled client is the θ after the K inner steps of its last local
    round (the authors' ``persionalized_model_bar``), even once the global model has moved on; not θ̂(w)."""
    q = quadratic_client(steps=2)
    trained = client_record(q.x.shape[0], seen=True)
    alg = PFedMe(lam=2.0, personal_lr=0.05, inner_steps=3, local_steps=2, local_lr=0.1, batch_size=None)
    full = Batch(q.batches.x[:1], q.batches.y[:1], q.batches.mask[:1])
    # the local training by hand: θ warm-started across the two local rounds, w_local pulled towards θ
    theta, w_local = q.params, q.params
    for r in range(2):
        theta, _ = alg.prox_point(q.ctx, w_local, q.batches.at(r, 0), theta)
        w_local = {k: w_local[k] - 0.1 * 2.0 * (w_local[k] - theta[k]) for k in q.params}
    out = alg.client_update(q.ctx, q.params, q.batches, alg.init_client_state(q.params), {}, q.record)
    moved = {k: v + 0.5 for k, v in q.params.items()}  # the global model after later rounds the client sat out
    for global_now in (q.params, moved):
        scored = alg.personalize(q.ctx, global_now, full, out.state, {}, trained)
        torch.testing.assert_close(scored["weight"], theta["weight"], atol=1e-12, rtol=0)
        fresh, _ = alg.prox_point(q.ctx, global_now, full.at(0, 0), global_now)
        assert float((scored["weight"] - fresh["weight"]).norm()) > 1e-2


def test_never_trained_client_is_scored_with_the_prox_solve_from_the_current_global_model() -> None:
    """No personal model yet (never sampled, held out): θ̂(w), K inner steps from θ = w on its training data."""
    q = quadratic_client()
    alg = PFedMe(lam=2.0, personal_lr=0.05, inner_steps=3)
    stale = {"theta": {"weight": q.params["weight"] - 1.0}}  # whatever the row holds, an untrained client ignores it
    for state in (alg.init_client_state(q.params), stale):
        scored = alg.personalize(q.ctx, q.params, q.batches, state, {}, q.record)
        fresh, _ = alg.prox_point(q.ctx, q.params, q.batches.at(0, 0), q.params)
        torch.testing.assert_close(scored["weight"], fresh["weight"], atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------------------------
# registry, and a short run
# ----------------------------------------------------------------------------------------------
def test_pfedme_is_registered_by_its_own_distribution() -> None:
    entries = [e for e in list_algorithms() if e.name == "pfedme"]
    assert entries, INSTALL_HINT
    assert {e.distribution for e in entries} == {"fedmeta-pfedme"}
    assert load_algorithm("pfedme") is PFedMe
    assert load_algorithm("fedmeta-pfedme:pfedme") is PFedMe


def test_pfedme_by_name_improves_personalised_accuracy_on_synthetic_data() -> None:
    from lightning_fedmeta.data import FederatedDataModule

    dm = FederatedDataModule(dataset="synthetic", num_clients=10, eval_every=6, data_seed=0)
    dm.setup("fit")
    torch.manual_seed(0)
    module = FederatedModule(
        algorithm={"name": "pfedme", "lam": 20.0, "personal_lr": 0.01, "inner_steps": 3, "local_steps": 5,
                   "local_lr": 0.05, "batch_size": 20},
        clients_per_round=5,
    )
    module.attach_data(dm.federated_data)
    clients = torch.arange(dm.federated_data.num_clients)
    scores = module.evaluate_clients(clients, 0)
    before = float(scores["builtin"][:, 0].sum() / scores["total"].sum())
    trainer = L.Trainer(max_steps=12, max_epochs=-1, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(module, dm)
    after = float(module.last_summary["clients"]["acc_weighted"])
    assert after > before + 0.15, (before, after)
