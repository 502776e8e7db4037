"""Per-client BatchNorm running statistics for functional (``torch.func``) client steps.

PyTorch's BatchNorm updates ``running_mean``/``running_var``/``num_batches_tracked`` in place during
the forward pass, which a functional client step cannot do: under ``torch.func.vmap`` the buffers
would be mutated with one client's statistics for all clients, and inside ``torch.func.grad`` the
update would be a tensor of an inner transform level. :func:`prepare_model` therefore switches each
BatchNorm layer that tracks running statistics to a subclass whose forward is *functional* whenever
a :class:`~lightning_fedmeta.client.functional.ClientContext` runs the model:

* **train mode**: it normalises with the statistics of the batch's real samples (the batch's
  ``mask``; padding rows neither enter the statistics nor change the running ones), and, when the
  context is bound to a client's buffers (``ctx.for_client(buffers)``), it *returns* the advanced
  running statistics (PyTorch's own update rule, see :func:`advance`) to the context instead of
  writing them into the buffers. The context hands them out of ``torch.func.grad`` as an auxiliary
  output (``has_aux=True``, detached), so nothing leaks from a transform level and loop == vmap.
* **eval mode**: it normalises with the running statistics it is given (the client's bound ones, or
  the module's own) and changes nothing.

Outside a ``ClientContext`` (a plain ``model(x)``), the layer is PyTorch's BatchNorm, unchanged:
the state dict, the parameters, the buffers and ``isinstance`` checks are all the same.

The masked statistics of an input ``x [B, C, *S]`` with mask ``m [B]`` are, per channel,
``n = Σ_b m_b · |S|``, ``μ = Σ m_b x_b / n`` and ``σ² = Σ m_b (x_b − μ)² / n`` (biased, used to
normalise, as PyTorch does); the running variance takes the unbiased ``σ² n / (n − 1)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = [
    "prepare_model",
    "running_stat_names",
    "tracked_layers",
    "client_buffers",
    "advance",
    "masked_batch_statistics",
    "statistics_scope",
    "updates_by_name",
]

_STAT_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


# ----------------------------------------------------------------------------------------------
# the scope a ClientContext opens around each forward
# ----------------------------------------------------------------------------------------------
@dataclass
class _Scope:
    """What a prepared BatchNorm layer needs to know during one functional forward."""

    mask: Tensor | None  #: ``[B]`` (1 = real sample) or ``None`` (every row is real)
    record: dict[nn.Module, tuple[Tensor, Tensor, Tensor | None]] | None = field(default=None)
    """Where train-mode layers put their advanced running statistics (``None``: do not compute them)."""


_SCOPES: list[_Scope] = []


@contextmanager
def statistics_scope(
    mask: Tensor | None, record: dict[nn.Module, tuple[Tensor, Tensor, Tensor | None]] | None = None
) -> Iterator[_Scope]:
    """Run prepared BatchNorm layers functionally inside the ``with`` block.

    Args:
        mask: ``[B]`` sample mask of the batch the model is called on (``None``: all rows are real).
        record: a dict that receives, for each prepared layer running in train mode, its advanced
            ``(running_mean, running_var, num_batches_tracked)`` (detached), computed from the
            buffers the layer sees (under ``functional_call``, the ones passed to it). ``None``: the
            running statistics are neither advanced nor recorded.
    """
    scope = _Scope(mask, record)
    _SCOPES.append(scope)
    try:
        yield scope
    finally:
        _SCOPES.pop()


# ----------------------------------------------------------------------------------------------
# the statistics
# ----------------------------------------------------------------------------------------------
def _stat_dtype(x: Tensor) -> torch.dtype:
    """Statistics are taken in at least float32 (half/bfloat16 activations under autocast)."""
    return torch.promote_types(x.dtype, torch.float32)


def masked_batch_statistics(x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Per-channel ``(mean, biased variance, n)`` of ``x [B, C, *S]`` over its real rows.

    ``n = Σ_b mask_b · |S|`` is a tensor (``0`` when no row is real: the mean and variance are then 0).
    With ``mask=None`` every row is real. Differentiable in ``x``.
    """
    if x.dim() < 2:
        raise ValueError(f"BatchNorm expects an input with a batch and a channel axis, got shape {tuple(x.shape)}")
    dims = [0, *range(2, x.dim())]
    spatial = 1
    for s in x.shape[2:]:
        spatial *= s
    xs = x.to(_stat_dtype(x))
    if mask is None:
        n = torch.full((), float(x.shape[0] * spatial), dtype=xs.dtype, device=x.device)
        mean = xs.mean(dims)
        centred = xs - mean.view(1, -1, *([1] * (x.dim() - 2)))
        var = (centred * centred).mean(dims)
        return mean, var, n
    if mask.dim() != 1 or mask.shape[0] != x.shape[0]:
        raise ValueError(
            f"a BatchNorm layer received an input of shape {tuple(x.shape)} but the batch mask has shape "
            f"{tuple(mask.shape)}: masked batch statistics need the layer's input to keep the batch axis first "
            "(one row per sample)"
        )
    m = mask.to(xs.dtype).view(-1, *([1] * (x.dim() - 1)))
    n = mask.to(xs.dtype).sum() * spatial
    denom = n.clamp_min(1.0)
    mean = (xs * m).sum(dims) / denom
    centred = xs - mean.view(1, -1, *([1] * (x.dim() - 2)))
    var = (centred * centred * m).sum(dims) / denom
    return mean, var, n


