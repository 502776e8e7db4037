"""The robust-rule, dataset and partitioner entry-point groups, with real (tiny) installed distributions.

Each fake plugin is a ``<name>.dist-info`` folder (``METADATA`` + ``entry_points.txt``) and its module, written into
``tmp_path`` and put on ``sys.path``: ``importlib.metadata`` finds it exactly as it finds a pip-installed package
(as tests/frontends/test_registry_plugins.py does for algorithms). Module names carry a per-test suffix.
"""

from __future__ import annotations

import itertools
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_fedmeta.data import DATASET_NAMES, PARTITION_NAMES, FederatedDataModule
from lightning_fedmeta.data.plugins import LabeledPool
from lightning_fedmeta.frontends.resume_settings import canonical_settings
from lightning_fedmeta.registry import AGGREGATORS, DATASETS, DISABLE_PLUGINS_ENV, PARTITIONERS
from lightning_fedmeta.reliability.robust import AGGREGATORS as BUILTIN_RULES
from lightning_fedmeta.reliability.robust import aggregate_rows, parse_aggregator
from lightning_fedmeta.testing import check_aggregator, check_dataset, check_partitioner

_counter = itertools.count()

RULE = '''
import torch
from lightning_fedmeta.reliability.robust import RobustRule


class Shrunk(RobustRule):
    """The coordinate-wise median times a factor."""

    def __init__(self, factor: float = 1.0) -> None:
        if not 0 < factor <= 1:
            raise ValueError(f"factor must be in (0, 1], got {factor!r}")
        self.factor = factor

    def __call__(self, rows, weights, *, f=0, steps=None):
        return rows.median(dim=0).values * self.factor if rows.shape[0] % 2 else (
            torch.sort(rows, dim=0).values[rows.shape[0] // 2 - 1: rows.shape[0] // 2 + 1].mean(0) * self.factor)
'''

DATASET = '''
import torch
from lightning_fedmeta.data import from_client_tensors


def blobs(num_clients, seed, size=12):
    g = torch.Generator().manual_seed(seed)
    clients = []
    for _ in range(num_clients):
        y = torch.arange(size) % 3
        x = y[:, None].float() + torch.randn(size, 4, generator=g)
        clients.append((x[3:], y[3:], x[:3], y[:3]))
    return from_client_tensors(clients, 3)
'''

PARTITIONER = '''
import torch


def halves(labels, num_clients, seed, shift=0):
    order = torch.randperm(labels.shape[0], generator=torch.Generator().manual_seed(seed + shift))
    return list(torch.tensor_split(order, num_clients))
'''


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv(DISABLE_PLUGINS_ENV, raising=False)
    return tmp_path


def install_fake(site: Path, dist: str, group: str, entries: dict[str, str], modules: dict[str, str]) -> None:
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entries.items())
    (info / "entry_points.txt").write_text(f"[{group}]\n{lines}")
    for mod, source in modules.items():
        (site / f"{mod}.py").write_text(textwrap.dedent(source))


def unique(prefix: str) -> str:
    return f"{prefix}_{next(_counter)}_{id(object())}"


# ----------------------------------------------------------------------------------------------
# the built-ins are entry points, as a plugin's are
# ----------------------------------------------------------------------------------------------
def test_builtins_are_registered_through_the_packages_own_entry_points() -> None:
    for registry, names in ((AGGREGATORS, BUILTIN_RULES), (DATASETS, DATASET_NAMES), (PARTITIONERS, PARTITION_NAMES)):
        builtin = {e.name for e in registry.list() if e.builtin}
        assert set(names) <= builtin, (registry.group, set(names) - builtin)


@pytest.mark.parametrize("name", ["mean", "median", "trimmed_mean", "krum", "multi_krum", "geometric_median",
                                  "fednova", "bulyan"])
def test_every_builtin_rule_keeps_the_contract(name: str) -> None:
    check_aggregator(name, fit=name == "median")


@pytest.mark.parametrize("name", ["iid", "dirichlet", "shards", "pathological", "dirichlet_min_size"])
def test_every_builtin_partitioner_keeps_the_contract(name: str) -> None:
    check_partitioner(name, n=2000, balance=name == "pathological", fit=name == "iid")


@pytest.mark.parametrize("name", ["synthetic", "synthetic_regression", "synthetic_multilabel"])
def test_builtin_synthetic_datasets_keep_the_contract(name: str) -> None:
    check_dataset(name, fit=name == "synthetic")


