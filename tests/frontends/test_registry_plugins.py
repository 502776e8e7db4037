"""Plugin behaviour of the algorithm registry, with real (tiny) installed distributions.

Each fake plugin is a ``<name>.dist-info`` folder (``METADATA`` + ``entry_points.txt``) and its
module, written into ``tmp_path`` and put on ``sys.path``: ``importlib.metadata`` finds it exactly
as it finds a pip-installed package. Module names carry a per-test suffix so ``sys.modules``
never hands one test another test's plugin.

Also checks that the example plugin in ``plugins/fedmeta-pfedme`` imports nothing but the
standard library, torch, lightning and names in ``lightning_fedmeta.__all__``.
"""

from __future__ import annotations

import ast
import itertools
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import lightning_fedmeta
from lightning_fedmeta import Algorithm
from lightning_fedmeta.registry import (
    DISABLE_PLUGINS_ENV,
    PluginLoadWarning,
    create_algorithm,
    describe_algorithms,
    list_algorithms,
    load_algorithm,
)
from tests.helpers import REPO

PLUGIN_SRC = REPO / "plugins" / "fedmeta-pfedme" / "src"

_counter = itertools.count()

GOOD_PLUGIN = '''
from lightning_fedmeta import Algorithm, ClientOutput


class {cls}(Algorithm):
    """{doc}"""

    marker = "{marker}"

    def client_update(self, ctx, params, batches, state, server_state, client):
        return ClientOutput({{k: v * 0 for k, v in params.items()}}, state, {{}}, {{}})
'''


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh folder on ``sys.path`` to install fake distributions into; plugins enabled."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(DISABLE_PLUGINS_ENV, raising=False)
    return tmp_path


def install_fake(site: Path, dist: str, entries: dict[str, str], modules: dict[str, str]) -> None:
    """Write distribution ``dist`` (entry points ``name = module:attr``) and its modules into ``site``."""
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entries.items())
    (info / "entry_points.txt").write_text(f"[lightning_fedmeta.algorithms]\n{lines}")
    for mod, source in modules.items():
        (site / f"{mod}.py").write_text(textwrap.dedent(source))


def unique(prefix: str) -> str:
    return f"{prefix}_{next(_counter)}_{id(object())}"


def good_module(cls: str = "Fake", doc: str = "A fake algorithm.", marker: str = "") -> str:
    return GOOD_PLUGIN.format(cls=cls, doc=doc, marker=marker)


def messages(caught: list[warnings.WarningMessage], needle: str) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, PluginLoadWarning) and needle in str(w.message)]


# ----------------------------------------------------------------------------------------------
# listing
# ----------------------------------------------------------------------------------------------
def test_listing_reads_metadata_without_importing_plugins(site: Path) -> None:
    mod = unique("lazy_plugin")
    install_fake(site, "fake-lazy", {"lazy_alg": f"{mod}:Fake"}, {mod: "raise RuntimeError('imported!')\n"})
    entries = {e.name: e for e in list_algorithms()}
    assert entries["lazy_alg"].distribution == "fake-lazy"
    assert entries["lazy_alg"].qualified_name == "fake-lazy:lazy_alg"
    assert not entries["lazy_alg"].builtin and entries["fedavg"].builtin
    assert mod not in sys.modules


def test_builtins_are_registered_through_the_packages_own_entry_points() -> None:
    builtins = {e.name for e in list_algorithms() if e.builtin}
    assert {"fedavg", "fedprox", "scaffold"} <= builtins
    assert all(e.distribution == "lightning-fedmeta" for e in list_algorithms() if e.builtin)


# ----------------------------------------------------------------------------------------------
# a broken plugin
# ----------------------------------------------------------------------------------------------
def test_broken_plugin_gives_one_warning_naming_distribution_and_exception_when_described(site: Path) -> None:
    broken, good = unique("broken_plugin"), unique("good_plugin")
    install_fake(site, "fake-broken", {"broken_alg": f"{broken}:Fake"}, {broken: "raise RuntimeError('boom')\n"})
    install_fake(site, "fake-good", {"good_alg": f"{good}:Fake"}, {good: good_module(doc="Good fake.")})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = {r["name"]: r for r in describe_algorithms()}
    about_broken = messages(caught, "fake-broken")
    assert len(about_broken) == 1, about_broken
    assert "broken_alg" in about_broken[0] and "RuntimeError: boom" in about_broken[0]
    assert rows["broken_alg"]["status"] == "failed" and rows["broken_alg"]["distribution"] == "fake-broken"
    assert rows["good_alg"]["status"] == "ok" and rows["good_alg"]["summary"] == "Good fake."
    assert rows["fedavg"]["status"] == "ok"


