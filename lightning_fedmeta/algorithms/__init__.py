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
    from lightning_fedmeta.algorithms.apfl import APFL
    from lightning_fedmeta.algorithms.cfl import CFL
    from lightning_fedmeta.algorithms.ditto import Ditto
    from lightning_fedmeta.algorithms.fdlora import FDLoRA
    from lightning_fedmeta.algorithms.fedala import FedALA
    from lightning_fedmeta.algorithms.fedamp import FedAMP
    from lightning_fedmeta.algorithms.fedas import FedAS
    from lightning_fedmeta.algorithms.fedavg import FedAvg
    from lightning_fedmeta.algorithms.fedbabu import FedBABU
    from lightning_fedmeta.algorithms.fedbn import FedBN
    from lightning_fedmeta.algorithms.feddbe import FedDBE
    from lightning_fedmeta.algorithms.fedem import FedEM
    from lightning_fedmeta.algorithms.fedfomo import FedFomo
    from lightning_fedmeta.algorithms.fedmaml import FedMAML
    from lightning_fedmeta.algorithms.fedpac import FedPAC
    from lightning_fedmeta.algorithms.fedproto import FedProto
    from lightning_fedmeta.algorithms.fedprox import FedProx
    from lightning_fedmeta.algorithms.fedrod import FedRoD
    from lightning_fedmeta.algorithms.fedsa_lora import FedSALoRA
    from lightning_fedmeta.algorithms.hetlora import HetLoRA
    from lightning_fedmeta.algorithms.ifca import IFCA
    from lightning_fedmeta.algorithms.lg_fedavg import LGFedAvg
    from lightning_fedmeta.algorithms.mocha import Mocha
    from lightning_fedmeta.algorithms.mtl_graph import MTLGraph
    from lightning_fedmeta.algorithms.mtl_mean import MTLMean
    from lightning_fedmeta.algorithms.mtl_pairwise import MTLPairwise
    from lightning_fedmeta.algorithms.perfedavg import PerFedAvg
    from lightning_fedmeta.algorithms.perfedmaml import PerFedMAML
    from lightning_fedmeta.algorithms.pfedhn import PFedHN
    from lightning_fedmeta.algorithms.reptile import Reptile
    from lightning_fedmeta.algorithms.scaffold import Scaffold
    from lightning_fedmeta.algorithms.shared_representation import FedPer, FedRep

#: every built-in algorithm class (the entry points of pyproject.toml) -> its module
_MODULE_OF = {
    "APFL": "apfl", "CFL": "cfl", "Ditto": "ditto", "FDLoRA": "fdlora", "FedALA": "fedala", "FedAMP": "fedamp",
    "FedAS": "fedas", "FedAvg": "fedavg", "FedBABU": "fedbabu", "FedBN": "fedbn", "FedDBE": "feddbe",
    "FedEM": "fedem", "FedFomo": "fedfomo", "FedMAML": "fedmaml", "FedPAC": "fedpac",
    "FedPer": "shared_representation", "FedProto": "fedproto", "FedProx": "fedprox",
    "FedRep": "shared_representation", "FedRoD": "fedrod", "FedSALoRA": "fedsa_lora", "HetLoRA": "hetlora",
    "IFCA": "ifca", "LGFedAvg": "lg_fedavg", "MTLGraph": "mtl_graph", "MTLMean": "mtl_mean",
    "MTLPairwise": "mtl_pairwise", "Mocha": "mocha", "PFedHN": "pfedhn", "PerFedAvg": "perfedavg",
    "PerFedMAML": "perfedmaml", "Reptile": "reptile", "Scaffold": "scaffold",
}

__all__ = [
    "APFL", "Algorithm", "BatchPlan", "CFL", "ClientOutput", "ClientRecord", "Ditto", "FDLoRA", "FedALA", "FedAMP",
    "FedAS", "FedAvg", "FedBABU", "FedBN", "FedDBE", "FedEM", "FedFomo", "FedMAML", "FedPAC", "FedPer", "FedProto",
    "FedProx", "FedRep", "FedRoD", "FedSALoRA", "HetLoRA", "IFCA", "LGFedAvg", "MTLGraph", "MTLMean", "MTLPairwise",
    "Mocha", "PFedHN", "PerFedAvg", "PerFedMAML", "Reptile", "Scaffold",
]
assert __all__ == sorted(__all__)
assert set(__all__) == {"Algorithm", "BatchPlan", "ClientOutput", "ClientRecord", *_MODULE_OF}


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
