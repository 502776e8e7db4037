"""Checkpoint files and run configs are data, never code (docs/security.md, "Checkpoint files and run configs").

Each test plays the attacker who wrote (or serves) a checkpoint, a history file or a CIFAR batch, and checks that
nothing they put there runs, opens a folder or imports a module the user did not name; the refusal says what was
refused and what to do instead.
"""

from __future__ import annotations

import functools
import http.server
import io
import json
import os
import pickle
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.cli import FedMetaConfigError, main, run
from lightning_fedmeta.data.datasets import read_cifar_batch
from lightning_fedmeta.frontends.compare import compare_main
from lightning_fedmeta.persistence.checksums import seal_checkpoint
from tests.helpers import make_trainer, tiny_datamodule, tiny_module

FEDAVG = {"name": "fedavg", "local_lr": 0.2, "local_steps": 2, "batch_size": 4}


class _Payload:
    """Unpickling it runs ``exec``: it creates the file ``marker`` (what an attacker's ``os.system`` would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _malicious_checkpoint(folder: Path) -> tuple[Path, Path]:
    """A checkpoint whose unpickling would run code; returns it and the marker file that code would create."""
    marker = folder / "code-ran"
    path = folder / "evil.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {}, "fedmeta": _Payload(marker)}, path)
    return path, marker


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        return


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A folder and the ``http://127.0.0.1:PORT`` URL that serves it (a tiny http.server on localhost)."""
    folder = tmp_path / "served"
    folder.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=folder))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield folder, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A genuine FedAvg checkpoint after 2 rounds."""
    path = tmp_path_factory.mktemp("good") / "fedavg.ckpt"
    trainer = make_trainer(2)
    trainer.fit(tiny_module(FEDAVG), tiny_datamodule())
    trainer.save_checkpoint(path)
    return path


# ----------------------------------------------------------------------------------------------
# item 1: every load is weights_only=True, URLs included; weights_only=False is refused
# ----------------------------------------------------------------------------------------------
def _where(kind: str, path: Path, base_url: str) -> str:
    return {"http": f"{base_url}/{path.name}", "file-url": path.as_uri(), "local": str(path)}[kind]


@pytest.mark.parametrize("kind", ["http", "file-url", "local"])
def test_load_from_checkpoint_never_runs_a_pickle_payload(
    served: tuple[Path, str], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lightning reads an ``http`` URL with ``weights_only=False``; torch's default for the others is overridden
    by ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` (set here): only an explicit ``weights_only=True`` holds."""
    folder, base_url = served
    path, marker = _malicious_checkpoint(folder)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(ValueError, match=r"holds objects other than tensors and plain values .*could run code"):
        FederatedModule.load_from_checkpoint(_where(kind, path, base_url))
    assert not marker.exists()


def test_the_cli_never_runs_a_pickle_payload_from_a_url(served: tuple[Path, str], tmp_path: Path) -> None:
    folder, base_url = served
    path, marker = _malicious_checkpoint(folder)
    with pytest.raises(FedMetaConfigError, match=rf"checkpoint {base_url}/evil.ckpt holds objects other than"):
        run(["fit", "--ckpt_path", f"{base_url}/evil.ckpt", "--data.dataset", "synthetic", "--plots", "false",
             "--trainer.default_root_dir", str(tmp_path / "logs"), "--trainer.max_steps", "1"])
    assert not marker.exists()
    assert not list((tmp_path / "logs").rglob("*.ckpt"))


def test_a_trainer_resume_from_a_url_never_runs_a_pickle_payload(served: tuple[Path, str]) -> None:
    """``Trainer.fit(ckpt_path=url)`` from Python reads through the module's AtomicCheckpointIO."""
    folder, base_url = served
    path, marker = _malicious_checkpoint(folder)
    with pytest.raises(ValueError, match="could run code"):
        make_trainer(3).fit(tiny_module(FEDAVG), tiny_datamodule(), ckpt_path=f"{base_url}/{path.name}")
    assert not marker.exists()


