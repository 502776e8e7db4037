"""APFL: a personal model v_k mixed with the global one, α_k v_k + (1 − α_k) w, with an adaptive mixing weight.

Client k keeps v_k and α_k ∈ [0, 1]. Receiving w, it takes ``local_steps`` steps, each on one mini-batch D and with
every gradient at the values before the step (v̄_k = α_k v_k + (1 − α_k) w_k the mixed model):

    w_k ← w_k − η ∇f_k(w_k; D)                                      (the local copy of the global model: FedAvg)
    v_k ← v_k − η ∇_v f_k(v̄_k; D) = v_k − η α_k ∇f_k(v̄_k; D)
    α_k ← clip_[0,1](α_k − η_α ∇_α f_k(v̄_k; D)) = clip(α_k − η_α ⟨v_k − w_k, ∇f_k(v̄_k; D)⟩)   (if adaptive)

and uploads Δ_k = w_k − w; the server averages (FedAvg). Client k is evaluated with α_k v_k + (1 − α_k) w.
α = 0 (fixed): every client is evaluated with w, the FedAvg model; α = 1 (fixed): v_k is plain local SGD.

Deng, Kamani, Mahdavi, "Adaptive Personalized Federated Learning", arXiv:2003.13461 (2020), Algorithm 1 and
its adaptive α (Section 3.2, the α step of Eq. (10)).

Where we differ from the authors' code (FedTorch ``comms/trainings/federated/apfl.py`` with ``flow_utils.
alpha_update``, by the paper's authors; also PFLlib ``clientapfl.py``, FL-bench ``apfl.py``):

* We mix parameters, as the paper does. The authors' code (and FL-bench) mixes the two models' outputs,
  α h_v(x) + (1 − α) h_w(x); the contract evaluates one model of the architecture, which the paper's mixed model is.
  For a linear model the two are the same. PFLlib trains v_k on its own loss and overwrites it with the mixture
  after each round; we follow neither.
* α is updated at every local step (the paper's Algorithm 1); the authors' code updates it once a round (first
  step of the round), with an extra decay term 0.02 α in its gradient; we follow the paper and have no decay.
* The authors' α step uses the learning rate of the models; ours is ``alpha_lr`` (default: ``local_lr``, theirs).
* The mixed model is evaluated with the current global w (FL-bench's choice); the paper's analysis uses the client's
  last local w_k.

New clients: a held-out client (or one that has not trained) has v_k = w and α_k = ``alpha``, so it is evaluated
with w. With ``finetune_steps > 0`` a client (new or trained) first takes that many personal steps, the rule's
second and third lines with w fixed at the global model, on its training data (rate ``finetune_lr``).

Common arguments: ``local_steps`` steps per round on batches of ``batch_size``, each two gradient evaluations (at
w_k and at v̄_k, same batch); ``local_lr`` is η (the paper uses one rate for w and v); ``finetune_*`` as above.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedmeta.algorithms.base import Algorithm, ClientOutput, ClientRecord, check_non_negative, check_range
from lightning_fedmeta.algorithms.local_steps import mean_over_taken_steps
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_axpy, tree_dot, tree_sub

__all__ = ["APFL", "mix"]

PERSONAL = "personal"
ALPHA = "alpha"


def mix(alpha: Tensor, v: Params, w: Params) -> Params:
    """The mixed model ``α v + (1 − α) w``."""
    return {k: alpha.to(v[k].dtype) * v[k] + (1 - alpha.to(v[k].dtype)) * w[k] for k in v}


class APFL(Algorithm):
    """APFL: FedAvg for w, plus a personal model v_k and a mixing weight α_k per client.

    Args:
        alpha: α's start (the paper tries 0.25, 0.5, 0.75; 0.5 as FL-bench); with ``adaptive=False``, α throughout.
        adaptive: learn α_k by the α step (the paper's adaptive APFL); ``False``: α fixed.
        alpha_lr: η_α (``None`` = ``local_lr``).
        local_steps, local_lr, batch_size, finetune_steps, finetune_lr, finetune_batch_size: see the module
            docstring.

    Client state: ``{"personal": {name: tensor}, "alpha": scalar}`` (read only once the client has trained).
    """

    step_budget = True
    name = "apfl"
    summary = "APFL: personal v_k mixed with the global w as α_k v_k + (1 − α_k) w, α_k learned (Deng et al.)"

    def __init__(
        self,
        alpha: float = 0.5,
        adaptive: bool = True,
        alpha_lr: float | None = None,
    ) -> None:
        super().__init__()
        check_range("alpha", alpha, 0.0, 1.0)
        if not isinstance(adaptive, bool):
            raise ValueError(f"adaptive must be True or False, got {adaptive!r}")
        if alpha_lr is not None:
            check_non_negative("alpha_lr", alpha_lr)
        self.alpha = float(alpha)
        self.adaptive = adaptive
        self.alpha_lr = self.local_lr if alpha_lr is None else alpha_lr

    def init_client_state(self, params: Params) -> dict[str, Tensor]:
        """v_k = the initial global model, α_k = ``alpha``."""
        return {PERSONAL: {k: v.detach().clone() for k, v in params.items()}, ALPHA: torch.tensor(self.alpha)}

    def personal_state(self, params: Params, state: dict[str, Tensor], client: ClientRecord) -> tuple[Params, Tensor]:
        """``(v_k, α_k)`` of a client that has trained; ``(w, alpha)`` for one that has not."""
        v = {k: torch.where(client.seen, state[PERSONAL][k], params[k]) for k in params}
        return v, torch.where(client.seen, state[ALPHA], torch.full_like(state[ALPHA], self.alpha))

    def _personal_step(
        self, ctx: ClientContext, v: Params, alpha: Tensor, w: Params, batch: Batch, lr: float
    ) -> tuple[Params, Tensor, Tensor]:
        """``v − η α ∇f(v̄)`` and ``clip(α − η_α ⟨v − w, ∇f(v̄)⟩)`` (α unchanged unless adaptive), and ``f(v̄)``."""
        loss, g = ctx.loss_and_grad(mix(alpha, v, w), batch)
        new_v = tree_axpy(-lr * alpha, g, v)
        if self.adaptive:
            alpha = (alpha - self.alpha_lr * tree_dot(tree_sub(v, w), g).to(alpha.dtype)).clamp(0.0, 1.0)
        return new_v, alpha, loss

    def _apfl_step(
        self, ctx: ClientContext, w: Params, v: Params, alpha: Tensor, batch: Batch
    ) -> tuple[Params, Params, Tensor, Tensor, Tensor]:
        """One local step of w (SGD) and of (v, α), all from the values before the step."""
        w_next, loss = ctx.sgd_step(w, batch, self.local_lr)
        v, alpha, personal_loss = self._personal_step(ctx, v, alpha, w, batch, self.local_lr)
        return w_next, v, alpha, loss, personal_loss

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        w = params
        v, alpha = self.personal_state(params, state, client)
        losses, personal_losses = [], []
        for t in range(batches.x.shape[0]):
            w, v, alpha, loss, personal_loss = ctx.step(self._apfl_step, w, v, alpha, batches.at(t, 0))
            losses.append(loss)
            personal_losses.append(personal_loss)
        return ClientOutput(
            delta=tree_sub(w, params),
            state={PERSONAL: v, ALPHA: alpha},
            extras={},
            metrics={"loss": mean_over_taken_steps(losses, batches),
                     "personal_loss": mean_over_taken_steps(personal_losses, batches), "alpha": alpha},
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
        """``finetune_steps`` personal steps with w fixed at the global model, then ``α_k v_k + (1 − α_k) w``."""
        v, alpha = self.personal_state(params, state, client)
        for t in range(batches.x.shape[0]):
            v, alpha, _ = self._personal_step(ctx, v, alpha, params, batches.at(t, 0), self.finetune_lr)
        return mix(alpha, v, params)
