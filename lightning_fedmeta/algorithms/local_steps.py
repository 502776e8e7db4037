"""The local SGD loops shared by the algorithms: plain SGD and proximal SGD over a client's batches.

Both walk the leading (step) axis of a round's batches ``[T, per_step, B, ...]`` and take one step
per batch ``batches[t, 0]``, with Python loops over static step counts, so they run per client and
under ``torch.func.vmap`` alike. They return the final model and the mean training loss over the
steps (each step's loss is taken at the model before the step).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedmeta.functional import Batch, ClientContext, Params

__all__ = ["local_sgd", "prox_sgd", "prox_step"]


def local_sgd(ctx: ClientContext, params: Params, batches: Batch, lr: float) -> tuple[Params, Tensor]:
    """SGD ``w ← w − η ∇F(w; Dₜ)`` over every batch ``batches[t, 0]`` (:meth:`ClientContext.sgd_step`).

    FedAvg's client (also Reptile's, IFCA's and CFL's).
    """
    w = params
    losses = []
    for t in range(batches.x.shape[0]):
        w, loss = ctx.sgd_step(w, batches.at(t, 0), lr)
        losses.append(loss)
    return w, torch.stack(losses).mean()


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
    is plain SGD, written as this formula (it rounds differently from :func:`local_sgd`'s fused step).
    """
    n = batches.x.shape[0] - first if steps is None else steps
    w = w0
    losses = []
    for t in range(first, first + n):
        # one primitive per step: compiled once and reused for every step when the module compiles
        w, loss = ctx.step(prox_step, w, batches.at(t, 0), lr, coef, centre)
        losses.append(loss)
    return w, torch.stack(losses).mean()


def prox_step(
    ctx: ClientContext, w: Params, batch: Batch, lr: float | Tensor, coef: float | Tensor, centre: Params
) -> tuple[Params, Tensor]:
    """One proximal step ``w − η (∇F(w; D) + c (w − u))``; returns the new model and ``F(w; D)``."""
    loss, g = ctx.loss_and_grad(w, batch)
    return {k: w[k] - lr * (g[k] + coef * (w[k] - centre[k])) for k in w}, loss
