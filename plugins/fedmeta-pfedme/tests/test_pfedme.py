"""pFedMe plugin: hyper-parameter validation, the inner prox solve, what a client is scored with, registry
wiring, a short run, loop = vmap.

Run against the INSTALLED distribution (``pip install ./plugins/fedmeta-pfedme``): the ``src``
layout keeps the source tree off ``sys.path``, so these tests see what a user sees.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from lightning_fedmeta import (
    Batch,
    ClientContext,
    ClientRecord,
    FederatedModule,
    client_records,
    from_client_tensors,
    list_algorithms,
    load_algorithm,
)
from torch import Tensor, nn

from fedmeta_pfedme import PFedMe

INSTALL_HINT = "install the plugin first: pip install ./plugins/fedmeta-pfedme"


def _one_batch(x: Tensor, y: Tensor) -> Batch:
    """A single full batch shaped ``[steps=1, per_step=1, B, ...]``."""
    return Batch(x[None, None], y[None, None], torch.ones(1, 1, x.shape[0]))


def _record(num_samples: int, seen: bool) -> ClientRecord:
    """One client's record (0-d fields), as the loop passes it to ``client_update`` and ``personalize``."""
    return ClientRecord(*(t[0] for t in client_records([num_samples], seen=[seen])))


def _half_squared_error(out: Tensor, y: Tensor) -> Tensor:
    return 0.5 * (out.squeeze(-1) - y) ** 2


def _quadratic_problem(d: int = 4, n: int = 16) -> tuple[ClientContext, dict[str, Tensor], Tensor, Tensor]:
    """f(θ) = (1/2n) ‖Xθ − y‖² through a bias-free linear model, a point w, and (X, y)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.randn(n, generator=g, dtype=torch.float64)
    model = nn.Linear(d, 1, bias=False).double()
    ctx = ClientContext(model, per_sample_loss=_half_squared_error)
    w = {"weight": torch.randn(1, d, generator=g, dtype=torch.float64)}
    return ctx, w, x, y


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
# the inner prox solve
# ----------------------------------------------------------------------------------------------
def test_inner_solve_converges_to_the_closed_form_prox_point_on_a_quadratic() -> None:
    """θ̂ = argmin (1/2n)‖Xθ − y‖² + λ/2‖θ − w‖² = (XᵀX/n + λI)⁻¹ (Xᵀy/n + λw); the K-step error shrinks to ~0."""
    ctx, w, x, y = _quadratic_problem()
    lam = 2.0
    a = x.T @ x / x.shape[0]
    exact = torch.linalg.solve(a + lam * torch.eye(4, dtype=x.dtype), x.T @ y / x.shape[0] + lam * w["weight"][0])
    lipschitz = float(torch.linalg.eigvalsh(a).max()) + lam
    batch = _one_batch(x, y).at(0, 0)
    errors = []
    for k in (1, 5, 25, 200):
        alg = PFedMe(lam=lam, personal_lr=1.0 / lipschitz, inner_steps=k)
        theta, _ = alg.prox_point(ctx, w, batch, w)
        errors.append(float((theta["weight"][0] - exact).norm()))
    assert all(later < earlier for earlier, later in zip(errors, errors[1:], strict=False)), errors
    assert errors[-1] < 1e-8 * max(1.0, float(exact.norm())), errors


def test_large_lambda_pins_the_personal_model_to_the_global_model() -> None:
    """‖θ̂ − w‖ ≤ ‖∇f(w)‖/λ for convex f, so θ_i → w as λ grows (K steps from θ = w stay within 2‖∇f(w)‖/λ)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 5, generator=g)
    y = torch.randint(0, 3, (32,), generator=g)
    model = nn.Linear(5, 3)
    ctx = ClientContext(model)
    w = {k: v.detach().clone() for k, v in model.named_parameters()}
    batches = _one_batch(x, y)
    grad_norm = float(sum((v**2).sum() for v in ctx.grad(w, batches.at(0, 0)).values()).sqrt())
    distances = []
    for lam in (1.0, 10.0, 100.0, 1000.0, 10000.0):
        alg = PFedMe(lam=lam, personal_lr=1.0 / (lam + 10.0), inner_steps=50, local_lr=1.0 / lam)
        theta = alg.personalize(ctx, w, batches, alg.init_client_state(w), {}, _record(32, seen=False))
        dist = float(sum(((theta[k] - w[k]) ** 2).sum() for k in w).sqrt())
        assert dist <= 2.0 * grad_norm / lam + 1e-6, (lam, dist, grad_norm)
        distances.append(dist)
    assert all(later < earlier for earlier, later in zip(distances, distances[1:], strict=False)), distances
    assert distances[-1] < 1e-3


