"""Grouping a round's clients by their number of local steps, so that batched clients pad few empty steps.

Under ``local_epochs`` client ``c`` takes ``s_c = E·⌈n_c/B⌉`` steps
(:func:`~lightning_fedmeta.client.sampling.epoch_steps`);
clients that run together in one ``vmap`` call share one step axis, as long as the longest of them, and the others
run empty (masked) steps to its end. On a Dirichlet(0.1) split the sizes differ by two orders of magnitude, so one
call for the whole round would compute mostly padding; :func:`step_groups` cuts the round into groups of similar
step counts, each run with its own step axis (benchmarks/results/epoch_grouping.md measures the waste).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["GROUP_RATIO", "padding_waste", "step_groups"]

#: a client joins the current group while ``s_c ≥ GROUP_RATIO · max_g`` (see :func:`step_groups` for the bound)
GROUP_RATIO = 0.91


def step_groups(steps: Tensor, ratio: float = GROUP_RATIO) -> list[Tensor]:
    """Positions (into ``steps``) of the groups the clients run in: sorted by ``s_c`` descending (ties by
    position), a new group starts when ``s_c < ratio · max_g``, ``max_g`` the first (largest) count of the current
    group. Clients with ``s_c = 0`` (``drop_last`` and fewer rows than a batch) form the last group, which the
    engine runs on one empty step (they leave the round as they came). Each group lists its positions in
    ascending order (one group is ``0, 1, …``: the round's order).

    Bound: every member of a group has ``s_c ≥ ratio · max_g``, so its padding is ``max_g − s_c ≤ (1 − ratio)·max_g
    ≤ (1 − ratio)/ratio · s_c``; summed over the group, ``Σ_g (max_g − s_c) ≤ (1 − ratio)/ratio · Σ_g s_c``. With
    ``ratio = 0.91`` that is ``0.09/0.91 < 9.9 %`` of the group's real steps, hence also under 10 % of its computed
    steps ``Σ_g max_g = Σ_g s_c + padding``. ``ratio = 0`` puts everyone in one group (no grouping).
    """
    order = torch.argsort(-steps, stable=True)
    groups: list[list[int]] = []
    top = 0
    for pos in order.tolist():
        s = int(steps[pos])
        if not groups or s < ratio * top:
            groups.append([])
            top = s
        groups[-1].append(pos)
    return [torch.tensor(sorted(g), dtype=torch.long) for g in groups]


def padding_waste(steps: Tensor, groups: list[Tensor]) -> tuple[int, int]:
    """``(padded, real)`` step counts of running ``groups``: ``Σ_g Σ_{c∈g} (max_g − s_c)`` and ``Σ_c s_c``."""
    padded = sum(int((steps[g].max() - steps[g]).sum()) for g in groups)
    return padded, int(steps.sum())
