"""A tiny Ditto run with the disk-backed client state, launched as one process per "node" by ``torchrun``:

    torchrun --nnodes 2 --nproc_per_node 1 --node_rank N --master_addr 127.0.0.1 --master_port P \\
        tests/distributed/multinode_worker.py OUT_DIR

Lightning reads the torchrun environment (``TorchElasticEnvironment``) and runs ``num_nodes=2, devices=1,
strategy="ddp"`` on CPU (gloo). Every node keeps its client state in its own folder ``OUT_DIR/node<N>`` (nodes share
no files), saves a checkpoint at the end (rank 0 writes the file; every rank writes its segments), and rank 0 writes
``OUT_DIR/result.pt``. ``run`` with ``num_nodes=1`` is the single-process reference (imported by the test).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.helpers

from lightning_fedmeta import FederatedModule  # noqa: E402
from lightning_fedmeta.persistence.memory_store import flatten_state  # noqa: E402
from tests.helpers import make_trainer, tiny_datamodule  # noqa: E402

__all__ = ["ROUNDS", "run"]

ROUNDS = 3
DITTO = {"name": "ditto", "lam": 0.1, "local_steps": 2, "local_lr": 0.1, "batch_size": 4, "finetune_steps": 1}


def run(out: Path, num_nodes: int, rounds: int = ROUNDS, resume: Path | None = None,
        init_seed: int = 0) -> dict[str, dict[str, torch.Tensor]] | None:
    """Fit Ditto (5 of 10 clients per round: the ranks get 3 and 2) to ``rounds`` rounds with
    ``client_state="disk"`` (from the checkpoint ``resume`` when given), save ``out/run<rounds>.ckpt``; the final
    state on rank 0, ``None`` elsewhere."""
    torch.manual_seed(init_seed)
    node = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))
    module = FederatedModule(
        model=nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)), algorithm=DITTO, clients_per_round=5,
        seed=2, client_state="disk", client_state_dir=str(out / f"node{node}"),
    )
    extra = {"strategy": "ddp", "num_nodes": num_nodes, "devices": 1} if num_nodes > 1 else {}
    trainer = make_trainer(rounds, **extra)
    trainer.fit(module, tiny_datamodule(num_clients=10, eval_every=2), ckpt_path=None if resume is None else resume)
    trainer.save_checkpoint(out / f"run{rounds}.ckpt")
    if not trainer.is_global_zero:
        return None
    return {
        "params": {k: v.detach().cpu().clone() for k, v in module.model.state_dict().items()},
        "client_state": module.client_states.state_dict(),
        "server_state": {k: v.detach().cpu().clone() for k, v in flatten_state(module.server_state).items()},
        "summary": {k: v.detach().cpu().clone() for k, v in module.last_summary["clients"].items()},
        "world": {"size": torch.tensor(trainer.world_size), "nodes": torch.tensor(trainer.num_nodes)},
    }


def main(argv: list[str]) -> None:
    """Fit :data:`ROUNDS` rounds, then resume from that checkpoint in a new module (other initial weights) to
    ``ROUNDS + 2``, on the same processes; rank 0 saves both results."""
    out = Path(argv[1])
    nodes = int(os.environ.get("WORLD_SIZE", "1"))
    first = run(out, nodes)
    resumed = run(out, nodes, ROUNDS + 2, resume=out / f"run{ROUNDS}.ckpt", init_seed=7)
    if first is not None and resumed is not None:
        torch.save({"first": first, "resumed": resumed}, out / "result.pt")


if __name__ == "__main__":
    main(sys.argv)
