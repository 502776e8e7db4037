"""One client's personalised score, the single definition shared by the simulator and a Flower ClientApp.

    w_i   = algorithm.personalize(w, adapt batches_i, state_i, σ, record_i)
    ŷ     = f(w_i; x_test),   ℓ_j = loss(ŷ_j, y_j)
    total = Σ_j m_j,   loss_sum = Σ_j m_j ℓ_j,   builtin[b] = Σ_j m_j metric_b(ŷ_j, y_j)

where ``m_j`` masks the padding of a test set padded to the widest client.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_fedmeta.algorithms.base import Algorithm, ClientRecord
from lightning_fedmeta.client.functional import Batch, ClientContext, Params

__all__ = ["score_client"]


def score_client(ctx: ClientContext, algorithm: Algorithm, params: Params, server_state: dict[str, Tensor],
                 adapt: Batch, test: Batch, state: dict[str, Tensor], record: ClientRecord,
                 functions: Sequence[Callable[[Tensor, Tensor], Tensor]], keep_outputs: bool = False,
                 rows: int | None = None) -> dict[str, Tensor]:
    """``total``, ``loss_sum``, ``builtin`` (``[B]``, when ``functions``) and, with ``keep_outputs``, the outputs.

    ``rows``: predict the test set in slabs of that many rows, the sums added slab by slab (the same sums,
    reassociated; a padded test set of a thousand images per client under ``vmap`` outgrows a CPU's caches).
    ``None``: the whole test set at once."""
    w = algorithm.personalize(ctx, params, adapt, state, server_state, record)
    width = test.x.shape[0]
    step = width if rows is None or rows >= width else max(1, int(rows))
    parts = []
    for start in range(0, width, step):
        slab = Batch(test.x[start:start + step], test.y[start:start + step], test.mask[start:start + step])
        parts.append(_slab_sums(ctx, w, slab, functions, keep_outputs))
    if len(parts) == 1:
        return parts[0]
    out = {key: value for key, value in parts[0].items() if key != "outputs"}
    for part in parts[1:]:  # slab by slab, in order
        out = {key: out[key] + part[key] for key in out}
    if keep_outputs:
        out["outputs"] = torch.cat([p["outputs"] for p in parts])
    return out


def _slab_sums(ctx: ClientContext, w: Params, test: Batch, functions: Sequence[Callable[[Tensor, Tensor], Tensor]],
               keep_outputs: bool) -> dict[str, Tensor]:
    outputs = ctx.predict(w, test.x)
    losses = ctx.per_sample_loss(outputs, test.y)
    mask = test.mask.to(losses.dtype)
    result = {"total": mask.sum(), "loss_sum": (losses * mask).sum()}
    if functions:
        result["builtin"] = torch.stack([(f(outputs, test.y).to(mask.dtype) * mask).sum() for f in functions])
    if keep_outputs:
        result["outputs"] = outputs
    return result
