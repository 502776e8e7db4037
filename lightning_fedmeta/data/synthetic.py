"""The Synthetic(alpha, beta) federated benchmark of FedProx.

Source: Li, Sahu, Zaheer, Sanjabi, Talwalkar & Smith, "Federated Optimization in Heterogeneous
Networks", MLSys 2020 (arXiv:1812.06127), section 5.1, and its reference generators
``data/synthetic_1_1/generate_synthetic.py`` (also ``synthetic_0_0``, ``synthetic_0.5_0.5``) and
``data/synthetic_iid/generate_iid.py`` in https://github.com/litian96/FedProx (commit 3eed82e).

For client ``k = 1..K`` (reference: K = 30, dim d = 60, C = 10 classes):

* ``n_k = floor(LogNormal(mu=4, sigma=2)) + 50`` samples (a power-law-like size distribution);
* ``u_k ~ N(0, alpha^2)`` and ``B_k ~ N(0, beta^2)`` -- the reference code calls
  ``np.random.normal(0, alpha)``, whose second argument is the *standard deviation*, so
  ``alpha``/``beta`` are standard deviations (the paper writes ``N(0, alpha)``);
* ``W_k ~ N(u_k, 1)`` of shape ``[d, C]``, ``b_k ~ N(u_k, 1)`` of shape ``[C]``;
* ``v_k ~ N(B_k, 1)`` of shape ``[d]``;
* ``x ~ N(v_k, Sigma)``, ``Sigma = diag(j^(-1.2))``, ``j = 1..d``;
* ``y = argmax softmax(W_k^T x + b_k) = argmax (W_k^T x + b_k)``.

``alpha`` controls how much the local models differ, ``beta`` how much the local inputs differ.
IID variant (``generate_iid.py``): one shared ``W ~ N(0, 1)``, ``b ~ N(0, 1)`` and
``x ~ N(0, Sigma)`` for every client (``alpha`` and ``beta`` are unused).

Each client's samples are shuffled and split into ``floor(0.9 n_k)`` train / the rest test, as
in the reference (``train_len = int(0.9 * num_samples)``); ``test_fraction`` generalizes the 0.1.
The generator is a pure function of ``seed`` (``numpy.random.default_rng(seed)``), so the data
is not bit-identical to the reference's global ``np.random`` stream, only equal in distribution.
"""

from __future__ import annotations

import numpy as np
import torch

from lightning_fedmeta.data.federated import FederatedData

__all__ = ["make_synthetic", "split_client"]

#: one client's ``(train_x, train_y, test_x, test_y)``
_Client = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def make_synthetic(
    alpha: float,
    beta: float,
    num_clients: int = 30,
    dim: int = 60,
    num_classes: int = 10,
    seed: int = 0,
    iid: bool = False,
    test_fraction: float = 0.1,
) -> FederatedData:
    """Generate Synthetic(alpha, beta) (see the module docstring for the model and sources).

    Args:
        alpha: standard deviation of ``u_k`` (model heterogeneity), ``>= 0``.
        beta: standard deviation of ``B_k`` (input heterogeneity), ``>= 0``.
        num_clients: number of clients ``K >= 1``.
        dim: input dimension ``d >= 1``.
        num_classes: number of classes ``C >= 2``.
        seed: seed of ``numpy.random.default_rng``; equal seeds give equal data.
        iid: the FedProx "Synthetic-IID" variant (shared ``W, b``; ``x ~ N(0, Sigma)``).
        test_fraction: fraction of each client's samples held out for test, in ``(0, 1)``;
            the train part is ``floor((1 - test_fraction) * n_k)``.

    Returns:
        ``FederatedData`` with float32 features ``[N, dim]`` and int64 labels.
    """
    _check_arguments(alpha, beta, num_clients, dim, num_classes, test_fraction)
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(4.0, 2.0, num_clients).astype(np.int64) + 50
    sigma_sqrt = np.power(np.arange(1, dim + 1, dtype=np.float64), -1.2) ** 0.5  # sqrt of diag(Sigma)

    if iid:
        w_shared = rng.normal(0.0, 1.0, (dim, num_classes))
        b_shared = rng.normal(0.0, 1.0, num_classes)
        u = np.zeros(num_clients)
        means = np.zeros((num_clients, dim))
    else:
        u = rng.normal(0.0, alpha, num_clients)
        big_b = rng.normal(0.0, beta, num_clients)
        means = rng.normal(big_b[:, None], 1.0, (num_clients, dim))

    clients = []
    for k in range(num_clients):
        if iid:
            w, b = w_shared, b_shared
        else:
            w = rng.normal(u[k], 1.0, (dim, num_classes))
            b = rng.normal(u[k], 1.0, num_classes)
        x = means[k] + rng.standard_normal((int(sizes[k]), dim)) * sigma_sqrt
        clients.append(_shuffle_and_split(rng, x, np.argmax(x @ w + b, axis=1), k, test_fraction))
    return _assemble(clients, num_classes)


def _check_arguments(
    alpha: float, beta: float, num_clients: int, dim: int, num_classes: int, test_fraction: float
) -> None:
    """Raise ``ValueError`` for an argument of :func:`make_synthetic` outside its range."""
    if not alpha >= 0 or not beta >= 0:
        raise ValueError(f"synthetic alpha and beta must be >= 0, got alpha={alpha!r}, beta={beta!r}")
    checks = (("num_clients", num_clients, 1), ("dim", dim, 1), ("num_classes", num_classes, 2))
    for name, value, low in checks:
        if not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")


def split_client(
    k: int, x: np.ndarray, y: np.ndarray, test_fraction: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Client ``k``'s ``(train_x, train_y, test_x, test_y)``: its first ``n_train = floor((1 - test_fraction) n)``
    samples train, the rest test. Raises ``ValueError`` when either part would be empty."""
    n = x.shape[0]
    n_train = int((1.0 - test_fraction) * n)
    if n_train < 1 or n_train >= n:
        raise ValueError(
            f"test_fraction={test_fraction} leaves client {k} ({n} samples) with {n_train} train and "
            f"{n - n_train} test samples; both must be >= 1"
        )
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def _shuffle_and_split(
    rng: np.random.Generator, x: np.ndarray, y: np.ndarray, k: int, test_fraction: float
) -> _Client:
    """Client ``k``'s samples shuffled by ``rng`` and split into ``(train_x, train_y, test_x, test_y)``
    (:func:`split_client`)."""
    order = rng.permutation(x.shape[0])
    return split_client(k, x[order], y[order], test_fraction)


def _assemble(clients: list[_Client], num_classes: int) -> FederatedData:
    """The clients' ``(train_x, train_y, test_x, test_y)`` concatenated into one ``FederatedData``."""

    def cat(i: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.concatenate([c[i] for c in clients]), dtype=dtype)

    def offsets(i: int) -> torch.Tensor:
        return torch.tensor([0] + [len(c[i]) for c in clients], dtype=torch.long).cumsum(0)

    return FederatedData(
        train_x=cat(0, torch.float32), train_y=cat(1, torch.long), train_offsets=offsets(1),
        test_x=cat(2, torch.float32), test_y=cat(3, torch.long), test_offsets=offsets(3),
        num_classes=num_classes,
    )
