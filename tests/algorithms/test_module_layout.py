"""Where things live: the low modules import nothing above them, and every built-in algorithm class is exported.

A module that imports one above it (``sampling`` importing ``algorithms.base``) or two modules that import each other
(``data.datasets`` and ``data.more_datasets``) make a cycle that a lazy import inside a function only hides; these
tests read the modules' imports from their source, so a cycle brought back fails here.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import lightning_fedmeta
import lightning_fedmeta.algorithms as algorithms
from lightning_fedmeta import list_algorithms
from lightning_fedmeta.registry import load_algorithm

PACKAGE = Path(lightning_fedmeta.__file__).parent


def _imported_modules(relative: str) -> set[str]:
    """Every ``lightning_fedmeta`` module the file imports, at its top or inside a function."""
    tree = ast.parse((PACKAGE / relative).read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m.startswith("lightning_fedmeta")}


def test_sampling_imports_nothing_from_the_algorithms() -> None:
    assert not {m for m in _imported_modules("client/sampling.py") if m.startswith("lightning_fedmeta.algorithms")}


def test_batch_plan_is_one_class_under_every_public_name() -> None:
    from lightning_fedmeta import BatchPlan as top
    from lightning_fedmeta.algorithms import BatchPlan as package
    from lightning_fedmeta.algorithms.base import BatchPlan as base
    from lightning_fedmeta.client.sampling import BatchPlan as low

    assert top is package is base is low
    assert low(steps=2) == base(steps=2, per_step=1, batch_size=32, epochs=None, drop_last=False)


@pytest.mark.parametrize(("module", "other"), [("datasets", "more_datasets"), ("more_datasets", "datasets")])
def test_the_dataset_loaders_do_not_import_each_other_both_ways(module: str, other: str) -> None:
    if f"lightning_fedmeta.data.{other}" in _imported_modules(f"data/{module}.py"):
        assert f"lightning_fedmeta.data.{module}" not in _imported_modules(f"data/{other}.py")


def test_the_cifar_reader_keeps_its_public_names() -> None:
    from lightning_fedmeta.data import read_cifar_batch as package
    from lightning_fedmeta.data.cifar import read_cifar_batch as low
    from lightning_fedmeta.data.datasets import read_cifar_batch as loaders

    assert package is low is loaders


BUILTINS = sorted(e.name for e in list_algorithms() if e.builtin)


@pytest.mark.parametrize("name", BUILTINS)
def test_every_builtin_algorithm_class_is_exported_by_the_algorithms_package(name: str) -> None:
    cls = load_algorithm(name)
    assert cls.__name__ in algorithms.__all__, f"{cls.__name__} ({name}) is not in lightning_fedmeta.algorithms"
    assert getattr(algorithms, cls.__name__) is cls
    assert cls.__name__ in dir(algorithms)


def test_the_algorithms_package_exports_are_sorted_and_import() -> None:
    assert algorithms.__all__ == sorted(algorithms.__all__)
    assert len(BUILTINS) == 33
    for name in algorithms.__all__:
        assert getattr(importlib.import_module("lightning_fedmeta.algorithms"), name) is not None
    with pytest.raises(AttributeError, match="has no attribute 'NotAnAlgorithm'"):
        algorithms.NotAnAlgorithm  # noqa: B018


def test_the_head_helpers_live_in_heads_and_keep_their_old_import_path() -> None:
    from lightning_fedmeta.algorithms import heads, shared_representation

    assert shared_representation.head_names is heads.head_names
    assert shared_representation.check_head_prefix is heads.check_head_prefix
    users = [p.name for p in (PACKAGE / "algorithms").glob("*.py")
             if "lightning_fedmeta.algorithms.shared_representation" in _imported_modules(f"algorithms/{p.name}")]
    assert users == ["__init__.py"], f"{users} import the head helpers from FedRep's module, not algorithms.heads"
