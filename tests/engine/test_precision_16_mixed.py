"""precision="16-mixed" (float16 autocast with a GradScaler): the federated server step has no loss to scale, so the
module drops the scaler and rounds run; before the fix Lightning's step failed ("Attempted unscale_ but _scale is
None", found by benchmarks/gpu.py on an H100). The CPU stands in for CUDA through Lightning's MixedPrecision plugin."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.frontends.precision import drop_loss_scaler


@pytest.mark.parametrize("algorithm", [{"name": "ditto", "lam": 0.1},
                                       {"name": "perfedavg", "variant": "hf", "alpha": 0.01, "beta": 0.01}],
                         ids=["ditto", "perfedavg-hf"])
def test_16_mixed_rounds_run_and_move_the_model(algorithm) -> None:
    torch.manual_seed(0)
    module = FederatedModule(model=nn.Sequential(nn.Linear(60, 16), nn.ReLU(), nn.Linear(16, 10)),
                             algorithm=algorithm, clients_per_round=3, seed=0, compile_clients=False)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    trainer = L.Trainer(max_steps=3, plugins=[plugin], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, FederatedDataModule(dataset="synthetic", num_clients=6, eval_every=100, data_seed=0))
    assert trainer.global_step == 3
    assert plugin.scaler is None
    assert all(bool(torch.isfinite(p).all()) for p in module.model.parameters())


def test_drop_loss_scaler_only_touches_a_scaler() -> None:
    class Plugin:
        scaler = None

    class Trainer:
        precision_plugin = Plugin()

    assert drop_loss_scaler(Trainer()) is False
    Trainer.precision_plugin.scaler = object()
    assert drop_loss_scaler(Trainer()) is True and Trainer.precision_plugin.scaler is None
