"""Mean-regularised federated multi-task learning (``mtl_mean``).

Objective (Hanzely & Richtárik, "Federated Learning of a Mixture of Global and Local Models",
arXiv:2002.05516, 2020, eq. (2) ``min F(x) + λψ(x)``, ``F = (1/n) Σ f_i(x_i)``, ``ψ = (1/2n) Σ ‖x_i − x̄‖²``,
with the uniform weights 1/n replaced by the client weights p_k; the penalty of Evgeniou & Pontil's
mean-regularised MTL, KDD 2004):

    Φ(W) = Σ_k p_k [F_k(w_k) + (λ/2) ‖w_k − w̄‖²],     w̄ = Σ_k p_k w_k,

over the TRAINING clients: p_k = ``client.weight`` (∝ n_k, or uniform, by the module's ``aggregation``;
Σ_k p_k = 1), held-out clients have p_k = 0 and are not part of Φ. For p_k = 1/n it is eq. (2) exactly.

Client step. Φ depends on w_k also through w̄, but that dependence contributes nothing:
``∂/∂w_k Σ_j p_j ‖w_j − w̄‖² = 2 p_k (w_k − w̄) − 2 p_k Σ_j p_j (w_j − w̄) = 2 p_k (w_k − w̄)`` since
Σ_j p_j (w_j − w̄) = 0. So the exact partial gradient is ``∂Φ/∂w_k = p_k (∇F_k(w_k) + λ (w_k − w̄))``
and every local step of a sampled client is that gradient divided by p_k (the other clients'
models and w̄ fixed during the round):

    w_k ← w_k − η (∇F_k(w_k; Dₜ) + λ (w_k − w̄)),      w̄ = the global parameters received this round.

τ such steps from the stored w_k; a client that has not trained yet (``client.seen`` false) starts
from w̄. It stores the result and uploads ``w_k_new − w_k_start``.

Mean. The global parameters are w̄ = Σ_{k seen} p_k w_k / Σ_{k seen} p_k (the initial model before any
client has trained): an unseen client's w_k is read as w̄, and then w̄ = Σ_k p_k w_k over all training
clients exactly. The server keeps P = Σ_{seen} p_k and adds Δ = Σ_{k∈S} p_k (w_k_new − w_k_start) / P'
(see :mod:`lightning_fedmeta.algorithms.regularized`; only the module's default ``SGD(lr=1)`` server
step is allowed). λ = 0 gives independent local training; λ → ∞ forces one shared model.

Evaluation: a client that has trained uses its personal model w_k; a client that has not — a
training client never sampled yet, a held-out (new) client, a client outside the federation —
uses the mean w̄ (then ``finetune_steps`` SGD steps, if any).
"""

from __future__ import annotations

from torch import Tensor

from lightning_fedmeta.algorithms.base import ClientRecord
from lightning_fedmeta.algorithms.regularized import RegularizedMTL
from lightning_fedmeta.client.functional import Params

__all__ = ["MTLMean"]


class MTLMean(RegularizedMTL):
    """Personal models pulled towards their p-weighted mean (the global parameters).

    Args:
        lam: λ ≥ 0 of the objective in the module docstring (Hanzely & Richtárik's λ). The local step
            contracts ``w_k − w̄`` by ``1 − λη``: stability needs ``λη < 1``.
        local_steps: τ, local steps per round on the personal model.
        local_lr: η.
        batch_size, finetune_steps, finetune_lr, finetune_batch_size: see
            :class:`~lightning_fedmeta.algorithms.base.Algorithm`.

    The module's server step must stay the default ``SGD(lr=1)`` (enforced): it is then the exact
    update of the mean w̄.
    """

    step_budget = True
    name = "mtl_mean"
    summary = "Mean-regularised MTL: Σ p_k [F_k(w_k) + λ/2‖w_k − w̄‖²], w̄ = Σ p_k w_k (Hanzely & Richtárik)"

    def prox_terms(
        self, params: Params, state: dict[str, Tensor], server_state: dict[str, Tensor], client: ClientRecord
    ) -> tuple[float | Tensor, Params]:
        """``c_k = λ`` and ``u_k = w̄`` (the global parameters): ``(1/p_k) ∂Φ/∂w_k = ∇F_k + λ (w_k − w̄)``."""
        return self.lam, params
