"""Precision and distribution belong to Lightning: bf16-mixed on CPU runs; DDP gives the 1-process model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.frontends.callbacks import HISTORY_FILE, read_history
from tests.distributed.ddp_worker import run_tiny
from tests.helpers import REPO, make_trainer, tiny_datamodule

WORKER = Path(__file__).resolve().parent / "ddp_worker.py"
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def _fit(precision: str) -> tuple[FederatedModule, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    module = FederatedModule(
        model=torch.nn.Linear(5, 3),
        algorithm={"name": "scaffold", "local_lr": 0.2, "local_steps": 2, "batch_size": 4, "finetune_steps": 1},
        clients_per_round=3,
    )
    trainer = make_trainer(4, precision=precision)
    trainer.fit(module, tiny_datamodule(eval_every=2))
    return module, dict(trainer.callback_metrics)


def test_bf16_mixed_precision_runs_on_cpu_with_finite_loss_and_logged_accuracy() -> None:
    module, logged = _fit("bf16-mixed")
    assert torch.isfinite(logged["train/loss"])
    assert 0.0 <= float(logged["val/acc_weighted"]) <= 1.0
    assert module.last_summary["clients"]["acc_weighted"] == pytest.approx(float(logged["val/acc_weighted"]))
    for p in module.model.parameters():  # master weights stay float32
        assert p.dtype == torch.float32 and torch.isfinite(p).all()
    reference, _ = _fit("32-true")
    # autocast really ran the client computation in bfloat16 (≈ 3 significant digits)
    assert not torch.allclose(module.model.weight, reference.model.weight, atol=1e-6, rtol=0)
    torch.testing.assert_close(module.model.weight, reference.model.weight, atol=0.05, rtol=0)


DDP_VARIANTS = ["plain", "unreliable", "private"]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """The three variants fitted by one 2-process DDP launch (one after the other, each with its own module and
    Trainer: the ranks' process start and imports are paid once, not three times). Read-only for the tests."""
    folder = tmp_path_factory.mktemp("ddp")
    out = folder / "ddp.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(out), "2", ",".join(DDP_VARIANTS)], capture_output=True, text=True,
        timeout=300, env=env, cwd=folder,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.mark.spawns
@pytest.mark.parametrize("variant", DDP_VARIANTS)
def test_ddp_on_two_cpu_processes_equals_the_single_process_run(
    ddp_runs: dict[str, dict[str, dict[str, torch.Tensor]]], variant: str
) -> None:
    """Also with dropouts, stragglers, Byzantine clients and a robust rule, and with DP (docs/reliability.md):
    every draw is pure in (seed, round, client), so the ranks agree on who answers and on the noise."""
    ddp = ddp_runs[variant]
    assert int(ddp["world_size"]["value"]) == 2
    single = run_tiny(devices=1, variant=variant)
    assert single is not None
    for group in ("params", "client_state", "server_state", "summary"):
        assert set(ddp[group]) == set(single[group]), group
        for k, v in single[group].items():
            torch.testing.assert_close(ddp[group][k], v, atol=1e-6, rtol=0, msg=f"{group}/{k}")


@pytest.mark.spawns
def test_ddp_fit_from_the_command_line_with_default_plots_writes_the_table_and_the_history(tmp_path: Path) -> None:
    """``fedmeta fit --config configs/quickstart.yaml --trainer.strategy ddp --trainer.devices 2
    --trainer.accelerator cpu`` with the CLI's defaults (plots on): the end-of-fit outputs are written
    by rank zero without a collective call that the other rank never joins."""
    script = Path(sys.executable).with_name("fedmeta")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "lightning_fedmeta.cli"]
    root = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MPLBACKEND": "Agg"}
    proc = subprocess.run(
        [*command, "fit", "--config", str(QUICKSTART), "--trainer.strategy", "ddp", "--trainer.devices", "2",
         "--trainer.accelerator", "cpu", "--trainer.max_steps", "5", "--data.eval_every", "2",
         "--trainer.default_root_dir", str(root)],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "Personalized evaluation after round 5" in output, output[-4000:]
    histories = list(root.rglob(HISTORY_FILE))
    assert len(histories) == 1, histories
    doc = read_history(histories[0])
    # both ranks end the last, shorter epoch at round 5 and evaluate the final model there
    assert [(h["round"], h["stage"]) for h in doc["history"]] == [(2, "val"), (4, "val"), (5, "val")]
    assert doc["per_client_round"] == 5
    assert len(doc["per_client_accuracy"]) == 30
    for name in ("accuracy_vs_round.png", "client_accuracy_hist.png"):
        assert (histories[0].parent / name).stat().st_size > 5000, name
