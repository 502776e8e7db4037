"""docs/reliability.md's table of which reliability options compose with which algorithm is the code's."""

from __future__ import annotations

import re

import pytest

from lightning_fedmeta.registry import create_algorithm, list_algorithms
from lightning_fedmeta.reliability.options import Reliability
from tests.helpers import REPO

DOC = REPO / "docs" / "reliability.md"
#: one option setting per column of the table, in its order
COLUMNS = [
    {"client_dropout": 0.2, "over_selection": 0.3},
    {"local_steps_dist": {"distribution": "uniform", "low": 1, "high": 1}},
    {"aggregator": "median"},
    {"byzantine": {"fraction": 0.2, "attack": "sign_flip"}},
    {"byzantine": {"fraction": 0.2, "attack": "label_flip"}},
    {"dp": {"clip": 1.0}},
]
EXTRA_ARGS = {"mtl_graph": {"knn": 2}}  # arguments an algorithm cannot be built without


def _documented() -> dict[str, list[bool]]:
    text = DOC.read_text()
    start = text.index("| algorithm |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        name = re.sub(r"\s*\(plugin\)", "", cells[0])
        rows[name] = [c == "yes" for c in cells[1:]]
    return rows


def _accepted(name: str) -> list[bool]:
    algorithm = create_algorithm(name, **EXTRA_ARGS.get(name, {}))
    result = []
    for options in COLUMNS:
        try:
            Reliability.from_options(**options).check(
                algorithm, num_clients=20, num_sampled=10, aggregation="uniform", task="classification"
            )
            result.append(True)
        except ValueError:
            result.append(False)
    return result


def test_every_registered_algorithm_has_a_row() -> None:
    assert {e.name for e in list_algorithms()} <= set(_documented())


@pytest.mark.parametrize("name", sorted({e.name for e in list_algorithms()}))
def test_documented_compatibility_matches_the_checks(name: str) -> None:
    assert _documented()[name] == _accepted(name), (name, _documented()[name], _accepted(name))