def test_local_model_moves_towards_the_personal_model_by_eta_lambda() -> None:
    """One local round with K inner steps: Δ = −ηλ (w − θ) exactly, θ from prox_point."""
    ctx, w, x, y = _quadratic_problem()
    alg = PFedMe(lam=2.0, personal_lr=0.05, inner_steps=3, local_steps=1, local_lr=0.1, batch_size=None)
    batches = _one_batch(x, y)
    theta, _ = alg.prox_point(ctx, w, batches.at(0, 0), w)
    out = alg.client_update(ctx, w, batches, alg.init_client_state(w), {}, _record(x.shape[0], seen=False))
    torch.testing.assert_close(out.delta["weight"], -0.1 * 2.0 * (w["weight"] - theta["weight"]))


# ----------------------------------------------------------------------------------------------
# what a client is scored with (README, "Evaluation")
# ----------------------------------------------------------------------------------------------
def test_client_state_starts_as_a_copy_of_the_parameters() -> None:
    _, w, _, _ = _quadratic_problem()
    state = PFedMe().init_client_state(w)
    assert set(state) == {"theta.weight"}
    torch.testing.assert_close(state["theta.weight"], w["weight"], atol=0, rtol=0)
    assert state["theta.weight"].data_ptr() != w["weight"].data_ptr()


def test_trained_client_is_scored_with_the_theta_of_its_local_training_not_a_fresh_prox_solve() -> None:
    """After a round, the evaluated model of a sampled client is the θ after the K inner steps of its last local
    round (the authors' ``persionalized_model_bar``), even once the global model has moved on; not θ̂(w)."""
    ctx, w, x, y = _quadratic_problem(n=16)
    alg = PFedMe(lam=2.0, personal_lr=0.05, inner_steps=3, local_steps=2, local_lr=0.1, batch_size=8)
    rounds = Batch(x.reshape(2, 1, 8, 4), y.reshape(2, 1, 8), torch.ones(2, 1, 8))
    full = _one_batch(x, y)
    # the local training by hand: θ warm-started across the two local rounds, w_local pulled towards θ
    theta, w_local = w, w
    for r in range(2):
        theta, _ = alg.prox_point(ctx, w_local, rounds.at(r, 0), theta)
        w_local = {k: w_local[k] - 0.1 * 2.0 * (w_local[k] - theta[k]) for k in w}
    out = alg.client_update(ctx, w, rounds, alg.init_client_state(w), {}, _record(16, seen=False))
    trained = _record(16, seen=True)
    moved = {k: v + 0.5 for k, v in w.items()}  # the global model after later rounds the client sat out
    for global_now in (w, moved):
        scored = alg.personalize(ctx, global_now, full, out.state, {}, trained)
        torch.testing.assert_close(scored["weight"], theta["weight"], atol=1e-12, rtol=0)
        fresh, _ = alg.prox_point(ctx, global_now, full.at(0, 0), global_now)
        assert float((scored["weight"] - fresh["weight"]).norm()) > 1e-2


def test_never_trained_client_is_scored_with_the_prox_solve_from_the_current_global_model() -> None:
    """No personal model yet (never sampled, held out): θ̂(w), K inner steps from θ = w on its training data."""
    ctx, w, x, y = _quadratic_problem()
    alg = PFedMe(lam=2.0, personal_lr=0.05, inner_steps=3)
    full = _one_batch(x, y)
    stale = {"theta.weight": w["weight"] - 1.0}  # whatever the row holds, an untrained client never reads it
    for state in (alg.init_client_state(w), stale):
        scored = alg.personalize(ctx, w, full, state, {}, _record(x.shape[0], seen=False))
        fresh, _ = alg.prox_point(ctx, w, full.at(0, 0), w)
        torch.testing.assert_close(scored["weight"], fresh["weight"], atol=1e-12, rtol=0)


# ----------------------------------------------------------------------------------------------
# registry and the federated loop
# ----------------------------------------------------------------------------------------------
def test_pfedme_is_registered_by_its_own_distribution() -> None:
    entries = [e for e in list_algorithms() if e.name == "pfedme"]
    assert entries, INSTALL_HINT
    assert {e.distribution for e in entries} == {"fedmeta-pfedme"}
    assert load_algorithm("pfedme") is PFedMe
    assert load_algorithm("fedmeta-pfedme:pfedme") is PFedMe


