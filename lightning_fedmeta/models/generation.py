"""Text generation from a causal language model: greedy decoding or temperature / top-k sampling.

Works with any model that maps int64 tokens ``[B, T]`` to next-token logits ``[B, T, V]`` (every position), or
``[B, V]`` (the last position only, e.g. ``TinyTransformer(all_positions=False)``), or an object with a ``.logits``
attribute holding either (a Hugging Face causal LM's output). ``FederatedModule.personalize(i)`` returns such a
model for a next-token dataset, so a client's personalised model generates with
``generate(module.personalize(i), tokenizer.encode(prompt), 50)``.

One step, on the sequence ``s`` so far: the context is ``s`` cut to its last ``max_len`` tokens (the model's
context length: ``max_len`` given, else the model's ``max_len`` attribute, the wrapped model's (``LoRAModel``), or a
Hugging Face config's ``max_position_embeddings`` / ``n_positions``; none: the whole sequence); ``z`` = the logits
of its last position; the next token is ``argmax z`` (the lowest id on ties) when ``temperature == 0``, else a draw
from ``softmax(z / temperature)`` restricted to the ``top_k`` largest logits (``None``: all).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["context_length", "generate"]


def context_length(model: nn.Module) -> int | None:
    """The model's context length: its ``max_len``, its wrapped ``model.max_len`` (``LoRAModel``), or its Hugging
    Face config's ``max_position_embeddings`` / ``n_positions``; ``None`` when it states none."""
    for owner in (model, getattr(model, "model", None)):
        value = getattr(owner, "max_len", None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _last_logits(output: object, batch: int) -> Tensor:
    """``[B, V]`` logits of the last position from a model output (tensor or object with ``.logits``)."""
    logits = getattr(output, "logits", output)
    if not isinstance(logits, Tensor) or logits.dim() not in (2, 3) or logits.shape[0] != batch:
        shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"generate needs a causal LM whose output is [B, T, V] or [B, V] logits (or has .logits); "
                         f"got {shape} for a batch of {batch}")
    return logits[:, -1] if logits.dim() == 3 else logits


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: Tensor | Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    max_len: int | None = None,
    eos_id: int | None = None,
) -> Tensor:
    """``prompt`` followed by ``max_new_tokens`` generated tokens (module docstring: one step).

    Args:
        model: a causal LM (``[B, T]`` int64 → ``[B, T, V]`` or ``[B, V]`` logits, or an output with ``.logits``).
            It runs in eval mode (its mode is restored afterwards), without gradients, on its own device.
        prompt: int64 ``[T]`` or ``[B, T]`` token ids (or a list of ids), ``T >= 1``.
        max_new_tokens: tokens to add, ``>= 0``.
        temperature: ``0`` for greedy decoding, else ``> 0`` (``< 1`` sharpens, ``> 1`` flattens).
        top_k: sample among the ``top_k`` most likely tokens only (``None``: all).
        generator: the ``torch.Generator`` of the draws (on the model's device, or CPU: the draws are then made
            there), for reproducible sampling.
        max_len: the context length (``None``: :func:`context_length` of the model).
        eos_id: stop once every row has produced this id; a finished row is filled with it, so the result may be
            shorter than ``T + max_new_tokens``. ``None``: never stop early.

    Returns:
        int64 ``[T + n]`` (for a 1-D prompt) or ``[B, T + n]``, the prompt then the ``n <= max_new_tokens`` new
        tokens, on the model's device.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not isinstance(temperature, int | float) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an integer >= 1 or None, got {top_k!r}")
    tokens = torch.as_tensor(prompt)
    if tokens.dim() in (1, 2) and tokens.shape[-1] == 0:
        raise ValueError("prompt must hold at least one token")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool or tokens.dim() not in (1, 2):
        raise ValueError(f"prompt must be integer token ids [T] or [B, T], got {tuple(tokens.shape)} {tokens.dtype}")
    single = tokens.dim() == 1
    param = next(model.parameters(), None)
    seq = (tokens[None] if single else tokens).to(device=param.device if param is not None else "cpu",
                                                  dtype=torch.long)
    limit = max_len if max_len is not None else context_length(model)
    if limit is not None and limit < 1:
        raise ValueError(f"max_len must be >= 1, got {limit}")
    done = torch.zeros(seq.shape[0], dtype=torch.bool, device=seq.device)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            context = seq if limit is None else seq[:, -limit:]
            logits = _last_logits(model(context), seq.shape[0]).float()
            nxt = _choose(logits, temperature, top_k, generator)
            if eos_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
                done |= nxt == eos_id
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            if eos_id is not None and bool(done.all()):
                break
    finally:
        model.train(was_training)
    return seq[0] if single else seq


def _choose(logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None) -> Tensor:
    """``[B]`` next tokens from ``[B, V]`` logits: argmax at temperature 0, else a top-k softmax draw."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    z = logits / temperature
    if top_k is not None and top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    probs = torch.softmax(z, dim=-1)
    where = generator.device if generator is not None else probs.device
    return torch.multinomial(probs.to(where), 1, generator=generator).squeeze(1).to(logits.device)
