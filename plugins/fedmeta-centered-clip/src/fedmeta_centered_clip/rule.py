"""Centered clipping (Karimireddy, He, Jaggi, ICML 2021, Eq. (2)), started from the coordinate-wise median.

    v⁰ = median_i(Δ_i),   vˡ⁺¹ = vˡ + (1/n) Σ_i (Δ_i − vˡ) · min(1, τ / ‖Δ_i − vˡ‖),   Δ = v^L

The paper starts from the previous round's aggregate (server momentum); a rule of lightning_fedmeta keeps no
state between rounds, so the start is the coordinate-wise median (already robust; the iterations then pull it
towards the honest mean within radius τ). Unweighted, as in the paper: the server drops clients of weight 0
before calling the rule.
"""

from __future__ import annotations

import math

import torch
from lightning_fedmeta.reliability.robust import RobustRule, coordinate_median
from torch import Tensor

__all__ = ["CenteredClipping"]


class CenteredClipping(RobustRule):
    """Centered clipping around the coordinate-wise median.

    Args:
        tau: the clipping radius τ > 0 around the current estimate.
        iterations: L ≥ 1, the clipping iterations.
    """

    def __init__(self, tau: float = 1.0, iterations: int = 3) -> None:
        if isinstance(tau, bool) or not isinstance(tau, int | float) or not math.isfinite(tau) or tau <= 0:
            raise ValueError(f"tau must be a finite number > 0, got {tau!r}")
        if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
            raise ValueError(f"iterations must be an integer >= 1, got {iterations!r}")
        self.tau, self.iterations = float(tau), iterations

    def __call__(self, rows: Tensor, weights: Tensor, *, f: int = 0, steps: Tensor | None = None) -> Tensor:
        x = rows.to(torch.float64)
        v = coordinate_median(x)
        for _ in range(self.iterations):
            diff = x - v
            norms = torch.linalg.vector_norm(diff, dim=1, keepdim=True)
            scale = torch.where(norms > self.tau, self.tau / norms.clamp_min(1e-300), torch.ones_like(norms))
            v = v + (diff * scale).mean(dim=0)
        return v.to(rows.dtype)
