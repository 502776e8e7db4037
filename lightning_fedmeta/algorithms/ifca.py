"""IFCA (Ghosh, Chung, Yin, Ramchandran, NeurIPS 2020, Algorithm 1, model-averaging variant).

k cluster models θ_1..θ_k (server state). Each sampled client i
    picks ĵ_i = argmin_j F_i(θ_j)                      (loss of every cluster model on its data)
    trains  w_i = τ local SGD steps from θ_ĵ_i
and the server averages per cluster (p_i = the client's aggregation weight):
    θ_j ← Σ_{i∈S: ĵ_i=j} p_i w_i / Σ_{i∈S: ĵ_i=j} p_i        (a cluster no client picked is kept).
F_i is estimated on the τ mini-batches the client draws in the round (the loss over all their samples).

Initialisation. IFCA's guarantees (Ghosh et al., 2020, Theorems 1–2) need initial cluster models
close enough to the true ones, and the paper relaxes this in practice with "random initialization
with multiple restarts". Random perturbations of one model (``init="perturb"``: θ_1 = the initial
global model, θ_j = θ_1 + ``init_noise``·rms·N(0, I) from ``init_seed``) often let two planted groups
pick the same cluster in the first round, and IFCA never splits such a cluster again. The default
``init="kmeans++"`` instead starts the clusters from data: in the first round every sampled client
trains from the global model w, the server clusters their updates Δ_i = w_i − w by k-means with
each client as one point (k-means++ seeding, Arthur & Vassilvitskii, "k-means++: the advantages of
careful seeding", SODA 2007, then Lloyd iterations; ``init_restarts`` seedings drawn from
``init_seed``, the lowest inertia Σ_i ‖Δ_i − μ_c(i)‖² kept), and sets
θ_j = w + Σ_{i∈G_j} p_i Δ_i / Σ_{i∈G_j} p_i, the p-weighted mean of its group's trained models
(restarts scored on the clients' own updates instead of k full runs). A group left empty (fewer
distinct clients than k in the first round) keeps w. With partial participation only the first
round's clients are clustered, so keep ``clients_per_round`` well above k (or use ``reseed_after``).

Empty clusters (optional, ``reseed_after = m > 0``): a cluster no client picked in the last m rounds
is re-seeded with the trained model w_i of the round's client with the highest loss F_i(θ_ĵ_i)
among the clients whose cluster has at least two of the round's clients (one cluster per round,
the longest idle first), so groups that collapsed into one cluster, leaving another empty, can
split again.

All of it is deterministic: k-means runs on the CPU in float64 from ``init_seed`` on tensors every
process holds identically, and the server state (``cluster`` ``{param: [k, ...]}``, ``round []``,
``last_picked [k]``: the last round a cluster received clients or a model, −1 never) is
checkpointed, so a resumed run is bit-exact. The client side stays vmappable: the choice is an
argmin and a one-hot selection, and the first-round start is a ``torch.where`` on ``round``.

The module's global parameters hold the sample-weighted mean of the models the sampled clients
trained (w ← Σ_i p_i w_i, the usual FedAvg delta), so FedAvg-style tools still see one sensible
model; the cluster models themselves are updated directly, not through the server optimizer.
Evaluation (training and new clients alike): the cluster model with the lowest loss on the client's
training batches (``eval_plan``) among the clusters that have been trained (``last_picked ≥ 0``;
never an untouched initialisation once one has), then ``finetune_steps`` optional SGD steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_fedmeta.algorithms.base import ClientOutput, ClientRecord, check_integer, check_non_negative
from lightning_fedmeta.algorithms.clustering import (
    CLUSTER,
    ClusteredAlgorithm,
    cluster_losses,
    cluster_means,
    flatten_rows,
    kmeans_plus_plus,
    lowest_loss,
    one_hot,
    stack_perturbed,
)
from lightning_fedmeta.algorithms.local_steps import local_sgd
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_sub, tree_weighted_sum

__all__ = ["IFCA"]

INITS = ("kmeans++", "perturb")


class IFCA(ClusteredAlgorithm):
    """Iterative Federated Clustering Algorithm: k cluster models, each client trains the best-fitting one.

    Args:
        num_clusters: k >= 1 cluster models.
        local_steps, local_lr, batch_size: τ local SGD steps of rate η on mini-batches of this size.
        finetune_steps, finetune_lr, finetune_batch_size: evaluation-time fine-tuning of the chosen
            cluster model (``finetune_batch_size=None``: full batch, also used to choose the cluster).
        init: ``"kmeans++"`` (default): the cluster models come from weighted k-means++ over the first
            round's client updates (see the module docstring); ``"perturb"``: Gaussian perturbations
            of the initial global model (the earlier behaviour; recovers planted clusters only from
            some seeds).
        init_noise: relative scale (>= 0) of the perturbations (``init="perturb"`` only).
        init_seed: seed of the perturbations or of the k-means++ seedings.
        init_restarts: k-means++ seedings (>= 1) tried in the first round; the lowest inertia wins.
        reseed_after: re-seed a cluster that no client picked for this many rounds from the trained
            model of the worst-fitting client (0 = never). With partial participation choose it well
            above the rounds a real cluster can go unsampled.
    """

    step_budget = True
    name = "ifca"
    summary = "IFCA: k cluster models, each client trains the one with the lowest loss (Ghosh et al., 2020)"

    def __init__(
        self,
        num_clusters: int = 2,
        finetune_batch_size: int | None = None,
        init: str = "kmeans++",
        init_noise: float = 1.0,
        init_seed: int = 0,
        init_restarts: int = 10,
        reseed_after: int = 0,
    ) -> None:
        super().__init__(finetune_batch_size=finetune_batch_size)
        check_integer("num_clusters", num_clusters, 1)
        if init not in INITS:
            raise ValueError(f"init must be one of {', '.join(repr(i) for i in INITS)}, got {init!r}")
        check_non_negative("init_noise", init_noise)
        if isinstance(init_seed, bool) or not isinstance(init_seed, int):
            raise ValueError(f"init_seed must be an integer, got {init_seed!r}")
        for label, value, low in (("init_restarts", init_restarts, 1), ("reseed_after", reseed_after, 0)):
            check_integer(label, value, low)
        self.num_clusters = num_clusters
        self.init = init
        self.init_noise = init_noise
        self.init_seed = init_seed
        self.init_restarts = init_restarts
        self.reseed_after = reseed_after

    # -- state ---------------------------------------------------------------------------------
    def init_server_state(self, params: Params) -> dict[str, Tensor]:
        noise = self.init_noise if self.init == "perturb" else 0.0  # k-means++: k copies until round 0 ends
        stacked = stack_perturbed(params, self.num_clusters, noise, self.init_seed)
        device = next(iter(params.values())).device
        return {
            CLUSTER: dict(stacked),
            "round": torch.tensor(0, dtype=torch.long, device=device),
            "last_picked": torch.full((self.num_clusters,), -1, dtype=torch.long, device=device),
        }

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
        clusters = self.clusters(server_state)
        losses = cluster_losses(ctx, clusters, batches)
        choice = losses.argmin()
        pick = one_hot(choice, self.num_clusters, losses.dtype)
        start = tree_weighted_sum(clusters, pick)
        if self.init == "kmeans++":
            # round 0: every client trains the global model; the server clusters the updates
            warm = server_state["round"] > 0
            start = {name: torch.where(warm, v, params[name]) for name, v in start.items()}
            choice = torch.where(warm, choice, torch.full_like(choice, -1))
        w, loss = local_sgd(ctx, start, batches, self.local_lr)
        return ClientOutput(
            delta=tree_sub(w, params),
            state={"cluster": choice.to(torch.long)},
            extras={"assign": pick, "model": dict(w)},
            metrics={"loss": loss, "cluster_loss": losses.min()},
        )

    def aggregate(
        self,
        params: Params,
        outputs: ClientOutput,
        weights: Tensor,
        server_state: dict[str, Tensor],
        clients: ClientRecord,
    ) -> tuple[Params, dict[str, Tensor]]:
        models = {name: outputs.extras["model"][name] for name in params}
        assign = outputs.extras["assign"]
        round_idx = int(server_state["round"])
        if self.init == "kmeans++" and round_idx == 0:
            # each client is one point (a small client's group counts as much as a large one's);
            # the cluster models below are still p_i-weighted means
            labels = kmeans_plus_plus(flatten_rows(outputs.delta), self.num_clusters, self.init_seed,
                                      restarts=self.init_restarts)
            assign = one_hot(labels.to(assign.device).unsqueeze(1), self.num_clusters, assign.dtype)
        new, mass = cluster_means(self.clusters(server_state), models, assign, weights)
        last_picked = torch.where(mass > 0, torch.full_like(server_state["last_picked"], round_idx),
                                  server_state["last_picked"])
        if self.reseed_after > 0:
            new, last_picked = self._reseed(new, last_picked, models, assign, outputs.metrics["cluster_loss"],
                                            round_idx)
        delta = tree_weighted_sum(outputs.delta, weights)  # global model = Σ_i p_i w_i
        return delta, {
            CLUSTER: dict(new),
            "round": torch.full_like(server_state["round"], round_idx + 1),
            "last_picked": last_picked,
        }

    def _reseed(
        self, clusters: Params, last_picked: Tensor, models: Params, assign: Tensor, fit: Tensor, round_idx: int
    ) -> tuple[Params, Tensor]:
        """Give the longest-idle cluster (idle ``>= reseed_after`` rounds) the trained model of the
        round's worst-fitting client among those sharing their cluster with another client."""
        idle = round_idx - last_picked
        stale = idle >= self.reseed_after
        shared = (assign @ assign.sum(0)) >= 2  # the client's cluster has >= 2 of this round's clients
        if not (bool(stale.any()) and bool(shared.any())):
            return clusters, last_picked
        j = int(torch.where(stale, idle, torch.full_like(idle, -1)).argmax())
        i = int(torch.where(shared, fit, torch.full_like(fit, -float("inf"))).argmax())
        out = {}
        for name, v in clusters.items():
            out[name] = v.clone()
            out[name][j] = models[name][i]
        last_picked = last_picked.clone()
        last_picked[j] = round_idx
        return out, last_picked

    # -- communication -------------------------------------------------------------------------
    def download(self, params: Params, server_state: dict[str, Tensor], client: ClientRecord) -> dict[str, Any]:
        """w and the k cluster models (the client picks by their losses: (k + 1)·d floats), and under k-means++
        initialisation the round counter (round 0 trains w)."""
        out: dict[str, Any] = {"params": dict(params), CLUSTER: self.clusters(server_state)}
        if self.init == "kmeans++":
            out["round"] = server_state["round"]
        return out

    def upload(self, output: ClientOutput) -> dict[str, Any]:
        """Δ_i = w_i − w, the one-hot choice (k), w_i (the server averages models per cluster) and the lowest
        cluster loss (read when an empty cluster is re-seeded): 2d + k + 1 floats."""
        return {"delta": output.delta, "extras": output.extras,
                "metrics": {"cluster_loss": output.metrics["cluster_loss"]}}

    # -- evaluation ----------------------------------------------------------------------------
    def eval_cluster(self, losses: Tensor, server_state: dict[str, Tensor], client: ClientRecord) -> Tensor:
        """The trained cluster model with the lowest loss on the client's batches (for a new client as
        for a training one); every cluster is eligible before any has been trained."""
        trained = server_state["last_picked"] >= 0
        return lowest_loss(losses, trained | ~trained.any())
