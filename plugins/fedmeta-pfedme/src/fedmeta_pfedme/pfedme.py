"""pFedMe (Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020, Algorithm 1).

Each client i keeps a personalised model θ_i tied to the global model w by the Moreau envelope

    F_i(w) = min_θ { f_i(θ) + (λ/2) ‖θ − w‖² },        θ̂_i(w) = argmin_θ { f_i(θ) + (λ/2) ‖θ − w‖² },

and the federation solves min_w Σ_i p_i F_i(w). One round, client i, from w_{i,0} = w:

    for r = 0 … R−1 (local rounds, one mini-batch D_{i,r} each):
        θ ← θ − ν (∇f_i(θ; D_{i,r}) + λ (θ − w_{i,r}))        K times (the inner prox solve, personal lr ν)
        w_{i,r+1} = w_{i,r} − η λ (w_{i,r} − θ)                 (a gradient step on F_i: ∇F_i(w) = λ (w − θ̂_i(w)))

and the server mixes  w ← (1 − β) w + β Σ_{i∈S} p_i w_{i,R}.

Mapping onto lightning_fedmeta: the client uploads Δ_i = w_{i,R} − w, the default aggregate is
Σ p_i Δ_i (weights sum to 1) and the server optimizer SGD(lr = β) takes w ← w + β Σ p_i Δ_i, which
is exactly (1 − β) w + β Σ p_i w_{i,R}: set the module's ``server_lr`` to the paper's β (β = 1 is
plain averaging of the local models; the paper also uses β = 2).

θ starts each round at w and is warm-started from one local round to the next, as in the
authors' code (CharlieDinh/pFedMe, ``pFedMeOptimizer``); the K inner steps of a local round reuse
its one mini-batch.

Evaluation. A client is scored with the personal model θ_i it reached in local training: the θ
after the K inner steps of the last local round of the last communication round it was sampled
in, kept in its client state (``state["theta"]``, a parameter dict) and not recomputed from the current global w.
This is the model the authors' evaluation is written to score (``evaluate_personalized_model`` →
``persionalized_model_bar``, the θ of the K inner steps, in ``userpFedMe.py`` and
``serverpFedMe.py``; the README's "Evaluation" section has the details). A client that has never
trained (``client.seen`` False: not sampled yet, held out, or outside the federation) has no
personal model: it is scored as a new client, with θ̂_i(w) for the current global w, K inner prox
steps from θ = w on its training data (full batch by default, ``eval_batch_size``), the
personalisation pFedMe defines for any client.

Defaults are the paper's MNIST (strongly convex) setting: λ = 15, ν = 0.1, K = 5, R = 20,
η = 0.005, batch size 20 (β = 1 is the module's default ``server_lr = 1.0``). For its Synthetic
data the paper uses λ = 20, ν = 0.01.
"""

from __future__ import annotations

import torch
from lightning_fedmeta import (
    Algorithm,
    Batch,
    BatchPlan,
    ClientContext,
    ClientOutput,
    ClientRecord,
    Params,
    has_samples,
)
from torch import Tensor

__all__ = ["PFedMe"]

THETA = "theta"  # client-state key of the personal model θ_i: ``{"theta": {parameter name: tensor}}``


