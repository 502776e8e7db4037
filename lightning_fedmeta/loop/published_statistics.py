"""The published model's BatchNorm statistics when a server stage must protect them (DP, robust rules).

Each client keeps its own running statistics ``s_i``
(:class:`~lightning_fedmeta.loop.client_storage.RunningStatistics`).
Without DP or a robust rule the model's become ``Σ_i w_i s_i``. Under DP that mean is an unprotected release of the
clients' data (one client's inputs ×1000 moved ``running_var`` by 6.6e4 while the parameters moved 1e-7), and a
robust rule that rejects a row must reject its statistics too. So the stages receive each client's change of the
floating-point statistics as one more row block,

    r_i = flatten(s_i) − flatten(s)          [n, d_s]   (published_statistics_rows)

clip it with the client's update, aggregate it by the same rule, noise it with the same standard deviation, and the
model's statistics become ``s + r`` (publish_statistics; a running variance is floored at 0, which is
post-processing). Integer counters (``num_batches_tracked``) are not published on this path: they stay as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

__all__ = ["publish_statistics", "published_statistics_rows", "published_statistics_size"]


def _float_names(names: Iterable[str], model: nn.Module) -> list[str]:
    own = dict(model.named_buffers())
    return [n for n in names if own[n].is_floating_point()]


def published_statistics_size(model: nn.Module, names: Iterable[str]) -> int:
    """``d_s``: the number of floating-point statistics among the buffers ``names`` of ``model``."""
    own = dict(model.named_buffers())
    return sum(own[n].numel() for n in _float_names(names, model))


def published_statistics_rows(buffers: Mapping[str, Tensor], model: nn.Module) -> Tensor:
    """``[n, d_s]``: each client's floating-point statistics (``buffers[name]`` is ``[n, ...]``) minus the model's,
    flattened in the order of ``buffers``."""
    own = dict(model.named_buffers())
    names = _float_names(buffers, model)
    n = next(iter(buffers.values())).shape[0]
    rows = [(buffers[k].reshape(n, -1) - own[k].reshape(1, -1).to(buffers[k])).float() for k in names]
    return torch.cat(rows, 1) if rows else torch.zeros(n, 0)


def publish_statistics(model: nn.Module, names: Iterable[str], change: Tensor) -> None:
    """Set the model's floating-point statistics among ``names`` to ``s + change`` (a variance floored at 0)."""
    own = dict(model.named_buffers())
    start = 0
    with torch.no_grad():
        for k in _float_names(names, model):
            size = own[k].numel()
            value = own[k] + change[start:start + size].reshape(own[k].shape).to(own[k])
            own[k].copy_(value.clamp_min(0) if k.endswith("running_var") else value)
            start += size
