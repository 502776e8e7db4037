"""Ditto (Li, Hu, Beirami, Smith, "Ditto: Fair and Robust Federated Learning Through Personalization",
ICML 2021, Algorithm 1).

Bi-level objective:  global  min_w G(F_1(w), …, F_K(w))  (FedAvg's objective here), and for each client

    min_{v_k}  h_k(v_k; w*) = F_k(v_k) + (λ/2) ‖v_k − w*‖².

Round t, sampled client k receiving the global model wᵗ:
    global part (FedAvg):   w_k ← w_k − η ∇F_k(w_k; Dₜ),  τ steps from w_k = wᵗ;  uploads Δ_k = w_k − wᵗ
    personal part:          v_k ← v_k − η_p (∇F_k(v_k; Dₜ) + λ (v_k − wᵗ)),  s steps from its stored v_k
Server:  wᵗ⁺¹ = wᵗ + β Σ_{k∈S} p_k Δ_k.   Clients are evaluated with v_k. A client that has never
trained (never sampled yet, or held out) has no personal model yet: its v_k starts from, and it is
evaluated with, the current global model wᵗ.
λ = 0: v_k is purely local SGD (independent of w); λ → ∞: v_k → w (one shared model).
"""

from __future__ import annotations

from torch import Tensor

from lightning_fedmeta.algorithms.base import (
    BatchPlan,
    ClientOutput,
    ClientRecord,
    PersonalModel,
    check_non_negative,
    phase_epochs,
)
from lightning_fedmeta.algorithms.local_steps import prox_sgd
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_sub
from lightning_fedmeta.client.sampling import phase_lengths

__all__ = ["Ditto"]


class Ditto(PersonalModel):
    """FedAvg for the global model plus a personal model per client pulled towards it.

    Args:
        lam: λ ≥ 0 of ``(λ/2)‖v_k − w‖²`` (the paper tunes λ per data set from a small grid; 0.1 here).
            Stability of the personal step needs ``λ η_p < 1`` for large λ.
        personal_steps: s, personal SGD steps per round (``None`` = ``local_steps``, as in the paper's
            experiments).
        personal_lr: η_p (``None`` = ``local_lr``).
        personal_epochs: s counted in epochs over the client's rows, with ``local_epochs`` (``None`` =
            ``local_epochs``; PFLlib's ``plocal_epochs``, personal, beside ``local_epochs``, global).
        local_steps: τ, FedAvg local steps of the global model.
        local_lr: η.
        batch_size, finetune_steps, finetune_lr, finetune_batch_size: see
            :class:`~lightning_fedmeta.algorithms.base.Algorithm` (fine-tuning starts from v_k).

    Each round a client draws ``τ + s`` mini-batches: the first τ for the global model, the last s
    for its personal model. Under ``local_epochs`` (E) the round is two phases of epochs, ``(E, E_p)`` with
    ``E_p = personal_epochs``: client ``c`` takes ``E·nb_c`` global then ``E_p·nb_c`` personal steps
    (``nb_c = ⌈n_c/B⌉``), each phase in its own block of the step axis, padded with empty steps
    (:func:`~lightning_fedmeta.client.sampling.phase_lengths`); both phases skip empty steps.
    Client state: ``{"personal": {name: tensor}}``, the personal model (read only once the client has trained:
    before that, its personal model is the current global one).
    """

    name = "ditto"
    summary = "Ditto: FedAvg global model + personal v_k on F_k(v) + λ/2‖v − w‖² (Li et al., 2021)"
    step_budget = True

    def __init__(
        self,
        lam: float = 0.1,
        personal_steps: int | None = None,
        personal_lr: float | None = None,
        personal_epochs: int | None = None,
    ) -> None:
        super().__init__()
        check_non_negative("lam", lam)
        if personal_steps is not None and (not isinstance(personal_steps, int) or personal_steps < 1):
            raise ValueError(f"personal_steps must be an integer >= 1 (or None = local_steps), got {personal_steps!r}")
        if personal_lr is not None:
            check_non_negative("personal_lr", personal_lr)
        self.lam = lam
        self.personal_steps = self.local_steps if personal_steps is None else personal_steps
        self.personal_lr = self.local_lr if personal_lr is None else personal_lr
        self.personal_epochs = phase_epochs("personal_epochs", personal_epochs, self.local_epochs, "personal_steps")

    def round_plan(self) -> BatchPlan:
        """``τ + s`` batches: τ for the global (FedAvg) model, then s for the personal model; under ``local_epochs``
        the epochs of the two phases, ``(local_epochs, personal_epochs)``."""
        if self.local_epochs is not None:
            return BatchPlan(steps=0, per_step=1, batch_size=self.batch_size,
                             epochs=(self.local_epochs, self.personal_epochs), drop_last=self.drop_last)
        return BatchPlan(steps=self.local_steps + self.personal_steps, per_step=1, batch_size=self.batch_size)

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        tau, s = phase_lengths(batches.x.shape[0], self.round_plan()) if self.local_epochs else (
            self.local_steps, self.personal_steps)
        w_local, loss = prox_sgd(ctx, params, batches, self.local_lr, 0.0, params, 0, tau)
        v = self.personal_start(params, state, server_state, client)
        v_new, personal_loss = prox_sgd(ctx, v, batches, self.personal_lr, self.lam, params, tau, s)
        return ClientOutput(
            delta=tree_sub(w_local, params),
            state={"personal": v_new},
            extras={},
            metrics={"loss": loss, "personal_loss": personal_loss},
        )
