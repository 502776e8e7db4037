"""FedProto: federated prototype learning (Tan, Long, Liu, Zhou, Lu, Jiang, Zhang, "FedProto: Federated Prototype
Learning across Heterogeneous Clients", AAAI 2022, arXiv:2105.00243, Algorithm 1).

Every client keeps its whole model θ_i = (φ_i, h_i) (body φ_i: x ↦ z ∈ ℝᵈ, the input of the last linear layer
h_i); only class prototypes travel. Round t, sampled client i, global prototypes C̄ᵏ (k a class; a_k = 1 once
class k has a prototype, else 0), τ SGD steps on its batches D_s, z_j = φ_i(x_j):

    θ_i ← θ_i − η ∇_θ [ (1/B) Σ_j CE(h_i(z_j), y_j) + λ (1/(B d)) Σ_j a_{y_j} ‖z_j − C̄^{y_j}‖² ]

(the regulariser is PyTorch's ``MSELoss`` between z and the prototype of its class, as the authors' code), then
its local prototypes, the mean representation of each class over the samples it trained on this round:

    C_iᵏ = Σ_s Σ_{j: y_j = k} sg(z_j) / |{(s, j): y_j = k}|     (sg: no gradient; z_j at the step's model)

Server: C̄ᵏ ← (1/|N_k|) Σ_{i ∈ N_k} C_iᵏ over the round's clients N_k holding class k. Client i is evaluated with
its own θ_i. The global parameters are never aggregated: they stay at the common initialisation θ⁰, the model
of every client that has not trained yet (``client.seen``; a Δ of zero is returned to the loop).

Where we differ from the authors' code (github:yuetan031/FedProto; PFLlib's clientproto/serverproto agree with it):
* Server average: the code averages the clients' prototypes of a class with equal weights; the paper's eq. (6)
  weights them by |D_{i,k}|/N_k. We follow the code.
* A class held by no client of the round: the code's new prototype set lacks it (its samples get no
  regulariser until a client holding it is sampled again); we keep its previous prototype. The code's experiments
  sample every client every round, where the two agree.
* Inference: PFLlib and the authors' "acc w/ protos" predict the class of the nearest global prototype
  (argmin_k ‖φ_i(x) − C̄ᵏ‖); the authors also report the local head's accuracy. The loop evaluates a model's
  output, so we evaluate with the local head h_i(φ_i(x)).
* Local prototypes: the authors' code averages z over the batches of the *last* local epoch, PFLlib's over every
  epoch; we average over all the round's τ batches (PFLlib's choice; the two agree with one local epoch, the
  authors' default). Mini-batches are drawn independently per step (the loop's sampler), epochs in the code.
* Local optimiser: the authors' code uses SGD with momentum 0.5; PFLlib and we use plain SGD.

New clients: a held-out client starts from θ⁰ (no model of its own; the global parameters never move) and
takes ``finetune_steps`` steps of the FedProto objective above (cross-entropy plus λ times the pull towards the
global prototypes) on its training data with ``finetune_lr``; a trained client fine-tunes its own θ_i the same way.

Common arguments: ``local_steps`` τ (one batch per step, from :meth:`round_plan`), ``local_lr`` η and
``batch_size`` B drive the local objective; ``finetune_steps``/``finetune_lr``/``finetune_batch_size`` are the
evaluation-time steps of the same objective. All are used.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.func import grad_and_value

from lightning_fedmeta.algorithms.base import ClientOutput, ClientRecord, PersonalModel, check_non_negative
from lightning_fedmeta.algorithms.feature_common import (
    KNOWN,
    PROTOTYPES,
    LinearHead,
    class_sums,
    empty_prototypes,
    features_and_logits,
    linear_head,
)
from lightning_fedmeta.algorithms.heads import check_head_prefix
from lightning_fedmeta.algorithms.local_steps import mean_over_taken_steps
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_zeros_like

__all__ = ["FedProto"]

PERSONAL = "personal"


class FedProto(PersonalModel):
    """Local models regularised towards class prototypes averaged by the server; no parameters are aggregated.

    Args:
        lam: λ ≥ 0, weight of the prototype regulariser (the authors' code and PFLlib default to 1).
        head_prefix: parameter-name prefix of the last linear layer whose input is the representation z
            (``None``: the last layer).
        local_steps, local_lr, batch_size, finetune_steps, finetune_lr, finetune_batch_size: see
            :class:`~lightning_fedmeta.algorithms.base.Algorithm` (fine-tuning uses the FedProto objective).

    Client state: ``{"personal": {name: tensor}}`` (θ_i). Server state: ``prototypes`` ``[C, d]`` and ``known``
    ``[C]`` (1 once class k has a prototype).
    """

    name = "fedproto"
    summary = "FedProto: local models pulled towards server-averaged class prototypes; no weights shared (Tan et al.)"
    step_budget = True
    server_optimizer_applies = False

    def __init__(
        self,
        lam: float = 1.0,
        head_prefix: str | list[str] | None = None,
    ) -> None:
        super().__init__()
        check_non_negative("lam", lam)
        check_head_prefix(head_prefix)
        self.lam = lam
        self.head_prefix = head_prefix
        self._num_classes: int | None = None

    # -- state --------------------------------------------------------------------------------
    def bind_clients(self, clients: ClientRecord, label_counts: Tensor) -> None:
        """Record the number of classes C (the width of the label histograms)."""
        self._num_classes = int(label_counts.shape[-1])

    def head(self, params: Params) -> LinearHead:
        """The last linear layer, whose input is the representation."""
        return linear_head(params, self.head_prefix, self.name)

    def init_server_state(self, params: Params) -> dict[str, Tensor]:
        """No prototype yet: ``prototypes`` ``[C, d]`` zeros, ``known`` ``[C]`` zeros."""
        return empty_prototypes(params, self.head(params), self._num_classes, self.name)

    # -- client -------------------------------------------------------------------------------
    def local_loss(
        self, ctx: ClientContext, w: Params, batch: Batch, server_state: dict[str, Tensor], head: LinearHead
    ) -> tuple[Tensor, Tensor]:
        """``(CE + λ · MSE(z, C̄^y), sg(z))`` on one masked batch; samples of a class without a prototype have
        no regulariser (they still count in the mean, as in ``MSELoss`` over the batch)."""
        z, logits = features_and_logits(ctx, w, batch.x, head)
        per_sample = ctx.per_sample_loss(logits, batch.y)
        mask = batch.mask.to(per_sample.dtype)
        count = mask.sum().clamp_min(1.0)
        target = server_state[PROTOTYPES][batch.y].to(z.dtype)
        known = server_state[KNOWN][batch.y].to(per_sample.dtype)
        sq = ((z - target) ** 2).sum(-1).to(per_sample.dtype)
        reg = (sq * known * mask).sum() / (count * z.shape[-1])
        return (per_sample * mask).sum() / count + self.lam * reg, z.detach()

    def local_steps_on(
        self, ctx: ClientContext, w: Params, batches: Batch, server_state: dict[str, Tensor], lr: float
    ) -> tuple[Params, Tensor, Tensor, Tensor]:
        """One SGD step of :meth:`local_loss` per batch ``batches[t, 0]``: ``(θ, mean loss, S [C, d], n [C])``,
        with the class sums S and counts n of the representations seen (at each step's model)."""
        head = self.head(w)
        prototypes = server_state[PROTOTYPES]
        sums, counts = torch.zeros_like(prototypes), torch.zeros_like(server_state[KNOWN])
        losses = []
        for t in range(batches.x.shape[0]):
            batch = batches.at(t, 0)
            g, (loss, z) = grad_and_value(
                lambda p, b: self.local_loss(ctx, p, b, server_state, head), has_aux=True
            )(w, batch)
            w = {k: w[k] - lr * g[k] for k in w}
            s, n = class_sums(z, batch.y, batch.mask, prototypes.shape[0])
            sums, counts = sums + s.to(sums.dtype), counts + n.to(counts.dtype)
            losses.append(loss)
        loss = mean_over_taken_steps(losses, batches) if losses else counts.new_zeros(())
        return w, loss, sums, counts

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        """τ steps of the FedProto objective from θ_i (its state: θ⁰ until it has trained); uploads the class
        prototypes. The global parameters are not read (only their shapes, for the zero Δ): they never travel."""
        w = state[PERSONAL]
        w, loss, sums, counts = self.local_steps_on(ctx, w, batches, server_state, self.local_lr)
        return ClientOutput(
            delta=tree_zeros_like(params),
            state={PERSONAL: w},
            extras={PROTOTYPES: sums / counts.clamp_min(1.0).unsqueeze(-1), "holds": (counts > 0).to(sums.dtype)},
            metrics={"loss": loss},
        )

    # -- exchange (docs/communication.md) ------------------------------------------------------
    def download(self, params: Params, server_state: dict[str, Tensor], client: ClientRecord) -> dict[str, Tensor]:
        """The global prototypes ``[C, d]`` and their ``known`` flags ``[C]``; the model never travels."""
        return {PROTOTYPES: server_state[PROTOTYPES], KNOWN: server_state[KNOWN]}

    def upload(self, output: ClientOutput) -> dict[str, object]:
        """The local prototypes ``[C, d]`` and the ``holds`` flags ``[C]`` (the Δ is 0 and not sent)."""
        return {"extras": output.extras}

    # -- server -------------------------------------------------------------------------------
    def aggregate(
        self,
        params: Params,
        outputs: ClientOutput,
        weights: Tensor,
        server_state: dict[str, Tensor],
        clients: ClientRecord,
    ) -> tuple[Params, dict[str, Tensor]]:
        """``C̄ᵏ = mean of C_iᵏ over the round's clients holding k`` (the previous C̄ᵏ if none); Δ = 0."""
        old, known = server_state[PROTOTYPES], server_state[KNOWN]
        holds = outputs.extras["holds"].to(old.dtype)
        held = holds.sum(0)
        mean = (holds.unsqueeze(-1) * outputs.extras[PROTOTYPES].to(old.dtype)).sum(0) / held.clamp_min(1.0)[:, None]
        new_state = dict(server_state)
        new_state[PROTOTYPES] = torch.where((held > 0).unsqueeze(-1), mean, old)
        new_state[KNOWN] = torch.maximum(known, (held > 0).to(known.dtype))
        return tree_zeros_like(params), new_state

    # -- evaluation ---------------------------------------------------------------------------
    def personalize(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> Params:
        """``finetune_steps`` steps of the FedProto objective (rate ``finetune_lr``) from :meth:`personal_start`."""
        w = self.personal_start(params, state, server_state, client)
        return self.local_steps_on(ctx, w, batches, server_state, self.finetune_lr)[0]
