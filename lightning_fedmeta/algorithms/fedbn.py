"""FedBN: normalisation layers stay on the client (Li, Jiang, Zhang, Kamp, Dou, "FedBN: Federated Learning on
Non-IID Features via Local Batch Normalization", ICLR 2021, arXiv:2102.07623, Algorithm 1).

The parameters split into the normalisation layers' affine parameters π (BatchNorm, GroupNorm, LayerNorm,
InstanceNorm, RMSNorm: γ, β) and the rest θ. Client i, receiving θ only, trains both jointly from its own π_i:

    (θ_i, π_i)⁰ = (θ, π_i),   (θ_i, π_i)ᵗ = (θ_i, π_i)ᵗ⁻¹ − η ∇F_i((θ_i, π_i)ᵗ⁻¹; Dₜ),   t = 1..τ,

keeps π_i^τ (and its BatchNorm running statistics μ_i, σ²_i) and uploads Δθ_i = θ_i^τ − θ only. The server
averages θ as FedAvg does, θ ← θ + β Σ_{i∈S} p_i (θ_i^τ − θ); the normalisation parameters never travel, and a
client that has not trained starts from the initial π⁰, received once with the initial model
(see :mod:`~lightning_fedmeta.algorithms.personal_layers_common`). Client i is evaluated with
(θ, π_i) and its own running statistics. On a model without normalisation layers FedBN is FedAvg.

Which parameters are normalisation parameters: with ``norm_prefix`` (a prefix or a list), the names equal to a
prefix or starting with ``prefix + "."``; by default the parameters of every module whose parameters are all 1-D
and include a ``weight`` (a normalisation layer's γ and β), which the client checks against the model's module
types before its first step: a 1-D-only module that is not a normalisation layer (PReLU), or a normalisation
layer with a multi-dimensional γ (``LayerNorm((C, H, W))``), is refused with the names to pass as ``norm_prefix``.

Where we differ from the authors' code (github.com/med-air/FedBN, ``federated/fed_digits.py``):

* The authors keep every state-dict entry whose name contains ``bn`` local (affine parameters and running
  statistics); we find the normalisation layers by module type (names need not contain ``bn``, and GroupNorm /
  LayerNorm count). The running statistics are per-client state of the library's loop for every algorithm
  (``running_stats.py``), so FedBN adds only the affine parameters to it. (PFLlib's ``clientbn`` keeps only the
  parameters whose name contains ``bn``, and leaves the running statistics to the shared model.)
* Their server never updates its own normalisation parameters (they stay at the initialisation), and neither does
  ours: π⁰ is where a client that has not trained starts. (PFLlib's server averages them.) Because the aggregate
  averages θ only, robust rules, DP and upload compression refuse FedBN.
* They average with uniform weights over all clients every round (full participation); we use the round's
  weights p_i (``aggregation="samples"`` or ``"uniform"``) over the sampled clients.
* Their local work is ``wk_iters`` epochs of SGD (lr 1e-2, batch 32); ours is the round's batches
  (``local_steps`` steps of ``batch_size``, the library's convention).

New clients: a held-out client (or one not sampled yet) is evaluated with (θ, π⁰) and the model's running
statistics (the mean of the last round's clients'); ``finetune_steps > 0`` fits them to its own training data
(SGD on the whole model from there), which is how FedBN is meant to meet a new feature domain.

Common arguments: ``local_steps``, ``local_lr``, ``batch_size``: the joint SGD above, one step per batch;
``finetune_steps``, ``finetune_lr``, ``finetune_batch_size``: SGD on the whole model from (θ, π_i) before
evaluation (0 = evaluate (θ, π_i) itself). All are used.
"""

from __future__ import annotations

import math

from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from lightning_fedmeta.algorithms.personal_layers_common import PersonalLayers
from lightning_fedmeta.client.functional import ClientContext, Params

__all__ = ["FedBN", "NORM_LAYERS", "normalisation_parameters"]

