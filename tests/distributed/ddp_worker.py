"""Train a tiny SCAFFOLD run and save the final global model, client and server state.

    python tests/distributed/ddp_worker.py OUT.pt [DEVICES] [VARIANT[,VARIANT...]]

``OUT.pt`` holds ``{variant: result}``. Several comma-separated variants are fitted one after the other by the same
ranks (one launch: the process start and the imports, most of a tiny run's cost, are paid once; each fit reseeds
and builds its own module and Trainer, and Lightning reuses the initialised process group). ``VARIANT``
``unreliable`` adds dropouts, over-selection, stragglers' budgets, Byzantine clients (ALIE) and a
trimmed-mean aggregator to the run (docs/reliability.md); ``private`` adds DP-FedAvg with adaptive clipping.

With ``DEVICES > 1`` the run uses ``strategy="ddp"`` on CPU (gloo). Lightning's DDP launcher
re-executes this script once per extra process, so it must stay a script (never run DDP inside
the pytest process). Rank 0 writes ``OUT.pt``. ``run_tiny`` is also imported by the test for the
single-process reference, so both sides build exactly the same run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.helpers

from lightning_fedmeta import FederatedModule  # noqa: E402
from lightning_fedmeta.persistence.memory_store import flatten_state
from tests.helpers import make_trainer, tiny_datamodule  # noqa: E402

__all__ = ["ROUNDS", "run_tiny"]

ROUNDS = 3


VARIANTS: dict[str, dict] = {
    "plain": {},
    "unreliable": {
        "client_dropout": 0.2, "over_selection": 0.5,
        "local_steps_dist": {"distribution": "uniform", "low": 1, "high": 2},
        "byzantine": {"fraction": 0.34, "attack": "alie"}, "aggregator": {"name": "trimmed_mean", "beta": 0.2},
    },
    "private": {
        "aggregation": "uniform",
        "dp": {"clip": 0.5, "noise_multiplier": 0.7, "adaptive_clip": {"count_noise_multiplier": 1.0}},
    },
}


def run_tiny(devices: int, variant: str = "plain") -> dict[str, dict[str, torch.Tensor]] | None:
    """Fit SCAFFOLD (5 of 6 clients per round, so ranks get unequal shares) for ``ROUNDS`` rounds; the
    ``unreliable`` and ``private`` variants run FedAvg with the reliability options of :data:`VARIANTS`.

    Returns the final state on rank 0 and ``None`` on the other ranks.
    """
    torch.manual_seed(0)
    algorithm = {"name": "scaffold" if variant == "plain" else "fedavg", "local_lr": 0.2, "local_steps": 2,
                 "batch_size": 4, "finetune_steps": 1}
    module = FederatedModule(
        model=nn.Linear(5, 3),
        algorithm=algorithm,
        clients_per_round=5 if variant != "unreliable" else 4,
        seed=2,
        **VARIANTS[variant],
    )
    extra = {"strategy": "ddp", "devices": devices} if devices > 1 else {}
    trainer = make_trainer(ROUNDS, **extra)
    trainer.fit(module, tiny_datamodule(eval_every=2))
    if not trainer.is_global_zero:
        return None
    return {
        "params": {k: v.detach().cpu().clone() for k, v in module.model.state_dict().items()},
        "client_state": module.client_states.state_dict(),
        "server_state": {k: v.detach().cpu().clone() for k, v in flatten_state(module.server_state).items()},
        "summary": {k: v.detach().cpu().clone() for k, v in module.last_summary["clients"].items()},
        "world_size": {"value": torch.tensor(trainer.world_size)},
    }


def main(argv: list[str]) -> None:
    out = Path(argv[1])
    devices = int(argv[2]) if len(argv) > 2 else 2
    variants = (argv[3] if len(argv) > 3 else "plain").split(",")
    results = {variant: run_tiny(devices, variant) for variant in variants}
    if all(result is not None for result in results.values()):
        torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv)
