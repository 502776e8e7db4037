"""Checkpoint files and run configs are data, never code (docs/security.md, "Checkpoint files and run configs").

Each test plays the attacker who wrote (or serves) a checkpoint, a history file or a CIFAR batch, and checks that
nothing they put there runs, opens a folder or imports a module the user did not name; the refusal says what was
refused and what to do instead.
"""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.cli import FedMetaConfigError, run
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
