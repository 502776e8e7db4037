"""LG-FedAvg: local representations, global top layers (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov,
Morency, "Think Locally, Act Globally: Federated Learning with Local and Global Representations", arXiv:2001.01523,
2020, Algorithm 1).

The parameters split into global top layers θ (by default the last layer; ``global_prefix``) and local lower layers
π_i, client i's representation. Client i, receiving θ only, trains both jointly from its own π_i:

    (θ_i, π_i)⁰ = (θ, π_i),   (θ_i, π_i)ᵗ = (θ_i, π_i)ᵗ⁻¹ − η ∇F_i((θ_i, π_i)ᵗ⁻¹; Dₜ),   t = 1..τ,

keeps π_i^τ and uploads Δθ_i = θ_i^τ − θ only. The server averages the global layers,
θ ← θ + β Σ_{i∈S} p_i (θ_i^τ − θ); the local layers never travel (a client that has not trained starts from the
initial π⁰, received once with the initial model). This is
FedPer (:mod:`~lightning_fedmeta.algorithms.shared_representation`) with the split reversed: FedPer shares the body
and keeps the head, LG-FedAvg keeps the body and shares the head (tested: the two agree when their personal parts
are the same layers). The client is :class:`~lightning_fedmeta.algorithms.personal_layers_common.PersonalLayers`.

Where we differ from the authors' code (github.com/pliang279/LG-FedAvg, ``main_lg.py``):

* They start every client from a FedAvg-trained model (``--load_fed``, required) and then run LG-FedAvg; we start
  from the module's model. Train FedAvg first and start this run from its checkpoint to follow them.
* Each round they keep, per client, the local model with the best *test* accuracy so far and report those; we
  evaluate the current models (no model selection on test data).
* Uniform weights 1/m over the m sampled clients; we use the round's p_i (``aggregation``).
* The aggregate averages θ only, so robust rules, DP and upload compression refuse LG-FedAvg.
* Local work: ``local_ep`` epochs of SGD with momentum 0.5; ours is the round's batches with plain SGD.
* Global layers: their ``num_layers_keep`` top layers of the model's ``weight_keys`` list; ours are named by
  ``global_prefix`` (default: the last layer, their default ``num_layers_keep = 1``; the Fashion-MNIST config
  keeps the last two of three, as their MNIST script keeps 3 of 5). PFLlib's ``clientlg`` does the same with the
  model's ``head``.

New clients: a held-out client (or one not sampled yet) is evaluated with (θ, π⁰): the global layers on the
initial representation (the authors test new devices with the average of the local models, or their ensemble,
which would need every π_i on the server; neither is built); ``finetune_steps > 0`` fits the whole model
to its own training data first.

Common arguments: ``local_steps``, ``local_lr``, ``batch_size``: the joint SGD above, one step per batch;
``finetune_steps``, ``finetune_lr``, ``finetune_batch_size``: SGD on the whole model from (θ, π_i) before
evaluation (0 = evaluate (θ, π_i) itself). All are used.
"""

from __future__ import annotations

from lightning_fedmeta.algorithms.heads import head_names
from lightning_fedmeta.algorithms.personal_layers_common import PersonalLayers
from lightning_fedmeta.client.functional import Params

__all__ = ["LGFedAvg"]


class LGFedAvg(PersonalLayers):
    """LG-FedAvg: local lower layers (the representation), global top layers averaged by the server.

    Args:
        global_prefix: parameter-name prefix(es) of the global layers (a name equal to a prefix or starting with
            ``prefix + "."``); ``None``: the last layer (the module owning the last parameter). Every other
            parameter is local.
        local_steps, local_lr, batch_size, finetune_steps, finetune_lr, finetune_batch_size: see
            :class:`~lightning_fedmeta.algorithms.base.Algorithm`.
    """

    name = "lg_fedavg"
    summary = "LG-FedAvg: local representation layers, global top layers averaged (Liang et al., 2020)"

    def __init__(self, global_prefix: str | list[str] | None = None) -> None:
        super().__init__()
        if global_prefix is not None and not (
            isinstance(global_prefix, str) or all(isinstance(p, str) for p in global_prefix)
        ):
            raise ValueError(f"global_prefix must be a string, a list of strings or None, got {global_prefix!r}")
        self.global_prefix = global_prefix

    def personal_names(self, params: Params) -> list[str]:
        """Every parameter outside the global layers (:func:`head_names` of ``global_prefix``)."""
        try:
            shared = set(head_names(list(params), self.global_prefix))
        except ValueError as err:
            raise ValueError(
                f"lg_fedavg: global_prefix {self.global_prefix!r} does not leave both global and local layers "
                f"({err}); name the top layers to share, e.g. global_prefix: [net.5]"
            ) from None
        return [n for n in params if n not in shared]
