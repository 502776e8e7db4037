"""Synthetic federated datasets for the non-classification tasks: regression, multi-label and next-token.

Every generator is a pure function of ``seed`` (``numpy.random.default_rng(seed)``), made entirely in
code (no files), and returns a :class:`~lightning_fedmeta.data.federated.FederatedData` whose
``task`` is set. Client sizes follow :func:`~lightning_fedmeta.data.synthetic.make_synthetic`
(FedProx, Li et al., MLSys 2020, arXiv:1812.06127, section 5.1): ``n_k = floor(LogNormal(4, 2)) + 50``
samples for client ``k``, of which ``floor((1 - test_fraction) n_k)`` are train and the rest test.

Regression and multi-label (:func:`make_synthetic_regression`, :func:`make_synthetic_multilabel`) use
the inputs and linear models of FedProx's Synthetic(alpha, beta), with ``D`` outputs instead of
``C`` class scores (``d`` = ``dim``):

* ``u_k ~ N(0, alpha^2)``, ``B_k ~ N(0, beta^2)`` (standard deviations ``alpha``, ``beta``, as in
  the FedProx reference code);
* ``W_k = s W_0 + N(u_k, 1)`` of shape ``[d, D]`` and ``b_k = s b_0 + N(u_k, 1)`` of shape ``[D]``,
  where ``W_0 ~ N(0, 1)``, ``b_0 ~ N(0, 1)`` are drawn once and shared by every client and
  ``s = shared`` (default 0: exactly FedProx's ``W_k ~ N(u_k, 1)``; the shared draws are made
  whatever ``s`` is, so changing ``shared`` changes nothing else);
* ``v_k ~ N(B_k, 1)`` of shape ``[d]`` and ``x ~ N(v_k, Sigma)``, ``Sigma = diag(j^(-1.2))``, ``j = 1..d``;
* the noiseless signal ``z = W_k^T x + b_k`` (``[D]`` per sample).

``alpha`` sets how much the clients' models differ, ``beta`` how much their inputs differ, and
``shared`` how large the component common to all clients' models is (what a global model can learn);
the clients always share the generative family and the input covariance ``Sigma``.

Next-token prediction (:func:`make_synthetic_next_token`) uses a Markov chain per client whose
transition matrix mixes a shared chain and a client's own chain; :func:`bayes_accuracy` gives the best
achievable next-token accuracies (own chain against shared chain), so tests and experiments can check
that personalisation has something to gain.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lightning_fedmeta.data.federated import FederatedData
from lightning_fedmeta.data.synthetic import split_client

__all__ = [
    "bayes_accuracy",
    "make_synthetic_multilabel",
    "make_synthetic_next_token",
    "make_synthetic_regression",
    "next_token_chains",
    "stationary_distribution",
]


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_common(alpha: float, beta: float, test_fraction: float) -> None:
    if not alpha >= 0 or not beta >= 0:
        raise ValueError(f"alpha and beta must be >= 0, got alpha={alpha!r}, beta={beta!r}")
    _check_fraction(test_fraction)


def _check_fraction(test_fraction: float) -> None:
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")


def _client_sizes(rng: np.random.Generator, num_clients: int) -> np.ndarray:
    """``n_k = floor(LogNormal(mu=4, sigma=2)) + 50`` (FedProx's power-law-like client sizes)."""
    return rng.lognormal(4.0, 2.0, num_clients).astype(np.int64) + 50


def _assemble(
    clients: Sequence[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
    x_dtype: torch.dtype,
    y_dtype: torch.dtype,
    num_classes: int | None,
    task: str,
) -> FederatedData:
    def cat(i: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.as_tensor(np.concatenate([c[i] for c in clients]), dtype=dtype)

    def offsets(i: int) -> torch.Tensor:
        return torch.tensor([0] + [len(c[i]) for c in clients], dtype=torch.long).cumsum(0)

    return FederatedData(
        train_x=cat(0, x_dtype), train_y=cat(1, y_dtype), train_offsets=offsets(1),
        test_x=cat(2, x_dtype), test_y=cat(3, y_dtype), test_offsets=offsets(3),
        num_classes=num_classes, task=task,
    )


def _linear_clients(
    rng: np.random.Generator, alpha: float, beta: float, num_clients: int, dim: int, out_dim: int, shared: float
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each client's inputs ``x [n_k, d]`` and noiseless signals ``z = W_k^T x + b_k`` ``[n_k, D]``."""
    sizes = _client_sizes(rng, num_clients)
    sigma_sqrt = np.power(np.arange(1, dim + 1, dtype=np.float64), -1.2) ** 0.5  # sqrt of diag(Sigma)
    u = rng.normal(0.0, alpha, num_clients)
    big_b = rng.normal(0.0, beta, num_clients)
    means = rng.normal(big_b[:, None], 1.0, (num_clients, dim))
    w0 = rng.normal(0.0, 1.0, (dim, out_dim))
    b0 = rng.normal(0.0, 1.0, out_dim)
    xs, zs = [], []
    for k in range(num_clients):
        w = shared * w0 + rng.normal(u[k], 1.0, (dim, out_dim))
        b = shared * b0 + rng.normal(u[k], 1.0, out_dim)
        x = means[k] + rng.standard_normal((int(sizes[k]), dim)) * sigma_sqrt
        xs.append(x)
        zs.append(x @ w + b)
    return xs, zs


def make_synthetic_regression(
    alpha: float = 1.0,
    beta: float = 1.0,
    num_clients: int = 30,
    dim: int = 60,
    target_dim: int = 1,
    noise: float = 0.1,
    seed: int = 0,
    test_fraction: float = 0.1,
    shared: float = 0.0,
) -> FederatedData:
    """Federated linear regression with FedProx-style heterogeneity (model in the module docstring).

    Targets: ``y = z / r + noise * eps``, ``eps ~ N(0, I_D)``, where ``z = W_k^T x + b_k`` and
    ``r = sqrt(mean(z^2))`` is the root mean square of the noiseless signal pooled over every sample
    (train and test) of every client and every output. So the noiseless part of the targets has mean
    square exactly 1 over the whole dataset (individual clients are of unit order, larger for clients
    with a large ``|u_k|``), and ``noise`` is the noise standard deviation in those units
    (signal-to-noise ratio ``1 / noise^2``). The best possible test mean squared error of client
    ``k`` is ``noise^2`` per output, reached by its own model ``(W_k / r, b_k / r)``.

    Args:
        alpha: standard deviation of ``u_k`` (model heterogeneity), ``>= 0``.
        beta: standard deviation of ``B_k`` (input heterogeneity), ``>= 0``.
        num_clients: number of clients ``K >= 1``.
        dim: input dimension ``d >= 1``.
        target_dim: output dimension ``D >= 1``.
        noise: standard deviation of the target noise (after scaling), ``>= 0``.
        seed: seed of ``numpy.random.default_rng``; equal arguments give equal data.
        test_fraction: fraction of each client's samples held out for test, in ``(0, 1)``.
        shared: scale ``s`` of the model component ``s W_0, s b_0`` common to all clients (any real;
            0 gives FedProx's independent ``W_k ~ N(u_k, 1)``).

    Returns:
        ``FederatedData`` with task ``"regression"``, ``num_classes=None``, float32 inputs ``[N, dim]``
        and float32 targets ``[N]`` (``target_dim == 1``) or ``[N, target_dim]``.
    """
    _check_common(alpha, beta, test_fraction)
    for name, value in (("num_clients", num_clients), ("dim", dim), ("target_dim", target_dim)):
        _check_int(name, value, 1)
    if not noise >= 0:
        raise ValueError(f"noise must be >= 0, got {noise!r}")
    rng = np.random.default_rng(seed)
    xs, zs = _linear_clients(rng, alpha, beta, num_clients, dim, target_dim, float(shared))
    rms = float(np.sqrt(np.mean(np.concatenate(zs) ** 2)))
    scale = rms if rms > 0 else 1.0
    clients = []
    for k, (x, z) in enumerate(zip(xs, zs, strict=True)):
        y = z / scale + noise * rng.standard_normal(z.shape)
        if target_dim == 1:
            y = y[:, 0]
        clients.append(split_client(k, x, y, test_fraction))
    return _assemble(clients, torch.float32, torch.float32, None, "regression")


def make_synthetic_multilabel(
    alpha: float = 1.0,
    beta: float = 1.0,
    num_clients: int = 30,
    dim: int = 60,
    num_labels: int = 10,
    seed: int = 0,
    test_fraction: float = 0.1,
    positive_rate: float = 0.5,
    shared: float = 0.0,
) -> FederatedData:
    """Federated multi-label classification with FedProx-style heterogeneity (module docstring).

    Label ``c`` of a sample is ``y_c = 1[z_c > t_c]`` with ``z = W_k^T x + b_k`` (``D = num_labels``).
    The threshold ``t_c`` is the ``(1 - positive_rate)`` quantile (``numpy.quantile``, linear
    interpolation) of ``z_c`` pooled over every sample (train and test) of every client, so about a
    fraction ``positive_rate`` of all samples carry label ``c``, and over the whole dataset every label
    is 1 for at least one sample (the largest ``z_c``) and 0 for at least one (the smallest). Within
    one client a label may be constant: the clients' label rates differ (heterogeneity), as in
    FedProx's Synthetic, where most clients have a dominant class.

    Args:
        alpha, beta, num_clients, dim, seed, test_fraction, shared: as in
            :func:`make_synthetic_regression`.
        num_labels: number of labels ``C >= 1`` per sample.
        positive_rate: target fraction of positive labels over the whole dataset, in ``(0, 1)``.

    Returns:
        ``FederatedData`` with task ``"multilabel"``, ``num_classes=num_labels``, float32 inputs
        ``[N, dim]`` and float32 ``{0, 1}`` targets ``[N, num_labels]``.
    """
    _check_common(alpha, beta, test_fraction)
    for name, value in (("num_clients", num_clients), ("dim", dim), ("num_labels", num_labels)):
        _check_int(name, value, 1)
    if not 0.0 < positive_rate < 1.0:
        raise ValueError(f"positive_rate must be in (0, 1), got {positive_rate!r}")
    rng = np.random.default_rng(seed)
    xs, zs = _linear_clients(rng, alpha, beta, num_clients, dim, num_labels, float(shared))
    thresholds = np.quantile(np.concatenate(zs), 1.0 - positive_rate, axis=0)  # [C]
    clients = [
        split_client(k, x, (z > thresholds).astype(np.float32), test_fraction)
        for k, (x, z) in enumerate(zip(xs, zs, strict=True))
    ]
    return _assemble(clients, torch.float32, torch.float32, num_labels, "multilabel")


def _draw_chains(
    rng: np.random.Generator, num_clients: int, vocab_size: int, mix: float, concentration: float
) -> tuple[np.ndarray, np.ndarray]:
    ones = np.full(vocab_size, float(concentration))
    shared = rng.dirichlet(ones, size=vocab_size)  # [V, V], row i = P(next | current = i)
    own = rng.dirichlet(ones, size=(num_clients, vocab_size))  # [K, V, V]
    return shared, (1.0 - mix) * shared[None] + mix * own


def _check_chain_args(num_clients: int, vocab_size: int, mix: float, concentration: float) -> None:
    _check_int("num_clients", num_clients, 1)
    _check_int("vocab_size", vocab_size, 2)
    if not 0.0 <= mix <= 1.0:
        raise ValueError(f"mix must be in [0, 1], got {mix!r}")
    if not concentration > 0:
        raise ValueError(f"concentration must be > 0, got {concentration!r}")


def next_token_chains(
    num_clients: int = 30, vocab_size: int = 16, mix: float = 0.5, seed: int = 0, concentration: float = 0.1
) -> tuple[np.ndarray, np.ndarray]:
    """The transition matrices behind :func:`make_synthetic_next_token` with the same arguments.

    Every row of the shared chain ``P_shared`` and of each client chain ``Q_k`` is drawn from
    ``Dir(concentration * 1_V)``; client ``k``'s text follows ``P_k = (1 - mix) P_shared + mix Q_k``.

    Returns:
        ``(P_shared [V, V], P [K, V, V])`` as float64 arrays; ``P[k, i, j]`` is the probability that
        token ``j`` follows token ``i`` in client ``k``'s text.
    """
    _check_chain_args(num_clients, vocab_size, mix, concentration)
    return _draw_chains(np.random.default_rng(seed), num_clients, vocab_size, mix, concentration)


def stationary_distribution(chain: np.ndarray) -> np.ndarray:
    """The stationary distribution ``pi`` of a transition matrix: ``pi P = pi``, ``sum(pi) = 1``.

    Solved as the linear system ``(P^T - I) pi = 0`` with the last equation replaced by
    ``sum(pi) = 1`` (unique for the chains here: all their entries are positive).
    """
    p = np.asarray(chain, dtype=np.float64)
    if p.ndim != 2 or p.shape[0] != p.shape[1]:
        raise ValueError(f"chain must be a square [V, V] transition matrix, got shape {p.shape}")
    v = p.shape[0]
    a = p.T - np.eye(v)
    a[-1] = 1.0
    b = np.zeros(v)
    b[-1] = 1.0
    pi = np.clip(np.linalg.solve(a, b), 0.0, None)
    return pi / pi.sum()


def bayes_accuracy(chain: np.ndarray, predictor: np.ndarray | None = None) -> float:
    """Next-token accuracy on stationary text of ``chain`` when predicting from the current token.

    The predictor guesses ``argmax_j predictor[i, j]`` after token ``i``, so its accuracy is

        acc(P, Q) = sum_i pi_P(i) * P[i, argmax_j Q[i, j]],     pi_P = stationary distribution of P.

    * ``predictor=None`` (``Q = P``): the Bayes-optimal accuracy ``sum_i pi_P(i) max_j P[i, j]`` of a
      client that knows its own chain. Because the text is Markov, no model -- whatever context it
      reads, global or personalised -- beats it at any position of a window.
    * ``predictor=P_shared``: the accuracy of a model that knows only the shared chain. For every
      client ``acc(P_k, P_shared) <= acc(P_k, P_k)``, with equality only when both choose the same next
      token for every current token; with ``mix > 0`` the gap is what personalisation can gain.
      (The best *global* current-token predictor uses ``Q = sum_k n_k pi_k(i) P_k[i, :]``, the pooled
      bigram counts; a model that reads the whole window may also partly recognise the client from it.)

    Args:
        chain: ``[V, V]`` transition matrix of the text (rows sum to 1).
        predictor: ``[V, V]`` scores whose row-wise argmax is the guess; ``None`` uses ``chain``.
    """
    p = np.asarray(chain, dtype=np.float64)
    q = p if predictor is None else np.asarray(predictor, dtype=np.float64)
    if q.shape != p.shape:
        raise ValueError(f"predictor must have the chain's shape {p.shape}, got {q.shape}")
    pi = stationary_distribution(p)
    guess = q.argmax(axis=1)
    return float(np.sum(pi * p[np.arange(p.shape[0]), guess]))


def make_synthetic_next_token(
    num_clients: int = 30,
    vocab_size: int = 16,
    seq_len: int = 20,
    mix: float = 0.5,
    seed: int = 0,
    test_fraction: float = 0.1,
    targets: str = "sequence",
    concentration: float = 0.1,
) -> FederatedData:
    """Federated next-token prediction on Markov-chain text that differs between clients.

    Client ``k``'s text is a Markov chain over ``V = vocab_size`` tokens with transition matrix
    ``P_k = (1 - mix) P_shared + mix Q_k`` (:func:`next_token_chains`: every row of ``P_shared`` and
    ``Q_k`` ~ ``Dir(concentration * 1_V)``; ``mix = 0``: all clients share one chain, ``mix = 1``:
    independent chains). Client ``k`` has ``n_k = floor(LogNormal(4, 2)) + 50`` samples; each sample is
    a stretch ``s_0 .. s_T`` of ``T + 1`` tokens (``T = seq_len``) of the client's text started in its
    stationary distribution ``pi_k`` (:func:`stationary_distribution`), i.e. a window of a long
    stationary text, with distinct windows independent (so train and test share no tokens):

    * ``x = s[0:T]`` (``[n, T]`` int64);
    * ``targets="sequence"``: ``y = s[1:T+1]`` (``[n, T]`` int64, the next token at every position);
    * ``targets="last"``: ``y = s[T]`` (``[n]`` int64, the token after the window).

    Best achievable accuracy (:func:`bayes_accuracy`): a client that knows its chain reaches
    ``sum_i pi_k(i) max_j P_k[i, j]`` at every position; one that knows only the shared chain reaches
    ``sum_i pi_k(i) P_k[i, argmax_j P_shared[i, j]]``, never more. With the defaults (``V = 16``,
    ``mix = 0.5``, ``concentration = 0.1``, seed 0) the clients' mean is about 0.35 for their own chain
    against 0.28 for the shared one (chance: ``1 / V = 0.0625``).

    Args:
        num_clients: number of clients ``K >= 1``.
        vocab_size: number of tokens ``V >= 2`` (also ``num_classes``).
        seq_len: window length ``T >= 1``.
        mix: weight of the client's own chain, in ``[0, 1]``.
        seed: seed of ``numpy.random.default_rng``; equal arguments give equal data. The chains are
            drawn first, so :func:`next_token_chains` with the same arguments returns them.
        test_fraction: fraction of each client's samples held out for test, in ``(0, 1)``.
        targets: ``"sequence"`` or ``"last"`` (above).
        concentration: Dirichlet concentration of the transition rows, ``> 0`` (small: peaked rows,
            predictable text).

    Returns:
        ``FederatedData`` with task ``"next_token"`` and ``num_classes=vocab_size``.
    """
    _check_chain_args(num_clients, vocab_size, mix, concentration)
    _check_int("seq_len", seq_len, 1)
    _check_fraction(test_fraction)
    if targets not in ("sequence", "last"):
        raise ValueError(f"targets must be 'sequence' or 'last', got {targets!r}")
    rng = np.random.default_rng(seed)
    _, chains = _draw_chains(rng, num_clients, vocab_size, mix, concentration)
    sizes = _client_sizes(rng, num_clients)
    clients = []
    for k in range(num_clients):
        n = int(sizes[k])
        cdf = np.cumsum(chains[k], axis=1)
        start_cdf = np.cumsum(stationary_distribution(chains[k]))
        seq = np.empty((n, seq_len + 1), dtype=np.int64)
        seq[:, 0] = np.minimum(np.searchsorted(start_cdf, rng.random(n), side="right"), vocab_size - 1)
        for t in range(seq_len):
            u = rng.random(n)
            seq[:, t + 1] = np.minimum((u[:, None] >= cdf[seq[:, t]]).sum(axis=1), vocab_size - 1)
        y = seq[:, 1:] if targets == "sequence" else seq[:, -1]
        clients.append(split_client(k, seq[:, :-1], y, test_fraction))
    return _assemble(clients, torch.long, torch.long, vocab_size, "next_token")
