"""LoRA adapters (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models") on any ``nn.Module``.

:class:`LoRALinear` wraps a frozen ``nn.Linear`` ``y = W x + b`` as

    ``y = W x + b + (α/r) · B A x``,   ``A ∈ R^{r×d_in}``, ``B ∈ R^{d_out×r}``,

with ``A`` drawn as ``nn.Linear`` draws its weight (Kaiming-uniform, ``a = √5``, as the paper's reference code
``loralib`` does) and ``B = 0``, so the adapted model starts as the base model. Only ``A`` and ``B`` are trainable.

FFA-LoRA (Sun, Li, Li, Ding, "Improving LoRA in Privacy-preserving Federated Learning", ICLR 2024): with
``freeze_a=True`` every ``A`` is frozen at its random initialisation (``requires_grad=False``) and only the
zero-initialised ``B`` is trained. ``A`` is then part of the frozen base: every client builds the same one from the
model's seed, and it is never trained, sent or stored. FedAvg over ``B`` is FFA-LoRA, and its aggregation is exact:
with one ``A`` for all, ``Σ_i p_i B_i A = (Σ_i p_i B_i) A``, the average of the clients' updates ``B_i A`` (with
``A`` trained too, the average of the products is not the product of the averages). Under SGD the scale ``α/r``
then only rescales the step on ``B A`` (by ``(α/r)²``), so the paper finds FFA-LoRA insensitive to ``α`` over a
wide range and can use a larger one than LoRA (tune ``alpha`` with ``local_lr``).

:func:`add_lora` replaces the matching ``nn.Linear`` modules of a model by :class:`LoRALinear` and freezes every other
parameter (``requires_grad=False``), in place. The federation then trains, sends and stores the adapters alone: the
frozen base is shared by every client and never copied per client (:mod:`lightning_fedmeta.client.trainable`).

:class:`LoRAModel` is the same as a module built from arguments, for configuration files::

    model:
      model:
        class_path: lightning_fedmeta.models.LoRAModel
        init_args:
          model: {class_path: lightning_fedmeta.models.TinyTransformer, init_args: {vocab_size: 16}}
          targets: [qkv, proj]
          rank: 4
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["LoRALinear", "add_lora", "LoRAModel", "lora_parameter_count", "lora_example_mlp"]


class LoRALinear(nn.Module):
    """``y = W x + b + (α/r) B A x`` around a frozen ``nn.Linear`` (module docstring).

    Args:
        base: the linear layer to adapt; its weight and bias are frozen (``requires_grad=False``) in place.
        rank: ``r ≥ 1``, the rank of the update ``B A``.
        alpha: ``α > 0``; the update is scaled by ``α / r``.
        freeze_a: freeze ``A`` at its random initialisation, train ``B`` only (FFA-LoRA; module docstring).
    """

    def __init__(self, base: nn.Linear, rank: int = 8, alpha: float = 16.0, freeze_a: bool = False) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRALinear adapts an nn.Linear, got {type(base).__name__}")
        if int(rank) != rank or rank < 1:
            raise ValueError(f"the LoRA rank must be a positive integer, got {rank!r}")
        if not alpha > 0:
            raise ValueError(f"the LoRA alpha must be positive, got {alpha!r}")
        if not isinstance(freeze_a, bool):
            raise ValueError(f"freeze_a must be true or false, got {freeze_a!r}")
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.rank = int(rank)
        self.alpha = float(alpha)
        self.scaling = self.alpha / self.rank
        weight = base.weight
        self.lora_A = nn.Parameter(torch.empty(self.rank, base.in_features, dtype=weight.dtype, device=weight.device))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, self.rank, dtype=weight.dtype, device=weight.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.freeze_a = freeze_a
        self.lora_A.requires_grad_(not freeze_a)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + (x @ self.lora_A.T @ self.lora_B.T) * self.scaling

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}" + (", freeze_a=True" if self.freeze_a else "")


def _matches(name: str, patterns: Sequence[str]) -> bool:
    """``name`` (a dotted module/parameter name) matches a pattern: equal to it, ending in ``.<pattern>``, or
    matching it as a shell pattern (``blocks.*.attn.qkv``)."""
    return any(name == p or name.endswith("." + p) or fnmatch.fnmatchcase(name, p) for p in patterns)


def add_lora(model: nn.Module, targets: Sequence[str] | str | None = None, rank: int = 8, alpha: float = 16.0,
             train_also: Sequence[str] | str = (), freeze_a: bool = False) -> nn.Module:
    """Replace the ``nn.Linear`` modules of ``model`` named by ``targets`` with :class:`LoRALinear` (in place) and
    freeze every parameter but the adapters' ``lora_A``/``lora_B`` and those named by ``train_also``
    (with ``freeze_a``, ``lora_A`` too: FFA-LoRA).

    Args:
        model: any module.
        targets: module names: exact (``head``), a last component (``qkv`` matches ``blocks.0.attn.qkv``) or a shell
            pattern (``blocks.*.mlp.*``); ``None``: every ``nn.Linear``. A target that matches no ``nn.Linear`` is an
            error (a misspelt name would otherwise train nothing).
        rank: ``r``. alpha: ``α`` (the update is scaled by ``α/r``).
        train_also: parameter names left trainable besides the adapters (same matching; e.g. ``head.*``).
        freeze_a: freeze every ``lora_A`` at its random initialisation and train ``B`` only (FFA-LoRA, module
            docstring); ``train_also`` may then not name a ``lora_A``.

    Returns:
        ``model`` itself.
    """
    patterns = [targets] if isinstance(targets, str) else (None if targets is None else list(targets))
    also = [train_also] if isinstance(train_also, str) else list(train_also)
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and n]
    if isinstance(model, nn.Linear):
        raise TypeError("add_lora adapts the linear layers inside a model; wrap a bare nn.Linear in LoRALinear")
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("the model already has LoRA adapters (add_lora was applied twice)")
    chosen = [(n, m) for n, m in linears if patterns is None or _matches(n, patterns)]
    if patterns is not None:
        unused = [p for p in patterns if not any(_matches(n, [p]) for n, _ in linears)]
        if unused:
            raise ValueError(f"LoRA targets {unused} match no nn.Linear of the model; its linear layers are "
                             f"{[n for n, _ in linears][:12]}")
    if not chosen:
        raise ValueError("the model has no nn.Linear layer to adapt")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, linear in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(linear, rank, alpha, freeze_a))
    if also:
        named = dict(model.named_parameters())
        unused = [p for p in also if not any(_matches(n, [p]) for n in named)]
        if unused:
            raise ValueError(f"train_also {unused} match no parameter of the model")
        if freeze_a and any(_matches(n, also) for n in named if n.endswith("lora_A")):
            raise ValueError(f"freeze_a freezes every lora_A, but train_also {also} names one; drop it from "
                             "train_also, or set freeze_a false to train A")
        for n, p in named.items():
            if _matches(n, also):
                p.requires_grad_(True)
    return model


def lora_parameter_count(model: nn.Module) -> tuple[int, int]:
    """``(trainable, frozen)`` numbers of parameter elements of ``model``."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters()) - trainable


