"""Built-in algorithms (each registered as an entry point in ``pyproject.toml``).

The algorithm classes are imported lazily (PEP 562): ``from lightning_fedmeta.algorithms import
Ditto`` imports only ``ditto.py``, so importing the package, or listing the registry, does not
import every algorithm.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from lightning_fedmeta.algorithms.base import Algorithm, BatchPlan, ClientOutput, ClientRecord

if TYPE_CHECKING:
    from lightning_fedmeta.algorithms.cfl import CFL
    from lightning_fedmeta.algorithms.ditto import Ditto
    from lightning_fedmeta.algorithms.fedavg import FedAvg
    from lightning_fedmeta.algorithms.fedmaml import FedMAML
    from lightning_fedmeta.algorithms.fedprox import FedProx
    from lightning_fedmeta.algorithms.ifca import IFCA
    from lightning_fedmeta.algorithms.mocha import Mocha
    from lightning_fedmeta.algorithms.mtl_graph import MTLGraph
    from lightning_fedmeta.algorithms.mtl_mean import MTLMean
    from lightning_fedmeta.algorithms.mtl_pairwise import MTLPairwise
    from lightning_fedmeta.algorithms.perfedavg import PerFedAvg
    from lightning_fedmeta.algorithms.perfedmaml import PerFedMAML
    from lightning_fedmeta.algorithms.reptile import Reptile
    from lightning_fedmeta.algorithms.scaffold import Scaffold
    from lightning_fedmeta.algorithms.shared_representation import FedPer, FedRep

_MODULE_OF = {
    "CFL": "cfl", "Ditto": "ditto", "FedAvg": "fedavg", "FedMAML": "fedmaml", "FedProx": "fedprox",
    "IFCA": "ifca", "Mocha": "mocha", "MTLGraph": "mtl_graph", "MTLMean": "mtl_mean",
    "MTLPairwise": "mtl_pairwise", "PerFedAvg": "perfedavg", "PerFedMAML": "perfedmaml",
    "Reptile": "reptile", "Scaffold": "scaffold", "FedPer": "shared_representation",
    "FedRep": "shared_representation",
}

__all__ = [
    "Algorithm", "BatchPlan", "ClientOutput", "ClientRecord",
    "CFL", "Ditto", "FedAvg", "FedMAML", "FedPer", "FedProx", "FedRep", "IFCA", "MTLGraph", "MTLMean",
    "MTLPairwise", "Mocha", "PerFedAvg", "PerFedMAML", "Reptile", "Scaffold",
]
assert set(__all__) == {"Algorithm", "BatchPlan", "ClientOutput", "ClientRecord", *_MODULE_OF}


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
