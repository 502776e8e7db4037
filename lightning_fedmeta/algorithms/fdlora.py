"""FDLoRA: a global LoRA adapter aggregated, a personal one kept, fused per client (Qi, Luan, Huang, Fung, Yang,
Qian, "FDLoRA: Personalized Federated Learning of Large Language Model via Dual LoRA Tuning", arXiv:2406.07925).

On a LoRA'd model (:func:`~lightning_fedmeta.models.lora.add_lora`: ``W x + (α/r) B A x``, the base ``W`` frozen)
every client holds two adapters of the model's shape: the global one ``θ_g`` (every trainable parameter: the
``lora_A``/``lora_B`` pairs and any ``train_also`` parameter), which travels, and its personal one ``θ_p,i``, which
never leaves it. Round t, sampled client i receiving ``θ_g``, on the round's batches ``D_1..D_τ``:

    global:    θ_g,i ← θ_g,i − η ∇F_i(θ_g,i; D_t),     τ steps from θ_g,i = θ_g;   uploads Δ_i = θ_g,i − θ_g
    personal:  θ_p,i ← θ_p,i − η_p ∇F_i(θ_p,i; D_t),   τ steps from its stored θ_p,i (same batches), kept

Server: the usual step on the global adapter, ``θ_g ← θ_g + β Σ_{i∈S} p_i Δ_i``; the paper's outer optimiser (a
Nesterov-momentum SGD step on the pseudo-gradient ``−Σ p_i Δ_i``, as DiLoCo) is the module's ``server_optimizer``
(``torch.optim.SGD`` with ``lr: 1.0, momentum: 0.5, nesterov: true``, the values of the public re-implementation
below). A client that has not trained yet (not sampled yet, or held out) has no personal adapter: it starts from,
and is evaluated with, the current global one, ``θ_p,i = θ_g`` (the framework's rule for personal parts, as Ditto's).

AdaFusion (evaluation): client i is evaluated with one adapter, the parameter-wise combination

    θ_i(w) = w_g θ_g + w_p θ_p,i          (every lora_A, lora_B and train_also tensor alike, as LoraHub's merge)

of the global adapter and its own, with the two weights ``w = (w_g, w_p)`` fitted on a few of its training
samples: ``fusion_steps`` projected gradient steps from ``w⁰ = fusion_init`` on

    L(w) = F_i(θ_i(w); D) + λ₁ (|w_g| + |w_p|) / 2,      w ← clip_[−b, b](w − η_w ∇_w L),

``∇_w F_i = (⟨∇F_i(θ_i(w)), θ_g⟩, ⟨∇F_i(θ_i(w)), θ_p,i⟩)`` (chain rule; exact), ``λ₁ = fusion_l1`` (0.05), ``b =
fusion_bound`` (1.5), on ``fusion_steps`` batches of ``finetune_batch_size`` rows of its training data (rate
``fusion_lr``). The weights are refitted at every evaluation (as the paper fuses after each round) and not stored.
A held-out client is evaluated with ``θ_i(w) = (w_g + w_p) θ_g``, ``w`` fitted on its own samples (at
``w⁰ = (0.5, 0.5)``: the global adapter).

Where we differ from the paper and the code we could read (the authors' code is not public; we read the paper's
abstract and a public re-implementation, the ``fdlora`` baseline of an LLM-PFL benchmark: ``baselines/fdlora.py``
with ``node.py``'s ``adaptive_fusion`` and the server's "OuterOpt"):

* AdaFusion is gradient-free in the paper (Nevergrad's ``NGOpt``, budget 5, ``w ∈ [−1.5, 1.5]²`` from ``w⁰ = 0``,
  loss + 0.05 mean|w| on 5 batches of the client's held-back few-shot split). A black-box search is not a batched
  tensor program, so ours is projected (sub)gradient descent on the same objective and box. From ``w⁰ = 0`` the
  fused adapter is 0 and its gradient in ``w`` vanishes (``B A`` is bilinear), so our default start is
  ``w⁰ = (0.5, 0.5)``. Our few samples are drawn from the client's training data, not a separate split.
* The paper first trains each personal adapter alone and initialises the global one with their average; here the
  global adapter starts from the model's initial one and each personal adapter from the global one of the round the
  client first trains in. The re-implementation's periodic
  synchronisation of the two adapters (``sync_freq``) is not built.
* Local work: plain SGD (``local_steps``, ``local_lr``; ``personal_lr`` for the personal adapter), one step per batch
  for both adapters on the same batches; theirs is AdamW with a decayed rate.
* The server's weights are the module's ``aggregation`` (``samples`` by default; the re-implementation averages
  uniformly: ``aggregation: uniform``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_fedmeta.algorithms.base import (
    Algorithm,
    BatchPlan,
    ClientOutput,
    ClientRecord,
    check_integer,
    check_non_negative,
    check_positive,
    started_from,
)
from lightning_fedmeta.algorithms.local_steps import local_sgd
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, has_samples, tree_dot, tree_sub
from lightning_fedmeta.models.lora import lora_example_mlp

__all__ = ["FDLoRA", "fuse"]

#: the client-state key of the personal adapter (checkpointed as ``personal/<parameter name>``)
PERSONAL = "personal"


def fuse(weights: Tensor, global_adapter: Params, personal_adapter: Params) -> Params:
    """AdaFusion's adapter ``w_g θ_g + w_p θ_p`` (``weights = (w_g, w_p)``), tensor by tensor."""
    return {k: weights[0].to(v.dtype) * v + weights[1].to(v.dtype) * personal_adapter[k]
            for k, v in global_adapter.items()}


