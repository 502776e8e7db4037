"""HetLoRA: LoRA adapters of heterogeneous ranks across clients (Cho, Manoel, Joshi, Sim, Dimitriadis, "Heterogeneous
LoRA for Federated Fine-tuning of On-Device Foundation Models", EMNLP 2024).

The server keeps rank-``r_max`` adapters (the model's: :func:`~lightning_fedmeta.models.lora.add_lora` with
``rank = r_max``). Client i has its own rank ``r_i ≤ r_max``. Round t, sampled client i:

* truncation: it receives the first ``r_i`` ranks, ``A[:r_i, :]`` and ``B[:, :r_i]`` of every adapter;
* local work: τ SGD steps on them (and on any other trainable parameter, ``train_also``), one per batch;
* zero-padding: its trained adapters, padded with zeros back to ``r_max``, ``pad(A_i)``, ``pad(B_i)``, go to the
  server, which averages the padded adapters:

      A ← Σ_{i∈S} p_i pad(A_i),   B ← Σ_{i∈S} p_i pad(B_i)          (every other trainable parameter: FedAvg)

  (the delta uploaded is ``pad(A_i) − A``, so ``server_lr`` β ≠ 1 steps part way, as in FedAvg). Ranks above
  ``r_i`` are thus pulled towards 0 by client i's weight: the higher ranks are learnt by the clients that hold them.
  The weights ``p_i`` are the paper's *sparsity-weighted* aggregation (``weighting: norm``, the default):
  ``p_i ∝ ‖ΔW_i‖_F``, the Frobenius norm of client i's trained update ``ΔW_i = (α/r_max) B_i A_i`` (over all adapted
  layers together: ``‖ΔW_i‖² = Σ_layers ‖(α/r) B A‖²_F``), normalised over the round's clients; ``weighting: data``
  uses the round's weights of the module's ``aggregation`` instead (``samples``: ``∝ n_i``).

Batching: every client holds ``r_max``-shaped adapters with rows ``r ≥ r_i`` of ``A`` and columns ``r ≥ r_i`` of
``B`` set to 0. That is the truncated model exactly — ``B A = B[:, :r_i] A[:r_i, :]`` — and plain SGD keeps the
zeros exactly: the gradient of row ``r`` of ``A`` is ``(α/r) B[:, r]ᵀ G xᵀ`` and of column ``r`` of ``B`` is
``(α/r) G (A[r] x)ᵀ``, both 0 while the other factor's ``r`` slice is 0. So the truncated clients run together under
``vmap``, with their rank a per-client tensor (client state ``{"rank": r_i}``, fixed).

Ranks: ``ranks`` lists ``r_i`` for every client of the federation (training and held-out), or ``rank_choices`` gives
a set each client's rank is drawn from, uniformly, by a generator seeded with ``rank_seed`` (one draw per client, in
index order); with neither, every client has rank ``r_max``. A held-out client is evaluated with the global
adapters truncated to its rank (after ``finetune_steps`` steps on them, if any).

Where we differ from the paper:

* The paper's local rank self-pruning (a regulariser on the last ranks' norm, and ``r_i`` lowered by a decay factor
  when it shrinks) is not built: ranks stay fixed.
* The adapters are scaled by the server's ``α / r_max`` on every client; a rank-``r_i`` LoRA built alone would use
  ``α / r_i`` (the paper does not say which it uses; with ours the truncated model is exactly the server's model
  restricted to ``r_i`` ranks).
* Local work: plain SGD (``local_steps``, ``local_lr``).

Because the aggregate is not the default weighted mean of the deltas under ``weighting: norm``, robust rules, DP and
upload compression refuse it (``reliability.uploads_delta``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_fedmeta.algorithms.base import Algorithm, ClientOutput, ClientRecord, check_integer, check_seed
from lightning_fedmeta.algorithms.local_steps import local_sgd
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_sub, tree_weighted_sum
from lightning_fedmeta.models.lora import lora_example_mlp

__all__ = ["HetLoRA", "rank_mask", "truncate"]

#: the client-state key of the client's rank r_i (a 0-d int64 tensor)
RANK = "rank"
#: the extras key of ``‖ΔW_i‖_F``, the sparsity weight of the client's update
NORM = "update_norm"


def _lora_axis(name: str) -> int | None:
    """The rank axis of a LoRA factor by its name: 0 for ``lora_A`` ``[r, d_in]``, 1 for ``lora_B`` ``[d_out, r]``;
    ``None`` for any other parameter."""
    last = name.rsplit(".", 1)[-1]
    return 0 if last == "lora_A" else 1 if last == "lora_B" else None


def rank_mask(name: str, value: Tensor, rank: Tensor) -> Tensor | None:
    """The 0/1 mask keeping the first ``rank`` ranks of a LoRA factor (rows of ``lora_A``, columns of ``lora_B``);
    ``None`` for a parameter that is not one."""
    axis = _lora_axis(name)
    if axis is None:
        return None
    keep = (torch.arange(value.shape[axis], device=value.device) < rank).to(value.dtype)
    return keep.reshape(-1, 1) if axis == 0 else keep.reshape(1, -1)


def truncate(params: Params, rank: Tensor) -> Params:
    """The parameters with every LoRA factor truncated to ``rank`` ranks and zero-padded back to its shape (other
    parameters unchanged)."""
    out = {}
    for k, v in params.items():
        mask = rank_mask(k, v, rank)
        out[k] = v if mask is None else v * mask
    return out


def update_norm(params: Params) -> Tensor:
    """``‖ΔW‖_F`` over every adapted layer, ``ΔW = B A`` per ``(lora_A, lora_B)`` pair (unscaled: the common factor
    ``α / r_max`` cancels in the normalised weights)."""
    total = None
    for k, v in params.items():
        if k.rsplit(".", 1)[-1] == "lora_A":
            b = params[k[: -len("lora_A")] + "lora_B"]
            sq = (b @ v).square().sum()
            total = sq if total is None else total + sq
    if total is None:
        raise ValueError("hetlora needs trainable lora_A/lora_B pairs: add_lora(model, targets) or "
                         "lightning_fedmeta.models.LoRAModel")
    return total.sqrt()


class HetLoRA(Algorithm):
    """HetLoRA: clients train the first ``r_i`` ranks of the server's rank-``r_max`` adapters; the server averages
    the zero-padded adapters, weighted by the norms of the clients' updates (module docstring).

    Args:
        ranks: ``r_i`` for every client of the federation (length: the number of clients), each in ``1..r_max``.
        rank_choices: the ranks each client's rank is drawn from (uniformly) when ``ranks`` is not given (neither
            given: every client has rank ``r_max``, homogeneous LoRA).
        rank_seed: the seed of that draw.
        weighting: ``norm`` (the paper's sparsity-weighted aggregation, ``p_i ∝ ‖ΔW_i‖_F``) or ``data`` (the round's
            weights of the module's ``aggregation``).
        local_steps, local_lr, batch_size, finetune_steps, finetune_lr, finetune_batch_size: see
            :class:`~lightning_fedmeta.algorithms.base.Algorithm` (fine-tuning keeps the client's rank).

    Client state: ``{"rank": r_i}`` (fixed).
    """

    name = "hetlora"
    summary = ("HetLoRA: heterogeneous LoRA ranks, truncation to the client's rank and zero-padded, norm-weighted "
               "aggregation (Cho et al., EMNLP 2024)")
    step_budget = True

    def __init__(
        self,
        ranks: Sequence[int] | None = None,
        rank_choices: Sequence[int] | None = None,
        rank_seed: int = 0,
        weighting: str = "norm",
    ) -> None:
        super().__init__()
        if ranks is not None and rank_choices is not None:
            raise ValueError("hetlora: give the clients' ranks either as ranks (one per client) or as rank_choices "
                             f"(drawn per client), not both; got ranks={ranks!r}, rank_choices={rank_choices!r}")
        for label, values in (("ranks", ranks), ("rank_choices", rank_choices)):
            if values is None:
                continue
            if isinstance(values, str) or not isinstance(values, Sequence) or not values:
                raise ValueError(f"hetlora: {label} must be a non-empty list of integers >= 1, got {values!r}")
            for v in values:
                check_integer(f"hetlora: each of {label}", v, 1)
        check_seed("rank_seed", rank_seed)
        if weighting not in ("norm", "data"):
            raise ValueError(f"hetlora: weighting must be 'norm' (sparsity-weighted, the paper's) or 'data', "
                             f"got {weighting!r}")
        self.ranks = None if ranks is None else [int(r) for r in ranks]
        self.rank_choices = None if rank_choices is None else [int(r) for r in rank_choices]
        self.rank_seed = rank_seed
        self.weighting = weighting

    def hparams(self) -> dict[str, object]:
        return {**super().hparams(), "ranks": self.ranks, "rank_choices": self.rank_choices}

    def client_ranks(self, num_clients: int, max_rank: int) -> list[int]:
        """``r_i`` of clients ``0..num_clients − 1``: ``ranks``, or the seeded draw from ``rank_choices``, or
        ``max_rank`` for every client when neither is given."""
        if self.ranks is not None:
            if len(self.ranks) != num_clients:
                raise ValueError(f"hetlora: ranks lists {len(self.ranks)} ranks, but the federation has "
                                 f"{num_clients} clients (held-out ones included): give one rank per client")
            return list(self.ranks)
        if self.rank_choices is None:
            return [max_rank] * num_clients
        generator = torch.Generator().manual_seed(self.rank_seed)  # one scalar draw per client, in index order:
        return [self.rank_choices[int(torch.randint(len(self.rank_choices), (1,), generator=generator))]
                for _ in range(num_clients)]  # client i's rank does not depend on how many follow it

    def check_model(self, params: Params) -> int:
        """``r_max``, the rank of the model's adapters; refuses a model without LoRA factors or with ranks above it."""
        max_rank = max((v.shape[_lora_axis(k)] for k, v in params.items() if _lora_axis(k) is not None), default=0)
        if not max_rank:
            raise ValueError(f"hetlora needs a LoRA'd model (trainable lora_A/lora_B; its trainable parameters are "
                             f"{list(params)[:12]}): add_lora(model, targets, rank=r_max) or "
                             "lightning_fedmeta.models.LoRAModel")
        wanted = max(self.ranks if self.ranks is not None else self.rank_choices or [0])  # [0]: every client r_max
        if wanted > max_rank:
            raise ValueError(f"hetlora: a client rank {wanted} exceeds the model's LoRA rank r_max = {max_rank}; "
                             "build the model with rank >= the largest client rank")
        return max_rank

    def init_client_states(self, params: Params, clients: ClientRecord) -> dict[str, Tensor]:
        """``{"rank": r_i}`` per client, by its index (a client outside the federation, index −1: ``r_max``)."""
        max_rank = self.check_model(params)
        index = clients.index.reshape(-1)
        known = int(index.max()) + 1 if index.numel() and int(index.max()) >= 0 else 0
        table = self.client_ranks(max(known, len(self.ranks) if self.ranks is not None else known), max_rank)
        ranks = [table[int(i)] if int(i) >= 0 else max_rank for i in index]
        return {RANK: torch.tensor(ranks, dtype=torch.long)}

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        """τ SGD steps from the global adapters truncated to ``r_i``; Δ_i = pad(trained) − global."""
        start = truncate(params, state[RANK])
        w, loss = local_sgd(ctx, start, batches, self.local_lr)
        w = truncate(w, state[RANK])  # exact already (module docstring); kept so the padding is explicit
        return ClientOutput(tree_sub(w, params), dict(state), {NORM: update_norm(w)}, {"loss": loss})

    def aggregate(
        self,
        params: Params,
        outputs: ClientOutput,
        weights: Tensor,
        server_state: dict[str, Tensor],
        clients: ClientRecord,
    ) -> tuple[Params, dict[str, Tensor]]:
        """``Σ_i p_i Δ_i`` with ``p_i ∝ ‖ΔW_i‖_F`` (``weighting: norm``) or the round's weights (``data``)."""
        if self.weighting == "norm":
            norms = outputs.extras[NORM].to(weights.dtype) * (weights > 0).to(weights.dtype)
            weights = norms / norms.sum().clamp_min(torch.finfo(norms.dtype).tiny)
        return tree_weighted_sum(outputs.delta, weights), server_state

    def upload(self, output: ClientOutput) -> dict[str, object]:
        """The delta (the padded adapters less the global ones) and ``‖ΔW_i‖_F`` (``weighting: norm``)."""
        return {"delta": output.delta, "extras": output.extras if self.weighting == "norm" else {}}

    def personal_start(
        self, params: Params, state: dict[str, Tensor], server_state: dict[str, Tensor], client: ClientRecord
    ) -> Params:
        """The global adapters truncated to the client's rank (fine-tuning steps keep the truncation exactly)."""
        return truncate(params, state[RANK])

    @classmethod
    def example_arguments(cls) -> dict[str, object]:
        """Ranks drawn from {1, 2} (the example model's adapters have rank 2)."""
        return {"rank_choices": [1, 2]}

    @classmethod
    def example_model(cls, input_shape: tuple[int, ...], num_classes: int) -> nn.Module | None:
        """A small MLP with rank-2 LoRA adapters on both linear layers (:func:`~lightning_fedmeta.models.lora.
        lora_example_mlp`)."""
        return lora_example_mlp(input_shape, num_classes)
