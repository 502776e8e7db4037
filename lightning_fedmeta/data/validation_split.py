"""A validation split carved out of every client's training data, for tuning without the test set.

With ``fraction = f`` client i's ``n_i`` training samples are permuted by a generator seeded from
``(seed, "validation", i)`` (:func:`lightning_fedmeta.client.sampling.generator_for`), and

    v_i = min(n_i − 1, max(1, round(f · n_i)))      (round half to even, as torch.round)

of them become the client's evaluation set; the other ``n_i − v_i`` stay its training set (in their
original order). The returned :class:`FederatedData` has these validation rows in place of the
test rows, so a run evaluates (``validate`` and ``test``) on data held out of its own training set
and never reads the test set. Hyper-parameters chosen on it are then used for a run on the full
training data, evaluated on the test set: the usual protocol of tuning on validation data, never
on test data.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_fedmeta.client.sampling import generator_for
from lightning_fedmeta.data.federated import FederatedData

__all__ = ["validation_sizes", "validation_split"]


def validation_sizes(train_counts: Tensor, fraction: float) -> Tensor:
    """``[K]`` validation samples per client: ``min(n_i − 1, max(1, round(fraction · n_i)))``.

    Raises ``ValueError`` when ``fraction`` is outside ``(0, 1)`` or a client has fewer than two
    training samples (it could not keep one for training and give one to validation).
    """
    if isinstance(fraction, bool) or not 0.0 < float(fraction) < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1) (or 0 for no validation split), got {fraction!r}")
    small = (train_counts < 2).nonzero().flatten().tolist()
    if small:
        raise ValueError(
            f"validation_fraction needs at least 2 training samples per client; client(s) {small[:5]} have "
            f"{[int(train_counts[i]) for i in small[:5]]}"
        )
    n = train_counts.to(torch.float64)
    v = torch.round(float(fraction) * n).clamp(min=1).to(torch.long)
    return torch.minimum(v, train_counts - 1)


def validation_split(data: FederatedData, fraction: float, seed: int) -> FederatedData:
    """``data`` with each client's test set replaced by ``validation_sizes`` of its training samples.

    The chosen rows are removed from the client's training set; the test set of ``data`` is dropped.
    The split is a pure function of ``(seed, client index, n_i, fraction)``.
    """
    counts = data.train_counts.cpu()
    sizes = validation_sizes(counts, fraction)
    offsets = data.train_offsets.cpu()
    keep: list[Tensor] = []
    held: list[Tensor] = []
    for i in range(data.num_clients):
        start, n = int(offsets[i]), int(counts[i])
        perm = torch.randperm(n, generator=generator_for(seed, "validation", i))
        v = int(sizes[i])
        held.append(start + perm[:v].sort().values)
        keep.append(start + perm[v:].sort().values)
    device = data.train_x.device
    keep_idx, held_idx = torch.cat(keep).to(device), torch.cat(held).to(device)

    def offsets_of(lengths: Tensor) -> Tensor:
        return torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).to(data.train_offsets.device)

    return FederatedData(
        train_x=data.train_x[keep_idx], train_y=data.train_y[keep_idx], train_offsets=offsets_of(counts - sizes),
        test_x=data.train_x[held_idx], test_y=data.train_y[held_idx], test_offsets=offsets_of(sizes),
        num_classes=data.num_classes, client_names=list(data.client_names), task=data.task,
    )
