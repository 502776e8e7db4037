"""Compressors of one client's upload: a flat float32 row ``v ∈ R^d`` in, its decoded estimate out.

Every compressor works on one row with tensor operations only (it runs looped over clients or under
``torch.func.vmap`` with the same numbers) and draws nothing itself: a random one reads a row of uniform draws
``u ∈ [0, 1)^d`` that :func:`compression_noise` derives from ``(seed, round, client)``
(:mod:`lightning_fedmeta.client.sampling`), never from the global random state.

* :class:`HalfPrecision` — transport in 16 bits: ``v̂ = float32(float16(v))`` (or bfloat16); 2 bytes a value.
* :class:`QSGD` — Alistarh et al., NeurIPS 2017, §3.1: per bucket of ``b`` coordinates with norm ``‖v‖``,
  ``Q_s(v_i) = ‖v‖ · sgn(v_i) · ξ_i / s`` with ``ξ_i = ℓ + 1`` with probability ``r − ℓ`` and ``ℓ`` otherwise,
  ``r = s|v_i| / ‖v‖``, ``ℓ = ⌊r⌋``. Unbiased, and (Lemma 3.1) ``E‖Q_s(v) − v‖² ≤ min(b/s², √b/s) ‖v‖²`` per
  bucket. ``bits`` per coordinate hold the sign and a level ``0..s``, ``s = 2^(bits−1) − 1`` (127 at 8 bits, 7 at
  4); each bucket's norm is sent as float32. The paper's Elias coding of the levels is not used (fixed width).
* :class:`TopK` — the ``k = ⌈fraction·d⌉`` largest ``|a_j|`` of ``a = v + e`` are sent, ``e ← a − top_k(a)``
  stays on the client (error feedback: Stich, Cordonnier & Jaggi, NeurIPS 2018, "Sparsified SGD with memory";
  Karimireddy et al., ICML 2019, "Error feedback fixes SignSGD"). Biased; the residual is client state.
* :class:`RandomK` — ``k`` coordinates drawn uniformly without replacement, scaled by ``d/k`` (unbiased,
  ``E‖v̂ − v‖² = (d/k − 1)‖v‖²``): the control for top-k, without error feedback.

Sizes (:meth:`Compressor.encoded_bytes`): a sparse row costs ``k`` float32 values plus the cheaper of ``k`` int32
indices and a ``⌈d/8⌉``-byte bitmap of the kept coordinates (the bitmap wins above ``k/d = 1/32``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from lightning_fedmeta.client.sampling import generator_for

__all__ = [
    "COMPRESSORS",
    "Compressor",
    "CompressionSpec",
    "HalfPrecision",
    "QSGD",
    "RandomK",
    "TopK",
    "check_composition",
    "compression_noise",
    "parse_compression",
    "sparse_bytes",
]


def sparse_bytes(numel: int, k: int, value_bytes: int = 4) -> int:
    """Bytes of ``k`` of ``numel`` values: ``k`` values plus the cheaper of ``k`` int32 indices and a bitmap."""
    return k * value_bytes + min(4 * k, math.ceil(numel / 8))


class Compressor(ABC):
    """One upload row's compression: :meth:`roundtrip` gives what the server decodes, :meth:`encoded_bytes` its
    size. Implements the byte accounting's ``Codec`` protocol (``name``, ``encoded_bytes``)."""

    #: the option's name (``model.compression.upload``)
    name: ClassVar[str] = ""
    #: whether ``E[v̂] = v``
    unbiased: ClassVar[bool] = False
    #: whether the client keeps a residual (error feedback) between rounds
    error_feedback: ClassVar[bool] = False
    #: whether :meth:`roundtrip` reads a row of uniform draws
    random: ClassVar[bool] = False

    @abstractmethod
    def roundtrip(self, row: Tensor, noise: Tensor | None = None) -> Tensor:
        """The server's decoded estimate ``v̂`` of one row ``v`` (``[d]``, float32; ``noise``: ``[d]`` uniforms)."""

    @abstractmethod
    def encoded_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes on the wire for ``numel`` values (whatever their ``dtype``: the code fixes the width)."""

    def step(self, row: Tensor, residual: Tensor, noise: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(v̂, e')``: the decoded upload and the client's new residual. Without error feedback ``e' = e``."""
        return self.roundtrip(row, noise), residual

    def describe(self) -> str:
        return self.name