def test_weights_only_false_is_refused_everywhere(good_ckpt: Path, tmp_path: Path) -> None:
    """A caller asking for ``weights_only=False`` is refused by name, even for a genuine file."""
    with pytest.raises(ValueError, match="refused to load checkpoint .* with weights_only=False"):
        FederatedModule.load_from_checkpoint(good_ckpt, weights_only=False)
    with pytest.raises(ValueError, match="with weights_only=False"):
        make_trainer(3).fit(tiny_module(FEDAVG), tiny_datamodule(), ckpt_path=str(good_ckpt), weights_only=False)
    with pytest.raises(FedMetaConfigError, match="with weights_only=False"):
        run(["validate", "--ckpt_path", str(good_ckpt), "--weights_only", "false", "--data.dataset", "synthetic",
             "--plots", "false", "--trainer.default_root_dir", str(tmp_path)])


def test_a_genuine_checkpoint_still_loads_from_a_url(served: tuple[Path, str], good_ckpt: Path) -> None:
    folder, base_url = served
    (folder / "good.ckpt").write_bytes(good_ckpt.read_bytes())
    loaded = FederatedModule.load_from_checkpoint(f"{base_url}/good.ckpt", model=torch.nn.Linear(5, 3))
    local = FederatedModule.load_from_checkpoint(good_ckpt, model=torch.nn.Linear(5, 3))
    for a, b in zip(loaded.state_dict().values(), local.state_dict().values(), strict=True):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# item 5: settings taken from a checkpoint never name code or paths; the CIFAR reader runs no code
# ----------------------------------------------------------------------------------------------
CLI_CONFIG = """
seed_everything: 0
trainer:
  max_steps: 2
  accelerator: cpu
  enable_progress_bar: false
  enable_model_summary: false
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {every_n_train_steps: 1, save_last: true}
model:
  algorithm: {name: fedavg, local_lr: 0.05, local_steps: 2, batch_size: 8}
  clients_per_round: 3
  compile_clients: false
data:
  dataset: synthetic
  num_clients: 6
  eval_every: 2
plots: false
"""