def _tiny_clients(num_clients: int = 6) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
    g = torch.Generator().manual_seed(0)
    w_true = torch.randn(5, 3, generator=g)
    clients = []
    for i in range(num_clients):
        n = 6 + 3 * (i % 3)
        x = torch.randn(n + 4, 5, generator=g) + 0.5 * (i % 3)
        y = (x @ w_true).argmax(1)
        clients.append((x[:n], y[:n], x[n:], y[n:]))
    return clients


def test_loop_and_vmap_clients_agree_to_1e_6() -> None:
    data = from_client_tensors(_tiny_clients(), 3)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    spec = {"name": "pfedme", "lam": 5.0, "personal_lr": 0.05, "inner_steps": 3, "local_steps": 4,
            "local_lr": 0.05, "batch_size": 4}
    results = {}
    for mode in ("loop", "vmap"):
        module = FederatedModule(copy.deepcopy(model), spec, clients_per_round=4, client_batching=mode)
        module.attach_data(data)
        _, out, _ = module.compute_round(3)
        evaluated = module.evaluate_clients(torch.arange(data.num_clients), 3)
        results[mode] = (out, evaluated)
    (loop_out, loop_eval), (vmap_out, vmap_eval) = results["loop"], results["vmap"]
    for k in loop_out.delta:
        torch.testing.assert_close(loop_out.delta[k], vmap_out.delta[k], atol=1e-6, rtol=0)
    for k in loop_out.metrics:
        torch.testing.assert_close(loop_out.metrics[k], vmap_out.metrics[k], atol=1e-6, rtol=0)
    for a, b in zip(loop_eval, vmap_eval, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


class _TinyDataset:
    """``_tiny_clients`` as a user dataset for ``FederatedDataModule``."""

    num_classes = 3

    def __init__(self, num_clients: int) -> None:
        self.num_clients = num_clients

    def client_data(self) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
        return _tiny_clients(self.num_clients)


def _quiet_trainer(max_steps: int) -> L.Trainer:
    return L.Trainer(max_steps=max_steps, max_epochs=-1, accelerator="cpu", devices=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0)


@pytest.mark.parametrize("mode", ["loop", "vmap"])
def test_after_one_round_sampled_clients_are_scored_with_their_theta_and_the_rest_as_new_clients(mode: str) -> None:
    """One real round: a sampled client's evaluated model is the θ its ``client_update`` returned; a client that
    did not train (not sampled, or held out) is scored exactly as a new client with its training data (θ̂(w))."""
    from lightning_fedmeta.data import FederatedDataModule

    clients = _tiny_clients(6)
    dm = FederatedDataModule(dataset=_TinyDataset(6), eval_every=100)
    dm.setup("fit")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    spec = {"name": "pfedme", "lam": 5.0, "personal_lr": 0.05, "inner_steps": 3, "local_steps": 4,
            "local_lr": 0.05, "batch_size": 4}
    module = FederatedModule(model, spec, clients_per_round=2, holdout_clients=1, client_batching=mode)
    module.attach_data(dm.federated_data)
    sampled, out, _ = module.compute_round(0)  # what round 0 will compute (a pure function of seed and round)
    _quiet_trainer(1).fit(module, dm)
    assert bool(module.seen[sampled].all()) and int(module.seen.sum()) == sampled.numel()
    held_out = set(module.holdout.tolist())
    assert held_out and not held_out & set(sampled.tolist())

    correct, total, _ = module.evaluate_clients(torch.arange(len(clients)), 1)
    for i, (x, y, x_test, y_test) in enumerate(clients):
        personal = module.personalize(i)
        scored = dict(personal.named_parameters())
        as_new_client = dict(module.personalize((x, y)).named_parameters())
        if i in sampled.tolist():
            gap = max(float((scored[n] - as_new_client[n]).detach().abs().max()) for n in scored)
            assert gap > 1e-3, (i, gap)  # the stored θ, not a prox solve recomputed from the new w
            pos = sampled.tolist().index(i)
            for name, p in scored.items():
                torch.testing.assert_close(p, out.state["theta." + name][pos], atol=1e-6, rtol=0)
        else:
            for name, p in scored.items():
                torch.testing.assert_close(p, as_new_client[name], atol=1e-5, rtol=0)
        # the evaluation scores exactly that model
        with torch.no_grad():
            hits = int((personal(x_test).argmax(1) == y_test).sum())
        assert (int(correct[i]), int(total[i])) == (hits, y_test.numel()), i


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
    correct, total, _ = module.evaluate_clients(clients, 0)
    before = float(correct.sum() / total.sum())
    trainer = L.Trainer(max_steps=12, max_epochs=-1, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(module, dm)
    after = float(module.last_summary["clients"]["acc_weighted"])
    assert after > before + 0.15, (before, after)