@dataclass(frozen=True)
class HalfPrecision(Compressor):
    """Transport in 16 bits: ``v̂ = float32(half(v))``, round to nearest (float16: 10-bit mantissa, values above
    65504 become ``inf``; bfloat16: 7-bit mantissa, float32's range)."""

    dtype: torch.dtype = torch.float16
    name: ClassVar[str] = "float16"

    def roundtrip(self, row: Tensor, noise: Tensor | None = None) -> Tensor:
        return row.to(self.dtype).to(row.dtype)

    def encoded_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return 2 * numel

    def describe(self) -> str:
        return "bfloat16" if self.dtype == torch.bfloat16 else "float16"


@dataclass(frozen=True)
class QSGD(Compressor):
    """Unbiased stochastic quantisation to ``s = 2^(bits−1) − 1`` levels per sign, one float32 norm per bucket
    of ``bucket_size`` coordinates (``None``: one bucket, the whole row). Alistarh et al. 2017, §3.1, Lemma 3.1."""

    bits: int = 8
    bucket_size: int | None = 512
    name: ClassVar[str] = "qsgd"
    unbiased: ClassVar[bool] = True
    random: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not _is_int(self.bits) or self.bits not in (2, 4, 8):
            raise ValueError(f"model.compression.bits must be 2, 4 or 8 for qsgd, got {self.bits!r}")
        if self.bucket_size is not None and not (_is_int(self.bucket_size) and self.bucket_size >= 1):
            raise ValueError(f"model.compression.bucket_size must be a positive integer or null, got "
                             f"{self.bucket_size!r}")

    @property
    def levels(self) -> int:
        """``s``: the sign takes one of the ``bits``, the level ``0..s`` the others."""
        return 2 ** (self.bits - 1) - 1

    def _buckets(self, row: Tensor) -> tuple[Tensor, int]:
        d = row.shape[-1]
        b = d if self.bucket_size is None else min(self.bucket_size, d)
        pad = (-d) % b
        return torch.nn.functional.pad(row, (0, pad)).reshape(-1, b), d

    def encode(self, row: Tensor, noise: Tensor) -> tuple[Tensor, Tensor]:
        """``(signed levels [d] int8, norms [buckets] float32)``: ``sgn(v_i) ξ_i`` and each bucket's ``‖v‖``."""
        v, d = self._buckets(row)
        u, _ = self._buckets(noise)
        norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True)
        r = v.abs() * self.levels / torch.where(norm > 0, norm, torch.ones_like(norm))
        low = r.floor()
        level = (low + (u < r - low).to(r.dtype)).clamp_max(self.levels)
        signed = (torch.sign(v) * level).reshape(-1)[:d].to(torch.int8)
        return signed, norm.reshape(-1).to(torch.float32)

    def decode(self, signed: Tensor, norms: Tensor) -> Tensor:
        """``v̂_i = ‖v‖_bucket(i) · sgn(v_i) ξ_i / s``."""
        d = signed.shape[-1]
        b = d if self.bucket_size is None else min(self.bucket_size, d)
        scale = norms.repeat_interleave(b, dim=-1)[..., :d]
        return signed.to(torch.float32) * scale / self.levels

    def roundtrip(self, row: Tensor, noise: Tensor | None = None) -> Tensor:
        assert noise is not None, "QSGD draws its rounding from the uniforms of compression_noise"
        return self.decode(*self.encode(row, noise)).to(row.dtype)

    def encoded_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        buckets = 1 if self.bucket_size is None else math.ceil(numel / self.bucket_size)
        return 4 * buckets + math.ceil(numel * self.bits / 8)

    def describe(self) -> str:
        return f"qsgd{self.bits}"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _fraction(value: object) -> float:
    """``model.compression.fraction`` as a float in ``(0, 1]``; anything else (a string, a bool, NaN) is refused."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ValueError(f"model.compression.fraction must be a number in (0, 1] (the share of coordinates sent), "
                         f"got {value!r}")
    return float(value)


def _kept(fraction: float, d: int) -> int:
    return max(1, min(d, math.ceil(fraction * d)))


@dataclass(frozen=True)
class TopK(Compressor):
    """The ``k = ⌈fraction·d⌉`` largest magnitudes of ``a = v + e``; the rest stays as the residual ``e``
    (error feedback). With ``fraction = 1`` nothing is dropped: ``v̂ = v`` bit for bit, ``e = 0``."""

    fraction: float = 0.01
    name: ClassVar[str] = "topk"
    error_feedback: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"model.compression.fraction must be in (0, 1], got {self.fraction!r}")

    def encode(self, row: Tensor) -> tuple[Tensor, Tensor]:
        """``(values [k], indices [k])`` of the ``k`` largest ``|row_j|`` (ties: torch.topk's order)."""
        index = row.abs().topk(_kept(self.fraction, row.shape[-1])).indices
        return row.gather(-1, index), index

    def roundtrip(self, row: Tensor, noise: Tensor | None = None) -> Tensor:
        values, index = self.encode(row)
        return torch.zeros_like(row).scatter(-1, index, values)

    def step(self, row: Tensor, residual: Tensor, noise: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``a = v + e``; ``v̂ = top_k(a)``; ``e' = a − v̂`` (Stich et al. 2018, Algorithm 1, memory ``m``)."""
        corrected = row + residual
        sent = self.roundtrip(corrected)
        return sent, corrected - sent

    def encoded_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return sparse_bytes(numel, _kept(self.fraction, numel))

    def describe(self) -> str:
        return f"topk{self.fraction:g}"


@dataclass(frozen=True)
class RandomK(Compressor):
    """``k = ⌈fraction·d⌉`` coordinates drawn uniformly without replacement (the ``k`` largest of ``d`` uniform
    draws), scaled by ``d/k`` so that ``E[v̂] = v``; no error feedback."""

    fraction: float = 0.01
    name: ClassVar[str] = "randomk"
    unbiased: ClassVar[bool] = True
    random: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"model.compression.fraction must be in (0, 1], got {self.fraction!r}")

    def encode(self, row: Tensor, noise: Tensor) -> tuple[Tensor, Tensor]:
        d = row.shape[-1]
        index = noise.topk(_kept(self.fraction, d)).indices
        return row.gather(-1, index) * (d / index.shape[-1]), index

    def roundtrip(self, row: Tensor, noise: Tensor | None = None) -> Tensor:
        assert noise is not None, "RandomK draws its coordinates from the uniforms of compression_noise"
        values, index = self.encode(row, noise)
        return torch.zeros_like(row).scatter(-1, index, values)

    def encoded_bytes(self, numel: int, dtype: torch.dtype = torch.float32) -> int:
        return sparse_bytes(numel, _kept(self.fraction, numel))

    def describe(self) -> str:
        return f"randomk{self.fraction:g}"


#: ``model.compression.upload`` names
COMPRESSORS: tuple[str, ...] = ("none", "float16", "bfloat16", "qsgd", "topk", "randomk")
#: ``model.compression.download`` names (see :func:`parse_compression` for why only these)
DOWNLOADS: tuple[str, ...] = ("none", "float16", "bfloat16")


def compression_noise(seed: int, round_idx: int, clients: Tensor, numel: int) -> Tensor:
    """``[C, numel]`` uniforms in ``[0, 1)``, row ``c`` a pure function of ``(seed, "compression", round, c)``."""
    rows = [torch.rand(numel, generator=generator_for(seed, "compression", round_idx, int(c))) for c in clients]
    return torch.stack(rows) if rows else torch.zeros(0, numel)


@dataclass(frozen=True)
class CompressionSpec:
    """``model.compression``, parsed: the upload compressor (``None``: uncompressed) and the download's 16-bit
    dtype (``None``: float32)."""

    upload: Compressor | None = None
    download: torch.dtype | None = None

    @property
    def active(self) -> bool:
        return self.upload is not None or self.download is not None


def _upload(name: str, options: dict[str, Any]) -> Compressor | None:
    if name == "none":
        return None
    if name in ("float16", "bfloat16"):
        return HalfPrecision(torch.float16 if name == "float16" else torch.bfloat16)
    if name == "qsgd":
        return QSGD(options.pop("bits", 8), options.pop("bucket_size", 512))
    return (TopK if name == "topk" else RandomK)(_fraction(options.pop("fraction", 0.01)))


def parse_compression(option: Any) -> CompressionSpec | None:
    """``model.compression``: ``None``, an upload name (``qsgd``) or ``{upload: qsgd, bits: 8, bucket_size: 512,
    download: float16}`` (``fraction`` for ``topk``/``randomk``).

    Downloads offer 16-bit transport only: the model itself must arrive usable, and QSGD, top-k or random-k of
    the model's weights destroy it; compressing the change since the client's last copy needs the server to
    remember which model each client holds (clients skip rounds), which this library does not keep."""
    if option is None:
        return None
    if not isinstance(option, str | dict):
        raise ValueError(f"model.compression must be null, an upload name ({', '.join(COMPRESSORS)}) or a mapping "
                         f"such as {{upload: qsgd, bits: 8}}; got {option!r}")
    options = {"upload": option} if isinstance(option, str) else dict(option)
    upload = str(options.pop("upload", "none"))
    download = str(options.pop("download", "none"))
    if upload not in COMPRESSORS:
        raise ValueError(f"model.compression.upload must be one of {', '.join(COMPRESSORS)}; got {upload!r}")
    if download not in DOWNLOADS:
        raise ValueError(
            f"model.compression.download must be one of {', '.join(DOWNLOADS)}; got {download!r} (quantising or "
            "sparsifying the model a client starts from loses the model, and compressing the change since its last "
            "copy needs per-client server memory, which is not kept)"
        )
    compressor = _upload(upload, options)
    if options:
        raise ValueError(f"model.compression: unknown or unused keys {sorted(options)} for upload {upload!r}")
    dtype = None if download == "none" else (torch.float16 if download == "float16" else torch.bfloat16)
    spec = CompressionSpec(compressor, dtype)
    return spec if spec.active else None


#: robust rules that combine each coordinate separately (a sparse row's zeros outvote its few sent values)
COORDINATE_WISE_RULES: tuple[str, ...] = ("median", "trimmed_mean", "bulyan")


def check_composition(spec: CompressionSpec, *, algorithm_name: str, uploads_delta: bool, aggregator: str) -> None:
    """Refuse the compositions that cannot mean what they say (docs/communication.md, "Compression").

    The order is fixed: the client compresses its delta before the server sees it; the server's stages (attack
    simulation, DP clipping of the *decoded* update, robust rule, DP noise) then act on the decoded rows. DP's
    sensitivity argument therefore holds unchanged (every decoded row is clipped to ``C`` by the server, whatever
    the client sent); clipping or noising on the client before compressing (local DP) is not offered."""
    upload = spec.upload
    if upload is None:
        return
    if not uploads_delta:
        raise ValueError(
            f"model.compression.upload={upload.describe()!r} compresses uploads that are parameter deltas combined by "
            f"a weighted mean; {algorithm_name} combines its uploads with its own aggregate (or updates models outside "
            "the server optimizer). Remove model.compression.upload (download: float16 stays possible), or use an "
            "algorithm with the default aggregate (fedavg, fedprox, reptile, perfedavg, fedmaml, ditto, ...)"
        )
    if upload.name in ("topk", "randomk") and aggregator in COORDINATE_WISE_RULES:
        raise ValueError(
            f"model.compression.upload={upload.name!r} sends a few coordinates per client, and "
            f"model.aggregator={aggregator!r} combines each coordinate separately: where most clients sent nothing "
            "(zero) the rule returns zero, so the sparse updates are discarded. Use krum, multi_krum or "
            "geometric_median (whole-row rules), or a dense compressor (float16, qsgd)"
        )
