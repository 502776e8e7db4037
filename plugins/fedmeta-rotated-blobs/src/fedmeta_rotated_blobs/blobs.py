"""``rotated_blobs``: Gaussian class blobs seen by every client through its own rotation (feature shift).

    x = R_i (μ_c + σ ε),   ε ~ N(0, I_d),   c ~ Uniform{0..C−1},   n_i ~ Uniform{min_samples..max_samples}

``μ_c ~ N(0, I_d)·separation`` are shared; ``R_i`` is the orthogonal factor of ``(1 − rotation)·I + rotation·G_i``
(``G_i`` a standard Gaussian matrix, QR with the signs fixed), so ``rotation = 0`` gives every client the same
coordinates. Everything is drawn from one ``torch.Generator`` seeded with ``seed`` (``data.data_seed``); a client's
test rows come from its own distribution (``test_fraction`` of its rows, at least one).
"""

from __future__ import annotations

import math

import torch
from lightning_fedmeta.data import FederatedData, from_client_tensors
from torch import Tensor

__all__ = ["rotated_blobs"]


def _check(name: str, value: object, low: float, integer: bool = False, high: float = math.inf) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:  # type: ignore[operator]
        what = "an integer" if integer else "a number"
        raise ValueError(f"{name} must be {what} in [{low}, {high}], got {value!r}")


def _rotation(d: int, mix: float, g: torch.Generator) -> Tensor:
    q, r = torch.linalg.qr((1 - mix) * torch.eye(d) + mix * torch.randn(d, d, generator=g))
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(d))


def rotated_blobs(num_clients: int, seed: int, num_features: int = 8, num_classes: int = 4,
                  min_samples: int = 40, max_samples: int = 120, rotation: float = 1.0, noise: float = 0.5,
                  separation: float = 2.0, test_fraction: float = 0.2) -> FederatedData:
    """``num_clients`` clients of rotated Gaussian blobs (module docstring); ``num_classes`` classes."""
    _check("num_features", num_features, 1, integer=True)
    _check("num_classes", num_classes, 2, integer=True)
    _check("min_samples", min_samples, 2, integer=True)
    _check("max_samples", max_samples, min_samples, integer=True)
    _check("rotation", rotation, 0.0, high=1.0)
    _check("noise", noise, 0.0)
    _check("separation", separation, 0.0)
    _check("test_fraction", test_fraction, 0.0, high=0.9)
    g = torch.Generator().manual_seed(int(seed))
    centres = torch.randn(num_classes, num_features, generator=g) * separation
    clients = []
    for _ in range(num_clients):
        n = int(torch.randint(min_samples, max_samples + 1, (1,), generator=g))
        y = torch.randint(0, num_classes, (n,), generator=g)
        x = (centres[y] + noise * torch.randn(n, num_features, generator=g)) @ _rotation(num_features, rotation, g).T
        n_test = max(1, round(test_fraction * n))
        clients.append((x[n_test:], y[n_test:], x[:n_test], y[:n_test]))
    return from_client_tensors(clients, num_classes, [f"blobs_{i}" for i in range(num_clients)])