@pytest.fixture(scope="module")
def cli_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The last checkpoint of ``fedmeta fit`` of FedAvg for 2 rounds."""
    root = tmp_path_factory.mktemp("cli")
    config = root / "fedavg.yaml"
    config.write_text(CLI_CONFIG)
    run(["fit", "--config", str(config), "--trainer.default_root_dir", str(root / "logs")])
    return root / "logs" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"


def _forged(source: Path, target: Path, model: dict[str, Any] | None = None,
            data: dict[str, Any] | None = None) -> Path:
    """``source`` with some hyper-parameters replaced by plain values, re-sealed as anyone can."""
    checkpoint = torch.load(source, weights_only=True)
    checkpoint["hyper_parameters"].update(model or {})
    checkpoint["datamodule_hyper_parameters"].update(data or {})
    torch.save(seal_checkpoint(checkpoint), target)
    return target


def _malicious_cifar(folder: Path) -> Path:
    """A CIFAR-10 folder whose every batch file runs code when unpickled; returns the marker it would create."""
    marker = folder / "code-ran"
    batches = folder / "cifar-10-batches-py"
    batches.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        with open(batches / name, "wb") as fh:
            pickle.dump({b"data": _Payload(marker), b"labels": [0]}, fh)
    return marker


def _importable_module(folder: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """A module on ``sys.path`` that creates a marker file when imported (an attacker names any installed one)."""
    name = f"fedmeta_untrusted_{folder.name}"
    marker = folder / "imported"
    (folder / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef loss(out, y):\n    return out\n")
    monkeypatch.syspath_prepend(str(folder))
    return name, marker


def _resume(ckpt: Path, root: Path, *extra: str) -> Any:
    return run(["fit", "--ckpt_path", str(ckpt), "--trainer.default_root_dir", str(root), "--trainer.max_steps", "3",
                "--plots", "false", "--trainer.enable_progress_bar", "false", *extra])


def test_a_checkpoint_cannot_point_the_data_reader_at_a_folder(cli_ckpt: Path, tmp_path: Path) -> None:
    """``data.dataset: cifar10`` with ``data.root`` in a forged checkpoint made ``fedmeta fit`` unpickle files
    there; the root is a path, so it is taken only from the user."""
    marker = _malicious_cifar(tmp_path / "cifar")
    forged = _forged(cli_ckpt, tmp_path / "forged.ckpt", data={"dataset": "cifar10", "root": str(tmp_path / "cifar")})
    with pytest.raises(FedMetaConfigError, match=r"names code or file-system paths .*data\.root=.*--data\.root VALUE"):
        _resume(forged, tmp_path / "logs")
    assert not marker.exists()


def test_the_cifar_reader_refuses_a_batch_that_would_run_code(cli_ckpt: Path, tmp_path: Path) -> None:
    """Defence in depth: even a root the user gives holds only data to the CIFAR reader."""
    marker = _malicious_cifar(tmp_path / "cifar")
    with pytest.raises(ValueError, match=r"data_batch_1' is not a CIFAR-10 batch: it names builtins\.exec"):
        read_cifar_batch(tmp_path / "cifar" / "cifar-10-batches-py" / "data_batch_1")
    forged = _forged(cli_ckpt, tmp_path / "forged.ckpt", data={"dataset": "cifar10"})
    with pytest.raises(ValueError, match="is not a CIFAR-10 batch"):
        _resume(forged, tmp_path / "logs", "--data.root", str(tmp_path / "cifar"))
    assert not marker.exists()


def test_a_genuine_cifar_batch_with_numpy_arrays_still_reads(tmp_path: Path) -> None:
    data = np.arange(2 * 3072, dtype=np.uint8).reshape(2, 3072)
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        path = tmp_path / f"batch{protocol}"
        with open(path, "wb") as fh:
            pickle.dump({b"batch_label": b"x", b"data": data, b"labels": [3, 7], b"filenames": [b"a", b"b"]}, fh,
                        protocol=protocol)
        x, y = read_cifar_batch(path)
        assert torch.equal(x.reshape(2, -1), torch.from_numpy(data)) and y.tolist() == [3, 7]


@pytest.mark.parametrize("setting", ["loss", "class_path"])
def test_a_checkpoint_cannot_make_the_cli_import_a_module(
    cli_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    name, marker = _importable_module(tmp_path, monkeypatch)
    value = f"{name}.loss" if setting == "loss" else {"class_path": f"{name}.Net", "init_args": {}}
    key = "loss" if setting == "loss" else "model"
    forged = _forged(cli_ckpt, tmp_path / "forged.ckpt", model={key: value})
    with pytest.raises(FedMetaConfigError, match=rf"names code or file-system paths .*model\.{key}="):
        _resume(forged, tmp_path / "logs")
    assert not marker.exists() and name not in sys.modules


def test_load_from_checkpoint_takes_no_import_path_or_folder_from_the_file(
    good_ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``FederatedModule(loss="pkg.mod.f")`` imports the module: a forged checkpoint must not choose it (nor the
    disk store's folder); the same values passed by the caller are the caller's choice."""
    name, marker = _importable_module(tmp_path, monkeypatch)
    checkpoint = torch.load(good_ckpt, weights_only=True)
    checkpoint["hyper_parameters"].update(loss=f"{name}.loss", client_state_dir=str(tmp_path / "elsewhere"))
    forged = tmp_path / "forged.ckpt"
    torch.save(seal_checkpoint(checkpoint), forged)
    with pytest.raises(ValueError, match=r"model\.client_state_dir=.*model\.loss=.*"
                                         r"load_from_checkpoint\(path, client_state_dir=\.\.\., loss=\.\.\.\)"):
        FederatedModule.load_from_checkpoint(forged, model=torch.nn.Linear(5, 3))
    assert not marker.exists() and name not in sys.modules
    loaded = FederatedModule.load_from_checkpoint(forged, model=torch.nn.Linear(5, 3), loss="cross_entropy",
                                                  client_state_dir=str(tmp_path / "mine"))
    assert loaded.client_state_dir == str(tmp_path / "mine") and not marker.exists()


