"""A compressed upload as a Flower message: what a ClientApp sends in place of its float32 ``delta`` record.

The record carries the compressed representation itself, so the bytes on the wire shrink:

* ``float16``/``bfloat16``: the row in 16 bits (``half``; bfloat16 as its int16 bit pattern);
* ``qsgd``: the signed levels ``sgn(v_i) ξ_i + s`` packed ``bits`` wide into ``uint8`` (``codes``) and one
  float32 norm per bucket (``norms``);
* ``topk``/``randomk``: the ``k`` float32 values in index order and either ``k`` int32 ``indices`` or a
  ``⌈d/8⌉``-byte ``bitmap`` of the kept coordinates, whichever is smaller.

The arrays' payload is exactly :meth:`~lightning_fedmeta.communication.compressors.Compressor.encoded_bytes` of the row
(the
record adds Flower's framing), and :func:`decode_upload` gives the row :meth:`Compressor.roundtrip` gives in
simulation, bit for bit, for the same uniforms.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord
from torch import Tensor

from lightning_fedmeta.communication.compressors import (
    QSGD,
    Compressor,
    HalfPrecision,
    RandomK,
    TopK,
    compression_noise,
)
from lightning_fedmeta.persistence.memory_store import flatten_state

__all__ = ["RESIDUAL", "client_upload", "decode_upload", "encode_upload", "payload_bytes_of", "upload_layout",
           "wire_bytes"]

#: the key of the top-k residual in a node's state file (next to the algorithm's state, saved per round)
RESIDUAL = "compression-residual"


def _pack(codes: Tensor, bits: int) -> Tensor:
    """Unsigned ``bits``-wide codes (``bits`` in 2, 4, 8) packed little-end first into ``uint8``."""
    per = 8 // bits
    padded = torch.nn.functional.pad(codes.to(torch.int32), (0, (-codes.numel()) % per)).reshape(-1, per)
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return (padded << shifts).sum(1).to(torch.uint8)


def _unpack(packed: Tensor, bits: int, numel: int) -> Tensor:
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    return ((packed.to(torch.int32).unsqueeze(1) >> shifts) & ((1 << bits) - 1)).reshape(-1)[:numel]


def encode_upload(compressor: Compressor, row: Tensor, noise: Tensor | None = None) -> ArrayRecord:
    """One client's flat upload row (after error feedback, for top-k: ``v + e``) as the record it sends."""
    row = row.detach().cpu().to(torch.float32)
    if isinstance(compressor, HalfPrecision):
        half = row.to(compressor.dtype)  # bfloat16 travels as its bits (numpy has no bfloat16)
        return ArrayRecord(torch_state_dict={"half": half.view(torch.int16) if half.dtype == torch.bfloat16 else half})
    if isinstance(compressor, QSGD):
        assert noise is not None
        signed, norms = compressor.encode(row, noise)
        codes = _pack(signed.to(torch.int32) + compressor.levels, compressor.bits)
        return ArrayRecord(torch_state_dict={"codes": codes, "norms": norms})
    values, index = compressor.encode(row) if isinstance(compressor, TopK) else compressor.encode(row, noise)
    order = index.argsort()
    values, index = values[order].contiguous(), index[order].to(torch.int32)
    if math.ceil(row.numel() / 8) < 4 * index.numel():
        mask = np.zeros(row.numel(), dtype=bool)
        mask[index.numpy()] = True
        return ArrayRecord(torch_state_dict={"values": values, "bitmap": torch.from_numpy(np.packbits(mask))})
    return ArrayRecord(torch_state_dict={"values": values, "indices": index})


def decode_upload(compressor: Compressor, record: ArrayRecord | dict[str, Tensor], numel: int) -> Tensor:
    """The server's float32 row from a record :func:`encode_upload` wrote, or its arrays (``ValueError`` for a
    malformed one)."""
    arrays = record if isinstance(record, dict) else record.to_torch_state_dict()
    if isinstance(compressor, HalfPrecision):
        half = arrays["half"]
        return (half.view(torch.bfloat16) if compressor.dtype == torch.bfloat16 else half).to(torch.float32)
    if isinstance(compressor, QSGD):
        signed = _qsgd_levels(compressor, arrays["codes"], arrays["norms"], numel)
        return compressor.decode(signed.to(torch.int8), arrays["norms"])
    if not isinstance(compressor, TopK | RandomK):
        raise ValueError(f"no wire format for {type(compressor).__name__}")
    values = arrays["values"]
    if "bitmap" in arrays:
        bits = np.unpackbits(arrays["bitmap"].numpy()).astype(bool)
        if bits[numel:].any():
            raise ValueError(f"the bitmap marks coordinates past d = {numel}")
        index = torch.from_numpy(np.flatnonzero(bits[:numel]))
    else:
        index = arrays["indices"].to(torch.int64)
        if index.numel() and (int(index.min()) < 0 or not bool((index[1:] > index[:-1]).all())):
            raise ValueError("the indices of a sparse upload must be distinct, increasing and >= 0 (as an honest "
                             "node sends them)")
    if index.numel() != values.numel() or (index.numel() and int(index.max()) >= numel):
        raise ValueError(f"a sparse upload of {values.numel()} values has {index.numel()} indices for d = {numel}")
    return torch.zeros(numel, dtype=torch.float32).scatter(0, index, values)