class FDLoRA(Algorithm):
    """FDLoRA: a global adapter trained and averaged, a personal adapter trained and kept, fused per client at
    evaluation with two fitted weights (module docstring).

    Args:
        personal_lr: η_p, the personal adapter's rate (``None`` = ``local_lr``).
        fusion_steps: gradient steps on the fusion weights before evaluation (each on one batch of
            ``finetune_batch_size`` training rows); 0 evaluates ``fusion_init``.
        fusion_lr: η_w, their rate.
        fusion_init: ``w⁰ = (w_g, w_p)``; ``(1, 0)`` evaluates the global adapter, ``(0, 1)`` the personal one.
        fusion_l1: λ₁ of the L1 penalty ``λ₁ mean|w|`` (the re-implementation's 0.05).
        fusion_bound: b, the box ``[−b, b]²`` the weights are kept in (1.5).
        local_steps, local_lr, batch_size, finetune_batch_size, local_epochs, drop_last: see
            :class:`~lightning_fedmeta.algorithms.base.Algorithm`.

    Client state: ``{"personal": {name: tensor}}``, the personal adapter (the trainable parameters only).
    """

    name = "fdlora"
    summary = ("FDLoRA: global LoRA adapter averaged, personal adapter kept, fused per client with fitted weights "
               "(Qi et al., 2024)")
    step_budget = True
    unused_args = {
        "finetune_steps": "the evaluation-time work is AdaFusion's fusion_steps (on the fusion weights)",
        "finetune_lr": "AdaFusion's rate is fusion_lr",
        "finetune_epochs": "AdaFusion counts fusion_steps",
    }

    def __init__(
        self,
        personal_lr: float | None = None,
        fusion_steps: int = 5,
        fusion_lr: float = 0.1,
        fusion_init: Sequence[float] = (0.5, 0.5),
        fusion_l1: float = 0.05,
        fusion_bound: float = 1.5,
    ) -> None:
        super().__init__()
        if personal_lr is not None:
            check_non_negative("personal_lr", personal_lr)
        check_integer("fusion_steps", fusion_steps, 0)
        check_non_negative("fusion_lr", fusion_lr)
        check_non_negative("fusion_l1", fusion_l1)
        check_positive("fusion_bound", fusion_bound)
        init = list(fusion_init) if isinstance(fusion_init, Sequence) and not isinstance(fusion_init, str) else None
        if init is None or len(init) != 2 or not all(
                isinstance(v, int | float) and not isinstance(v, bool) and abs(v) <= fusion_bound for v in init):
            raise ValueError(f"fusion_init must be two numbers (w_g, w_p) in [-fusion_bound, fusion_bound] = "
                             f"[{-fusion_bound}, {fusion_bound}], got {fusion_init!r}")
        self.personal_lr = self.local_lr if personal_lr is None else personal_lr
        self.fusion_steps = fusion_steps
        self.fusion_lr = fusion_lr
        self.fusion_init = (float(init[0]), float(init[1]))
        self.fusion_l1 = fusion_l1
        self.fusion_bound = fusion_bound

    def hparams(self) -> dict[str, object]:
        return {**super().hparams(), "fusion_init": list(self.fusion_init)}

    def eval_plan(self) -> BatchPlan:
        """``fusion_steps`` batches of ``finetune_batch_size`` training rows (AdaFusion's few samples)."""
        return BatchPlan(steps=self.fusion_steps, per_step=1, batch_size=self.finetune_batch_size)

    def init_client_state(self, params: Params) -> dict[str, Tensor]:
        """The personal adapter (a copy of the initial adapter, not read before the client has trained)."""
        return {PERSONAL: {k: v.detach().clone() for k, v in params.items()}}

    def personal_adapter(self, params: Params, state: dict[str, Tensor], client: ClientRecord) -> Params:
        """θ_p,i for a client that has trained; the global adapter θ_g for one that has not."""
        return started_from(client, state[PERSONAL], params)

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        """τ SGD steps of the global adapter from θ_g and of the personal one from θ_p,i, on the same batches."""
        w_global, loss = local_sgd(ctx, params, batches, self.local_lr)
        personal, personal_loss = local_sgd(ctx, self.personal_adapter(params, state, client), batches,
                                            self.personal_lr)
        return ClientOutput(tree_sub(w_global, params), {PERSONAL: personal}, {},
                            {"loss": loss, "personal_loss": personal_loss})

    def fusion_weights(self, ctx: ClientContext, params: Params, personal: Params, batches: Batch) -> Tensor:
        """AdaFusion's ``w = (w_g, w_p)`` after ``fusion_steps`` projected gradient steps (module docstring); a step
        on an empty batch leaves ``w`` as it is."""
        first = next(iter(params.values()))
        w = torch.tensor(self.fusion_init, dtype=torch.float32, device=first.device)
        for t in range(batches.x.shape[0]):
            batch = batches.at(t, 0)
            _, g = ctx.loss_and_grad(fuse(w, params, personal), batch)
            grad = torch.stack([tree_dot(g, params), tree_dot(g, personal)]).to(w.dtype)
            grad = grad + self.fusion_l1 * torch.sign(w) / 2
            rate = self.fusion_lr * has_samples(batch).to(w.dtype)
            w = (w - rate * grad).clamp(-self.fusion_bound, self.fusion_bound)
        return w

    def personalize(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> Params:
        """The fused adapter ``w_g θ_g + w_p θ_p,i`` with AdaFusion's fitted weights."""
        personal = self.personal_adapter(params, state, client)
        return fuse(self.fusion_weights(ctx, params, personal, batches), params, personal)

    @classmethod
    def example_model(cls, input_shape: tuple[int, ...], num_classes: int) -> nn.Module | None:
        """A small MLP with rank-2 LoRA adapters on both linear layers (:func:`~lightning_fedmeta.models.lora.
        lora_example_mlp`)."""
        return lora_example_mlp(input_shape, num_classes)
