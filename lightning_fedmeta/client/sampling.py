"""Every random draw of the federated loop as a pure function of ``(seed, tag, round, client)``.

Nothing here reads a global random state, so the clients sampled in round r and their
mini-batches are the same whether the run is looped, batched, split over processes or resumed
from a checkpoint (docs/design.md, contract 1).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "BatchPlan",
    "stable_seed", "generator_for", "sample_clients", "draw_batch_indices", "choose_holdout", "epoch_steps",
    "epoch_batches", "phase_lengths", "total_epochs",
    "plan_steps",
]


@dataclass(frozen=True)
class BatchPlan:
    """How many mini-batches a client draws in one call: ``steps × per_step`` batches of ``batch_size``.

    ``batch_size=None`` means full batch (each batch is all of the client's training data,
    padded and masked to a common length). Every batch is drawn independently and without
    replacement within itself, as a pure function of ``(seed, round, client)``.

    ``epochs=E`` (``local_epochs``/``finetune_epochs``) counts the work in passes over the client's rows instead:
    client ``c`` with ``n_c`` rows takes ``s_c = E·⌈n_c / (per_step·B)⌉`` steps (``⌊·⌋`` with ``drop_last``), each
    epoch a fresh permutation cut into consecutive chunks
    (:func:`~lightning_fedmeta.client.sampling.epoch_steps`,
    :func:`~lightning_fedmeta.client.sampling.draw_batch_indices`);
    ``steps`` is then the length of the call's step axis (at least the largest ``s_c``), its steps beyond ``s_c``
    empty (mask 0).

    A round of two phases (Ditto: global then personal steps; FedRep: head then body steps) gives per-phase epochs
    ``epochs=(E_1, E_2)``: ``s_c = (E_1 + E_2)·⌈n_c / (per_step·B)⌉``, and the step axis ``T`` (a multiple of
    ``E_1 + E_2``) holds phase ``p`` in a block of ``T·E_p/(E_1 + E_2)`` steps, each block padded at its end
    (:func:`~lightning_fedmeta.client.sampling.phase_lengths`).
    """

    steps: int
    per_step: int = 1
    batch_size: int | None = 32
    epochs: int | tuple[int, ...] | None = None
    drop_last: bool = False


def stable_seed(*parts: int | str) -> int:
    """A 63-bit seed derived from ``parts`` by BLAKE2b (stable across processes and Python runs)."""
    text = ":".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def generator_for(*parts: int | str) -> torch.Generator:
    return torch.Generator().manual_seed(stable_seed(*parts))


def sample_clients(seed: int, round_idx: int, eligible: Tensor, num_sampled: int) -> Tensor:
    """``num_sampled`` distinct clients drawn uniformly from ``eligible`` for round ``round_idx``, sorted."""
    if num_sampled > eligible.numel():
        raise ValueError(f"cannot sample {num_sampled} clients from {eligible.numel()} eligible clients")
    perm = torch.randperm(eligible.numel(), generator=generator_for(seed, "clients", round_idx))
    return eligible[perm[:num_sampled]].sort().values


def choose_holdout(seed: int, num_clients: int, holdout: float | int) -> Tensor:
    """Indices of the clients held out of training: a count (int ≥ 0) or a fraction in [0, 1)."""
    if isinstance(holdout, bool) or not holdout >= 0 or holdout == math.inf:
        raise ValueError(f"holdout_clients must be a count >= 0 or a fraction in [0, 1), got {holdout!r}")
    if isinstance(holdout, float) and holdout >= 1:
        raise ValueError(f"holdout_clients as a fraction must be < 1, got {holdout!r}")
    count = int(holdout) if isinstance(holdout, int) else int(round(holdout * num_clients))
    if count >= num_clients:
        raise ValueError(f"holdout_clients={holdout!r} leaves no training client out of {num_clients}")
    perm = torch.randperm(num_clients, generator=generator_for(seed, "holdout"))
    return perm[:count].sort().values


def total_epochs(plan: BatchPlan) -> int:
    """``E``, the epochs of an epoch plan, summed over its phases (``E_1 + E_2 + …``) when ``plan.epochs`` is a
    tuple of per-phase counts (a two-phase round such as Ditto's or FedRep's)."""
    if plan.epochs is None:
        raise ValueError("epoch_steps needs a plan with epochs (local_epochs / finetune_epochs)")
    return sum(plan.epochs) if isinstance(plan.epochs, tuple) else plan.epochs


def epoch_steps(n: int, plan: BatchPlan) -> int:
    """``s = E·⌈n / (per_step·B)⌉`` steps of a client with ``n`` training rows under an epoch plan
    (``E = plan.epochs``, or ``E_1 + E_2 + …`` for per-phase epochs, :func:`total_epochs`; ``⌊·⌋`` with
    ``plan.drop_last``; ``B = n`` for a full-batch plan, so one step per epoch).

    Each step consumes ``per_step·B`` rows (one chunk of the epoch's permutation, see :func:`draw_batch_indices`),
    so an epoch is ``⌈n / (per_step·B)⌉`` steps with the last one partial, as PyTorch's ``DataLoader`` with
    ``batch_size = per_step·B`` (``drop_last=True``: ``⌊·⌋``, the partial chunk dropped). A client with no rows
    takes no step."""
    return total_epochs(plan) * epoch_batches(n, plan)


def epoch_batches(n: int, plan: BatchPlan) -> int:
    """``nb = ⌈n / (per_step·B)⌉`` (``⌊·⌋`` with ``plan.drop_last``), the steps of one epoch of a client with ``n``
    rows; 0 for a client with no rows."""
    if n <= 0:
        return 0
    chunk = plan.per_step * (n if plan.batch_size is None else plan.batch_size)
    return n // chunk if plan.drop_last else -(-n // chunk)


def phase_lengths(total: int, plan: BatchPlan) -> list[int]:
    """The steps of each phase on a call's step axis of ``total`` steps: ``T_p = T · E_p / (E_1 + E_2 + …)`` under
    per-phase epochs (exact: the sampler makes ``T`` a multiple of ``E_1 + E_2 + …``, ``T = ΣE · max_c nb_c``, see
    :func:`draw_batch_indices`), ``[T]`` for any other plan. A two-phase algorithm finds its phase boundary here
    from the step axis alone."""
    if not isinstance(plan.epochs, tuple):
        return [total]
    whole = sum(plan.epochs)
    if total % whole:
        raise ValueError(f"a step axis of {total} steps cannot hold the phases {plan.epochs} epochs: it must be a "
                         f"multiple of {whole} (draw the batches with draw_batch_indices)")
    return [total // whole * e for e in plan.epochs]


def plan_steps(counts: Tensor, plan: BatchPlan) -> Tensor:
    """The steps every client takes under ``plan`` (int64 ``[C]``, from the clients' row counts ``counts``):
    :func:`epoch_steps` for an epoch plan, ``plan.steps`` for everyone otherwise."""
    if plan.epochs is None:
        return torch.full((counts.numel(),), plan.steps, dtype=torch.long)
    return torch.tensor([epoch_steps(int(n), plan) for n in counts.tolist()], dtype=torch.long)


def _epoch_rows(g: torch.Generator, n: int, plan: BatchPlan, steps: int, width: int) -> tuple[Tensor, Tensor]:
    """One client's local row indices and mask ``[steps·per_step, width]`` under an epoch plan: epoch ``e`` is
    ``torch.randperm(n)`` cut into chunks of ``per_step·width`` rows, one chunk per step, filling batch 0 of the step
    first; its last chunk may be partial (masked) or dropped (``drop_last``). Per-phase epochs ``(E_1, E_2, …)``: the
    ``E_p`` epochs of phase ``p`` fill the start of its block of :func:`phase_lengths` steps, phase after phase;
    the steps after a phase's last epoch (the block's padding) are empty."""
    chunk = plan.per_step * width
    per_epoch = epoch_batches(n, plan)
    counts = plan.epochs if isinstance(plan.epochs, tuple) else (plan.epochs or 0,)
    local = torch.zeros(steps * chunk, dtype=torch.long)
    mask = torch.zeros(steps * chunk, dtype=torch.float32)
    block = 0
    for epochs, length in zip(counts, phase_lengths(steps, plan), strict=True):
        for e in range(epochs):
            perm = torch.randperm(n, generator=g)[: per_epoch * chunk]
            start = (block + e * per_epoch) * chunk
            local[start:start + perm.numel()] = perm
            mask[start:start + perm.numel()] = 1.0
        block += length
    return local.view(steps * plan.per_step, width), mask.view(steps * plan.per_step, width)


def _draw_epochs(seed: int, tag: str, round_idx: int, clients: Tensor, starts: list[int], ends: list[int],
                 plan: BatchPlan, width: int) -> tuple[Tensor, Tensor]:
    """:func:`draw_batch_indices` under an epoch plan: a step axis of ``max(plan.steps, max_c s_c)`` steps, rounded
    up to a multiple of ``E_1 + E_2 + …`` under per-phase epochs."""
    steps = max([plan.steps, *(epoch_steps(e - s, plan) for s, e in zip(starts, ends, strict=True))])
    if isinstance(plan.epochs, tuple):
        steps = -(-steps // total_epochs(plan)) * total_epochs(plan)
    index = torch.zeros(clients.numel(), steps * plan.per_step, width, dtype=torch.long)
    mask = torch.zeros(clients.numel(), steps * plan.per_step, width, dtype=torch.float32)
    for row, (c, start, end) in enumerate(zip(clients.tolist(), starts, ends, strict=True)):
        local, mask[row] = _epoch_rows(generator_for(seed, tag, round_idx, c), end - start, plan, steps, width)
        index[row] = start + local
    shape = (clients.numel(), steps, plan.per_step, width)
    return index.view(shape), mask.view(shape)


def draw_batch_indices(
    seed: int,
    tag: str,
    round_idx: int,
    clients: Tensor,
    offsets: Tensor,
    plan: BatchPlan,
    full_batch_len: int,
) -> tuple[Tensor, Tensor]:
    """Row indices and masks of every mini-batch the given clients draw.

    Client ``c`` (with ``n_c`` samples in rows ``offsets[c]:offsets[c+1]``) draws
    ``plan.steps × plan.per_step`` batches, each ``plan.batch_size`` samples without replacement
    (all ``n_c`` samples, masked-padded, when ``n_c < batch_size`` or ``batch_size is None``).

    Under an epoch plan (``plan.epochs = E``) client ``c`` instead takes ``s_c = epoch_steps(n_c, plan)`` steps:
    each epoch a fresh permutation of its rows from ``generator_for(seed, tag, round, c)`` (so every row is used
    exactly once per epoch, and the draw does not depend on the other clients of the call), cut into consecutive
    chunks of ``per_step·B`` rows, one per step (batch 0 of the step first); the last chunk of an epoch may be
    partial (masked) unless ``drop_last``. The step axis is ``max(plan.steps, max_c s_c)`` long (a caller that
    groups clients passes its group's length); the steps after ``s_c`` are empty (mask 0). Full batch:
    ``B = full_batch_len``, one step per epoch.

    Per-phase epochs ``plan.epochs = (E_1, E_2, …)`` (a two-phase round): the step axis ``T`` is rounded up to a
    multiple of ``ΣE`` and cut into blocks of ``T_p = T·E_p/ΣE`` steps (:func:`phase_lengths`); client ``c``'s
    ``E_p·nb_c`` steps of phase ``p`` open block ``p`` and the rest of the block is empty, so every phase ends with
    its own padding. The permutations are drawn epoch after epoch, phase after phase, from the same generator: a
    client's rows and masks depend on the others of the call only through ``T``.

    Returns:
        ``index [C, steps, per_step, B]`` (int64 rows of the concatenated tensor) and
        ``mask [C, steps, per_step, B]`` (float32, 1 = real sample). ``B = batch_size`` or
        ``full_batch_len`` for full-batch plans.
    """
    width = full_batch_len if plan.batch_size is None else plan.batch_size
    idx = clients.long()
    starts, ends = offsets[idx].tolist(), offsets[idx + 1].tolist()  # O(clients), not O(K): no list of all offsets
    if plan.epochs is not None:
        return _draw_epochs(seed, tag, round_idx, clients, starts, ends, plan, width)
    steps, per_step = plan.steps, plan.per_step
    n_batches = steps * per_step
    index = torch.zeros(clients.numel(), n_batches, width, dtype=torch.long)
    mask = torch.zeros(clients.numel(), n_batches, width, dtype=torch.float32)
    for row, (c, start, end) in enumerate(zip(clients.tolist(), starts, ends, strict=True)):
        n = end - start
        take = min(n, width)
        if n_batches == 0:
            continue
        if take == n:  # the whole client fits in one batch: every batch is all of its data
            local = torch.arange(n).expand(n_batches, n)
        else:
            g = generator_for(seed, tag, round_idx, c)
            # the `take` largest of n uniform draws: a uniformly random subset without replacement
            # (topk is a partial selection, several times cheaper than a full argsort)
            local = torch.rand(n_batches, n, generator=g).topk(take, dim=1).indices
        index[row, :, :take] = start + local
        index[row, :, take:] = start
        mask[row, :, :take] = 1.0
    shape = (clients.numel(), steps, per_step, width)
    return index.view(shape), mask.view(shape)
