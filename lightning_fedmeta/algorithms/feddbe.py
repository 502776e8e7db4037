"""FedDBE: domain bias elimination in representation space (Zhang, Hua, Cao, Wang, Song, Xue, Ma, Guan, "Eliminating
Domain Bias for Federated Learning in Representation Space", NeurIPS 2023, arXiv:2311.14975; FedAvg + DBE).

The model is a body φ (x ↦ z ∈ ℝᵈ, the input of the last linear layer) and a linear head h(z) = W z + b. Each
client keeps a personal representation bias μ_i ∈ ℝᵈ (its "client mean", initially 0), added to z before the
head. Round t, sampled client i receives the global model θ = (φ, W, b) and the global mean ḡ; τ SGD steps on
(θ_i, μ_i) from (θ, μ_i), with the running mean m of the representations (m₀ = 0, reset every round):

    m_s = (1 − ρ) sg(m_{s−1}) + ρ z̄_s                     (z̄_s: mean representation of batch s; sg: no gradient)
    (θ_i, μ_i) ← (θ_i, μ_i) − η ∇ [ (1/B) Σ_j CE(h(φ(x_j) + μ_i), y_j) + κ (1/d) Σ_c ½ (m_s − ḡ)_c² ]

then uploads Δ_i = θ_i − θ (and m_τ); μ_i stays on the client. Server: FedAvg, θ ← θ + β Σ_i p_i Δ_i. The global
mean ḡ is set once, from the first round's clients, ḡ = Σ_i n_i m_{i,τ} / Σ_i n_i: before it exists clients
train plain FedAvg (no μ_i, no regulariser), as the authors' initialisation period does. Client i is evaluated with
h(φ(x) + μ_i), which is the global model with its head bias replaced by b + W μ_i (an exact identity, so the
personalised model is an ordinary parameter dict; the head must have a bias).

Where we differ from the authors' code (github:TsingZ0/DBE; PFLlib's clientdbe/serverdbe are the same code):
* Initialisation period: the code runs one extra local round of *every* client before round 0, discards the
  models it trained, and averages their running means into ḡ. Here round 0 plays that part: its sampled clients
  train plain FedAvg (their updates are kept, as in any round) and their running means set ḡ. With every
  client in round 0 the ḡ is the code's up to the models being FedAvg-trained rather than discarded.
* The batch mean z̄ is over the batch's real samples (the loop pads batches with a mask); the code's batches
  are unpadded.
* Defaults: κ = 50 and ρ = 1.0, the authors' ``system/run_me.sh`` (Fashion-MNIST, CNN, η = 0.005, batch 10,
  one local epoch); the ``main.py`` defaults (theirs and PFLlib's) are κ = 0 (no regulariser) and ρ = 0.1.

New clients: μ_i = 0 for a client that has not trained (held out, or not sampled yet), so it is evaluated with
the global model; ``finetune_steps`` plain SGD steps (``finetune_lr``, ``finetune_batch_size``) then adapt it,
as for any client (a trained client fine-tunes from its personalised model, bias included).

Common arguments: ``local_steps`` τ (one batch per step, :meth:`round_plan`), ``local_lr`` η (for θ_i and μ_i
alike, as the code's two SGD optimisers share the rate), ``batch_size`` B; ``finetune_*`` fine-tune the
personalised model before evaluation. All are used.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.func import grad_and_value

from lightning_fedmeta.algorithms.base import (
    Algorithm,
    ClientOutput,
    ClientRecord,
    check_non_negative,
    check_range,
    started_from,
)
from lightning_fedmeta.algorithms.feature_common import LinearHead, features_and_logits, linear_head
from lightning_fedmeta.algorithms.heads import check_head_prefix
from lightning_fedmeta.algorithms.local_steps import mean_over_taken_steps
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, has_samples, tree_sub

__all__ = ["FedDBE"]

CLIENT_MEAN = "client_mean"
GLOBAL_MEAN = "global_mean"
READY = "ready"
RUNNING_MEAN = "running_mean"


def with_bias_shift(params: Params, head: LinearHead, mu: Tensor) -> Params:
    """The parameters whose head computes ``W (z + μ) + b``: ``b`` replaced by ``b + W μ``."""
    assert head.bias is not None
    shift = (params[head.weight] * mu.to(params[head.weight].dtype)).sum(-1)
    return {**params, head.bias: params[head.bias] + shift}


class FedDBE(Algorithm):
    """FedAvg with a personal representation bias μ_i per client and a regulariser of the representation mean.

    Args:
        kappa: κ ≥ 0, weight of ``mean(½ (m − ḡ)²)`` (the authors' ``kl_weight``). The regulariser's curvature in
            the body grows with the input scale: κ = 50 with a Fashion-MNIST MLP at η = 0.05 diverges (κ = 1 does
            not; configs/feddbe.yaml).
        momentum: ρ ∈ (0, 1], the running mean's rate (the authors' ``momentum``; 1 = the batch mean).
        head_prefix: parameter-name prefix of the last linear layer (``None``: the last layer); it needs a bias.
        local_steps, local_lr, batch_size, finetune_steps, finetune_lr, finetune_batch_size: see
            :class:`~lightning_fedmeta.algorithms.base.Algorithm`.

    Client state: ``client_mean`` ``[d]`` (μ_i). Server state: ``global_mean`` ``[d]`` (ḡ) and ``ready`` (1 once
    ḡ is set).
    """

    step_budget = True
    name = "feddbe"
    summary = "FedDBE: FedAvg + personal representation bias and a global-mean regulariser (Zhang et al., 2023)"

    def __init__(
        self,
        kappa: float = 50.0,
        momentum: float = 1.0,
        head_prefix: str | list[str] | None = None,
    ) -> None:
        super().__init__()
        check_non_negative("kappa", kappa)
        check_range("momentum", momentum, 0.0, 1.0)
        if momentum == 0:
            raise ValueError("momentum must be > 0 (0 would never move the running mean from 0)")
        check_head_prefix(head_prefix)
        self.kappa = kappa
        self.momentum = momentum
        self.head_prefix = head_prefix

    def head(self, params: Params) -> LinearHead:
        """The last linear layer; refused without a bias (μ_i is folded into it for evaluation)."""
        head = linear_head(params, self.head_prefix, self.name)
        if head.bias is None:
            raise ValueError("feddbe folds the personal bias μ into the head's bias: give the last nn.Linear a bias")
        return head

    def init_server_state(self, params: Params) -> dict[str, Tensor]:
        """ḡ = 0, not set yet (``ready`` = 0)."""
        weight = params[self.head(params).weight]
        like = {"dtype": weight.dtype, "device": weight.device}
        return {GLOBAL_MEAN: torch.zeros(weight.shape[1], **like), READY: torch.zeros((), **like)}

    def init_client_state(self, params: Params) -> dict[str, Tensor]:
        """μ_i = 0."""
        weight = params[self.head(params).weight]
        return {CLIENT_MEAN: torch.zeros(weight.shape[1], dtype=weight.dtype, device=weight.device)}

    # -- client -------------------------------------------------------------------------------
    @staticmethod
    def client_mean(state: dict[str, Tensor], client: ClientRecord) -> Tensor:
        """μ_i of a client that has trained, 0 for one that has not (its stored row is not read)."""
        mu = state[CLIENT_MEAN]
        return started_from(client, {CLIENT_MEAN: mu}, {CLIENT_MEAN: torch.zeros_like(mu)})[CLIENT_MEAN]

    def local_loss(
        self, ctx: ClientContext, trained: tuple[Params, Tensor], batch: Batch, running: Tensor,
        server_state: dict[str, Tensor], head: LinearHead,
    ) -> tuple[Tensor, Tensor]:
        """``(CE(h(z + μ)) + κ mean(½ (m − ḡ)²), m)`` with ``m = (1 − ρ) running + ρ z̄`` (μ and the regulariser
        only once ḡ is set)."""
        w, mu = trained
        ready = server_state[READY]
        z, logits = features_and_logits(ctx, with_bias_shift(w, head, mu * ready), batch.x, head)
        per_sample = ctx.per_sample_loss(logits, batch.y)
        mask = batch.mask.to(per_sample.dtype)
        count = mask.sum().clamp_min(1.0)
        z_bar = (z * mask.to(z.dtype).unsqueeze(-1)).sum(0) / count.to(z.dtype)
        m = (1.0 - self.momentum) * running + self.momentum * z_bar
        reg = (0.5 * (m - server_state[GLOBAL_MEAN].to(m.dtype)) ** 2).mean().to(per_sample.dtype)
        return (per_sample * mask).sum() / count + self.kappa * ready * reg, m.detach()

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        """τ SGD steps on (θ_i, μ_i) from (θ, μ_i); uploads θ_i − θ and the final running mean; keeps μ_i."""
        head = self.head(params)
        trained = (dict(params), self.client_mean(state, client))
        running = torch.zeros_like(state[CLIENT_MEAN])
        losses = []
        for t in range(batches.x.shape[0]):
            batch = batches.at(t, 0)
            g, (loss, m) = grad_and_value(
                lambda p, b, r: self.local_loss(ctx, p, b, r, server_state, head), has_aux=True
            )(trained, batch, running)
            # an empty step (padding under local_epochs) is no step: its gradient is 0, and the running mean,
            # which would decay towards its z̄ = 0, is kept
            running = torch.where(has_samples(batch), m, running)
            w, mu = trained
            trained = ({k: w[k] - self.local_lr * g[0][k] for k in w}, mu - self.local_lr * g[1])
            losses.append(loss)
        return ClientOutput(
            delta=tree_sub(trained[0], params),
            state={CLIENT_MEAN: trained[1]},
            extras={RUNNING_MEAN: running},
            metrics={"loss": mean_over_taken_steps(losses, batches)},
        )

    # -- exchange (docs/communication.md) ------------------------------------------------------
    def download(self, params: Params, server_state: dict[str, Tensor], client: ClientRecord) -> dict[str, object]:
        """The global model θ, the global mean ḡ ``[d]`` and its ``ready`` flag (one float)."""
        return {"params": dict(params), GLOBAL_MEAN: server_state[GLOBAL_MEAN], READY: server_state[READY]}

    # -- server -------------------------------------------------------------------------------
    def aggregate(
        self,
        params: Params,
        outputs: ClientOutput,
        weights: Tensor,
        server_state: dict[str, Tensor],
        clients: ClientRecord,
    ) -> tuple[Params, dict[str, Tensor]]:
        """FedAvg; and, the first time, ``ḡ = Σ_i n_i m_i / Σ_i n_i`` over the round's clients."""
        delta, _ = super().aggregate(params, outputs, weights, server_state, clients)
        old, ready = server_state[GLOBAL_MEAN], server_state[READY]
        n = clients.num_samples.to(torch.float64)
        first = (n.unsqueeze(-1) * outputs.extras[RUNNING_MEAN].to(torch.float64)).sum(0) / n.sum().clamp_min(1.0)
        new_state = dict(server_state)
        new_state[GLOBAL_MEAN] = torch.where(ready > 0, old, first.to(old.dtype))
        new_state[READY] = torch.ones_like(ready)
        return delta, new_state

    # -- evaluation ---------------------------------------------------------------------------
    def personal_start(
        self, params: Params, state: dict[str, Tensor], server_state: dict[str, Tensor], client: ClientRecord
    ) -> Params:
        """The global model with head bias ``b + W μ_i`` (μ_i = 0 for a client that has not trained)."""
        return with_bias_shift(params, self.head(params), self.client_mean(state, client) * server_state[READY])
