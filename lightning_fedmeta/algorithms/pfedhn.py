"""pFedHN: a server hypernetwork generates each client's model from the client's embedding (``pfedhn``).

Shamsian, Navon, Fetaya, Chechik, "Personalized Federated Learning using Hypernetworks", ICML 2021,
arXiv:2103.04628 (Algorithm 1). The server holds a hypernetwork h(·; φ) and one embedding v_i per
client; client i's model is θ_i = h(v_i; φ). Round t, sampled client i:

    θ_i = h(v_i; φ);   θ̃_i = τ local SGD steps from θ_i;   Δθ_i = θ̃_i − θ_i   (uploaded)
    server:  g_φ = −Σ_i p_i (∂θ_i/∂φ)ᵀ Δθ_i,   g_v = −Σ_i p_i (∂θ_i/∂v)ᵀ Δθ_i,   then an SGD step on (φ, v)

(the gradient of Σ_i p_i ⟨θ_i(φ, v_i), θ_i − θ̃_i⟩, i.e. a chain rule through the local update direction).
Hypernetwork (the authors' CNNHyper): an MLP of ``mlp_layers`` linear layers of width ``hidden_dim``
with ReLU between them, then one linear head per parameter tensor of the model:
``θ_i[name] = A_name f(v_i) + b_name``, ``f`` the MLP (the identity when ``mlp_layers = 0``).

Server step (the authors' optimizer): gradients clipped to global norm ``clip_norm``, then SGD with
``momentum`` and ``weight_decay`` on every hypernetwork tensor, rate ``server_lr`` for φ and
``embed_lr`` for the embeddings (all rows: momentum and decay move unsampled rows too, as torch's SGD does).
With ``mlp_layers = 0``, embeddings fixed at 0 (``embed_init_std = 0``, ``embed_lr = 0``) and a plain step
(server_lr 1, no momentum, decay or clipping) every θ_i is b and b follows FedAvg: tested.

The module's global parameters hold h(v̄; φ), v̄ = Σ_i p_i v_i over the training clients (the model a
client without a trained embedding is evaluated with); they are set in :meth:`PFedHN.aggregate`, so only
the default server step SGD(lr=1) is accepted (``server_optimizer_applies = False``).

Where we differ from the authors' code (github.com/AvivSham/pFedHN, experiments/pfedhn/trainer.py).
* The authors take one client per hypernetwork step; we take one step per round on the p-weighted
  sum over the round's sampled clients (``clients_per_round = 1`` gives theirs).
* The heads' weights A start at 0 and their biases b at the module's initial parameters, so every
  client starts from the module's initial model; the authors initialise every layer as ``nn.Linear``
  does (random generated models). The MLP layers and embeddings are initialised as theirs
  (``nn.Linear``'s uniform rule, embeddings N(0, ``embed_init_std``²)), from ``init_seed``.
* The local steps are plain SGD (``local_lr``); the authors' inner optimizer has momentum 0.9, weight
  decay 5e-5 and gradient clipping at norm 50.
* ``embed_dim = None`` gives the authors' ``1 + K/4`` (K = all clients, held-out ones included).
* The authors' pFedHN-PC variant (personal classifier heads) is not implemented.

New clients. A client without a trained embedding (held out, or not yet sampled) is evaluated with
h(v̄; φ), then ``finetune_steps`` SGD steps on that model. The paper's novel-client protocol, which
trains a new embedding through the frozen hypernetwork, is not implemented.

Common arguments. ``local_steps`` (τ, the batches' leading axis), ``local_lr`` and ``batch_size`` drive
the clients' SGD; ``finetune_*`` fine-tune the evaluated model. Client code is the generation and the
local SGD, batchable under vmap; the hypernetwork step runs on the server (``torch.func.vjp``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.func import vjp, vmap

from lightning_fedmeta.algorithms.base import (
    Algorithm,
    ClientOutput,
    ClientRecord,
    check_integer,
    check_non_negative,
    check_seed,
    started_from,
)
from lightning_fedmeta.algorithms.local_steps import local_sgd
from lightning_fedmeta.algorithms.rows import take_row
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_sub

__all__ = ["PFedHN", "generate"]

HNET = "hnet"
MOMENTUM = "momentum"
WEIGHTS = "weights"
EMBED = "embed"


def generate(hnet: dict[str, Tensor], v: Tensor, shapes: dict[str, torch.Size], layers: int) -> Params:
    """``θ = h(v; φ)``: ``f = L_n(ReLU(… L_1(v)))`` (``f = v`` when ``layers = 0``), then
    ``θ[name] = A_name f + b_name``."""
    f = v
    for layer in range(layers):
        if layer > 0:
            f = torch.relu(f)
        f = hnet[f"mlp.{layer}.weight"] @ f + hnet[f"mlp.{layer}.bias"]
    return {n: (hnet[f"head.{n}.weight"] @ f + hnet[f"head.{n}.bias"]).reshape(s) for n, s in shapes.items()}


def _uniform(shape: tuple[int, ...], fan_in: int, g: torch.Generator) -> Tensor:
    """``nn.Linear``'s initial values: U(−1/√fan_in, 1/√fan_in)."""
    bound = 1.0 / math.sqrt(fan_in)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).mul(bound)


