"""FedBABU: the body is trained and averaged, the head stays at its random initialisation; every client fine-tunes
the whole model to personalise it (Oh, Kim, Yun, "FedBABU: Toward Enhanced Representation for Federated Image
Classification", ICLR 2022, arXiv:2106.06042, Algorithm 1).

The parameters split into a body φ and a head h (by default the last layer; ``head_prefix``). h is h⁰, the
initialisation, for the whole of training. Client i, receiving φ:

    φ_i⁰ = φ,   φ_iᵗ = φ_iᵗ⁻¹ − η ∇_φ F_i(φ_iᵗ⁻¹, h⁰; Dₜ),   t = 1..τ      (the head is not updated),

and uploads Δφ_i = φ_i^τ − φ (the head is not sent).
Server: φ ← φ + β Σ_{i∈S} p_i (φ_i^τ − φ); h stays h⁰. Personalisation, before
every evaluation: ``finetune_steps`` SGD steps on the whole model (body and head) from (φ, h⁰) on the client's
training data, (φ_i, h_i) ← (φ_i, h_i) − η_f ∇F_i(φ_i, h_i; Dₜ).

Where we differ from the authors' code (github.com/jhoon-oh/FedBABU, ``main_fed.py`` with ``--local_upt_part body
--aggr_part body``, personalisation in ``analysis.ipynb``):

* They freeze the head by a head learning rate of 0 in an SGD optimizer with momentum 0.9 and select the head by
  the name ``linear``; we take no step on the head (its gradient is computed with the body's and dropped) and
  select it by ``head_prefix``. Local SGD is plain here (no momentum, no weight decay), at a constant rate (they
  divide it by 10 at half and three quarters of the rounds).
* They average with weights 1/m over the m sampled clients; we use the round's p_i (``aggregation``).
* Their personalisation is 5 epochs of SGD with momentum 0.9 at lr 1e-3 on the whole model, once, from the final
  global model; ours is ``finetune_steps`` plain SGD steps at ``finetune_lr`` from the current global model before
  every evaluation (nothing of it is kept). PFLlib's ``clientbabu`` fine-tunes once after the last round as well.
* Their networks' BatchNorm layers do not track running statistics; ours keep them per client (the loop does, for
  every algorithm).
* Exchange: only the body travels each round (down φ, up Δφ); the head h⁰ reaches a client once, with the
  initial model (a one-off cost, as the architecture's weights are), and is kept in the client state (K copies of
  the head in simulation). The global model's head stays h⁰ because its Δ is 0 (a server optimizer with weight
  decay would still shrink the global copy, which no client reads). Robust rules, DP and upload compression
  refuse FedBABU (its aggregate averages the body only).

New clients: a held-out client is personalised as every client is, by ``finetune_steps`` steps on the whole model
from (φ, h⁰); its only client state is h⁰, so a client that has trained and one that has not are treated alike.

Common arguments: ``local_steps``, ``local_lr``, ``batch_size``: the body steps above, one per batch;
``finetune_steps`` (default 10 here: FedBABU is evaluated after fine-tuning; 0 evaluates (φ, h⁰), the paper's
"initial" accuracy), ``finetune_lr``, ``finetune_batch_size``: the personalisation. All are used.
"""

from __future__ import annotations

from torch import Tensor

from lightning_fedmeta.algorithms.base import Algorithm, ClientOutput, ClientRecord
from lightning_fedmeta.algorithms.heads import check_head_prefix, head_names
from lightning_fedmeta.algorithms.local_steps import mean_over_taken_steps
from lightning_fedmeta.client.functional import Batch, ClientContext, Params

__all__ = ["FedBABU", "body_sgd"]

HEAD = "head"