def advance(
    running_mean: Tensor,
    running_var: Tensor,
    num_batches_tracked: Tensor | None,
    momentum: float | None,
    mean: Tensor,
    var: Tensor,
    n: Tensor,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """PyTorch's running-statistics update, as a pure function.

    ``num_batches_tracked += 1``; ``r ← (1 − f) r + f · stat`` with ``f = momentum``, or
    ``f = 1 / num_batches_tracked`` (a cumulative average) when ``momentum`` is ``None``; the running
    variance takes the unbiased ``var · n / (n − 1)``. A batch without real samples (``n = 0``) changes
    nothing. (PyTorch refuses ``n = 1``; here the variance is then taken as is.)

    Args:
        mean, var: the batch's per-channel mean and *biased* variance.
        n: the number of values per channel (a tensor, so it may differ per client under vmap).
    """
    dtype = running_mean.dtype
    seen = (n > 0).to(dtype)
    unbiased = var * n / (n - 1).clamp_min(1.0)
    new_tracked = None
    if num_batches_tracked is not None:
        new_tracked = num_batches_tracked + (n > 0).to(num_batches_tracked.dtype)
    if momentum is None:
        if new_tracked is None:
            factor = torch.zeros((), dtype=dtype, device=running_mean.device)
        else:
            factor = seen / new_tracked.clamp_min(1).to(dtype)
    else:
        factor = seen * momentum
    new_mean = (1 - factor) * running_mean + factor * mean.detach().to(dtype)
    new_var = (1 - factor) * running_var + factor * unbiased.detach().to(dtype)
    return new_mean, new_var, new_tracked


def _channel(t: Tensor, x: Tensor) -> Tensor:
    return t.view(1, -1, *([1] * (x.dim() - 2)))


def _functional_batch_norm(module: _BatchNorm, x: Tensor, scope: _Scope) -> Tensor:
    module._check_input_dim(x)
    use_batch = module.training or module.running_mean is None or module.running_var is None
    if use_batch:
        mean, var, n = masked_batch_statistics(x, scope.mask)
        if scope.record is not None and module.running_mean is not None and module.running_var is not None:
            # a layer called twice in one forward advances twice, as PyTorch's does
            base = scope.record.get(module, (module.running_mean, module.running_var, module.num_batches_tracked))
            new = advance(*base, module.momentum, mean.detach(), var.detach(), n.detach())
            scope.record[module] = (new[0].detach(), new[1].detach(), None if new[2] is None else new[2].detach())
    else:
        mean, var = module.running_mean, module.running_var
    dtype = _stat_dtype(x)
    out = (x.to(dtype) - _channel(mean.to(dtype), x)) * _channel(torch.rsqrt(var.to(dtype) + module.eps), x)
    if module.weight is not None:
        out = out * _channel(module.weight.to(dtype), x)
    if module.bias is not None:
        out = out + _channel(module.bias.to(dtype), x)
    return out.to(x.dtype)


class _FunctionalBatchNorm:
    """Mixin placed before a BatchNorm class: functional inside a :func:`statistics_scope`, PyTorch's outside."""

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 - nn.Module's argument name
        if not _SCOPES:
            return super().forward(input)  # type: ignore[misc]
        return _functional_batch_norm(self, input, _SCOPES[-1])  # type: ignore[arg-type]


class FunctionalBatchNorm1d(_FunctionalBatchNorm, nn.BatchNorm1d):
    """``nn.BatchNorm1d`` whose statistics are functional inside a ``ClientContext`` (see the module docstring)."""


class FunctionalBatchNorm2d(_FunctionalBatchNorm, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose statistics are functional inside a ``ClientContext`` (see the module docstring)."""


class FunctionalBatchNorm3d(_FunctionalBatchNorm, nn.BatchNorm3d):
    """``nn.BatchNorm3d`` whose statistics are functional inside a ``ClientContext`` (see the module docstring)."""


class FunctionalSyncBatchNorm(_FunctionalBatchNorm, nn.SyncBatchNorm):
    """``nn.SyncBatchNorm``: inside a ``ClientContext`` each client's statistics are its own (no sync)."""


_PREPARED: dict[type, type] = {
    nn.BatchNorm1d: FunctionalBatchNorm1d,
    nn.BatchNorm2d: FunctionalBatchNorm2d,
    nn.BatchNorm3d: FunctionalBatchNorm3d,
    nn.SyncBatchNorm: FunctionalSyncBatchNorm,
}


def _prepared_class(cls: type) -> type:
    """The functional subclass of a BatchNorm class (made once for a class not listed above)."""
    if cls not in _PREPARED:
        name = f"Functional{cls.__name__}"
        made = type(name, (_FunctionalBatchNorm, cls), {"__module__": __name__, "__qualname__": name})
        globals().setdefault(name, made)  # picklable by reference within this process
        _PREPARED[cls] = made
    return _PREPARED[cls]


def _tracks(m: nn.Module) -> bool:
    return isinstance(m, _BatchNorm) and m.track_running_stats and m.running_mean is not None


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


# ----------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------
def prepare_model(model: nn.Module) -> list[str]:
    """Make ``model``'s BatchNorm layers with running statistics usable in functional client steps.

    Each ``_BatchNorm`` with ``track_running_stats=True`` gets a functional subclass of its own class
    (``BatchNorm2d`` → :class:`FunctionalBatchNorm2d`) in place: same parameters, buffers, state dict
    and behaviour outside a ``ClientContext``. Idempotent; a model without such layers is unchanged.

    Returns:
        the names (as in ``model.named_buffers()``) of the buffers that are per-client running
        statistics: ``running_mean``, ``running_var`` and ``num_batches_tracked`` of each such layer.
    """
    for name, m in model.named_modules():
        if not _tracks(m) or isinstance(m, _FunctionalBatchNorm):
            continue
        if isinstance(m, nn.modules.lazy.LazyModuleMixin) and m.has_uninitialized_params():
            raise ValueError(
                f"BatchNorm layer {name or '<root>'} is lazy and not initialised yet: run one forward pass "
                "before prepare_model"
            )
        m.__class__ = _prepared_class(type(m))
    return running_stat_names(model)


def tracked_layers(model: nn.Module) -> dict[nn.Module, str]:
    """The prepared BatchNorm layers that track running statistics, with their names in ``model``."""
    return {m: name for name, m in model.named_modules() if isinstance(m, _FunctionalBatchNorm) and _tracks(m)}


def running_stat_names(model: nn.Module) -> list[str]:
    """The buffer names of the running statistics of ``model``'s prepared BatchNorm layers."""
    names = []
    for m, prefix in tracked_layers(model).items():
        for b in _STAT_BUFFERS:
            if getattr(m, b, None) is not None:
                names.append(_join(prefix, b))
    return names


def client_buffers(model: nn.Module, num_clients: int, names: list[str] | None = None) -> dict[str, Tensor]:
    """Every client's initial running statistics: the module's own, stacked ``num_clients`` times.

    Returns ``{name: [num_clients, *shape]}`` for ``names`` (default: :func:`running_stat_names`).
    """
    buffers = dict(model.named_buffers())
    names = running_stat_names(model) if names is None else names
    return {n: buffers[n].detach().unsqueeze(0).repeat(num_clients, *([1] * buffers[n].dim())) for n in names}


def updates_by_name(
    layers: dict[nn.Module, str], record: dict[nn.Module, tuple[Tensor, Tensor, Tensor | None]]
) -> dict[str, Tensor]:
    """A :func:`statistics_scope` record as ``{buffer name: tensor}`` (``layers`` from :func:`tracked_layers`)."""
    out: dict[str, Any] = {}
    for m, (mean, var, tracked) in record.items():
        prefix = layers[m]
        out[_join(prefix, "running_mean")] = mean
        out[_join(prefix, "running_var")] = var
        if tracked is not None:
            out[_join(prefix, "num_batches_tracked")] = tracked
    return out
