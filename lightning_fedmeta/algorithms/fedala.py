"""FedALA: adaptive local aggregation, element-wise, of the global model into the client's local model.

Client k keeps its local model θ_k (after its last local training) and element-wise weights W_k ∈ [0, 1] (ones at
first) on its p highest parameter tensors. Receiving the global model θ, it first forms its local start

    θ̂_k = θ                                    on the lower tensors (the global model's),
    θ̂_k = θ_k + (θ − θ_k) ⊙ W_k                on the p higher tensors,

learning W_k by projected SGD on its own data, with θ and θ_k fixed:

    W_k ← clip_[0,1](W_k − η_W ∇_{θ̂} f_k(θ̂_k; D) ⊙ (θ − θ_k))        (= ∇_W f_k(θ̂_k(W)); one step per batch D)

for ``ala_steps`` batches a round (``ala_start_steps`` at its first aggregation, the authors' start phase). Then it
trains θ̂_k by ``local_steps`` SGD steps (θ_k ← θ̂_k − η ∇f_k), keeps θ_k and W_k, and uploads Δ_k = θ_k − θ; the
server averages (FedAvg). Client k is evaluated with its local start θ̂_k from the current global model, W_k learned
again on its data as at the start of a round (not stored).

Zhang, Hua, Wang, Shen, Guan, Zhang, "FedALA: Adaptive Local Aggregation for Personalized Federated Learning",
AAAI 2023 (arXiv:2212.01197), Algorithm 1 and Eq. (3)-(5).

Where we differ from the authors' code (PFLlib ``utils/ALA.py`` and ``clientala.py``, by the paper's authors; FL-bench
``fedala.py`` follows it):

* Start phase: the authors train W_k until the standard deviation of the last 10 epochs' losses falls below 0.1 (a
  data-dependent loop); clients here run the same program under vmap, so the first aggregation takes a fixed
  ``ala_start_steps`` W steps, later ones ``ala_steps`` (the authors: one pass over a random s = 80 % slice of the
  local data, in batches of ``batch_size``). Our W batches are the round's own mini-batches.
* ``ala_layers`` counts parameter tensors from the end, as the authors' ``layer_idx`` (p = 2: a last ``Linear``'s
  weight and bias); the paper speaks of layers.
* The authors run ALA for every client at every round, before the evaluation (which scores the ALA start). We learn
  W_k when the client is sampled (the start of its training) and, for evaluation, learn it again from its stored
  value without keeping it, so evaluating a client does not change it.
* A client that has not trained has θ_k = θ: its start is θ and its W_k does not move (the gradient is multiplied
  by θ − θ_k = 0), as the authors' "first round" check (θ_k equal to θ: skip ALA).

New clients: a held-out client (or one that has not trained) starts from the global model θ (no local model to
aggregate into); ``finetune_steps`` SGD steps (``finetune_lr``, ``finetune_batch_size``) on its training data follow,
as for every client.

Common arguments: ``local_steps`` SGD steps of the local training (after the W steps; a round draws
``max(ala_steps, ala_start_steps) + local_steps`` mini-batches of ``batch_size``); ``local_lr`` is their rate (η_W is
``eta``); ``finetune_*``: SGD steps after the ALA start before evaluation (evaluation draws
``max(ala_steps, ala_start_steps) + finetune_steps`` batches of ``finetune_batch_size``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedmeta.algorithms.base import (
    Algorithm,
    BatchPlan,
    ClientOutput,
    ClientRecord,
    check_non_negative,
    started_from,
)
from lightning_fedmeta.algorithms.local_steps import local_sgd
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_sub

__all__ = ["FedALA"]

LOCAL = "local"
WEIGHTS = "weights"
STARTED = "started"


class FedALA(Algorithm):
    """FedALA: element-wise learned aggregation of the global model into the local one, then local SGD.

    Args:
        eta: η_W, the rate of the aggregation weights (the authors' default 1.0).
        ala_layers: p, the number of parameter tensors, from the last, that are aggregated with learned weights
            (the others take the global values); ≥ 1 (2: a last ``Linear``'s weight and bias).
        ala_steps: W steps at each aggregation after the first, ≥ 1.
        ala_start_steps: W steps at a client's first aggregation (the start phase), ≥ 1.
        local_steps, local_lr, batch_size, finetune_steps, finetune_lr, finetune_batch_size: see the module
            docstring.

    Client state: ``{"local": {name: tensor}, "weights": {name: tensor}, "started": scalar}`` (θ_k, W_k on the p
    higher tensors, 1.0 once its start phase is done).
    """

    step_budget = True
    name = "fedala"
    summary = "FedALA: element-wise learned local aggregation of the global model into the local one (Zhang et al.)"

    def __init__(
        self,
        eta: float = 1.0,
        ala_layers: int = 2,
        ala_steps: int = 5,
        ala_start_steps: int = 20,
    ) -> None:
        super().__init__()
        check_non_negative("eta", eta)
        for name, value in (("ala_layers", ala_layers), ("ala_steps", ala_steps), ("ala_start_steps", ala_start_steps)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.eta = eta
        self.ala_layers = ala_layers
        self.ala_steps = ala_steps
        self.ala_start_steps = ala_start_steps

    @property
    def weight_steps(self) -> int:
        """W steps a round's plan holds room for: ``max(ala_steps, ala_start_steps)``."""
        return max(self.ala_steps, self.ala_start_steps)

    def round_plan(self) -> BatchPlan:
        """The W steps' batches, then ``local_steps`` batches of local training. Under ``local_epochs`` the base
        epoch plan: the W steps take its first batches, which the local training then also uses."""
        if self.local_epochs is not None:
            return super().round_plan()
        return BatchPlan(steps=self.weight_steps + self.local_steps, per_step=1, batch_size=self.batch_size)

    def eval_plan(self) -> BatchPlan:
        """The W steps' batches, then ``finetune_steps`` batches of fine-tuning (under ``finetune_epochs``: the base
        epoch plan, the W steps on its first batches, as in :meth:`round_plan`)."""
        if self.finetune_epochs is not None:
            return super().eval_plan()
        return BatchPlan(steps=self.weight_steps + self.finetune_steps, per_step=1,
                         batch_size=self.finetune_batch_size)

    def _training_batches(self, batches: Batch, epochs: int | None) -> Batch:
        """The SGD steps' batches: all of them under epochs (the W steps shared them), else those after the W
        steps' ``weight_steps``."""
        return batches if epochs is not None else batches.slice(self.weight_steps)

    def higher(self, params: Params) -> list[str]:
        """Names of the p highest parameter tensors (the last ``ala_layers`` of the model's order)."""
        names = list(params)
        if self.ala_layers > len(names):
            raise ValueError(f"ala_layers={self.ala_layers} exceeds the model's {len(names)} parameter tensors")
        return names[-self.ala_layers:]

    def init_client_state(self, params: Params) -> dict[str, Tensor]:
        """θ_k = the initial global model, W_k = 1, start phase not done."""
        return {
            LOCAL: {k: v.detach().clone() for k, v in params.items()},
            WEIGHTS: {k: torch.ones_like(params[k]) for k in self.higher(params)},
            STARTED: torch.tensor(0.0),
        }

    def aggregate_locally(
        self, ctx: ClientContext, params: Params, state: dict[str, Tensor], batches: Batch, client: ClientRecord
    ) -> tuple[Params, Params]:
        """The local start θ̂_k and the learned W_k, from the first ``weight_steps`` batches (the steps beyond
        ``ala_steps`` count only in the start phase; under epochs a client with fewer batches takes as many W steps
        as it has batches: a W step on an empty batch has a zero gradient)."""
        local = started_from(client, state[LOCAL], params)
        weights = started_from(client, state[WEIGHTS], {k: torch.ones_like(v) for k, v in state[WEIGHTS].items()})
        started = torch.where(client.seen, state[STARTED], torch.zeros_like(state[STARTED]))
        gap = {k: params[k] - local[k] for k in weights}
        frozen = ctx.frozen()
        for t in range(min(self.weight_steps, batches.x.shape[0])):
            start = {**params, **{k: local[k] + gap[k] * weights[k] for k in weights}}
            g = frozen.grad(start, batches.at(t, 0))
            rate = self.eta if t < self.ala_steps else self.eta * (1 - started)
            weights = {k: (w - rate * g[k] * gap[k]).clamp(0.0, 1.0) for k, w in weights.items()}
        return {**params, **{k: local[k] + gap[k] * weights[k] for k in weights}}, weights

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        start, weights = self.aggregate_locally(ctx, params, state, batches, client)
        local, loss = local_sgd(ctx, start, self._training_batches(batches, self.local_epochs), self.local_lr)
        started = torch.where(client.seen, torch.ones_like(state[STARTED]), state[STARTED])
        return ClientOutput(
            delta=tree_sub(local, params),
            state={LOCAL: local, WEIGHTS: weights, STARTED: started},
            extras={},
            metrics={"loss": loss},
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
        """The local start θ̂_k (W_k learned again, not kept), then ``finetune_steps`` SGD steps."""
        start, _ = self.aggregate_locally(ctx, params, state, batches, client)
        return self.finetune(ctx, start, self._training_batches(batches, self.finetune_epochs))
