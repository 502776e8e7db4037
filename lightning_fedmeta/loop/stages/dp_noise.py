"""Client-level DP, second half: Gaussian noise on the aggregate, and the next clip (``model.dp``).

    Δ ← Δ + (σ_Δ C / m) ξ,   ξ ~ N(0, I)                          (McMahan et al., ICLR 2018)
    b̄ = (Σ_i 1[‖Δ_i‖ ≤ C] + N(0, σ_b²)) / m,   C ← C·exp(−η_C (b̄ − γ))   adaptive (Andrew et al., NeurIPS 2021)

``σ_Δ`` and ``σ_b`` split the noise multiplier ``z`` (:func:`~lightning_fedmeta.privacy.noise_multipliers`). A
sampled client that did not answer counts as above ``C`` (norm ``+inf``), so the denominator stays ``m``. Draws
come from ``generator_for(seed, "dp-noise" | "dp-clip", round)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lightning_fedmeta.loop.stages.base import PrivacyReport, ServerContext, ServerUpdate, Uploads
from lightning_fedmeta.privacy import DPSpec, adapt_clip, gaussian_noise, noise_multipliers
from lightning_fedmeta.sampling import generator_for

__all__ = ["AddDPNoise"]


@dataclass(frozen=True)
class AddDPNoise:
    spec: DPSpec

    def __call__(self, uploads: Uploads, ctx: ServerContext) -> Uploads:
        assert uploads.update is not None and uploads.norms is not None, "AddDPNoise follows clipping and aggregation"
        delta, norms, clip, cohort = uploads.update.delta, uploads.norms, ctx.clip, ctx.cohort
        sigma, _ = noise_multipliers(self.spec, cohort)
        if sigma > 0:
            generator = generator_for(ctx.seed, "dp-noise", ctx.round_idx)
            std = sigma * clip / cohort
            delta = {k: v + gaussian_noise(v, std, generator) for k, v in delta.items()}
        next_clip = None
        if self.spec.adaptive is not None:
            generator = generator_for(ctx.seed, "dp-clip", ctx.round_idx)
            missing = torch.full((cohort - int(norms.numel()),), math.inf, dtype=norms.dtype, device=norms.device)
            next_clip = adapt_clip(clip, torch.cat([norms, missing]), cohort, self.spec, generator)
        fraction = float((norms > clip).to(torch.float64).mean())
        return uploads.with_(update=ServerUpdate(delta, uploads.update.server_state),
                             privacy=PrivacyReport(clip, fraction, next_clip))
