"""FedMAML: federated MAML with gradient upload (Chen, Luo, Dong, Li, He, "Federated Meta-Learning
with Fast Convergence and Efficient Communication", arXiv:1802.07876, 2018, "FedMeta with MAML";
Finn, Abbeel, Levine, ICML 2017 for MAML).

Client i splits a mini-batch of its training data into two disjoint halves, the support set
D^tr and the query set D^val, adapts and evaluates the meta-gradient at the global θ:
    θ′_i = θ − α ∇L_i(θ; D^tr)
    g_i  = ∇L_i(θ′_i; D^val)                                   (first order, default)
    g_i  = (I − α ∇²L_i(θ; D^tr)) ∇L_i(θ′_i; D^val)             (``second_order=True``: the exact
                                                                  gradient of θ ↦ L_i(θ − α∇L_i(θ; D^tr); D^val))
and uploads ``delta = −g_i``.  The server takes the meta step through its optimizer:
    θ ← θ − β Σ_{i∈S} p_i g_i,
so **β is the module's ``server_lr``** (SGD by default; Adam etc. give adaptive meta steps).
With ``local_steps = τ > 1`` a client draws τ independent (D^tr, D^val) pairs and uploads the
mean of their meta-gradients, all taken at θ (a larger meta-batch; θ does not move locally).
A client is evaluated after ``finetune_steps`` (default 1) SGD steps at rate α from θ.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedmeta.algorithms.base import Algorithm, BatchPlan, ClientOutput, ClientRecord, check_non_negative
from lightning_fedmeta.algorithms.local_steps import mean_over_taken_steps
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_axpy, tree_scale

__all__ = [
    "BETA_IS_LOCAL_LR", "META_FINETUNE_DEFAULTS", "FedMAML", "beta_meta_rates", "maml_meta_gradient", "maml_plan",
    "meta_rates", "split_support_query",
]


def split_support_query(batch: Batch) -> tuple[Batch, Batch]:
    """Split one mini-batch ``[W, ...]`` into disjoint support and query halves.

    The real samples of a drawn batch occupy its first ``m = Σ mask`` positions (distinct rows
    of the client's data, in random order when the client has more than ``W`` samples). The
    support set is the first ``⌈m/2⌉`` of them, the query set the next ``⌊m/2⌋``; shapes are
    ``⌈W/2⌉`` and ``⌊W/2⌋`` whatever ``m`` is, so the split runs under ``torch.func.vmap``.
    A client with fewer than ``W`` samples always gets the same split of all its data.
    """
    width = batch.x.shape[0]
    w_tr, w_val = (width + 1) // 2, width // 2
    m = batch.mask.sum()
    h = torch.ceil(m / 2)
    pos_tr = torch.arange(w_tr, device=batch.mask.device)
    support = Batch(batch.x[:w_tr], batch.y[:w_tr], batch.mask[:w_tr] * (pos_tr < h).to(batch.mask.dtype))
    pos_val = h + torch.arange(w_val, device=batch.mask.device, dtype=h.dtype)
    idx = pos_val.clamp(max=width - 1).long()
    query = Batch(batch.x[idx], batch.y[idx], batch.mask[idx] * (pos_val < m).to(batch.mask.dtype))
    return support, query


#: the evaluation the meta-learners (Reptile, FedMAML, Per-FedAvg, PerFedMAML) default to, as their
#: :attr:`~lightning_fedmeta.algorithms.base.Algorithm.common_defaults`: one fine-tuning step on the client's whole
#: training set (from the model it was meta-trained to adapt from)
META_FINETUNE_DEFAULTS: dict[str, object] = {"finetune_steps": 1, "finetune_batch_size": None}


#: the common argument refused by the meta-learners with a meta step size β of their own (Per-FedAvg, PerFedMAML)
BETA_IS_LOCAL_LR: dict[str, str] = {"local_lr": "the local (meta) step size is beta; alpha is the adaptation rate"}


def meta_rates(alpha: float, finetune_lr: float | None, **rates: float) -> float:
    """Check the meta-learners' step sizes, α and the others named (β), each ``>= 0``, and return the evaluation
    fine-tuning rate: ``finetune_lr``, or α when it is ``None`` (a client is evaluated after the inner adaptation
    step ``θ − α∇L_i(θ)`` it was meta-trained for: Reptile, FedMAML, Per-FedAvg, PerFedMAML)."""
    for name, value in {"alpha": alpha, **rates}.items():
        check_non_negative(name, value)
    return alpha if finetune_lr is None else finetune_lr


def beta_meta_rates(alpha: float, beta: float, finetune_lr: float | None) -> dict[str, float]:
    """The common arguments of a meta-learner whose local step size is a meta step size β of its own (Per-FedAvg,
    PerFedMAML): ``local_lr = β`` and ``finetune_lr`` (α when ``None``: :func:`meta_rates`, which checks α, β ≥ 0)."""
    return {"local_lr": beta, "finetune_lr": meta_rates(alpha, finetune_lr, beta=beta)}


def maml_plan(algorithm: Algorithm) -> BatchPlan:
    """FedMAML's and PerFedMAML's round: ``local_steps`` batches of ``2B`` rows (``None``: the whole client), or under
    ``local_epochs`` (E) ``E·⌈n_c/2B⌉`` of them, consecutive chunks of each epoch's permutation (every row once per
    epoch, in D^tr or D^val)."""
    size = None if algorithm.batch_size is None else 2 * algorithm.batch_size
    steps = algorithm.local_steps if algorithm.local_epochs is None else 0
    return BatchPlan(steps=steps, per_step=1, batch_size=size, epochs=algorithm.local_epochs,
                     drop_last=algorithm.drop_last)


def maml_meta_gradient(
    ctx: ClientContext, theta: Params, support: Batch, query: Batch, alpha: float, second_order: bool
) -> tuple[Params, Tensor, Tensor]:
    """MAML's meta-gradient of ``θ ↦ L(θ − α∇L(θ; D^tr); D^val)``.

    Returns ``(g, L(θ; D^tr), L(θ′; D^val))`` where ``g = ∇L(θ′; D^val)`` (first order) or
    ``(I − α∇²L(θ; D^tr)) ∇L(θ′; D^val)`` (second order, one exact Hessian-vector product).
    """
    loss_tr, g_tr = ctx.loss_and_grad(theta, support)
    adapted = tree_axpy(-alpha, g_tr, theta)
    loss_val, g_val = ctx.loss_and_grad(adapted, query)
    if second_order:
        g_val = tree_axpy(-alpha, ctx.hvp(theta, support, g_val), g_val)
    return g_val, loss_tr, loss_val


class FedMAML(Algorithm):
    """Federated MAML: clients upload meta-gradients, the server optimizer takes the meta step.

    The outer (meta) learning rate β is the :class:`~lightning_fedmeta.FederatedModule`'s
    ``server_lr``: set ``server_lr: β`` in the config (the module's default 1 is rarely right).

    Args:
        alpha: α, the inner adaptation step size, ``>= 0``; also the evaluation fine-tuning rate.
        second_order: upload the exact MAML gradient (one Hessian-vector product) instead of the
            first-order approximation.
        local_steps: τ, (D^tr, D^val) pairs whose meta-gradients a client averages (default 1).
        batch_size: B, the size of each of D^tr and D^val (a batch of 2B is drawn and split);
            ``None`` = the client's whole training set, split in two.
        finetune_steps: SGD steps from θ before a client is evaluated (default 1).
        finetune_lr: rate of those steps (default α).
        finetune_batch_size: batch size of those steps (``None`` = the client's whole training set).

    The common argument ``local_lr`` is refused (``unused_args``): θ does not move locally.
    """

    name = "fedmaml"
    step_budget = True
    summary = "FedMAML: clients upload MAML meta-gradients, server lr = meta lr β (Chen et al., 2018)"
    unused_args = {
        "local_lr": "FedMAML takes no local SGD steps: alpha is the inner adaptation rate and the meta step "
        "is the module's server_lr",
    }

    common_defaults = {"local_steps": 1, **META_FINETUNE_DEFAULTS}

    def __init__(self, alpha: float = 0.01, second_order: bool = False) -> None:
        check_non_negative("alpha", alpha)
        super().__init__(local_lr=alpha)  # finetune_lr=None (its default) follows it: alpha
        self.alpha = alpha
        self.second_order = bool(second_order)

    def round_plan(self) -> BatchPlan:
        """τ batches of 2B samples, each split into D^tr and D^val by :func:`split_support_query`; under
        ``local_epochs`` (E), ``E·⌈n_c/2B⌉`` of them, consecutive chunks of each epoch's permutation."""
        return maml_plan(self)

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        total: Params | None = None
        losses, meta_losses = [], []
        for t in range(batches.x.shape[0]):
            support, query = split_support_query(batches.at(t, 0))
            g, loss, meta_loss = maml_meta_gradient(ctx, params, support, query, self.alpha, self.second_order)
            total = g if total is None else {k: total[k] + g[k] for k in g}  # an empty step's g is 0
            losses.append(loss)
            meta_losses.append(meta_loss)
        assert total is not None
        metrics = {"loss": mean_over_taken_steps(losses, batches),
                   "meta_loss": mean_over_taken_steps(meta_losses, batches)}
        ref = next(iter(total.values()))
        taken = (batches.mask.reshape(batches.mask.shape[0], -1).sum(1) > 0).sum().to(ref.dtype)  # empty: padding
        scale = -1.0 / taken.clamp_min(1.0)
        return ClientOutput(tree_scale(total, scale), state, {}, metrics)
