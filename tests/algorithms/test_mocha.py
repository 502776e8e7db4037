"""MOCHA: duality gap, agreement with a centralised solve for fixed Ω, the Ω update, batching."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.mocha import Mocha, covariance_update
from lightning_fedmeta.data import FederatedData, from_client_tensors
from tests.helpers import fit

K, D, N = 4, 5, 24


def multitask_data(seed: int = 0) -> FederatedData:
    """K related binary tasks (labels {0, 1}), unequal sizes: w_t = w_0 + 0.5 ε_t, y = [x·w_t + noise > 0]."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(D, generator=g)
    clients = []
    for t in range(K):
        w = base + 0.5 * torch.randn(D, generator=g)
        n = N - 4 * t
        x = torch.randn(n + 8, D, generator=g)
        y = ((x @ w + 0.3 * torch.randn(n + 8, generator=g)) > 0).long()
        clients.append((x[:n], y[:n], x[n:], y[n:]))
    return from_client_tensors(clients, 2)


def fixed_sigma() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    a = torch.randn(K, K, generator=g, dtype=torch.float64)
    sigma = a @ a.t() / K + 0.2 * torch.eye(K, dtype=torch.float64)
    return sigma / sigma.trace()


def run_mocha(alg: Mocha, rounds: int, sigma: torch.Tensor | None = None, batching: str = "auto") -> FederatedModule:
    """Full participation; the server step is taken by ``aggregate`` exactly as in ``training_step``."""
    module = FederatedModule(model=nn.Linear(D, 2), algorithm=alg, clients_per_round=K, client_batching=batching)
    module.attach_data(multitask_data())
    if sigma is not None:
        module.server_state = alg.set_task_covariance(module.server_state, sigma)
    for r in range(rounds):
        _round(module, r)
    return module


