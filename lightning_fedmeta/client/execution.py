"""Run a per-client pure function over many clients: looped one by one, or ``vmap``-ed in chunks.

Both paths call the same function with the same inputs and stack the outputs the same way, so
they agree to floating-point reassociation (tested to 1e-6). The looped path is the fallback for
models ``vmap`` cannot handle (dropout with per-client draws; PyTorch's recurrent layers ``nn.LSTM``/
``nn.GRU``/``nn.RNN``, which have no batching rule: see :func:`choose_batching`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from torch.func import vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = [
    "run_clients", "ChunkReducer", "choose_batching", "training_chunk_size", "ClientBatching", "BatchingError",
    "CPU_CONV_CHUNK", "AUTO_CHUNK",
]

ClientBatching = Literal["auto", "vmap", "loop"]

#: PyTorch's messages for code that vmap cannot batch (a tensor's value in Python control flow, .item())
_VMAP_CONTROL_FLOW = ("data-dependent control flow", "calling .item() on a Tensor")
_VMAP_RANDOMNESS = "random operation while in randomness error mode"


class BatchingError(RuntimeError):
    """A per-client function cannot run batched under ``torch.func.vmap``; the message names the fix."""


def _batching_error(exc: BaseException, label: str) -> BatchingError | None:
    """A clear error for PyTorch's raw vmap errors (``None`` for any other error)."""
    text = str(exc)
    first = text.splitlines()[0] if text else type(exc).__name__
    loop_fix = (
        "or set `batchable = False` on the algorithm class (its clients then always run in a Python loop), "
        "or run this module with `client_batching=\"loop\"`"
    )
    if any(pattern in text for pattern in _VMAP_CONTROL_FLOW):
        return BatchingError(
            f"{label} uses a tensor's value in Python control flow (an `if`/`while` on a tensor, `bool()`, `int()`, "
            "`float()` or `.item()`), which cannot run batched: under torch.func.vmap one call serves all clients "
            "at once, so there is no single value to branch on. Fix: write the branch with tensor operations "
            f"(`torch.where(cond, a, b)`, masks, `torch.clamp`), {loop_fix}. PyTorch said: {first}"
        )
    if _VMAP_RANDOMNESS in text:
        return BatchingError(
            f"{label} draws random numbers, which the batched client path refuses (vmap(randomness='error')): "
            "every draw must be a pure function of (seed, round, client). Fix: remove the random draw, "
            f"{loop_fix} (the loop seeds each client's draws from (seed, round, client)). PyTorch said: {first}"
        )
    return None


def _call_batched(batched: Callable[..., Any], args: tuple[Any, ...], label: str) -> Any:
    try:
        return batched(*args)
    except RuntimeError as exc:
        error = _batching_error(exc, label)
        if error is None:
            raise
        raise error from exc


def _select(tree: Any, i: int | slice) -> Any:
    return tree_map(lambda t: t[i], tree)


def _stack(outputs: list[Any]) -> Any:
    leaves0, spec = tree_flatten(outputs[0])
    columns = [tree_flatten(o)[0] for o in outputs]
    return tree_unflatten([torch.stack([col[j] for col in columns]) for j in range(len(leaves0))], spec)


def run_clients(
    fn: Callable[..., Any],
    shared: tuple[Any, ...],
    per_client: tuple[Any, ...],
    num_clients: int,
    mode: Literal["vmap", "loop"],
    chunk_size: int | None = None,
    client_seeds: list[int] | None = None,
    label: str | None = None,
    reduce: ChunkReducer | None = None,
) -> Any:
    """Evaluate ``fn(*shared, *per_client_i)`` for every client ``i`` and stack the results.

    Args:
        fn: pure per-client function.
        shared: arguments common to all clients (the global parameters, server state).
        per_client: pytrees whose leaves have a leading client axis of length ``num_clients``.
        mode: ``"vmap"`` (chunks of ``chunk_size`` clients, all at once) or ``"loop"``.
        client_seeds: in loop mode, the global RNG is seeded with ``client_seeds[i]`` for client
            ``i`` (for models with dropout), and restored afterwards.
        label: what ``fn`` runs, for error messages (e.g. ``"FedAvg.client_update"``). PyTorch's raw vmap
            errors (a tensor's value in Python control flow, ``.item()``, random draws) are re-raised as a
            :class:`BatchingError` naming it and the fixes, chained from the original.
        reduce: called on each chunk's stacked output with the chunk's positions (a ``slice``); what it returns
            is kept and stacked instead (the engine's streamed aggregate sums the chunk's weighted updates and
            keeps the rest, so a round never holds every client's update at once). Under ``reduce`` the looped
            path also runs in chunks of ``chunk_size``.
    """
    if num_clients == 0:
        raise ValueError("run_clients needs at least one client")
    label = label or getattr(fn, "__qualname__", "the client function")
    if mode == "loop":
        def call(sl: slice) -> Any:
            return _loop(fn, shared, per_client, sl, client_seeds)
        size = num_clients if reduce is None or chunk_size is None else max(1, chunk_size)
    else:
        batched = vmap(fn, in_dims=(None,) * len(shared) + (0,) * len(per_client), randomness="error")

        def call(sl: slice) -> Any:
            return _call_batched(batched, (*shared, *_select(per_client, sl)), label)
        size = num_clients if chunk_size is None else max(1, chunk_size)
    return _chunked(call, num_clients, size, reduce)


#: what ``run_clients`` calls on each chunk's stacked output: ``reduce(output, positions)`` → the output to keep
ChunkReducer = Callable[[Any, slice], Any]


