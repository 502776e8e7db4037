"""Synthetic(alpha, beta) at cross-device scale: 10^5 clients and more, power-law sizes, generated in chunks.

The client model is FedProx's Synthetic(alpha, beta) (Li et al., "Federated Optimization in Heterogeneous
Networks", MLSys 2020, section 5.1; :mod:`lightning_fedmeta.data.synthetic` gives the reference and its
conventions). For client ``k = 1..K`` (dimension ``d``, ``C`` classes):

* ``u_k ~ N(0, alpha^2)``, ``B_k ~ N(0, beta^2)`` (standard deviations, as the reference code);
* ``W_k ~ N(u_k, 1)`` of shape ``[d, C]``, ``b_k ~ N(u_k, 1)`` of shape ``[C]``, ``v_k ~ N(B_k, 1)`` of shape ``[d]``;
* ``x ~ N(v_k, Sigma)``, ``Sigma = diag(j^(-1.2))``, ``j = 1..d``;  ``y = argmax (W_k^T x + b_k)``.

Only the client sizes differ from the reference (whose ``floor(LogNormal(4, 2)) + 50`` gives a mean of about
400 samples, 40 million samples at K = 10^5). Here the sizes follow a **discrete Pareto (power) law** with
minimum ``n_min``, tail exponent ``gamma`` and a cap ``n_max``:

    n_k = min(n_max, floor(n_min · U_k^(-1/gamma))),   U_k ~ Uniform(0, 1],

so ``P(n_k >= s) = (n_min / s)^gamma`` for every integer ``n_min <= s <= n_max`` (exactly: ``n_k >= s`` iff
``U_k <= (n_min/s)^gamma``). Defaults ``n_min = 10``, ``gamma = 2``, ``n_max = 500``: mean
``≈ n_min·gamma/(gamma − 1) = 20`` samples (19.6 with the floor and the cap), median 14, 1 client in 2,500 at
the cap; 1.96 million samples and about 0.5 GB of float32 features at K = 10^5, d = 60. Cross-device
populations are heavy-tailed like this (LEAF, Caldas et al. 2018, table 1: most Stack Overflow / Reddit users
hold a few samples). Each client's first ``floor((1 − test_fraction)·n_k)`` samples are its training set and
the rest its test set (the samples are i.i.d. within a client, so the reference's shuffle is not needed).

**Memory.** The output tensors are allocated once (``train_x [N_train, d]`` float32, ``test_x``, the labels
and offsets); clients are then generated in consecutive chunks of at most ``chunk_samples`` samples (a client
larger than that forms its own chunk), vectorised over the chunk, and written into their rows. Per-client
values are held as ``[K]`` arrays (``u``, ``B``, sizes) or for one chunk only (``v``, ``W``, ``b``, the
features): the peak is the final tensors plus one chunk's work (tens of MB), and there is no Python object
per client. Measured: ``benchmarks/results/scale.md``.

**Randomness.** Every quantity has its own stream (``numpy.random.SeedSequence(seed).spawn``), consumed in
client order, so the data do not depend on ``chunk_samples`` (tested), only on ``seed`` and the arguments.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lightning_fedmeta.data.federated import FederatedData

__all__ = ["make_synthetic_scale", "power_law_sizes"]

#: the streams of the generator, in the order ``SeedSequence(seed).spawn`` hands them out
_STREAMS = ("sizes", "u", "B", "v", "model", "x")


def power_law_sizes(
    num_clients: int, min_samples: int = 10, exponent: float = 2.0, max_samples: int = 500,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """``[K]`` int64 sizes ``n_k = min(n_max, floor(n_min · U^(-1/gamma)))``, ``U ~ Uniform(0, 1]``:
    ``P(n >= s) = (n_min/s)^gamma`` for integers ``n_min <= s <= n_max`` (module docstring)."""
    rng = rng if rng is not None else np.random.default_rng(0)
    u = 1.0 - rng.random(num_clients)  # (0, 1]
    sizes = np.floor(min_samples * u ** (-1.0 / exponent))
    return np.minimum(sizes, max_samples).astype(np.int64)


def _chunks(sizes: np.ndarray, chunk_samples: int) -> list[tuple[int, int]]:
    """Consecutive client ranges ``[a, b)`` of at most ``chunk_samples`` samples (at least one client each)."""
    ends = np.cumsum(sizes)
    out, a, done = [], 0, 0
    k = sizes.size
    while a < k:
        b = int(np.searchsorted(ends, done + chunk_samples, side="right"))
        b = max(b, a + 1)
        out.append((a, b))
        done = int(ends[b - 1])
        a = b
    return out


def _labels(x: np.ndarray, w: np.ndarray, bias: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``argmax (W_k^T x + b_k)`` for the client-major samples ``x`` of clients with ``sizes``: the clients of one
    size ``s`` form one stacked product ``[m, s, d] @ [m, d, C]`` (no per-sample copy of ``W_k``); each client's
    product has the same operands and shape whatever the chunk, so the labels do not depend on the chunking."""
    y = np.empty(x.shape[0], dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    for s in np.unique(sizes):
        group = np.flatnonzero(sizes == s)
        rows = starts[group, None] + np.arange(s)  # [m, s]
        logits = np.matmul(x[rows], w[group]) + bias[group, None, :]
        y[rows] = logits.argmax(axis=2)
    return y


def make_synthetic_scale(
    alpha: float = 1.0,
    beta: float = 1.0,
    num_clients: int = 100_000,
    dim: int = 60,
    num_classes: int = 10,
    seed: int = 0,
    min_samples: int = 10,
    exponent: float = 2.0,
    max_samples: int = 500,
    test_fraction: float = 0.1,
    chunk_samples: int = 65536,
) -> FederatedData:
    """Generate Synthetic(alpha, beta) with power-law client sizes (see the module docstring).

    Args:
        alpha: standard deviation of ``u_k`` (model heterogeneity), ``>= 0``.
        beta: standard deviation of ``B_k`` (input heterogeneity), ``>= 0``.
        num_clients: ``K >= 1``.
        dim: input dimension ``d >= 1``.
        num_classes: ``C >= 2``.
        seed: seed of every stream; equal seeds give equal data.
        min_samples: ``n_min``, the smallest client; with ``test_fraction`` it must leave at least one train and
            one test sample.
        exponent: the tail exponent ``gamma > 0`` (``P(n >= s) = (n_min/s)^gamma``).
        max_samples: ``n_max >= n_min``, the cap (bounds the padded width of a client's batches).
        test_fraction: each client's test share, in ``(0, 1)``.
        chunk_samples: samples generated per vectorised chunk (memory, not values: the data do not depend on it).

    Returns:
        ``FederatedData`` with float32 features ``[N, dim]`` and int64 labels, client-major.
    """
    _check_arguments(alpha, beta, num_clients, dim, num_classes, min_samples, exponent, max_samples, test_fraction,
                     chunk_samples)
    streams = dict(zip(_STREAMS, (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(6)),
                       strict=True))
    sizes = power_law_sizes(num_clients, min_samples, exponent, max_samples, streams["sizes"])
    n_train = np.floor((1.0 - test_fraction) * sizes).astype(np.int64)  # the reference's int(0.9 * n)
    n_test = sizes - n_train
    if (n_train < 1).any() or (n_test < 1).any():  # cannot happen for sizes >= min_samples; kept as a guard
        raise ValueError("a client was left without train or test samples; raise min_samples")
    u = streams["u"].normal(0.0, alpha, num_clients)
    big_b = streams["B"].normal(0.0, beta, num_clients)
    sigma_sqrt = np.power(np.arange(1, dim + 1, dtype=np.float64), -1.2) ** 0.5

    train_offsets = np.concatenate([[0], np.cumsum(n_train)])
    test_offsets = np.concatenate([[0], np.cumsum(n_test)])
    train_x, train_y = _empty_rows(int(train_offsets[-1]), dim)
    test_x, test_y = _empty_rows(int(test_offsets[-1]), dim)
    trx, tex, tr_y, te_y = train_x.numpy(), test_x.numpy(), train_y.numpy(), test_y.numpy()

    for a, b in _chunks(sizes, chunk_samples):
        n = sizes[a:b]
        x, y, owner = _chunk_samples(streams, n, u[a:b], big_b[a:b], sigma_sqrt, num_classes)
        position = np.arange(owner.size) - np.repeat(np.cumsum(n) - n, n)
        is_train = position < n_train[a:b][owner]
        trx[train_offsets[a]:train_offsets[b]] = x[is_train]
        tr_y[train_offsets[a]:train_offsets[b]] = y[is_train]
        tex[test_offsets[a]:test_offsets[b]] = x[~is_train]
        te_y[test_offsets[a]:test_offsets[b]] = y[~is_train]

    return FederatedData(
        train_x=train_x, train_y=train_y, train_offsets=torch.from_numpy(train_offsets.astype(np.int64)),
        test_x=test_x, test_y=test_y, test_offsets=torch.from_numpy(test_offsets.astype(np.int64)),
        num_classes=num_classes, task="classification",
    )


def _check_arguments(
    alpha: float, beta: float, num_clients: int, dim: int, num_classes: int, min_samples: int, exponent: float,
    max_samples: int, test_fraction: float, chunk_samples: int,
) -> None:
    """Raise ``ValueError`` for an argument of :func:`make_synthetic_scale` outside its range."""
    if not alpha >= 0 or not beta >= 0 or math.isinf(alpha) or math.isinf(beta):
        raise ValueError(f"synthetic alpha and beta must be finite and >= 0, got alpha={alpha!r}, beta={beta!r}")
    for name, value, low in (("num_clients", num_clients, 1), ("dim", dim, 1), ("num_classes", num_classes, 2),
                             ("min_samples", min_samples, 2), ("chunk_samples", chunk_samples, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if isinstance(max_samples, bool) or not isinstance(max_samples, int) or max_samples < min_samples:
        raise ValueError(f"max_samples must be an integer >= min_samples={min_samples}, got {max_samples!r}")
    if not 0 < exponent < math.inf:
        raise ValueError(f"exponent must be > 0, got {exponent!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    n_train_min = int((1.0 - test_fraction) * min_samples)
    if n_train_min < 1 or n_train_min >= min_samples:
        raise ValueError(
            f"test_fraction={test_fraction} leaves the smallest client ({min_samples} samples) with {n_train_min} "
            f"train and {min_samples - n_train_min} test samples; both must be >= 1 (raise min_samples)"
        )


def _empty_rows(n: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised float32 features ``[n, dim]`` and int64 labels ``[n]``, filled chunk by chunk."""
    return torch.empty(n, dim, dtype=torch.float32), torch.empty(n, dtype=torch.long)


def _chunk_samples(
    streams: dict[str, np.random.Generator], n: np.ndarray, u: np.ndarray, big_b: np.ndarray,
    sigma_sqrt: np.ndarray, num_classes: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Client-major features and labels of one chunk of clients with sizes ``n``, and each sample's client."""
    c, dim = n.size, sigma_sqrt.size
    v = streams["v"].standard_normal((c, dim)) + big_b[:, None]
    model = streams["model"].standard_normal((c, dim * num_classes + num_classes)) + u[:, None]
    w = model[:, : dim * num_classes].reshape(c, dim, num_classes)
    bias = model[:, dim * num_classes:]
    owner = np.repeat(np.arange(c), n)
    x = v[owner] + streams["x"].standard_normal((owner.size, dim)) * sigma_sqrt
    return x, _labels(x, w, bias, n), owner
