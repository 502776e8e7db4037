"""MOCHA (Smith, Chiang, Sanjabi, Talwalkar, "Federated Multi-Task Learning", NeurIPS 2017, Algorithm 1).

One linear model w_t per client (task) t = 1..K, W = [w_1 … w_K]ᵀ, and a task-relationship
matrix. The primal problem (paper eq. 1–2, with the MTRL regulariser of Zhang & Yeung):

    min_W  P(W) = Σ_t Σ_i ℓ(w_tᵀ x_ti, y_ti) + λ₁ tr(W Ω Wᵀ) + λ₂ ‖W‖²_F,      Ω = Σ⁻¹,

alternating with the task-covariance update (paper §3.2; the reference code updates Σ and uses
Ω = Σ⁻¹):   Σ ← (WᵀW)^{1/2} / tr((WᵀW)^{1/2})   (WᵀW is the K×K Gram matrix of the task models).

For fixed Σ, with A = λ₁Ω + λ₂I (K×K) and M = A⁻¹ = Σ (λ₁I + λ₂Σ)⁻¹, the dual is

    max_α  D(α) = −Σ_t Σ_i ℓ*(−α_ti) − ¼ Σ_{s,t} M_st v_sᵀ v_t,    v_t = Σ_i α_ti x_ti,
    w_t(α) = ½ Σ_s M_ts v_s,

and the duality gap decomposes over clients:
    G(α) = P(W(α)) − D(α) = Σ_t G_t,   G_t = Σ_i [ℓ(w_tᵀx_ti) + ℓ*(−α_ti)] + w_tᵀ v_t ≥ 0.

Each round, client t approximately maximises its local quadratic model of D (paper eq. 4)
    G_t(Δα) = −Σ_i ℓ*(−α_i − Δα_i) − w_tᵀ X_tᵀΔα − (σ' M_tt / 4) ‖X_tᵀΔα‖²
with ``local_iters`` SDCA coordinate steps (a random permutation of its samples drawn from
(seed, round, client); with ``budget_spread = s > 0`` client t only takes ⌈H(1 − s u)⌉ steps,
u ~ U[0, 1) drawn the same way: the paper's systems heterogeneity), and uploads Δv_t = X_tᵀΔα.
The server sets v_t ← v_t + Δv_t and W = ½ M V + B. σ' = max_t Σ_s |M_ts| / M_tt (safe for additive
aggregation, as the reference code's ρ) unless given. Σ is re-estimated every ``omega_every``
rounds (0 = keep it fixed).

What a Σ step keeps (``sigma_warm_start``): with ``"primal"`` (the default, as the authors' MATLAB code,
gingsmith/fmtl ``run_mocha.m``, which adds each round's update to W and never recomputes it) the task
models W are unchanged by the step: the offset B ← W − ½ M_new V absorbs the change of M, and later
rounds move W by ½ M_new ΔV. With ``"dual"`` (Algorithm 1 read literally) B stays 0, the duals α are
kept and W jumps to ½ M_new V. Both are identical while Σ is fixed (B = 0). The jump can be large: on the
Per-FedAvg paper's Fashion-MNIST split (10 one-vs-rest SVMs, 45 clients), ``"dual"`` fell from 88 % to
53 % validation accuracy within 30 rounds of ``omega_every=10`` while ``"primal"`` kept 88 %
(docs/algorithms/mocha.md).

SDCA steps for coordinate i (q = σ' M_tt ‖x_i‖² / 2, w̃ = w_t + (σ' M_tt / 2) X_tᵀΔα):
    hinge   ℓ(z, y) = max(0, 1 − yz):   α_i y_i ← clip(α_i y_i + (1 − y_i w̃ᵀx_i) / q, 0, 1),
    squared ℓ(z, y) = ½ (z − y)²:       α_i ← α_i + (y_i − w̃ᵀx_i − α_i) / (1 + q).

Multi-class data are handled one-vs-rest: for every class c, y_tic = +1 if the label is c else −1,
and the C binary problems share Σ (their Gram matrices are summed). Labels {0, 1} with a 2-output
linear model give two mirrored binary problems. The model must be linear: one ``weight [C, d]``
and optionally one ``bias [C]`` (the bias is the weight of a constant feature 1 and is
regularised with it); evaluation uses the client's own w_t, and predicts the class with the
largest score (the reported loss is the cross-entropy of those scores).

Federated shape: the client state holds the dual variables α_t (padded to the largest client
and masked); a client finds its task row through its record (``client.index``). The server state
holds V, W, the offset B, Σ, M, σ', the clients' weights ``p`` and ``training`` mask, the round number and
each client's latest local gap (``gap [K]``); ``duality_gap`` is their sum — the exact gap of the
iterate of the round when every client took part in it and W = ½ M V (Σ fixed, or the dual warm start);
after a primal-warm-started Σ step (B ≠ 0) it is the same sum at the received W, a progress measure
rather than a certificate.

Held-out clients: a task without training data has v_t = 0, and Σ is estimated from the training
clients' task models only, with the held-out tasks in a separate ``I/K`` block, so they stay
decoupled (w_t = 0) and never bias Σ. MOCHA has no model of its own for a new task: a held-out (new)
client is evaluated with the weighted mean of the training clients' models ``Σ_s p_s w_s`` (also the
module's global model). The clients receive their whole training
set each round (``BatchPlan(1, 1, None)``, full batch, in sample order).
"""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn

