"""A robust rule in place of the weighted mean (``model.aggregator``): median, trimmed mean, Krum, Multi-Krum,
Bulyan, geometric median, FedNova, the mean of norm-bounded updates (``clip``), or any rule a plugin registers
in the ``lightning_fedmeta.aggregators`` entry-point group (:class:`~lightning_fedmeta.reliability.robust.RobustRule`).

``Δ = rule({Δ_i}, w, f)`` over the ``[n, d]`` rows (:func:`~lightning_fedmeta.reliability.robust.aggregate_rows`); the
server state is unchanged (robust rules apply to algorithms whose upload is a plain delta). A rule that needs
``n`` larger than this round's answering clients allow (Krum: ``n > 2f + 2``) skips the round. The clients'
BatchNorm statistics (:attr:`Uploads.statistics`, centred on the model's) go through the same rule on their own
rows (a rule with ``average_statistics``, FedNova, a re-weighting rather than a defence, averages them), so an
outlier's statistics are rejected as its update is.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_fedmeta.client.functional import weighted_sum
from lightning_fedmeta.loop.stages.base import ServerContext, ServerUpdate, Uploads
from lightning_fedmeta.reliability.robust import AggregatorSpec, aggregate_rows, check_aggregator, unflatten_row

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
        steps = ctx.steps.to(rows.device)
        vector = aggregate_rows(self.spec, rows, uploads.weights, f=f, steps=steps)
        statistics = uploads.statistics
        if statistics is not None:  # the same rule on the statistics: a row the rule rejects cannot move them
            averaged = getattr(self.spec.rule_class, "average_statistics", False)
            statistics = (weighted_sum(uploads.weights, statistics) if averaged
                          else aggregate_rows(self.spec, statistics, uploads.weights, f=f, steps=steps))
        update = ServerUpdate(unflatten_row(vector, uploads.output.delta), ctx.server_state, statistics)
        return uploads.with_(update=update)
