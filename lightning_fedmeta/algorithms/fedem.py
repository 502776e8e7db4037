"""FedEM: federated expectation-maximisation over a mixture of M shared component models (``fedem``).

Marfoq, Neglia, Bellet, Kameni, Vidal, "Federated Multi-Task Learning under a Mixture of
Distributions", NeurIPS 2021, arXiv:2108.10252 (Algorithm 1). Client i's data is a mixture of M
underlying distributions with its own weights π_i ∈ Δ^M; component m is modelled by θ_m, shared by
all clients. Round t, sampled client i receiving θ_1..θ_M:

    E-step   q_s(m) = π_im exp(−ℓ(θ_m; x_s, y_s)) / Σ_m' π_im' exp(−ℓ(θ_m'; x_s, y_s))   per sample s
    M-step   π_im ← (1/n) Σ_s q_s(m)
    update   θ_im ← θ_m, then τ steps  θ_im ← θ_im − η ∇ (Σ_{s∈Dₜ} q_s(m) ℓ(θ_im; x_s, y_s) / |Dₜ|)   for each m
Server:  θ_m ← Σ_{i∈S} p_i θ_im  (FedAvg of every component). M = 1: q ≡ 1 and FedEM is FedAvg.

Storage. Component 1 (m = 0 here) is the module's global parameters (so FedAvg-style tools and the
server step see it: Δ = Σ_i p_i (θ_i0 − θ_0), applied by the default SGD(lr=1)); components 2..M are
server state (``components`` ``{name: [M−1, ...]}``), averaged in :meth:`FedEM.aggregate`. Only the
default server step is accepted (``server_optimizer_applies = False``): another optimizer would move
component 1 differently from the others. The mixture weights π_i are client state (``mixture`` [M]).

Where we differ from the authors' code (github.com/omarfoq/FedEM; FL-bench's src/client/fedem.py
follows it).
* The E-step runs on the samples the client draws this round (the ``τ`` mini-batches, duplicates
  counted), with the components received; the authors run it on the whole local training set. With
  ``batch_size=None`` (full batch) both are the same.
* The authors initialise the M learners independently; we have one initial model, so components
  2..M are it plus Gaussian noise of its own scale (``init_noise``·rms, seed ``init_seed``).
* Evaluation. The authors predict with the mixture Σ_m π_im softmax(h_θm(x)). The algorithm contract
  evaluates one parameter set (``personalize`` returns Params), so a client is evaluated with its
  most likely component θ_{argmax_m π_im} (then ``finetune_steps`` SGD steps). This equals the
  authors' prediction when π_i is one-hot and is an approximation otherwise: the contract would need
  an ensemble-prediction hook to do better.
* The server weights are the round's p_i (∝ n_i or uniform by ``aggregation``); the authors weight
  by n_i. The authors' decentralised variant (D-FedEM) is not implemented.

New clients. As in the paper's new-client protocol, a client that has not trained (held out, or not
yet sampled) keeps the components fixed and estimates its π by ``em_steps`` E/M iterations from the
uniform mixture on its adaptation batches (``eval_plan``: at least one batch of ``finetune_batch_size``
samples), then is evaluated like a training client.

Common arguments. ``local_steps`` (τ, from the batches' leading axis) SGD steps per component (M·τ
gradient evaluations per round), ``local_lr`` (η), ``batch_size``; ``finetune_*`` fine-tune the chosen
component before evaluation. With models whose BatchNorm layers run through the client context the
E-step weights enter as fractional masks (the batch statistics become q-weighted).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedmeta.algorithms.base import (
    Algorithm,
    BatchPlan,
    ClientOutput,
    ClientRecord,
    check_integer,
    check_non_negative,
    check_seed,
)
from lightning_fedmeta.algorithms.clustering import one_hot, stack_perturbed
from lightning_fedmeta.algorithms.local_steps import mean_over_taken_steps
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, has_samples, tree_sub, tree_weighted_sum

__all__ = ["FedEM", "e_step", "weighted_step"]

COMPONENTS = "components"
MIXTURE = "mixture"


def component_losses(ctx: ClientContext, thetas: list[Params], batches: Batch) -> Tensor:
    """``[M, N]`` per-sample losses ``ℓ(θ_m; x_s, y_s)`` of every drawn sample (all batches flattened)."""
    x = batches.x.reshape(-1, *batches.x.shape[batches.y.dim():])
    y = batches.y.reshape(-1)
    return torch.stack([ctx.per_sample_loss(ctx.predict(theta, x), y) for theta in thetas])


def e_step(losses: Tensor, mixture: Tensor) -> Tensor:
    """``q [M, N]``: ``q_s(m) = softmax_m(log π_m − ℓ_ms)`` (a zero weight stays zero)."""
    log_pi = torch.log(mixture.to(losses.dtype).clamp_min(torch.finfo(losses.dtype).tiny))
    log_pi = torch.where(mixture > 0, log_pi, torch.full_like(log_pi, -torch.inf))
    return torch.softmax(log_pi.unsqueeze(1) - losses, dim=0)


def m_step(q: Tensor, mask: Tensor, mixture: Tensor) -> Tensor:
    """``π_m = Σ_s m_s q_s(m) / Σ_s m_s`` over the real samples (``mixture`` kept when there are none)."""
    m = mask.reshape(-1).to(q.dtype)
    total = m.sum()
    new = (q * m).sum(1) / total.clamp_min(1.0)
    return torch.where(total > 0, new, mixture.to(q.dtype))


def weighted_step(
    ctx: ClientContext, theta: Params, batch: Batch, weight: Tensor, lr: float
) -> tuple[Params, Tensor]:
    """``θ − η ∇ (Σ_s m_s q_s ℓ(θ; s) / Σ_s m_s)`` and that loss. The context's masked mean divides by
    ``max(Σ m q, 1)``; the factor ``max(Σ m q, 1) / max(Σ m, 1)`` turns it into the mean over the batch."""
    mq = batch.mask * weight.to(batch.mask.dtype)
    loss, g = ctx.loss_and_grad(theta, Batch(batch.x, batch.y, mq))
    scale = mq.sum().clamp_min(1.0) / batch.mask.sum().clamp_min(1.0)
    rate = lr * scale.to(loss.dtype) * has_samples(batch).to(loss.dtype)
    return {k: theta[k] - rate * g[k] for k in theta}, loss * scale.to(loss.dtype)


class FedEM(Algorithm):
    """M shared component models; each client's mixture weights π_i by EM; FedAvg of every component.

    Args:
        num_components: M ≥ 1 (the paper uses M = 3). M = 1 is FedAvg.
        init_noise: relative scale (≥ 0) of the perturbation that starts components 2..M from the
            initial model (see :func:`~lightning_fedmeta.algorithms.clustering.stack_perturbed`).
        init_seed: seed of that perturbation.
        em_steps: E/M iterations (≥ 1) a client that has not trained runs on its adaptation batches to
            estimate its π before evaluation.
        local_steps, local_lr, batch_size: τ SGD steps of rate η per component on mini-batches of this size.
        finetune_steps, finetune_lr, finetune_batch_size: evaluation-time fine-tuning of the chosen component
            (its batches also serve a new client's EM).
    """

    step_budget = True
    name = "fedem"
    summary = "FedEM: M shared components, per-client mixture weights by EM (Marfoq et al., 2021)"
    server_optimizer_applies = False

    def __init__(
        self,
        num_components: int = 3,
        init_noise: float = 1.0,
        init_seed: int = 0,
        em_steps: int = 10,
    ) -> None:
        super().__init__()
        for label, value in (("num_components", num_components), ("em_steps", em_steps)):
            check_integer(label, value, 1)
        check_non_negative("init_noise", init_noise)
        check_seed("init_seed", init_seed)
        self.num_components = num_components
        self.init_noise = init_noise
        self.init_seed = init_seed
        self.em_steps = em_steps

    # -- state ---------------------------------------------------------------------------------
    def init_server_state(self, params: Params) -> dict[str, Tensor]:
        """Components 2..M (``[M−1, ...]`` per parameter); none when M = 1."""
        if self.num_components == 1:
            return {}
        stacked = stack_perturbed(params, self.num_components, self.init_noise, self.init_seed)
        return {COMPONENTS: {n: v[1:].clone() for n, v in stacked.items()}}

    def init_client_state(self, params: Params) -> dict[str, Tensor]:
        """π_i = uniform over the M components."""
        ref = next(iter(params.values()))
        return {MIXTURE: torch.full((self.num_components,), 1.0 / self.num_components, dtype=ref.dtype,
                                    device=ref.device)}

    def components(self, params: Params, server_state: dict[str, Tensor]) -> list[Params]:
        """``[θ_0, …, θ_{M−1}]``: the global parameters, then the server's components."""
        rest = server_state.get(COMPONENTS, {})
        return [params] + [{n: rest[n][m] for n in params} for m in range(self.num_components - 1)]

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
        """E-step and M-step on the round's samples, then τ q-weighted SGD steps of every component."""
        thetas = self.components(params, server_state)
        q = e_step(component_losses(ctx.frozen(), thetas, batches), state[MIXTURE])
        mixture = m_step(q, batches.mask, state[MIXTURE])
        q = q.reshape(self.num_components, *batches.mask.shape)
        trained, losses = [], []
        for m, theta in enumerate(thetas):
            steps = []
            for t in range(batches.x.shape[0]):
                theta, loss = ctx.step(weighted_step, theta, batches.at(t, 0), q[m][t, 0], self.local_lr)
                steps.append(loss)
            trained.append(theta)
            losses.append(mean_over_taken_steps(steps, batches))
        extras = {}
        if self.num_components > 1:
            extras[COMPONENTS] = {n: torch.stack([w[n] for w in trained[1:]]) for n in params}
        return ClientOutput(
            delta=tree_sub(trained[0], params),
            state={MIXTURE: mixture.to(state[MIXTURE].dtype)},
            extras=extras,
            metrics={"loss": torch.stack(losses).sum()},
        )

    def download(self, params: Params, server_state: dict[str, Tensor], client: ClientRecord) -> dict[str, Tensor]:
        """All M components: θ_0 (the global parameters) and θ_1..θ_{M−1} (the server state), M·d floats."""
        return {"params": dict(params), COMPONENTS: dict(server_state.get(COMPONENTS, {}))}

    def aggregate(
        self,
        params: Params,
        outputs: ClientOutput,
        weights: Tensor,
        server_state: dict[str, Tensor],
        clients: ClientRecord,
    ) -> tuple[Params, dict[str, Tensor]]:
        """``θ_m ← Σ_i p_i θ_im`` for every component (component 1 through Δ = Σ_i p_i (θ_i0 − θ_0))."""
        delta = tree_weighted_sum(outputs.delta, weights)
        if self.num_components == 1:
            return delta, server_state
        return delta, {COMPONENTS: tree_weighted_sum(outputs.extras[COMPONENTS], weights)}

    # -- evaluation ----------------------------------------------------------------------------
    def eval_plan(self) -> BatchPlan:
        """At least one batch: a client that has not trained estimates its π on it. Under ``finetune_epochs`` the
        base epoch plan (at least one epoch): π is estimated on all of its batches, then one SGD step per batch."""
        if self.finetune_epochs is not None:
            return super().eval_plan()
        return BatchPlan(steps=max(self.finetune_steps, 1), per_step=1, batch_size=self.finetune_batch_size)

    def personalize(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> Params:
        """The component ``argmax_m π_im`` (π estimated by ``em_steps`` EM iterations on ``batches`` for a
        client that has not trained), then ``finetune_steps`` SGD steps."""
        thetas = self.components(params, server_state)
        losses = component_losses(ctx.frozen(), thetas, batches)
        mixture = torch.full_like(state[MIXTURE], 1.0 / self.num_components)
        for _ in range(self.em_steps):
            mixture = m_step(e_step(losses, mixture), batches.mask, mixture)
        mixture = torch.where(client.seen, state[MIXTURE], mixture.to(state[MIXTURE].dtype))
        stacked = {n: torch.stack([theta[n] for theta in thetas]) for n in params}
        chosen = tree_weighted_sum(stacked, one_hot(mixture.argmax(), self.num_components, mixture.dtype))
        steps = None if self.finetune_epochs is not None else self.finetune_steps  # epochs: one step a batch
        return self.finetune(ctx, chosen, batches, steps=steps)
