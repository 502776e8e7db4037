"""Federated Reptile (Nichol, Achiam, Schulman, "On First-Order Meta-Learning Algorithms", 2018;
federated form: Jiang, Konečný, Rush, Kannan, "Improving Federated Learning Personalization via
Model Agnostic Meta Learning", 2019).

Client i, from the global (meta) model w:   w_i⁰ = w,
    w_iᵗ = w_iᵗ⁻¹ − α ∇f_i(w_iᵗ⁻¹; Dₜ),   t = 1..τ,
and uploads Δ_i = w_i^τ − w.  Server (Reptile's outer step):
    w ← w + β_server Σ_{i∈S} p_i Δ_i,
with β_server the module's ``server_lr`` (default 1) and p_i from the module's ``aggregation``.
The client computation is FedAvg's; what makes it meta-learning is the evaluation: every
client is evaluated after ``finetune_steps`` SGD steps at rate α from w on its own training data.
"""

from __future__ import annotations

from torch import Tensor

from lightning_fedmeta.algorithms.base import Algorithm, ClientOutput, ClientRecord, check_non_negative
from lightning_fedmeta.algorithms.fedmaml import META_FINETUNE_DEFAULTS
from lightning_fedmeta.algorithms.local_steps import local_sgd
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_sub

__all__ = ["Reptile"]


class Reptile(Algorithm):
    """Federated Reptile: τ inner SGD steps at rate α, server moves towards the mean adapted model.

    The server step size β_server is the :class:`~lightning_fedmeta.FederatedModule`'s
    ``server_lr`` (``1`` averages the clients' adapted models, i.e. FedAvg).

    Args:
        alpha: α, the inner (client) learning rate, ``>= 0``.
        local_steps: τ, inner SGD steps per round.
        batch_size: inner mini-batch size (``None`` = full batch).
        finetune_steps: SGD steps from w before a client is evaluated (default 1).
        finetune_lr: rate of those steps (default α).
        finetune_batch_size: batch size of those steps (``None`` = the client's whole training set).

    The common argument ``local_lr`` is refused (``unused_args``): the inner rate is ``alpha``.
    """

    name = "reptile"
    step_budget = True
    summary = "Reptile: τ inner SGD steps, server moves w towards the clients' adapted models (Nichol et al., 2018)"
    unused_args = {"local_lr": "Reptile's inner (local) learning rate is alpha"}

    common_defaults = META_FINETUNE_DEFAULTS

    def __init__(self, alpha: float = 0.01) -> None:
        check_non_negative("alpha", alpha)
        super().__init__(local_lr=alpha)  # finetune_lr=None (its default) follows it: alpha
        self.alpha = alpha

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        w, loss = local_sgd(ctx, params, batches, self.alpha)
        return ClientOutput(tree_sub(w, params), state, {}, {"loss": loss})
