"""How ``ditto_bn_topk_flat.ckpt`` was made: a checkpoint in the flat ``checkpoint["fedmeta"]`` layout of every
release up to 0.3 (main c58bb23, 2026-11-29), kept so that the per-part layout's key migration stays tested on a file
that code really wrote. Run from the repository root with that release installed:
``python tests/checkpoints/data/make_flat_layout_checkpoint.py``. Do not regenerate it with newer code."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_fedmeta import FederatedModule
from tests.helpers import NUM_CLASSES, NUM_FEATURES, make_trainer, tiny_datamodule

HERE = Path(__file__).parent
ALGORITHM = {"name": "ditto", "local_lr": 0.2, "local_steps": 2, "batch_size": 4}
COMPRESSION = {"upload": "topk", "fraction": 0.5}


def bn_model() -> nn.Module:
    """``torch.manual_seed(0)``, then ``Linear → BatchNorm1d → Tanh → Linear`` (per-client BN statistics)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(NUM_FEATURES, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, NUM_CLASSES))


def module() -> FederatedModule:
    return FederatedModule(model=bn_model(), algorithm=ALGORITHM, clients_per_round=3, seed=4,
                           compression=COMPRESSION, server_lr=0.8)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = ModelCheckpoint(dirpath=tmp, every_n_train_steps=4, save_top_k=-1, save_last=True)
        make_trainer(4, enable_checkpointing=True, callbacks=[ckpt]).fit(module(), tiny_datamodule(eval_every=2))
        data = torch.load(Path(tmp) / "last.ckpt", weights_only=True)
    torch.save(data, HERE / "ditto_bn_topk_flat.ckpt")
    print(sorted(data["fedmeta"]))