def lora_example_mlp(input_shape: Sequence[int], num_classes: int, rank: int = 2, alpha: float = 4.0) -> nn.Module:
    """``Flatten → Linear(∏ input_shape, 8) → Tanh → Linear(8, num_classes)`` with rank-``rank`` adapters on both
    linear layers and ``B ~ N(0, 0.1²)`` instead of 0, so a first round already trains ``A`` through ``B``: the
    small model an adapter algorithm's ``example_model`` gives the conformance kit (``check_algorithm``)."""
    width = math.prod(int(d) for d in input_shape)
    net = nn.Sequential(nn.Flatten(), nn.Linear(width, 8), nn.Tanh(), nn.Linear(8, num_classes))
    with torch.no_grad():
        add_lora(net, rank=rank, alpha=alpha)
        for module in net.modules():
            if isinstance(module, LoRALinear):
                module.lora_B.normal_(0.0, 0.1)
    return net


class LoRAModel(nn.Module):
    """``model`` with LoRA adapters (:func:`add_lora`), as a module built from arguments (configuration files).

    Args:
        model: the base model (in a config: ``{class_path: ..., init_args: ...}``).
        targets, rank, alpha, train_also, freeze_a: as :func:`add_lora` (``freeze_a: true``: FFA-LoRA).
        base_weights: a ``state_dict`` file of the base model (``torch.save(model.state_dict(), path)``), loaded
            (``weights_only``) before the adapters are added; ``None`` keeps the base's own initialisation.
    """

    def __init__(self, model: nn.Module, targets: Sequence[str] | str | None = None, rank: int = 8,
                 alpha: float = 16.0, train_also: Sequence[str] | str = (), base_weights: str | None = None,
                 freeze_a: bool = False) -> None:
        super().__init__()
        if base_weights is not None:
            model.load_state_dict(torch.load(base_weights, map_location="cpu", weights_only=True))
        self.model = add_lora(model, targets, rank, alpha, train_also, freeze_a)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)