# ----------------------------------------------------------------------------------------------
# item 16: the temporary files of interrupted saves go away on --ckpt_path last
# ----------------------------------------------------------------------------------------------
def _dead_pid() -> int:
    """The id of a process that has ended (one this test started and waited for)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_ckpt_path_last_removes_the_partial_files_of_a_killed_save(tmp_path: Path) -> None:
    """A save killed mid-write leaves ``.<name>.<pid>.<random>.partial``; the resumed run writes into a new
    ``version_1`` folder, so only the resume itself can remove those of ``version_0`` (of any checkpoint name)."""
    config = tmp_path / "fedavg.yaml"
    config.write_text(CLI_CONFIG)
    args = ["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path / "logs")]
    run(args)
    folder = tmp_path / "logs" / "lightning_logs" / "version_0" / "checkpoints"
    dead, alive = _dead_pid(), os.getpid()
    stale = [folder / f".last.ckpt.{dead}.0a1b2c3d.partial", folder / f".epoch=0-step=2.ckpt.{dead}.deadbeef.partial"]
    live = folder / f".last.ckpt.{alive}.00ff00ff.partial"  # a writer still running: kept
    for path in [*stale, live]:
        path.write_bytes(b"PK\x03\x04 half a checkpoint")
    resumed = run([*args, "--ckpt_path", "last", "--trainer.max_steps", "3"])
    assert resumed.trainer.global_step == 3
    assert [p for p in stale if p.exists()] == [] and live.exists()


# ----------------------------------------------------------------------------------------------
# item 17: fedmeta compare on a malformed history: one line naming the file and what is wrong, status 2
# ----------------------------------------------------------------------------------------------
_GOOD_RECORD = {"round": 2, "stage": "val", "metrics": {"val/acc_weighted": 0.5, "val/acc_worst10": 0.1}}
MALFORMED_HISTORIES: dict[str, tuple[bytes, str]] = {
    "not-json": (b"{this is not json", r"not JSON: Expecting property name"),
    "not-utf8": (b'{"history": ["\xff\xfe"]}', r"not UTF-8 text"),
    "empty": (b"", r"not JSON"),
    "a-list": (b"[1, 2]", r"expected a JSON object with a 'history' list"),
    "history-not-list": (b'{"history": {"round": 1}}', r"expected a JSON object with a 'history' list"),
    "record-not-object": (b'{"history": [1]}', r"history record 0 is int 1, not an object"),
    "no-round": (b'{"history": [{"stage": "val", "metrics": {}}]}', r"history record 0 has no 'round'"),
    "round-a-string": (b'{"history": [{"round": "two", "metrics": {}}]}', r"has round 'two', not an integer"),
    "round-null": (b'{"history": [{"round": null}]}', r"has round None, not an integer"),
    "metrics-a-list": (b'{"history": [{"round": 1, "metrics": [0.5]}]}', r"has metrics \[0\.5\], not an object"),
    "metric-a-string": (b'{"history": [{"round": 1, "metrics": {"val/acc_weighted": "high"}}]}',
                        r"has metric 'val/acc_weighted' = 'high', not a number"),
    "metric-an-object": (b'{"history": [{"round": 1, "metrics": {"val/acc_weighted": {"x": 1}}}]}',
                         r"not a number"),
    "stage-a-number": (b'{"history": [{"round": 1, "stage": 3, "metrics": {}}]}', r"has stage 3, not a string"),
    "deep": (b'{"history": ' + b"[" * 100000 + b"]" * 100000 + b"}", r"nested too deeply|history record 0"),
}
MALFORMED_CSVS: dict[str, tuple[bytes, str]] = {
    "step-a-word": (b"step,val/acc_weighted\nten,0.5\n", r"line 2, column 'step' holds 'ten', not a number"),
    "value-a-word": (b"step,val/acc_weighted\n1,high\n", r"line 2, column 'val/acc_weighted' holds 'high'"),
    "round-a-word": (b"step,val/round,val/acc_weighted\n1,x,0.5\n", r"column 'val/round' holds 'x'"),
    "binary": (b"step,val/acc_weighted\n\xff\xfe\x00\x01,0.5\n", r"cannot be read as a CSVLogger metrics\.csv"),
    "nul-byte": (b"step,val/acc_weighted\n1,0.5\x00\n", r"metrics\.csv"),
}


def _compare_fails(path: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``fedmeta compare PATH`` through the console entry point; returns its one line of stderr."""
    with pytest.raises(SystemExit) as info:
        main(["compare", str(path), "--out", str(out)])
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedmeta: error: ") and str(path) in lines[0], lines
    return lines[0]


