"""FedAS: federated parameter alignment on the client, Fisher-weighted client synchronisation on the server.

The model is a body φ (x ↦ z, the input of the last linear layer) and a head h. Client i keeps its whole last trained
model θ_i = (φ_i, h_i). Round t, sampled client i receives the global model θ = (φ, h) and

1. *parameter alignment*: class prototypes of its previous body, p_c = mean of φ_i(x) over its samples of class c
   (every batch of the round, forward passes only), then ``align_steps`` SGD steps (rate ``align_lr``) on the received
   body alone,

       φ ← φ − η_a ∇_φ Σ_{c ∈ batch} (1 / (n_c d)) Σ_{j: y_j = c} ‖φ(x_j) − p_c‖²;

2. local training of (φ, h_i) from the aligned body and its own head, ``local_steps`` SGD steps (rate ``local_lr``),
   giving θ_i ← (φ_i, h_i);
3. the diagonal empirical Fisher information of θ_i on the round's batches b, F_i = mean_b (∇f_i(θ_i; b))²
   (element-wise square of each batch's mean-loss gradient, averaged over the batches that hold samples).

It uploads Δ_i = θ_i − θ and tr F_i. *Client synchronisation*: the server weights each client by its Fisher
information's trace (the authors' ``aggregate_wrt_fisher``) and its weight p_i,

    Δ = Σ_i ω_i Δ_i,   ω_i = p_i tr F_i / Σ_j p_j tr F_j   (ω_i = p_i where Σ_j p_j tr F_j = 0),

and θ ← θ + β Δ (the server optimizer's step). ``fisher="parameter"`` weights every parameter k by its own entry
instead, ω_i[k] = p_i F_i[k] / Σ_j p_j F_j[k] (an extension: F_i is uploaded whole, 2d floats); ``fisher="off"`` is
FedAvg's ω_i = p_i. With ``align_steps=0`` and ``fisher="off"`` a round is FedPer's with the head aggregated (a joint
SGD of the global body and the client's own head, averaged by p_i). Client i is evaluated with θ_i.

Yang, Huang, Ye, "FedAS: Bridging Inconsistency in Personalized Federated Learning", CVPR 2024 (no arXiv version;
code: github:xiyuanyang45/FedAS, a fork of PFLlib; PFLlib's ``clientas.py`` / ``serveras.py`` are the same code;
FL-bench ``src/client/fedas.py``).

Where we differ from the authors' code:

* Fisher weights: the authors' server weights each client by the trace of its empirical Fisher information summed
  over its training batches, normalised over the round's clients, with no data-size factor (PFLlib
  ``serveras.aggregate_wrt_fisher``, the authors' repository's copy). A sum over ⌈n_i/B⌉ batches is n_i/B times a
  batch mean, so our ``p_i tr F_i`` (F_i a batch mean) with ``p_i ∝ n_i`` (the default ``aggregation="samples"``) is
  their weight up to that rounding; with ``aggregation="uniform"`` the size factor is dropped. FL-bench's FedAS
  aggregates by data size only (no Fisher weights). ``fisher="parameter"`` (per-parameter weights) is ours, not the
  authors'.
* Fisher data: the authors evaluate it on a pass over the whole training set after training; here on the round's own
  batches (``fisher_steps``: the first that many, ``None`` = all of them), at the trained model.
* Alignment data: the authors compute the prototypes on a pass over the training set at batch size 16 and align for
  one epoch at rate 0.01 (hard-coded); here the prototypes come from every batch of the round and the alignment
  takes the round's first ``align_steps`` batches (under ``local_epochs`` those batches are the epoch plan's first,
  which the training then also uses, as FedALA's weight steps). FL-bench matches the batch's class *mean* to the
  prototype; we follow the authors' per-sample MSE.
* A client that has not trained takes its prototypes from the current global body (the authors' from its initial
  model, the first global model): it aligns the global body towards its own class means.
* The authors' server aggregates the whole model but a client replaces only its body (``set_parameters`` copies
  ``base``): the global head is unused by trained clients. The same here: the head is uploaded and averaged with the
  same weights; it is the start of every client that has not trained.
* The authors' repository passes the server's model to each client without a copy, so each client's alignment moves
  the model the next client receives (PFLlib copies it); every client here aligns its own copy.
* Stragglers: the authors' clients that are not sampled still compute their Fisher trace every round, unused by the
  aggregation; here only sampled clients compute it.

New clients: a held-out client (or one that has not trained) is evaluated with the global model θ (the global body
and the Fisher-weighted head), then ``finetune_steps`` SGD steps (``finetune_lr``, ``finetune_batch_size``) on its
training data, as PFLlib fine-tunes its new clients.

Common arguments: ``local_steps`` SGD steps of local training after the ``align_steps`` alignment steps (a round
draws ``align_steps + local_steps`` batches of ``batch_size``; under ``local_epochs`` the epoch plan, the alignment on
its first batches); ``local_lr`` their rate (the alignment's is ``align_lr``); ``finetune_*``: SGD steps from θ_i
(the global model for a client that has not trained) before evaluation. All are used.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.func import grad

from lightning_fedmeta.algorithms.base import (
    BatchPlan,
    ClientOutput,
    ClientRecord,
    PersonalModel,
    check_integer,
    check_non_negative,
    started_from,
)
from lightning_fedmeta.algorithms.feature_common import LinearHead, class_sums, features_and_logits, linear_head
from lightning_fedmeta.algorithms.heads import check_head_prefix, head_names
from lightning_fedmeta.algorithms.local_steps import local_sgd
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, has_samples, tree_sub

__all__ = ["FedAS", "fisher_weights"]

PERSONAL = "personal"
FISHER = "fisher"
FISHER_MODES = ("parameter", "trace", "off")


def fisher_weights(fisher: Tensor, weights: Tensor) -> Tensor:
    """``ω_i = p_i F_i / Σ_j p_j F_j`` along axis 0 (clients), element-wise; ``p_i`` where ``Σ_j p_j F_j = 0``.

    ``fisher`` is ``[C, ...]`` (one Fisher tensor, or one trace, per client), ``weights`` the clients' ``p_i`` ``[C]``.
    """
    p = weights.to(torch.float64).reshape(-1, *([1] * (fisher.dim() - 1)))
    scaled = p * fisher.to(torch.float64)
    total = scaled.sum(0, keepdim=True)
    return torch.where(total > 0, scaled / torch.where(total > 0, total, torch.ones_like(total)), p.expand_as(scaled))


class FedAS(PersonalModel):
    """FedAS: prototype alignment of the received body, local SGD with the own head, Fisher-weighted averaging.

    Args:
        align_steps: SGD steps of the alignment per round, ≥ 0 (0: no alignment).
        align_lr: η_a ≥ 0, the alignment's rate (the authors' 0.01).
        fisher: ``"trace"`` (ω per client from tr F_i, the authors' code; default), ``"parameter"`` (ω per
            parameter, F_i uploaded whole) or ``"off"`` (ω_i = p_i, FedAvg's weights; nothing extra is uploaded).
        fisher_steps: batches of the round the Fisher information is estimated on (the first that many), ≥ 1;
            ``None``: all of them.
        head_prefix: parameter-name prefix of the last linear layer, whose input is the representation aligned
            (``None``: the last layer).
        local_steps, local_lr, batch_size, finetune_steps, finetune_lr, finetune_batch_size: see the module
            docstring.

    Client state: ``{"personal": {name: tensor}}`` (θ_i, its last trained model). Upload: Δ_i and ``extras``
    ``{"fisher": tr F_i}`` (one number; with ``"parameter"`` ``{name: tensor}``, F_i; nothing with ``"off"``).
    """

    step_budget = True
    name = "fedas"
    summary = "FedAS: prototype alignment of the received body, Fisher-trace weighted averaging (Yang et al., 2024)"

    def __init__(
        self,
        align_steps: int = 5,
        align_lr: float = 0.01,
        fisher: str = "trace",
        fisher_steps: int | None = None,
        head_prefix: str | list[str] | None = None,
    ) -> None:
        super().__init__()
        check_integer("align_steps", align_steps, 0)
        check_non_negative("align_lr", align_lr)
        if fisher not in FISHER_MODES:
            raise ValueError(f"fisher must be one of {FISHER_MODES}, got {fisher!r}")
        if fisher_steps is not None:
            check_integer("fisher_steps", fisher_steps, 1)
        check_head_prefix(head_prefix)
        self.align_steps = align_steps
        self.align_lr = align_lr
        self.fisher = fisher
        self.fisher_steps = fisher_steps
        self.head_prefix = head_prefix

    def round_plan(self) -> BatchPlan:
        """``align_steps`` batches of alignment, then ``local_steps`` of training; under ``local_epochs`` the base
        epoch plan (the alignment on its first batches, which the training also uses)."""
        if self.local_epochs is not None:
            return super().round_plan()
        return BatchPlan(steps=self.align_steps + self.local_steps, per_step=1, batch_size=self.batch_size)

    def init_server_state(self, params: Params) -> dict[str, Tensor]:
        """None; the head is checked here, at setup (a last linear layer, or the one ``head_prefix`` names)."""
        self.head(params)
        return {}

    def head(self, params: Params) -> LinearHead:
        """The last linear layer, whose input is the representation z."""
        return linear_head(params, self.head_prefix, self.name)

    def body_names(self, params: Params) -> list[str]:
        """The parameters of the body φ: all but the head's."""
        head = set(head_names(list(params), self.head_prefix))
        return [k for k in params if k not in head]

    # -- client -------------------------------------------------------------------------------
    def prototypes(self, ctx: ClientContext, previous: Params, batches: Batch) -> tuple[Tensor, Tensor]:
        """``(P [C, d], known [C])``: the class means of the previous model's representations over every batch of
        the round (forward passes, no gradient), and whether class c was seen."""
        head = self.head(previous)
        num_classes = previous[head.weight].shape[0]
        sums, counts = None, None
        for t in range(batches.x.shape[0]):
            batch = batches.at(t, 0)
            z, _ = features_and_logits(ctx, previous, batch.x, head)
            s, n = class_sums(z.detach(), batch.y, batch.mask, num_classes)
            sums, counts = (s, n) if sums is None else (sums + s, counts + n)
        assert sums is not None and counts is not None
        return sums / counts.clamp_min(1.0).unsqueeze(-1), (counts > 0).to(sums.dtype)

    def alignment_loss(
        self, ctx: ClientContext, w: Params, batch: Batch, prototypes: Tensor, known: Tensor
    ) -> Tensor:
        """``Σ_{c in the batch, known} (1 / (n_c d)) Σ_{j: y_j = c} ‖z_j − P_c‖²`` (the authors' ``MSELoss`` per
        class present, summed over the classes)."""
        z, _ = features_and_logits(ctx, w, batch.x, self.head(w))
        sq = ((z - prototypes[batch.y].to(z.dtype)) ** 2).mean(-1)
        # a comparison, not one_hot (which checks the labels' range: data-dependent, refused under grad of vmap)
        classes = torch.arange(prototypes.shape[0], device=batch.y.device)
        onehot = (batch.y.long().unsqueeze(-1) == classes).to(sq.dtype) * batch.mask.to(sq.dtype).unsqueeze(-1)
        per_class, count = (onehot * sq.unsqueeze(-1)).sum(0), onehot.sum(0)
        return (known.to(sq.dtype) * per_class / count.clamp_min(1.0)).sum()

    def align(self, ctx: ClientContext, params: Params, previous: Params, batches: Batch) -> Params:
        """The received model with its body moved by ``align_steps`` SGD steps on :meth:`alignment_loss` towards the
        previous model's prototypes (the first ``align_steps`` batches; an empty batch has a zero gradient)."""
        if self.align_steps == 0:
            return dict(params)
        prototypes, known = self.prototypes(ctx, previous, batches)
        body = {k: params[k] for k in self.body_names(params)}
        for t in range(min(self.align_steps, batches.x.shape[0])):
            # the parameters in the model's order: the head is found as the last module of that order
            g = grad(lambda b, batch: self.alignment_loss(ctx, {k: b.get(k, v) for k, v in params.items()}, batch,
                                                          prototypes, known))(body, batches.at(t, 0))
            body = {k: body[k] - self.align_lr * g[k] for k in body}
        return {k: body.get(k, v) for k, v in params.items()}

    def fisher_information(self, ctx: ClientContext, w: Params, batches: Batch) -> Params:
        """``F = Σ_b s_b (∇f(w; b))² / max(1, Σ_b s_b)`` over the first ``fisher_steps`` batches (``s_b`` = 1 for a
        batch holding samples)."""
        frozen = ctx.frozen()
        steps = batches.x.shape[0] if self.fisher_steps is None else min(self.fisher_steps, batches.x.shape[0])
        total = {k: torch.zeros_like(v) for k, v in w.items()}
        taken = []
        for t in range(steps):
            batch = batches.at(t, 0)
            g = frozen.grad(w, batch)
            s = has_samples(batch)
            total = {k: total[k] + s.to(g[k].dtype) * g[k] ** 2 for k in total}
            taken.append(s)
        count = torch.stack(taken).sum().clamp_min(1)
        return {k: v / count.to(v.dtype) for k, v in total.items()}

    def _training_batches(self, batches: Batch) -> Batch:
        """The training steps' batches: all of them under epochs (the alignment shared them), else those after the
        ``align_steps`` alignment batches."""
        if self.local_epochs is not None:
            return batches
        return batches.slice(self.align_steps)

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        """Align the received body, train (body, own head), estimate F_i; upload Δ_i and F_i, keep θ_i."""
        previous = started_from(client, state[PERSONAL], params)
        aligned = self.align(ctx, params, previous, batches)
        head = set(head_names(list(params), self.head_prefix))
        start = {k: previous[k] if k in head else aligned[k] for k in params}
        trained_batches = self._training_batches(batches)
        w, loss = local_sgd(ctx, start, trained_batches, self.local_lr)
        extras: dict[str, object] = {}
        if self.fisher != "off":
            fisher = self.fisher_information(ctx, w, trained_batches)
            extras[FISHER] = fisher if self.fisher == "parameter" else sum(v.sum() for v in fisher.values())
        return ClientOutput(delta=tree_sub(w, params), state={PERSONAL: w}, extras=extras, metrics={"loss": loss})

    # -- server -------------------------------------------------------------------------------
    def aggregate(
        self,
        params: Params,
        outputs: ClientOutput,
        weights: Tensor,
        server_state: dict[str, Tensor],
        clients: ClientRecord,
    ) -> tuple[Params, dict[str, Tensor]]:
        """``Δ[k] = Σ_i ω_i[k] Δ_i[k]`` with the Fisher weights of :func:`fisher_weights` (per parameter, per client
        from the trace, or ``p_i``)."""
        if self.fisher == "off":
            return super().aggregate(params, outputs, weights, server_state, clients)
        fisher = outputs.extras[FISHER]
        delta = {}
        for k, d in outputs.delta.items():
            f = fisher[k] if self.fisher == "parameter" else fisher
            omega = fisher_weights(f, weights)
            omega = omega.reshape(*omega.shape, *([1] * (d.dim() - omega.dim())))
            delta[k] = (omega * d.to(torch.float64)).sum(0).to(d.dtype)
        return delta, server_state