#: the module types whose parameters are normalisation parameters (BatchNorm, InstanceNorm, SyncBatchNorm,
#: GroupNorm, LayerNorm, RMSNorm)
NORM_LAYERS: tuple[type[nn.Module], ...] = (_NormBase, nn.GroupNorm, nn.LayerNorm, nn.RMSNorm)


def normalisation_parameters(model: nn.Module) -> list[str]:
    """The names of the parameters of ``model``'s normalisation layers (:data:`NORM_LAYERS`)."""
    names = []
    for prefix, module in model.named_modules():
        if isinstance(module, NORM_LAYERS):
            names += [f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters(recurse=False)]
    return names


def _one_dimensional_layers(params: Params) -> list[str]:
    """Parameters of the modules whose parameters are all 1-D and include a ``weight`` (γ, β of a norm layer)."""
    owners: dict[str, list[str]] = {}
    for name in params:
        owners.setdefault(name.rpartition(".")[0], []).append(name)
    return [
        n for group in owners.values()
        if all(params[k].dim() == 1 for k in group) and any(k.rpartition(".")[2] == "weight" for k in group)
        for n in group
    ]


class FedBN(PersonalLayers):
    """FedAvg whose normalisation layers (affine parameters and running statistics) stay on the client.

    Args:
        norm_prefix: parameter-name prefix(es) of the local normalisation parameters; ``None``: the parameters of
            the model's normalisation layers (see the module docstring).
        local_steps, local_lr, batch_size, finetune_steps, finetune_lr, finetune_batch_size: see
            :class:`~lightning_fedmeta.algorithms.base.Algorithm`.
    """

    name = "fedbn"
    summary = "FedBN: FedAvg with the normalisation layers kept local (Li et al., ICLR 2021)"

    def __init__(self, norm_prefix: str | list[str] | None = None) -> None:
        super().__init__()
        if norm_prefix is not None and not (
            isinstance(norm_prefix, str) or all(isinstance(p, str) for p in norm_prefix)
        ):
            raise ValueError(f"norm_prefix must be a string, a list of strings or None, got {norm_prefix!r}")
        self.norm_prefix = norm_prefix

    @classmethod
    def example_model(cls, input_shape: tuple[int, ...], num_classes: int) -> nn.Module | None:
        """``Flatten → Linear(·, 8) → BatchNorm1d(8) → Tanh → Linear(8, num_classes)``: FedBN is about the
        normalisation layers, so :func:`~lightning_fedmeta.testing.check_algorithm` runs it on one."""
        width = math.prod(input_shape)
        return nn.Sequential(nn.Flatten(), nn.Linear(width, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, num_classes))

    def personal_names(self, params: Params) -> list[str]:
        """The normalisation parameters: by ``norm_prefix``, else the 1-D-only modules with a ``weight``."""
        if self.norm_prefix is None:
            return _one_dimensional_layers(params)
        prefixes = [self.norm_prefix] if isinstance(self.norm_prefix, str) else list(self.norm_prefix)
        prefixes = [p.rstrip(".") for p in prefixes]
        names = [n for n in params if any(n == p or n.startswith(p + ".") for p in prefixes)]
        if not names:
            raise ValueError(f"norm_prefix {self.norm_prefix!r} matches no parameter; parameters are {list(params)}")
        return names

    def check_model(self, ctx: ClientContext, params: Params) -> None:
        """Without ``norm_prefix``: refuse a model whose normalisation layers are not what the shapes say."""
        if self.norm_prefix is not None:
            return
        found = sorted(self.personal_names(params))
        actual = sorted(n for n in normalisation_parameters(ctx.model) if n in params)
        if found != actual:
            raise ValueError(
                f"fedbn: the model's normalisation layers hold the parameters {actual}, but by their shapes (1-D "
                f"modules with a weight) FedBN would keep {found} local; pass norm_prefix with the prefixes of the "
                "parameters to keep local (e.g. the normalisation layers' module names)"
            )
