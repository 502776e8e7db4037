"""Helpers shared by the clustered and multi-task algorithms (IFCA, CFL, MOCHA).

* :class:`ClusteredAlgorithm`, the base of IFCA and CFL: cluster models stacked in the server state,
  each client's loss under every cluster model (:func:`cluster_losses`), and the evaluation by a
  chosen cluster's model, fine-tuned;
* vmap-safe one-hot vectors (:func:`one_hot`): ``tree_weighted_sum(clusters, one_hot(j, k))`` selects
  cluster j's model ``Σ_j e_j θ_j``, so a client can start from "its" cluster model under
  ``torch.func.vmap``;
* per-cluster weighted means of the clients' models (a cluster nobody picked keeps its model);
* deterministic initial cluster models: perturbations of the global model from a fixed seed, or
  :func:`kmeans_plus_plus`, weighted k-means++ seeding (Arthur & Vassilvitskii, SODA 2007) refined by
  Lloyd iterations, with restarts scored by inertia, on the clients' first-round updates;
* the cosine-similarity matrix of client updates and its bi-partition by complete-linkage
  agglomerative clustering (Sattler, Müller & Samek, IEEE TNNLS 2020, and their reference code);
* :func:`adjusted_rand_index` (Hubert & Arabie, 1985) to score a recovered partition.
"""

from __future__ import annotations

from abc import abstractmethod
from math import comb

import numpy as np
import torch
from torch import Tensor

from lightning_fedmeta.algorithms.base import Algorithm, BatchPlan, ClientRecord
from lightning_fedmeta.algorithms.rows import one_hot  # re-exported (its old home)
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_weighted_sum, weighted_sum

__all__ = [
    "CLUSTER",
    "ClusteredAlgorithm",
    "cluster_losses",
    "lowest_loss",
    "one_hot",
    "stack_perturbed",
    "gram_matrix",
    "kmeans_plus_plus",
    "cluster_means",
    "flatten_rows",
    "pairwise_cosine_similarity",
    "complete_linkage_bipartition",
    "adjusted_rand_index",
]

#: server-state key of the stacked cluster models: ``server_state["cluster"][parameter name]`` is ``[slots, ...]``
CLUSTER = "cluster"


def cluster_losses(ctx: ClientContext, clusters: Params, batches: Batch) -> Tensor:
    """``[k]``: loss of each stacked cluster model ``clusters [k, ...]`` on all samples of ``batches [T, P, B, ...]``.

    The ``T·P`` batches are merged into one (a masked mean over every drawn sample), so choosing
    among k clusters costs k forward passes.
    """
    k = next(iter(clusters.values())).shape[0]
    lead = batches.x.shape[0] * batches.x.shape[1] * batches.x.shape[2]
    merged = Batch(
        batches.x.reshape(lead, *batches.x.shape[3:]), batches.y.reshape(lead), batches.mask.reshape(lead)
    )
    return torch.stack([ctx.loss({name: v[j] for name, v in clusters.items()}, merged) for j in range(k)])


def lowest_loss(losses: Tensor, eligible: Tensor) -> Tensor:
    """The index (0-d) of the smallest of ``losses [k]`` among the ``eligible [k]`` entries (vmap-safe)."""
    return torch.where(eligible, losses, torch.full_like(losses, float("inf"))).argmin()


