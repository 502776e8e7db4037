"""The deprecation aliases of moved modules (lightning_fedmeta/compat/aliases.py, CHANGELOG.md): an old path
imports the new module itself, with a DeprecationWarning naming the new path; new paths never warn."""

from __future__ import annotations

import importlib
import inspect
import pickle
import subprocess
import sys
import warnings

import pytest

import lightning_fedmeta
from lightning_fedmeta.compat.aliases import ALIASES


def _forget(monkeypatch: pytest.MonkeyPatch, old: str) -> None:
    """As if ``old`` had never been imported in this process (the warning comes once per process)."""
    parent, _, leaf = old.rpartition(".")
    if leaf in vars(sys.modules[parent]):  # not hasattr: the package's __getattr__ would import the old path
        monkeypatch.delattr(sys.modules[parent], leaf)
    monkeypatch.delitem(sys.modules, old, raising=False)


@pytest.mark.parametrize("old", sorted(ALIASES))
def test_an_old_path_imports_the_new_module_and_warns(monkeypatch: pytest.MonkeyPatch, old: str) -> None:
    new = importlib.import_module(ALIASES[old])
    _forget(monkeypatch, old)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {ALIASES[old]}"):
        module = importlib.import_module(old)
    assert module is new
    assert sys.modules[old] is new
    assert new.__name__ == ALIASES[old]  # the new module keeps its own name and spec
    assert new.__spec__.name == ALIASES[old]


def test_from_import_and_monkeypatch_through_an_old_path(monkeypatch: pytest.MonkeyPatch) -> None:
    old = "lightning_fedmeta.state"
    _forget(monkeypatch, old)
    with pytest.warns(DeprecationWarning):
        from lightning_fedmeta.state import ClientStateStore  # noqa: F401 (the old path on purpose)
    new = importlib.import_module(ALIASES[old])
    assert ClientStateStore is new.ClientStateStore
    sentinel = object()
    monkeypatch.setattr(f"{old}.ClientStateStore", sentinel)  # patching the old path patches the one module
    assert new.ClientStateStore is sentinel


def _a_class_of(module_name: str) -> type | None:
    module = importlib.import_module(module_name)
    for _name, obj in vars(module).items():
        if inspect.isclass(obj) and obj.__module__ == module_name and "<locals>" not in obj.__qualname__:
            return obj
    return None


@pytest.mark.parametrize("old", sorted(o for o in ALIASES if _a_class_of(ALIASES[o]) is not None))
def test_a_pickle_naming_an_old_path_loads(old: str) -> None:
    cls = _a_class_of(ALIASES[old])
    data = f"c{old}\n{cls.__qualname__}\n.".encode()  # protocol 0: a global by module and name
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert pickle.loads(data) is cls


def test_an_old_module_read_as_an_attribute_of_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    old = next(o for o in sorted(ALIASES) if o.count(".") == 1)
    _forget(monkeypatch, old)
    with pytest.warns(DeprecationWarning, match=ALIASES[old]):
        module = getattr(lightning_fedmeta, old.split(".")[1])
    assert module is importlib.import_module(ALIASES[old])
    with pytest.raises(AttributeError, match="no attribute 'no_such_module'"):
        lightning_fedmeta.no_such_module  # noqa: B018


def test_new_paths_do_not_warn() -> None:
    """Every module of the package imported by its new path in a fresh interpreter: no deprecation of ours."""
    code = (
        "import importlib, pkgutil, warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    import lightning_fedmeta\n"
        "    for info in pkgutil.walk_packages(lightning_fedmeta.__path__, 'lightning_fedmeta.'):\n"
        "        if '.compat.' not in info.name:\n"
        "            importlib.import_module(info.name)\n"
        "ours = [str(w.message) for w in caught if 'moved to' in str(w.message)]\n"
        "print(ours)\n"
        "assert not ours, ours\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_finder_answers_only_old_names() -> None:
    from lightning_fedmeta.compat.aliases import AliasFinder

    finder = AliasFinder()
    assert all(finder.find_spec(new) is None for new in ALIASES.values())
    assert all(finder.find_spec(old) is not None for old in ALIASES)
