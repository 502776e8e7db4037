"""Pairwise-similarity regularised federated multi-task learning (``mtl_pairwise``).

Objective (the similarity-weighted penalty of federated MTL: Smith, Chiang, Sanjabi, Talwalkar,
"Federated Multi-Task Learning", NeurIPS 2017, for a fixed task relation; weighted per client as
Hanzely & Richtárik, arXiv:2002.05516, weight their penalty; when S is not given it is inferred from
the cosine similarity of client updates, the similarity measure of Clustered FL: Sattler, Müller,
Samek, IEEE TNNLS 2020):

    Φ(W) = Σ_k p_k [F_k(w_k) + (λ/2) Σ_j S_jk ‖w_k − w_j‖²],     S_jk ≥ 0,

over the TRAINING clients: p_k = ``client.weight`` (Σ_k p_k = 1; 0 for held-out clients), and S is
restricted to them (the rows and columns of held-out clients are set to 0: their models never train
and pull nobody). ``S_jk`` is the pull of client j on client k; the diagonal is ignored.

Client step: the exact partial gradient of Φ w.r.t. w_k divided by p_k. w_k appears in client k's own
penalty (weight p_k) and in every client j's penalty (weight p_j, entry S_kj), so

    (1/p_k) ∂Φ/∂w_k = ∇F_k(w_k) + λ Σ_j a_jk (w_k − w_j) = ∇F_k(w_k) + λ d_k (w_k − u_k),
    a_jk = S_jk + (p_j / p_k) S_kj,   d_k = Σ_j a_jk,   u_k = Σ_j a_jk w_j / d_k,

for any S, symmetric or not (symmetric S and uniform p: a_jk = 2 S_jk). A sampled client takes τ
steps ``w_k ← w_k − η (∇F_k(w_k; Dₜ) + λ d_k (w_k − u_k))`` from its stored w_k, the other clients'
models held at their values at the start of the round.

Clients that have not trained yet (``client.seen`` false) have no personal model: their w_k is read
as the mean w̄ (the global parameters) — as their own starting point, as a neighbour in u_j, and for
evaluation. The global parameters hold w̄ = Σ_{k seen} p_k w_k / Σ_{k seen} p_k, which equals
Σ_k p_k w_k over all training clients with that reading (see :mod:`lightning_fedmeta.algorithms.regularized`;
only the module's default ``SGD(lr=1)`` server step is allowed). A held-out (new) client has no
neighbours (S is zero on its row and column) and is evaluated with w̄ (then ``finetune_steps``
SGD steps, if any); a training client is evaluated with its w_k once it has trained.

S is either given (``similarity``) or, when not given, inferred after every round as the clipped
cosine similarity ``S_jk = max(0, cos(Δ_j, Δ_k))`` of the clients' most recent personal updates
Δ_j = w_j_new − w_j_start (kept server-side, ``[K, P]``). A client that has not trained yet has S = 0
to everyone, so round 0 is local training. With an inferred S each step is the block gradient of Φ
for the S of that round.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from lightning_fedmeta.algorithms.regularized import SimilarityRegularizedMTL

__all__ = ["MTLPairwise", "load_similarity"]


def load_similarity(similarity: list[list[float]] | str | Path | Tensor | np.ndarray) -> Tensor:
    """A ``[K, K]`` float64 similarity from a nested list, an array, or a ``.npy`` file path.

    Raises ``ValueError`` unless it is square, finite and non-negative.
    """
    if isinstance(similarity, str | Path):
        path = Path(similarity)
        if not path.is_file():
            raise ValueError(f"similarity file {str(path)!r} does not exist (expected a [K, K] .npy array)")
        similarity = np.load(path)
    s = torch.as_tensor(np.asarray(similarity, dtype=np.float64))
    if s.dim() != 2 or s.shape[0] != s.shape[1]:
        raise ValueError(f"similarity must be a square [K, K] matrix, got shape {tuple(s.shape)}")
    if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
        raise ValueError(f"similarity entries must be finite and >= 0, got min {float(s.min())!r}")
    return s


class MTLPairwise(SimilarityRegularizedMTL):
    """Personal models pulled towards their similarity-weighted neighbours.

    Args:
        lam: λ ≥ 0 of the objective in the module docstring. Stability needs ``λ d_k η < 1`` for every
            training client k, ``d_k = Σ_j (S_jk + (p_j / p_k) S_kj)`` (``2 Σ_j S_jk`` for symmetric S and
            uniform weights).
        similarity: S, a ``[K, K]`` nested list of non-negative numbers or the path of a ``.npy`` file
            (``S_jk`` is the pull of client j on client k; need not be symmetric; the diagonal and the
            rows and columns of held-out clients are ignored). ``None`` infers S every round from the
            clients' most recent updates (clipped cosine similarity).
        local_steps, local_lr, batch_size, finetune_steps, finetune_lr, finetune_batch_size: see
            :class:`~lightning_fedmeta.algorithms.base.Algorithm`.
    """

    step_budget = True
    name = "mtl_pairwise"
    summary = "Pairwise MTL: Σ p_k [F_k(w_k) + λ/2 Σ_j S_jk‖w_k − w_j‖²], S given or clipped cosine of updates"

    def __init__(
        self,
        lam: float = 0.1,
        similarity: list[list[float]] | str | None = None,
    ) -> None:
        super().__init__(lam)
        self.similarity = None if similarity is None else load_similarity(similarity)

    def fixed_similarity(self, num_clients: int) -> Tensor | None:
        if self.similarity is None:
            return None
        if self.similarity.shape[0] != num_clients:
            raise ValueError(
                f"similarity is {self.similarity.shape[0]}x{self.similarity.shape[0]} but the data has "
                f"{num_clients} clients; give a {num_clients}x{num_clients} matrix"
            )
        return self.similarity