class ClusteredAlgorithm(Algorithm):
    """Base of IFCA and CFL: cluster models stacked in the server state (``{"cluster": {name: [slots, ...]}}``),
    updated by the algorithm itself (``server_optimizer_applies = False``).

    Evaluation (:meth:`personalize`) draws :meth:`eval_plan`'s batches from a client's training data,
    computes every cluster model's loss on them, lets :meth:`eval_cluster` choose a cluster (by those
    losses, or by membership) and fine-tunes its model on the same batches.
    """

    server_optimizer_applies = False

    @staticmethod
    def clusters(server_state: dict[str, Tensor]) -> Params:
        """The stacked cluster models ``{name: [slots, ...]}`` of the server state."""
        return dict(server_state[CLUSTER])

    def init_client_state(self, params: Params) -> dict[str, Tensor]:
        """``cluster``: the cluster the client trained in its latest round (−1 before its first round)."""
        return {"cluster": torch.tensor(-1, dtype=torch.long)}

    def eval_plan(self) -> BatchPlan:
        """At least one batch: the cluster is chosen by the loss on these batches, then fine-tuned on them; under
        ``finetune_epochs`` (E) the epochs' batches (every training row E times: the loss is the mean over the
        client's rows), each a fine-tuning step."""
        if self.finetune_epochs is not None:
            return BatchPlan(steps=0, per_step=1, batch_size=self.finetune_batch_size, epochs=self.finetune_epochs,
                             drop_last=self.drop_last)
        return BatchPlan(steps=max(1, self.finetune_steps), per_step=1, batch_size=self.finetune_batch_size)

    @abstractmethod
    def eval_cluster(self, losses: Tensor, server_state: dict[str, Tensor], client: ClientRecord) -> Tensor:
        """The cluster (0-d index into the slots) a client is evaluated with, given ``losses [slots]``, the
        loss of every cluster model on the client's evaluation batches (vmap-safe)."""

    def personalize(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> Params:
        """The model of the cluster :meth:`eval_cluster` chooses, after ``finetune_steps`` SGD steps on ``batches``."""
        clusters = self.clusters(server_state)
        losses = cluster_losses(ctx, clusters, batches)
        first = next(iter(clusters.values()))
        pick = one_hot(self.eval_cluster(losses, server_state, client), first.shape[0], first.dtype)
        steps = self.finetune_steps if self.finetune_epochs is None else None  # None: every batch (empty ones no-ops)
        return self.finetune(ctx, tree_weighted_sum(clusters, pick), batches, steps)


def stack_perturbed(params: Params, k: int, noise: float, seed: int) -> Params:
    """``k`` distinct starting models ``θ_0 = θ``, ``θ_j = θ + noise · rms(θ) · ε_j`` (``ε_j ~ N(0, I)``).

    ``rms(θ)`` is the root mean square of each tensor (1 where the tensor is all zeros), so the
    perturbation has the scale of the initialisation. The draws come from
    ``torch.Generator().manual_seed(seed)``: the same seed gives the same cluster models.
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in params.items():
        rms = float(p.detach().float().pow(2).mean().sqrt()) if p.numel() else 0.0
        scale = noise * (rms if rms > 0 else 1.0)
        eps = torch.randn((k, *p.shape), generator=g, dtype=torch.float32).to(p.dtype)
        eps[0] = 0.0
        out[name] = p.detach().unsqueeze(0) + scale * eps.to(p.device)
    return out


def gram_matrix(points: Tensor, chunk: int = 1 << 16) -> Tensor:
    """``[n, n]`` float64 CPU Gram matrix ``⟨x_i, x_j⟩`` of the rows of ``points [n, P]``, summed over
    column chunks so that no float64 copy of all of ``points`` is made."""
    x = points.detach().reshape(points.shape[0], -1)
    gram = torch.zeros(x.shape[0], x.shape[0], dtype=torch.float64)
    for s in range(0, x.shape[1], chunk):
        part = x[:, s : s + chunk].to("cpu", torch.float64)
        gram += part @ part.t()
    return gram


def kmeans_plus_plus(
    points: Tensor,
    k: int,
    seed: int,
    weights: Tensor | None = None,
    restarts: int = 10,
    max_iter: int = 100,
) -> Tensor:
    """Weighted k-means of the rows of ``points [n, P]`` into ``k`` groups; returns labels ``[n]`` in ``[0, k)``.

    Each restart seeds the centers by k-means++ (Arthur & Vassilvitskii, "k-means++: the advantages
    of careful seeding", SODA 2007): the first center is a point drawn with probability ∝ ``w_i``, each
    next one a point drawn with probability ∝ ``w_i D(x_i)²`` (``D`` = distance to the nearest center
    chosen so far); then Lloyd iterations (assign to the nearest center, move each center to the
    ``w``-weighted mean of its points; an empty group keeps its center) run until the labels stop
    changing. The restart with the lowest inertia ``Σ_i w_i D(x_i)²`` is kept (the first on ties).
    When all remaining mass is at distance 0 (fewer distinct points than ``k``), further centers
    duplicate points and some groups stay empty; ties go to the lowest group index.

    Distances come from the ``n × n`` Gram matrix (:func:`gram_matrix`; every center is a convex
    combination of points), so the cost is one pass over ``points`` plus ``O(n² k)`` per iteration,
    whatever the number of parameters ``P``. Everything runs on the CPU in float64 with draws from
    ``torch.Generator().manual_seed(seed)``: the labels are a pure function of
    ``(points, weights, k, seed, restarts)``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n = points.shape[0]
    if n == 0:
        raise ValueError("k-means needs at least one point")
    gram = gram_matrix(points)
    sq = gram.diagonal().clone()
    w = torch.ones(n, dtype=torch.float64) if weights is None else weights.detach().to("cpu", torch.float64)
    w = w.clamp_min(0)
    if not float(w.sum()) > 0:
        w = torch.ones(n, dtype=torch.float64)

    g = torch.Generator().manual_seed(seed)
    best_labels, best_inertia = torch.zeros(n, dtype=torch.long), float("inf")
    for _ in range(max(1, restarts)):
        chosen = _kmeans_pp_seeds(gram, sq, w, k, g)
        labels, dist = _lloyd(gram, sq, w, chosen, max_iter)
        inertia = float((w * dist.gather(1, labels.unsqueeze(1)).squeeze(1)).sum())
        if inertia < best_inertia:
            best_labels, best_inertia = labels, inertia
    return best_labels


def _to_point(gram: Tensor, sq: Tensor, c: int) -> Tensor:
    """``‖x_i − x_c‖²`` for all ``i``, from the Gram matrix and its diagonal ``sq``."""
    return (sq + sq[c] - 2 * gram[:, c]).clamp_min(0)


def _to_centers(gram: Tensor, sq: Tensor, coef: Tensor) -> Tensor:
    """``[n, k]``: ``‖x_i − μ_j‖²`` for the centers ``μ_j = Σ_l coef[j, l] x_l``."""
    cross = coef @ gram  # [k, n]: ⟨μ_j, x_i⟩
    return (sq.unsqueeze(1) - 2 * cross.t() + (cross * coef).sum(1).unsqueeze(0)).clamp_min(0)


def _kmeans_pp_seeds(gram: Tensor, sq: Tensor, w: Tensor, k: int, g: torch.Generator) -> list[int]:
    """The ``k`` points k-means++ picks as centers, each drawn from ``g`` with probability ∝ ``w_i D(x_i)²``."""
    chosen = [int(torch.multinomial(w / w.sum(), 1, generator=g))]
    d2 = _to_point(gram, sq, chosen[0])
    for _ in range(1, k):
        mass = w * d2
        prob = mass / mass.sum() if float(mass.sum()) > 0 else w / w.sum()
        chosen.append(int(torch.multinomial(prob, 1, generator=g)))
        d2 = torch.minimum(d2, _to_point(gram, sq, chosen[-1]))
    return chosen


def _lloyd(gram: Tensor, sq: Tensor, w: Tensor, chosen: list[int], max_iter: int) -> tuple[Tensor, Tensor]:
    """Lloyd iterations from the points ``chosen`` as centers: the labels ``[n]`` and the distances ``[n, k]``."""
    k, n = len(chosen), w.shape[0]
    coef = torch.zeros(k, n, dtype=torch.float64)
    coef[torch.arange(k), torch.tensor(chosen)] = 1.0
    dist = _to_centers(gram, sq, coef)
    labels = dist.argmin(1)
    for _ in range(max_iter):
        member = (labels.unsqueeze(0) == torch.arange(k).unsqueeze(1)).to(torch.float64) * w  # [k, n]
        size = member.sum(1, keepdim=True)
        coef = torch.where(size > 0, member / size.clamp_min(torch.finfo(torch.float64).tiny), coef)
        dist = _to_centers(gram, sq, coef)
        new = dist.argmin(1)
        if torch.equal(new, labels):
            break
        labels = new
    return labels, dist


def cluster_means(current: Params, models: Params, assign: Tensor, weights: Tensor) -> tuple[Params, Tensor]:
    """Per-cluster weighted means ``θ_j = Σ_{i: a_i = j} p_i w_i / Σ_{i: a_i = j} p_i``.

    Args:
        current: the cluster models ``[k, ...]`` (kept for clusters no client picked).
        models: the clients' models ``[C, ...]``.
        assign: one-hot cluster choices ``[C, k]``.
        weights: aggregation weights ``p_i`` ``[C]``.

    Returns:
        the new cluster models ``[k, ...]`` and the mass ``Σ_{i: a_i = j} p_i`` of each cluster ``[k]``.
    """
    w = assign.to(weights.dtype) * weights.unsqueeze(1)  # [C, k]
    mass = w.sum(0)
    picked = mass > 0
    out = {}
    for name, old in current.items():
        summed = weighted_sum(w.t(), models[name])  # [k, ...]
        shape = (-1,) + (1,) * (old.dim() - 1)
        mean = summed / mass.clamp_min(torch.finfo(mass.dtype).tiny).to(old.dtype).view(shape)
        out[name] = torch.where(picked.view(shape), mean, old)
    return out, mass


def flatten_rows(tree: Params) -> Tensor:
    """``[C, P]``: each client's tree flattened into one row (keys in insertion order)."""
    return torch.cat([v.reshape(v.shape[0], -1) for v in tree.values()], dim=1)


def pairwise_cosine_similarity(rows: Tensor, eps: float = 1e-12) -> Tensor:
    """``α_ij = ⟨Δ_i, Δ_j⟩ / (‖Δ_i‖ ‖Δ_j‖ + eps)`` for all pairs of rows of ``rows [n, P]``, the diagonal
    included and signs kept (CFL's split criterion; compare ``regularized.clipped_cosine_similarity``)."""
    norms = rows.norm(dim=1)
    return (rows @ rows.t()) / (norms.unsqueeze(1) * norms.unsqueeze(0) + eps)


def complete_linkage_bipartition(similarity: Tensor) -> Tensor:
    """Split ``n >= 2`` items into two groups by complete-linkage agglomerative clustering.

    Distances are ``-α_ij``; starting from singletons, the two clusters with the smallest
    complete-linkage distance ``max_{i∈A, j∈B} -α_ij`` (i.e. the largest *minimum* cross
    similarity) are merged until two remain. This is the bi-partition CFL's reference code computes
    (``AgglomerativeClustering(linkage="complete")`` on ``-α``). Ties are broken by the lowest
    indices, so the result is deterministic.

    Returns:
        a bool tensor ``[n]``: True for the members of the group *not* containing item 0.
    """
    s = similarity.detach().double().cpu().numpy()
    n = s.shape[0]
    if n < 2:
        raise ValueError(f"a bi-partition needs at least 2 items, got {n}")
    groups: list[list[int]] = [[i] for i in range(n)]
    # link[a, b] = min similarity between groups a and b (complete linkage on distance -α)
    link = s.copy()
    np.fill_diagonal(link, -np.inf)
    alive = list(range(n))
    while len(alive) > 2:
        best, pair = -np.inf, (alive[0], alive[1])
        for ai, a in enumerate(alive):
            for b in alive[ai + 1 :]:
                if link[a, b] > best:
                    best, pair = link[a, b], (a, b)
        a, b = pair
        groups[a] = groups[a] + groups[b]
        alive.remove(b)
        for c in alive:
            if c != a:
                link[a, c] = link[c, a] = min(link[a, c], link[b, c])
    first = next(g for g in (groups[alive[0]], groups[alive[1]]) if 0 in g)
    out = torch.ones(n, dtype=torch.bool)
    out[torch.tensor(first)] = False
    return out


def adjusted_rand_index(labels_a: Tensor | list[int], labels_b: Tensor | list[int]) -> float:
    """Adjusted Rand index of two partitions of the same items (1.0 = identical up to renaming).

    ``ARI = (Σ_ij C(n_ij, 2) − E) / (½ (Σ_i C(a_i, 2) + Σ_j C(b_j, 2)) − E)``, with
    ``E = Σ_i C(a_i, 2) Σ_j C(b_j, 2) / C(n, 2)`` (Hubert & Arabie, 1985).
    """
    a = [int(v) for v in (labels_a.tolist() if isinstance(labels_a, Tensor) else labels_a)]
    b = [int(v) for v in (labels_b.tolist() if isinstance(labels_b, Tensor) else labels_b)]
    if len(a) != len(b):
        raise ValueError(f"partitions of different sizes: {len(a)} and {len(b)}")
    n = len(a)
    pairs: dict[tuple[int, int], int] = {}
    for x, y in zip(a, b, strict=True):
        pairs[(x, y)] = pairs.get((x, y), 0) + 1
    rows: dict[int, int] = {}
    cols: dict[int, int] = {}
    for (x, y), c in pairs.items():
        rows[x] = rows.get(x, 0) + c
        cols[y] = cols.get(y, 0) + c
    index = sum(comb(c, 2) for c in pairs.values())
    sum_a = sum(comb(c, 2) for c in rows.values())
    sum_b = sum(comb(c, 2) for c in cols.values())
    expected = sum_a * sum_b / comb(n, 2) if n > 1 else 0.0
    maximum = 0.5 * (sum_a + sum_b)
    if maximum == expected:
        return 1.0
    return (index - expected) / (maximum - expected)
