"""Personal layers, shared rest: the common client of FedBN and LG-FedAvg.

The parameters split by name into a shared part θ (aggregated) and a personal part π_i (kept by client i in the
client state store, ``{"personal": {name: tensor}}``); which names are personal is each algorithm's choice
(:meth:`PersonalLayers.personal_names`: FedBN the normalisation layers, LG-FedAvg everything below the global
head). Client i, receiving the global model (θ, π̄):

    (θ_i, π_i)⁰ = (θ, π_i)              (π̄, the running mean of the personal parts, while i has not trained),
    (θ_i, π_i)ᵗ = (θ_i, π_i)ᵗ⁻¹ − η ∇F_i((θ_i, π_i)ᵗ⁻¹; Dₜ),   t = 1..τ   (joint SGD: :func:`local_sgd`),

keeps π_i^τ and uploads Δ_i = (θ_i^τ − θ, π_i^τ − π̄). The server takes the usual step on both parts,
(θ, π̄) ← (θ, π̄) + β Σ_{i∈S} p_i Δ_i: θ is FedAvg's model and π̄, which no trained client reads, tracks the mean of
the personal parts; it is where a client that has not trained yet starts, and what a held-out client is evaluated
with (after ``finetune_steps`` SGD steps on its own data, if any). This is FedPer's client
(:class:`~lightning_fedmeta.algorithms.shared_representation.FedPer`) with the personal part chosen by the
subclass and written on :func:`local_sgd`, so a step beyond a straggler's budget is not taken (``step_budget``).
"""

from __future__ import annotations

from abc import abstractmethod

from torch import Tensor

from lightning_fedmeta.algorithms.base import Algorithm, ClientOutput, ClientRecord, started_from
from lightning_fedmeta.algorithms.local_steps import local_sgd
from lightning_fedmeta.functional import Batch, ClientContext, Params, tree_sub

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
        """The client's personal part, initially the global one (``{}`` when no parameter is personal)."""
        _, personal = self.split(params)
        return {PERSONAL: {k: v.detach().clone() for k, v in personal.items()}} if personal else {}

    def own_personal(self, params: Params, state: dict[str, Tensor], client: ClientRecord) -> Params:
        """The client's own personal part π_i, or the global π̄ while it has not trained (:func:`started_from`)."""
        _, personal = self.split(params)
        if not personal:
            return {}
        return started_from(client, {k: state[PERSONAL][k] for k in personal}, personal)

    def personal_start(
        self, params: Params, state: dict[str, Tensor], server_state: dict[str, Tensor], client: ClientRecord
    ) -> Params:
        """``(θ, π_i)``: the global shared part with the client's personal part (π̄ while it has not trained)."""
        return {**params, **self.own_personal(params, state, client)}

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
        """τ joint SGD steps from ``(θ, π_i)`` (one per batch); keep π_i^τ, upload the whole change."""
        self.check_model(ctx, params)
        w, loss = local_sgd(ctx, self.personal_start(params, state, server_state, client), batches, self.local_lr)
        _, personal = self.split(w)
        return ClientOutput(tree_sub(w, params), {PERSONAL: personal} if personal else {}, {}, {"loss": loss})

    def personalize(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> Params:
        """``finetune_steps`` SGD steps from ``(θ, π_i)`` (π̄ for a held-out client or one that has not trained)."""
        self.check_model(ctx, params)
        return super().personalize(ctx, params, batches, state, server_state, client)
