"""Per-sample losses: what every algorithm's local steps, adaptation and evaluation minimise.

A loss here maps ``(outputs, targets)`` of a batch of ``B`` samples to ``[B]`` per-sample values;
:class:`~lightning_fedmeta.client.functional.ClientContext` takes their masked mean
``f(w; D) = Σ_j m_j ℓ_j / Σ_j m_j`` (padding rows have ``m_j = 0``), so a client's loss never
depends on how its batch was padded. Samples with extra target axes (token sequences ``[B, T]``,
multi-label rows ``[B, C]``, vector regression ``[B, D]``) are reduced to one value per sample by
the mean over those axes.

Named losses (``FederatedModule(loss="mse")``, or ``loss: mse`` in YAML):

=================== ======================================================================
``cross_entropy``   ``−log softmax(z)[y]``; ``z [B, C]`` with ``y [B]``, or ``z [B, T, C]`` with
                    ``y [B, T]`` (the mean over positions: next-token prediction)
``nll``             ``−z[y]`` for log-probabilities ``z`` (same shapes as ``cross_entropy``)
``mse``             ``mean (z − y)²`` over the target's axes
``l1``              ``mean |z − y|``
``smooth_l1``       PyTorch's smooth L1 (``beta = 1``), averaged over the target's axes
``huber``           Huber loss (``delta = 1``), averaged over the target's axes
``bce_with_logits`` ``mean_c [−y_c log σ(z_c) − (1 − y_c) log(1 − σ(z_c))]`` for multi-label ``y ∈ {0, 1}``
=================== ======================================================================

Anything else is a callable ``(outputs, targets) -> [B]`` (or ``[B, ...]``, averaged to ``[B]``),
or a ``torch.nn`` loss module such as ``torch.nn.MSELoss()``: a copy with ``reduction="none"`` is
used, so its default ``reduction="mean"`` cannot silently give one number for the whole batch.
Half and bfloat16 outputs are upcast to float32 before the loss (mixed precision).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LOSSES", "DEFAULT_LOSS", "PerSampleLoss", "resolve_loss", "per_sample", "loss_name", "aligned"]

PerSampleLoss = Callable[[Tensor, Tensor], Tensor]


def _upcast(t: Tensor) -> Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def per_sample(values: Tensor) -> Tensor:
    """``[B, ...] -> [B]``: the mean over every axis but the first (identity for ``[B]``)."""
    return values if values.dim() <= 1 else values.reshape(values.shape[0], -1).mean(dim=1)


def _class_scores(outputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """``[B, *pos, C]`` scores with ``[B, *pos]`` class ids -> ``[N, C]`` and ``[N]`` (positions flattened)."""
    if outputs.dim() != targets.dim() + 1:
        raise ValueError(
            f"class scores must have one more axis than the class ids (the classes, last): got outputs "
            f"{tuple(outputs.shape)} and targets {tuple(targets.shape)}"
        )
    return outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1)


def cross_entropy(outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-sample cross-entropy ``−log softmax(z)[y]`` (the mean over positions for sequences)."""
    z, y = _class_scores(_upcast(outputs), targets)
    return per_sample(F.cross_entropy(z, y, reduction="none").reshape(targets.shape))


