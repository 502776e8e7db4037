"""PerFedMAML: MAML with per-client initialisations coupled to a server mean.

Every client i keeps its own meta-initialisation θ_i (in the client state store) and the
server keeps their weighted mean θ̄ = Σ_i p_i θ_i over the training clients (p_i = the client's
weight ``client.weight``: ∝ n_i, or uniform, by the module's ``aggregation``), the global model.
The clients jointly minimise
    Σ_i p_i [ L_i(θ_i − α∇L_i(θ_i)) + λ ‖θ_i − θ̄‖² ],
a MAML objective per client (Finn, Abbeel, Levine, ICML 2017) with the mean-regularised
multi-task coupling of Evgeniou & Pontil (KDD 2004) / Hanzely & Richtárik (2020).  When
sampled, client i takes τ meta-steps (default 1), each on a fresh support/query split
(D^tr, D^val) of a mini-batch of its training data:
    θ′_i = θ_i − α ∇L_i(θ_i; D^tr)
    g_i  = ∇L_i(θ′_i; D^val)                 (``second_order=True``: (I − α∇²L_i(θ_i; D^tr)) ∇L_i(θ′_i; D^val))
    θ_i ← θ_i − β (g_i + 2λ (θ_i − θ̄)).
λ = 0 is independent per-client MAML.  The server updates θ̄ to the weighted mean of every
client's current θ_i: it keeps S = Σ_{i seen} p_i θ_i and P = Σ_{i seen} p_i (server state),
adds the sampled clients' changes p_i (θ_i^new − θ_i^old) (and p_i θ_i, p_i for a client's first
round, known from its record's ``seen``), and sets θ̄ = S / P.  A client that has never
trained (including held-out clients, whose p_i is 0) starts from the current θ̄, so θ̄ is also
the weighted mean over *all* training clients when an untrained client's θ_i is read as θ̄.
With the module's ``server_lr = 1`` (enforced: ``server_optimizer_applies = False``) the global
model equals θ̄ exactly.  A client is evaluated after ``finetune_steps`` (default 1) SGD
steps at rate α from its own θ_i (from θ̄ if it never trained).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_fedmeta.algorithms.base import (
    BatchPlan,
    ClientOutput,
    ClientRecord,
    PersonalModel,
    check_non_negative,
)
from lightning_fedmeta.algorithms.fedmaml import (
    BETA_IS_LOCAL_LR,
    META_FINETUNE_DEFAULTS,
    beta_meta_rates,
    maml_meta_gradient,
    maml_plan,
    split_support_query,
)
from lightning_fedmeta.algorithms.local_steps import mean_over_taken_steps
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, has_samples, tree_sub

__all__ = ["PerFedMAML"]

_SUM = "sum"


class PerFedMAML(PersonalModel):
    """Per-client MAML initialisations θ_i pulled towards their mean θ̄ by ``λ‖θ_i − θ̄‖²``.

    Run it with the module's ``server_lr: 1`` (the default): the server's update is
    ``θ̄_new − θ̄`` and any other rate makes the global model differ from the clients' mean.

    Args:
        alpha: α, the inner adaptation step size, ``>= 0``; also the evaluation fine-tuning rate.
        beta: β, the clients' meta step size, ``>= 0``.
        lam: λ, the coupling strength, ``>= 0`` (0 = independent per-client MAML). The coupling
            step contracts θ_i − θ̄ by ``1 − 2λβ``, so keep ``2λβ < 1``.
        second_order: use the exact MAML gradient (one Hessian-vector product per step).
        local_steps: τ, meta-steps a sampled client takes per round.
        batch_size: B, the size of each of D^tr and D^val (a batch of 2B is drawn and split);
            ``None`` = the client's whole training set, split in two.
        finetune_steps: SGD steps from θ_i before a client is evaluated (default 1).
        finetune_lr: rate of those steps (default α).
        finetune_batch_size: batch size of those steps (``None`` = the client's whole training set).

    The common argument ``local_lr`` is refused (``unused_args``): the local step size is ``beta``.
    """

    name = "perfedmaml"
    step_budget = True
    unused_args = BETA_IS_LOCAL_LR
    common_defaults = {"local_steps": 1, **META_FINETUNE_DEFAULTS}
    server_optimizer_applies = False
    summary = "PerFedMAML: per-client MAML initialisations θ_i with λ‖θ_i − θ̄‖² coupling to their mean"

    def __init__(
        self,
        alpha: float = 0.01,
        beta: float = 0.05,
        lam: float = 0.5,
        second_order: bool = False,
        finetune_lr: float | None = None,
    ) -> None:
        rates = beta_meta_rates(alpha, beta, finetune_lr)
        check_non_negative("lam", lam)
        super().__init__(**rates)
        self.alpha, self.beta, self.lam = alpha, beta, lam
        self.second_order = bool(second_order)

    def round_plan(self) -> BatchPlan:
        """τ batches of 2B samples, each split into D^tr and D^val (as :class:`FedMAML`, :func:`maml_plan`)."""
        return maml_plan(self)

    # -- state ---------------------------------------------------------------------------------
    def init_server_state(self, params: Params) -> dict[str, Tensor]:
        """S = Σ_{i seen} p_i θ_i and P = Σ_{i seen} p_i, both zero before the first round."""
        state: dict[str, Any] = {_SUM: {n: torch.zeros_like(v) for n, v in params.items()}}
        ref = next(iter(params.values()))
        state["total"] = torch.zeros((), dtype=ref.dtype, device=ref.device)
        return state

    # -- client and server ---------------------------------------------------------------------
    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        theta_old = self.personal_start(params, state, server_state, client)
        theta = theta_old
        losses, meta_losses = [], []
        for t in range(batches.x.shape[0]):
            support, query = split_support_query(batches.at(t, 0))
            g, loss, meta_loss = maml_meta_gradient(ctx, theta, support, query, self.alpha, self.second_order)
            rate = self.beta * has_samples(batches.at(t, 0)).to(loss.dtype)  # an empty step (padding) is no step
            theta = {k: theta[k] - rate * (g[k] + 2.0 * self.lam * (theta[k] - params[k])) for k in theta}
            losses.append(loss)
            meta_losses.append(meta_loss)
        ref = next(iter(theta.values()))
        seen, p = client.seen.to(ref.dtype), client.weight.to(ref.dtype)
        # change of S: p_i (θ_new − θ_old) for a returning client, p_i θ_new for a first-time one
        extras: dict[str, Any] = {_SUM: {k: p * (theta[k] - seen * theta_old[k]) for k in theta}}
        extras["total"] = p * (1.0 - seen)
        new_state = {"personal": theta}
        metrics = {"loss": mean_over_taken_steps(losses, batches),
                   "meta_loss": mean_over_taken_steps(meta_losses, batches)}
        return ClientOutput(tree_sub(theta, params), new_state, extras, metrics)

    def aggregate(
        self,
        params: Params,
        outputs: ClientOutput,
        weights: Tensor,
        server_state: dict[str, Tensor],
        clients: ClientRecord,
    ) -> tuple[Params, dict[str, Tensor]]:
        """``Δ = θ̄_new − θ̄`` with ``θ̄_new = S / P`` after adding the sampled clients' changes.

        The module's ``weights`` (normalised over the sampled clients) are not used: θ̄ weighs
        each client by its global p_i (``client.weight``).
        """
        new_state = {
            _SUM: {k: v + outputs.extras[_SUM][k].sum(0) for k, v in server_state[_SUM].items()},
            "total": server_state["total"] + outputs.extras["total"].sum(0),
        }
        total = new_state["total"].clamp_min(torch.finfo(new_state["total"].dtype).tiny)
        delta = {k: new_state[_SUM][k] / total - v for k, v in params.items()}
        return delta, new_state

    # -- communication -------------------------------------------------------------------------
    def upload(self, output: ClientOutput) -> dict[str, Any]:
        """The change of S, p_i (θ_i − θ_i_old) (d floats), and of P (1): the server forms θ̄ = S / P from them
        (Δ_i is not read)."""
        return {"extras": output.extras}
