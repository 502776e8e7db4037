"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, MLSys 2020, Algorithm 2).

Client i approximately minimises the proximal objective
    h_i(v; w) = f_i(v) + (μ/2) ‖v − w‖²
by τ SGD steps from v⁰ = w:  vᵗ = vᵗ⁻¹ − η (∇f_i(vᵗ⁻¹; Dₜ) + μ (vᵗ⁻¹ − w)),
and uploads Δ_i = v^τ − w; the server averages as FedAvg.  μ = 0 is FedAvg exactly.
"""

from __future__ import annotations

from torch import Tensor

from lightning_fedmeta.algorithms.base import Algorithm, ClientOutput, ClientRecord, check_non_negative
from lightning_fedmeta.algorithms.local_steps import prox_sgd
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_sub

__all__ = ["FedProx"]


class FedProx(Algorithm):
    """FedAvg with a proximal term ``μ/2 ‖v − w‖²`` in every client's local objective.

    Args:
        mu: proximal coefficient μ ≥ 0 (the paper tunes μ ∈ {0.001, 0.01, 0.1, 1}; default 0.01).
        **kwargs: see :class:`~lightning_fedmeta.algorithms.base.Algorithm`.
    """

    name = "fedprox"
    step_budget = True
    summary = "FedProx: local SGD on f_i(v) + μ/2‖v − w‖² (Li et al., 2020)"

    def __init__(
        self,
        mu: float = 0.01,
    ) -> None:
        super().__init__()
        check_non_negative("mu", mu)
        self.mu = mu

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        v, loss = prox_sgd(ctx, params, batches, self.local_lr, self.mu, params)
        return ClientOutput(tree_sub(v, params), state, {}, {"loss": loss})
