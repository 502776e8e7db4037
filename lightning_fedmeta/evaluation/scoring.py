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
from lightning_fedmeta.functional import Batch, ClientContext, Params

__all__ = ["score_client"]


def score_client(ctx: ClientContext, algorithm: Algorithm, params: Params, server_state: dict[str, Tensor],
                 adapt: Batch, test: Batch, state: dict[str, Tensor], record: ClientRecord,
                 functions: Sequence[Callable[[Tensor, Tensor], Tensor]], keep_outputs: bool = False
                 ) -> dict[str, Tensor]:
    """``total``, ``loss_sum``, ``builtin`` (``[B]``, when ``functions``) and, with ``keep_outputs``, the outputs."""
    w = algorithm.personalize(ctx, params, adapt, state, server_state, record)
    outputs = ctx.predict(w, test.x)
    losses = ctx.per_sample_loss(outputs, test.y)
    mask = test.mask.to(losses.dtype)
    result = {"total": mask.sum(), "loss_sum": (losses * mask).sum()}
    if functions:
        result["builtin"] = torch.stack([(f(outputs, test.y).to(mask.dtype) * mask).sum() for f in functions])
    if keep_outputs:
        result["outputs"] = outputs
    return result
