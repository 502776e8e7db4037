"""The local SGD loops shared by the algorithms: plain SGD and proximal SGD over a client's batches.

Both walk the leading (step) axis of a round's batches ``[T, per_step, B, ...]`` and take one step
per batch ``batches[t, 0]``, with Python loops over static step counts, so they run per client and
under ``torch.func.vmap`` alike. They return the final model and the mean training loss over the
steps (each step's loss is taken at the model before the step).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedmeta.client.compiled import ZERO
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, has_samples

__all__ = ["local_sgd", "mean_over_taken_steps", "prox_sgd", "prox_step"]


def mean_over_taken_steps(values: list[Tensor], batches: Batch, first: int = 0) -> Tensor:
    """The mean of per-step values over the steps a client took (those whose batch holds a sample; a straggler
    with a budget of local steps skips the rest): ``Σ_t s_t v_t / max(1, Σ_t s_t)``, steps ``first, first + 1, …``.
    """
    steps = len(values)
    mask = batches.mask[first:first + steps]
    stacked = torch.stack(values)
    taken = (mask.reshape(steps, -1).sum(1) > 0).to(stacked.dtype)
    return (stacked * taken).sum() / taken.sum().clamp_min(1.0)


def local_sgd(ctx: ClientContext, params: Params, batches: Batch, lr: float) -> tuple[Params, Tensor]:
    """SGD ``w ← w − η ∇F(w; Dₜ)`` over every batch ``batches[t, 0]`` (:meth:`ClientContext.sgd_step`).

    FedAvg's client (also Reptile's, IFCA's and CFL's). A step on an empty batch (beyond a straggler's budget) is
    a no-op: the masked loss and its gradient are 0. The returned loss is the mean over the steps taken.
    """
    w = params
    losses = []
    for t in range(batches.x.shape[0]):
        w, loss = ctx.sgd_step(w, batches.at(t, 0), lr)
        losses.append(loss)
    return w, mean_over_taken_steps(losses, batches)


def prox_sgd(
    ctx: ClientContext,
    w0: Params,
    batches: Batch,
    lr: float,
    coef: float | Tensor,
    centre: Params,
    first: int = 0,
    steps: int | None = None,
) -> tuple[Params, Tensor]:
    """Proximal SGD ``w ← w − η (∇F(w; Dₜ) + c (w − u))`` over ``batches[first:first + steps]``
    (default: from ``first`` to the end).

    The local step of FedProx (``c = μ``, ``u = w``), Ditto and the regularised MTL family. ``c = 0``
    is plain SGD, written as this formula (it rounds differently from :func:`local_sgd`'s fused step). A step on
    an empty batch (beyond a straggler's budget) leaves ``w`` unchanged; the loss is the mean over the steps taken.
    """
    n = batches.x.shape[0] - first if steps is None else steps
    w = w0
    losses = []
    for t in range(first, first + n):
        # one primitive per step: compiled once and reused for every step when the module compiles
        w, loss = ctx.step(prox_step, w, batches.at(t, 0), lr, coef, centre)
        losses.append(loss)
    return w, mean_over_taken_steps(losses, batches, first)


def prox_step(
    ctx: ClientContext, w: Params, batch: Batch, lr: float | Tensor, coef: float | Tensor, centre: Params
) -> tuple[Params, Tensor]:
    """One proximal step ``w − η (∇F(w; D) + c (w − u))``; returns the new model and ``F(w; D)``. On an empty batch
    (a step beyond a straggler's budget) the rate is 0: ``w`` is returned unchanged."""
    loss, g = ctx.loss_and_grad(w, batch)
    rate = lr * has_samples(batch).to(loss.dtype)
    return {k: w[k] - rate * (g[k] + coef * (w[k] - centre[k])) for k in w}, loss


def _prox_step_on_empty_batch(w: Params, batch: Batch, lr: float | Tensor, coef: float | Tensor,
                              centre: Params) -> tuple[Params, object]:
    """:func:`prox_step` on an empty batch: the rate is 0, so ``(w, 0)`` (a compacted round skips such steps)."""
    return dict(w), ZERO


prox_step.empty_batch = _prox_step_on_empty_batch  # type: ignore[attr-defined]
