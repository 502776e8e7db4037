"""Graph-regularised federated multi-task learning (``mtl_graph``).

A client graph of symmetric adjacency A (A_jk = A_kj ≥ 0; graph Laplacian regularisation of multi-task
learning: Evgeniou, Micchelli, Pontil, JMLR 2005; in federated form: Smith et al., NeurIPS 2017;
Dinh et al., FedU, 2021; weighted per client as Hanzely & Richtárik, arXiv:2002.05516, weight their
penalty). Objective:

    Φ(W) = Σ_k p_k [F_k(w_k) + (λ/2) Σ_j A_jk ‖w_k − w_j‖²],

over the TRAINING clients: p_k = ``client.weight`` (Σ_k p_k = 1; 0 for held-out clients), and A is
restricted to them (edges that touch a held-out client are dropped; the kNN graph is built among
the training clients only). Each edge {j, k} thus enters with weight (p_j + p_k) A_jk. This is the
``mtl_pairwise`` objective with S = A, and the client step is the same: the exact partial gradient
of Φ w.r.t. w_k divided by p_k,

    (1/p_k) ∂Φ/∂w_k = ∇F_k(w_k) + λ Σ_j (1 + p_j / p_k) A_jk (w_k − w_j) = ∇F_k(w_k) + λ d_k (w_k − u_k),
    d_k = Σ_j (1 + p_j / p_k) A_jk,   u_k = Σ_j (1 + p_j / p_k) A_jk w_j / d_k,

τ steps ``w_k ← w_k − η (∇F_k(w_k; Dₜ) + λ d_k (w_k − u_k))`` from the stored w_k, the neighbours'
models held at their values at the start of the round. For uniform weights the pull is
``2λ Σ_j A_jk (w_k − w_j) = 2λ (L W)_k`` with the Laplacian L = D − A.

Clients that have not trained yet (``client.seen`` false) have no personal model: their w_k is read
as the mean w̄ (the global parameters) — as their own starting point, as a neighbour, and for
evaluation. The global parameters hold w̄ = Σ_{k seen} p_k w_k / Σ_{k seen} p_k, which equals
Σ_k p_k w_k over all training clients with that reading (see :mod:`lightning_fedmeta.algorithms.regularized`;
only the module's default ``SGD(lr=1)`` server step is allowed). A held-out (new) client has no
neighbours and is evaluated with w̄ (then ``finetune_steps`` SGD steps, if any); a training client
is evaluated with its w_k once it has trained.

The graph is given as an edge list (``edges``) or built as the symmetric k-nearest-neighbour graph of
the training clients' label histograms (``knn``; the loop passes them to :meth:`MTLGraph.bind_clients`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_fedmeta.algorithms.base import ClientRecord
from lightning_fedmeta.algorithms.regularized import SimilarityRegularizedMTL

__all__ = ["MTLGraph", "adjacency_from_edges", "knn_adjacency", "laplacian"]


def adjacency_from_edges(edges: Sequence[Sequence[float]], num_clients: int) -> Tensor:
    """Symmetric ``[K, K]`` float64 adjacency from ``[j, k]`` (weight 1) or ``[j, k, weight]`` entries.

    Repeated edges add their weights; self-loops are ignored later (they do not change ``tr(Wᵀ L W)``).
    """
    s = torch.zeros(num_clients, num_clients, dtype=torch.float64)
    for e in edges:
        j, k = int(e[0]), int(e[1])
        weight = float(e[2]) if len(e) == 3 else 1.0
        if not (0 <= j < num_clients and 0 <= k < num_clients):
            raise ValueError(f"edges: edge {list(e)} names a client outside 0..{num_clients - 1}")
        s[j, k] += weight
        if j != k:
            s[k, j] += weight
    return s


def knn_adjacency(features: Tensor, k: int, include: Tensor | None = None) -> Tensor:
    """Symmetric k-nearest-neighbour graph (weight 1) of the rows of ``features [K, F]``.

    Rows are normalised to sum 1 (histograms become distributions); the k nearest other rows in
    Euclidean distance are neighbours (ties: lower index first); an edge exists if either end chose it.
    ``include`` (``[K]`` bool, default all) restricts the graph to those clients: the others get no
    edges and are nobody's neighbour (held-out clients).
    """
    num = features.shape[0]
    keep = torch.ones(num, dtype=torch.bool) if include is None else include.to(torch.bool).cpu()
    members = keep.nonzero().flatten()
    m = int(members.numel())
    if not 1 <= k < m:
        held = f" ({num - m} held out)" if m < num else ""
        raise ValueError(f"knn must be in [1, {m - 1}] for {m} training clients{held}, got {k!r}")
    f = features.to(torch.float64)[members]
    f = f / f.sum(1, keepdim=True).clamp_min(1.0)
    dist = torch.cdist(f, f)
    dist.fill_diagonal_(float("inf"))
    order = torch.sort(dist, dim=1, stable=True).indices[:, :k]
    sub = torch.zeros(m, m, dtype=torch.float64)
    sub.scatter_(1, order, 1.0)
    s = torch.zeros(num, num, dtype=torch.float64)
    s[members.unsqueeze(1), members.unsqueeze(0)] = torch.maximum(sub, sub.T)
    return s


def laplacian(adjacency: Tensor) -> Tensor:
    """``L = D − S`` with ``D = diag(Σ_j S_jk)``."""
    return torch.diag(adjacency.sum(0)) - adjacency


class MTLGraph(SimilarityRegularizedMTL):
    """Personal models smoothed over a client graph (Laplacian regularisation).

    Args:
        lam: λ ≥ 0 of the objective in the module docstring. Stability needs ``λ d_k η < 1`` for every
            training client k, ``d_k = Σ_j (1 + p_j / p_k) A_jk`` (``2 × degree`` for uniform weights).
        edges: undirected edge list ``[[j, k], ...]`` or ``[[j, k, weight], ...]`` over client indices
            (edges that touch a held-out client are dropped).
        knn: build the symmetric ``knn``-nearest-neighbour graph of the training clients' label
            histograms instead (exactly one of ``edges`` and ``knn``; held-out clients are left out).
            The histograms must reach the algorithm through :meth:`bind_clients` before its state is
            initialised.
        local_steps, local_lr, batch_size, finetune_steps, finetune_lr, finetune_batch_size: see
            :class:`~lightning_fedmeta.algorithms.base.Algorithm`.
    """

    step_budget = True
    name = "mtl_graph"
    summary = "Graph MTL: Σ p_k [F_k(w_k) + λ/2 Σ_j A_jk‖w_k − w_j‖²] over a client graph (edges or kNN of labels)"

    @classmethod
    def example_arguments(cls) -> dict[str, Any]:
        """The graph must be given: the kit uses each client's 2 nearest neighbours by label histogram."""
        return {"knn": 2}

    def __init__(
        self,
        lam: float = 0.1,
        edges: list[list[float]] | None = None,
        knn: int | None = None,
    ) -> None:
        super().__init__(lam)
        if (edges is None) == (knn is None):
            raise ValueError(f"give exactly one of edges (a list of [j, k]) and knn (an int); got edges={edges!r}, "
                             f"knn={knn!r}")
        if knn is not None and (not isinstance(knn, int) or knn < 1):
            raise ValueError(f"knn must be an integer >= 1, got {knn!r}")
        if edges is not None:
            for e in edges:
                if len(e) not in (2, 3) or (len(e) == 3 and not float(e[2]) >= 0):
                    raise ValueError(f"edges: each edge must be [j, k] or [j, k, weight >= 0], got {e!r}")
        self.edges = None if edges is None else [list(e) for e in edges]
        self.knn = knn
        self._label_counts: Tensor | None = None
        self._training: Tensor | None = None

    def bind_clients(self, clients: ClientRecord, label_counts: Tensor) -> None:
        """Receive the clients' records and training label histograms ``[K, C]`` (needed by ``knn``).

        ``FederatedModule.attach_data`` calls it once, before any state is initialised, with
        ``label_counts[k, c]`` = number of training samples of class c at client k.
        """
        super().bind_clients(clients, label_counts)
        if label_counts.shape[0] != clients.index.numel():
            raise ValueError(f"label_counts has {label_counts.shape[0]} rows for {clients.index.numel()} clients")
        self._label_counts = label_counts.detach().cpu()
        self._training = ~clients.is_new.detach().cpu().to(torch.bool)

    def adjacency(self, num_clients: int) -> Tensor:
        """The ``[K, K]`` float64 adjacency A of the client graph (kNN: among the training clients;
        the server state further zeroes every edge that touches a held-out client)."""
        if self.edges is not None:
            return adjacency_from_edges(self.edges, num_clients)
        if self._label_counts is None:
            raise ValueError(
                "mtl_graph with knn needs the clients' label histograms, which this training loop does not "
                "pass (MTLGraph.bind_clients was not called); give the graph explicitly with edges: [[j, k], ...]"
            )
        if self._label_counts.shape[0] != num_clients:
            raise ValueError(
                f"label histograms cover {self._label_counts.shape[0]} clients, the data has {num_clients}"
            )
        if self._label_counts.shape[1] == 0:
            raise ValueError(
                "mtl_graph with knn builds the client graph from class-label histograms, and this data has no "
                "class labels (a regression, multi-label or next-token task); give the graph explicitly with "
                "edges: [[j, k], ...]"
            )
        return knn_adjacency(self._label_counts, int(self.knn), self._training)  # type: ignore[arg-type]

    def fixed_similarity(self, num_clients: int) -> Tensor:
        return self.adjacency(num_clients)
