"""Shared machinery of the regularised multi-task algorithms (federated learning as multi-task learning).

The three algorithms (``mtl_mean``, ``mtl_pairwise``, ``mtl_graph``) minimise an objective of the form

    Φ(W) = Σ_k p_k [F_k(w_k) + λ ψ_k(W)]

over one personal model ``w_k`` per client (Hanzely & Richtárik, "Federated Learning of a Mixture of
Global and Local Models", arXiv:2002.05516, eq. (2), with weights p_k; Smith et al., "Federated
Multi-Task Learning", NeurIPS 2017). The sums run over the TRAINING clients: ``p_k`` is the
client's ``ClientRecord.weight`` (∝ n_k or uniform by the module's ``aggregation``, summing to 1 over
the training clients, 0 for a held-out client). Each subclass writes its objective once, in its
module docstring.

Client step. A sampled client takes τ SGD steps on its own block, the other clients' models and w̄
held at their values at the start of the round; every step is the partial gradient of Φ with
respect to ``w_k``, divided by ``p_k``, written as a proximal step:

    (1/p_k) ∂Φ/∂w_k = ∇F_k(w_k) + c_k (w_k − u_k):   w_k ← w_k − η (∇F_k(w_k; Dₜ) + c_k (w_k − u_k)),

with the coefficient ``c_k`` and the centre ``u_k`` of :meth:`RegularizedMTL.prox_terms`.

Clients that have not trained yet. The loop's record says whether a client has taken part in a
completed round (``client.seen``). A client that has not (never sampled yet, or held out) has no
personal model yet: its ``w_k`` is READ AS the current mean w̄, both when it trains for the first
time (it starts from w̄) and when it is evaluated (with w̄). The stored row is ignored until then.

The mean. The module's global parameters hold

    w̄ = Σ_{k seen} p_k w_k / Σ_{k seen} p_k        (the initial global model while no client is seen),

which is exactly ``Σ_k p_k w_k`` over all training clients when every unseen client's ``w_k`` is read
as w̄ (solve ``w̄ = Σ_seen p_k w_k + (1 − P) w̄`` with ``P = Σ_seen p_k``). The server keeps ``P`` in
its state (``total``) and, since a sampled client uploads ``w_k_new − w_k_start`` (start = its stored
w_k, or w̄ on its first round), the new mean is

    P' = P + Σ_{k∈S, first round} p_k,      Δ = w̄' − w̄ = Σ_{k∈S} p_k (w_k_new − w_k_start) / P',

with the GLOBAL weights ``p_k`` of the records (not the round's renormalised ``weights``). The module
applies Δ with its default server optimizer ``SGD(lr=1)``; ``server_optimizer_applies = False``
makes it refuse any other (which would break the identity).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from torch import Tensor

from lightning_fedmeta.algorithms.base import ClientOutput, ClientRecord, PersonalModel, check_non_negative
from lightning_fedmeta.algorithms.local_steps import prox_sgd
from lightning_fedmeta.algorithms.rows import take_column, take_row
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_sub, tree_weighted_sum

__all__ = [
    "RegularizedMTL",
    "SimilarityRegularizedMTL",
    "coupling_column",
    "similarity_centre",
    "clipped_cosine_similarity",
]

MODELS = "models"
SIMILARITY = "similarity"
UPDATES = "updates"
WEIGHTS = "weights"
SEEN = "seen"
TOTAL = "total"


class RegularizedMTL(PersonalModel):
    """Base of ``mtl_mean``, ``mtl_pairwise`` and ``mtl_graph``: personal models, prox SGD, exact mean tracking.

    Client state (one row per client): ``{"personal": {name: tensor}}``, the personal model (read only once the client
    has trained, ``client.seen``; before that the client's model is the current mean w̄). Server
    state: ``total`` = P = Σ_{k seen} p_k. Subclasses give the proximal coefficient and centre of a
    client (:meth:`prox_terms`). See the module docstring for the objective, the client step and
    the mean w̄.

    Args:
        lam: λ ≥ 0, strength of the regulariser.
        **kwargs: see :class:`~lightning_fedmeta.algorithms.base.Algorithm`.
    """

    server_optimizer_applies = False

    def __init__(
        self,
        lam: float = 0.1,
    ) -> None:
        super().__init__()
        check_non_negative("lam", lam)
        self.lam = lam
        self._num_clients: int | None = None
        self._weights: Tensor | None = None

    # -- state --------------------------------------------------------------------------------
    def init_server_state(self, params: Params) -> dict[str, Tensor]:
        """``total`` = P = Σ_{k seen} p_k, 0 before the first round."""
        ref = next(iter(params.values()))
        return {TOTAL: torch.zeros((), dtype=ref.dtype, device=ref.device)}

    def bind_clients(self, clients: ClientRecord, label_counts: Tensor) -> None:
        """Record ``K`` and every client's weight ``p_k`` (0 for held-out clients)."""
        super().bind_clients(clients, label_counts)
        self._num_clients = int(clients.index.numel())
        self._weights = clients.weight.detach().cpu().to(torch.float64)

    @property
    def num_clients(self) -> int:
        """``K``, known once :meth:`bind_clients` has run."""
        if self._num_clients is None:
            raise RuntimeError(
                f"{type(self).__name__}.init_server_state needs the clients: call "
                "bind_clients(clients, label_counts) first (FederatedModule.attach_data does)"
            )
        return self._num_clients

    @property
    def client_weight(self) -> Tensor:
        """``[K]`` float64 weights ``p_k`` of all clients (0 for held-out ones), from :meth:`bind_clients`."""
        _ = self.num_clients
        assert self._weights is not None
        return self._weights

    # -- client -------------------------------------------------------------------------------
    @abstractmethod
    def prox_terms(
        self, params: Params, state: dict[str, Tensor], server_state: dict[str, Tensor], client: ClientRecord
    ) -> tuple[float | Tensor, Params]:
        """``(c_k, u_k)`` with ``(1/p_k) ∂Φ/∂w_k = ∇F_k(w_k) + c_k (w_k − u_k)`` (the others fixed)."""

    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        """τ proximal steps from ``w_k`` (from w̄ on the client's first round); uploads ``w_k_new − w_k_start``."""
        w_start = self.personal_start(params, state, server_state, client)
        coef, centre = self.prox_terms(params, state, server_state, client)
        w_new, loss = prox_sgd(ctx, w_start, batches, self.local_lr, coef, centre)
        new_state = dict(state)
        new_state["personal"] = w_new
        return ClientOutput(
            delta=tree_sub(w_new, w_start),
            state=new_state,
            extras={},
            metrics={"loss": loss},
        )

    # -- server -------------------------------------------------------------------------------
    def aggregate(
        self,
        params: Params,
        outputs: ClientOutput,
        weights: Tensor,
        server_state: dict[str, Tensor],
        clients: ClientRecord,
    ) -> tuple[Params, dict[str, Tensor]]:
        """``P' = P + Σ_{k∈S unseen} p_k`` and ``Δ = Σ_{k∈S} p_k (w_k_new − w_k_start) / P'`` (the global
        ``p_k`` of the records, not the round's ``weights``): afterwards w̄ + Δ = Σ_{seen} p_k w_k / P'."""
        p = clients.weight.to(torch.float64)
        first = (~clients.seen.to(torch.bool)).to(torch.float64)
        total = server_state[TOTAL].to(torch.float64) + (p * first).sum()
        coeffs = p / total.clamp_min(torch.finfo(torch.float64).tiny)
        new_state = dict(server_state)
        new_state[TOTAL] = total.to(server_state[TOTAL].dtype)
        return tree_weighted_sum(outputs.delta, coeffs), new_state


# ----------------------------------------------------------------------------------------------
# similarity-weighted (pairwise / graph) regularisation
# ----------------------------------------------------------------------------------------------
def coupling_column(similarity: Tensor, weights: Tensor, k: Tensor, own_weight: Tensor | None = None) -> Tensor:
    """``a_{·k}`` with ``a_jk = S_jk + (p_j / p_k) S_kj`` (``a_{·k} = 0`` when ``p_k = 0``).

    ``similarity`` is ``[K, K]`` with a zero diagonal, ``weights`` the ``[K]`` client weights ``p``, ``k``
    the client's index (0-d int tensor; a one-hot product selects row and column, so it is vmap-safe)
    and ``own_weight`` its ``p_k`` (default ``weights[k]``).
    """
    column = take_column(similarity, k)  # S_{·k}
    row = take_row(similarity, k)  # S_{k·}
    w = weights.to(similarity.dtype)
    pk = take_row(w, k) if own_weight is None else own_weight.to(similarity.dtype)
    ratio = torch.where(pk > 0, w / pk.clamp_min(torch.finfo(similarity.dtype).tiny), torch.zeros_like(w))
    return torch.where(pk > 0, column + ratio * row, torch.zeros_like(column))


def similarity_centre(
    similarity: Tensor, weights: Tensor, models: Params, k: Tensor, own_weight: Tensor | None = None
) -> tuple[Tensor, Params]:
    """``(d_k, u_k)`` with ``d_k = Σ_j a_jk`` and ``u_k = Σ_j a_jk w_j / d_k`` (``u_k = 0`` when ``d_k = 0``),
    ``a_jk = S_jk + (p_j / p_k) S_kj`` (:func:`coupling_column`), so that

        Σ_j a_jk (w_k − w_j) = d_k (w_k − u_k).

    ``models`` holds every client's model stacked ``[K, ...]``.
    """
    a = coupling_column(similarity, weights, k, own_weight)
    degree = a.sum()
    coeffs = a / degree.clamp_min(torch.finfo(similarity.dtype).tiny)
    return degree, tree_weighted_sum(models, coeffs)


def clipped_cosine_similarity(updates: Tensor) -> Tensor:
    """``S_jk = max(0, cos(Δ_j, Δ_k))`` for ``j ≠ k`` and ``S_kk = 0``; rows of ``updates [K, P]``.

    A client without an update yet (a zero row) has similarity 0 to everyone.
    """
    norms = updates.norm(dim=1, keepdim=True)
    unit = updates / norms.clamp_min(torch.finfo(updates.dtype).tiny)
    s = (unit @ unit.T).clamp_min(0.0)
    return s * (1.0 - torch.eye(s.shape[0], dtype=s.dtype, device=s.device))


def _training_mask(weights: Tensor) -> Tensor:
    """``M_jk = 1`` when both j and k are training clients (``p > 0``), else 0."""
    t = (weights > 0).to(weights.dtype)
    return t.unsqueeze(1) * t.unsqueeze(0)


class SimilarityRegularizedMTL(RegularizedMTL):
    """Base of ``mtl_pairwise`` and ``mtl_graph``: ``ψ_k(W) = ½ Σ_j S_jk ‖w_k − w_j‖²`` over a similarity S.

    Objective (written once in each subclass's module docstring):
    ``Φ(W) = Σ_k p_k [F_k(w_k) + (λ/2) Σ_j S_jk ‖w_k − w_j‖²]`` over the training clients, where S is
    restricted to them (rows and columns of held-out clients are zero; the diagonal is ignored).
    ``w_k`` appears in client k's own penalty (weight p_k, pulls ``S_jk``) and in every client j's
    (weight p_j, pull ``S_kj``), so

        (1/p_k) ∂Φ/∂w_k = ∇F_k(w_k) + λ Σ_j a_jk (w_k − w_j) = ∇F_k(w_k) + λ d_k (w_k − u_k),
        a_jk = S_jk + (p_j / p_k) S_kj,   d_k = Σ_j a_jk,   u_k = Σ_j a_jk w_j / d_k,

    exact for any non-negative S, symmetric or not (for symmetric S and uniform p: a_jk = 2 S_jk). The
    other clients' models are those stored at the start of the round, an unseen client's read as w̄.

    Server state (``K`` clients): ``models`` ``{name: [K, ...]}`` — a server copy of every client's
    personal model (``aggregate`` sees only the sampled clients, so the centres of the others need
    this copy; updated from the returned personal models, it equals the client store); ``seen``
    ``[K]`` — 1 once the client has trained (rows still 0 are read as w̄); ``weights`` ``[K]`` — p;
    ``similarity`` ``[K, K]`` — S with zero diagonal and zero rows/columns for held-out clients;
    ``total`` — P (see :class:`RegularizedMTL`); and, when S is inferred, ``updates`` ``[K, P]`` — each
    client's latest update ``w_k_new − w_k_start`` flattened (zero before its first round). A client
    reads its column and row of S through its record's ``index`` with one-hot products, so
    ``client_update`` stays pure and vmappable.
    """

    @abstractmethod
    def fixed_similarity(self, num_clients: int) -> Tensor | None:
        """``[K, K]`` float64 similarity, or ``None`` to infer it from the clients' updates every round."""

    def init_server_state(self, params: Params) -> dict[str, Tensor]:
        k = self.num_clients
        first = next(iter(params.values()))
        like = {"dtype": first.dtype, "device": first.device}
        state = super().init_server_state(params)
        state.update(
            {MODELS: {n: v.detach().unsqueeze(0).repeat(k, *([1] * v.dim())).clone() for n, v in params.items()}}
        )
        weights = self.client_weight.to(**like)
        state[WEIGHTS] = weights
        state[SEEN] = torch.zeros(k, **like)
        fixed = self.fixed_similarity(k)
        if fixed is None:
            size = sum(v.numel() for v in params.values())
            state[UPDATES] = torch.zeros(k, size, **like)
            state[SIMILARITY] = torch.zeros(k, k, **like)
        else:
            off_diagonal = fixed.to(**like) * (1.0 - torch.eye(k, **like))
            state[SIMILARITY] = off_diagonal * _training_mask(weights)
        return state

    def prox_terms(
        self, params: Params, state: dict[str, Tensor], server_state: dict[str, Tensor], client: ClientRecord
    ) -> tuple[float | Tensor, Params]:
        """``c_k = λ d_k`` and ``u_k = Σ_j a_jk w_j / d_k`` (see the class docstring), unseen ``w_j`` read as w̄."""
        seen = server_state[SEEN] > 0
        models = {}
        for n in params:
            stored = server_state[MODELS][n]
            mask = seen.reshape(-1, *([1] * (stored.dim() - 1)))
            models[n] = torch.where(mask, stored, params[n].unsqueeze(0))
        degree, centre = similarity_centre(
            server_state[SIMILARITY], server_state[WEIGHTS], models, client.index, client.weight
        )
        return self.lam * degree, centre

    def aggregate(
        self,
        params: Params,
        outputs: ClientOutput,
        weights: Tensor,
        server_state: dict[str, Tensor],
        clients: ClientRecord,
    ) -> tuple[Params, dict[str, Tensor]]:
        """Mean tracking (see :class:`RegularizedMTL`), then write the sampled clients' new personal
        models into the server copies, mark them seen and, when inferring S, store their updates and
        recompute S (held-out clients masked out)."""
        delta, new_state = super().aggregate(params, outputs, weights, server_state, clients)
        idx = clients.index.to(torch.long)
        stored, personal = server_state[MODELS], outputs.state["personal"]
        new_state[MODELS] = {n: stored[n].index_copy(0, idx, personal[n].to(stored[n])) for n in params}
        new_state[SEEN] = server_state[SEEN].index_fill(0, idx, 1.0)
        if UPDATES in server_state:
            flat = torch.cat([outputs.delta[n].reshape(idx.numel(), -1) for n in params], dim=1)
            updates = server_state[UPDATES].index_copy(0, idx, flat.to(server_state[UPDATES]))
            new_state[UPDATES] = updates
            new_state[SIMILARITY] = clipped_cosine_similarity(updates) * _training_mask(server_state[WEIGHTS])
        return delta, new_state

    # -- communication -------------------------------------------------------------------------
    def download(self, params: Params, server_state: dict[str, Tensor], client: ClientRecord) -> dict[str, Any]:
        """w̄, the client's centre u_k (the server forms it from every stored model and S) and c_k = λ d_k:
        2d + 1 floats."""
        coef, centre = self.prox_terms(params, {}, server_state, client)
        return {"params": dict(params), "centre": centre, "coef": torch.as_tensor(coef)}

    def upload(self, output: ClientOutput) -> dict[str, Any]:
        """Δ_k = w_k_new − w_k_start and the new personal model w_k (the server's copy of every model): 2d."""
        return {"delta": output.delta, "state": {"personal": output.state["personal"]}}