def _loop(fn: Callable[..., Any], shared: tuple[Any, ...], per_client: tuple[Any, ...], sl: slice,
          client_seeds: list[int] | None) -> Any:
    """The clients at positions ``sl`` one by one (the RNG seeded per client when ``client_seeds`` is given)."""
    outs = []
    for i in range(sl.start, sl.stop):
        args = (*shared, *_select(per_client, i))
        if client_seeds is None:
            outs.append(fn(*args))
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(client_seeds[i])
            outs.append(fn(*args))
    return _stack(outs)


def _chunked(call: Callable[[slice], Any], num_clients: int, size: int, reduce: ChunkReducer | None) -> Any:
    """``call`` on consecutive chunks of ``size`` positions, each output passed through ``reduce`` and written into
    outputs allocated once for all ``num_clients`` (no list of chunks to concatenate)."""
    if size >= num_clients:
        whole = slice(0, num_clients)
        return call(whole) if reduce is None else reduce(call(whole), whole)
    leaves: list[torch.Tensor] = []
    spec = None
    for start in range(0, num_clients, size):
        sl = slice(start, min(start + size, num_clients))
        out = call(sl)
        chunk, chunk_spec = tree_flatten(out if reduce is None else reduce(out, sl))
        del out
        if spec is None:
            spec = chunk_spec
            leaves = [torch.empty((num_clients, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in chunk]
        for kept, t in zip(leaves, chunk, strict=True):
            kept[sl].copy_(t)
        del chunk
    return tree_unflatten(leaves, spec)


#: clients per ``vmap`` call for a model with convolutions on the CPU. vmap lowers a per-client convolution to one
#: grouped convolution over the chunk's clients, whose activations (and max-pool indices) outgrow the CPU's caches as
#: the chunk grows: PFLlib's CNN, 100 clients per round, batch 10, one thread, CPU seconds per round: chunk 100 3.55,
#: 25 2.98, 10 2.45, 5 2.45 (benchmarks/results/speed.md, issue 29). GPUs keep the requested chunk.
CPU_CONV_CHUNK = 10
_CONV_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


#: clients per ``vmap`` call under ``client_chunk_size="auto"`` (training on a GPU or without convolutions, evaluation)
AUTO_CHUNK = 100


def training_chunk_size(model: nn.Module, device: torch.device, requested: int | str | None) -> int | None:
    """Clients per ``vmap`` call of a training round: ``requested`` as given (``None``: all at once); ``"auto"``:
    :data:`CPU_CONV_CHUNK` for a model with convolution layers on the CPU, else :data:`AUTO_CHUNK`.

    The chunk size changes no number beyond floating-point reassociation (the clients are independent; tested
    in tests/engine/test_vision_models.py); it only changes speed and peak memory.
    """
    if requested != "auto":
        return None if requested is None else int(requested)
    if device.type == "cpu" and any(isinstance(m, _CONV_LAYERS) for m in model.modules()):
        return CPU_CONV_CHUNK
    return AUTO_CHUNK


def _unbatchable_layers(model: nn.Module) -> list[str]:
    """``"name (nn.LSTM)"`` for each layer ``torch.func.vmap`` cannot run over clients.

    ``nn.LSTM``/``nn.GRU``/``nn.RNN`` (``nn.RNNBase``; torch 2.14, CPU): a forward outside ``torch.func.grad``
    (evaluation) fails in every mode ("Batching rule not implemented for aten::lstm.input ... We could not
    generate a fallback"), ``nn.GRU``/``nn.RNN`` also fail inside ``grad`` when the parameters are shared and
    the data per client (an in-place write in the fused kernel), and ``nn.LSTM`` inside ``grad`` runs through
    ``aten::mkldnn_rnn_layer``, which has no batching rule (vmap loops internally). Details: the docstring of
    :mod:`lightning_fedmeta.models.reference`.
    """
    return [f"{n or '<model>'} (nn.{type(m).__name__})" for n, m in model.named_modules() if isinstance(m, nn.RNNBase)]


def choose_batching(model: nn.Module, requested: ClientBatching) -> tuple[Literal["vmap", "loop"], str]:
    """Pick the client path for ``model``: returns the mode and the reason (for an info line).

    BatchNorm layers run batched (``FederatedModule`` makes them functional with per-client running
    statistics, :mod:`lightning_fedmeta.client.batchnorm_stats`). The loop is forced by dropout (per-client
    draws) and by PyTorch's recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``: no vmap batching rule;
    :class:`~lightning_fedmeta.models.reference.CharLSTM` is the batched equivalent); ``requested="vmap"`` then raises
    ``ValueError`` with the reason.
    """
    random_layers = [
        n for n, m in model.named_modules()
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
    ]
    recurrent = _unbatchable_layers(model)
    if requested == "loop":
        return "loop", "client_batching='loop' requested"
    reasons = []
    if random_layers:
        reasons.append(
            f"the batched (vmap) client path cannot run dropout drawn per client ({', '.join(random_layers[:3])})"
        )
    if recurrent:
        reasons.append(
            f"torch.func.vmap cannot run PyTorch's recurrent layers ({', '.join(recurrent[:3])}: no batching rule "
            "for aten::lstm/gru/rnn outside a grad transform); for batched clients use "
            "lightning_fedmeta.models.reference.CharLSTM (the same LSTM/GRU recurrence written with nn.Linear gates; "
            "CharLSTM.load_rnn_weights copies an nn.LSTM/nn.GRU in)"
        )
    if reasons:
        reason = "; ".join(reasons) + "; running clients looped"
        if requested == "vmap":
            raise ValueError(f"client_batching='vmap' is impossible for this model: {reason}")
        return "loop", reason
    return "vmap", "batched clients (torch.func.vmap)"
