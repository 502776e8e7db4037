"""Deprecation aliases of the modules moved when the package was grouped by concern (CHANGELOG.md, 0.2).

``import lightning_fedmeta.state`` (or ``from lightning_fedmeta.state import X``, or an old pickle naming
``lightning_fedmeta.state.X``) still works for one release: a :data:`sys.meta_path` finder maps each old dotted name
of :data:`ALIASES` to its new module, emits a :class:`DeprecationWarning` naming the new path, and puts the *same*
module object under the old name in ``sys.modules``, so ``old is new`` holds and a ``monkeypatch`` through either
name changes the one module. New paths never warn (the finder answers only the old names).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

#: old dotted module -> the module that replaces it
ALIASES: dict[str, str] = {
    "lightning_fedmeta.atomic_io": "lightning_fedmeta.persistence.atomic_io",
    "lightning_fedmeta.attacks": "lightning_fedmeta.reliability.attacks",
    "lightning_fedmeta.callbacks": "lightning_fedmeta.frontends.callbacks",
    "lightning_fedmeta.checkpoint_state": "lightning_fedmeta.frontends.checkpoint_state",
    "lightning_fedmeta.checkpointing": "lightning_fedmeta.compat.checkpointing",
    "lightning_fedmeta.compare": "lightning_fedmeta.frontends.compare",
    "lightning_fedmeta.compiled": "lightning_fedmeta.client.compiled",
    "lightning_fedmeta.compression": "lightning_fedmeta.communication.compressors",
    "lightning_fedmeta.disk_manifest": "lightning_fedmeta.persistence.disk_manifest",
    "lightning_fedmeta.disk_state": "lightning_fedmeta.persistence.disk_store",
    "lightning_fedmeta.dp_draws": "lightning_fedmeta.privacy.draws",
    "lightning_fedmeta.execution": "lightning_fedmeta.client.execution",
    "lightning_fedmeta.facade": "lightning_fedmeta.frontends.facade",
    "lightning_fedmeta.functional": "lightning_fedmeta.client.functional",
    "lightning_fedmeta.graphs": "lightning_fedmeta.client.graphs",
    "lightning_fedmeta.loop.client_state": "lightning_fedmeta.loop.client_storage",
    "lightning_fedmeta.loop.compress": "lightning_fedmeta.loop.compression_stage",
    "lightning_fedmeta.loop.statistics": "lightning_fedmeta.loop.published_statistics",
    "lightning_fedmeta.losses": "lightning_fedmeta.client.losses",
    "lightning_fedmeta.metrics": "lightning_fedmeta.evaluation.metrics",
    "lightning_fedmeta.options": "lightning_fedmeta.frontends.options",
    "lightning_fedmeta.participation": "lightning_fedmeta.reliability.participation",
    "lightning_fedmeta.personal_model": "lightning_fedmeta.frontends.personal_model",
    "lightning_fedmeta.plots": "lightning_fedmeta.frontends.plots",
    "lightning_fedmeta.precision": "lightning_fedmeta.frontends.precision",
    "lightning_fedmeta.privacy_budget": "lightning_fedmeta.privacy.budget",
    "lightning_fedmeta.private_fit": "lightning_fedmeta.frontends.private_fit",
    "lightning_fedmeta.robust": "lightning_fedmeta.reliability.robust",
    "lightning_fedmeta.round_logging": "lightning_fedmeta.frontends.round_logging",
    "lightning_fedmeta.running_stats": "lightning_fedmeta.client.batchnorm_stats",
    "lightning_fedmeta.sampling": "lightning_fedmeta.client.sampling",
    "lightning_fedmeta.state": "lightning_fedmeta.persistence.memory_store",
    "lightning_fedmeta.validation": "lightning_fedmeta.loop.validation",
    "lightning_fedmeta.vision_models": "lightning_fedmeta.models.vision",
}

_PACKAGE = __name__.rsplit(".", 2)[0]


def deprecation_message(old: str) -> str:
    return (f"{old} moved to {ALIASES[old]}; the old path is deprecated and will be removed in the next release "
            f"(CHANGELOG.md): import {ALIASES[old]} instead")


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the new module: ``exec_module`` replaces the placeholder in ``sys.modules``, which the
    import system then returns (it reads ``sys.modules`` back after ``exec_module``)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__
        warnings.warn(deprecation_message(old), DeprecationWarning, stacklevel=2)
        sys.modules[old] = importlib.import_module(ALIASES[old])


class AliasFinder(importlib.abc.MetaPathFinder):
    """Answers the old dotted names of :data:`ALIASES`, nothing else."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in ALIASES:
            return None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader())


def install() -> None:
    """Put one :class:`AliasFinder` first in :data:`sys.meta_path` (idempotent): before the path finder, and before an
    editable install's finder, which would otherwise find a stale old file of another checkout."""
    if not any(isinstance(f, AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, AliasFinder())


def module_getattr(name: str) -> ModuleType:
    """``lightning_fedmeta.<old module>`` read as an attribute (without importing it first): the new module, with
    the same warning. The package's ``__getattr__``."""
    old = f"{_PACKAGE}.{name}"
    if old in ALIASES:
        return importlib.import_module(old)
    raise AttributeError(f"module {_PACKAGE!r} has no attribute {name!r}")