def _qsgd_levels(compressor: QSGD, packed: Tensor, norms: Tensor, numel: int) -> Tensor:
    """The signed levels of packed QSGD ``codes``, checked against what :meth:`QSGD.encode` can produce
    (``ValueError`` otherwise): codes in ``[0, 2s]`` (``s`` levels per sign; a higher code would decode past the
    bucket norm, or wrap in 8 bits), zero padding, bucket norms ``>= 0``, no level in a bucket of norm 0, and in a
    bucket of norm >= 1e-15·√b levels of norm at least ``s − √b`` (``ξ_i > s|v_i|/‖v‖ − 1``, and the
    ``s|v_i|/‖v‖`` have norm ``s``; for smaller norms float32 squares underflow and ``‖v‖`` is inexact either way,
    which is also why no upper bound of that kind is checked, beyond ``|ξ_i| <= s``)."""
    s, bits = compressor.levels, compressor.bits
    codes = _unpack(packed, bits, packed.numel() * (8 // bits))
    if bool(codes[numel:].any()):
        raise ValueError("the QSGD codes' padding is not zero")
    top = int(codes[:numel].max()) if numel else 0
    if top > 2 * s:
        raise ValueError(f"a QSGD code is {top}, above the top level {2 * s} of {bits}-bit codes")
    if bool((norms < 0).any()):
        raise ValueError("a QSGD bucket norm is negative")
    signed = codes[:numel] - s
    b = numel if compressor.bucket_size is None else min(compressor.bucket_size, numel)
    rows = torch.nn.functional.pad(signed, (0, (-numel) % b)).reshape(-1, b).to(torch.float64)
    size = torch.linalg.vector_norm(rows, dim=1)
    if size.numel() != norms.numel():
        raise ValueError(f"{norms.numel()} QSGD bucket norms for {size.numel()} buckets")
    if bool(((norms == 0) & (size > 0)).any()):
        raise ValueError("a QSGD bucket of norm 0 has levels other than 0 (an honest bucket of norm 0 is all 0)")
    low = (s - math.sqrt(b)) * (1 - 1e-6)
    # below 1e-15·√b float32 squares underflow and ‖v‖ is inexact; an infinite norm is refused as not finite
    exact = (norms.to(torch.float64) >= 1e-15 * math.sqrt(b)) & torch.isfinite(norms)
    if bool((exact & (size < low)).any()):  # e.g. a norm of 3e38 with levels of 0 and 1
        raise ValueError(f"a QSGD bucket of norm > 0 has levels of norm {float(size[norms > 0].min()):.4g}, less "
                         f"than an honest encoding gives (at least s − √b = {s - math.sqrt(b):.4g})")
    return signed


def payload_bytes_of(record: ArrayRecord) -> int:
    """Bytes of the arrays a record carries (without Flower's framing)."""
    return sum(t.numel() * t.element_size() for t in record.to_torch_state_dict().values())


def upload_layout(compressor: Compressor, numel: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The arrays (name: shape, dtype) of an honest compressed upload of ``numel`` values (what the server's reply
    check expects): the record :func:`encode_upload` writes for a zero row."""
    zeros = torch.zeros(numel)
    record = encode_upload(compressor, zeros, zeros)
    return {k: (tuple(v.shape), v.dtype) for k, v in record.to_torch_state_dict().items()}


def client_upload(compressor: Compressor, delta: dict[str, Tensor], residual: Tensor | None, seed: int,
                  round_idx: int, client: int) -> tuple[ArrayRecord, Tensor | None]:
    """A node's compressed ``delta`` record and its new top-k residual, as the simulation's
    :class:`~lightning_fedmeta.loop.compression_stage.CompressionStage` computes them: ``v = flat(Δ)`` (float32, in the
    delta's key order), ``a = v + e`` with error feedback, the record of ``a`` (uniforms of
    :func:`~lightning_fedmeta.communication.compressors.compression_noise` for ``(seed, round, client)``) and ``e' = a
    − â``."""
    row = torch.cat([v.detach().cpu().reshape(-1) for v in flatten_state(delta).values()]).to(torch.float32)
    noise = compression_noise(seed, round_idx, torch.tensor([client]), row.numel())[0] if compressor.random else None
    if not compressor.error_feedback:
        return encode_upload(compressor, row, noise), residual
    corrected = row + (torch.zeros_like(row) if residual is None else residual)
    record = encode_upload(compressor, corrected, noise)
    return record, corrected - decode_upload(compressor, record, row.numel())


def wire_bytes(content: Any) -> int:
    """Bytes of a message's ``RecordDict`` serialised as Flower sends it (protobuf; the arrays as ``.npy``
    buffers with their headers, the record and key names), without gRPC's own framing."""
    from flwr.common.serde import recorddict_to_proto

    return int(recorddict_to_proto(content).ByteSize())