# ----------------------------------------------------------------------------------------------
# a third-party rule, dataset and partitioner, used by name
# ----------------------------------------------------------------------------------------------
def test_a_plugin_rule_is_used_by_name_with_its_options_checked(site: Path) -> None:
    mod = unique("rule_plugin")
    install_fake(site, "fake-rule", "lightning_fedmeta.aggregators", {"shrunk": f"{mod}:Shrunk"}, {mod: RULE})
    spec = parse_aggregator({"name": "shrunk", "factor": 0.5, "clip": 10.0})
    assert spec.factor == 0.5 and spec.given() == {"name": "shrunk", "clip": 10.0, "factor": 0.5}
    rows = torch.tensor([[1.0, 2.0], [3.0, 4.0], [100.0, -50.0]])
    assert aggregate_rows(spec, rows, torch.full((3,), 1 / 3)).tolist() == [1.5, 1.0]
    check_aggregator({"name": "shrunk", "factor": 1.0})
    with pytest.raises(AssertionError, match=r"aggregator 'shrunk' failed consensus: every client sent the same row"):
        check_aggregator({"name": "shrunk", "factor": 0.5}, fit=False)
    with pytest.raises(ValueError, match=r"^model\.aggregator\.factor must be in \(0, 1\], got 2"):
        parse_aggregator({"name": "shrunk", "factor": 2})
    with pytest.raises(ValueError, match=r"model\.aggregator\.scale: unknown key; shrunk accepts name, clip, factor"):
        parse_aggregator({"name": "shrunk", "scale": 2})
    with pytest.raises(ValueError, match=r"model\.aggregator\.f does not apply to the shrunk rule"):
        parse_aggregator({"name": "shrunk", "f": 1})
    with pytest.raises(ValueError, match=r"unknown aggregator 'shrnk'; choose one of mean, .*, fednova, .*shrunk"):
        parse_aggregator("shrnk")


def test_a_plugin_that_fails_to_import_is_named(site: Path) -> None:
    mod = unique("broken_rule")
    install_fake(site, "fake-broken-rule", "lightning_fedmeta.aggregators", {"broken": f"{mod}:Rule"},
                 {mod: "raise RuntimeError('boom')\n"})
    with pytest.raises(ImportError, match=r"aggregator 'broken' from distribution 'fake-broken-rule' failed to load "
                                          r".*RuntimeError: boom"):
        parse_aggregator("broken")
    mod = unique("broken_data")
    install_fake(site, "fake-broken-data", "lightning_fedmeta.datasets", {"broken_data": f"{mod}:make"},
                 {mod: "raise RuntimeError('no numpy')\n"})
    with pytest.raises(ImportError, match=r"dataset 'broken_data' from distribution 'fake-broken-data' failed"):
        FederatedDataModule(dataset="broken_data")


def test_a_plugin_dataset_and_partitioner_are_used_by_name(site: Path) -> None:
    data_mod, part_mod = unique("data_plugin"), unique("part_plugin")
    install_fake(site, "fake-data", "lightning_fedmeta.datasets", {"blobs": f"{data_mod}:blobs"}, {data_mod: DATASET})
    install_fake(site, "fake-part", "lightning_fedmeta.partitioners", {"halves": f"{part_mod}:halves"},
                 {part_mod: PARTITIONER})
    dm = FederatedDataModule(dataset="blobs", num_clients=3, dataset_options={"size": 20})
    assert dm.num_classes == 3 and dm.federated_data is not None  # no declared num_classes: built to know
    assert dm.federated_data.train_counts.tolist() == [17, 17, 17]
    check_dataset("blobs", {"size": 15}, fit=False)
    check_partitioner("halves", {"shift": 1}, fit=False)
    with pytest.raises(ValueError, match=r"dataset 'blobs' has no option\(s\) 'sise' \(data\.dataset_options\); "
                                         r"accepted: size"):
        FederatedDataModule(dataset="blobs", dataset_options={"sise": 3})
    with pytest.raises(ValueError, match=r"unknown partition 'halfs'; choose one of \['iid', .*'halves'.*\]"):
        FederatedDataModule(partition="halfs")
    with pytest.raises(ValueError, match=r"'num_clients' are set by data\.\* settings"):
        FederatedDataModule(partition="halves", partition_options={"num_clients": 3})


def test_a_labeled_pool_is_split_by_the_partition_named() -> None:
    g = torch.Generator().manual_seed(0)
    y, test_y = torch.arange(60) % 4, torch.arange(20) % 4
    pool = LabeledPool(torch.randn(60, 3, generator=g), y, torch.randn(20, 3, generator=g), test_y, 4)
    dm = FederatedDataModule(dataset=pool, partition="shards", classes_per_client=2, num_clients=4)
    dm.setup("fit")
    assert dm.num_classes == 4 and dm.federated_data is not None
    assert int(dm.federated_data.train_counts.sum()) == 60


