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

from lightning_fedmeta.registry import create_algorithm, list_algorithms
from lightning_fedmeta.testing import check_algorithm

#: extra hyper-parameters some algorithms need on this tiny problem
OVERRIDES: dict[str, dict[str, Any]] = {
    "mtl_graph": {"knn": 2},
    "mocha": {"local_iters": 20, "omega_every": 2},
    "fedmaml": {"alpha": 0.1},
    "cfl": {"warmup_rounds": 0, "eps1": 10.0, "eps2": 0.0},  # clusters split within the check's few rounds
}


def _names() -> list[str]:
    return sorted({entry.name for entry in list_algorithms()})


@pytest.mark.parametrize("name", _names())
def test_every_registered_algorithm_passes_check_algorithm(name: str) -> None:
    """No model is passed: an algorithm that needs a particular one (MOCHA: linear) declares example_model."""
    check_algorithm({"name": name, **OVERRIDES.get(name, {})})


def test_check_algorithm_by_name_alone_uses_the_declared_examples() -> None:
    """``check_algorithm("mocha")`` with no other argument: its example model is the linear model it needs, and
    an MLP (the kit's default for other algorithms) is what it refuses."""
    model = create_algorithm("mocha").example_model((5,), 3)
    assert model is not None and [p.dim() for p in model.parameters()] == [2, 1]
    assert create_algorithm("fedavg").example_model((5,), 3) is None
    check_algorithm("mocha")
    check_algorithm("mtl_graph")  # its defaults name no graph: it declares example_arguments (knn=2)
    with pytest.raises(AssertionError, match="linear model"):
        check_algorithm("mocha", model=nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3)))
