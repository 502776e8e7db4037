"""The algorithm's own aggregate: ``(Δ, σ') = algorithm.aggregate(w, outputs, weights, σ, records)``.

For the default rule ``Δ = Σ_i w_i Δ_i``. When an earlier stage transformed the deltas (attacks, clipping),
the algorithm aggregates the transformed ones; otherwise it receives the clients' outputs untouched. BatchNorm
statistics a stage must protect (:attr:`Uploads.statistics`, under DP) are averaged with the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_fedmeta.client.functional import weighted_sum
from lightning_fedmeta.loop.stages.base import ServerContext, ServerUpdate, Uploads, unflatten_row_tree
from lightning_fedmeta.loop.validation import validate_aggregate_output

__all__ = ["AlgorithmAggregate"]


@dataclass(frozen=True)
class AlgorithmAggregate:
    def __call__(self, uploads: Uploads, ctx: ServerContext) -> Uploads:
        out = uploads.output
        if uploads.rows is not None:
            out = out._replace(delta=unflatten_row_tree(uploads.rows, out.delta))
        result = ctx.algorithm.aggregate(ctx.params, out, uploads.weights, ctx.server_state, ctx.records)
        if not (isinstance(result, tuple) and len(result) == 2):  # the contract error names what is wrong
            validate_aggregate_output(ctx.algorithm, result, ctx.params, ctx.server_state, strict_dtypes=False)
        delta, server_state = result
        statistics = None if uploads.statistics is None else weighted_sum(uploads.weights, uploads.statistics)
        return uploads.with_(update=ServerUpdate(delta, server_state, statistics))
