"""The round engine: the federated round written once, Trainer-free (docs/design.md, "The round engine")."""

from lightning_fedmeta.loop.client_storage import RunningStatistics, StoreLocation
from lightning_fedmeta.loop.compile_policy import CompilePolicy
from lightning_fedmeta.loop.engine import RoundEngine
from lightning_fedmeta.loop.federation import Federation
from lightning_fedmeta.loop.gather import BatchGatherer
from lightning_fedmeta.loop.ranks import RankSplit
from lightning_fedmeta.loop.round import RoundReport, RoundResult
from lightning_fedmeta.loop.server import ServerPipeline, apply_server_step, skip_server_step

__all__ = [
    "BatchGatherer", "CompilePolicy", "Federation", "RankSplit", "RoundEngine", "RoundReport", "RoundResult",
    "RunningStatistics", "ServerPipeline", "StoreLocation", "apply_server_step", "skip_server_step",
]