class PFedHN(Algorithm):
    """A server hypernetwork h(v_i; φ) generates client i's model; its gradient comes from the clients' updates.

    Args:
        embed_dim: size of a client embedding (``None``: ``1 + K/4`` as the authors).
        hidden_dim: width of the hypernetwork's MLP (authors: 100).
        mlp_layers: linear layers of the MLP (authors: 4, their ``n_hidden = 3`` plus the input layer; 0:
            the heads read the embedding directly).
        server_lr: rate of the hypernetwork step (authors: 0.01).
        embed_lr: rate of the embeddings (``None``: ``server_lr``).
        momentum: server SGD momentum in [0, 1) (authors: 0.9).
        weight_decay: server SGD weight decay (authors: 1e-3).
        clip_norm: global norm the hypernetwork gradient is clipped to (authors: 50; 0: no clipping).
        embed_init_std: standard deviation of the initial embeddings (authors: 1, ``nn.Embedding``).
        init_seed: seed of the hypernetwork's initial values.
        local_steps, local_lr, batch_size, finetune_steps, finetune_lr, finetune_batch_size: see
            :class:`~lightning_fedmeta.algorithms.base.Algorithm`.
    """

    step_budget = True
    name = "pfedhn"
    summary = "pFedHN: a server hypernetwork generates θ_i = h(v_i; φ) (Shamsian et al., 2021)"
    server_optimizer_applies = False

    def __init__(
        self,
        embed_dim: int | None = None,
        hidden_dim: int = 100,
        mlp_layers: int = 4,
        server_lr: float = 0.01,
        embed_lr: float | None = None,
        momentum: float = 0.9,
        weight_decay: float = 1e-3,
        clip_norm: float = 50.0,
        embed_init_std: float = 1.0,
        init_seed: int = 0,
    ) -> None:
        super().__init__()
        for label, value, low in (("hidden_dim", hidden_dim, 1), ("mlp_layers", mlp_layers, 0),
                                  ("embed_dim", 1 if embed_dim is None else embed_dim, 1)):
            check_integer(label, value, low)
        for label, value in (("server_lr", server_lr), ("weight_decay", weight_decay),
                             ("clip_norm", clip_norm), ("embed_init_std", embed_init_std)):
            check_non_negative(label, value)
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1) (the authors use 0.9; from 1 on the momentum buffer "
                             f"b <- momentum*b + g never forgets old gradients), got {momentum!r}")
        check_seed("init_seed", init_seed)
        if embed_lr is not None:
            check_non_negative("embed_lr", embed_lr)
        self.embed_dim = embed_dim
        self.hidden_dim = hidden_dim
        self.mlp_layers = mlp_layers
        self.server_lr = server_lr
        self.embed_lr = server_lr if embed_lr is None else embed_lr
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.clip_norm = clip_norm
        self.embed_init_std = embed_init_std
        self.init_seed = init_seed
        self._weights: Tensor | None = None

    def bind_clients(self, clients: ClientRecord, label_counts: Tensor) -> None:
        """Record every client's weight ``p_i`` (0 for held-out clients): v̄ = Σ_i p_i v_i."""
        self._weights = clients.weight.detach().cpu().to(torch.float64)

    # -- state ---------------------------------------------------------------------------------
    def init_server_state(self, params: Params) -> dict[str, Tensor]:
        """The hypernetwork (``hnet``), its momentum buffers (zero) and the clients' weights."""
        if self._weights is None:
            raise RuntimeError("PFedHN.init_server_state needs the clients: call bind_clients(clients, label_counts) "
                               "first (FederatedModule.attach_data does)")
        k = self._weights.numel()
        e = int(1 + k / 4) if self.embed_dim is None else self.embed_dim
        g = torch.Generator().manual_seed(self.init_seed)
        ref = next(iter(params.values()))
        hnet = {EMBED: torch.randn((k, e), generator=g, dtype=torch.float64) * self.embed_init_std}
        width = e
        for layer in range(self.mlp_layers):
            hnet[f"mlp.{layer}.weight"] = _uniform((self.hidden_dim, width), width, g)
            hnet[f"mlp.{layer}.bias"] = _uniform((self.hidden_dim,), width, g)
            width = self.hidden_dim
        for n, p in params.items():
            hnet[f"head.{n}.weight"] = torch.zeros((p.numel(), width), dtype=torch.float64)
            hnet[f"head.{n}.bias"] = p.detach().reshape(-1).to(torch.float64).cpu()
        hnet = {n: t.to(dtype=ref.dtype, device=ref.device) for n, t in hnet.items()}
        return {HNET: hnet, MOMENTUM: {n: torch.zeros_like(t) for n, t in hnet.items()},
                WEIGHTS: self._weights.to(dtype=ref.dtype, device=ref.device)}

    def _model(self, hnet: dict[str, Tensor], v: Tensor, params: Params) -> Params:
        return generate(hnet, v, {n: p.shape for n, p in params.items()}, self.mlp_layers)

    def _mean_embedding(self, server_state: dict[str, Tensor]) -> Tensor:
        """v̄ = Σ_i p_i v_i over the training clients."""
        return server_state[WEIGHTS] @ server_state[HNET][EMBED]

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
        """τ SGD steps from ``θ_i = h(v_i; φ)``; uploads ``Δθ_i = θ̃_i − θ_i``."""
        hnet = server_state[HNET]
        theta = self._model(hnet, take_row(hnet[EMBED], client.index), params)
        trained, loss = local_sgd(ctx, theta, batches, self.local_lr)
        return ClientOutput(delta=tree_sub(trained, theta), state={}, extras={}, metrics={"loss": loss})

    def download(self, params: Params, server_state: dict[str, Tensor], client: ClientRecord) -> dict[str, Tensor]:
        """The client's generated model ``θ_i = h(v_i; φ)`` (d floats; the hypernetwork stays on the server)."""
        hnet = server_state[HNET]
        return self._model(hnet, take_row(hnet[EMBED], client.index), params)

    def upload(self, output: ClientOutput) -> dict[str, Tensor]:
        """``Δθ_i = θ̃_i − θ_i`` (d floats)."""
        return {"delta": output.delta}

    def aggregate(
        self,
        params: Params,
        outputs: ClientOutput,
        weights: Tensor,
        server_state: dict[str, Tensor],
        clients: ClientRecord,
    ) -> tuple[Params, dict[str, Tensor]]:
        """One clipped SGD(momentum, weight decay) step of (φ, v) along ``−Σ_i p_i (∂θ_i/∂(φ, v))ᵀ Δθ_i``;
        the global parameters become ``h(v̄; φ)``."""
        hnet, idx = server_state[HNET], clients.index.to(torch.long)

        def generated(h: dict[str, Tensor]) -> Params:
            return vmap(lambda v: self._model(h, v, params))(h[EMBED][idx])

        cotangent = {n: -(weights.to(d.dtype).reshape(-1, *([1] * (d.dim() - 1))) * d)
                     for n, d in outputs.delta.items()}
        with torch.enable_grad():
            _, pullback = vjp(generated, hnet)
            grads = pullback(cotangent)[0]
        new_hnet, new_momentum = self._sgd(hnet, grads, server_state[MOMENTUM])
        new_state = {HNET: new_hnet, MOMENTUM: new_momentum, WEIGHTS: server_state[WEIGHTS]}
        mean_model = self._model(new_hnet, self._mean_embedding(new_state), params)
        return tree_sub(mean_model, params), new_state

    def _sgd(
        self, hnet: dict[str, Tensor], grads: dict[str, Tensor], momentum: dict[str, Tensor]
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Clip to global norm, add weight decay, momentum ``b ← μ b + g``, step ``φ ← φ − lr b`` (torch's SGD)."""
        if self.clip_norm > 0:
            norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values()))
            scale = torch.clamp(self.clip_norm / (norm + 1e-6), max=1.0)
            grads = {n: g * scale.to(g.dtype) for n, g in grads.items()}
        new_hnet, new_momentum = {}, {}
        for n, g in grads.items():
            g = g + self.weight_decay * hnet[n]
            new_momentum[n] = self.momentum * momentum[n] + g
            rate = self.embed_lr if n == EMBED else self.server_lr
            new_hnet[n] = hnet[n] - rate * new_momentum[n]
        return new_hnet, new_momentum

    # -- evaluation ----------------------------------------------------------------------------
    def personal_start(
        self, params: Params, state: dict[str, Tensor], server_state: dict[str, Tensor], client: ClientRecord
    ) -> Params:
        """``h(v_i; φ)`` for a client that has trained; ``h(v̄; φ)`` (the global parameters) otherwise."""
        hnet = server_state[HNET]
        own = self._model(hnet, take_row(hnet[EMBED], client.index), params)
        return started_from(client, own, params)
