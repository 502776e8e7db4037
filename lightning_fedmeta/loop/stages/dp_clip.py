"""Client-level DP, first half: every update clipped to norm ``C`` and weighted ``1/m`` (``model.dp``).

    Δ_i ← Δ_i · min(1, C / ‖Δ_i‖₂),      w_i = 1/m  (m = clients sampled per round, a fixed denominator)

DP-FedAvg (McMahan et al., ICLR 2018, Algorithm 1): with the fixed denominator a client's influence on ``Δ`` is
at most ``C/m`` whether or not others answered. The norms before clipping are kept for adaptive clipping. With
BatchNorm statistics to publish (``model.dp.batchnorm: private``) a client's row is ``[Δ_i ‖ s_i − s]`` (its
statistics' change), clipped as one: the statistics spend the same norm budget, so the sensitivity stays ``C``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_fedmeta.loop.stages.base import ServerContext, Uploads
from lightning_fedmeta.privacy.mechanism import clip_rows

__all__ = ["ClipUploads"]


@dataclass(frozen=True)
class ClipUploads:
    def __call__(self, uploads: Uploads, ctx: ServerContext) -> Uploads:
        rows, statistics = uploads.flat(), uploads.statistics
        w = uploads.weights
        weights = torch.ones(int(w.numel()), dtype=w.dtype, device=w.device) / ctx.cohort
        if statistics is None:
            rows, norms = clip_rows(rows, ctx.clip)
            return uploads.with_(rows=rows, norms=norms, weights=weights)
        joint, norms = clip_rows(torch.cat([rows, statistics.to(device=rows.device, dtype=rows.dtype)], 1), ctx.clip)
        d = rows.shape[1]
        return uploads.with_(rows=joint[:, :d], statistics=joint[:, d:], norms=norms, weights=weights)
