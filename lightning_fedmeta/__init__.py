"""lightning_fedmeta: personalized federated learning for PyTorch Lightning."""

from lightning_fedmeta.algorithms.base import Algorithm, BatchPlan, ClientOutput, ClientRecord, client_records
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, has_samples
from lightning_fedmeta.compat.aliases import install as _install_aliases
from lightning_fedmeta.compat.aliases import module_getattr as __getattr__  # noqa: F401 (old attribute paths)
from lightning_fedmeta.data.federated import FederatedData, FederatedDataset, from_client_tensors
from lightning_fedmeta.module import FederatedModule
from lightning_fedmeta.persistence.memory_store import ClientStateStore
from lightning_fedmeta.registry import create_algorithm, list_algorithms, load_algorithm

__version__ = "0.1.0"

__all__ = [
    "Algorithm",
    "Batch",
    "BatchPlan",
    "ClientContext",
    "ClientOutput",
    "ClientRecord",
    "ClientStateStore",
    "FederatedData",
    "FederatedDataset",
    "FederatedModule",
    "Params",
    "client_records",
    "create_algorithm",
    "from_client_tensors",
    "has_samples",
    "list_algorithms",
    "load_algorithm",
    "__version__",
]

_install_aliases()
