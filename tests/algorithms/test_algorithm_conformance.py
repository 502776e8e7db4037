"""Every registered algorithm (built-ins and installed plugins alike) passes the plugin author's kit.

``lightning_fedmeta.testing.check_algorithm`` runs each one on tiny clients of unequal sizes (2 of 8
held out, 3 sampled per round): real rounds with every output checked, loop == vmap, the logged
evaluation == ``personalize(i)``, never-trained clients ignoring their initial state, a bit-exact
resume from a mid-run checkpoint, and a bf16-mixed round (docs/testing.md).
"""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from lightning_fedmeta.registry import list_algorithms
from lightning_fedmeta.testing import check_algorithm

#: extra hyper-parameters some algorithms need on this tiny problem
OVERRIDES: dict[str, dict[str, Any]] = {
    "mtl_graph": {"knn": 2},
    "mocha": {"local_iters": 20, "omega_every": 2},
    "fedmaml": {"alpha": 0.1},
    "cfl": {"warmup_rounds": 0, "eps1": 10.0, "eps2": 0.0},  # clusters split within the check's few rounds
}
#: algorithms defined for a linear model only
LINEAR_ONLY = {"mocha"}


def _names() -> list[str]:
    return sorted({entry.name for entry in list_algorithms()})


def _kwargs(name: str) -> dict[str, Any]:
    return {"model": nn.Linear(5, 3) if name in LINEAR_ONLY else None}


@pytest.mark.parametrize("name", _names())
def test_every_registered_algorithm_passes_check_algorithm(name: str) -> None:
    check_algorithm({"name": name, **OVERRIDES.get(name, {})}, **_kwargs(name))
