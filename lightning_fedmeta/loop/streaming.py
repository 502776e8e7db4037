"""The streamed aggregate: a round's weighted-mean update summed chunk by chunk, never stacked whole.

An algorithm whose ``aggregate`` is the default rule of :class:`~lightning_fedmeta.algorithms.base.Algorithm`,

    Δ = Σ_{i∈S} w_i Δ_i        (w_i the round's participation weights, renormalised over S),

needs the clients' updates only through that sum. Stacking them first costs ``|S|`` copies of the model: for 1000
ResNet-18 clients (11.2 M parameters) 45 GB, which is what kept that cohort off an 80 GB GPU (issue 29,
benchmarks/results/gpu.md). Under :func:`streams` the engine instead hands :func:`~lightning_fedmeta.client.execution.
run_clients` a :class:`DeltaSum`, which adds each chunk's ``Σ_{i∈chunk} w_i Δ_i`` to a running total as soon as
the chunk is computed and keeps the chunk's other outputs (state, extras, metrics: small); the round's
``RoundResult`` then carries the total as a single row (``delta_summed``), and the server stage aggregates it with
weight 1 (exact: ``1·x = x``).

Numbers: with one chunk the sum is the same ``weighted_sum`` over the same stacked tensor as the stacked path, bit
for bit (so every run of one chunk, the fingerprinted runs included, is unchanged); with several chunks or step
groups the per-chunk partial sums are added in client order, which differs from one sum over all clients by
floating-point reassociation only (tested against the stacked path).

Before a chunk's updates are summed, they are checked as the stacked path checks them: the output contract on the
first chunk, and finiteness on every chunk (naming the client), so a sum never hides a bad client.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from lightning_fedmeta.algorithms.base import Algorithm, ClientOutput
from lightning_fedmeta.client.functional import Params, tree_weighted_sum
from lightning_fedmeta.loop.compression_stage import CompressionStage
from lightning_fedmeta.loop.ranks import RankSplit
from lightning_fedmeta.loop.server import ServerPipeline
from lightning_fedmeta.loop.stages import AlgorithmAggregate

__all__ = ["DeltaSum", "streams"]


def streams(algorithm: Algorithm, pipeline: ServerPipeline, compression: CompressionStage, ranks: RankSplit) -> bool:
    """Whether a round may stream its aggregate: the algorithm keeps the default ``aggregate`` (``Σ w_i Δ_i``, the
    server state unchanged), the server pipeline is that aggregate alone (no robust rule, clipping, DP noise or
    simulated model poisoning: those need every update), no upload compressor rewrites the updates, and one process
    computes every client (several ranks combine stacked outputs)."""
    return (type(algorithm).aggregate is Algorithm.aggregate
            and len(pipeline.stages) == 1 and isinstance(pipeline.stages[0], AlgorithmAggregate)
            and compression.upload is None and ranks.world == 1)


class DeltaSum:
    """The running ``Σ_i w_i Δ_i`` of one round, fed chunk by chunk.

    Args:
        weights: ``w_i`` of the round's clients, in the round's client order.
        check: called with ``(positions, output)`` on every chunk's stacked output before its updates are summed
            (``positions``: the chunk's clients as positions in the round), to validate and check finiteness.
    """

    def __init__(self, weights: Tensor, check: Callable[[Tensor, ClientOutput], None]) -> None:
        self.weights = weights
        self.check = check
        self.total: Params | None = None

    def for_positions(self, positions: Tensor) -> Callable[[Any, slice], Any]:
        """The reducer of one ``run_clients`` call whose clients sit at ``positions`` of the round (a step group,
        or the whole round)."""
        def reduce(output: Any, chunk: slice) -> Any:
            out = ClientOutput(*output)
            where = positions[chunk]
            self.check(where, out)
            part = tree_weighted_sum(out.delta, self.weights[where.to(self.weights.device)])
            self.total = part if self.total is None else {k: self.total[k] + v for k, v in part.items()}
            return out._replace(delta={})
        return reduce

    def output(self, rest: ClientOutput) -> ClientOutput:
        """The round's output: ``rest`` (every client's state, extras and metrics) with ``delta`` the summed update
        as one row."""
        assert self.total is not None, "no chunk was summed"
        return rest._replace(delta={k: v.unsqueeze(0) for k, v in self.total.items()})
