"""The values that flow through the server pipeline, and the protocol every stage follows.

A round's uploads enter as :class:`Uploads` (the stacked client outputs and their weights ``w_i``); each stage
returns new :class:`Uploads` (never edits its input) or ``None`` when the round cannot be aggregated (too few
clients for a robust rule: the round then leaves the model unchanged). The aggregation stage fills ``update``
(``Δ`` and the next server state); later stages transform it. Stages that need the deltas as one row per client
read :meth:`Uploads.flat` (``[n, d]``, :func:`~lightning_fedmeta.reliability.robust.flatten_rows`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from torch import Tensor

from lightning_fedmeta.algorithms.base import Algorithm, ClientOutput, ClientRecord
from lightning_fedmeta.client.functional import Params
from lightning_fedmeta.privacy.draws import DPDraws, SeededDraws
from lightning_fedmeta.reliability.robust import flatten_rows

__all__ = ["PrivacyReport", "ServerContext", "ServerStage", "ServerUpdate", "Uploads", "unflatten_row_tree"]


@dataclass(frozen=True)
class ServerUpdate:
    """The aggregate: ``Δ`` (applied by the server optimizer as the pseudo-gradient ``−Δ``) and the next
    server state."""

    delta: Params
    server_state: dict[str, Any]
    statistics: Tensor | None = None  # [d_s] the published change of the BatchNorm statistics (Uploads.statistics)


@dataclass(frozen=True)
class PrivacyReport:
    """What a DP round reports: the clip ``C`` it used, the fraction of updates clipped, and the next round's
    ``C`` under adaptive clipping (``None``: fixed)."""

    clip: float
    clipped_fraction: float
    next_clip: float | None = None

    def logged(self) -> dict[str, float]:
        """The values logged every round, by name (``dp/clip``, ``dp/clipped_fraction``)."""
        return {"dp/clip": self.clip, "dp/clipped_fraction": self.clipped_fraction}


@dataclass(frozen=True)
class ServerContext:
    """Everything a stage may read about the round besides the uploads.

    Attributes:
        byzantine: bool ``[n]``, which of the round's clients are simulated Byzantine clients.
        steps: int ``[n]``, the local steps each client took (FedNova).
        cohort: ``m``, the clients sampled per round (the DP denominator).
        clip: the current DP clipping norm ``C`` (``inf`` without DP).
        assumed_byzantine: ``f``, the Byzantine updates a robust rule tolerates.
        draws: where DP's random draws come from (``None``: ``SeededDraws(seed)``, reproducible from the seed).
        release_idx: the index of this release among all the model's rounds, warm starts included (``None``:
            ``round_idx``); DP's noise is drawn per release, so no noise is ever drawn twice.
        expected_answers: ``m̂``, the expected number of clients that answer (adaptive clipping's denominator;
            ``None``: ``cohort``).
    """

    algorithm: Algorithm
    params: Params
    server_state: dict[str, Any]
    records: ClientRecord
    seed: int
    round_idx: int
    byzantine: Tensor
    steps: Tensor
    cohort: int
    clip: float = math.inf
    assumed_byzantine: int = 0
    draws: DPDraws | None = None
    release_idx: int | None = None
    expected_answers: float | None = None

    def dp_draws(self) -> DPDraws:
        return self.draws if self.draws is not None else SeededDraws(self.seed)

    def release(self) -> int:
        return self.round_idx if self.release_idx is None else self.release_idx


@dataclass(frozen=True)
class Uploads:
    """The round's uploads as they pass through the stages."""

    output: ClientOutput
    weights: Tensor
    rows: Tensor | None = None  # the deltas as [n, d] rows, once a stage needed them
    norms: Tensor | None = None  # the rows' norms before DP clipping
    update: ServerUpdate | None = None
    privacy: PrivacyReport | None = field(default=None)
    # [n, d_s] each client's float BatchNorm statistics minus the model's, when a stage must protect them (DP,
    # robust rules): clipped with the client's row, aggregated by the same rule, noised with the update
    statistics: Tensor | None = None

    def flat(self) -> Tensor:
        """The deltas as ``[n, d]`` rows (the transformed ones when a stage changed them)."""
        return self.rows if self.rows is not None else flatten_rows(self.output.delta)

    def with_(self, **changes: Any) -> Uploads:
        return replace(self, **changes)


class ServerStage(Protocol):
    """One step of the server pipeline: ``(uploads, context) -> uploads`` or ``None`` (skip the round)."""

    def __call__(self, uploads: Uploads, ctx: ServerContext) -> Uploads | None: ...


def unflatten_row_tree(rows: Tensor, like: Params) -> Params:
    """``[n, d]`` rows back to a tree of ``[n, ...]`` leaves shaped like ``like`` (the inverse of ``flatten_rows``)."""
    out, start = {}, 0
    for k, v in like.items():
        size = v[0].numel() if v.shape[0] else int(math.prod(v.shape[1:]))
        out[k] = rows[:, start:start + size].reshape(v.shape).to(v.dtype)
        start += size
    return out
