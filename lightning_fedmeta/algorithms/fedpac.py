"""FedPAC: feature alignment to global prototypes and per-client classifier combination (``fedpac``).

Xu, Tong, Huang, "Personalized Federated Learning with Feature Alignment and Classifier Collaboration", ICLR 2023,
arXiv:2306.11867 (Algorithm 1, eqs. 8-11). The model splits into a shared body φ (the feature extractor
z = φ(x) ∈ ℝᵈ) and a linear head h (``W z + b``, one output per class, personal). Round t, sampled clients S,
client i with n_i training samples, global body φ, its head h_i, global prototypes C̄ᵏ (``known`` a_k = 1 once
class k has one):

1. Statistics of the features at the received body, over the head phase's batches (n_k samples of class k,
   N = Σ_k n_k, S_k = Σ_{y_j=k} z_j, Q_k = Σ_{y_j=k} ‖z_j‖²):

       H_i = [S_k / N]_k  (= p_k μ_k, [C, d]),     V_i = (Σ_k Q_k / N − Σ_k ‖S_k / N‖²) / n_i.

2. Head phase, body fixed: ``head_steps`` steps h_i ← h_i − η_h ∇_h CE(h_i(φ(x)), y).
3. Body phase, head fixed: ``local_steps`` steps φ_i ← φ_i − η ∇_φ [ CE + λ (1/(B d)) Σ_j a'_{y_j} ‖z_j − c_{y_j}‖² ]
   with c_k = C̄ᵏ where a_k = 1, else the client's own class mean μ_k = S_k / n_k of step 1; a'_k = 1 when
   some global prototype exists and (a_k = 1 or n_k > 0), else 0 (the authors' round-0 rule and fallback).
4. Local prototypes C_iᵏ: the mean of z_j of class k at the trained body over the head phase's batches.

Server: φ ← φ + Σ_i p_i (φ_i − φ) (as FedRep, also the global head h ← h + Σ_i p_i (h_i − h), the start of a
client that has not trained); C̄ᵏ ← Σ_i n_ik C_iᵏ / Σ_i n_ik over the clients holding k (the previous C̄ᵏ if
none); and for each sampled client i the combination weights of the classifier heads,

    α_i = argmin_{α ∈ Δ} Σ_{j∈S} α_j² V_j + ‖Σ_{j∈S} α_j H_j − H_i‖²_F
        = argmin_{α ∈ Δ} αᵀ A α − 2 g_iᵀ α,    A = diag(V) + G,  G_jl = ⟨H_j, H_l⟩,  g_i = G[i],

weights below ``min_weight`` set to 0 and the rest renormalised, and client i's new head h_i ← Σ_j α_ij h_j
(kept by the server, sent at the client's next round). The quadratic programme is solved by
:func:`simplex_qp` (accelerated projected gradient, exact Euclidean projection onto the simplex; the objective
after k iterations is within 4 λ_max(A)/(k + 1)² of its minimum, Beck & Teboulle 2009, Thm. 4.4; the returned
Frank-Wolfe gap ∇fᵀα − min_j ∇f_j bounds the error of each solution from above).

Where we differ from the authors' code (github:JianXu95/FedPAC ``methods/fedpac.py``, ``tools.py``; PFLlib's
clientpac/serverpac copy it):
* QP solver: the authors use cvxpy on Q_i = diag(V) + D_i (D_i the Gram matrix of the H_i − H_j); after they replace
  Q_i by its eigen-decomposition with eigenvalues below 0.01 dropped when Q_i has a negative eigenvalue (rounding)
  and fall back to the client's own head when it still has one. On the simplex αᵀQ_iα = αᵀAα − 2g_iᵀα + G_ii, so we
  solve the same problem with A = diag(V) + G, positive semi-definite by construction (float64), without the
  eigenvalue clipping or the fallback.
* Statistics and prototypes are computed over the round's head-phase batches (step 1 at the received body, step 4
  at the trained body); the authors pass over the whole training set before and after training. With
  ``local_epochs`` and the authors' one head epoch (``head_epochs=1``) these batches are the training set once, and
  the two agree; with ``head_steps`` they are a sample of ``head_steps`` mini-batches.
* Global prototypes: the authors rebuild them from the round's clients only (a class nobody uploaded is dropped and
  its samples are pulled towards their own local mean); we keep the previous C̄ᵏ, as this library's FedProto.
  Their server weights a client's prototype by its class size n_ik (PFLlib: equally); we weight by the class-k
  samples it trained on in the head phase (n_ik per head epoch under ``local_epochs``).
* Optimiser: the authors use SGD with momentum 0.5 and weight decay 5e-4, the head at a fixed rate 0.1 and the
  body at ``lr``; we use plain SGD, the head at ``head_lr`` (default ``local_lr``), the body at ``local_lr``.
* The authors combine the heads in every round but their last (an extra round of every client, without
  combination) while ``agg_g`` is set; we combine in every round while ``collaborate`` is set. ``collaborate=False``
  is their ``agg_g = 0`` (each client keeps its own trained head: FedRep plus alignment).
* Weights below ``min_weight`` (the authors' 1e-3) are dropped and the rest renormalised, as the authors
  (PFLlib does not renormalise); the largest weight is always kept. (FL-bench's ``fedpac.py`` server, in the version
  we read, computes the weights but never applies them: its heads are FedAvg's.)

New clients. A held-out client has no head of its own: it starts from the global body and the global head (the
mean of the clients' heads, as FedRep) and takes ``finetune_steps`` head-only steps (the head phase, body fixed,
rate ``finetune_lr``) on its training data; a training client fine-tunes its own combined head the same way. With
``finetune_steps=0`` a client is evaluated with (global body, its combined head), as the authors.

Common arguments. ``local_steps`` are the body phase's steps, after ``head_steps`` head steps (a round draws
``head_steps + local_steps`` batches of ``batch_size``); under ``local_epochs`` the round is two phases of epochs
``(head_epochs, local_epochs)`` (:func:`~lightning_fedmeta.client.sampling.phase_lengths`). ``local_lr`` is the body's
rate (and the head's unless ``head_lr``); ``finetune_steps``/``finetune_epochs``/``finetune_lr``/
``finetune_batch_size`` drive the evaluation-time head steps. All are used.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.func import grad_and_value

from lightning_fedmeta.algorithms.base import (
    Algorithm,
    BatchPlan,
    ClientOutput,
    ClientRecord,
    check_integer,
    check_non_negative,
    check_range,
    phase_epochs,
    started_from,
)
from lightning_fedmeta.algorithms.feature_common import (
    KNOWN,
    PROTOTYPES,
    LinearHead,
    class_sums,
    empty_prototypes,
    features_and_logits,
    linear_head,
)
from lightning_fedmeta.algorithms.heads import check_head_prefix, head_names
from lightning_fedmeta.algorithms.local_steps import mean_over_taken_steps
from lightning_fedmeta.algorithms.rows import take_rows
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_weighted_sum
from lightning_fedmeta.client.sampling import phase_lengths

__all__ = ["FedPAC", "combination_weights", "feature_statistics", "project_to_simplex", "simplex_qp"]

HEADS = "heads"


def project_to_simplex(v: Tensor, allowed: Tensor | None = None) -> Tensor:
    """The Euclidean projection of each row of ``v`` ``[R, K]`` onto ``{α ≥ 0, Σ_j α_j = 1}``, with ``α_j = 0``
    where ``allowed`` ``[K]`` is false (Held, Wolfe, Crowder 1974; Duchi et al. 2008): with u the row sorted
    descending, ρ = max{j : u_j − (Σ_{l≤j} u_l − 1)/j > 0}, θ = (Σ_{l≤ρ} u_l − 1)/ρ, α = max(v − θ, 0).

    A coordinate outside ``allowed`` is set to ``max(v_allowed) − 2`` first: θ ≥ max(v_allowed) − 1, so it projects
    to 0 and leaves θ as the projection over the allowed coordinates alone."""
    if allowed is not None:
        top = torch.where(allowed, v, torch.full_like(v, -torch.inf)).amax(-1, keepdim=True)
        v = torch.where(allowed, v, top - 2.0)
    u = v.sort(-1, descending=True).values
    css = u.cumsum(-1) - 1.0
    j = torch.arange(1, v.shape[-1] + 1, dtype=v.dtype, device=v.device)
    rho = (u - css / j > 0).sum(-1, keepdim=True).clamp_min(1)
    theta = css.gather(-1, rho - 1) / rho.to(v.dtype)
    return (v - theta).clamp_min(0.0)


def simplex_qp(a: Tensor, b: Tensor, iters: int, allowed: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``α_i = argmin_{α ∈ Δ} αᵀAα − 2 b_iᵀα`` for every row ``b_i`` of ``b`` ``[R, K]`` (``A`` ``[K, K]``
    symmetric positive semi-definite), by ``iters`` steps of accelerated projected gradient (FISTA, step 1/L,
    L = 2 λ_max(A)) from the uniform weights over ``allowed``, in float64.

    Returns ``(α [R, K], gap [R])``: ``gap_i = ∇f_i(α_i)ᵀα_i − min_j ∇f_i(α_i)_j ≥ f_i(α_i) − min f_i`` (the
    Frank-Wolfe gap, a certificate); the FISTA bound is f_i(α_k) − min f_i ≤ 2L‖α_0 − α*‖²/(k + 1)²
    < 4 λ_max/(k + 1)²."""
    a, b = a.double(), b.double()
    k = a.shape[-1]
    ok = torch.ones(k, dtype=torch.bool, device=a.device) if allowed is None else allowed
    lipschitz = 2.0 * torch.linalg.eigvalsh(a).amax().clamp_min(1e-30)
    alpha = (ok.double() / ok.sum()).expand(b.shape[0], k).clone()
    y, t = alpha, 1.0
    for _ in range(iters):
        step = project_to_simplex(y - 2.0 * (y @ a - b) / lipschitz, ok)
        t_next = (1.0 + (1.0 + 4.0 * t * t) ** 0.5) / 2.0
        y = step + ((t - 1.0) / t_next) * (step - alpha)
        alpha, t = step, t_next
    grad = 2.0 * (alpha @ a - b)
    gap = (grad * alpha).sum(-1) - torch.where(ok, grad, torch.full_like(grad, torch.inf)).amin(-1)
    return alpha, gap


