"""Personal layers, shared rest: the common client of FedBN and LG-FedAvg.

The parameters split by name into a shared part θ (aggregated) and a personal part π_i (kept by client i in the
client state store, ``{"personal": {name: tensor}}``); which names are personal is each algorithm's choice
(:meth:`PersonalLayers.personal_names`: FedBN the normalisation layers, LG-FedAvg everything below the global
head). Client i, receiving the shared part θ only:

    (θ_i, π_i)⁰ = (θ, π_i)              (π_i = π⁰, the model's initial personal part, while i has not trained),
    (θ_i, π_i)ᵗ = (θ_i, π_i)ᵗ⁻¹ − η ∇F_i((θ_i, π_i)ᵗ⁻¹; Dₜ),   t = 1..τ   (joint SGD: :func:`local_sgd`),

keeps π_i^τ and uploads Δθ_i = θ_i^τ − θ only. The server takes the usual step on the shared part,
θ ← θ + β Σ_{i∈S} p_i Δθ_i; the personal part of the global model stays π⁰ (its Δ is 0). π⁰ is part of the initial
model a client receives once with the architecture (a one-off cost, not a per-round one: docs/communication.md), so
its client state starts as a copy of it (:meth:`init_client_state`); a held-out client is evaluated with (θ, π⁰)
(after ``finetune_steps`` SGD steps on its own data, if any). This is FedPer's client
(:class:`~lightning_fedmeta.algorithms.shared_representation.FedPer`) with the personal part chosen by the
subclass, the personal part never sent, and written on :func:`local_sgd`, so a step beyond a straggler's budget is
not taken (``step_budget``). Because :meth:`PersonalLayers.aggregate` is not the default weighted mean of whole
deltas, robust rules, DP and upload compression refuse these algorithms (``reliability.uploads_delta``).
"""

from __future__ import annotations

from abc import abstractmethod

from torch import Tensor

from lightning_fedmeta.algorithms.base import Algorithm, ClientOutput, ClientRecord, started_from
from lightning_fedmeta.algorithms.local_steps import local_sgd
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_zeros_like

__all__ = ["PERSONAL", "PersonalLayers"]

#: the client-state key of the personal part (checkpointed as ``personal/<parameter name>``)
PERSONAL = "personal"


class PersonalLayers(Algorithm):
    """Joint local SGD of a shared part and a personal part; the personal part stays in the client state.

    Subclasses say which parameters are personal (:meth:`personal_names`). A model with no personal parameter
    keeps no client state, and the algorithm is then FedAvg exactly.
    """

    step_budget = True

    @abstractmethod
    def personal_names(self, params: Params) -> list[str]:
        """The names of the personal parameters among ``params`` (a model's parameters: names and shapes)."""

    def split(self, params: Params) -> tuple[Params, Params]:
        """``(shared, personal)`` parts of a parameter dict."""
        personal = set(self.personal_names(params))
        return ({k: v for k, v in params.items() if k not in personal},
                {k: v for k, v in params.items() if k in personal})

    def init_client_state(self, params: Params) -> dict[str, Tensor]:
        """The client's personal part, initially the model's initial one π⁰ (``{}`` when no parameter is personal).

        Called with the initial model (and for a new client with the global model, whose personal part never
        moves from π⁰: its Δ is 0)."""
        _, personal = self.split(params)
        return {PERSONAL: {k: v.detach().clone() for k, v in personal.items()}} if personal else {}

    def own_personal(self, params: Params, state: dict[str, Tensor], client: ClientRecord) -> Params:
        """The client's own personal part π_i from its state (π⁰ while it has not trained); the global model's
        personal part is not read, as it is never sent."""
        _, personal = self.split(params)
        return {k: state[PERSONAL][k] for k in personal}

    def personal_start(
        self, params: Params, state: dict[str, Tensor], server_state: dict[str, Tensor], client: ClientRecord
    ) -> Params:
        """``(θ, π_i)`` for evaluation: the client's π_i once it has trained, the global personal part otherwise
        (which stays π⁰: its Δ is 0), so a never-trained client does not read its stored state."""
        _, personal = self.split(params)
        return {**params, **started_from(client, self.own_personal(params, state, client), personal)}

    def check_model(self, ctx: ClientContext, params: Params) -> None:  # noqa: B027
        """Refuse, with a message, a model the split does not fit (default: nothing to check)."""

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        """τ joint SGD steps from ``(θ, π_i)`` (one per batch); keep π_i^τ; Δ is θ_i^τ − θ on the shared part and
        0 on the personal part (which is not uploaded)."""
        self.check_model(ctx, params)
        start = {**params, **self.own_personal(params, state, client)}  # the global π is not sent: not read
        w, loss = local_sgd(ctx, start, batches, self.local_lr)
        shared, personal = self.split(w)
        delta = {k: shared[k] - params[k] if k in shared else v.new_zeros(v.shape) for k, v in w.items()}
        return ClientOutput(delta, {PERSONAL: personal} if personal else {}, {}, {"loss": loss})

    # -- exchange and server (docs/communication.md) --------------------------------------------
    def download(self, params: Params, server_state: dict[str, Tensor], client: ClientRecord) -> dict[str, Tensor]:
        """The shared part θ; the personal part never travels."""
        return self.split(params)[0]

    def upload(self, output: ClientOutput) -> dict[str, object]:
        """The shared part of Δ_i (and the extras); the personal part's Δ is not read by the server."""
        return {"delta": self.split(output.delta)[0], "extras": output.extras}

    def aggregate(
        self,
        params: Params,
        outputs: ClientOutput,
        weights: Tensor,
        server_state: dict[str, Tensor],
        clients: ClientRecord,
    ) -> tuple[Params, dict[str, Tensor]]:
        """``Δθ = Σ_i p_i Δθ_i`` on the shared part; 0 on the personal part (the global π stays π⁰)."""
        personal = set(self.personal_names(params))  # by the unstacked parameters: the outputs are stacked
        shared = {k: v for k, v in outputs.delta.items() if k not in personal}
        mean, state = super().aggregate(params, outputs._replace(delta=shared), weights, server_state, clients)
        zeros = tree_zeros_like(params)
        return {k: mean[k] if k in mean else zeros[k] for k in params}, state

    def personalize(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> Params:
        """``finetune_steps`` SGD steps from ``(θ, π_i)`` (π⁰ for a held-out client or one that has not trained)."""
        self.check_model(ctx, params)
        return super().personalize(ctx, params, batches, state, server_state, client)
