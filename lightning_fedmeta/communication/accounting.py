"""Communication accounting: the bytes each client downloads and uploads in a round (docs/communication.md).

An algorithm declares what travels (:meth:`~lightning_fedmeta.algorithms.base.Algorithm.download`: what one client
receives at the start of a round; :meth:`~lightning_fedmeta.algorithms.base.Algorithm.upload`: what one client sends
back), and a :class:`Codec` says how many bytes a tensor takes on the wire. For round ``r`` with candidates ``C_r``
(the clients sent the round's model, dropped ones included) and answering clients ``S_r ⊆ C_r``:

    down_i = Σ_{t ∈ download(w, σ, i)} codec.encoded_bytes(numel(t), dtype(t))      for i ∈ C_r
    up_i   = Σ_{t ∈ upload(out_i)}     codec.encoded_bytes(numel(t), dtype(t))      for i ∈ S_r, 0 for i ∈ C_r \\ S_r

With :class:`PlainCodec` a tensor costs ``numel · itemsize`` bytes (its raw payload; framing is not counted).

Under ``model.compression`` (:mod:`lightning_fedmeta.communication.compressors`) each direction has its own code, the
one the
compressor really sends: the upload's ``delta`` travels as ONE flat row of ``d = Σ numel`` values, so it costs
``compressor.encoded_bytes(d)`` (QSGD's ``⌈d/b⌉`` float32 norms and ``⌈d·bits/8⌉`` level bytes; top-k's and
random-k's ``k`` values and indices of the flat row), the rest of the upload stays plain; the download is
``download(half(w), σ, i)``: the tensors the algorithm sends from the 16-bit model cost 2 bytes a value.
:class:`TrafficCounter` keeps the run's cumulative sums in the engine's checkpointed state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_fedmeta.communication.compressors import CompressionSpec, Compressor
from lightning_fedmeta.persistence.memory_store import flatten_state

__all__ = [
    "Codec",
    "PlainCodec",
    "RoundTraffic",
    "TrafficCounter",
    "payload_bytes",
    "round_traffic",
    "sent_model",
    "upload_bytes",
    "upload_of_client",
]

UP, DOWN = "comm/up_bytes", "comm/down_bytes"


@runtime_checkable
class Codec(Protocol):
    """How a tensor travels: ``encoded_bytes(numel, dtype)`` is the size of its encoding in bytes."""

    name: str

    def encoded_bytes(self, numel: int, dtype: torch.dtype) -> int: ...


class PlainCodec:
    """No compression: a tensor of ``numel`` elements of ``dtype`` takes ``numel · itemsize`` bytes."""

    name = "plain"

    def encoded_bytes(self, numel: int, dtype: torch.dtype) -> int:
        return int(numel) * _itemsize(dtype)

    def __repr__(self) -> str:
        return "PlainCodec()"


def _itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype`` (``torch.bool``: 1)."""
    return torch.empty((), dtype=dtype).element_size()


def payload_bytes(tensors: Mapping[str, Any], codec: Codec | None = None, per_client: bool = False) -> int | Tensor:
    """``Σ_t codec.encoded_bytes(numel(t), dtype(t))`` over the (possibly nested) ``tensors``.

    With ``per_client=True`` every tensor is stacked ``[n, ...]`` (one row per client) and the result is an int64
    tensor ``[n]``: each client's bytes (rows have equal sizes, so every entry is the same)."""
    codec = codec or PlainCodec()
    leaves = flatten_state(tensors)
    if not per_client:
        return sum(codec.encoded_bytes(t.numel(), t.dtype) for t in leaves.values())
    sizes = {t.shape[0] for t in leaves.values()}
    if len(sizes) > 1:
        raise ValueError(f"per_client=True needs every tensor stacked over the same clients, got leading sizes "
                         f"{sorted(sizes)}")
    n = sizes.pop() if sizes else 0
    one = sum(codec.encoded_bytes(t[0].numel() if n else 0, t.dtype) for t in leaves.values())
    return torch.full((n,), one, dtype=torch.int64)


@dataclass(frozen=True)
class RoundTraffic:
    """The bytes each of a round's candidate clients downloaded and uploaded (int64 ``[n]``; 0 up for a client
    that dropped out)."""

    up_bytes: Tensor
    down_bytes: Tensor

    def totals(self) -> dict[str, int]:
        """``{"comm/up_bytes": Σ_i up_i, "comm/down_bytes": Σ_i down_i}``."""
        return {UP: int(self.up_bytes.sum()), DOWN: int(self.down_bytes.sum())}


def upload_of_client(output: Any, i: int) -> Any:
    """Client ``i``'s row of a stacked :class:`~lightning_fedmeta.algorithms.base.ClientOutput`."""
    return type(output)(*(_row(field, i) for field in output))