def nll(outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-sample negative log-likelihood ``−z[y]`` of log-probabilities ``z``."""
    z, y = _class_scores(_upcast(outputs), targets)
    return per_sample(F.nll_loss(z, y, reduction="none").reshape(targets.shape))


def aligned(outputs: Tensor, targets: Tensor) -> Tensor:
    """Outputs (half precision upcast) in the targets' shape (``[B, 1]`` outputs for ``[B]`` targets are accepted)."""
    outputs = _upcast(outputs)
    if outputs.shape != targets.shape:
        if outputs.numel() != targets.numel():
            raise ValueError(
                f"outputs {tuple(outputs.shape)} do not match targets {tuple(targets.shape)}: the model must give "
                "one value per target entry"
            )
        outputs = outputs.reshape(targets.shape)
    return outputs


def mse(outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-sample mean squared error over the target's axes."""
    z = aligned(outputs, targets)
    return per_sample((z - targets.to(z.dtype)) ** 2)


def l1(outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-sample mean absolute error over the target's axes."""
    z = aligned(outputs, targets)
    return per_sample((z - targets.to(z.dtype)).abs())


def smooth_l1(outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-sample smooth L1 (``beta = 1``)."""
    z = aligned(outputs, targets)
    return per_sample(F.smooth_l1_loss(z, targets.to(z.dtype), reduction="none"))


def huber(outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-sample Huber loss (``delta = 1``)."""
    z = aligned(outputs, targets)
    return per_sample(F.huber_loss(z, targets.to(z.dtype), reduction="none"))


def bce_with_logits(outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-sample binary cross-entropy of logits, averaged over the labels (multi-label)."""
    z = aligned(outputs, targets)
    return per_sample(F.binary_cross_entropy_with_logits(z, targets.to(z.dtype), reduction="none"))


LOSSES: dict[str, PerSampleLoss] = {
    "cross_entropy": cross_entropy,
    "nll": nll,
    "mse": mse,
    "l1": l1,
    "smooth_l1": smooth_l1,
    "huber": huber,
    "bce_with_logits": bce_with_logits,
}

#: The loss used when none is given, by task (``FederatedData.task``).
DEFAULT_LOSS: dict[str, str] = {
    "classification": "cross_entropy",
    "next_token": "cross_entropy",
    "multilabel": "bce_with_logits",
    "regression": "mse",
}


class _ModuleLoss:
    """A ``torch.nn`` loss module with ``reduction="none"``, reduced to one value per sample."""

    def __init__(self, module: nn.Module) -> None:
        self.module = copy.deepcopy(module)
        self.module.reduction = "none"  # type: ignore[assignment]
        self.__qualname__ = type(module).__qualname__

    def __call__(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return per_sample(self.module(_upcast(outputs), targets))


class _ReducedLoss:
    """A user callable whose ``[B, ...]`` values are averaged to ``[B]``."""

    def __init__(self, fn: Callable[[Tensor, Tensor], Tensor]) -> None:
        self.fn = fn
        self.__qualname__ = getattr(fn, "__qualname__", type(fn).__name__)

    def __call__(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return per_sample(self.fn(outputs, targets))


def loss_name(spec: Any) -> str:
    """A short name of a loss specification, for messages and the checkpoint."""
    if isinstance(spec, str):
        return spec
    if isinstance(spec, nn.Module):
        return type(spec).__name__
    return getattr(spec, "__qualname__", type(spec).__name__)


def resolve_loss(spec: str | Callable[[Tensor, Tensor], Tensor] | nn.Module | None, task: str) -> PerSampleLoss:
    """The per-sample loss for ``spec``: a name of :data:`LOSSES`, a ``torch.nn`` loss module, a callable,
    or ``None`` (the task's default, :data:`DEFAULT_LOSS`)."""
    if spec is None:
        return LOSSES[DEFAULT_LOSS[task]]
    if isinstance(spec, str):
        if spec not in LOSSES:
            raise ValueError(f"unknown loss {spec!r}; choose one of {sorted(LOSSES)}, or pass a callable")
        return LOSSES[spec]
    if isinstance(spec, nn.Module):
        if not hasattr(spec, "reduction"):
            raise ValueError(
                f"the loss module {type(spec).__name__} has no `reduction` attribute; pass a callable "
                "(outputs, targets) -> [B] per-sample losses instead"
            )
        return _ModuleLoss(spec)
    if callable(spec):
        return _ReducedLoss(spec)
    raise TypeError(f"loss must be a name, a torch.nn loss module or a callable, got {type(spec).__name__}")