def _mean_over_taken_rounds(losses: list[Tensor], batches: Batch) -> Tensor:
    """The mean loss over the local rounds whose batch holds a sample (``Σ_r s_r ℓ_r / max(1, Σ_r s_r)``); the plain
    mean when every round has one (no padding), computed as before."""
    stacked = torch.stack(losses)
    taken = (batches.mask.reshape(stacked.shape[0], -1).sum(1) > 0).to(stacked.dtype)
    over_taken = (stacked * taken).sum() / taken.sum().clamp_min(1.0)
    return torch.where(taken.all(), stacked.mean(), over_taken)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class PFedMe(Algorithm):
    """pFedMe: personalised models θ_i = prox_{f_i/λ}(w), global model by gradient steps on the Moreau envelope.

    Args:
        lam: λ > 0, strength of the tie ‖θ_i − w‖² between personal and global models (paper: 15 MNIST, 20 Synthetic).
        personal_lr: ν > 0, step of the K inner prox iterations; ν·λ < 2 keeps them stable (paper: 0.1 MNIST).
        inner_steps: K ≥ 1, inner prox iterations per local round (paper: 5).
        local_steps: R ≥ 1, local rounds per communication round, one mini-batch each (paper: 20).
        local_lr: η ≥ 0, step of the local model on the Moreau envelope; η·λ < 2 (paper: 0.005).
        batch_size: mini-batch size of a local round (``None`` = full batch; paper: 20).
        eval_batch_size: batch of the new-client prox solve at evaluation (``None`` = the client's whole
            training set); used only for clients that have never trained.

    The common arguments ``finetune_steps``, ``finetune_lr`` and ``finetune_batch_size`` are refused
    (``unused_args``): pFedMe's evaluation is the personal model or its prox solve, not fine-tuning.

    Client state: ``{"theta": {name: tensor}}``, the personal model θ_i of the client's last local training (one model
    per client). A trained client is evaluated with it; a never-trained one with θ̂_i(w).
    """

    step_budget = True
    name = "pfedme"
    summary = "pFedMe: personal θ_i = prox of f_i at w (K inner steps), w on the Moreau envelope (Dinh et al., 2020)"
    # Common arguments pFedMe does not use, with the reason (refused with it; left out of repr/hparams).
    unused_args = {
        "finetune_steps": "pFedMe evaluates a client with its personal model θ_i, or, never trained, with its prox "
        "solve θ̂_i(w) (inner_steps steps at personal_lr): it takes no fine-tuning SGD steps",
        "finetune_lr": "pFedMe takes no fine-tuning steps; its prox solve runs at personal_lr",
        "finetune_batch_size": "the batch of pFedMe's evaluation-time prox solve is eval_batch_size",
    }

    def __init__(
        self,
        lam: float = 15.0,
        personal_lr: float = 0.1,
        inner_steps: int = 5,
        local_steps: int = 20,
        local_lr: float = 0.005,
        batch_size: int | None = 20,
        eval_batch_size: int | None = None,
    ) -> None:
        _require(
            eval_batch_size is None or eval_batch_size > 0,
            f"eval_batch_size must be > 0 (or None for the whole training set), got {eval_batch_size!r}",
        )
        super().__init__(local_steps, local_lr, batch_size)
        _require(lam > 0, f"lam (λ) must be > 0, got {lam!r}")
        _require(personal_lr > 0, f"personal_lr (ν) must be > 0, got {personal_lr!r}")
        _require(
            isinstance(inner_steps, int) and not isinstance(inner_steps, bool) and inner_steps >= 1,
            f"inner_steps (K) must be an integer >= 1, got {inner_steps!r}",
        )
        _require(
            personal_lr * lam < 2,
            f"personal_lr·lam must be < 2 or the inner prox iterations diverge, got {personal_lr!r}·{lam!r} "
            f"= {personal_lr * lam!r}; lower personal_lr below {2 / lam!r}",
        )
        _require(
            local_lr * lam < 2,
            f"local_lr·lam must be < 2 (the Moreau envelope is λ-smooth), got {local_lr!r}·{lam!r} "
            f"= {local_lr * lam!r}; lower local_lr below {2 / lam!r}",
        )
        self.lam = lam
        self.personal_lr = personal_lr
        self.inner_steps = inner_steps
        self.eval_batch_size = eval_batch_size

    # ------------------------------------------------------------------------------------------
    def init_client_state(self, params: Params) -> dict[str, Tensor]:
        """The personal model θ_i (``{"theta": {name: tensor}}``), initially a copy of the parameters; read only
        once the client has trained."""
        return {THETA: {k: v.detach().clone() for k, v in params.items()}}

    def prox_point(self, ctx: ClientContext, w: Params, batch: Batch, theta: Params) -> tuple[Params, Tensor]:
        """K inner steps ``θ ← θ − ν (∇f(θ; D) + λ (θ − w))`` towards ``argmin_θ f(θ; D) + λ/2 ‖θ − w‖²``.

        Returns the final θ and ``f(θ; D)`` at the first inner step (the loss of the incoming θ). On an empty
        batch (a padded step under ``local_epochs``/``finetune_epochs``) θ is returned unchanged: the pull
        ``λ (θ − w)`` would still move it.
        """
        first_loss = None
        taken = has_samples(batch)
        for _ in range(self.inner_steps):
            loss, g = ctx.loss_and_grad(theta, batch)
            stepped = {k: theta[k] - self.personal_lr * (g[k] + self.lam * (theta[k] - w[k])) for k in theta}
            theta = {k: torch.where(taken, stepped[k], theta[k]) for k in theta}
            if first_loss is None:
                first_loss = loss
        assert first_loss is not None
        return theta, first_loss

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        """R local rounds: prox solve for θ on D_{i,r}, then ``w_local ← w_local − ηλ (w_local − θ)``.

        θ starts at w (the stored θ_i is not read) and the final θ is returned as the client's new state.
        """
        w_local = params
        theta = params
        losses = []
        for r in range(batches.x.shape[0]):
            batch = batches.at(r, 0)
            theta, loss = self.prox_point(ctx, w_local, batch, theta)
            # an empty local round (padding under local_epochs) is no round: w_local is kept
            taken = has_samples(batch)
            w_local = {k: torch.where(taken, w_local[k] - self.local_lr * self.lam * (w_local[k] - theta[k]),
                                      w_local[k]) for k in w_local}
            losses.append(loss)
        gap = sum(((theta[k] - w_local[k]) ** 2).sum() for k in theta)
        return ClientOutput(
            delta={k: w_local[k] - params[k] for k in params},
            state={THETA: {k: theta[k] for k in params}},
            extras={},
            metrics={"loss": _mean_over_taken_rounds(losses, batches), "personal_gap": gap},
        )

    # ------------------------------------------------------------------------------------------
    def eval_plan(self) -> BatchPlan:
        """One batch (``eval_batch_size``; ``None`` = the whole training set) for the new-client prox solve; under
        ``finetune_epochs`` E epochs of such batches, one prox solve per batch (θ warm-started, w fixed)."""
        if self.finetune_epochs is not None:
            return BatchPlan(steps=0, per_step=1, batch_size=self.eval_batch_size, epochs=self.finetune_epochs,
                             drop_last=self.drop_last)
        return BatchPlan(steps=1, per_step=1, batch_size=self.eval_batch_size)

    def personalize(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> Params:
        """Client i's evaluation model: its stored θ_i if it has trained (``client.seen``), else θ̂_i(w), K inner
        prox steps from θ = w on its training batch (a new client's personalisation; under ``finetune_epochs`` K
        inner steps on each batch in turn)."""
        fresh = params
        for t in range(batches.x.shape[0]):
            fresh, _ = self.prox_point(ctx, params, batches.at(t, 0), fresh)
        # both branches are computed: a tensor-valued choice keeps this vmap-safe
        return {k: torch.where(client.seen, state[THETA][k].to(fresh[k].dtype), fresh[k]) for k in params}
