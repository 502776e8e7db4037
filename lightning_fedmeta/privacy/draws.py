"""Where the random draws of differential privacy come from: the run's seed, or a secret (``model.dp.secure_mode``).

DP-FedAvg's guarantee assumes the noise is unknown to whoever reads the published model. The seeded source
(:class:`SeededDraws`, the default in simulation) draws the noise from ``generator_for(seed, tag, release)``: the
run is reproducible, but ``model.seed`` is in every checkpoint, ``hparams.yaml`` and ``config.yaml``, so anyone who
reads one regenerates the noise, subtracts it from a published update and recovers the exact clipped mean; the
cohort is public the same way, so the amplification by sampling the accountant assumes does not hold either.

The secret source (:class:`SecretDraws`) keys every draw by a 256-bit secret from ``os.urandom``, made when a fit
starts and kept only in memory (never in a checkpoint, log or config):

    bytes(tag, i)  = SHAKE-256(key ‖ tag ‖ i)                     (FIPS 202 extendable-output function)
    u              = (⌊b / 2¹¹⌋ + ½) · 2⁻⁵³        for each 8-byte word b: uniform on (0, 1), 53 bits
    (z₁, z₂)       = √(−2 ln u₁) · (cos 2πu₂, sin 2πu₂)             Box–Muller, in float64
    ξ              = (z₁ + z₂ + z₃ + z₄) / 2                        N(0, 1)

The sum of four normals is Opacus's defence against floating-point attacks on Gaussian samplers (``secure_mode``
of ``opacus.optimizers.optimizer._generate_noise``, after Holohan and Braghin, "Secure Random Sampling in
Differential Privacy", ESORICS 2021, arXiv:2107.10138, Section 5.1: 2n samples with n = 2). Opacus takes its
secure generator from the unmaintained ``torchcsprng``; SHAKE-256 from Python's ``hashlib`` needs nothing extra.
The cohort (and, with ``model.dp.sampling: poisson``, each client's inclusion) is drawn from the same secret
stream, so it is as unknown as the noise. Draws from one key are deterministic, so every rank of a run agrees once
rank 0's key is broadcast; a resumed fit makes a new key (its noise differs from an uninterrupted run's: that is the
point).
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Protocol

import torch
from torch import Tensor

from lightning_fedmeta.client.sampling import generator_for
from lightning_fedmeta.privacy.mechanism import gaussian_noise

__all__ = ["DPDraws", "SecretDraws", "SeededDraws", "secret_uniform", "secret_normal", "KEY_BYTES"]

KEY_BYTES = 32


class DPDraws(Protocol):
    """The random draws of the DP mechanism (noise, count noise) and of its cohort, by tag and release index."""

    secure: bool

    def noise_tree(self, tree: dict[str, Tensor], std: float, tag: str, index: int) -> dict[str, Tensor]: ...

    def standard_normal(self, tag: str, index: int) -> float: ...

    def uniform(self, n: int, tag: str, index: int) -> Tensor: ...


class SeededDraws:
    """Draws from ``generator_for(seed, tag, index)``: reproducible from the seed, so *not secret*."""

    secure = False

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def noise_tree(self, tree: dict[str, Tensor], std: float, tag: str, index: int) -> dict[str, Tensor]:
        """N(0, std²) noise shaped like each leaf, drawn in the tree's order from one generator per (tag, index)."""
        generator = generator_for(self.seed, tag, index)
        return {k: gaussian_noise(v, std, generator) for k, v in tree.items()}

    def standard_normal(self, tag: str, index: int) -> float:
        return float(torch.randn((), generator=generator_for(self.seed, tag, index), dtype=torch.float64))

    def uniform(self, n: int, tag: str, index: int) -> Tensor:
        return torch.rand(n, generator=generator_for(self.seed, tag, index), dtype=torch.float64)


def _stream(key: bytes, nbytes: int, *parts: object) -> bytes:
    label = ":".join(str(p) for p in parts).encode()
    return hashlib.shake_256(key + len(label).to_bytes(4, "little") + label).digest(nbytes)


def secret_uniform(key: bytes, n: int, *parts: object) -> Tensor:
    """``n`` float64 uniforms on (0, 1) (53 random bits each, never 0 or 1) from SHAKE-256(key ‖ parts)."""
    if n == 0:
        return torch.zeros(0, dtype=torch.float64)
    words = torch.frombuffer(bytearray(_stream(key, 8 * n, *parts)), dtype=torch.int64)
    mantissa = (words >> 11) & ((1 << 53) - 1)
    return (mantissa.to(torch.float64) + 0.5) * 2.0 ** -53


def secret_normal(key: bytes, n: int, *parts: object) -> Tensor:
    """``n`` float64 standard normals, each the sum of four Box–Muller normals over 2 (see the module docstring)."""
    pairs = 2 * n  # four normals per output = two Box-Muller pairs
    u = secret_uniform(key, 2 * pairs, *parts).view(2, pairs)
    radius = torch.sqrt(-2.0 * torch.log(u[0]))
    angle = 2.0 * math.pi * u[1]
    normals = torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])  # 4n standard normals
    return normals.view(4, n).sum(0) / 2.0


class SecretDraws:
    """Draws keyed by a secret (``model.dp.secure_mode``): unpredictable without the key, which no file holds."""

    secure = True

    def __init__(self, key: bytes | None = None) -> None:
        key = os.urandom(KEY_BYTES) if key is None else bytes(key)
        if len(key) != KEY_BYTES:
            raise ValueError(f"a secure-mode key has {KEY_BYTES} bytes, got {len(key)}")
        self._key = key

    def __repr__(self) -> str:  # never print the key
        return "SecretDraws(<secret>)"

    def noise_tree(self, tree: dict[str, Tensor], std: float, tag: str, index: int) -> dict[str, Tensor]:
        std = float(std)
        if not (std >= 0 and math.isfinite(std)):
            raise ValueError(f"the noise standard deviation must be a finite number >= 0, got {std!r}")
        out = {}
        for name, like in tree.items():
            if std == 0:
                out[name] = torch.zeros_like(like)
                continue
            z = secret_normal(self._key, like.numel(), tag, index, name).view(like.shape) * std
            out[name] = z.to(device=like.device, dtype=like.dtype)
        return out

    def standard_normal(self, tag: str, index: int) -> float:
        return float(secret_normal(self._key, 1, tag, index)[0])

    def uniform(self, n: int, tag: str, index: int) -> Tensor:
        return secret_uniform(self._key, n, tag, index)
