"""The server side of a round, written once: the stage pipeline, then the server optimizer's step.

    uploads  → [participation weights w_i] → poison (simulated attacks) → clip (DP) →
               aggregate (the algorithm's rule, or a robust rule) → noise (DP)  →  (Δ, σ')
    w       ← server optimizer step with the pseudo-gradient  p.grad = −Δ  (SGD(lr=β): w + βΔ; Adam/Yogi: FedOpt)

The participation weights come from :class:`~lightning_fedmeta.loop.federation.Federation` (renormalised over the
clients that answered). Which stages run follows the ``model.*`` reliability options
(:meth:`ServerPipeline.from_reliability`); with none of them the pipeline is the algorithm's ``aggregate`` alone.
Every frontend (the Lightning module, the Flower ServerApp, the testing kit, benchmarks) calls
:func:`apply_server_step`; none writes its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_fedmeta.algorithms.base import ClientOutput
from lightning_fedmeta.client.functional import Params
from lightning_fedmeta.loop.stages import (
    AddDPNoise,
    AlgorithmAggregate,
    ClipUploads,
    PoisonUploads,
    RobustAggregate,
    ServerContext,
    ServerStage,
    ServerUpdate,
    Uploads,
)
from lightning_fedmeta.reliability.options import Reliability

__all__ = [
    "ServerPipeline", "apply_server_step", "check_update_finite", "noise_only_uploads", "skip_server_step",
    "sums_finite",
]


class ServerPipeline:
    """An ordered list of stages; :meth:`run` passes the uploads through them."""

    def __init__(self, stages: Sequence[ServerStage], statistics: str = "mean") -> None:
        self.stages = list(stages)
        # how the published model's BatchNorm statistics are formed: "mean" (Σ w_i s_i), "pipeline" (the stages
        # clip, aggregate and noise them with the updates: DP, robust rules) or "local" (never published)
        self.statistics = statistics

    @classmethod
    def from_reliability(cls, reliability: Reliability) -> ServerPipeline:
        """The stages the options ask for, in their only meaningful order (docs/reliability.md)."""
        if not reliability.transforms_uploads:
            return cls([AlgorithmAggregate()])
        stages: list[ServerStage] = []
        if reliability.byzantine is not None and reliability.byzantine.poisons_model:
            stages.append(PoisonUploads(reliability.byzantine))
        if reliability.dp is not None:
            stages.append(ClipUploads())
        rule = reliability.aggregator
        stages.append(AlgorithmAggregate() if rule.name == "mean" and rule.clip is None else RobustAggregate(rule))
        if reliability.dp is not None:
            stages.append(AddDPNoise(reliability.dp))
        protected = reliability.dp is not None or not isinstance(stages[-1], AlgorithmAggregate)
        local = reliability.dp is not None and reliability.dp.batchnorm == "local"
        return cls(stages, "local" if local else "pipeline" if protected else "mean")

    def run(self, uploads: Uploads, ctx: ServerContext) -> Uploads | None:
        """The uploads after every stage (``update`` set), or ``None`` when a stage skips the round."""
        for stage in self.stages:
            result = stage(uploads, ctx)
            if result is None:
                return None
            uploads = result
        assert uploads.update is not None, f"no stage of {self!r} aggregated the uploads"
        return uploads

    def __repr__(self) -> str:
        return "ServerPipeline(" + " → ".join(type(s).__name__ for s in self.stages) + ")"


def noise_only_uploads(pipeline: ServerPipeline, ctx: ServerContext, statistics_size: int = 0) -> Uploads:
    """The output of a DP round no client answered: the last stage (``AddDPNoise``) on an empty sum, so
    ``Δ = (σC/m)·ξ`` and adaptive clipping still updates ``C`` (``statistics_size``: BatchNorm statistics being
    published get their noise too). Every frontend releases this instead of skipping such a round: skipping would
    reveal an empty cohort, which the accountant does not cover."""
    zeros = {k: torch.zeros_like(v) for k, v in ctx.params.items()}
    device = next(iter(zeros.values())).device
    statistics = torch.zeros(statistics_size, device=device) if statistics_size else None
    output = ClientOutput(delta={k: v[None][:0] for k, v in zeros.items()}, state={}, extras={}, metrics={})
    uploads = Uploads(output, torch.zeros(0), norms=torch.zeros(0, dtype=torch.float64),
                      update=ServerUpdate(zeros, ctx.server_state, statistics))
    noised = pipeline.stages[-1](uploads, ctx)
    assert noised is not None and noised.update is not None, "a DP pipeline ends with AddDPNoise"
    return noised


def sums_finite(sums: list[torch.Tensor]) -> bool:
    """Whether all these sums are finite, in one host sync: a NaN or an infinity anywhere in a tensor makes its
    sum non-finite, so a finite sum proves the tensor finite (one pass over the data instead of isfinite's
    several). A non-finite sum may also be an overflow of finite values: callers then check element-wise."""
    return bool(torch.isfinite(torch.cat([t.reshape(-1).float() for t in sums])).all())


def check_update_finite(round_idx: int, delta: Params) -> None:
    """Raise ``FloatingPointError`` (before any parameter changes) when the aggregate ``Δ`` is not finite."""
    if not sums_finite([v.sum() for v in delta.values()]) and not all(
        bool(torch.isfinite(v).all()) for v in delta.values()
    ):
        raise FloatingPointError(f"round {round_idx}: the aggregated update is not finite; lower the learning rates")


def apply_server_step(optimizer: Any, model: nn.Module, delta: Params) -> None:
    """The server step: ``p.grad = −Δ_p`` for every trainable parameter, then one optimizer step (``optimizer`` is a
    ``torch.optim`` optimizer or Lightning's wrapper of one). Frozen parameters (``requires_grad=False``) get no
    gradient, so the optimizer leaves them untouched (no step, no weight decay, no state)."""
    optimizer.zero_grad()
    for name, p in model.named_parameters():
        if not p.requires_grad:
            p.grad = None
            continue
        p.grad = (-delta[name]).to(p.dtype)
    optimizer.step()


def skip_server_step(optimizer: Any, model: nn.Module) -> None:
    """A round that changes nothing still counts: the optimizer steps without gradients (parameters and
    optimizer state untouched)."""
    optimizer.zero_grad(set_to_none=True)
    for p in model.parameters():
        p.grad = None
    optimizer.step()
