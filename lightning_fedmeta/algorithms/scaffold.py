"""SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, ICML 2020, Algorithm 1, option II),
for the weighted objective f(x) = Σ_i p_i f_i(x) that FedAvg and FedProx minimise here.

Server control variate c, client control variates c_i (kept in the client state store), η_l
the local rate, τ local steps.  Client i, from y = x:
    y ← y − η_l (∇f_i(y; Dₜ) − c_i + c)                         (τ times)
    c_i⁺ = c_i − c + (x − y) / (K η_l)                           (option II; K = τ, or the client's budget of
                                                                  local steps under model.local_steps_dist)
uploads Δy_i = y − x and Δc_i = c_i⁺ − c_i, and stores c_i ← c_i⁺.  Server:
    x ← x + η_g Σ_{i∈S} p̃_i Δy_i          (p̃ = the round's weights; η_g = server_lr, the server optimizer)
    c ← c + Σ_{i∈S} p_i Δc_i              (p_i = the client's weight in the objective, ``client.weight``).

Why c is weighted by p_i.  The correction −c_i + c replaces the client gradient ∇f_i by an
estimate of the gradient of the objective, so c must estimate ∇f = Σ_i p_i ∇f_i: c = Σ_i p_i c_i
over all N training clients. Only the sampled clients change their c_i, so the server keeps this
identity exactly by adding Σ_{i∈S} p_i Δc_i. The paper states the algorithm for the uniform
objective f = (1/N) Σ_i f_i (its eq. (1) and Algorithm 1, line 17: c ← c + (|S|/N)·(1/|S|) Σ_{i∈S} Δc_i,
i.e. c = (1/N) Σ_i c_i); with p_i = 1/N (``aggregation="uniform"``) the two updates are identical.
At a fixed point with full participation and full-batch gradients, c_i = ∇f_i(x), Δy_i = −τη_l c,
so x is stationary iff Σ_i p_i ∇f_i(x) = 0: the minimiser of the weighted objective, the one
FedAvg and FedProx target. Averaging c uniformly while the model is averaged with p_i ∝ n_i (as
this file did before) makes SCAFFOLD converge to the minimiser of the *unweighted* mean instead.
The control variates correct client drift: on heterogeneous clients SCAFFOLD converges to
the global minimiser where FedAvg with many local steps settles elsewhere.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_fedmeta.algorithms.base import Algorithm, ClientOutput, ClientRecord
from lightning_fedmeta.algorithms.local_steps import mean_over_taken_steps
from lightning_fedmeta.client.functional import (
    Batch,
    ClientContext,
    Params,
    has_samples,
    tree_sub,
    tree_weighted_sum,
    tree_zeros_like,
)

__all__ = ["Scaffold"]


class Scaffold(Algorithm):
    """SCAFFOLD with option-II control variates (local rate must be > 0)."""

    name = "scaffold"
    summary = "SCAFFOLD: local SGD corrected by control variates c − c_i (Karimireddy et al., 2020)"
    step_budget = True

    def __init__(self) -> None:
        super().__init__()
        if not self.local_lr > 0:
            raise ValueError(f"SCAFFOLD needs local_lr > 0 (option II divides by τ·η_l), got {self.local_lr!r}")

    def init_server_state(self, params: Params) -> dict[str, Tensor]:
        return {"c": tree_zeros_like(params)}

    def init_client_state(self, params: Params) -> dict[str, Tensor]:
        return {"c_i": tree_zeros_like(params)}

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        c = {k: server_state["c"][k] for k in params}
        c_i = {k: state["c_i"][k] for k in params}
        y = params
        losses = []
        for t in range(batches.x.shape[0]):
            y, loss = ctx.step(self.corrected_step, y, batches.at(t, 0), c_i, c)
            losses.append(loss)
        # K = the steps this client took (all τ of them, or a straggler's budget: empty steps are not taken);
        # K·η_l in float64 and then float32, exactly as the Python product τ·η_l of the full round
        taken = (batches.mask.reshape(batches.mask.shape[0], -1).sum(1) > 0).sum()
        denom = taken.to(torch.float64) * self.local_lr
        c_new = {k: c_i[k] - c[k] + (params[k] - y[k]) / denom for k in params}
        delta_c = tree_sub(c_new, c_i)
        return ClientOutput(
            delta=tree_sub(y, params),
            state={"c_i": c_new},
            extras={"dc": delta_c},
            metrics={"loss": mean_over_taken_steps(losses, batches)},
        )

    def corrected_step(
        self, ctx: ClientContext, y: Params, batch: Batch, c_i: Params, c: Params
    ) -> tuple[Params, Tensor]:
        """One corrected step ``y − η_l (∇F_i(y; D) − c_i + c)``; returns the new model and ``F_i(y; D)``. On an empty
        batch (a step beyond a straggler's budget) the rate is 0: ``y`` is returned unchanged."""
        loss, g = ctx.loss_and_grad(y, batch)
        rate = self.local_lr * has_samples(batch).to(loss.dtype)
        return {k: y[k] - rate * (g[k] - c_i[k] + c[k]) for k in y}, loss

    def aggregate(
        self,
        params: Params,
        outputs: ClientOutput,
        weights: Tensor,
        server_state: dict[str, Tensor],
        clients: ClientRecord,
    ) -> tuple[Params, dict[str, Tensor]]:
        delta, _ = super().aggregate(params, outputs, weights, server_state, clients)
        # c = Σ_i p_i c_i over the training clients, kept exactly: c ← c + Σ_{i∈S} p_i Δc_i
        c = server_state["c"]
        new_state = {
            "c": {k: c[k] + tree_weighted_sum({k: outputs.extras["dc"][k]}, clients.weight)[k] for k in params}
        }
        return delta, new_state

    # -- communication -------------------------------------------------------------------------
    def download(self, params: Params, server_state: dict[str, Tensor], client: ClientRecord) -> dict[str, Any]:
        """w and the server control variate c (2d floats); the upload is the default Δy_i and Δc_i (2d)."""
        return {"params": dict(params), "c": dict(server_state["c"])}