def combination_weights(
    variance: Tensor, moments: Tensor, allowed: Tensor, iters: int, min_weight: float
) -> Tensor:
    """FedPAC's classifier weights ``α`` ``[R, R]`` (row i: client i's combination of the R heads) from the clients'
    ``V_j`` ``[R]`` and ``H_j`` ``[R, C, d]``: :func:`simplex_qp` with ``A = diag(V) + G``, ``b = G``
    (``G_jl = ⟨H_j, H_l⟩``), over the ``allowed`` clients; weights ``≤ min_weight`` (but the largest) set to 0 and
    the row renormalised."""
    h = moments.reshape(moments.shape[0], -1).double()
    gram = h @ h.T
    alpha, _ = simplex_qp(torch.diag(variance.double()) + gram, gram, iters, allowed)
    keep = (alpha > min_weight) | (alpha == alpha.amax(-1, keepdim=True))
    alpha = alpha * keep
    return alpha / alpha.sum(-1, keepdim=True)


def feature_statistics(sums: Tensor, squares: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """``(V, H)`` from the per-class feature sums ``S`` ``[C, d]``, squared norms ``Q`` ``[C]`` and counts ``n``
    ``[C]``: ``H_k = S_k / N`` (p_k μ_k) and ``V = Σ_k Q_k / N − Σ_k ‖S_k / N‖²``
    (= Σ_k p_k E[‖z‖² | k] − Σ_k p_k² ‖μ_k‖², the authors' ``statistics_extraction``), N = Σ_k n_k."""
    total = counts.sum().clamp_min(1.0)
    moments = sums / total
    return squares.sum() / total - (moments**2).sum(), moments


class FedPAC(Algorithm):
    """FedPAC: shared body aligned to global class prototypes; personal heads combined by per-client QP weights.

    Args:
        lam: λ ≥ 0, weight of the feature-alignment term (the authors' default 1).
        head_steps: head-only steps before the body phase per round, ≥ 1.
        head_epochs: the head phase in epochs under ``local_epochs`` (``None``: 1, the authors' one head epoch).
        head_lr: the head phase's rate (``None``: ``local_lr``; the authors use 0.1 with a body rate of 0.01).
        collaborate: combine the heads by the QP weights (the authors' ``agg_g``); ``False`` keeps each client's
            own trained head.
        min_weight: combination weights at or below it are dropped (the authors' 1e-3), in [0, 1).
        qp_iters: accelerated projected-gradient iterations of the QP, ≥ 1.
        head_prefix: the last linear layer, whose input is the feature z (``None``: the model's last layer).
        local_steps, local_lr, batch_size, finetune_*: see the module docstring.

    Client state: none. Server state: ``prototypes`` ``[C, d]``, ``known`` ``[C]`` and ``heads`` (every client's
    combined head, ``{name: [K, ...]}``, read once the client has trained).
    """

    name = "fedpac"
    summary = "FedPAC: body aligned to global prototypes; heads combined per client by a QP (Xu, Tong, Huang 2023)"
    step_budget = True

    def __init__(
        self,
        lam: float = 1.0,
        head_steps: int = 2,
        head_epochs: int | None = None,
        head_lr: float | None = None,
        collaborate: bool = True,
        min_weight: float = 1e-3,
        qp_iters: int = 500,
        head_prefix: str | list[str] | None = None,
    ) -> None:
        super().__init__()
        check_non_negative("lam", lam)
        check_integer("head_steps", head_steps, 1)
        if head_lr is not None:
            check_non_negative("head_lr", head_lr)
        if not isinstance(collaborate, bool):
            raise ValueError(f"collaborate must be true or false, got {collaborate!r}")
        check_range("min_weight", min_weight, 0.0, 1.0)
        if min_weight == 1.0:
            raise ValueError("min_weight must be < 1 (1 would drop every weight but the largest); got 1.0")
        check_integer("qp_iters", qp_iters, 1)
        check_head_prefix(head_prefix)
        self.lam, self.head_steps, self.head_lr, self.collaborate = lam, head_steps, head_lr, collaborate
        self.min_weight, self.qp_iters, self.head_prefix = min_weight, qp_iters, head_prefix
        if head_epochs is None:
            self.head_epochs = None if self.local_epochs is None else 1
        else:
            self.head_epochs = phase_epochs("head_epochs", head_epochs, self.local_epochs, "head_steps")
        self._num_classes: int | None = None
        self._num_clients: int | None = None

    @property
    def head_rate(self) -> float:
        """η_h: ``head_lr``, or ``local_lr`` when it is not given."""
        return self.local_lr if self.head_lr is None else self.head_lr

    def round_plan(self) -> BatchPlan:
        """``head_steps + local_steps`` batches, head first; under ``local_epochs`` the two phases' epochs
        ``(head_epochs, local_epochs)``."""
        if self.local_epochs is not None:
            return BatchPlan(steps=0, per_step=1, batch_size=self.batch_size,
                             epochs=(self.head_epochs, self.local_epochs), drop_last=self.drop_last)
        return BatchPlan(steps=self.head_steps + self.local_steps, per_step=1, batch_size=self.batch_size)

    # -- model split and state ----------------------------------------------------------------
    def head(self, params: Params) -> LinearHead:
        """The last linear layer (its input is the feature z)."""
        return linear_head(params, self.head_prefix, self.name)

    def split(self, params: Params) -> tuple[Params, Params]:
        """``(body, head)`` of a parameter dict."""
        head = set(head_names(list(params), self.head_prefix))
        return {k: v for k, v in params.items() if k not in head}, {k: v for k, v in params.items() if k in head}

    def bind_clients(self, clients: ClientRecord, label_counts: Tensor) -> None:
        """Record the number of classes C and of clients K."""
        self._num_classes = int(label_counts.shape[-1])
        self._num_clients = int(label_counts.shape[0])

    def init_server_state(self, params: Params) -> dict[str, Tensor]:
        """No prototype yet (``prototypes`` ``[C, d]`` and ``known`` ``[C]`` zeros); every client's head row a copy
        of the initial head (not read before the client has trained)."""
        if self._num_clients is None:
            raise RuntimeError("fedpac.init_server_state needs the number of clients: call "
                               "bind_clients(clients, label_counts) first (FederatedModule.attach_data does)")
        _, head = self.split(params)
        k = self._num_clients
        return {**empty_prototypes(params, self.head(params), self._num_classes, self.name),
                HEADS: {n: v.detach().unsqueeze(0).repeat(k, *([1] * v.dim())).clone() for n, v in head.items()}}

    def client_head(self, params: Params, server_state: dict[str, Any], client: ClientRecord) -> Params:
        """The client's combined head (its row of ``heads``), or the global head while it has not trained."""
        _, head = self.split(params)
        return started_from(client, take_rows(server_state[HEADS], client.index), head)

    def personal_start(
        self, params: Params, state: dict[str, Tensor], server_state: dict[str, Any], client: ClientRecord
    ) -> Params:
        """The global body with the client's combined head (the global head while it has not trained)."""
        return {**params, **self.client_head(params, server_state, client)}

    # -- client -------------------------------------------------------------------------------
    def head_phase(
        self, ctx: ClientContext, body: Params, head: Params, batches: Batch, lr: float, steps: int
    ) -> tuple[Params, tuple[Tensor, Tensor, Tensor], list[Tensor]]:
        """``steps`` SGD steps of CE on the head (body fixed) over ``batches[0:steps]``; also the class sums S
        ``[C, d]``, squared norms Q ``[C]`` and counts n ``[C]`` of the features z = φ(x) (the body does not move,
        so they are the features at the received body)."""
        layer = self.head({**body, **head})
        weight = head[layer.weight]
        sums = torch.zeros_like(weight)
        squares = counts = torch.zeros_like(weight[:, 0])
        losses = []
        for t in range(steps):
            batch = batches.at(t, 0)

            def loss(h: Params, b: Batch = batch) -> tuple[Tensor, Tensor]:
                z, logits = features_and_logits(ctx, {**body, **h}, b.x, layer)
                per_sample = ctx.per_sample_loss(logits, b.y)
                mask = b.mask.to(per_sample.dtype)
                return (per_sample * mask).sum() / mask.sum().clamp_min(1.0), z.detach()

            g, (value, z) = grad_and_value(loss, has_aux=True)(head)
            head = {k: head[k] - lr * g[k] for k in head}
            s, n = class_sums(z, batch.y, batch.mask, weight.shape[0])
            q, _ = class_sums((z**2).sum(-1, keepdim=True), batch.y, batch.mask, weight.shape[0])
            sums, squares = sums + s.to(sums.dtype), squares + q[:, 0].to(sums.dtype)
            counts = counts + n.to(sums.dtype)
            losses.append(value)
        return head, (sums, squares, counts), losses

    def alignment_loss(
        self, ctx: ClientContext, w: Params, batch: Batch, targets: Tensor, active: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``(CE + λ (1/(B d)) Σ_j a'_{y_j} ‖z_j − c_{y_j}‖², sg(z))`` on one masked batch (``MSELoss`` against the
        class targets ``c`` ``[C, d]``, as the authors; a sample of an inactive class adds 0 but counts in B)."""
        z, logits = features_and_logits(ctx, w, batch.x, self.head(w))
        per_sample = ctx.per_sample_loss(logits, batch.y)
        mask = batch.mask.to(per_sample.dtype)
        count = mask.sum().clamp_min(1.0)
        sq = ((z - targets[batch.y].to(z.dtype)) ** 2).sum(-1).to(per_sample.dtype)
        reg = (sq * active[batch.y].to(per_sample.dtype) * mask).sum() / (count * z.shape[-1])
        return (per_sample * mask).sum() / count + self.lam * reg, z.detach()

    def alignment_targets(
        self, server_state: dict[str, Any], sums: Tensor, counts: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``(c [C, d], a' [C])``: the global prototype of a known class, else the client's own mean at the received
        body; active once any global prototype exists, for known classes and the classes the client holds."""
        known = server_state[KNOWN]
        own = sums / counts.clamp_min(1.0).unsqueeze(-1)
        targets = torch.where((known > 0).unsqueeze(-1), server_state[PROTOTYPES].to(own.dtype), own)
        active = (known > 0) | (counts > 0)
        return targets, active.to(known.dtype) * known.amax()

    def body_phase(
        self, ctx: ClientContext, body: Params, head: Params, batches: Batch, targets: Tensor, active: Tensor,
        first: int, steps: int,
    ) -> tuple[Params, list[Tensor]]:
        """``steps`` SGD steps (rate ``local_lr``) of :meth:`alignment_loss` on the body (head fixed) over
        ``batches[first:first + steps]``."""
        losses = []
        for t in range(first, first + steps):
            g, (value, _) = grad_and_value(
                lambda p, b: self.alignment_loss(ctx, {**p, **head}, b, targets, active), has_aux=True
            )(body, batches.at(t, 0))
            body = {k: body[k] - self.local_lr * g[k] for k in body}
            losses.append(value)
        return body, losses

    def prototypes(self, ctx: ClientContext, w: Params, batches: Batch, steps: int) -> tuple[Tensor, Tensor]:
        """``(C_i [C, d], n [C])``: the class means of z at ``w`` over ``batches[0:steps]`` (the head phase's)."""
        layer = self.head(w)
        sums = torch.zeros_like(w[layer.weight])
        counts = torch.zeros_like(sums[:, 0])
        for t in range(steps):
            batch = batches.at(t, 0)
            z, _ = features_and_logits(ctx, w, batch.x, layer)
            s, n = class_sums(z.detach(), batch.y, batch.mask, sums.shape[0])
            sums, counts = sums + s.to(sums.dtype), counts + n.to(sums.dtype)
        return sums / counts.clamp_min(1.0).unsqueeze(-1), counts

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Any],
        client: ClientRecord,
    ) -> ClientOutput:
        """Head phase (statistics at the received body), body phase with the alignment term, prototypes at the
        trained body; uploads (φ_i − φ, h_i − h), V_i, H_i and the prototypes with their class counts."""
        body, global_head = self.split(params)
        first, then = (phase_lengths(batches.x.shape[0], self.round_plan()) if self.local_epochs is not None
                       else (self.head_steps, self.local_steps))
        head = self.client_head(params, server_state, client)
        head, (sums, squares, counts), head_losses = self.head_phase(ctx, body, head, batches, self.head_rate, first)
        targets, active = self.alignment_targets(server_state, sums, counts)
        body, body_losses = self.body_phase(ctx, body, head, batches, targets, active, first, then)
        protos, proto_counts = self.prototypes(ctx, {**body, **head}, batches, first)
        variance, moments = feature_statistics(sums, squares, counts)
        dtype = server_state[KNOWN].dtype
        delta = {k: body[k] - params[k] if k in body else head[k] - params[k] for k in params}
        return ClientOutput(
            delta=delta,
            state={},
            extras={"variance": (variance / client.num_samples.clamp_min(1)).to(dtype), "moments": moments.to(dtype),
                    PROTOTYPES: protos.to(dtype), "counts": proto_counts.to(dtype)},
            metrics={"loss": mean_over_taken_steps(head_losses + body_losses, batches)},
        )

    # -- exchange (docs/communication.md) ------------------------------------------------------
    def download(self, params: Params, server_state: dict[str, Any], client: ClientRecord) -> dict[str, Any]:
        """The global model (body, and the global head for a client that has not trained), the prototypes ``[C, d]``
        with their ``known`` flags ``[C]``, and the client's combined head: d + C·d + C + (C·d + C) floats."""
        row = take_rows(server_state[HEADS], client.index)
        return {"params": dict(params), PROTOTYPES: server_state[PROTOTYPES], KNOWN: server_state[KNOWN],
                "head": row}

    # -- server -------------------------------------------------------------------------------
    def aggregate(
        self,
        params: Params,
        outputs: ClientOutput,
        weights: Tensor,
        server_state: dict[str, Any],
        clients: ClientRecord,
    ) -> tuple[Params, dict[str, Any]]:
        """``Δ = Σ_i p_i Δ_i`` (body and global head, as FedRep); the class-count-weighted prototypes; each sampled
        client's combined head ``Σ_j α_ij h_j`` (its own trained head without ``collaborate``) into its row."""
        delta = tree_weighted_sum(outputs.delta, weights)
        new_state = dict(server_state)
        old, known = server_state[PROTOTYPES], server_state[KNOWN]
        counts = outputs.extras["counts"].to(old.dtype)
        held = counts.sum(0)
        mean = (counts.unsqueeze(-1) * outputs.extras[PROTOTYPES].to(old.dtype)).sum(0) / held.clamp_min(1e-12)[:, None]
        new_state[PROTOTYPES] = torch.where((held > 0).unsqueeze(-1), mean, old)
        new_state[KNOWN] = torch.maximum(known, (held > 0).to(known.dtype))
        stored = server_state[HEADS]
        trained = {n: params[n].unsqueeze(0) + outputs.delta[n].to(params[n].dtype) for n in stored}
        if self.collaborate:
            taking_part = weights > 0
            allowed = taking_part | ~taking_part.any()  # every client if none has a weight
            alpha = combination_weights(outputs.extras["variance"], outputs.extras["moments"], allowed,
                                        self.qp_iters, self.min_weight)
            trained = {n: torch.tensordot(alpha.to(t.dtype), t, dims=1) for n, t in trained.items()}
        idx = clients.index.to(torch.long)
        new_state[HEADS] = {n: stored[n].index_copy(0, idx, trained[n].to(stored[n].dtype)) for n in stored}
        return delta, new_state

    # -- evaluation ---------------------------------------------------------------------------
    def personalize(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Any],
        client: ClientRecord,
    ) -> Params:
        """The global body with the client's combined head (the global head for a new client), then one head-only
        SGD step (rate ``finetune_lr``) per evaluation batch."""
        body, _ = self.split(params)
        head = self.client_head(params, server_state, client)
        head, _, _ = self.head_phase(ctx, body, head, batches, self.finetune_lr, batches.x.shape[0])
        return {**params, **head}