def client_arrays(data: FederatedData) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per task: features with a constant 1 appended, labels in {−1, +1} (class 1 vs rest)."""
    out = []
    for t in range(data.num_clients):
        x, y = data.client_train(t)
        xa = np.concatenate([x.double().numpy(), np.ones((x.shape[0], 1))], axis=1)
        out.append((xa, 2.0 * (y.double().numpy() == 1) - 1.0))
    return out


def regulariser_matrix(sigma: torch.Tensor, lambda1: float, lambda2: float) -> np.ndarray:
    """``A = λ₁ Σ⁻¹ + λ₂ I`` so that the regulariser is ``Σ_st A_st w_sᵀ w_t``."""
    s = sigma.numpy()
    return lambda1 * np.linalg.inv(s) + lambda2 * np.eye(s.shape[0])


def centralised_squared(data: FederatedData, a: np.ndarray) -> np.ndarray:
    """Closed form of min Σ_t Σ_i ½(w_tᵀx − y)² + Σ_st A_st w_sᵀw_t: (blockdiag(X_tᵀX_t) + 2 A⊗I) vec W = [X_tᵀy_t]."""
    arrays = client_arrays(data)
    dim = arrays[0][0].shape[1]
    lhs = 2.0 * np.kron(a, np.eye(dim))
    rhs = np.zeros(K * dim)
    for t, (x, y) in enumerate(arrays):
        lhs[t * dim : (t + 1) * dim, t * dim : (t + 1) * dim] += x.T @ x
        rhs[t * dim : (t + 1) * dim] = x.T @ y
    return np.linalg.solve(lhs, rhs).reshape(K, dim)


def hinge_primal(arrays: list[tuple[np.ndarray, np.ndarray]], a: np.ndarray, w: np.ndarray) -> float:
    """``P(W) = Σ_t Σ_i max(0, 1 − y_ti w_tᵀx_ti) + Σ_st A_st w_sᵀw_t`` (the SVM primal, any W)."""
    hinge = sum(np.maximum(0.0, 1.0 - y * (x @ w[t])).sum() for t, (x, y) in enumerate(arrays))
    return float(hinge + np.sum(a * (w @ w.T)))


def hinge_dual(arrays: list[tuple[np.ndarray, np.ndarray]], a: np.ndarray, betas: list[np.ndarray]) -> float:
    """``D(α) = Σ α_ti y_ti − ¼ Σ_st M_st v_sᵀv_t``, ``v_t = Σ_i α_ti x_ti``, ``M = A⁻¹``, for β = α y ∈ [0, 1].

    Weak duality: ``D(α) ≤ min P ≤ P(W)`` for every feasible α and every W, so ``P(W) − D(α)`` bounds the
    suboptimality of W. P is 2λ_min(A)-strongly convex, hence also ``‖W − W*‖²_F ≤ (P(W) − D(α)) / λ_min(A)``.
    """
    for beta in betas:
        assert np.all((beta >= 0.0) & (beta <= 1.0)), "dual point outside the box 0 <= α y <= 1"
    v = np.stack([x.T @ (beta * y) for (x, y), beta in zip(arrays, betas, strict=True)])
    return float(sum(beta.sum() for beta in betas) - 0.25 * np.sum(np.linalg.inv(a) * (v @ v.T)))


def centralised_hinge(data: FederatedData, a: np.ndarray, tol: float = 1e-10) -> tuple[np.ndarray, list[np.ndarray]]:
    """The exact SVM solution ``(W*, β*)`` with a certificate: ``P(W*) − D(β*) ≤ tol``.

    Plain numpy, no solver library: exact (sequential, centralised, float64) dual coordinate ascent on
    ``max_{0 ≤ β ≤ 1} Σ β_i − ½ βᵀQβ``, ``Q_ij = ½ M_{t(i)t(j)} y_i y_j x_iᵀx_j``, until the duality gap of
    ``W(β) = ½ M V(β)`` is below ``tol``. At ``W = W(β)`` the gap is ``Σ_i [max(0, 1 − m_i) − β_i (1 − m_i)]``
    (m_i = y_i w_tᵀx_i), a sum of non-negative terms: a zero gap is exactly the KKT conditions
    (m_i > 1 ⇒ β_i = 0, m_i < 1 ⇒ β_i = 1, 0 ≤ β_i ≤ 1 when m_i = 1).
    """
    arrays = client_arrays(data)
    m = np.linalg.inv(a)
    task = np.concatenate([np.full(len(y), t) for t, (_, y) in enumerate(arrays)])
    yx = np.concatenate([y[:, None] * x for x, y in arrays])
    q = 0.5 * m[np.ix_(task, task)] * (yx @ yx.T)
    beta, margin = np.zeros(len(task)), np.zeros(len(task))  # margin = Qβ = y_i w_tᵀx_i at W(β)
    splits = np.cumsum([len(y) for _, y in arrays])[:-1]
    gap = np.inf
    for _ in range(10_000):
        for i in range(len(beta)):
            new = min(1.0, max(0.0, beta[i] + (1.0 - margin[i]) / q[i, i]))
            if new != beta[i]:
                margin += (new - beta[i]) * q[:, i]
                beta[i] = new
        betas = np.split(beta.copy(), splits)
        v = np.stack([x.T @ (b * y) for (x, y), b in zip(arrays, betas, strict=True)])
        w = 0.5 * m @ v
        gap = hinge_primal(arrays, a, w) - hinge_dual(arrays, a, betas)
        if gap <= tol:
            return w, betas
    raise AssertionError(f"reference SVM dual coordinate ascent did not converge: duality gap {gap:.3g}")


def learned_w(module: FederatedModule, cls: int = 1) -> np.ndarray:
    return module.server_state["W"][:, cls, :].double().numpy()


def test_mocha_squared_gap_vanishes_and_matches_closed_form_for_fixed_omega() -> None:
    sigma = fixed_sigma()
    alg = Mocha(loss="squared", lambda1=1.0, lambda2=0.1, local_iters=40, omega_every=0)
    module = run_mocha(alg, 40, sigma)
    assert float(module.server_state["duality_gap"]) < 1e-3
    expected = centralised_squared(multitask_data(), regulariser_matrix(sigma, 1.0, 0.1))
    np.testing.assert_allclose(learned_w(module), expected, atol=1e-4)


def test_mocha_one_sdca_step_from_zero_is_the_closed_form() -> None:
    """One round of one SDCA step per client, squared loss, Σ fixed, from α = 0 (so W = 0). Client t's
    subproblem in its one coordinate i is  max_Δ −ℓ*(−Δ) − w_tᵀx Δ − (σ' M_tt / 4) ‖x‖² Δ²  with
    ℓ*(−a) = ½a² − a y and w_t = 0, so  Δ = y / (1 + q),  q = ½ σ' M_tt ‖x‖²,  ‖x‖² counting the constant
    feature 1 of the bias: |α_i| = 1 / (1 + ½ σ' M_tt (‖x_i‖² + 1)), with the sign of y_i, for both mirrored
    classes; every other α is 0. M = (λ₁ Σ⁻¹ + λ₂ I)⁻¹ and σ' = max_t Σ_s |M_ts| / M_tt are recomputed here
    (a dense Σ: σ' > 1 and M_tt ≠ M_ss, so neither factor can be dropped unnoticed)."""
    sigma, lambda1, lambda2 = fixed_sigma(), 0.7, 0.3
    module = run_mocha(Mocha(loss="squared", lambda1=lambda1, lambda2=lambda2, local_iters=1, omega_every=0), 1, sigma)
    m = torch.linalg.inv(lambda1 * torch.linalg.inv(sigma) + lambda2 * torch.eye(K, dtype=torch.float64))
    sigma_prime = (m.abs().sum(1) / m.diagonal()).max()
    assert sigma_prime > 1.05 and m.diagonal().std() > 0.01 * m.diagonal().mean()
    torch.testing.assert_close(module.server_state["M"].double(), m, rtol=1e-6, atol=0)
    torch.testing.assert_close(module.server_state["sigma_prime"].double(), sigma_prime, rtol=1e-6, atol=0)
    alpha = module.client_states.tensors["alpha"]  # [K, largest client, 2]
    data = module.data
    assert data is not None
    for t in range(K):
        x, y = data.client_train(t)
        moved = alpha[t].abs().sum(1).nonzero().flatten()
        assert moved.numel() == 1, f"client {t}: one SDCA step moves one coordinate, moved {moved.tolist()}"
        i = int(moved)
        q = 0.5 * sigma_prime * m[t, t] * (x[i].double().pow(2).sum() + 1.0)
        y_pm = torch.tensor([-1.0, 1.0], dtype=torch.float64) * (1.0 if int(y[i]) == 1 else -1.0)  # class 0, 1
        torch.testing.assert_close(alpha[t, i].double(), y_pm / (1.0 + q), rtol=1e-6, atol=0)


def test_mocha_hinge_gap_vanishes_and_matches_svm_qp_for_fixed_omega() -> None:
    sigma = fixed_sigma()
    alg = Mocha(loss="hinge", lambda1=1.0, lambda2=0.1, local_iters=60, omega_every=0)
    module = run_mocha(alg, 70, sigma)
    assert 0 <= float(module.server_state["duality_gap"]) < 1e-3
    a = regulariser_matrix(sigma, 1.0, 0.1)
    arrays = client_arrays(multitask_data())
    expected, betas = centralised_hinge(multitask_data(), a)
    lower_bound = hinge_dual(arrays, a, betas)  # ≤ min P, certified tight to 1e-10 by centralised_hinge
    for cls, sign in ((1, 1.0), (0, -1.0)):  # class 0 vs rest is the mirror problem: W = −W*
        w = sign * learned_w(module, cls)
        # MOCHA's W is optimal by the certificate alone (whatever solved the reference) ...
        assert hinge_primal(arrays, a, w) - lower_bound < 1e-5, f"class {cls}: W is not SVM-optimal"
        # ... and equals the exact solution
        np.testing.assert_allclose(w, expected, atol=1e-4)


def test_mocha_omega_update_is_normalised_matrix_square_root() -> None:
    w = torch.randn(5, 7, dtype=torch.float64)
    sigma = covariance_update(w)
    assert torch.allclose(sigma.trace(), torch.tensor(1.0, dtype=torch.float64))
    gram = w @ w.t()
    assert torch.allclose(sigma @ sigma / (sigma @ sigma).trace(), gram / gram.trace(), atol=1e-10)


def test_mocha_alternating_omega_updates_keep_gap_finite_and_sigma_normalised() -> None:
    alg = Mocha(loss="hinge", lambda1=1.0, lambda2=0.1, local_iters=20, omega_every=3)
    module = run_mocha(alg, 6)
    sigma = module.server_state["Sigma"]
    assert torch.allclose(sigma.trace(), torch.tensor(1.0, dtype=sigma.dtype))
    assert not torch.allclose(sigma, torch.eye(K, dtype=sigma.dtype) / K)
    assert torch.isfinite(module.server_state["duality_gap"])


def _round(module: FederatedModule, r: int) -> tuple[dict, dict]:
    """One round of ``run_mocha``'s loop: (server state before, server state after)."""
    alg = module.algorithm
    before = {k: v.clone() for k, v in module.server_state.items()}
    sampled, out, weights = module.compute_round(r)
    params = module._global_params()
    delta, after = alg.aggregate(params, out, weights, module.server_state, module.records(sampled))
    with torch.no_grad():
        for name, p in module.model.named_parameters():
            p.add_(delta[name])
    module.commit_round(sampled, out, after)
    return before, after


@pytest.mark.parametrize("warm_start", ["primal", "dual"])
def test_mocha_sigma_step_keeps_the_task_models_or_the_duals(warm_start: str) -> None:
    """At a Σ step (round 3 of ``omega_every=3``), the primal warm start (the default, the authors' code) keeps
    W: W_new = W_old + ½ M_old ΔV, the round's update under the M the clients used, and later rounds add
    ½ M_new ΔV; the dual warm start (the paper's Algorithm 1 read literally) jumps to W = ½ M_new V."""
    alg = Mocha(loss="hinge", lambda1=1.0, lambda2=0.1, local_iters=20, omega_every=3, sigma_warm_start=warm_start)
    module = run_mocha(alg, 2)
    before, after = _round(module, 2)
    assert not torch.allclose(after["Sigma"], before["Sigma"])  # the Σ step happened
    dv = after["V"] - before["V"]
    kept = before["W"] + 0.5 * torch.einsum("ts,s...->t...", before["M"], dv)
    jumped = 0.5 * torch.einsum("ts,s...->t...", after["M"], after["V"])
    if warm_start == "primal":
        torch.testing.assert_close(after["W"], kept, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(after["W"], jumped, atol=1e-3)
    else:
        torch.testing.assert_close(after["W"], jumped, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(after["W"], kept, atol=1e-3)
    before, after = _round(module, 3)  # a round without a Σ step: W moves by ½ M ΔV, M unchanged
    torch.testing.assert_close(after["M"], before["M"])
    step = 0.5 * torch.einsum("ts,s...->t...", before["M"], after["V"] - before["V"])
    torch.testing.assert_close(after["W"], before["W"] + step, atol=1e-5, rtol=1e-5)


def test_mocha_warm_starts_agree_while_sigma_is_fixed() -> None:
    """Without a Σ step the offset B stays zero and both warm starts give the same W = ½ M V, bit for bit."""
    runs = [run_mocha(Mocha(local_iters=15, omega_every=0, sigma_warm_start=w), 3, fixed_sigma())
            for w in ("primal", "dual")]
    assert torch.equal(runs[0].server_state["W"], runs[1].server_state["W"])
    assert not runs[0].server_state["B"].any()


def test_mocha_loop_and_vmap_agree() -> None:
    sigma = fixed_sigma()
    runs = [run_mocha(Mocha(local_iters=15, budget_spread=0.5, omega_every=2), 3, sigma, b) for b in ("loop", "vmap")]
    for key in ("W", "V", "Sigma"):
        torch.testing.assert_close(runs[0].server_state[key], runs[1].server_state[key], atol=1e-6, rtol=0)
    torch.testing.assert_close(runs[0].client_states.tensors["alpha"], runs[1].client_states.tensors["alpha"],
                               atol=1e-6, rtol=0)
    for a, b in zip(runs[0].model.parameters(), runs[1].model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_mocha_budget_spread_changes_local_work() -> None:
    sigma = fixed_sigma()
    full = run_mocha(Mocha(local_iters=20, omega_every=0), 1, sigma)
    spread = run_mocha(Mocha(local_iters=20, budget_spread=0.9, omega_every=0), 1, sigma)
    moved_full = (full.client_states.tensors["alpha"] != 0).sum()
    moved_spread = (spread.client_states.tensors["alpha"] != 0).sum()
    assert moved_spread < moved_full


def test_mocha_personal_model_is_the_task_row() -> None:
    sigma = fixed_sigma()
    module = run_mocha(Mocha(local_iters=20, omega_every=0), 3, sigma)
    personal = module.personalize(2)
    w = module.server_state["W"][2]
    torch.testing.assert_close(personal.weight.detach(), w[:, :D])
    torch.testing.assert_close(personal.bias.detach(), w[:, D])


@pytest.mark.parametrize(
    "kwargs",
    [{"loss": "logistic"}, {"lambda1": 0.0, "lambda2": 0.0}, {"local_iters": 0}, {"budget_spread": 1.0},
     {"omega_every": -1}, {"sigma_prime": 0.0}, {"sigma_warm_start": "both"}],
)
def test_mocha_rejects_bad_hyperparameters(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Mocha(**kwargs)


def test_mocha_rejects_nonlinear_model() -> None:
    module = FederatedModule(model=nn.Sequential(nn.Linear(D, 3), nn.ReLU(), nn.Linear(3, 2)), algorithm="mocha",
                             clients_per_round=K)
    with pytest.raises(ValueError, match="linear model"):
        module.attach_data(multitask_data())


def test_mocha_held_out_clients_are_scored_with_the_mean_task_model_not_an_all_zero_one() -> None:
    """A held-out task has no data: MOCHA keeps it decoupled (its row of W stays 0, Σ is estimated from
    the training tasks) and scores the new client with Σ_s p_s w_s over the training clients. Before the
    fix it was scored with the all-zero model: loss exactly ln C and accuracy 0 at every evaluation."""

    from lightning_fedmeta.data import FederatedDataModule

    class Tasks:
        num_classes = 2

        def client_data(self) -> list:
            data = multitask_data()
            return [(*data.client_train(t), *data.client_test(t)) for t in range(K)]

    module = FederatedModule(model=nn.Linear(D, 2), algorithm={"name": "mocha", "local_iters": 20, "omega_every": 2},
                             clients_per_round=K - 1, holdout_clients=1)
    fit(module, FederatedDataModule(dataset=Tasks(), eval_every=3), 6)
    new = int(module.holdout[0])
    state = module.server_state
    training = ~module.is_holdout
    assert torch.equal(state["W"][new], torch.zeros_like(state["W"][new]))
    sigma = state["Sigma"]
    assert float(sigma[new].abs().sum()) == pytest.approx(1.0 / K)  # its own I/K block, decoupled
    mean = torch.tensordot(module.client_weight[training].to(state["W"].dtype), state["W"][training], dims=1)
    personal = module.personalize(new)
    torch.testing.assert_close(personal.weight.detach(), mean[:, :D])
    torch.testing.assert_close(personal.bias.detach(), mean[:, D])
    summary = module.last_summary["new"]
    assert float(summary["loss_weighted"]) < float(np.log(2.0)) - 0.05
    x, y = module.data.client_test(new)
    with torch.no_grad():
        acc = float((personal(x).argmax(-1) == y).float().mean())
    assert float(summary["acc_weighted"]) == pytest.approx(acc)
    assert acc > 0.6
