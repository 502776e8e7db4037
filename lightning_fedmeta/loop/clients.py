"""The client half of a round, as functions both frontends call: the engine for its sampled clients, a Flower
ClientApp for the one client its node holds (:mod:`lightning_fedmeta.flower.client`).

For client ``c`` of round ``r`` (docs/design.md, contracts 1, 2 and 9):

    batches  = draw_batch_indices(seed, "train", r, c, plan)      pure in (seed, r, c): rows of c's own data
    seed_c   = stable_seed(seed, "dropout", r, c)                  the global RNG of a looped client (dropout)
    out, s_c = client_update(ctx with c's BN statistics, w, batches, state_c, σ, record_c), c's new statistics

:func:`partition_offsets` lets a node that holds only some clients' rows draw exactly what the whole federation
draws for them; :func:`run_client_updates` runs the client function looped or batched (``run_clients``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_fedmeta.algorithms.base import Algorithm, ClientOutput, ClientRecord
from lightning_fedmeta.client.execution import run_clients
from lightning_fedmeta.client.functional import Batch, ClientContext, Params
from lightning_fedmeta.client.sampling import stable_seed

__all__ = ["client_step", "loop_seeds", "partition_offsets", "run_client_updates"]


def loop_seeds(seed: int, batching: str, tag: str, round_idx: int, clients: Tensor) -> list[int] | None:
    """``stable_seed(seed, tag, r, c)`` per listed client: the global RNG of each looped client (dropout); the
    batched path draws nothing (``None``)."""
    if batching != "loop":
        return None
    return [stable_seed(seed, tag, round_idx, int(c)) for c in clients]


def client_step(algorithm: Algorithm, ctx: ClientContext, params: Params, server_state: dict[str, Tensor],
                batches: Batch, state: dict[str, Tensor], record: ClientRecord,
                buffers: dict[str, Tensor]) -> tuple[ClientOutput, dict[str, Tensor]]:
    """One client's local procedure, and its BatchNorm running statistics after it (``{}`` without BatchNorm):
    ``client_update`` under ``ctx.for_client(buffers)`` (the statistics the client starts from)."""
    ctx = ctx.for_client(buffers) if buffers else ctx
    out = algorithm.client_update(ctx, params, batches, state, server_state, record)
    return out, ctx.updated_buffers()


def run_client_updates(algorithm: Algorithm, ctx: ClientContext, shared: tuple[Params, dict[str, Any]],
                       per_client: tuple[Batch, dict[str, Tensor], ClientRecord, dict[str, Tensor]], count: int,
                       batching: str, chunk: int | None, seeds: list[int] | None,
                       reduce: Callable[[Any, slice], Any] | None = None) -> tuple[Any, dict[str, Tensor]]:
    """:func:`client_step` for ``count`` clients (``per_client``: their stacked batches, states, records and
    starting statistics; ``shared``: the downloaded parameters and the server state), looped or batched in chunks
    of ``chunk``. Returns ``(outputs, statistics)`` stacked in the clients' order (each chunk's outputs passed
    through ``reduce`` first, when given)."""
    def fn(params: Params, server_state: dict[str, Tensor], batches: Batch, state: dict[str, Tensor],
           record: ClientRecord, buffers: dict[str, Tensor]) -> tuple[ClientOutput, dict[str, Tensor]]:
        return client_step(algorithm, ctx, params, server_state, batches, state, record, buffers)

    return run_clients(
        fn, shared, per_client, count, batching, chunk, seeds,
        label=f"{type(algorithm).__name__}.client_update",
        reduce=None if reduce is None else (lambda pair, part: (reduce(pair[0], part), pair[1])),
    )


def partition_offsets(local_offsets: Tensor, indices: Tensor) -> Tensor:
    """The federation's row offsets as a node holding the clients ``indices`` (sorted, distinct) sees them: client
    ``indices[j]`` owns rows ``local_offsets[j]:local_offsets[j + 1]`` of the node's tensors, every other client
    none, so ``draw_batch_indices`` gives the node the batches the whole federation draws for its clients."""
    indices = indices.cpu().long()
    if indices.numel() and not bool((indices[1:] > indices[:-1]).all()):
        raise ValueError(f"partition_offsets: the node's client indices must be sorted and distinct, got "
                         f"{indices.tolist()}")
    size = int(indices.max()) + 2 if indices.numel() else 1
    ends = torch.zeros(size, dtype=torch.long)
    ends[indices + 1] = local_offsets.cpu().long()[1:] - local_offsets.cpu().long()[:-1]
    return torch.cumsum(ends, 0)
