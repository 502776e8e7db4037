"""FedSA-LoRA: LoRA's ``A`` matrices shared and averaged, its ``B`` matrices personal (Guo, Zeng, Wang, Fan, Wang, Qu,
"Selective Aggregation for Low-Rank Adaptation in Federated Learning", ICLR 2025; code:
github.com/Pengxin-Guo/FedSA-LoRA).

On a LoRA'd model (:func:`~lightning_fedmeta.models.lora.add_lora`: ``W x + (α/r) B A x`` with the base ``W``
frozen), client i keeps its own ``B_i`` (every ``lora_B``; ``personal`` names more) and receives the global ``A``.
From ``(A, B_i)`` it trains both jointly, τ SGD steps, one per batch:

    (A_i, B_i)⁰ = (A, B_i),   (A_i, B_i)ᵗ = (A_i, B_i)ᵗ⁻¹ − η ∇F_i((A_i, B_i)ᵗ⁻¹; Dₜ),   t = 1..τ,

keeps ``B_i^τ`` and uploads ``ΔA_i = A_i^τ − A`` only. The server averages the ``A`` matrices as FedAvg does,
``A ← A + β Σ_{i∈S} p_i ΔA_i`` (``p_i ∝ n_i`` under ``aggregation: samples``, the authors' FederatedScope default);
``B`` never travels. Client i's personalised model is ``(W, A, B_i)``: the global ``A`` with its own ``B``, as in
the authors' code (FederatedScope's ``personalization.local_param``: the client keeps its local parameters when it
loads the global model, and is evaluated on its own test split). This is
:class:`~lightning_fedmeta.algorithms.personal_layers_common.PersonalLayers` with the personal part chosen by name.

``B`` starts at 0 (LoRA's initialisation), so a client that has not trained (not sampled yet, or held out) uses
``(W, A, B⁰ = 0)``: the base model itself, whatever ``A`` is; the paper does not treat new clients. Give
``finetune_steps > 0`` to fit its ``A`` and ``B`` to its own data before evaluation.

Where we differ from the authors' code:

* Their GLUE runs also keep the classification head local (``local_param: ['lora_B', 'classifier']``; their LLM runs
  ``['lora_B']``): name it in ``personal`` (``personal: [lora_B, classifier]``), with the head trainable
  (``add_lora(..., train_also=["classifier.*"])``).
* Local work: FederatedScope's ``local_update_steps`` batches of SGD (lr 0.02 on GLUE, 0.005 on GSM8K); ours is the
  round's batches with plain SGD (``local_steps``, ``local_lr``). Their LoRA has dropout 0.05; ours none.
* Because the aggregate averages ``A`` only, robust rules, DP and upload compression refuse FedSA-LoRA (as every
  personal-layers algorithm).

FFA-LoRA, the other rule of issue 40 (``A`` frozen, ``B`` trained and averaged), is not an algorithm but a model
option, ``add_lora(..., freeze_a=True)`` / ``LoRAModel(freeze_a=true)``, run under ``fedavg``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

from lightning_fedmeta.algorithms.personal_layers_common import PersonalLayers
from lightning_fedmeta.client.functional import Params
from lightning_fedmeta.models.lora import lora_example_mlp

__all__ = ["FedSALoRA", "personal_parameter_names"]


def personal_parameter_names(names: Sequence[str], patterns: Sequence[str]) -> list[str]:
    """The names among ``names`` that a pattern picks: a pattern equal to one dotted component of the name
    (``lora_B`` picks ``blocks.0.attn.qkv.lora_B``, ``classifier`` picks ``classifier.weight``), or matching the
    whole name as a shell pattern (``head.*``)."""
    return [n for n in names if any(p in n.split(".") or fnmatch.fnmatchcase(n, p) for p in patterns)]


class FedSALoRA(PersonalLayers):
    """FedSA-LoRA: ``lora_A`` shared and averaged, ``lora_B`` personal (module docstring).

    Args:
        personal: the personal parameters, by name (:func:`personal_parameter_names`); default ``lora_B``, the
            paper's rule. Every other trainable parameter (every ``lora_A``, and any ``train_also`` parameter not
            named here) is shared and averaged.
        local_steps, local_lr, batch_size, finetune_steps, finetune_lr, finetune_batch_size: see
            :class:`~lightning_fedmeta.algorithms.base.Algorithm`.
    """

    name = "fedsa_lora"
    summary = "FedSA-LoRA: LoRA A matrices shared and averaged, B matrices personal (Guo et al., ICLR 2025)"

    def __init__(self, personal: str | list[str] = "lora_B") -> None:
        super().__init__()
        patterns = [personal] if isinstance(personal, str) else personal
        if not isinstance(patterns, Sequence) or not patterns or not all(
                isinstance(p, str) and p for p in patterns):
            raise ValueError(f"fedsa_lora: personal must be a parameter name pattern or a non-empty list of them, "
                             f"got {personal!r}")
        self.personal = list(patterns)

    def personal_names(self, params: Params) -> list[str]:
        """The parameters named by ``personal`` (default: every ``lora_B``); refuses a model where they are none or
        all of the trainable parameters (nothing would be personal, or nothing shared)."""
        names = list(params)
        picked = personal_parameter_names(names, self.personal)
        if not picked:
            raise ValueError(f"fedsa_lora: personal {self.personal} names no trainable parameter of the model "
                             f"(its trainable parameters are {names[:12]}); FedSA-LoRA needs a LoRA'd model: "
                             "add_lora(model, targets) or lightning_fedmeta.models.LoRAModel")
        if len(picked) == len(names):
            raise ValueError(f"fedsa_lora: personal {self.personal} names every trainable parameter, leaving no "
                             "shared lora_A to average")
        return picked

    @classmethod
    def example_model(cls, input_shape: tuple[int, ...], num_classes: int) -> nn.Module | None:
        """A small MLP with rank-2 LoRA adapters on both linear layers (:func:`~lightning_fedmeta.models.lora.
        lora_example_mlp`)."""
        return lora_example_mlp(input_shape, num_classes)
