"""Simulated model poisoning: the Byzantine clients' uploads replaced by an attack's (``model.byzantine``).

``Δ_i ← attack(Δ_i)`` for the round's Byzantine clients (sign flip, scaled, Gaussian, ALIE, IPM:
:mod:`lightning_fedmeta.reliability.attacks`); honest rows are returned bit for bit. The attack's draws come from
``generator_for(seed, "attack", round)``. Data poisoning (label flips) happens before the clients run, not here.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_fedmeta.client.sampling import generator_for
from lightning_fedmeta.loop.stages.base import ServerContext, Uploads
from lightning_fedmeta.reliability.attacks import ByzantineSpec, attack_rows

__all__ = ["PoisonUploads"]


@dataclass(frozen=True)
class PoisonUploads:
    spec: ByzantineSpec

    def __call__(self, uploads: Uploads, ctx: ServerContext) -> Uploads:
        rows = uploads.flat()
        if bool(ctx.byzantine.any()):
            rows = attack_rows(self.spec, rows, ctx.byzantine.to(rows.device), generator_for(ctx.seed, "attack",
                                                                                             ctx.round_idx))
        return uploads.with_(rows=rows)
