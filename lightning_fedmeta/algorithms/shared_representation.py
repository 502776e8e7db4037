"""Shared representation, personal heads: FedRep and FedPer.

The model's parameters split by name into a shared body φ (aggregated) and a local head h_k
(kept by each client, never aggregated). Client k, receiving the global body φ:

FedRep (Collins, Hassani, Mokhtari, Shakkottai, "Exploiting Shared Representations for Personalized
Federated Learning", ICML 2021, Algorithm 1):
    h_k ← h_k − η ∇_h F_k(φ, h_k; Dₜ)      head_steps times (body fixed),
    φ_k ← φ_k − η ∇_φ F_k(φ_k, h_k; Dₜ)    local_steps times from φ_k = φ (head fixed).
FedPer (Arivazhagan, Aggarwal, Singh, Choudhary, "Federated Learning with Personalization Layers", 2019):
    (φ_k, h_k) ← (φ_k, h_k) − η ∇ F_k(φ_k, h_k; Dₜ)   local_steps times, jointly, from (φ, h_k).
Both upload Δ_k = (φ_k − φ, h_k − h): the body is averaged, φ ← φ + β Σ_{k∈S} p_k (φ_k − φ), and so
is the global head h ← h + β Σ_{k∈S} p_k (h_k − h). No trained client ever reads the global head (it
keeps its own h_k); the global head is the running mean of the clients' heads, the start of every
client that has not trained yet. Client k is evaluated with (global φ, h_k); a client that has never
trained (never sampled yet, or held out) with (global φ, global h) — the mean head, not the random
initialisation (add ``finetune_steps`` to fit its head to its own data).

Head: the parameters whose name equals a ``head_prefix`` entry or starts with ``<prefix>.``; by default
the parameters of the module owning the last entry of ``named_parameters()`` (for
``Sequential(..., Linear)`` the last layer's ``weight`` and ``bias``).
"""

from __future__ import annotations

from torch import Tensor
from torch.func import grad_and_value

from lightning_fedmeta.algorithms.base import (
    Algorithm,
    BatchPlan,
    ClientOutput,
    ClientRecord,
    phase_epochs,
    started_from,
)
from lightning_fedmeta.algorithms.heads import check_head_prefix, head_names  # re-exported (their old home)
from lightning_fedmeta.algorithms.local_steps import mean_over_taken_steps
from lightning_fedmeta.client.functional import Batch, ClientContext, Params
from lightning_fedmeta.client.sampling import phase_lengths

__all__ = ["FedRep", "FedPer", "SharedRepresentation", "check_head_prefix", "head_names"]

HEAD = "head"


class SharedRepresentation(Algorithm):
    """Base of FedRep and FedPer: global body, per-client head in the client state (``{"head": {name: tensor}}``).

    Args:
        head_prefix: parameter-name prefix(es) of the local head; ``None`` = the last layer.
        local_steps, local_lr, batch_size, finetune_steps, finetune_lr, finetune_batch_size: see
            :class:`~lightning_fedmeta.algorithms.base.Algorithm`.
    """

    def __init__(
        self,
        head_prefix: str | list[str] | None = None,
    ) -> None:
        super().__init__()
        check_head_prefix(head_prefix)
        self.head_prefix = head_prefix

    def split(self, params: Params) -> tuple[Params, Params]:
        """``(body, head)`` of a parameter dict."""
        head = set(head_names(list(params), self.head_prefix))
        return {k: v for k, v in params.items() if k not in head}, {k: v for k, v in params.items() if k in head}

    def init_client_state(self, params: Params) -> dict[str, Tensor]:
        """The client's head, initially the global (initial) head."""
        _, head = self.split(params)
        return {HEAD: {k: v.detach().clone() for k, v in head.items()}}

    def client_head(self, params: Params, state: dict[str, Tensor], client: ClientRecord) -> Params:
        """The client's own head ``h_k``, or the global (mean) head while it has not trained."""
        _, head = self.split(params)
        return started_from(client, {k: state[HEAD][k] for k in head}, head)

    def personal_start(
        self, params: Params, state: dict[str, Tensor], server_state: dict[str, Tensor], client: ClientRecord
    ) -> Params:
        """The global body with the client's own head (the global head while it has not trained)."""
        body, _ = self.split(params)
        return {**params, **body, **self.client_head(params, state, client)}

    @staticmethod
    def _steps(
        ctx: ClientContext, trained: Params, fixed: Params, batches: Batch, lr: float, first: int, steps: int
    ) -> tuple[Params, list[Tensor]]:
        """SGD on ``trained`` with ``fixed`` held constant, over ``batches[first:first + steps]``."""
        losses = []
        for t in range(first, first + steps):
            g, loss = grad_and_value(lambda p, b: ctx.loss({**fixed, **p}, b))(trained, batches.at(t, 0))
            trained = {k: trained[k] - lr * g[k] for k in trained}
            losses.append(loss)
        return trained, losses

    def _output(self, params: Params, body: Params, head: Params, losses: list[Tensor], batches: Batch) -> ClientOutput:
        """Upload ``(φ_k − φ, h_k − h)``: the body update, and the head's offset from the global head. The loss is
        the mean over the steps taken (empty steps, a straggler's or an epoch layout's padding, are left out)."""
        delta = {k: body[k] - params[k] if k in body else head[k] - params[k] for k in params}
        loss = mean_over_taken_steps(losses, batches)
        return ClientOutput(
            delta=delta,
            state={HEAD: dict(head)},
            extras={},
            metrics={"loss": loss},
        )


