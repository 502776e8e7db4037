"""``kill -9`` of a ``fedmeta fit`` mid-run, then ``fedmeta fit ... --ckpt_path last``: the finished run's final
parameters, optimizer state, client state and server state equal an uninterrupted run's, bit for bit
(docs/reliability.md, "Crashes and checkpoints").

Three ``fedmeta fit`` processes run SCAFFOLD (per-client control variates c_i, server control variate c) with a
momentum server optimizer on 6 synthetic clients: an uninterrupted reference, a run killed with SIGKILL while it
sleeps in round 4 (a callback of its configuration, after the checkpoint of round 3 is on disk), and its resumption
with ``--ckpt_path last`` in a new process, whose logger writes a new ``version_1`` folder (so ``last`` must be
found in ``version_0``, which Lightning alone would not do). Every process has a timeout; only the processes this
test started are killed, by their pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_fedmeta.frontends.checkpoint_layout import FLAT_KEYS

pytestmark = [pytest.mark.skipif(os.name == "nt", reason="SIGKILL is POSIX"), pytest.mark.spawns]

ROUNDS = 6
KILL_IN_ROUND = 4  # the process sleeps before round 4 (global_step 3: the checkpoint of round 3 is written)

SLEEPER = '''
import os, time
from lightning.pytorch.callbacks import Callback


class SleepBeforeRound(Callback):
    """Sleeps (to be killed) before round ``step + 1``, once: it leaves ``marker`` holding its pid."""

    def __init__(self, step: int, marker: str) -> None:
        self.step = step
        self.marker = marker

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and not os.path.exists(self.marker):
            with open(self.marker + ".tmp", "w") as fh:
                fh.write(str(os.getpid()))
            os.replace(self.marker + ".tmp", self.marker)
            time.sleep(120)
'''

CONFIG = """
seed_everything: 0
trainer:
  max_steps: {rounds}
  accelerator: cpu
  enable_progress_bar: false
  enable_model_summary: false
  log_every_n_steps: 1
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{every_n_train_steps: 1, save_last: true, save_top_k: 1}}
{extra_callbacks}
model:
  algorithm: {{name: scaffold, local_lr: 0.05, local_steps: 3, batch_size: 8}}
  clients_per_round: 3
  compile_clients: false
  server_optimizer:
    class_path: torch.optim.SGD
    init_args: {{lr: 1.0, momentum: 0.9}}
data:
  dataset: synthetic
  num_clients: 6
  eval_every: 2
plots: false
"""


def _fedmeta(args: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(cwd), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "lightning_fedmeta.cli", *args], cwd=cwd, env=env,
                                stdout=out, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    """Wait for a CLI run (a hang guard, not a speed limit: under `-n 2` on 2 cores a 3-round run can take minutes)."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"fedmeta did not finish in {timeout} s:\n{log.read_text()[-3000:]}")
    assert rc == 0, log.read_text()[-3000:]


def _tensors_equal(a: Any, b: Any, where: str) -> None:
    """Nested dicts/lists of tensors and plain values: equal, tensors bit for bit (dtype included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(torch.uint8) if a.dim() else a, b.view(torch.uint8) if b.dim() else b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for key in a:
            _tensors_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _tensors_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def test_kill_9_mid_run_then_ckpt_path_last_finishes_bit_identical(tmp_path: Path) -> None:
    (tmp_path / "crash_sleeper.py").write_text(SLEEPER)
    marker = tmp_path / "sleeping.pid"
    sleeper = (f"    - class_path: crash_sleeper.SleepBeforeRound\n"
               f"      init_args: {{step: {KILL_IN_ROUND - 1}, marker: {marker}}}")
    (tmp_path / "crash.yaml").write_text(CONFIG.format(rounds=ROUNDS, extra_callbacks=sleeper))
    (tmp_path / "straight.yaml").write_text(CONFIG.format(rounds=ROUNDS, extra_callbacks=""))

    straight = _fedmeta(["fit", "--config", "straight.yaml", "--trainer.default_root_dir", "straight"], tmp_path,
                        tmp_path / "straight.log")
    crashed = _fedmeta(["fit", "--config", "crash.yaml", "--trainer.default_root_dir", "run"], tmp_path,
                       tmp_path / "crashed.log")
    try:
        deadline = time.monotonic() + 240  # a hang guard, not a speed limit: 2 CLI runs start on a loaded machine
        while not marker.exists():
            assert crashed.poll() is None, "the run ended before it was killed:\n" + (
                tmp_path / "crashed.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never reached round 4"
            time.sleep(0.05)
        assert int(marker.read_text()) == crashed.pid
        os.kill(crashed.pid, signal.SIGKILL)  # the process this test started, by its pid
        assert crashed.wait(timeout=10) == -signal.SIGKILL
    finally:
        if crashed.poll() is None:
            crashed.kill()
            crashed.wait()
    checkpoints = tmp_path / "run" / "lightning_logs" / "version_0" / "checkpoints"
    left = torch.load(checkpoints / "last.ckpt", weights_only=True)
    assert left["global_step"] == KILL_IN_ROUND - 1  # the interruption really cut the run short
    assert not list(checkpoints.glob(".*.partial")), "a completed save leaves no temporary file"

    resumed = _fedmeta(["fit", "--config", "crash.yaml", "--trainer.default_root_dir", "run", "--ckpt_path", "last"],
                       tmp_path, tmp_path / "resumed.log")
    _finish(resumed, tmp_path / "resumed.log")
    _finish(straight, tmp_path / "straight.log")
    log = (tmp_path / "resumed.log").read_text()
    found = Path("run/lightning_logs/version_0/checkpoints/last.ckpt")
    assert f"--ckpt_path last: resuming from {found}" in log
    assert f"Restored all states from the checkpoint at {found}" in log  # rounds 4-6 only, not a rerun from 0

    final = torch.load(tmp_path / "run" / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt",
                       weights_only=True)
    reference = torch.load(tmp_path / "straight" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt",
                           weights_only=True)
    assert final["global_step"] == reference["global_step"] == ROUNDS
    _tensors_equal(reference["state_dict"], final["state_dict"], "state_dict")
    _tensors_equal(reference["optimizer_states"], final["optimizer_states"], "optimizer_states")
    for key in ("client_state", "server_state", "seen", "metric_state", "round", "compile_decision"):
        path = FLAT_KEYS[key]  # where the per-part layout keeps it
        ours, theirs = reference["fedmeta"], final["fedmeta"]
        for part in path:
            ours, theirs = ours[part], theirs[part]
        _tensors_equal(ours, theirs, "fedmeta/" + "/".join(path))
    # the state is not trivially equal: SCAFFOLD's control variates and the momentum buffer moved
    assert set(final["fedmeta"]["engine"]["client_state"]) == {"c_i/linear.weight", "c_i/linear.bias"}
    assert final["fedmeta"]["engine"]["server_state"]["c/linear.weight"].abs().sum() > 0
    assert final["optimizer_states"][0]["state"][0]["momentum_buffer"].abs().sum() > 0
    assert not torch.equal(left["state_dict"]["model.linear.weight"], final["state_dict"]["model.linear.weight"])
    # and the final checkpoints carry the same checksum of the federated state
    assert final["fedmeta_checksum"]["digests"]["fedmeta"] == reference["fedmeta_checksum"]["digests"]["fedmeta"]
