"""FedAvg (McMahan, Moore, Ramage, Hampson, Agüera y Arcas, AISTATS 2017, Algorithm 1).

Client i, starting from the global model w:   w_i⁰ = w,
    w_iᵗ = w_iᵗ⁻¹ − η ∇f_i(w_iᵗ⁻¹; Dₜ),   t = 1..τ,
and uploads Δ_i = w_i^τ − w.  Server:  w ← w + β Σ_{i∈S} p_i Δ_i  (β = server learning rate;
p_i ∝ n_i or uniform).  With ``finetune_steps = k > 0`` each client is evaluated after k SGD
steps from w on its own training data: the FedAvg + fine-tune (FedAvg+FT) baseline.
"""

from __future__ import annotations

from torch import Tensor

from lightning_fedmeta.algorithms.base import Algorithm, ClientOutput, ClientRecord
from lightning_fedmeta.algorithms.local_steps import local_sgd
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_sub

__all__ = ["FedAvg"]


class FedAvg(Algorithm):
    """Federated averaging of locally SGD-trained models (optionally evaluated after fine-tuning)."""

    name = "fedavg"
    step_budget = True
    summary = "FedAvg: average of τ-step local SGD models (McMahan et al., 2017); +FT via finetune_steps"

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        w, loss = local_sgd(ctx, params, batches, self.local_lr)
        return ClientOutput(tree_sub(w, params), state, {}, {"loss": loss})
