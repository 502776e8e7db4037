"""Fixtures shared by every test folder. The plain helpers they use live in ``tests/helpers.py``;
``run_plain_rounds`` (rounds without a Trainer) is here: ``from tests.conftest import run_plain_rounds``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import lightning as L
import pytest
import torch
from torch import Tensor

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.data import FederatedData
from tests.helpers import make_trainer, tiny_data

__all__ = ["SPAWNS_TIMEOUT_S", "run_plain_rounds"]

#: pytest-timeout's limit for a test marked ``spawns`` that sets none of its own (every other test: ``timeout`` in
#: pyproject.toml, 300 s). Longer than the timeouts of the processes such a test waits for (up to 240 s), so a stuck
#: process is reported by the test's own message first.
SPAWNS_TIMEOUT_S = 600


def _start_rank(item: pytest.Item) -> int:
    """0 for the Flower loopback test (minutes), 1 for a ``spawns`` test, 2 for any other."""
    return 0 if item.get_closest_marker("flower_loopback") else 1 if item.get_closest_marker("spawns") else 2


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    """Whether the test uses a fixture built once per module or class (a DDP launch, a trained checkpoint)."""
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(d.scope in ("module", "class") for defs in info.name2fixturedefs.values()
                                    for d in defs)


def schedule_for_workers(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the tests for ``-n 2 --dist loadgroup`` (the README's test command), which hands tests to the two
    workers in this order: the Flower loopback test first (minutes), then every ``spawns`` test, then the rest,
    each group in collection order (a stable sort). A file whose tests share a module- or class-scoped fixture is
    one ``xdist_group``, so that fixture is built once, on one worker. Without pytest-xdist only the order changes."""
    items.sort(key=_start_rank)
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order and group the tests for two workers (:func:`schedule_for_workers`) and give every ``spawns`` test
    without a ``timeout`` marker of its own the limit :data:`SPAWNS_TIMEOUT_S`."""
    schedule_for_workers(config, items)
    if not config.pluginmanager.hasplugin("timeout"):  # pytest-timeout not installed: no limits at all
        return
    for item in items:
        if item.get_closest_marker("spawns") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SPAWNS_TIMEOUT_S))


def run_plain_rounds(module: FederatedModule, rounds: int, first: int = 0) -> list[Tensor]:
    """Rounds ``first .. first + rounds − 1`` through the round engine without a Trainer, with the server
    optimizer ``SGD(lr=1)`` (w ← w + Δ). Returns each round's clients."""
    optimizer = torch.optim.SGD(module.model.parameters(), lr=1.0)
    return [module.engine.run_round(r, optimizer).clients for r in range(first, first + rounds)]


@pytest.fixture
def trainer_factory() -> Callable[..., L.Trainer]:
    return make_trainer


@pytest.fixture
def tiny() -> FederatedData:
    return tiny_data()


@pytest.fixture(autouse=True)
def _lightning_log_levels() -> Iterator[None]:
    """Put Lightning's logger levels back after every test. A test that quiets them (test_fingerprint sets
    ``lightning.pytorch`` to WARNING) must not hide Lightning's INFO messages (``rank_zero_info``) from a later
    test's ``caplog``: test_participation's empty-round message was lost that way whenever it ran after it."""
    loggers = [logging.getLogger(name) for name in ("lightning", "lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    yield
    for lg, level in zip(loggers, levels, strict=True):
        lg.setLevel(level)