from lightning_fedmeta.algorithms.base import (
    Algorithm,
    BatchPlan,
    ClientOutput,
    ClientRecord,
    check_integer,
    check_non_negative,
    check_range,
)
from lightning_fedmeta.algorithms.clustering import one_hot
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, weighted_sum

__all__ = ["Mocha", "covariance_update", "dual_scaling"]

_MOD = 2**31


def _hash31(x: Tensor) -> Tensor:
    """A 31-bit integer mixing function (LCG steps and xor-shifts; exact in int64, vmap-safe)."""
    for _ in range(3):
        x = (x * 1103515245 + 12345) % _MOD
        x = x ^ (x // 65536)
    return x


class _SdcaPlan(NamedTuple):
    """One client's SDCA steps: one-hot coordinates ``[H, B]``, their features, labels, curvature and activity."""

    pick: Tensor
    xs: Tensor
    ys: Tensor
    qs: Tensor
    active: Tensor


def _uniform_key(seed: int, round_idx: Tensor, client: Tensor, salt: int, j: Tensor) -> Tensor:
    """Pseudo-random 31-bit keys, a pure function of (seed, round, client, salt, j)."""
    base = _hash31(torch.full_like(round_idx, seed % _MOD, dtype=torch.long))
    base = _hash31((base + round_idx.to(torch.long)) % _MOD)
    base = _hash31((base + client.to(torch.long) + 1) % _MOD)
    base = _hash31((base + salt) % _MOD)
    return _hash31((base + j) % _MOD)


def covariance_update(w_flat: Tensor, floor: float = 1e-7) -> Tensor:
    """``Σ = (W Wᵀ)^{1/2} / tr((W Wᵀ)^{1/2})`` for task models stacked as rows ``[K, P]`` (eigenvalues floored)."""
    gram = (w_flat.double() @ w_flat.double().t())
    evals, evecs = torch.linalg.eigh((gram + gram.t()) / 2)
    root = evals.clamp_min(floor).sqrt()
    sigma = (evecs * root) @ evecs.t()
    return sigma / root.sum()


def dual_scaling(sigma: Tensor, lambda1: float, lambda2: float, floor: float = 1e-12) -> tuple[Tensor, Tensor]:
    """``M = (λ₁ Σ⁻¹ + λ₂ I)⁻¹ = U diag(s / (λ₁ + λ₂ s)) Uᵀ`` and ``σ' = max_t Σ_s |M_ts| / M_tt``."""
    s, u = torch.linalg.eigh((sigma.double() + sigma.double().t()) / 2)
    s = s.clamp_min(floor)
    m = (u * (s / (lambda1 + lambda2 * s))) @ u.t()
    sigma_prime = (m.abs().sum(1) / m.diagonal()).max()
    return m, sigma_prime


class Mocha(Algorithm):
    """MOCHA: federated multi-task learning of linear models by distributed dual coordinate ascent.

    Args:
        loss: ``"hinge"`` (SVM, the paper's experiments) or ``"squared"`` (``½ (z − y)²``).
        lambda1: λ₁ >= 0, weight of the task-relationship term ``tr(W Σ⁻¹ Wᵀ)``.
        lambda2: λ₂ >= 0, weight of ``‖W‖²_F`` (λ₁ + λ₂ > 0). Both multiply a *sum* of losses.
        local_iters: H >= 1, SDCA coordinate steps per client and round (the local budget).
        budget_spread: s in [0, 1): client t's budget is ⌈H(1 − s u_t)⌉, u_t drawn per round.
        omega_every: re-estimate Σ every this many rounds (0 = keep Σ fixed, initially I/K).
        sigma_warm_start: what a Σ step keeps. ``"primal"`` (the authors' code): the task models W stay as
            they are and later rounds add ``½ M ΔV`` to them (W = ½ M V + B, the offset B absorbing the
            change of M). ``"dual"`` (the paper's Algorithm 1 read literally): the duals α stay and W jumps
            to ``½ M_new V``. Both are the same while Σ is fixed.
        sigma_prime: σ' of the local subproblems (None = max_t Σ_s |M_ts| / M_tt, always safe).
        fit_bias: learn the model's bias as the weight of a constant feature (if the model has one).
        seed: seed of the SDCA coordinate orders and budgets.

    All six common arguments (``local_steps``, ``local_lr``, ``batch_size``, ``finetune_*``) are
    refused, each with its reason (``unused_args``): MOCHA takes no SGD steps.
    """

    name = "mocha"

    @classmethod
    def example_model(cls, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        """MOCHA learns linear task models: logistic regression on the flattened inputs."""
        from lightning_fedmeta.models.reference import LogisticRegression

        return LogisticRegression(math.prod(input_shape), num_classes)

    summary = "MOCHA: federated multi-task linear models by dual coordinate ascent (Smith et al., 2017)"
    server_optimizer_applies = False
    unused_args = {
        "local_steps": "MOCHA's local work is local_iters SDCA coordinate steps on the client's dual",
        "local_lr": "MOCHA's dual coordinate ascent takes exact coordinate steps, with no learning rate",
        "batch_size": "every MOCHA client solves its dual over its whole training set each round",
        "finetune_steps": "MOCHA evaluates a client with its own task model w_t (the mean of the training "
        "clients' models for a new client) and takes no SGD steps",
        "finetune_lr": "MOCHA takes no fine-tuning steps (see finetune_steps)",
        "finetune_batch_size": "MOCHA takes no fine-tuning steps (see finetune_steps)",
        "local_epochs": "MOCHA's local work is local_iters SDCA coordinate steps, not SGD epochs",
        "finetune_epochs": "MOCHA takes no fine-tuning steps (see finetune_steps)",
        "drop_last": "MOCHA reads the whole training set each round (no mini-batches to drop)",
    }

    def __init__(
        self,
        loss: Literal["hinge", "squared"] = "hinge",
        lambda1: float = 1.0,
        lambda2: float = 0.1,
        local_iters: int = 100,
        budget_spread: float = 0.0,
        omega_every: int = 10,
        sigma_warm_start: Literal["primal", "dual"] = "primal",
        sigma_prime: float | None = None,
        fit_bias: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__(local_steps=1, local_lr=0.0, batch_size=None, finetune_steps=0)
        if loss not in ("hinge", "squared"):
            raise ValueError(f"loss must be 'hinge' or 'squared', got {loss!r}")
        check_non_negative("lambda1", lambda1)
        check_non_negative("lambda2", lambda2)
        if not lambda1 + lambda2 > 0:
            raise ValueError(f"lambda1 + lambda2 must be > 0, got {lambda1!r} + {lambda2!r}")
        check_integer("local_iters", local_iters, 1)
        check_range("budget_spread", budget_spread, 0.0, 0.999)
        if isinstance(omega_every, bool) or not isinstance(omega_every, int) or omega_every < 0:
            raise ValueError(f"omega_every must be an integer >= 0 (0 = fixed), got {omega_every!r}")
        if sigma_warm_start not in ("primal", "dual"):
            raise ValueError(f"sigma_warm_start must be 'primal' or 'dual', got {sigma_warm_start!r}")
        if sigma_prime is not None and not 0 < sigma_prime < float("inf"):
            raise ValueError(f"sigma_prime must be > 0 (or None for the safe default), got {sigma_prime!r}")
        self.loss = loss
        self.lambda1 = lambda1
        self.lambda2 = lambda2
        self.local_iters = local_iters
        self.budget_spread = budget_spread
        self.omega_every = omega_every
        self.sigma_warm_start = sigma_warm_start
        self.sigma_prime = sigma_prime
        self.fit_bias = fit_bias
        self.seed = seed

    # -- the linear model ----------------------------------------------------------------------
    @staticmethod
    def _linear_keys(params: Params) -> tuple[str, str | None]:
        weights = [k for k, v in params.items() if v.dim() == 2]
        biases = [k for k, v in params.items() if v.dim() == 1]
        if len(weights) != 1 or len(biases) > 1 or len(params) != len(weights) + len(biases):
            shapes = {k: tuple(v.shape) for k, v in params.items()}
            raise ValueError(
                "MOCHA needs a linear model: one weight [C, d] and at most one bias [C] "
                f"(e.g. lightning_fedmeta.models.reference.LogisticRegression); got parameters {shapes}"
            )
        return weights[0], (biases[0] if biases else None)

    def _uses_bias(self, params: Params) -> bool:
        return self.fit_bias and self._linear_keys(params)[1] is not None

    def _features(self, x: Tensor, params: Params) -> Tensor:
        """``[B, D]``: flattened inputs, with a constant 1 appended when the bias is learned."""
        x = x.reshape(x.shape[0], -1)
        if self._uses_bias(params):
            x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
        return x

    def _to_params(self, w: Tensor, params: Params) -> Params:
        """Task model(s) ``[..., C, D]`` as the module's parameters."""
        wk, bk = self._linear_keys(params)
        d = params[wk].shape[1]
        out = {wk: w[..., :d]}
        if bk is not None:
            out[bk] = w[..., d] if self._uses_bias(params) else torch.zeros_like(params[bk]).expand(w.shape[:-1])
        return out

    def _from_params(self, params: Params) -> Tensor:
        wk, bk = self._linear_keys(params)
        if self._uses_bias(params):
            return torch.cat([params[wk], params[bk].unsqueeze(-1)], dim=-1)  # type: ignore[index]
        return params[wk]

    # -- state ---------------------------------------------------------------------------------
    def round_plan(self) -> BatchPlan:
        return BatchPlan(steps=1, per_step=1, batch_size=None)

    def eval_plan(self) -> BatchPlan:
        return BatchPlan(steps=0, per_step=1, batch_size=None)

    def bind_clients(self, clients: ClientRecord, label_counts: Tensor) -> None:
        """Record the tasks: one per client; the training clients' weights p_t (0 for held-out clients)."""
        self._weights = clients.weight.detach().cpu().to(torch.float64)
        self._training = ~clients.is_new.detach().cpu()

    def init_client_states(self, params: Params, clients: ClientRecord) -> dict[str, Tensor]:
        """The dual variables ``α_t`` of every client's samples, zero, padded to the largest client."""
        wk, _ = self._linear_keys(params)
        width = int(clients.num_samples.max()) if clients.num_samples.numel() else 0
        classes = params[wk].shape[0]
        return {"alpha": torch.zeros((clients.index.numel(), width, classes), dtype=params[wk].dtype)}

    def init_server_state(self, params: Params) -> dict[str, Tensor]:
        if getattr(self, "_weights", None) is None:
            raise RuntimeError("Mocha.init_server_state needs bind_clients(clients, label_counts) first "
                               "(FederatedModule.attach_data calls it)")
        k = int(self._weights.numel())
        wk, _ = self._linear_keys(params)
        dtype = params[wk].dtype
        shape = (k, *self._from_params(params).shape)
        sigma = torch.eye(k, dtype=torch.float64) / k
        return self._with_sigma(
            {
                "V": torch.zeros(shape, dtype=dtype),
                "B": torch.zeros(shape, dtype=dtype),
                "p": self._weights.to(dtype),
                "training": self._training.clone(),
                "round": torch.tensor(0, dtype=torch.long),
                "gap": torch.zeros(k, dtype=dtype),
                "duality_gap": torch.tensor(float("inf"), dtype=dtype),
            },
            sigma,
        )

    def _with_sigma(self, server_state: dict[str, Tensor], sigma: Tensor, new_sigma: bool = False
                    ) -> dict[str, Tensor]:
        """Server state with task covariance Σ, and M, σ', W = ½ M V + B recomputed from it.

        ``new_sigma`` marks a Σ step: with ``sigma_warm_start="primal"`` the offset B is reset so that W keeps
        its value (B = W_old − ½ M_new V); with ``"dual"`` B stays zero and W jumps to ½ M_new V.
        """
        v = server_state["V"]
        m, sp = dual_scaling(sigma, self.lambda1, self.lambda2)
        if self.sigma_prime is not None:
            sp = torch.tensor(float(self.sigma_prime), dtype=torch.float64)
        out = dict(server_state)
        out["Sigma"] = sigma.to(torch.float64)
        out["M"] = m.to(v.dtype)
        out["sigma_prime"] = sp.to(v.dtype)
        dual_w = 0.5 * weighted_sum(m, v)  # ½ Σ_s M_ts V_s
        offset = server_state.get("B")
        if offset is None:  # a server state from before the offset existed: no Σ step kept W yet
            offset = torch.zeros_like(v)
        if new_sigma and self.sigma_warm_start == "primal" and "W" in server_state:
            offset = server_state["W"] - dual_w
        out["B"] = offset
        out["W"] = dual_w + offset
        return out

    def set_task_covariance(self, server_state: dict[str, Tensor], sigma: Tensor) -> dict[str, Tensor]:
        """A new server state with the task covariance fixed to ``sigma`` (symmetric positive definite ``[K, K]``).

        With ``omega_every=0`` MOCHA then solves the primal problem for this fixed ``Ω = Σ⁻¹``.
        """
        k = server_state["V"].shape[0]
        if sigma.shape != (k, k):
            raise ValueError(f"sigma must be [{k}, {k}], got {tuple(sigma.shape)}")
        s = sigma.double()
        if not torch.allclose(s, s.t()) or bool(torch.linalg.eigvalsh(s).min() <= 0):
            raise ValueError("sigma must be symmetric positive definite")
        return self._with_sigma(server_state, s, new_sigma=True)

    # -- client --------------------------------------------------------------------------------
    def _loss_terms(self, z: Tensor, ypm: Tensor, alpha: Tensor) -> tuple[Tensor, Tensor]:
        """Per-sample, per-class ``ℓ(z, y)`` and ``ℓ*(−α)``."""
        if self.loss == "hinge":
            return (1.0 - ypm * z).clamp_min(0.0), -alpha * ypm
        return 0.5 * (z - ypm) ** 2, 0.5 * alpha**2 - alpha * ypm

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        batch = batches.at(0, 0)
        x = self._features(batch.x, params)  # [B, D]
        mask = batch.mask.to(x.dtype)
        alpha = state["alpha"]  # [B, C]
        classes = alpha.shape[1]
        ypm = 2.0 * (batch.y.unsqueeze(1) == torch.arange(classes, device=x.device)).to(x.dtype) - 1.0
        cid = client.index
        w, scale = self._received_task(server_state, cid, x.dtype)
        local_loss, gap = self._local_gap(x, ypm, alpha, mask, w)
        n = mask.sum().clamp_min(1.0)
        plan = self._sdca_plan(x, ypm, mask, n, scale, server_state["round"], cid)
        alpha = self._sdca_steps(alpha, w, scale, plan)
        delta = (alpha - state["alpha"]).t() @ x  # X_tᵀΔα

        return ClientOutput(
            delta={name: torch.zeros_like(p) for name, p in params.items()},
            state={"alpha": alpha},
            extras={"dv": delta, "gap": gap},
            metrics={"loss": local_loss / n / classes, "gap": gap},
        )

    @staticmethod
    def _received_task(server_state: dict[str, Tensor], cid: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Client ``cid``'s received task model ``w_t [C, D]`` and the SDCA scale ``σ' M_tt / 2`` (vmap-safe)."""
        k = server_state["M"].shape[0]
        mine = one_hot(cid, k, dtype)
        w = weighted_sum(mine, server_state["W"])  # [C, D]
        m_tt = (server_state["M"].diagonal() * mine).sum()
        return w, 0.5 * server_state["sigma_prime"] * m_tt

    def _local_gap(self, x: Tensor, ypm: Tensor, alpha: Tensor, mask: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        """The task's summed local loss and its duality-gap contribution ``G_t`` at the received iterate."""
        z = x @ w.t()  # [B, C]
        loss_terms, conj_terms = self._loss_terms(z, ypm, alpha)
        v = alpha.t() @ x  # [C, D]
        local_loss = (loss_terms.sum(1) * mask).sum()
        gap = ((loss_terms + conj_terms).sum(1) * mask).sum() + (w * v).sum()
        return local_loss, gap

    def _sdca_plan(
        self, x: Tensor, ypm: Tensor, mask: Tensor, n: Tensor, scale: Tensor, r: Tensor, cid: Tensor
    ) -> _SdcaPlan:
        """The coordinate of every SDCA step, its features, labels and curvature, gathered at once (vmap-safe)."""
        width = x.shape[0]
        pos = torch.arange(width, device=x.device)
        keys = _uniform_key(self.seed, r, cid, 1, pos)
        order = torch.argsort(keys + (1 - mask.to(torch.long)) * _MOD)  # real samples first
        u = _uniform_key(self.seed, r, cid, 2, torch.zeros((), dtype=torch.long, device=x.device)).to(x.dtype) / _MOD
        budget = torch.ceil(self.local_iters * (1.0 - self.budget_spread * u))
        steps = torch.arange(self.local_iters, device=x.device)
        slots = torch.remainder(steps.to(x.dtype), n)
        coord = ((pos.unsqueeze(0) == slots.unsqueeze(1)).to(torch.long) * order.unsqueeze(0)).sum(1)  # [H]
        pick = (pos.unsqueeze(0) == coord.unsqueeze(1)).to(x.dtype)  # [H, B] one-hot rows
        xs, ys = pick @ x, pick @ ypm
        qs = scale * (xs * xs).sum(1)
        active = ((steps < budget) & ((pick @ mask) > 0)).to(x.dtype)
        return _SdcaPlan(pick, xs, ys, qs, active)

    def _sdca_steps(self, alpha: Tensor, w: Tensor, scale: Tensor, plan: _SdcaPlan) -> Tensor:
        """``alpha`` after the ``local_iters`` SDCA coordinate steps of ``plan`` (inactive steps change nothing)."""
        w_tilde = w  # w_t + (σ' M_tt / 2) X_tᵀΔα
        for step in range(self.local_iters):
            e, xi, yi, q = plan.pick[step], plan.xs[step], plan.ys[step], plan.qs[step]
            ai = e @ alpha
            zi = w_tilde @ xi
            if self.loss == "hinge":
                beta = ai * yi
                da = yi * ((beta + (1.0 - yi * zi) / q.clamp_min(1e-12)).clamp(0.0, 1.0) - beta)
            else:
                da = (yi - zi - ai) / (1.0 + q)
            da = da * plan.active[step]
            alpha = alpha + e.unsqueeze(1) * da.unsqueeze(0)
            w_tilde = w_tilde + (scale * da).unsqueeze(1) * xi.unsqueeze(0)
        return alpha

    # -- server --------------------------------------------------------------------------------
    def aggregate(
        self,
        params: Params,
        outputs: ClientOutput,
        weights: Tensor,
        server_state: dict[str, Tensor],
        clients: ClientRecord,
    ) -> tuple[Params, dict[str, Tensor]]:
        ids = clients.index
        state = dict(server_state)
        state["V"] = server_state["V"].index_add(0, ids, outputs.extras["dv"].to(server_state["V"].dtype))
        state["gap"] = server_state["gap"].index_copy(0, ids, outputs.extras["gap"].to(server_state["gap"].dtype))
        state["duality_gap"] = state["gap"].sum()
        rounds_done = int(server_state["round"]) + 1
        state["round"] = torch.tensor(rounds_done, dtype=torch.long)
        state = self._with_sigma(state, server_state["Sigma"])  # W = ½ M V + B with this round's V
        if self.omega_every > 0 and rounds_done % self.omega_every == 0:
            w_now = state["W"]
            sigma = self._task_covariance(w_now.reshape(w_now.shape[0], -1), server_state["training"])
            state = self._with_sigma(state, sigma, new_sigma=True)
        mean_model = self._to_params(self._mean_task_model(state), params)
        return {name: mean_model[name].to(p.dtype) - p for name, p in params.items()}, state

    # -- communication -------------------------------------------------------------------------
    def download(self, params: Params, server_state: dict[str, Tensor], client: ClientRecord) -> dict[str, Any]:
        """The client's task model w_t = (½ M V + B)_t (C·D floats), its SDCA scale σ' M_tt / 2 and the round
        counter (int64, seeds the coordinate order); the global parameters are not read (only their names)."""
        w, scale = self._received_task(server_state, client.index, server_state["W"].dtype)
        return {"task": w, "scale": scale, "round": server_state["round"]}

    def upload(self, output: ClientOutput) -> dict[str, Any]:
        """Δv_t = X_tᵀΔα (C·D floats) and the local duality gap G_t (1); the zero Δ is not sent."""
        return {"extras": output.extras}

    @staticmethod
    def _task_covariance(w_flat: Tensor, training: Tensor) -> Tensor:
        """Σ estimated from the training clients' task models only, block-diagonal with ``I/K`` for held-out
        clients: their tasks have no data, so they stay decoupled (zero models) and never bias Σ."""
        k = w_flat.shape[0]
        idx = training.nonzero().flatten().to(w_flat.device)
        sigma = torch.eye(k, dtype=torch.float64, device=w_flat.device) / k
        block = covariance_update(w_flat.index_select(0, idx))
        sigma[idx.unsqueeze(1), idx.unsqueeze(0)] = block
        return sigma

    @staticmethod
    def _mean_task_model(server_state: dict[str, Tensor]) -> Tensor:
        """``Σ_t p_t w_t`` over the training clients: the model of a new client and the module's global model."""
        return weighted_sum(server_state["p"], server_state["W"])

    def personalize(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> Params:
        """Client t's own w_t; a new (held-out) client the weighted mean of the training clients' task
        models ``Σ_s p_s w_s`` (MOCHA learns no model for a task without data)."""
        k = server_state["W"].shape[0]
        mine = weighted_sum(one_hot(client.index, k, server_state["W"].dtype), server_state["W"])
        w = torch.where(client.is_new, self._mean_task_model(server_state), mine)
        return self._to_params(w, params)