def test_broken_plugin_by_name_raises_import_error_naming_distribution_and_others_still_load(site: Path) -> None:
    broken, good = unique("broken_plugin"), unique("good_plugin")
    install_fake(site, "fake-broken", {"broken_alg": f"{broken}:Fake"}, {broken: "raise RuntimeError('boom')\n"})
    install_fake(site, "fake-good", {"good_alg": f"{good}:Fake"}, {good: good_module()})
    with pytest.raises(ImportError, match=r"'broken_alg' from distribution 'fake-broken'.*RuntimeError: boom"):
        load_algorithm("broken_alg")
    assert isinstance(create_algorithm("good_alg", local_steps=2), Algorithm)
    assert create_algorithm("fedavg").local_steps >= 1


def test_entry_point_that_is_not_an_algorithm_is_a_type_error_naming_distribution(site: Path) -> None:
    mod = unique("notalg_plugin")
    install_fake(site, "fake-notalg", {"notalg": f"{mod}:thing"}, {mod: "thing = 42\n"})
    with pytest.raises(TypeError, match=r"'notalg' of 'fake-notalg'.*not an lightning_fedmeta.Algorithm"):
        load_algorithm("notalg")


def test_plugin_without_summary_or_docstring_is_described_with_an_empty_summary(site: Path) -> None:
    mod = unique("nodoc_plugin")
    source = good_module().replace('"""A fake algorithm."""', "")
    install_fake(site, "fake-nodoc", {"nodoc_alg": f"{mod}:Fake"}, {mod: source})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = {r["name"]: r for r in describe_algorithms()}
    assert rows["nodoc_alg"] == {"name": "nodoc_alg", "distribution": "fake-nodoc", "status": "ok", "summary": ""}


# ----------------------------------------------------------------------------------------------
# two distributions, one name
# ----------------------------------------------------------------------------------------------
def test_two_distributions_claiming_one_name_warn_and_distribution_prefix_picks_each(site: Path) -> None:
    alpha, beta = unique("alpha_plugin"), unique("beta_plugin")
    install_fake(site, "fake-alpha", {"twin": f"{alpha}:Fake"}, {alpha: good_module(marker="alpha")})
    install_fake(site, "fake-beta", {"twin": f"{beta}:Fake"}, {beta: good_module(marker="beta")})

    with pytest.warns(PluginLoadWarning, match=r"'twin' is registered by several distributions") as record:
        chosen = load_algorithm("twin")
    text = " ".join(str(w.message) for w in record if issubclass(w.category, PluginLoadWarning))
    assert "fake-alpha:twin" in text and "fake-beta:twin" in text
    assert chosen.marker == "alpha"  # ties go to the first distribution by name, deterministically

    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginLoadWarning)  # a qualified name is unambiguous: no warning
        assert load_algorithm("fake-alpha:twin").marker == "alpha"
        assert load_algorithm("fake-beta:twin").marker == "beta"
        assert load_algorithm("fake_beta:twin").marker == "beta"  # distribution names are normalised
        assert create_algorithm("fake-beta:twin", local_lr=0.3).local_lr == 0.3


def test_describing_a_contested_name_warns_once_naming_both_distributions(site: Path) -> None:
    alpha, beta = unique("alpha_plugin"), unique("beta_plugin")
    install_fake(site, "fake-alpha", {"twin": f"{alpha}:Fake"}, {alpha: good_module(marker="alpha")})
    install_fake(site, "fake-beta", {"twin": f"{beta}:Fake"}, {beta: good_module(marker="beta")})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = [r for r in describe_algorithms() if r["name"] == "twin"]
    about_twin = messages(caught, "'twin'")
    assert len(about_twin) == 1, about_twin
    assert "fake-alpha:twin" in about_twin[0] and "fake-beta:twin" in about_twin[0]
    assert sorted(r["distribution"] for r in rows) == ["fake-alpha", "fake-beta"]


