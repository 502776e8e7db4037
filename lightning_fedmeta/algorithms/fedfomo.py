"""FedFomo: first-order model optimisation for personalised federated learning (Zhang, Sapra, Fidler, Yeung,
Alvarez, "Personalized Federated Learning with First Order Model Optimization", ICLR 2021, arXiv:2012.08565).

No global model: every client keeps its own θ_i, and the server keeps a copy of every client's latest upload θ_n
and an affinity matrix P (P = I at the start). Round t, sampled client i (current model θ_i) receives the M
stored models with the largest affinities P_{i,·} and weights them by the first-order improvement they bring on
a validation batch V:

    w_n = (L_V(θ_i) − L_V(θ_n)) / (‖θ_n − θ_i‖ + 10⁻⁵),        w_n⁺ = max(w_n, 0)
    θ_i ← θ_i + Σ_n (w_n⁺ / Σ_m w_m⁺) (θ_n − θ_i)             (θ_i unchanged when every w_n ≤ 0)

then takes τ SGD steps ``θ_i ← θ_i − η ∇L(θ_i; D_s)`` and uploads θ_i and its raw weights; the server stores θ_i
and adds P_{i,n} += w_n for the models it sent. Client i is evaluated with its θ_i. A client that has not
trained yet has the common initialisation θ⁰ (the global parameters, which never move: a Δ of zero is returned
to the loop).

Where we differ from the authors' code (the paper's Algorithm 1 and PFLlib's clientfomo/serverfomo; we follow
PFLlib's rule, which the paper's eq. (5) equals when Σ w⁺ > 0):
* The authors' code (github:NVlabs/FedFomo) has several variants we did not reproduce (other baseline models,
  leave-one-out averages, softmax weighting, ε-greedy selection with decay) and divides by the distance without
  PFLlib's +10⁻⁵; we implement the paper's main rule with PFLlib's +10⁻⁵.
* Validation data: PFLlib holds out the last 20% of each client's training set as V and trains on the rest. Here
  V is one extra mini-batch of the client's training data drawn each round (batch 0 of the round; the τ SGD
  steps use batches 1..τ), so all training data is trained on and V is not held out.
* Which models are sent: PFLlib sends the top-M of P_i (its own copy included); the paper adds ε-greedy
  exploration, which we (as PFLlib) leave out. Ties in P are broken by the lower client index (a stable sort).
* First round: PFLlib sends nothing before the first uploads; here the stored copies are all θ⁰, so every
  w_n = 0 and θ_i is unchanged: the same round.
* The aggregation is written θ_i + Σ c_n (θ_n − θ_i) (the paper's form); PFLlib computes Σ c_n θ_n, equal up to
  rounding since Σ c_n = 1.

New clients: a held-out client starts from θ⁰ and applies the FedFomo weighting to *all* K stored models (it has
no affinity row yet) on its own validation batch (batch 0 of its evaluation batches), then takes
``finetune_steps`` SGD steps (``finetune_lr``) on the rest. A trained client is evaluated with its θ_i (after
``finetune_steps`` SGD steps from it, if any).

Common arguments: ``local_steps`` τ (the round draws τ + 1 batches of ``batch_size``: one for V), ``local_lr`` η;
``finetune_steps``/``finetune_lr``/``finetune_batch_size`` as above (the evaluation draws ``finetune_steps`` + 1
batches). All are used.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from lightning_fedmeta.algorithms.base import BatchPlan, ClientOutput, ClientRecord, PersonalModel
from lightning_fedmeta.algorithms.local_steps import local_sgd
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_zeros_like

__all__ = ["FedFomo", "first_order_combination"]

PERSONAL = "personal"
MODELS = "models"
AFFINITY = "affinity"
WEIGHTS = "weights"


def first_order_combination(
    ctx: ClientContext, own: Params, candidates: Params, val: Batch
) -> tuple[Params, Tensor]:
    """``(θ_i + Σ_n c_n (θ_n − θ_i), w)``: FedFomo's weights ``w_n = (L(θ_i) − L(θ_n)) / (‖θ_n − θ_i‖ + 1e-5)`` of
    the ``candidates`` (stacked ``[M, ...]``) on the batch ``val``, and ``c_n = w_n⁺ / Σ w⁺`` (all 0 when Σ w⁺ = 0)."""
    base = ctx.loss(own, val)
    count = next(iter(candidates.values())).shape[0]
    weights = []
    for j in range(count):
        theta = {k: v[j] for k, v in candidates.items()}
        dist = torch.sqrt(sum(((theta[k] - own[k]) ** 2).sum() for k in own))
        weights.append((base - ctx.loss(theta, val)) / (dist + 1e-5))
    w = torch.stack(weights)
    positive = w.clamp_min(0.0)
    total = positive.sum()
    coeff = torch.where(total > 0, positive / total.clamp_min(torch.finfo(total.dtype).tiny), torch.zeros_like(w))
    combined = {}
    for k, v in own.items():
        c = coeff.to(v.dtype).reshape(-1, *([1] * v.dim()))
        combined[k] = v + (c * (candidates[k] - v.unsqueeze(0))).sum(0)
    return combined, w


class FedFomo(PersonalModel):
    """Each client combines the stored models of its M closest peers, weighted by their validation improvement.

    Args:
        models_per_client: M ≥ 1, stored models sent to a client each round (PFLlib's ``M``, default 5).
        local_steps, local_lr, batch_size, finetune_steps, finetune_lr, finetune_batch_size: see
            :class:`~lightning_fedmeta.algorithms.base.Algorithm` (one extra batch each: the validation batch).

    Client state: ``{"personal": {name: tensor}}`` (θ_i). Server state: ``models`` (every client's latest θ_i,
    ``[K, ...]`` per parameter) and ``affinity`` ``[K, K]`` (P).
    """

    step_budget = True
    name = "fedfomo"
    summary = "FedFomo: clients weight peers' models by validation-loss improvement per distance (Zhang et al.)"
    server_optimizer_applies = False

    def __init__(
        self,
        models_per_client: int = 5,
    ) -> None:
        super().__init__()
        if not isinstance(models_per_client, int) or models_per_client < 1:
            raise ValueError(f"models_per_client must be an integer >= 1, got {models_per_client!r}")
        self.models_per_client = models_per_client
        self._num_clients: int | None = None

    # -- plans and state ----------------------------------------------------------------------
    def round_plan(self) -> BatchPlan:
        """The base plan plus one batch, first: the validation batch V. Under ``local_epochs`` the base epoch plan
        as it is: V is the first batch of the first epoch, which the τ = E·⌈n_i/B⌉ SGD steps then also use."""
        plan = super().round_plan()
        return plan if plan.epochs is not None else dataclasses.replace(plan, steps=plan.steps + 1)

    def eval_plan(self) -> BatchPlan:
        """The base plan plus one batch, first: a new client's validation batch (under ``finetune_epochs`` the
        base epoch plan: V is the first fine-tuning batch, as in :meth:`round_plan`)."""
        plan = super().eval_plan()
        return plan if plan.epochs is not None else dataclasses.replace(plan, steps=plan.steps + 1)

    @staticmethod
    def _training_batches(batches: Batch, epochs: int | None) -> Batch:
        """The SGD steps' batches: all of them under epochs (V is the first), else batches 1.. (V held apart)."""
        return batches if epochs is not None else batches.slice(1)

    def bind_clients(self, clients: ClientRecord, label_counts: Tensor) -> None:
        """Record K, the number of clients (the server keeps a model per client)."""
        self._num_clients = int(clients.index.numel())

    def init_server_state(self, params: Params) -> dict[str, Tensor]:
        """Every stored model θ⁰; P = I."""
        if self._num_clients is None:
            raise RuntimeError("FedFomo.init_server_state needs the clients: call bind_clients(clients, "
                               "label_counts) first (FederatedModule.attach_data does)")
        k = self._num_clients
        first = next(iter(params.values()))
        return {
            MODELS: {n: v.detach().unsqueeze(0).repeat(k, *([1] * v.dim())).clone() for n, v in params.items()},
            AFFINITY: torch.eye(k, dtype=first.dtype, device=first.device),
        }

    # -- client -------------------------------------------------------------------------------
    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        """Combine the top-M stored models on batch 0, then τ SGD steps on batches 1..τ (under ``local_epochs``:
        on every batch, batch 0 included); upload θ_i and w."""
        own = state[PERSONAL]
        candidates = self.download(params, server_state, client)[MODELS]
        combined, w = first_order_combination(ctx, own, candidates, batches.at(0, 0))
        rest = self._training_batches(batches, self.local_epochs)
        trained, loss = local_sgd(ctx, combined, rest, self.local_lr)
        return ClientOutput(
            delta=tree_zeros_like(params),
            state={PERSONAL: trained},
            extras={WEIGHTS: w.to(server_state[AFFINITY].dtype)},
            metrics={"loss": loss},
        )

    # -- exchange (docs/communication.md) ------------------------------------------------------
    def selected(self, affinity: Tensor, index: Tensor) -> Tensor:
        """The stored models sent to the clients ``index`` (``[..., M]``): the top-M of their rows of P, ties to
        the lower client index (a stable sort). The server computes it at download and again at aggregation
        (P changes only there), so the indices never travel."""
        rows = torch.index_select(affinity, 0, index.reshape(-1).long())
        m = min(self.models_per_client, affinity.shape[0])
        return torch.sort(rows, dim=-1, descending=True, stable=True).indices[:, :m].reshape(*index.shape, m)

    def download(self, params: Params, server_state: dict[str, Tensor], client: ClientRecord) -> dict[str, Tensor]:
        """The M selected stored models ``[M, ...]`` (in the order of :meth:`selected`); θ⁰ and P stay put."""
        chosen = self.selected(server_state[AFFINITY], client.index)
        return {MODELS: {k: torch.index_select(v, 0, chosen) for k, v in server_state[MODELS].items()}}

    def upload(self, output: ClientOutput) -> dict[str, object]:
        """The trained θ_i and the M raw weights w (in the order the models came); the zero Δ is not sent."""
        return {"state": {PERSONAL: output.state[PERSONAL]}, "extras": {WEIGHTS: output.extras[WEIGHTS]}}

    # -- server -------------------------------------------------------------------------------
    def aggregate(
        self,
        params: Params,
        outputs: ClientOutput,
        weights: Tensor,
        server_state: dict[str, Tensor],
        clients: ClientRecord,
    ) -> tuple[Params, dict[str, Tensor]]:
        """Store the sampled clients' θ_i and add their weights to their rows of P; Δ = 0."""
        idx = clients.index.to(torch.long)
        stored, personal = server_state[MODELS], outputs.state[PERSONAL]
        new_state = dict(server_state)
        new_state[MODELS] = {n: stored[n].index_copy(0, idx, personal[n].to(stored[n])) for n in stored}
        affinity = server_state[AFFINITY]
        chosen = self.selected(affinity, idx)  # [n, M]: what each client was sent
        added = torch.zeros(idx.numel(), affinity.shape[1], dtype=affinity.dtype, device=affinity.device)
        added = added.scatter(1, chosen, outputs.extras[WEIGHTS].to(affinity))
        new_state[AFFINITY] = affinity.index_add(0, idx, added)
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
        """A new client: θ⁰ combined with all K stored models on batch 0; others: θ_i. Then ``finetune_steps``
        SGD steps on the remaining batches (under ``finetune_epochs``: on every batch)."""
        start = self.personal_start(params, state, server_state, client)
        combined, _ = first_order_combination(ctx, params, server_state[MODELS], batches.at(0, 0))
        start = {k: torch.where(client.is_new, combined[k], v) for k, v in start.items()}
        return self.finetune(ctx, start, self._training_batches(batches, self.finetune_epochs))
