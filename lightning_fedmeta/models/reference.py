"""Small reference models used by the configs and the papers we reproduce, for every task.

Every model here runs batched over clients (``torch.func.vmap``, loop = vmap) unless it has dropout.

``torch.func.vmap`` support of PyTorch layers (torch 2.14.1, CPU; probe: per-client parameters, two SGD steps by
``torch.func.grad`` and a reverse-over-reverse Hessian-vector product, vmap-ed over 3 clients vs a Python loop;
plain forward in train/eval mode, with and without grad):

* ``nn.Linear``, ``nn.Conv2d``, ``nn.Embedding``, ``nn.LayerNorm``, ``nn.GroupNorm``: batched kernels; gradients and
  Hessian-vector products equal the loop to float32 reassociation (relative 1e-7 to 7e-6).
* ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` (``nn.RNNBase``): a forward outside a ``torch.func.grad`` transform fails in
  every mode (train/eval, grad enabled or ``no_grad``): "Batching rule not implemented for aten::lstm.input
  (aten::gru.input, aten::rnn_tanh.input). We could not generate a fallback." Inside ``grad`` they decompose and run
  (equal to the loop; ``nn.LSTM`` through ``aten::mkldnn_rnn_layer``, which has no batching rule, so vmap loops over
  the clients internally with a "performance drop" warning) — except ``nn.GRU``/``nn.RNN`` with parameters shared
  by all clients and data per client (the first local step), which fail ("output with shape [B, H] doesn't match
  the broadcast shape [C, B, H]"). Evaluation predicts outside ``grad``, so these layers cannot run batched:
  :func:`~lightning_fedmeta.client.execution.choose_batching` runs them looped, and :class:`CharLSTM` writes the same
  recurrences with ``nn.Linear`` gates, which vmap.
* ``nn.MultiheadAttention`` with ``need_weights=False`` and ``nn.TransformerEncoderLayer`` (``norm_first`` either
  way, dropout 0): run and equal the loop, but ``aten::_scaled_dot_product_flash_attention_for_cpu`` (and its
  backward; in eval mode ``aten::_native_multi_head_attention`` / ``aten::_transformer_encoder_layer_fwd``) have
  no batching rule, so vmap loops over clients internally; and the Hessian-vector product fails even looped
  ("derivative for aten::_scaled_dot_product_flash_attention_for_cpu_backward is not implemented"), so
  second-order algorithms cannot use them. With ``need_weights=True`` (explicit softmax) ``nn.MultiheadAttention``
  is fully batched and twice differentiable. :class:`TinyTransformer` writes attention explicitly.

Sources: Per-FedAvg MLP (Fallah et al., 2020); LEAF Shakespeare LSTM (Caldas et al., "LEAF: A Benchmark for
Federated Settings", 2018); GPT-style pre-LayerNorm blocks (Radford et al., 2019).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from lightning_fedmeta.models.vision import FEMNISTCNN, FedAvgCNN, LeNet5, ResNet18

__all__ = [
    "FEMNISTCNN",
    "FedAvgCNN",
    "LeNet5",
    "ResNet18",
    "MLP",
    "LogisticRegression",
    "SmallCNN",
    "CharLSTM",
    "TinyTransformer",
    "Reshape",
    "ELU",
    "default_model",
    "TASKS",
]

class ELU(nn.ELU):
    """``nn.ELU`` that, when compiled, computes ``x`` if ``x > 0`` else ``α (exp(x) − 1)``.

    The same function as ``nn.ELU`` (Clevert, Unterthiner, Hochreiter 2016) to float32 rounding: within 5e-8 of the
    float64 ELU, as PyTorch's own ``expm1`` form is within 3e-8 (``tests/engine/test_model_families.py``). Inductor's
    ``expm1`` runs at about 5 ns per element on x86-64, its ``exp`` about 10× faster, so the compiled client steps of
    the Per-FedAvg MLP use the ``exp`` form. Eagerly it is exactly ``nn.ELU`` (PyTorch's fused kernel, and the same
    bits as before this class existed).
    """

    def forward(self, x: Tensor) -> Tensor:
        if self.inplace or not torch.compiler.is_compiling():
            return super().forward(x)
        positive = x > 0
        # exp of the negative side only (no overflow in the branch not taken); gradient α·exp(x) at x = 0 as nn.ELU
        return torch.where(positive, x, self.alpha * (torch.exp(torch.where(positive, 0.0, x)) - 1.0))


_ACTIVATIONS = {"elu": ELU, "relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}

#: the tasks :func:`default_model` builds a model for
TASKS = ("classification", "regression", "multilabel", "next_token")


class Reshape(nn.Module):
    """``x [B, N] -> x [B, *shape]`` (``shape = ()`` gives ``[B]``); no parameters."""

    def __init__(self, shape: Sequence[int]) -> None:
        super().__init__()
        self.shape = tuple(int(s) for s in shape)

    def forward(self, x: Tensor) -> Tensor:
        return x.reshape(*x.shape[:1], *self.shape)

    def extra_repr(self) -> str:
        return f"shape={self.shape}"


class MLP(nn.Module):
    """Flatten → [Linear → (BatchNorm1d) → activation]* → Linear. ``MLP(784, [80, 60], 10, "elu")`` is the
    Per-FedAvg paper's model (68,270 parameters).

    ``norm="batch"`` puts a ``BatchNorm1d`` after each hidden ``Linear`` (the paper's MLP with normalisation
    layers, for FedBN: 280 more parameters for ``[80, 60]``); ``None`` (the default) has none, and the parameter
    names are those of the plain MLP. ``output_shape`` (optional) reshapes the ``num_classes`` outputs to
    ``[B, *output_shape]`` (its product must be ``num_classes``; ``()`` gives ``[B]`` for one output); parameter
    names are unchanged.
    """

    def __init__(
        self, in_features: int = 784, hidden: Sequence[int] = (80, 60), num_classes: int = 10,
        activation: str = "elu", output_shape: Sequence[int] | None = None, norm: str | None = None,
    ) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        if norm not in (None, "batch"):
            raise ValueError(f"norm must be null (no normalisation) or 'batch' (BatchNorm1d), got {norm!r}")
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), *([nn.BatchNorm1d(h)] if norm else []), _ACTIVATIONS[activation]()]
            width = h
        layers.append(nn.Linear(width, num_classes))
        if output_shape is not None:
            if math.prod(output_shape) != num_classes:
                raise ValueError(f"output_shape {tuple(output_shape)} does not hold {num_classes} outputs")
            layers.append(Reshape(output_shape))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class LogisticRegression(nn.Module):
    """Multinomial logistic regression ``softmax(W x + b)`` (the FedProx synthetic model)."""

    def __init__(self, in_features: int = 60, num_classes: int = 10) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(self.flatten(x))


class SmallCNN(nn.Module):
    """Two conv blocks (conv 3×3 → norm → ReLU → max-pool 2) and a linear head, for 28×28 or 32×32 images.

    ``norm="group"`` (default): ``GroupNorm(4, ·)``, per-sample statistics, so it runs batched as is.
    ``norm="batch"``: ``BatchNorm2d`` with running statistics (buffers ``features.{1,5}.running_mean`` …);
    same parameter names as ``"group"``.
    """

    def __init__(
        self, in_channels: int = 1, num_classes: int = 10, width: int = 32, image_size: int = 28,
        norm: Literal["group", "batch"] = "group",
    ) -> None:
        super().__init__()
        if norm not in ("group", "batch"):
            raise ValueError(f"norm must be 'group' or 'batch', got {norm!r}")

        def make_norm(channels: int) -> nn.Module:
            return nn.GroupNorm(4, channels) if norm == "group" else nn.BatchNorm2d(channels)

        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), make_norm(width), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), make_norm(2 * width), nn.ReLU(), nn.MaxPool2d(2),
        )
        side = image_size // 4
        self.head = nn.Linear(2 * width * side * side, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).flatten(1))


class CharLSTM(nn.Module):
    """Character model: embedding → stacked LSTM (or GRU) → linear head to the vocabulary.

    The defaults are LEAF's Shakespeare next-character model (embedding 8, 2-layer LSTM with 256 units;
    Caldas et al., 2018). Input ``[B, T]`` int64 tokens; output ``[B, vocab]`` logits for the token after the
    sequence (``all_positions=False``) or ``[B, T, vocab]`` logits of the next token at every position.

    The recurrence is written with ``nn.Linear`` gates (layer ``l``: ``ih[l]`` on the input, ``hh[l]`` on the
    state), so it runs under ``torch.func.vmap`` (``nn.LSTM``/``nn.GRU`` do not: see the module docstring), with
    PyTorch's equations and gate order (zero initial state):

    * LSTM, gates ``(i, f, g, o)``: ``i,f,o = σ(W_i· x + b_i· + W_h· h + b_h·)``, ``g = tanh(…)``,
      ``c' = f ⊙ c + i ⊙ g``, ``h' = o ⊙ tanh(c')``.
    * GRU, gates ``(r, z, n)``: ``r,z = σ(W_i· x + b_i· + W_h· h + b_h·)``,
      ``n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn))``, ``h' = (1 − z) ⊙ n + z ⊙ h``.

    ``ih[l].weight``/``bias`` are ``nn.LSTM``'s ``weight_ih_l{l}``/``bias_ih_l{l}`` (same for ``hh``), so
    :meth:`load_rnn_weights` copies a trained ``nn.LSTM``/``nn.GRU`` in exactly.
    """

    def __init__(
        self, vocab_size: int, embed_dim: int = 8, hidden_size: int = 256, num_layers: int = 2,
        cell: Literal["lstm", "gru"] = "lstm", all_positions: bool = False,
    ) -> None:
        super().__init__()
        if cell not in ("lstm", "gru"):
            raise ValueError(f"cell must be 'lstm' or 'gru', got {cell!r}")
        if num_layers < 1:
            raise ValueError(f"num_layers must be at least 1, got {num_layers}")
        self.cell = cell
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.all_positions = all_positions
        gates = 4 if cell == "lstm" else 3
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.ih = nn.ModuleList(
            nn.Linear(embed_dim if layer == 0 else hidden_size, gates * hidden_size) for layer in range(num_layers)
        )
        self.hh = nn.ModuleList(nn.Linear(hidden_size, gates * hidden_size) for _ in range(num_layers))
        bound = 1.0 / math.sqrt(hidden_size)  # nn.LSTM/nn.GRU's initialisation: U(-1/√H, 1/√H) for all weights
        for p in [*self.ih.parameters(), *self.hh.parameters()]:
            nn.init.uniform_(p, -bound, bound)
        self.head = nn.Linear(hidden_size, vocab_size)

    def _layer(self, layer: int, inputs: Tensor) -> Tensor:
        """One recurrent layer over ``inputs [B, T, in]`` → hidden states ``[B, T, H]``."""
        xs = self.ih[layer](inputs)  # input projections of all steps at once
        hh = self.hh[layer]
        h = xs.new_zeros(*xs.shape[:-2], self.hidden_size)
        c = torch.zeros_like(h)
        outs = []
        for x_t in xs.unbind(-2):
            if self.cell == "lstm":
                i, f, g, o = (x_t + hh(h)).chunk(4, dim=-1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
            else:
                x_r, x_z, x_n = x_t.chunk(3, dim=-1)
                h_r, h_z, h_n = hh(h).chunk(3, dim=-1)
                r = torch.sigmoid(x_r + h_r)
                z = torch.sigmoid(x_z + h_z)
                n = torch.tanh(x_n + r * h_n)
                h = (1 - z) * n + z * h
            outs.append(h)
        return torch.stack(outs, dim=-2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.embedding(x)
        for layer in range(self.num_layers):
            h = self._layer(layer, h)
        if not self.all_positions:
            h = h[..., -1, :]
        return self.head(h)

    @torch.no_grad()
    def load_rnn_weights(self, rnn: nn.LSTM | nn.GRU) -> None:
        """Copy the weights of an ``nn.LSTM``/``nn.GRU`` (matching cell and sizes, unidirectional, with biases,
        no projection; ``batch_first`` either way) into the gates, so both compute the same outputs."""
        expected = nn.LSTM if self.cell == "lstm" else nn.GRU
        if not isinstance(rnn, expected) or rnn.num_layers != self.num_layers or rnn.bidirectional \
                or not rnn.bias or rnn.hidden_size != self.hidden_size or getattr(rnn, "proj_size", 0):
            raise ValueError(f"expected a unidirectional {expected.__name__} with biases and {self.num_layers} layers "
                             f"of {self.hidden_size} units, got {rnn}")
        for layer in range(self.num_layers):
            self.ih[layer].weight.copy_(getattr(rnn, f"weight_ih_l{layer}"))
            self.ih[layer].bias.copy_(getattr(rnn, f"bias_ih_l{layer}"))
            self.hh[layer].weight.copy_(getattr(rnn, f"weight_hh_l{layer}"))
            self.hh[layer].bias.copy_(getattr(rnn, f"bias_hh_l{layer}"))


class _CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention written out (``softmax(q kᵀ/√d_h + M) v``, ``M_ts = −∞`` for ``s > t``),
    so it vmaps and is twice differentiable (unlike CPU ``scaled_dot_product_attention``)."""

    def __init__(self, d_model: int, nhead: int, dropout: float) -> None:
        super().__init__()
        if d_model % nhead:
            raise ValueError(f"d_model={d_model} is not divisible by nhead={nhead}")
        self.nhead = nhead
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.attn_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        *lead, t, d = x.shape
        q, k, v = (z.reshape(*lead, t, self.nhead, d // self.nhead).transpose(-3, -2)
                   for z in self.qkv(x).chunk(3, dim=-1))  # [..., heads, T, d_h]
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.nhead)
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        weights = self.attn_dropout(torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1))
        out = (weights @ v).transpose(-3, -2).reshape(*lead, t, d)
        return self.proj(out)


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + Attn(LN(x))``, then ``x + MLP(LN(x))`` (MLP: d → 4d → GELU → d)."""

    def __init__(self, d_model: int, nhead: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = _CausalSelfAttention(d_model, nhead, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout)
        )
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.resid_dropout(self.attn(self.ln1(x)))
        return x + self.mlp(self.ln2(x))


class TinyTransformer(nn.Module):
    """A small causal (decoder-only) transformer language model, GPT-style (Radford et al., 2019).

    ``h_0 = E_tok[x] + E_pos[0..T)``, then ``num_layers`` pre-LayerNorm blocks (causal multi-head self-attention,
    MLP d → 4d → d with GELU), a final LayerNorm and a linear head. Input ``[B, T]`` int64 tokens (``T ≤ max_len``);
    output ``[B, T, vocab]`` next-token logits (``all_positions=True``) or ``[B, vocab]`` of the last position.
    The logits at position ``t`` depend on tokens ``0..t`` only.

    Attention is written out (no ``scaled_dot_product_attention``), so with ``dropout=0`` it runs under
    ``torch.func.vmap`` and supports Hessian-vector products; with ``dropout>0`` (on the embeddings, attention
    weights and residual branches) :func:`~lightning_fedmeta.client.execution.choose_batching` runs clients looped.
    """

    def __init__(
        self, vocab_size: int, d_model: int = 64, nhead: int = 4, num_layers: int = 2, max_len: int = 128,
        dropout: float = 0.0, all_positions: bool = True,
    ) -> None:
        super().__init__()
        self.max_len = max_len
        self.all_positions = all_positions
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(_Block(d_model, nhead, dropout) for _ in range(num_layers)))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[-1]
        if t > self.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len={self.max_len}")
        h = self.drop(self.tok(x) + self.pos.weight[:t])
        h = self.ln(self.blocks(h))
        if not self.all_positions:
            h = h[..., -1, :]
        return self.head(h)


def default_model(
    input_shape: Sequence[int], num_classes: int, *, task: str = "classification",
    target_shape: Sequence[int] = (),
) -> nn.Module:
    """The model used when none is configured, by task (every one runs batched):

    * ``"classification"``: logistic regression for feature vectors, the Per-FedAvg MLP (784-80-60-10, ELU)
      for single-channel images, SmallCNN for colour images; output ``[B, num_classes]``.
    * ``"regression"``: MLP (flattened input → 80 → 60, ELU) → ``prod(target_shape)`` outputs, shaped
      ``[B, *target_shape]`` (``[B]`` for scalar targets, ``target_shape=()``); ``num_classes`` is ignored.
    * ``"multilabel"``: the same MLP with ``num_classes`` outputs (one logit per label), ``[B, num_classes]``.
    * ``"next_token"``: :class:`CharLSTM` (LEAF Shakespeare sizes) with vocabulary ``num_classes`` on ``[B, T]``
      token inputs; ``[B, num_classes]`` logits of the next token when targets are single tokens
      (``target_shape=()``), ``[B, T, num_classes]`` for every position when targets are sequences.
    """
    shape = tuple(input_shape)
    if task == "classification":
        if len(shape) == 1:
            return LogisticRegression(shape[0], num_classes)
        if len(shape) == 3 and shape[0] == 3:
            return SmallCNN(3, num_classes, image_size=shape[1])
        return MLP(math.prod(shape), (80, 60), num_classes, "elu")
    if task == "regression":
        target = tuple(int(s) for s in target_shape)
        return MLP(math.prod(shape), (80, 60), math.prod(target), "elu", output_shape=target)
    if task == "multilabel":
        return MLP(math.prod(shape), (80, 60), num_classes, "elu")
    if task == "next_token":
        return CharLSTM(num_classes, all_positions=len(tuple(target_shape)) > 0)
    raise ValueError(f"task must be one of {TASKS}, got {task!r}")