# ----------------------------------------------------------------------------------------------
# disabling plugins, unknown names
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["1", "true", "YES"])
def test_disable_env_var_hides_third_party_algorithms(site: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    good = unique("good_plugin")
    install_fake(site, "fake-good", {"good_alg": f"{good}:Fake"}, {good: good_module()})
    assert "good_alg" in {e.name for e in list_algorithms()}
    monkeypatch.setenv(DISABLE_PLUGINS_ENV, value)
    entries = list_algorithms()
    assert entries and all(e.builtin for e in entries)
    assert "pfedme" not in {e.name for e in entries}
    with pytest.raises(ValueError, match=rf"unknown algorithm 'good_alg'.*{DISABLE_PLUGINS_ENV}"):
        load_algorithm("good_alg")
    assert create_algorithm("fedavg") is not None


def test_unknown_name_raises_value_error_listing_available_names(site: Path) -> None:
    good = unique("good_plugin")
    install_fake(site, "fake-good", {"good_alg": f"{good}:Fake"}, {good: good_module()})
    with pytest.raises(ValueError, match=r"unknown algorithm 'fedavgg'; available: .*fedavg.*good_alg.*scaffold"):
        load_algorithm("fedavgg")
    with pytest.raises(ValueError, match=r"unknown algorithm 'fake-nowhere:good_alg'; available: "):
        load_algorithm("fake-nowhere:good_alg")


def test_unknown_hyperparameter_names_the_accepted_ones() -> None:
    with pytest.raises(ValueError, match=r"'fedavg' has no hyper-parameter\(s\) 'mu'; accepted: local_steps"):
        create_algorithm("fedavg", mu=0.1)


# ----------------------------------------------------------------------------------------------
# the example plugin uses the public API only
# ----------------------------------------------------------------------------------------------
ALLOWED_TOP_LEVEL = set(sys.stdlib_module_names) | {"torch", "lightning", "fedmeta_pfedme"}


def import_violations(source: str, filename: str = "<plugin>") -> list[str]:
    """Imports that reach past ``lightning_fedmeta``'s public API (or into unexpected packages)."""
    public = set(lightning_fedmeta.__all__)
    tree = ast.parse(source, filename)
    bad: list[str] = []
    module_aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "lightning_fedmeta":
                    module_aliases.add(alias.asname or alias.name)
                elif alias.name.split(".")[0] not in ALLOWED_TOP_LEVEL:
                    bad.append(f"{filename}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            top = (node.module or "").split(".")[0]
            if top == "lightning_fedmeta":
                if node.module != "lightning_fedmeta":
                    bad.append(f"{filename}:{node.lineno}: from {node.module} import ... (not the top-level package)")
                bad += [
                    f"{filename}:{node.lineno}: {a.name} is not in lightning_fedmeta.__all__"
                    for a in node.names
                    if a.name not in public
                ]
            elif top not in ALLOWED_TOP_LEVEL:
                bad.append(f"{filename}:{node.lineno}: from {node.module} import ...")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in module_aliases:
            if node.attr not in public:
                bad.append(f"{filename}:{node.lineno}: lightning_fedmeta.{node.attr} is not in __all__")
    return bad


def test_import_checker_flags_private_paths_and_names() -> None:
    source = (
        "from lightning_fedmeta.client.functional import tree_sub\n"
        "from lightning_fedmeta import Algorithm, weighted_mean_metrics\n"
        "import lightning_fedmeta as lf\nlf.registry\nlf.Batch\n"
        "import numpy\n"
    )
    bad = import_violations(source)
    assert len(bad) == 5, bad
    assert import_violations("import os\nimport torch.nn\nfrom lightning_fedmeta import Algorithm, Params\n") == []


def test_pfedme_plugin_imports_only_the_public_api() -> None:
    files = sorted(PLUGIN_SRC.rglob("*.py"))
    assert files, f"no plugin sources under {PLUGIN_SRC}"
    bad = [v for f in files for v in import_violations(f.read_text(), str(f.relative_to(REPO)))]
    assert bad == []