@pytest.mark.parametrize("form", sorted(MALFORMED_HISTORIES))
def test_compare_names_the_file_and_the_fault_of_a_malformed_history(
    form: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    content, expected = MALFORMED_HISTORIES[form]
    path = tmp_path / "fedmeta_history.json"
    path.write_bytes(content)
    assert re.search(expected, _compare_fails(path, tmp_path, capsys))


@pytest.mark.parametrize("form", sorted(MALFORMED_CSVS))
def test_compare_names_the_file_and_the_fault_of_a_malformed_metrics_csv(
    form: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    content, expected = MALFORMED_CSVS[form]
    path = tmp_path / "metrics.csv"
    path.write_bytes(content)
    assert re.search(expected, _compare_fails(path, tmp_path, capsys))


def test_compare_still_reads_a_well_formed_history(tmp_path: Path) -> None:
    path = tmp_path / "fedmeta_history.json"
    path.write_text(json.dumps({"history": [_GOOD_RECORD, {"round": 4, "stage": "val",
                                                           "metrics": {"val/acc_weighted": None}}]}))
    comparison = compare_main([str(path), "--out", str(tmp_path)], stream=io.StringIO())
    assert [s["rounds"] for s in comparison.summaries.values()] == [[2]]  # one run; its last round with a value


# ----------------------------------------------------------------------------------------------
# the datamodule's load_from_checkpoint (Lightning's own read http URLs with weights_only=False)
# ----------------------------------------------------------------------------------------------
def test_the_datamodule_from_a_url_never_runs_a_pickle_payload(served: tuple[Path, str]) -> None:
    from lightning_fedmeta.data import FederatedDataModule

    folder, url = served
    _malicious_checkpoint(folder)
    with pytest.raises(ValueError):
        FederatedDataModule.load_from_checkpoint(f"{url}/evil.ckpt")
    assert not (folder / "code-ran").exists()
    with pytest.raises(ValueError, match="weights_only"):
        FederatedDataModule.load_from_checkpoint(f"{url}/evil.ckpt", weights_only=False)


def test_the_datamodule_takes_no_folder_from_the_checkpoint_unless_passed(tmp_path: Path) -> None:
    from lightning_fedmeta.data import FederatedDataModule

    path = tmp_path / "dm.ckpt"
    settings = {"dataset": "cifar10", "root": str(tmp_path / "attacker"), "num_clients": 4}
    torch.save(seal_checkpoint({"datamodule_hyper_parameters": settings, "state_dict": {}}), path)
    with pytest.raises(ValueError, match=r"data\.root=.*attacker.*root=\.\.\."):
        FederatedDataModule.load_from_checkpoint(path)
    dm = FederatedDataModule.load_from_checkpoint(path, root=str(tmp_path / "mine"))
    assert dm.root == str(tmp_path / "mine") and dm.num_clients == 4