class FedRep(SharedRepresentation):
    """FedRep: head_steps head-only steps, then local_steps body-only steps; only the body is averaged.

    Args:
        head_steps: SGD steps on the head (body fixed) per round, ≥ 1 (the paper's 10 local epochs
            of the head become 10 steps here).
        head_epochs: the head phase counted in epochs, with ``local_epochs`` (the body phase's epochs); ``None`` =
            ``local_epochs`` (PFLlib's ``plocal_epochs``, head, beside ``local_epochs``, body).
        head_prefix, local_steps, local_lr, batch_size, finetune_*: see :class:`SharedRepresentation`.

    A round draws ``head_steps + local_steps`` mini-batches (head steps first). Under ``local_epochs`` the round
    is two phases of epochs, ``(head_epochs, local_epochs)``: client ``c`` takes ``head_epochs·nb_c`` head then
    ``local_epochs·nb_c`` body steps (``nb_c = ⌈n_c/B⌉``), each phase in its own block of the step axis padded
    with empty steps (:func:`~lightning_fedmeta.client.sampling.phase_lengths`), which change nothing.
    """

    name = "fedrep"
    summary = "FedRep: local head trained first, then the shared body; only the body is averaged (Collins et al.)"
    step_budget = True

    def __init__(
        self,
        head_steps: int = 10,
        head_prefix: str | list[str] | None = None,
        head_epochs: int | None = None,
    ) -> None:
        super().__init__(head_prefix)
        if not isinstance(head_steps, int) or head_steps < 1:
            raise ValueError(f"head_steps must be an integer >= 1, got {head_steps!r}")
        self.head_steps = head_steps
        self.head_epochs = phase_epochs("head_epochs", head_epochs, self.local_epochs, "head_steps")

    def round_plan(self) -> BatchPlan:
        """``head_steps + local_steps`` batches, head first; under ``local_epochs`` the epochs of the two phases,
        ``(head_epochs, local_epochs)``."""
        if self.local_epochs is not None:
            return BatchPlan(steps=0, per_step=1, batch_size=self.batch_size,
                             epochs=(self.head_epochs, self.local_epochs), drop_last=self.drop_last)
        return BatchPlan(steps=self.head_steps + self.local_steps, per_step=1, batch_size=self.batch_size)

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        body, _ = self.split(params)
        first, then = phase_lengths(batches.x.shape[0], self.round_plan()) if self.local_epochs else (
            self.head_steps, self.local_steps)
        head, head_losses = self._steps(ctx, self.client_head(params, state, client), body, batches, self.local_lr, 0,
                                        first)
        body, body_losses = self._steps(ctx, body, head, batches, self.local_lr, first, then)
        return self._output(params, body, head, head_losses + body_losses, batches)


class FedPer(SharedRepresentation):
    """FedPer: body and head trained jointly for local_steps; only the body is averaged."""

    step_budget = True
    name = "fedper"
    summary = "FedPer: joint local SGD of shared body and personal head; only the body is averaged (Arivazhagan)"

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        w = self.personal_start(params, state, server_state, client)
        w, losses = self._steps(ctx, w, {}, batches, self.local_lr, 0, batches.x.shape[0])
        body, head = self.split(w)
        return self._output(params, body, head, losses, batches)