def test_checkers_say_what_broke(site: Path) -> None:
    mod = unique("bad_rule")
    install_fake(site, "fake-bad-rule", "lightning_fedmeta.aggregators", {"first_row": f"{mod}:First"}, {mod: '''
        class First:
            def __call__(self, rows, weights, *, f=0, steps=None):
                return rows[0]
    '''})
    with pytest.raises(AssertionError, match=r"aggregator 'first_row' failed permutation: permuting the clients "):
        check_aggregator("first_row", fit=False)
    mod = unique("bad_part")
    install_fake(site, "fake-bad-part", "lightning_fedmeta.partitioners", {"overlap": f"{mod}:overlap"}, {mod: '''
        import torch
        def overlap(labels, num_clients):
            return [torch.arange(labels.shape[0])] * num_clients
    '''})
    with pytest.raises(AssertionError, match=r"partitioner 'overlap' failed parts: ValueError: partitioner 'overlap' "
                                             r"gives some rows to more than one client"):
        check_partitioner("overlap", fit=False)


# ----------------------------------------------------------------------------------------------
# the resume check compares the option mappings generically
# ----------------------------------------------------------------------------------------------
def test_resume_settings_compare_plugin_options_with_their_defaults_filled() -> None:
    defaults = {"aggregator": None}
    same = [canonical_settings("model", {"aggregator": a}, defaults)["aggregator"]
            for a in ("trimmed_mean", {"name": "trimmed_mean"}, {"name": "trimmed_mean", "beta": 0.1})]
    assert same[0] == same[1] == same[2] == {"name": "trimmed_mean", "f": None, "clip": None, "beta": 0.1}
    assert canonical_settings("model", {}, defaults)["aggregator"] == {"name": "mean", "f": None, "clip": None}
    other = canonical_settings("model", {"aggregator": {"name": "trimmed_mean", "beta": 0.2}}, defaults)
    assert other["aggregator"] != same[0]
    data_defaults = {"partition": "iid", "partition_options": None, "dataset": "synthetic", "dataset_options": None}
    a = canonical_settings("data", {"partition": "dirichlet"}, data_defaults)
    b = canonical_settings("data", {"partition": "dirichlet", "partition_options": {}}, data_defaults)
    assert a["partition_options"] == b["partition_options"] == {}


def test_flower_config_takes_a_plugin_rules_options_as_written(site: Path, tmp_path: Path) -> None:
    """The deployment config carries model.aggregator as one mapping, checked by the rule's constructor."""
    pytest.importorskip("flwr")
    from lightning_fedmeta.flower.config import load_config

    mod = unique("flower_rule")
    install_fake(site, "fake-flower-rule", "lightning_fedmeta.aggregators", {"shrunk": f"{mod}:Shrunk"}, {mod: RULE})

    def config(factor: float) -> Path:
        path = tmp_path / f"fedmeta_{factor}.yaml"
        path.write_text("trainer: {max_steps: 2}\nmodel:\n  algorithm: fedavg\n  clients_per_round: 2\n"
                        f"  aggregator: {{name: shrunk, factor: {factor}}}\n"
                        "data: {dataset: synthetic, num_clients: 4, dataset_options: {}}\n")
        return path

    cfg = load_config(config(0.5))
    assert cfg.module_options["aggregator"] == {"name": "shrunk", "factor": 0.5}
    with pytest.raises(ValueError, match=r"model\.aggregator\.factor must be in \(0, 1\], got 2"):
        load_config(config(2.0))


def test_compare_settings_reads_plugin_option_mappings_in_canonical_form() -> None:
    """What the CLI's and the module's resume checks call: equal meanings pass, a changed option is reported as
    written."""
    from lightning_fedmeta.frontends.resume_settings import compare_settings

    saved = {"aggregator": {"name": "trimmed_mean", "beta": 0.1}}
    assert compare_settings("model", saved, {"aggregator": "trimmed_mean"}, {}) == []
    (diff,) = compare_settings("model", saved, {"aggregator": {"name": "trimmed_mean", "beta": 0.2}}, {})
    assert (diff.name, diff.saved, diff.given, diff.changeable) == (
        "model.aggregator", {"name": "trimmed_mean", "beta": 0.1}, {"name": "trimmed_mean", "beta": 0.2}, False)
    data_saved = {"dataset": "synthetic", "dataset_options": None}
    assert compare_settings("data", data_saved, {"dataset_options": {}}, {}) == []
