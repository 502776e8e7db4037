"""Clustered Federated Learning (Sattler, Müller, Samek, IEEE TNNLS 2020, Algorithm 1).

All clients start in one cluster. Each round, client i of cluster c trains τ local SGD steps from
the cluster model θ_c and uploads Δ_i = w_i − θ_c; the server updates every cluster with its own
clients' updates, θ_c ← θ_c + Σ_{i∈S_c} p_i Δ_i / Σ_{i∈S_c} p_i. Then, for each cluster c,
    if  ‖Σ_{i∈S_c} p̃_i Δ_i‖ < ε₁   (the cluster's model is near a stationary point of the cluster's
                                     joint objective)
    and max_{i∈S_c} ‖Δ_i‖ > ε₂     (but some clients are still far from their own stationary point)
    and round ≥ warmup_rounds and c has ≥ min_split_size members with a stored update,
c is bi-partitioned by the cosine similarities α_ij = ⟨Δ_i, Δ_j⟩ / (‖Δ_i‖‖Δ_j‖) of its members'
latest updates, with complete-linkage agglomerative clustering into two groups (the authors'
reference code: ``AgglomerativeClustering(linkage="complete")`` on −α); both halves start from θ_c.
Defaults ε₁ = 0.4, ε₂ = 1.6, 20 warm-up rounds are those of the reference code.

Static shapes (docs/design.md, contract 1: everything is checkpointed and resumes bit for bit): the
server state holds ``max_clusters`` cluster-model slots ``[max_clusters, ...]`` of which the first
``num_clusters`` are in use, the cluster ``membership [K]`` of every client, and each client's
latest update ``last_update [K, P]`` with a ``fresh [K]`` flag (False once the client's cluster has
split, as its update was relative to the parent model). The latest updates live on the server, not in
the client state, because the split is decided in ``aggregate``, which sees only this round's clients.
With partial participation the split uses the members' most recent updates; members without one
stay in the first half and are split off later if they disagree. A cluster cannot split once all
``max_clusters`` slots are used.

Clients are known by their :class:`~lightning_fedmeta.algorithms.base.ClientRecord`: ``client.index``
is the client's row of ``membership`` and ``last_update``. Evaluation: a training client uses its
cluster's model; a new client (``client.is_new``: held out of training, or a client outside the
federation, ``FederatedModule.personalize((x, y))``) the active cluster model with the lowest loss on
its training batches (its ``membership`` row is never trained: it stays 0); then ``finetune_steps``
optional SGD steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_fedmeta.algorithms.base import ClientOutput, ClientRecord, check_integer, check_non_negative
from lightning_fedmeta.algorithms.clustering import (
    CLUSTER,
    ClusteredAlgorithm,
    cluster_means,
    complete_linkage_bipartition,
    flatten_rows,
    lowest_loss,
    one_hot,
    pairwise_cosine_similarity,
)
from lightning_fedmeta.algorithms.local_steps import local_sgd
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_sub, tree_weighted_sum

__all__ = ["CFL"]


class CFL(ClusteredAlgorithm):
    """Clustered FL: recursive bi-partitioning of clients whose updates disagree at a stationary point.

    Args:
        eps1: ε₁ > 0, threshold on the norm of a cluster's mean update (stationarity).
        eps2: ε₂ >= 0, threshold on the largest client update norm in the cluster (disagreement).
        max_clusters: cluster-model slots allocated in the server state (>= 1).
        warmup_rounds: no split before this many rounds have completed.
        min_split_size: a cluster needs at least this many (>= 2) members with a stored update to split.
        local_steps, local_lr, batch_size, finetune_steps, finetune_lr, finetune_batch_size: as FedAvg.
    """

    step_budget = True
    name = "cfl"
    summary = "CFL: split clusters by cosine similarity of updates at stationarity (Sattler et al., 2020)"

    def __init__(
        self,
        eps1: float = 0.4,
        eps2: float = 1.6,
        max_clusters: int = 8,
        warmup_rounds: int = 20,
        min_split_size: int = 2,
        finetune_batch_size: int | None = None,
    ) -> None:
        super().__init__(finetune_batch_size=finetune_batch_size)
        if not eps1 > 0:
            raise ValueError(f"eps1 must be > 0, got {eps1!r}")
        check_non_negative("eps2", eps2)
        for name, value, low in (("max_clusters", max_clusters, 1), ("warmup_rounds", warmup_rounds, 0),
                                 ("min_split_size", min_split_size, 2)):
            check_integer(name, value, low)
        self.eps1 = eps1
        self.eps2 = eps2
        self.max_clusters = max_clusters
        self.warmup_rounds = warmup_rounds
        self.min_split_size = min_split_size

    # -- state ---------------------------------------------------------------------------------
    def bind_clients(self, clients: ClientRecord, label_counts: Tensor) -> None:
        """Record ``K``: the server keeps every client's cluster membership and latest update."""
        self._num_clients = int(clients.index.numel())

    def init_server_state(self, params: Params) -> dict[str, Tensor]:
        k = getattr(self, "_num_clients", None)
        if k is None:
            raise RuntimeError("CFL.init_server_state needs bind_clients(clients, label_counts) first "
                               "(FederatedModule.attach_data calls it)")
        size = sum(v.numel() for v in params.values())
        dtype = next(iter(params.values())).dtype
        clusters = {}
        for name, p in params.items():
            slots = torch.zeros((self.max_clusters, *p.shape), dtype=p.dtype, device=p.device)
            slots[0] = p.detach()
            clusters[name] = slots
        state: dict[str, Any] = {CLUSTER: clusters}
        state["num_clusters"] = torch.tensor(1, dtype=torch.long)
        state["membership"] = torch.zeros(k, dtype=torch.long)
        state["last_update"] = torch.zeros((k, size), dtype=dtype)
        state["fresh"] = torch.zeros(k, dtype=torch.bool)
        state["round"] = torch.tensor(0, dtype=torch.long)
        return state

    def _cluster_of(self, client: ClientRecord, server_state: dict[str, Tensor]) -> Tensor:
        membership = server_state["membership"]
        mine = one_hot(client.index, membership.numel(), membership.dtype)
        return (membership * mine).sum()

    # -- client and server ---------------------------------------------------------------------
    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        c = self._cluster_of(client, server_state)
        pick = one_hot(c, self.max_clusters, next(iter(params.values())).dtype)
        start = tree_weighted_sum(self.clusters(server_state), pick)
        w, loss = local_sgd(ctx, start, batches, self.local_lr)
        update = tree_sub(w, start)
        return ClientOutput(
            delta=tree_sub(w, params),
            state={"cluster": c},
            extras={"assign": pick, "update": dict(update)},
            metrics={"loss": loss},
        )

    def aggregate(
        self,
        params: Params,
        outputs: ClientOutput,
        weights: Tensor,
        server_state: dict[str, Tensor],
        clients: ClientRecord,
    ) -> tuple[Params, dict[str, Tensor]]:
        assign = outputs.extras["assign"]
        updates = {n: outputs.extras["update"][n] for n in params}
        clusters = self.clusters(server_state)
        starts = tree_weighted_sum(clusters, assign)
        models = {n: starts[n] + updates[n] for n in params}
        new_clusters, mass = cluster_means(clusters, models, assign, weights)

        ids = clients.index
        flat = flatten_rows(updates)
        last_update = server_state["last_update"].index_copy(0, ids, flat.to(server_state["last_update"].dtype))
        fresh = server_state["fresh"].index_copy(0, ids, torch.ones_like(ids, dtype=torch.bool))
        membership = server_state["membership"].clone()
        num_clusters = int(server_state["num_clusters"])
        rounds_done = int(server_state["round"]) + 1

        chosen = assign.argmax(1)
        for c in range(num_clusters):
            here = chosen == c
            if not self._wants_split(here, weights, mass, c, flat, rounds_done, num_clusters):
                continue
            pool = ((membership == c) & fresh).nonzero().flatten()
            if pool.numel() < self.min_split_size:
                continue
            second = complete_linkage_bipartition(pairwise_cosine_similarity(last_update[pool].double()))
            new_id = num_clusters
            membership[pool[second.to(pool.device)]] = new_id
            _copy_cluster(new_clusters, c, new_id)
            fresh[pool] = False
            num_clusters += 1
            if num_clusters >= self.max_clusters:
                break

        new_state: dict[str, Any] = {CLUSTER: new_clusters}
        new_state.update(
            num_clusters=torch.tensor(num_clusters, dtype=torch.long),
            membership=membership,
            last_update=last_update,
            fresh=fresh,
            round=torch.tensor(rounds_done, dtype=torch.long),
        )
        return tree_weighted_sum(outputs.delta, weights), new_state

    def _wants_split(
        self, here: Tensor, weights: Tensor, mass: Tensor, c: int, flat: Tensor, rounds_done: int, num_clusters: int
    ) -> bool:
        """Whether cluster ``c`` (its clients this round: ``here``) meets the split criterion (warm-up, ε₁, ε₂)."""
        if not bool(here.any()) or rounds_done < self.warmup_rounds or num_clusters >= self.max_clusters:
            return False
        p = weights[here] / mass[c]
        mean_norm = float((p.unsqueeze(1) * flat[here]).sum(0).norm())
        max_norm = float(flat[here].norm(dim=1).max())
        return mean_norm < self.eps1 and max_norm > self.eps2

    # -- communication -------------------------------------------------------------------------
    def download(self, params: Params, server_state: dict[str, Tensor], client: ClientRecord) -> dict[str, Any]:
        """w, the model of the client's cluster (2d floats) and its cluster id (int64); the upload is the
        default: Δ_i = w_i − w, the one-hot cluster (max_clusters) and the update w_i − θ_c (2d + max_clusters)."""
        c = self._cluster_of(client, server_state)
        pick = one_hot(c, self.max_clusters, next(iter(params.values())).dtype)
        return {"params": dict(params), "model": tree_weighted_sum(self.clusters(server_state), pick), "cluster": c}

    # -- evaluation ----------------------------------------------------------------------------
    def eval_cluster(self, losses: Tensor, server_state: dict[str, Tensor], client: ClientRecord) -> Tensor:
        """A training client's own cluster; a new client's the active cluster with the lowest loss."""
        active = torch.arange(self.max_clusters, device=losses.device) < server_state["num_clusters"]
        return torch.where(client.is_new, lowest_loss(losses, active), self._cluster_of(client, server_state))


def _copy_cluster(clusters: Params, src: int, dst: int) -> None:
    """Copy cluster slot ``src`` of every stacked tensor into slot ``dst`` (in place of the dict's entries)."""
    for n in clusters:
        clusters[n] = clusters[n].index_copy(
            0, torch.tensor([dst], device=clusters[n].device), clusters[n][src : src + 1]
        )