def _row(tree: Mapping[str, Any], i: int) -> dict[str, Any]:
    return {k: _row(v, i) if isinstance(v, Mapping) else v[i] for k, v in tree.items()}


def upload_bytes(upload: Mapping[str, Any], codec: Codec | None = None, compressor: Compressor | None = None) -> int:
    """One client's upload in bytes: without ``compressor`` :func:`payload_bytes`; with it the ``delta`` is one
    flat row of ``d = Σ_t numel(t)`` values costing ``compressor.encoded_bytes(d)`` (how
    :class:`~lightning_fedmeta.loop.compression_stage.CompressionStage` and the Flower client send it), plus the rest of
    the upload through ``codec``."""
    if compressor is None or "delta" not in upload:
        return int(payload_bytes(upload, codec))
    d = sum(t.numel() for t in flatten_state(upload["delta"]).values())
    rest = {k: v for k, v in upload.items() if k != "delta"}
    return int(compressor.encoded_bytes(d)) + int(payload_bytes(rest, codec))


def sent_model(params: Mapping[str, Tensor], compression: CompressionSpec | None) -> dict[str, Tensor]:
    """The model as it travels down: its floating tensors in ``compression.download`` (16 bits), else as is."""
    dtype = None if compression is None else compression.download
    if dtype is None:
        return dict(params)
    return {n: p.to(dtype) if p.is_floating_point() else p for n, p in params.items()}


def round_traffic(algorithm: Any, params: Mapping[str, Tensor], server_state: Mapping[str, Any], first: Any,
                  candidates: Tensor, answered: Tensor, output: Any | None, codec: Codec | None = None,
                  compression: CompressionSpec | None = None) -> RoundTraffic:
    """A round's :class:`RoundTraffic`: every candidate downloads ``download(sent_model(params), server_state,
    first)`` (its size does not depend on the client: :func:`~lightning_fedmeta.testing.check_algorithm` checks
    it), and every candidate in ``answered`` uploads :func:`upload_bytes` of ``upload`` of its row of the stacked
    ``output`` (``None``: nobody answered), the delta through ``compression.upload`` when one is set.

    ``first`` is one candidate's (unstacked) record; ``answered`` is a bool ``[n]`` mask over ``candidates``."""
    n = int(candidates.numel())
    down_tree = algorithm.download(sent_model(params, compression), server_state, first) if n else {}
    down_one = payload_bytes(down_tree, codec) if n else 0
    compressor = None if compression is None else compression.upload
    up_one = upload_bytes(algorithm.upload(upload_of_client(output, 0)), codec, compressor) \
        if output is not None else 0
    down = torch.full((n,), int(down_one), dtype=torch.int64)
    up = answered.cpu().to(torch.int64) * int(up_one)
    return RoundTraffic(up_bytes=up, down_bytes=down)


class TrafficCounter:
    """The run's cumulative bytes (``comm/up_bytes_cumulative``, ``comm/down_bytes_cumulative``) and the last
    round's :class:`RoundTraffic`; its ``state_dict`` goes into the engine's checkpointed state, so the sums
    continue after a resume."""

    def __init__(self) -> None:
        self.up = 0
        self.down = 0
        self.last: RoundTraffic | None = None
        #: nothing is counted, logged or checkpointed: the round's bytes would reveal a cohort size that
        #: ``model.dp`` hides (:func:`~lightning_fedmeta.privacy.mechanism.hides_cohort_size`)
        self.hidden = False

    def add(self, traffic: RoundTraffic) -> None:
        if self.hidden:
            return
        totals = traffic.totals()
        self.up += totals[UP]
        self.down += totals[DOWN]
        self.last = traffic

    def logged(self, traffic: RoundTraffic) -> dict[str, int]:
        """The round's sums and the cumulative sums after it, by logged name (none when :attr:`hidden`)."""
        if self.hidden:
            return {}
        return {**traffic.totals(), f"{UP}_cumulative": self.up, f"{DOWN}_cumulative": self.down}

    def cumulative(self) -> dict[str, int]:
        return {} if self.hidden else {f"{UP}_cumulative": self.up, f"{DOWN}_cumulative": self.down}

    def state_dict(self) -> dict[str, int]:
        return {"up_bytes": self.up, "down_bytes": self.down}

    def load_state_dict(self, state: Mapping[str, Any] | None) -> None:
        """Restore the sums (a checkpoint from before byte accounting restarts them at 0)."""
        state = state or {}
        self.up, self.down = int(state.get("up_bytes", 0)), int(state.get("down_bytes", 0))
        self.last = None
