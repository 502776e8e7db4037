"""FedRoD: a generic head trained with the balanced softmax, and a personal head on top of it.

The model splits into a body φ and a generic head θ_g (both shared, averaged by the server); every client also keeps
a personal head θ_p. With z = φ(x) the features, n_{k,c} client k's training samples of class c, and ℓ the
per-sample loss (cross-entropy), one local step of client k on a mini-batch D is

    (φ, θ_g) ← (φ, θ_g) − η ∇_{φ, θ_g} (1/|D|) Σ_{(x,y)∈D} ℓ(θ_g(z) + log n_k, y)          (balanced softmax)
    θ_p      ← θ_p − η ∇_{θ_p} (1/|D|) Σ_{(x,y)∈D} ℓ(sg[θ_g(z)] + θ_p(sg[z]), y)              (personal head)

(sg = stop-gradient; both gradients are taken at the model before the step, from the same batch). After
``local_steps`` steps the client uploads Δ_k = (φ_k, θ_{g,k}) − (φ, θ_g) and keeps θ_p; the server averages
(FedAvg). Client k is evaluated with the personal prediction θ_g(z) + θ_p(z).

Chen & Chao, "On Bridging Generic and Personalized Federated Learning for Image Classification", ICLR 2022
(arXiv:2107.00778), Algorithm 1 with the linear personal head (their FedRoD (linear)); the balanced softmax is
Ren et al., NeurIPS 2020.

Where we differ from the authors' code (PFLlib ``clientrod.py``, which the FedRoD authors' linear variant matches;
FL-bench ``fedrod.py``):

* One model for the personal prediction. The contract evaluates one model of the architecture, so the personal
  model is the network with head θ_g + θ_p: for a head that is affine in its parameters (a final ``Linear``, the
  default head and the one of every implementation) ``(W_g + W_p) z + (b_g + b_p) = θ_g(z) + θ_p(z)`` exactly, and
  the personal-head gradient is the authors' (body and generic head detached). A non-affine head (a
  ``head_prefix`` naming several layers) gets the sum of its parameters, not the sum of two heads' outputs.
* θ_p starts at 0 (the personal prediction of a client that has not trained is the generic one); PFLlib starts it
  as a copy of the initial head (its prediction is then θ_g(z) + θ_init(z)). We follow neither code's start and
  take the paper's view that a client with no personal head yet uses the generic head.
* A class absent from the client's training data gets the logit shift −10⁴ instead of log 0 = −∞: its
  probability underflows to exactly 0 as in the authors' code, while a padded row (mask 0) stays finite.
* FL-bench trains the personal head on its own logits θ_p(z) and lets its gradient reach the body, and offers a
  hypernetwork for θ_p; we follow the paper and PFLlib (summed logits, detached features, no hypernetwork).
* The authors' prior comes from the whole local training set, as ours (``bind_clients``' label histogram).

New clients: a held-out client (or one that has not trained) starts from θ_p = 0, the generic model; with
``finetune_steps > 0`` it fits its personal head alone on its training data (the rule's second line, body and
generic head fixed) before it is evaluated; a trained client continues its own θ_p the same way.

Common arguments: ``local_steps`` steps per round, each one generic step and one personal-head step on the same
mini-batch (``batch_size``); ``local_lr`` is η of both (the authors use one learning rate); ``finetune_steps``,
``finetune_lr`` and ``finetune_batch_size`` are the personal-head steps taken before evaluation.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.func import grad

from lightning_fedmeta.algorithms.base import Algorithm, ClientOutput, ClientRecord, started_from
from lightning_fedmeta.algorithms.heads import head_names
from lightning_fedmeta.algorithms.local_steps import mean_over_taken_steps
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_sub

__all__ = ["FedRoD", "balanced_log_prior"]

PERSONAL_HEAD = "personal_head"
LOG_PRIOR = "log_prior"
#: the logit shift of a class the client has no sample of (log 0, kept finite)
ABSENT_SHIFT = -1.0e4


def balanced_log_prior(counts: Tensor) -> Tensor:
    """The balanced-softmax shift ``log n_c`` of each class (``ABSENT_SHIFT`` for ``n_c = 0``), float32."""
    counts = counts.to(torch.float32)
    return torch.where(counts > 0, counts.clamp_min(1.0).log(), torch.full_like(counts, ABSENT_SHIFT))


class FedRoD(Algorithm):
    """FedRoD: shared body and generic head (balanced softmax, averaged) plus a personal head per client.

    Args:
        head_prefix: parameter-name prefix(es) of the head (generic and personal); ``None`` = the last layer
            (see :func:`~lightning_fedmeta.algorithms.shared_representation.head_names`).
        balanced: train the generic head with the balanced softmax (the paper); ``False``: plain loss (an
            ablation: the generic part is then FedAvg).
        local_steps, local_lr, batch_size, finetune_steps, finetune_lr, finetune_batch_size: see the module
            docstring.

    Client state: ``{"personal_head": {name: tensor}, "log_prior": [C]}`` (θ_p, and ``log n_{k,c}`` from the
    client's label histogram, fixed).
    """

    step_budget = True
    name = "fedrod"
    summary = "FedRoD: generic head by balanced softmax (averaged) + personal head on the summed logits (Chen & Chao)"

    def __init__(
        self,
        head_prefix: str | list[str] | None = None,
        balanced: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(balanced, bool):
            raise ValueError(f"balanced must be True or False, got {balanced!r}")
        self.head_prefix = head_prefix
        self.balanced = balanced
        self._label_counts: Tensor | None = None

    def head(self, params: Params) -> list[str]:
        """Names of the head's parameters."""
        return head_names(list(params), self.head_prefix)

    def bind_clients(self, clients: ClientRecord, label_counts: Tensor) -> None:
        """Keep every client's label histogram ``[K, C]`` (the balanced softmax's prior)."""
        if label_counts.dim() != 2 or label_counts.shape[1] == 0:
            raise ValueError("FedRoD's balanced softmax needs one class label per sample (a classification task); "
                             "this data has none: use fedrep or fedper for a personal head on other tasks")
        self._label_counts = label_counts.detach().to("cpu", torch.float32)

    def init_client_states(self, params: Params, clients: ClientRecord) -> dict[str, Tensor]:
        """θ_p = 0 and the log prior of each client (a client outside the federation: 0, plain softmax)."""
        if self._label_counts is None:
            raise RuntimeError("FedRoD needs the clients' label histograms: call bind_clients(clients, label_counts) "
                               "before init_client_states (the loop does)")
        index = clients.index.to("cpu").reshape(-1)
        k, num_classes = int(index.numel()), self._label_counts.shape[1]
        inside = (index >= 0) & (index < self._label_counts.shape[0])
        prior = torch.zeros(k, num_classes)
        if bool(inside.any()):
            prior[inside] = balanced_log_prior(self._label_counts[index[inside]])
        heads = {n: torch.zeros(k, *params[n].shape, dtype=params[n].dtype, device=params[n].device)
                 for n in self.head(params)}
        return {PERSONAL_HEAD: heads, LOG_PRIOR: prior.to(next(iter(params.values())).device)}

    def personal_head(self, params: Params, state: dict[str, Tensor], client: ClientRecord) -> Params:
        """θ_p of a client that has trained; 0 (the generic prediction) for one that has not."""
        stored = {n: state[PERSONAL_HEAD][n] for n in self.head(params)}
        return started_from(client, stored, {n: torch.zeros_like(v) for n, v in stored.items()})

    def _rod_step(
        self, ctx: ClientContext, w: Params, head_p: Params, batch: Batch, log_prior: Tensor, lr: float
    ) -> tuple[Params, Params, Tensor]:
        """One local step: the personal head's gradient on the summed logits (features and generic head fixed),
        then the balanced-softmax step of body and generic head, both at the model before the step."""
        g_p = grad(self._personal_loss, argnums=1)(ctx.frozen(), head_p, w, batch)
        base = ctx.per_sample_loss
        if self.balanced:
            ctx.per_sample_loss = lambda logits, y: base(logits + log_prior.to(logits.dtype), y)
        try:
            loss, g = ctx.loss_and_grad(w, batch)
        finally:
            ctx.per_sample_loss = base
        return {k: w[k] - lr * g[k] for k in w}, {k: head_p[k] - lr * g_p[k] for k in head_p}, loss

    @staticmethod
    def _personal_loss(ctx: ClientContext, head_p: Params, w: Params, batch: Batch) -> Tensor:
        """ℓ(sg[θ_g(z)] + θ_p(sg[z]), y): the model with head ``sg[θ_g] + θ_p`` and a detached body."""
        fixed = {k: v.detach() for k, v in w.items()}
        return ctx.loss({**fixed, **{k: fixed[k] + head_p[k] for k in head_p}}, batch)

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        w, head_p = params, self.personal_head(params, state, client)
        losses = []
        for t in range(batches.x.shape[0]):
            w, head_p, loss = ctx.step(self._rod_step, w, head_p, batches.at(t, 0), state[LOG_PRIOR], self.local_lr)
            losses.append(loss)
        return ClientOutput(
            delta=tree_sub(w, params),
            state={PERSONAL_HEAD: head_p, LOG_PRIOR: state[LOG_PRIOR]},
            extras={},
            metrics={"loss": mean_over_taken_steps(losses, batches)},
        )

    def personalize(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> Params:
        """``finetune_steps`` personal-head steps from the client's θ_p (0 if it has not trained), then the model
        with head θ_g + θ_p (the personal prediction θ_g(z) + θ_p(z))."""
        head_p = self.personal_head(params, state, client)
        frozen = ctx.frozen()
        for t in range(batches.x.shape[0]):
            g_p = grad(self._personal_loss, argnums=1)(frozen, head_p, params, batches.at(t, 0))
            head_p = {k: head_p[k] - self.finetune_lr * g_p[k] for k in head_p}
        return {**params, **{k: params[k] + head_p[k] for k in head_p}}
