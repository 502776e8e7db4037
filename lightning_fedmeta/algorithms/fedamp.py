"""FedAMP: federated attentive message passing (``fedamp``).

Huang, Chu, Zhou, Wang, Liu, Pei, Zhang, "Personalized Cross-Silo Federated Learning on Non-IID Data",
AAAI 2021, arXiv:2007.03797 (eqs. 3-7, Algorithm 1). Objective over the personal models W = (w_1..w_K):

    G(W) = Σ_k F_k(w_k) + λ Σ_{j<k} A(‖w_k − w_j‖²),     A(x) = 1 − exp(−x/σ),   A'(x) = exp(−x/σ)/σ.

Round (incremental proximal optimisation, fixed step α = ``alpha_k``): the server passes messages,
one gradient step on the attention term from the stored models, giving each sampled client k its
"cloud model"

    u_k = (1 − Σ_{j≠k} ξ_kj) w_k + Σ_{j≠k} ξ_kj w_j,      ξ_kj = α A'(‖w_k − w_j‖²),

and client k approximately solves the proximal problem ``min_w F_k(w) + λ/(2α) ‖w − u_k‖²`` with τ
steps ``w ← w − η (∇F_k(w; Dₜ) + (λ/α)(w − u_k))`` from its stored w_k.

Relation to ``mtl_pairwise`` (:mod:`lightning_fedmeta.algorithms.mtl_pairwise`). With a linear A
(A(x) = x/σ) G is mtl_pairwise's objective Φ with uniform S_jk = 1/σ (up to the weights p_k and a
factor 2 in λ); FedAMP's saturating A re-weights each pair by A'(‖w_k − w_j‖²) every round, which is
mtl_pairwise's quadratic penalty with S_jk = A'(‖w_k − w_j‖²) taken at the current models (a
majorise-minimise step of the concave A). Same family, different step: mtl_pairwise takes exact
partial-gradient steps of Φ, FedAMP a gradient step on the penalty at the server then a proximal
solve at the client. The code that is the same is shared: FedAMP subclasses
:class:`~lightning_fedmeta.algorithms.regularized.SimilarityRegularizedMTL` (personal models in the
client store, the server copy of every client's model, unseen clients read as the mean w̄, exact
tracking of w̄ = Σ_k p_k w_k in the global parameters) and replaces only the proximal coefficient and
centre (:meth:`FedAMP.prox_terms`).

Where we differ from the authors' code. The authors released no code; the reference
implementation is PFLlib's (system/flcore/{servers/serveramp.py, clients/clientamp.py}).
* PFLlib builds ξ only from the models uploaded in the previous round; we use every training client
  that has trained (the server's copy of its latest model), as the paper's full-participation
  Algorithm 1 does; with partial participation the neighbours' models may be several rounds old.
* PFLlib's client penalty is ``0.5 λ/α ‖w − u‖`` (the norm, not its square) built from ``.data``, so
  it carries no gradient and its client is plain local training; we follow the paper's
  ``λ/(2α)‖w − u‖²`` with its gradient.
* As PFLlib, the client starts from its own stored w_k (the paper's argmin has no start).
* A fixed α (the paper allows a schedule α_k). The paper's heuristic variant (HeurFedAMP: cosine
  similarity with a self-attention weight) is not implemented.
* Neighbours are the training clients that have trained (``seen``); a client that has not has no
  model on the server and sends no message. In a client's first round its u_k is its own start w̄
  unless neighbours have trained.

New clients. A held-out client has no personal model and no neighbours (weight 0): it is evaluated
with the mean w̄ (the global parameters), then ``finetune_steps`` SGD steps if asked, as in
``mtl_pairwise``. A training client is evaluated with its w_k once it has trained.

Common arguments. ``local_steps`` (τ, from the batches' leading axis), ``local_lr`` (η) and
``batch_size`` drive the proximal client steps; ``finetune_*`` fine-tune the evaluated model. The
module's default server step SGD(lr=1) is required (exact mean tracking; ``server_optimizer_applies``
is False).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_fedmeta.algorithms.base import ClientRecord, check_positive
from lightning_fedmeta.algorithms.regularized import MODELS, SEEN, WEIGHTS, SimilarityRegularizedMTL
from lightning_fedmeta.client.functional import Params

__all__ = ["FedAMP", "attention_weights"]


def attention_weights(models: Params, own: Params, usable: Tensor, alpha: float, sigma: float) -> Tensor:
    """``ξ_j = α A'(‖w − w_j‖²) = α exp(−‖w − w_j‖²/σ)/σ`` for every stored model ``w_j`` (rows of
    ``models``), 0 where ``usable`` is false (``[K]`` bool: itself, untrained or held-out clients)."""
    sq = sum(((m - own[n].unsqueeze(0)) ** 2).reshape(m.shape[0], -1).sum(1) for n, m in models.items())
    xi = alpha * torch.exp(-sq / sigma) / sigma
    return torch.where(usable, xi, torch.zeros_like(xi))


class FedAMP(SimilarityRegularizedMTL):
    """Personal models, each pulled towards its attention-weighted cloud model ``u_k``.

    Args:
        lam: λ ≥ 0, weight of the attention term (0: local training).
        alpha_k: α > 0, the server's message-passing step; the client's proximal coefficient is λ/α.
            The self weight ``1 − Σ_j ξ_kj`` stays ≥ 0 when ``α (K − 1) ≤ σ``.
        sigma: σ > 0, scale of ``A(x) = 1 − exp(−x/σ)`` (in squared parameter distance).
        local_steps, local_lr, batch_size, finetune_steps, finetune_lr, finetune_batch_size: see
            :class:`~lightning_fedmeta.algorithms.base.Algorithm`.
    """

    step_budget = True
    name = "fedamp"
    summary = "FedAMP: personal w_k, prox towards u_k = Σ_j ξ_kj w_j, ξ = α exp(−‖w_k−w_j‖²/σ)/σ (Huang et al., 2021)"

    def __init__(
        self,
        lam: float = 1.0,
        alpha_k: float = 1.0,
        sigma: float = 1.0,
    ) -> None:
        super().__init__(lam)
        check_positive("alpha_k", alpha_k)
        check_positive("sigma", sigma)
        self.alpha_k = alpha_k
        self.sigma = sigma

    def fixed_similarity(self, num_clients: int) -> Tensor | None:
        """No fixed similarity: FedAMP's weights are recomputed from the models in every client step
        (:meth:`prox_terms`); the inherited ``similarity`` matrix stays zero and unused."""
        return torch.zeros(num_clients, num_clients, dtype=torch.float64)

    def download(self, params: Params, server_state: dict[str, Tensor], client: ClientRecord) -> dict[str, Any]:
        """w̄, u_k and c_k = λ/α (2d + 1 floats), u_k formed by the server from its copies of the models (its copy
        of w_k is the personal model the client uploaded last, equal to the one the client keeps)."""
        row = client.index.clamp(0, server_state[SEEN].shape[0] - 1)
        copy = {"personal": {n: m[row] for n, m in server_state[MODELS].items()}}
        coef, centre = self.prox_terms(params, copy, server_state, client)
        return {"params": dict(params), "centre": centre, "coef": torch.as_tensor(coef)}

    def prox_terms(
        self, params: Params, state: dict[str, Tensor], server_state: dict[str, Tensor], client: ClientRecord
    ) -> tuple[float | Tensor, Params]:
        """``c_k = λ/α`` and ``u_k = (1 − Σ_j ξ_kj) w_k + Σ_j ξ_kj w_j`` over the other training clients
        that have trained (their server copies), ``w_k`` the client's start."""
        own = self.personal_start(params, state, server_state, client)
        models = server_state[MODELS]
        num = server_state[SEEN].shape[0]
        others = torch.arange(num, device=server_state[SEEN].device) != client.index
        usable = (server_state[SEEN] > 0) & (server_state[WEIGHTS] > 0) & others
        xi = attention_weights(models, own, usable, self.alpha_k, self.sigma)
        self_weight = 1.0 - xi.sum()
        centre = {
            n: self_weight.to(own[n].dtype) * own[n]
            + (xi.to(m.dtype).reshape(-1, *([1] * (m.dim() - 1))) * m).sum(0)
            for n, m in models.items()
        }
        return self.lam / self.alpha_k, centre
