"""Split a centralized labelled set among clients.

Every partitioner is a pure function of its arguments (randomness comes only from ``seed``) and
returns one sorted int64 tensor of row indices per client; no index is given to two clients.
Indices not given to any client are simply unused.

Partitions:

* :func:`iid` -- uniform random split into near-equal parts.
* :func:`dirichlet` -- label skew, per class ``p_c ~ Dir(alpha * 1_K)`` (Hsu, Qi & Brown, 2019,
  "Measuring the Effects of Non-Identical Data Distribution for Federated Visual Classification",
  arXiv:1909.06335).
* :func:`shards` -- sort by label, cut into ``K * m`` shards, ``m`` shards per client (McMahan et
  al., AISTATS 2017, "Communication-Efficient Learning of Deep Networks from Decentralized Data").
* :func:`perfedavg_paper` -- the split of Fallah, Mokhtari & Ozdaglar, NeurIPS 2020,
  "Personalized Federated Learning with Theoretical Guarantees: A Model-Agnostic
  Meta-Learning Approach" (Per-FedAvg), section 6.
* :func:`matching_test_split` -- per-client test sets that follow each client's train label
  distribution, drawn from the dataset's own test pool.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "PERFEDAVG_SAMPLES_PER_CLASS",
    "cap_client_sizes",
    "dirichlet",
    "iid",
    "matching_test_split",
    "perfedavg_paper",
    "shards",
]

#: Default ``a`` of :func:`perfedavg_paper`: the value the Per-FedAvg paper reports for MNIST
#: (section 6, a = 196; a = 68 for CIFAR-10), quoted from memory of the paper -- the search tools
#: available when this was written did not return the paper text, and a public reimplementation
#: (``MNIST_MAML``) uses a = 168. It fits 50 clients on MNIST and Fashion-MNIST: each of classes
#: 0-4 needs 25 * 196 + 5 * 98 = 5390 training images (MNIST's smallest of those classes, class 4,
#: has 5842; Fashion-MNIST has 6000 per class) and each of classes 5-9 needs 5 * 392 = 1960.
#: CIFAR-10 (5000 per class) needs a smaller ``a`` (the paper's 68).
PERFEDAVG_SAMPLES_PER_CLASS = 196


def _as_labels(labels: Tensor | Sequence[int] | np.ndarray) -> Tensor:
    y = torch.as_tensor(labels).reshape(-1)
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(f"labels must be integers, got dtype {y.dtype}")
    y = y.to(torch.long).cpu()
    if y.numel() and int(y.min()) < 0:
        raise ValueError(f"labels must be >= 0, got minimum {int(y.min())}")
    return y


def _check_num_clients(num_clients: int, num_samples: int) -> None:
    if not isinstance(num_clients, int) or num_clients <= 0:
        raise ValueError(f"num_clients must be a positive integer, got {num_clients!r}")
    if num_clients > num_samples:
        raise ValueError(f"num_clients={num_clients} exceeds the number of samples ({num_samples})")


def _generator(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(int(seed))
    return g


def _sorted_parts(parts: Sequence[Tensor]) -> list[Tensor]:
    return [torch.sort(p.to(torch.long)).values for p in parts]


def _indices_by_class(y: Tensor, num_classes: int) -> list[Tensor]:
    """``[(y == c).nonzero().flatten() for c in range(num_classes)]`` from one stable sort of ``y``.

    A stable sort keeps each class's indices ascending, exactly as ``nonzero`` lists them, so the
    result is identical, for one pass over the labels instead of one per class.
    """
    order = torch.sort(y, stable=True).indices
    counts = torch.bincount(y, minlength=num_classes)[:num_classes]
    starts = torch.searchsorted(y[order], torch.arange(num_classes, dtype=y.dtype))
    return [order[s : s + n] for s, n in zip(starts.tolist(), counts.tolist(), strict=True)]


def iid(labels: Tensor | Sequence[int], num_clients: int, seed: int = 0) -> list[Tensor]:
    """Shuffle all ``N`` indices with ``seed`` and cut them into ``num_clients`` near-equal parts.

    Client ``i`` gets ``floor(N / K)`` or ``floor(N / K) + 1`` samples (``torch.tensor_split``).
    Only ``len(labels)`` is used.
    """
    y = _as_labels(labels)
    _check_num_clients(num_clients, y.numel())
    perm = torch.randperm(y.numel(), generator=_generator(seed))
    return _sorted_parts(torch.tensor_split(perm, num_clients))


def dirichlet(labels: Tensor | Sequence[int], num_clients: int, alpha: float, seed: int = 0) -> list[Tensor]:
    """Label-skewed split: for each class ``c``, proportions ``p_c ~ Dir(alpha * 1_K)`` over clients.

    The shuffled indices of class ``c`` (``n_c`` of them) are cut at ``floor(cumsum(p_c) * n_c)``,
    so client ``k`` gets about ``p_{c,k} * n_c`` samples of class ``c`` (Hsu et al., 2019).
    Small ``alpha`` gives few classes per client (and possibly empty clients, which
    ``FederatedData.check_no_empty_client`` reports); ``alpha -> inf`` tends to IID.
    Randomness: ``numpy.random.default_rng(seed)``.

    Raises:
        ValueError: ``alpha <= 0`` (Dir(alpha) needs ``alpha > 0``) or invalid ``num_clients``.
    """
    if not alpha > 0:
        raise ValueError(f"dirichlet alpha must be > 0, got {alpha!r}")
    y = _as_labels(labels)
    _check_num_clients(num_clients, y.numel())
    rng = np.random.default_rng(seed)
    y_np = y.numpy()
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in np.unique(y_np):
        idx = np.flatnonzero(y_np == c)
        rng.shuffle(idx)
        p = rng.dirichlet(np.full(num_clients, float(alpha)))
        cuts = (np.cumsum(p)[:-1] * idx.size).astype(np.int64)
        for k, chunk in enumerate(np.split(idx, cuts)):
            parts[k].append(chunk)
    return _sorted_parts([torch.from_numpy(np.concatenate(p).astype(np.int64)) for p in parts])


def shards(
    labels: Tensor | Sequence[int], num_clients: int, classes_per_client: int, seed: int = 0
) -> list[Tensor]:
    """Pathological non-IID split of McMahan et al. (2017): ``m = classes_per_client`` shards each.

    The indices are shuffled (so ties are broken at random), stably sorted by label, and cut into
    ``S = K * m`` contiguous near-equal shards; a random permutation of the shard ids gives client
    ``k`` shards ``perm[k*m : (k+1)*m]``. A client therefore sees at most about ``m`` classes
    (a shard may straddle a class boundary). Randomness: ``torch.Generator().manual_seed(seed)``.

    Raises:
        ValueError: ``classes_per_client`` outside ``[1, number of classes]`` or more shards than samples.
    """
    y = _as_labels(labels)
    _check_num_clients(num_clients, y.numel())
    num_classes = int(y.max()) + 1 if y.numel() else 0
    if not isinstance(classes_per_client, int) or not 1 <= classes_per_client <= num_classes:
        raise ValueError(
            f"classes_per_client must be an integer in [1, {num_classes}] (the number of classes), "
            f"got {classes_per_client!r}"
        )
    num_shards = num_clients * classes_per_client
    if num_shards > y.numel():
        raise ValueError(
            f"shards needs num_clients * classes_per_client = {num_clients} * {classes_per_client} = "
            f"{num_shards} shards but there are only {y.numel()} samples"
        )
    g = _generator(seed)
    perm = torch.randperm(y.numel(), generator=g)
    order = perm[torch.sort(y[perm], stable=True).indices]
    pieces = torch.tensor_split(order, num_shards)
    shard_perm = torch.randperm(num_shards, generator=g).view(num_clients, classes_per_client)
    return _sorted_parts([torch.cat([pieces[int(s)] for s in row]) for row in shard_perm])


def perfedavg_paper(
    labels: Tensor | Sequence[int],
    num_clients: int = 50,
    samples_per_class: int = PERFEDAVG_SAMPLES_PER_CLASS,
    seed: int = 0,
) -> list[Tensor]:
    """The heterogeneous split of the Per-FedAvg paper (Fallah, Mokhtari & Ozdaglar, NeurIPS 2020, §6).

    With ``a = samples_per_class`` and ``K = num_clients`` (the paper uses ``K = 50``):

    * clients ``0 .. K//2 - 1`` ("first half") each get ``a`` images of every class 0, 1, 2, 3, 4;
    * client ``i >= K//2``, with ``j = i - K//2``, gets ``a // 2`` images of class ``j mod 5`` and
      ``2a`` images of class ``5 + (j mod 5)``.

    The classes of the second half are assigned round-robin by client index (the paper says only
    "one of the first five" / "one of the other five"; round-robin in lock-step is also what the
    public reimplementation ``MNIST_MAML.make_data_index`` does), so the split is balanced and the
    class counts do not depend on the seed. ``seed`` only picks which images of each class are
    used (a random permutation per class, ``torch.Generator().manual_seed(seed)``). For odd ``a``,
    ``a/2`` is rounded down.

    Raises:
        ValueError: invalid arguments, labels without classes 0-9, or a class whose pool is smaller
            than the number of images the split needs (the message gives both numbers).
    """
    y = _as_labels(labels)
    _check_num_clients(num_clients, y.numel())
    if not isinstance(samples_per_class, int) or samples_per_class < 2:
        raise ValueError(
            f"samples_per_class must be an integer >= 2 (so a/2 >= 1), got {samples_per_class!r}"
        )
    a = samples_per_class
    counts = torch.bincount(y, minlength=10)
    if counts.numel() < 10:
        raise ValueError(f"perfedavg_paper needs labels 0-9, got labels up to {counts.numel() - 1}")
    half = num_clients // 2
    plan: list[list[tuple[int, int]]] = []  # per client: (class, count)
    for i in range(num_clients):
        if i < half:
            plan.append([(c, a) for c in range(5)])
        else:
            j = (i - half) % 5
            plan.append([(j, a // 2), (5 + j, 2 * a)])
    need = torch.zeros(counts.numel(), dtype=torch.long)
    for client in plan:
        for c, n in client:
            need[c] += n
    short = [c for c in range(10) if int(need[c]) > int(counts[c])]
    if short:
        detail = "; ".join(f"class {c} needs {int(need[c])} but has {int(counts[c])}" for c in short)
        raise ValueError(
            f"perfedavg_paper with num_clients={num_clients}, samples_per_class={a} cannot be satisfied: "
            f"{detail}. Lower samples_per_class or num_clients."
        )
    g = _generator(seed)
    pools = {}
    by_class = _indices_by_class(y, 10)
    for c in range(10):
        idx = by_class[c]
        pools[c] = idx[torch.randperm(idx.numel(), generator=g)]
    taken = dict.fromkeys(range(10), 0)
    parts = []
    for client in plan:
        chunks = []
        for c, n in client:
            chunks.append(pools[c][taken[c] : taken[c] + n])
            taken[c] += n
        parts.append(torch.cat(chunks))
    return _sorted_parts(parts)


def cap_client_sizes(parts: Sequence[Tensor], max_samples: int | None, seed: int = 0) -> list[Tensor]:
    """Keep at most ``max_samples`` indices per client, chosen uniformly at random with ``seed``.

    ``None`` returns the parts unchanged (as sorted tensors).
    """
    if max_samples is None:
        return _sorted_parts(parts)
    if not isinstance(max_samples, int) or max_samples <= 0:
        raise ValueError(f"max_samples must be a positive integer or None, got {max_samples!r}")
    g = _generator(seed)
    out = []
    for p in parts:
        if p.numel() > max_samples:
            p = p[torch.randperm(p.numel(), generator=g)[:max_samples]]
        out.append(p)
    return _sorted_parts(out)


def _largest_remainder(total: int, weights: np.ndarray) -> np.ndarray:
    """Integer apportionment of ``total`` proportional to ``weights`` (Hamilton's method).

    ``q_k = total * w_k / sum(w)``; each client gets ``floor(q_k)`` and the ``total - sum floor(q)``
    leftover units go to the largest fractional parts, ties to the lower client index.
    """
    quotas = total * weights / weights.sum()
    base = np.floor(quotas).astype(np.int64)
    left = int(total - base.sum())
    if left > 0:
        frac = np.where(weights > 0, quotas - base, -1.0)  # zero-weight clients never get a unit
        order = np.lexsort((np.arange(weights.size), -frac))
        base[order[:left]] += 1
    return base


def matching_test_split(
    train_labels_per_client: Sequence[Tensor | Sequence[int]],
    test_labels: Tensor | Sequence[int],
    seed: int = 0,
) -> list[Tensor]:
    """Per-client test sets from the dataset's test pool that follow each client's train labels.

    For class ``c`` let ``n_{k,c}`` be client ``k``'s number of class-``c`` training samples and
    ``T_c`` the pool's class-``c`` test indices. The whole of ``T_c`` (shuffled with ``seed``) is
    apportioned to the clients proportionally to ``n_{k,c} / sum_j n_{j,c}`` by the largest-remainder
    method, so

        |test_{k,c}| ~= |T_c| * n_{k,c} / sum_j n_{j,c}     (exact up to rounding, total = |T_c|).

    A client gets test samples only of classes it trains on, no test index goes to two clients,
    and test samples of classes no client trains on are left unused.

    Args:
        train_labels_per_client: the labels of each client's training samples.
        test_labels: labels of the test pool (indices returned refer to this tensor).
        seed: picks which test images of a class go to which client.
    """
    if len(train_labels_per_client) == 0:
        raise ValueError("matching_test_split needs at least one client")
    y_test = _as_labels(test_labels)
    train = [_as_labels(t) for t in train_labels_per_client]
    num_classes = max([int(y_test.max()) + 1 if y_test.numel() else 0]
                      + [int(t.max()) + 1 for t in train if t.numel()])
    counts = np.stack([torch.bincount(t, minlength=num_classes).numpy() for t in train])  # [K, C]
    g = _generator(seed)
    parts: list[list[Tensor]] = [[] for _ in train]
    by_class = _indices_by_class(y_test, num_classes)
    for c in range(num_classes):
        pool = by_class[c]
        pool = pool[torch.randperm(pool.numel(), generator=g)]
        weights = counts[:, c].astype(np.float64)
        if pool.numel() == 0 or weights.sum() == 0:
            continue
        sizes = _largest_remainder(int(pool.numel()), weights)
        start = 0
        for k, n in enumerate(sizes.tolist()):
            if n:
                parts[k].append(pool[start : start + n])
                start += n
    return _sorted_parts(
        [torch.cat(p) if p else torch.empty(0, dtype=torch.long) for p in parts]
    )
