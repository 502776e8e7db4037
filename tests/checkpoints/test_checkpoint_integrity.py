"""Damaged checkpoints are detected, and checkpoint writes are atomic (docs/reliability.md, "Crashes and
checkpoints"; lightning_fedmeta/persistence/checksums.py, lightning_fedmeta/persistence/checkpoint_files.py,
lightning_fedmeta/persistence/safe_loading.py and lightning_fedmeta/frontends/resume_settings.py)."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback
from torch import nn

import lightning_fedmeta.persistence.checkpoint_files as checkpoint_files
import lightning_fedmeta.persistence.checksums as checksums
from lightning_fedmeta import FederatedModule
from lightning_fedmeta.cli import FedMetaConfigError, run
from lightning_fedmeta.persistence.checkpoint_files import AtomicCheckpointIO, atomic_save
from lightning_fedmeta.persistence.checksums import (
    CHECKSUM_KEY,
    CheckpointDamagedError,
    CheckpointWithoutChecksumWarning,
    checkpoint_digests,
    seal_checkpoint,
    verify_checkpoint,
)
from tests.helpers import REPO, make_trainer, momentum_module, tiny_datamodule

QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
SCAFFOLD = {"name": "scaffold", "local_lr": 0.2, "local_steps": 2, "batch_size": 4}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, FederatedModule]:
    """A SCAFFOLD checkpoint after 2 rounds, and the module that wrote it."""
    path = tmp_path_factory.mktemp("integrity") / "good.ckpt"
    module = momentum_module(SCAFFOLD)
    trainer = make_trainer(2)
    trainer.fit(module, tiny_datamodule())
    trainer.save_checkpoint(path)
    return path, module


# ----------------------------------------------------------------------------------------------
# the checksum
# ----------------------------------------------------------------------------------------------
def _tok(tag: bytes, text: str) -> bytes:
    data = text.encode()
    return tag + len(data).to_bytes(8, "little") + data


def test_digest_is_the_documented_walk() -> None:
    """SHA-256 over type-tagged, length-prefixed tokens, dict keys sorted, a tensor as its header and the
    SHA-256 of its bytes (one chunk here)."""
    t = torch.tensor([1.5, -2.0])
    expected = hashlib.sha256(
        _tok(b"D", "2") + _tok(b"S", "a") + _tok(b"I", "3") + _tok(b"S", "b")
        + _tok(b"T", "torch.float32|(2,)|torch.strided|False")
        + b"R" + (1).to_bytes(8, "little") + hashlib.sha256(t.numpy().tobytes()).digest()
    ).hexdigest()
    assert checkpoint_digests({"k": {"b": t, "a": 3}}) == {"k": expected}
    assert checkpoint_digests({"k": {"a": 3, "b": t}}) == {"k": expected}  # insertion order does not count


@pytest.mark.parametrize(
    "a, b",
    [
        (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0000002])),  # one mantissa bit
        (torch.tensor([1.0]), torch.tensor([1.0]).view(torch.int32)),  # same bytes, other dtype
        (torch.arange(6).reshape(2, 3), torch.arange(6).reshape(3, 2)),  # same bytes, other shape
        (1, 1.0), (1, True), (1, "1"), ([1, 2], (1, 2)), (None, "None"), (0.1, 0.1 + 2**-56),
        ({"a": 1}, {"a": 1, "b": None}), ({"a": 1}, {"b": 1}),
    ],
    ids=["bit", "dtype", "shape", "int-float", "int-bool", "int-str", "list-tuple", "none-str", "float",
         "extra-key", "renamed-key"],
)
def test_digest_tells_apart_values_that_differ(a: Any, b: Any) -> None:
    assert checkpoint_digests({"k": a}) != checkpoint_digests({"k": b})


def test_large_tensors_hash_in_chunks_the_same_with_or_without_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    big = torch.arange(3 * 2**20, dtype=torch.float64)  # 24 MiB: 3 chunks of 8 MiB
    threaded = checkpoint_digests({"k": big})
    monkeypatch.setattr(checksums, "_PARALLEL_BYTES", 2**62)
    assert checkpoint_digests({"k": big}) == threaded
    monkeypatch.setattr(checksums, "_PARALLEL_BYTES", 1)
    assert checkpoint_digests({"k": big}) == threaded
    changed = big.clone()
    changed[2 * 2**20 + 5] += 1  # in the third chunk
    assert checkpoint_digests({"k": changed}) != threaded


class _Counter(Callback):
    def __init__(self) -> None:
        self.saves = 0

    def state_dict(self) -> dict[str, Any]:
        return {"saves": self.saves}

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.saves += 1


def test_the_checksum_is_written_last_and_covers_every_entry() -> None:
    """``on_save_checkpoint`` runs last in Lightning's ``dump_checkpoint``: the sealed dict is what is saved, and
    every entry but the version string is covered (callbacks' states included)."""
    module = momentum_module(SCAFFOLD)
    trainer = make_trainer(2, callbacks=[_Counter()])
    trainer.fit(module, tiny_datamodule())
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(False)
    covered = set(checkpoint[CHECKSUM_KEY]["digests"])
    assert covered == set(checkpoint) - {CHECKSUM_KEY, "pytorch-lightning_version"}
    assert {"state_dict", "optimizer_states", "lr_schedulers", "global_step", "loops", "callbacks", "fedmeta",
            "hyper_parameters", "datamodule_hyper_parameters"} <= covered
    assert verify_checkpoint(checkpoint) is True
    checkpoint["global_step"] += 1
    with pytest.raises(CheckpointDamagedError, match=r"differ from the checksum written with it, in global_step"):
        verify_checkpoint(checkpoint)


# ----------------------------------------------------------------------------------------------
# damaged files: one message, every way of loading
# ----------------------------------------------------------------------------------------------
def _damage(good: Path, how: str, out: Path) -> Path:
    data = bytearray(good.read_bytes())
    if how == "flipped":  # 200 bytes of SCAFFOLD's stored control variates c_i
        c_i = torch.load(good, weights_only=True)["fedmeta"]["engine"]["client_state"]["c_i/weight"]
        raw = c_i.contiguous().numpy().tobytes()
        with zipfile.ZipFile(good) as archive:
            records = [i for i in archive.infolist() if archive.read(i.filename) == raw]
        assert len(records) == 1 and len(raw) >= 200
        header = records[0].header_offset
        start = header + 30 + int.from_bytes(data[header + 26:header + 28], "little") + int.from_bytes(
            data[header + 28:header + 30], "little")
        assert data[start:start + len(raw)] == raw
        data[start:start + 200] = bytes(b ^ 0xA5 for b in data[start:start + 200])
    elif how == "truncated":
        data = data[: len(data) // 2]
    else:
        data = bytearray(torch.randint(0, 256, (len(data),), generator=torch.Generator().manual_seed(1),
                                       dtype=torch.uint8).numpy().tobytes())
    out.write_bytes(bytes(data))
    return out


DAMAGE = ["flipped", "truncated", "random"]
DAMAGED = r"checkpoint \S*{name} is damaged \(.*\); it cannot be used"


def test_without_the_checksum_a_flipped_file_loads_silently(saved: tuple[Path, FederatedModule],
                                                            tmp_path: Path) -> None:
    """What the checksum is for: torch.load reads the flipped file without complaint, with other c_i."""
    good, _ = saved
    bad = _damage(good, "flipped", tmp_path / "flipped.ckpt")
    loaded = torch.load(bad, weights_only=True)["fedmeta"]["engine"]["client_state"]["c_i/weight"]
    original = torch.load(good, weights_only=True)["fedmeta"]["engine"]["client_state"]["c_i/weight"]
    assert not torch.equal(loaded, original)
    assert (loaded != original).sum() == 50  # 200 bytes: 50 float32 values
    with pytest.raises(CheckpointDamagedError, match=r"in fedmeta\)"):
        verify_checkpoint(torch.load(bad, weights_only=True), bad)


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("entry", ["fit", "validate", "load_from_checkpoint"])
def test_a_damaged_checkpoint_is_named_by_every_python_entry_point(
    saved: tuple[Path, FederatedModule], tmp_path: Path, how: str, entry: str
) -> None:
    bad = _damage(saved[0], how, tmp_path / f"{how}.ckpt")
    with pytest.raises(CheckpointDamagedError, match=DAMAGED.format(name=f"{how}.ckpt")) as info:
        if entry == "fit":
            make_trainer(4).fit(momentum_module(SCAFFOLD), tiny_datamodule(), ckpt_path=str(bad))
        elif entry == "validate":
            make_trainer(4).validate(momentum_module(SCAFFOLD), tiny_datamodule(), ckpt_path=str(bad), verbose=False)
        else:
            FederatedModule.load_from_checkpoint(bad, model=nn.Linear(5, 3))
    assert "weights_only" not in str(info.value)  # never the unsafe advice torch gives for a damaged file
    assert info.value.__cause__ is None


@pytest.mark.parametrize("how", DAMAGE)
@pytest.mark.parametrize("subcommand", ["fit", "validate", "test"])
def test_a_damaged_checkpoint_is_named_by_the_cli(
    saved: tuple[Path, FederatedModule], tmp_path: Path, how: str, subcommand: str
) -> None:
    bad = _damage(saved[0], how, tmp_path / f"{how}.ckpt")
    with pytest.raises(FedMetaConfigError, match=DAMAGED.format(name=f"{how}.ckpt")):
        run([subcommand, "--config", QUICKSTART, "--ckpt_path", str(bad), "--trainer.default_root_dir",
             str(tmp_path), "--plots", "false"])


def test_the_console_script_prints_the_message_alone(saved: tuple[Path, FederatedModule], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_fedmeta.cli import main

    bad = _damage(saved[0], "truncated", tmp_path / "cut.ckpt")
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", QUICKSTART, "--ckpt_path", str(bad), "--trainer.default_root_dir", str(tmp_path)])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fedmeta: error: checkpoint {bad} is damaged (not a complete checkpoint archive")
    assert "Traceback" not in err


def test_a_checkpoint_without_checksum_loads_with_a_warning(saved: tuple[Path, FederatedModule],
                                                           tmp_path: Path) -> None:
    good, module = saved
    old = torch.load(good, weights_only=True)
    del old[CHECKSUM_KEY]
    path = tmp_path / "old.ckpt"
    torch.save(old, path)
    with pytest.warns(CheckpointWithoutChecksumWarning, match=r"old.ckpt has no checksum"):
        loaded = FederatedModule.load_from_checkpoint(path, model=nn.Linear(5, 3))
    for k, v in module.client_states.state_dict().items():
        assert torch.equal(loaded.client_states.state_dict()[k], v), k
    with pytest.warns(CheckpointWithoutChecksumWarning):
        trainer = make_trainer(3)
        trainer.fit(momentum_module(SCAFFOLD), tiny_datamodule(), ckpt_path=str(path))
    assert trainer.global_step == 3


def test_an_edited_checkpoint_loads_once_sealed_again(saved: tuple[Path, FederatedModule], tmp_path: Path) -> None:
    checkpoint = torch.load(saved[0], weights_only=True)
    checkpoint["fedmeta"]["engine"]["client_state"]["c_i/weight"] = torch.zeros(6, 3, 5)
    with pytest.raises(CheckpointDamagedError):
        verify_checkpoint(checkpoint)
    path = tmp_path / "edited.ckpt"
    torch.save(seal_checkpoint(checkpoint), path)
    loaded = FederatedModule.load_from_checkpoint(path, model=nn.Linear(5, 3))
    assert torch.equal(loaded.client_states.state_dict()["c_i/weight"], torch.zeros(6, 3, 5))


def test_a_checksum_of_an_unknown_scheme_is_refused(saved: tuple[Path, FederatedModule]) -> None:
    checkpoint = torch.load(saved[0], weights_only=True)
    checkpoint[CHECKSUM_KEY]["scheme"] = "sha512/v9"
    with pytest.raises(ValueError, match=r"scheme 'sha512/v9'"):
        verify_checkpoint(checkpoint)


# ----------------------------------------------------------------------------------------------
# atomic writes
# ----------------------------------------------------------------------------------------------
class _MyIO(TorchCheckpointIO):
    pass


def test_the_module_installs_the_atomic_io_but_keeps_a_users_own() -> None:
    trainer = make_trainer(1)
    assert type(trainer.strategy.checkpoint_io) is TorchCheckpointIO
    trainer.fit(momentum_module(SCAFFOLD), tiny_datamodule())
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO
    mine = _MyIO()
    trainer = make_trainer(1, plugins=[mine])
    trainer.fit(momentum_module(SCAFFOLD), tiny_datamodule())
    assert trainer.strategy.checkpoint_io is mine


def test_a_save_interrupted_mid_write_leaves_the_previous_checkpoint(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    module = momentum_module(SCAFFOLD)
    trainer = make_trainer(2)
    trainer.fit(module, tiny_datamodule())
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    before = path.read_bytes()
    written: list[int] = []

    def disk_full(obj: Any, fh: Any) -> None:  # half the file reaches the disk, then the write fails
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        fh.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        fh.flush()
        written.append(len(buffer.getvalue()) // 2)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_files, "_serialize", disk_full)
    with pytest.raises(OSError, match="No space left"):
        trainer.save_checkpoint(path)
    assert written and written[0] > 1000
    assert path.read_bytes() == before
    assert verify_checkpoint(torch.load(path, weights_only=True), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # the temporary file is gone


KILLED_WRITER = textwrap.dedent("""
    import io, os, sys, time, torch
    import lightning_fedmeta.persistence.checkpoint_files as checkpoint_files
    import lightning_fedmeta.persistence.checksums as checksums
    path, progress = sys.argv[1], sys.argv[2]
    checkpoint_files.atomic_save(checksums.seal_checkpoint({"step": 0, "x": torch.zeros(2**20)}), path)

    def stalls_mid_write(obj, fh):  # writes half the new file, then waits to be killed
        data = io.BytesIO()
        torch.save(obj, data)
        fh.write(data.getvalue()[: len(data.getvalue()) // 2])
        fh.flush()
        os.fsync(fh.fileno())
        with open(progress + ".tmp", "w") as out:
            out.write(str(len(data.getvalue()) // 2))
        os.replace(progress + ".tmp", progress)
        time.sleep(60)
        fh.write(data.getvalue()[len(data.getvalue()) // 2 :])

    checkpoint_files._serialize = stalls_mid_write
    checkpoint_files.atomic_save(checksums.seal_checkpoint({"step": 1, "x": torch.ones(2**20)}), path)
""")


@pytest.mark.spawns
def test_kill_9_in_the_middle_of_a_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    """A process killed with SIGKILL halfway through writing a checkpoint over an earlier one: the file is still
    the earlier, complete and verified checkpoint, and the next save removes the killed writer's temporary file."""
    if os.name == "nt":
        pytest.skip("SIGKILL is POSIX")
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    path, progress = tmp_path / "big.ckpt", tmp_path / "progress"
    proc = subprocess.Popen([sys.executable, str(script), str(path), str(progress)],
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        deadline = time.monotonic() + 120  # a hang guard, not a speed limit (the suite runs 2 workers)
        while not progress.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the writer never reached the middle"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)  # the process this test started, halfway through its second save
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    partials = list(tmp_path.glob(".big.ckpt.*.partial"))
    assert len(partials) == 1 and partials[0].stat().st_size == int(progress.read_text())  # the half-written file
    checkpoint = torch.load(path, weights_only=True)
    assert verify_checkpoint(checkpoint, path)
    assert checkpoint["step"] == 0 and torch.equal(checkpoint["x"], torch.zeros(2**20))
    atomic_save(seal_checkpoint({"step": 2}), path)
    assert not list(tmp_path.glob(".big.ckpt.*.partial"))  # the dead writer's temporary file is removed
    assert torch.load(path, weights_only=True)["step"] == 2
