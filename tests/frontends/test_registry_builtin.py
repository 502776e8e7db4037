"""The built-in algorithms are entry points of this distribution, listed without being imported."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lightning_fedmeta import create_algorithm, list_algorithms, load_algorithm
from lightning_fedmeta.algorithms import FedAvg, FedProx, Scaffold

BUILTINS = {"fedavg": FedAvg, "fedprox": FedProx, "scaffold": Scaffold}

_LIST_WITHOUT_IMPORT = """
import json, sys
from lightning_fedmeta.registry import list_algorithms
before = set(sys.modules)
entries = list_algorithms()
new = sorted(m for m in set(sys.modules) - before
             if m.startswith("lightning_fedmeta") or any(m == e.value.split(":")[0] for e in entries))
not_loaded = sorted(e.name for e in entries if e.value.split(":")[0] not in sys.modules)
rows = [[e.name, e.distribution, e.value] for e in entries]
print(json.dumps({"new": new, "rows": rows, "not_loaded": not_loaded}))
"""


@pytest.mark.spawns
def test_builtins_are_listed_with_their_distribution_without_importing_them() -> None:
    proc = subprocess.run([sys.executable, "-c", _LIST_WITHOUT_IMPORT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["new"] == [], f"list_algorithms imported {result['new']}"
    rows = {name: (dist, value) for name, dist, value in result["rows"]}
    for name, cls in BUILTINS.items():
        assert rows[name] == ("lightning-fedmeta", f"{cls.__module__}:{cls.__name__}")
    # algorithms whose module nobody imported yet are still listed (metadata only)
    builtin_not_loaded = [n for n in result["not_loaded"] if rows[n][0] == "lightning-fedmeta"]
    assert builtin_not_loaded, "expected some built-in algorithm module to stay unimported"


def test_list_algorithms_is_sorted_and_marks_builtins() -> None:
    entries = list_algorithms()
    names = [e.name for e in entries]
    assert names == sorted(names)
    by_name = {e.name: e for e in entries if e.builtin}
    for name in BUILTINS:
        assert by_name[name].distribution == "lightning-fedmeta"
        assert by_name[name].qualified_name == f"lightning-fedmeta:{name}"


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_loads_by_name_and_by_qualified_name(name: str) -> None:
    assert load_algorithm(name) is BUILTINS[name]
    assert load_algorithm(f"lightning-fedmeta:{name}") is BUILTINS[name]
    assert load_algorithm(f"lightning_fedmeta:{name}") is BUILTINS[name]  # normalised distribution name
    algo = create_algorithm(name, local_lr=0.05)
    assert isinstance(algo, BUILTINS[name]) and algo.name == name and algo.local_lr == 0.05


def test_unknown_hyper_parameter_lists_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"no hyper-parameter\(s\) 'lr'; accepted: .*local_lr") as info:
        create_algorithm("fedavg", lr=0.1)
    for accepted in ("local_steps", "local_lr", "batch_size", "finetune_steps"):
        assert accepted in str(info.value)
    with pytest.raises(ValueError, match=r"'mu'.*accepted: local_steps"):
        create_algorithm("scaffold", mu=0.1)


def test_unknown_name_with_a_distribution_prefix_lists_available() -> None:
    with pytest.raises(ValueError, match="unknown algorithm 'other-dist:fedavg'; available: .*fedavg"):
        load_algorithm("other-dist:fedavg")
