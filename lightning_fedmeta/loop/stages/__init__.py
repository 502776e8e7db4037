"""The server pipeline's stages, one per file (docs/design.md, "Adding a server stage")."""

from lightning_fedmeta.loop.stages.aggregate import AlgorithmAggregate
from lightning_fedmeta.loop.stages.base import (
    PrivacyReport,
    ServerContext,
    ServerStage,
    ServerUpdate,
    Uploads,
    unflatten_row_tree,
)
from lightning_fedmeta.loop.stages.dp_clip import ClipUploads
from lightning_fedmeta.loop.stages.dp_noise import AddDPNoise
from lightning_fedmeta.loop.stages.poison import PoisonUploads
from lightning_fedmeta.loop.stages.robust import RobustAggregate

__all__ = [
    "AddDPNoise", "AlgorithmAggregate", "ClipUploads", "PoisonUploads", "PrivacyReport", "RobustAggregate",
    "ServerContext", "ServerStage", "ServerUpdate", "Uploads", "unflatten_row_tree",
]
