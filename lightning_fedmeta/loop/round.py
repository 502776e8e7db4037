"""The values a round produces: what the clients computed (:class:`RoundResult`) and what the round did
(:class:`RoundReport`). Both are frozen: per-round facts travel as values, never as attributes of a frontend."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_fedmeta.algorithms.base import ClientOutput
from lightning_fedmeta.communication.accounting import RoundTraffic
from lightning_fedmeta.loop.server import sums_finite
from lightning_fedmeta.loop.stages import PrivacyReport
from lightning_fedmeta.persistence.memory_store import flatten_state

__all__ = ["RoundReport", "RoundResult", "check_outputs_finite", "finite_clients"]


@dataclass(frozen=True)
class RoundResult:
    """The clients' side of round ``round_idx``, all ranks combined.

    Attributes:
        clients: the clients that took part (sorted indices).
        output: their stacked :class:`ClientOutput` (``[n, ...]`` leaves).
        weights: ``w_i``, the participation weights renormalised over ``clients``.
        steps: ``τ_i``, the local steps each took.
        buffers: their BatchNorm running statistics after the round (``{}`` without BatchNorm).
        residual: their new top-k residuals (``model.compression`` with error feedback), else ``None``.
        delta_summed: ``output.delta`` holds the round's aggregate ``Σ_i w_i Δ_i`` as one row instead of every
            client's update (a streamed round, :mod:`~lightning_fedmeta.loop.streaming`).
    """

    round_idx: int
    clients: Tensor
    output: ClientOutput
    weights: Tensor
    steps: Tensor
    buffers: dict[str, Tensor] = field(default_factory=dict)
    residual: dict[str, Tensor] | None = None
    delta_summed: bool = False

    def __iter__(self) -> Iterator[Any]:
        """``clients, output, weights = result`` (the tuple ``FederatedModule.compute_round`` always returned)."""
        return iter((self.clients, self.output, self.weights))


@dataclass(frozen=True)
class RoundReport:
    """What a finished round did: its clients, their weighted training metrics, the DP report, or why it was
    skipped (the model is then unchanged), and the bytes its clients downloaded and uploaded (``traffic``; ``None``
    for a round that did not count them)."""

    round_idx: int
    clients: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)
    privacy: PrivacyReport | None = None
    skipped: str | None = None
    traffic: RoundTraffic | None = None

    @property
    def loss(self) -> Tensor | None:
        return self.metrics.get("loss")


def finite_clients(result: RoundResult) -> Tensor:
    """bool ``[n]``: which of the round's clients have a finite loss, update, extras and state (one host sync
    when all are finite)."""
    out = result.output
    leaves = list(out.delta.values()) + list(out.metrics.values()) + list(flatten_state(out.extras).values())
    leaves += [t for t in flatten_state(out.state).values() if t.is_floating_point()]
    n = int(result.clients.numel())
    if not leaves or sums_finite([t.reshape(t.shape[0], -1).sum(1) for t in leaves]):
        return torch.ones(n, dtype=torch.bool)
    return torch.stack([torch.isfinite(t.reshape(t.shape[0], -1)).all(1) for t in leaves]).all(0).cpu()


def check_outputs_finite(result: RoundResult, client_names: list[str], algorithm: Any) -> None:
    """Raise ``FloatingPointError`` naming the first client whose loss, update, extras or state is not finite."""
    ok = finite_clients(result)
    if not bool(ok.all()):
        bad = int(result.clients[(~ok).nonzero()[0, 0]])
        raise FloatingPointError(
            f"round {result.round_idx}: client {client_names[bad]} (index {bad}) produced a non-finite loss or "
            f"update with {algorithm!r}; lower the learning rates. The global model was not updated and saved "
            "checkpoints are untouched."
        )