def body_sgd(
    ctx: ClientContext, params: Params, head: set[str], batches: Batch, lr: float
) -> tuple[Params, Tensor]:
    """SGD on the body only, ``φ ← φ − η ∇_φ F(φ, h; Dₜ)`` over every batch ``batches[t, 0]``, the head ``h``
    (the names in ``head``) unchanged; returns the model and the mean loss over the steps taken. A step on an
    empty batch (beyond a straggler's budget) is a no-op: the masked loss and its gradient are 0."""
    w = params
    losses = []
    for t in range(batches.x.shape[0]):
        loss, g = ctx.loss_and_grad(w, batches.at(t, 0))
        w = {k: v if k in head else v - lr * g[k] for k, v in w.items()}
        losses.append(loss)
    return w, mean_over_taken_steps(losses, batches)


class FedBABU(Algorithm):
    """FedBABU: body-only local SGD with the head frozen at its initialisation; whole-model fine-tuning to evaluate.

    Args:
        head_prefix: parameter-name prefix(es) of the head (a name equal to a prefix or starting with
            ``prefix + "."``); ``None``: the last layer (the module owning the last parameter).
        finetune_steps: SGD steps on the whole model before evaluation (the personalisation); default 10.
        local_steps, local_lr, batch_size, finetune_lr, finetune_batch_size: see
            :class:`~lightning_fedmeta.algorithms.base.Algorithm`.
    """

    name = "fedbabu"
    step_budget = True
    summary = "FedBABU: body trained with the head frozen at init; whole model fine-tuned to personalise (Oh et al.)"

    def __init__(self, head_prefix: str | list[str] | None = None, finetune_steps: int = 10) -> None:
        super().__init__(finetune_steps=finetune_steps)
        check_head_prefix(head_prefix)
        self.head_prefix = head_prefix

    def head(self, params: Params) -> set[str]:
        """The names of the head's parameters (:func:`head_names`)."""
        return set(head_names(list(params), self.head_prefix))

    def init_client_state(self, params: Params) -> dict[str, Tensor]:
        """``{"head": h⁰}``: the initial head, received once with the initial model (never per round)."""
        head = self.head(params)
        return {HEAD: {k: v.detach().clone() for k, v in params.items() if k in head}}

    def with_head(self, params: Params, state: dict[str, Tensor]) -> Params:
        """``(φ, h⁰)``: the global body with the client's copy of the initial head."""
        return {**params, **state[HEAD]}

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        """τ body steps with the head fixed at h⁰ (:func:`body_sgd`); Δ = ``(φ_i − φ, 0)``, the body uploaded."""
        head = self.head(params)
        w, loss = body_sgd(ctx, self.with_head(params, state), head, batches, self.local_lr)
        delta = {k: v.new_zeros(v.shape) if k in head else v - params[k] for k, v in w.items()}
        return ClientOutput(delta, state, {}, {"loss": loss})

    # -- exchange and server (docs/communication.md) --------------------------------------------
    def download(self, params: Params, server_state: dict[str, Tensor], client: ClientRecord) -> dict[str, Tensor]:
        """The body φ; the head h⁰ came once with the initial model."""
        head = self.head(params)
        return {k: v for k, v in params.items() if k not in head}

    def upload(self, output: ClientOutput) -> dict[str, object]:
        """The body's Δ (the head's is 0 and not sent)."""
        head = self.head(output.delta)
        return {"delta": {k: v for k, v in output.delta.items() if k not in head}, "extras": output.extras}

    def aggregate(
        self,
        params: Params,
        outputs: ClientOutput,
        weights: Tensor,
        server_state: dict[str, Tensor],
        clients: ClientRecord,
    ) -> tuple[Params, dict[str, Tensor]]:
        """``Δφ = Σ_i p_i Δφ_i``; 0 on the head."""
        head = self.head(params)
        body = {k: v for k, v in outputs.delta.items() if k not in head}
        mean, state = super().aggregate(params, outputs._replace(delta=body), weights, server_state, clients)
        return {k: mean[k] if k in mean else v.new_zeros(v.shape) for k, v in params.items()}, state

    def personalize(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> Params:
        """``finetune_steps`` SGD steps on the whole model from the global (φ, h⁰), for every client alike."""
        self.head(params)  # refuse a head_prefix that does not fit the model before adapting
        return self.finetune(ctx, params, batches)  # the global head is h⁰ too (its Δ is 0)

