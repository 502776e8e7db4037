"""Client-level DP, second half: Gaussian noise on the aggregate, and the next clip (``model.dp``).

    Δ ← Δ + (σ_Δ C / m) ξ,   ξ ~ N(0, I)                          (McMahan et al., ICLR 2018)
    b̄ = (Σ_i 1[‖Δ_i‖ ≤ C] + N(0, σ_b²)) / m,   C ← C·exp(−η_C (b̄ − γ))   adaptive (Andrew et al., NeurIPS 2021)

``σ_Δ`` and ``σ_b`` split the noise multiplier ``z`` (:func:`~lightning_fedmeta.privacy.mechanism.noise_multipliers`).
The
count is centred (``b_i − ½``) and divided by ``m̂``, the expected number of answering clients, so a client that
did not answer leaves it unbiased (TensorFlow Privacy's ``QuantileEstimatorQuery``). BatchNorm statistics being
published (:attr:`ServerUpdate.statistics`) get the same noise, drawn after the parameters'. Draws come from
``ctx.dp_draws()`` (seeded by ``(seed, "dp-noise" | "dp-clip", release)``, or secret under ``secure_mode``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lightning_fedmeta.loop.stages.base import PrivacyReport, ServerContext, ServerUpdate, Uploads
from lightning_fedmeta.privacy.mechanism import DPSpec, adapt_clip, noise_multipliers

__all__ = ["AddDPNoise"]


@dataclass(frozen=True)
class AddDPNoise:
    spec: DPSpec

    def __call__(self, uploads: Uploads, ctx: ServerContext) -> Uploads:
        assert uploads.update is not None and uploads.norms is not None, "AddDPNoise follows clipping and aggregation"
        update, norms, clip, cohort = uploads.update, uploads.norms, ctx.clip, ctx.cohort
        delta, statistics = update.delta, update.statistics
        sigma, sigma_b = noise_multipliers(self.spec, cohort)
        draws, release = ctx.dp_draws(), ctx.release()
        if sigma > 0:
            tree = dict(delta) if statistics is None else {**delta, _STATISTICS: statistics}
            noise = draws.noise_tree(tree, sigma * clip / cohort, "dp-noise", release)
            delta = {k: v + noise[k] for k, v in delta.items()}
            if statistics is not None:
                statistics = statistics + noise[_STATISTICS]
        next_clip = None
        if self.spec.adaptive is not None:
            xi = draws.standard_normal("dp-clip", release) if sigma_b > 0 else 0.0
            next_clip = adapt_clip(clip, norms, cohort, self.spec, xi, expected_answers=ctx.expected_answers)
        fraction = float((norms > clip).to(torch.float64).mean()) if norms.numel() else 0.0
        return uploads.with_(update=ServerUpdate(delta, update.server_state, statistics),
                             privacy=PrivacyReport(clip, fraction, next_clip))


_STATISTICS = "\0batchnorm-statistics"  # noised after every parameter (a name no parameter has)
