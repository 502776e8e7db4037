"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar, "Personalized Federated Learning with Theoretical
Guarantees: A Model-Agnostic Meta-Learning Approach", NeurIPS 2020, Algorithm 1).

Objective: F(w) = (1/n) Σ_i f_i(w − α∇f_i(w)), the loss of every client after one step of
gradient descent from the shared model w.  Client i runs τ local steps from w_i⁰ = w; step t
draws three independent mini-batches D, D′, D″ of its training data and computes
    w̃ = w − α ∇f_i(w; D),          v = ∇f_i(w̃; D′),
then, by ``variant``:
    exact:  w ← w − β (v − α ∇²f_i(w; D″) v)        (Hessian-vector product, vjp of grad)
    hf:     w ← w − β (v − α d),  d = [∇f_i(w + δv; D″) − ∇f_i(w − δv; D″)] / (2δ)
    fo:     w ← w − β v                                (first-order: the Hessian term dropped)
The client uploads Δ_i = w_i^τ − w and the server averages the clients' final models
(w ← w + Σ_{i∈S} p_i Δ_i with the module's ``server_lr`` = 1).  A client is evaluated with
its personalised model: ``finetune_steps`` (default 1) SGD steps at rate α from w on its
training data, the one-step adaptation the objective is built for.

Paper defaults (§6, MNIST/CIFAR-10): α = β = 0.001, τ = 10, |D| = |D′| = |D″| = 40, δ = 0.001.
"""

from __future__ import annotations

from typing import Literal

from torch import Tensor

from lightning_fedmeta.algorithms.base import (
    Algorithm,
    BatchPlan,
    ClientOutput,
    ClientRecord,
    check_positive,
)
from lightning_fedmeta.algorithms.fedmaml import BETA_IS_LOCAL_LR, META_FINETUNE_DEFAULTS, beta_meta_rates
from lightning_fedmeta.algorithms.local_steps import mean_over_taken_steps
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_axpy, tree_sub

__all__ = ["PerFedAvg", "PerFedAvgVariant", "hessian_free_hvp"]

PerFedAvgVariant = Literal["fo", "hf", "exact"]
_BATCHES_PER_STEP = {"fo": 2, "hf": 3, "exact": 3}


def hessian_free_hvp(ctx: ClientContext, params: Params, batch: Batch, v: Params, delta: float) -> Params:
    """Central-difference Hessian-vector product ``[∇f(w + δv) − ∇f(w − δv)] / (2δ)``.

    Its error against ``∇²f(w) v`` is ``O(δ²)`` for a smooth loss (Per-FedAvg (HF), eq. (9)).
    """
    g_plus = ctx.grad(tree_axpy(delta, v, params), batch)
    g_minus = ctx.grad(tree_axpy(-delta, v, params), batch)
    return {k: (g_plus[k] - g_minus[k]) / (2.0 * delta) for k in params}


class PerFedAvg(Algorithm):
    """Per-FedAvg with first-order (``fo``), Hessian-free (``hf``) or exact Hessian (``exact``) steps.

    Args:
        variant: ``"fo"``, ``"hf"`` or ``"exact"`` (see the module docstring).
        alpha: α, the adaptation (inner) step size, ``>= 0``; also the evaluation fine-tuning rate.
        beta: β, the local meta step size, ``>= 0``.
        delta: δ of the ``hf`` finite difference, ``> 0``.
        local_steps: τ, local meta steps per round.
        batch_size: size of each of D, D′, D″ (``None`` = full batch).
        finetune_steps: SGD steps from w before a client is evaluated (default 1, as the paper).
        finetune_lr: rate of those steps (default α).
        finetune_batch_size: batch size of those steps (``None`` = the client's whole training set).

    The common argument ``local_lr`` is refused (``unused_args``): the local step size is ``beta``.
    """

    name = "perfedavg"
    step_budget = True
    summary = "Per-FedAvg: FedAvg on the one-step-adapted loss, fo/hf/exact (Fallah et al., 2020)"
    unused_args = BETA_IS_LOCAL_LR
    common_defaults = {"batch_size": 40, **META_FINETUNE_DEFAULTS}

    def __init__(
        self,
        variant: PerFedAvgVariant = "hf",
        alpha: float = 0.001,
        beta: float = 0.001,
        delta: float = 0.001,
        finetune_lr: float | None = None,
    ) -> None:
        if variant not in _BATCHES_PER_STEP:
            raise ValueError(f"variant must be one of {sorted(_BATCHES_PER_STEP)}, got {variant!r}")
        rates = beta_meta_rates(alpha, beta, finetune_lr)
        check_positive("delta", delta)
        super().__init__(**rates)
        self.variant = variant
        self.alpha, self.beta, self.delta = alpha, beta, delta

    def round_plan(self) -> BatchPlan:
        """τ steps of (D, D′) for ``fo``, (D, D′, D″) for ``hf`` and ``exact``. Under ``local_epochs`` (E) a step
        takes the next ``k·B`` rows of the epoch's permutation (``k`` = 2 or 3 batches): ``E·⌈n_c/(k·B)⌉`` steps, as
        PFLlib's Per-FedAvg, whose loader yields batches of ``2B`` split into D and D′."""
        steps = self.local_steps if self.local_epochs is None else 0
        return BatchPlan(steps=steps, per_step=_BATCHES_PER_STEP[self.variant], batch_size=self.batch_size,
                         epochs=self.local_epochs, drop_last=self.drop_last)

    def meta_direction(
        self, ctx: ClientContext, w: Params, batches: Batch, t: int
    ) -> tuple[Params, Tensor, Tensor]:
        """Step ``t``'s direction ``(I − α∇²f_i(w; D″)) ∇f_i(w̃; D′)`` (or its hf/fo form).

        Returns the direction, ``f_i(w; D)`` and the adapted loss ``f_i(w̃; D′)``.
        """
        return self.step_direction(ctx, w, batches.at(t))

    def step_direction(self, ctx: ClientContext, w: Params, step: Batch) -> tuple[Params, Tensor, Tensor]:
        """The direction of one meta step from its batches ``step = (D, D′[, D″])`` (leading axis)."""
        loss, g = ctx.loss_and_grad(w, step.at(0))
        w_tilde = tree_axpy(-self.alpha, g, w)
        meta_loss, v = ctx.loss_and_grad(w_tilde, step.at(1))
        if self.variant == "fo":
            return v, loss, meta_loss
        if self.variant == "exact":
            hv = ctx.hvp(w, step.at(2), v)
        else:
            hv = hessian_free_hvp(ctx, w, step.at(2), v, self.delta)
        return tree_axpy(-self.alpha, hv, v), loss, meta_loss

    def meta_step(self, ctx: ClientContext, w: Params, step: Batch) -> tuple[Params, Tensor, Tensor]:
        """One local meta step ``w − β · direction``; returns the new model, ``f_i(w; D)`` and ``f_i(w̃; D′)``."""
        direction, loss, meta_loss = self.step_direction(ctx, w, step)
        return tree_axpy(-self.beta, direction, w), loss, meta_loss

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        w = params
        losses, meta_losses = [], []
        for t in range(batches.x.shape[0]):
            # one primitive per step: compiled once and reused τ times when the module compiles
            w, loss, meta_loss = ctx.step(self.meta_step, w, batches.at(t))
            losses.append(loss)
            meta_losses.append(meta_loss)
        # a step on empty batches (beyond a straggler's budget) is a no-op: every gradient in it is 0
        metrics = {
            "loss": mean_over_taken_steps(losses, batches), "meta_loss": mean_over_taken_steps(meta_losses, batches),
        }
        return ClientOutput(tree_sub(w, params), state, {}, metrics)
