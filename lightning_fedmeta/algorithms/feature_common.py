"""Representation-space helpers of FedProto, FedDBE, FedPAC and FedAS: the features a linear head reads, per-class
sums, and the server state of class prototypes.

Both algorithms regularise the *representation* ``z = φ(x)``, the input of the model's last linear layer (the
head ``h(z) = W z + b``; the body ``φ`` is everything before it). :func:`linear_head` finds that layer among the
parameters (by :func:`~lightning_fedmeta.algorithms.shared_representation.head_names`), and
:func:`features_and_logits` runs the model once through ``torch.func.functional_call`` and returns both ``z``
(captured by a forward pre-hook on the head module, removed after the call) and the logits ``h(z)``. It is a pure
tensor computation, so it runs under ``torch.func.grad`` and ``vmap``.

Models with prepared BatchNorm layers (running statistics tracked per client by the
:class:`~lightning_fedmeta.client.functional.ClientContext`) are refused: this forward does not go through the
context's statistics scope. Models with GroupNorm or LayerNorm (no running statistics) run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.func import functional_call

from lightning_fedmeta.algorithms.heads import head_names
from lightning_fedmeta.client import batchnorm_stats as running_stats
from lightning_fedmeta.client.functional import ClientContext, Params, model_logits

__all__ = ["KNOWN", "PROTOTYPES", "LinearHead", "class_sums", "empty_prototypes", "features_and_logits", "linear_head"]

#: server-state keys of class prototypes: ``prototypes`` ``[C, d]`` and ``known`` ``[C]`` (1 once class c has one)
PROTOTYPES, KNOWN = "prototypes", "known"


class LinearHead(NamedTuple):
    """The model's last linear layer: its module path, ``weight [C, d]`` name and ``bias [C]`` name (or None)."""

    module: str
    weight: str
    bias: str | None


def linear_head(params: Params, head_prefix: str | Sequence[str] | None, algorithm: str) -> LinearHead:
    """The head named by ``head_prefix`` (default: the last layer), which must be one linear layer: a 2-d
    ``weight`` ``[C, d]`` and optionally a 1-d ``bias`` ``[C]`` of the same module. Raises ``ValueError``
    saying what the head holds otherwise."""
    names = head_names(list(params), head_prefix)
    modules = {n.rpartition(".")[0] for n in names}
    weights = [n for n in names if n.rpartition(".")[2] == "weight" and params[n].dim() == 2]
    biases = [n for n in names if n.rpartition(".")[2] == "bias" and params[n].dim() == 1]
    if len(modules) != 1 or len(weights) != 1 or len(names) != len(weights) + len(biases):
        raise ValueError(
            f"{algorithm} regularises the input of the model's last linear layer, but its head {names} is not one "
            "nn.Linear (a 2-d weight and a bias): end the model with an nn.Linear or name it with head_prefix"
        )
    return LinearHead(modules.pop(), weights[0], biases[0] if biases else None)


def features_and_logits(ctx: ClientContext, params: Params, x: Tensor, head: LinearHead) -> tuple[Tensor, Tensor]:
    """``(z, h(z))``: the input of the head module (``[B, d]``) and the model's output, in one forward."""
    if running_stats.tracked_layers(ctx.model):
        raise ValueError(
            "this algorithm reads the representation with its own forward, which does not track BatchNorm running "
            "statistics: use a model with GroupNorm/LayerNorm (or BatchNorm with track_running_stats=False)"
        )
    module: nn.Module = ctx.model.get_submodule(head.module) if head.module else ctx.model
    captured: list[Tensor] = []
    handle = module.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    try:
        logits = model_logits(functional_call(ctx.model, (params, ctx.constants(params, ctx.buffers)), (x,)))
    finally:
        handle.remove()
    return captured[0], logits


def class_sums(z: Tensor, y: Tensor, mask: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """``(S [C, d], n [C])``: ``S_c = Σ_j m_j [y_j = c] z_j`` and ``n_c = Σ_j m_j [y_j = c]`` over a batch."""
    onehot = torch.nn.functional.one_hot(y.long(), num_classes).to(z.dtype) * mask.to(z.dtype).unsqueeze(-1)
    # an elementwise product and a sum, not a matmul: autocast leaves it in the features' precision
    return (onehot.unsqueeze(-1) * z.unsqueeze(1)).sum(0), onehot.sum(0)


def empty_prototypes(params: Params, head: LinearHead, num_classes: int | None, algorithm: str) -> dict[str, Tensor]:
    """No prototype yet: ``{prototypes: zeros [C, d], known: zeros [C]}`` in the head's dtype and device, after
    checking that the head has one output per class (``num_classes``, from ``bind_clients``)."""
    if num_classes is None:
        raise RuntimeError(f"{algorithm}.init_server_state needs the number of classes: call "
                           "bind_clients(clients, label_counts) first (FederatedModule.attach_data does)")
    weight = params[head.weight]
    if weight.shape[0] != num_classes:
        raise ValueError(f"{algorithm} needs one output per class: the head has {weight.shape[0]} outputs, the data "
                         f"{num_classes} classes")
    like = {"dtype": weight.dtype, "device": weight.device}
    return {PROTOTYPES: torch.zeros(weight.shape[0], weight.shape[1], **like),
            KNOWN: torch.zeros(weight.shape[0], **like)}
