"""A robust rule in place of the weighted mean (``model.aggregator``): median, trimmed mean, Krum, Multi-Krum,
Bulyan, geometric median, FedNova, or the mean of norm-bounded updates (``clip``).

``Δ = rule({Δ_i}, w, f)`` over the ``[n, d]`` rows (:func:`~lightning_fedmeta.robust.aggregate_rows`); the
server state is unchanged (robust rules apply to algorithms whose upload is a plain delta). A rule that needs
``n`` larger than this round's answering clients allow (Krum: ``n > 2f + 2``) skips the round.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_fedmeta.loop.stages.base import ServerContext, ServerUpdate, Uploads
from lightning_fedmeta.robust import AggregatorSpec, aggregate_rows, check_aggregator, unflatten_row

__all__ = ["RobustAggregate"]


@dataclass(frozen=True)
class RobustAggregate:
    spec: AggregatorSpec

    def __call__(self, uploads: Uploads, ctx: ServerContext) -> Uploads | None:
        f = ctx.assumed_byzantine
        if self.spec.needs_f:
            try:
                check_aggregator(self.spec, int(uploads.weights.numel()), f)
            except ValueError:
                return None
        rows = uploads.flat()
        vector = aggregate_rows(self.spec, rows, uploads.weights, f=f, steps=ctx.steps.to(rows.device))
        return uploads.with_(update=ServerUpdate(unflatten_row(vector, uploads.output.delta), ctx.server_state))
