"""Traps a new user of the ``fedmeta`` command hit (issue 31, items 5, 6, 8, 11): resuming with ``--ckpt_path last``
after a default fit, a ``class_path`` to their own module, ``--help``, and a console full of third-party noise."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from lightning_fedmeta.cli import FedMetaConfigError, main, quiet_console, run
from lightning_fedmeta.frontends.callbacks import RoundProgressBar
from tests.helpers import REPO

SMALL = """
seed_everything: 0
trainer:
  max_steps: 4
  accelerator: cpu
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


def _config(tmp_path: Path, extra_trainer: str = "") -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(SMALL.replace("  accelerator: cpu\n", "  accelerator: cpu\n" + extra_trainer))
    return path


# ---- item 5: --ckpt_path last after a default fit ------------------------------------------------------------------

def test_default_fit_writes_last_ckpt_and_ckpt_path_last_resumes_at_its_round(tmp_path: Path,
                                                                             caplog: pytest.LogCaptureFixture) -> None:
    args = ["fit", "--config", str(_config(tmp_path)), "--trainer.default_root_dir", str(tmp_path / "logs"),
            "--trainer.enable_progress_bar", "false"]
    run(args)
    last = tmp_path / "logs" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert last.is_file(), "a default `fedmeta fit` writes last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 4
    with caplog.at_level(logging.INFO):
        resumed = run([*args, "--ckpt_path", "last", "--trainer.max_steps", "6"])
    assert f"--ckpt_path last: resuming from {last}" in caplog.text
    assert resumed.trainer.ckpt_path == str(last)  # restored from round 4, not trained again from round 0
    assert resumed.trainer.global_step == 6
    newest = tmp_path / "logs" / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt"
    assert torch.load(newest, weights_only=True)["global_step"] == 6


def test_users_checkpoint_callback_keeps_its_settings_and_gains_last_ckpt(tmp_path: Path) -> None:
    own = tmp_path / "own"
    callback = ("  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
                f"      init_args: {{dirpath: {own}, every_n_train_steps: 1, save_top_k: -1}}\n")
    run(["fit", "--config", str(_config(tmp_path, callback)), "--trainer.default_root_dir", str(tmp_path / "logs"),
         "--trainer.enable_progress_bar", "false", "--trainer.max_steps", "2"])
    assert sorted(p.name for p in own.iterdir()) == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "last.ckpt"]


def test_ckpt_path_last_beside_checkpoints_without_last_is_refused_naming_the_folders(tmp_path: Path) -> None:
    callback = ("  callbacks:\n    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
                "      init_args: {save_last: false}\n")
    args = ["fit", "--config", str(_config(tmp_path, callback)), "--trainer.default_root_dir", str(tmp_path / "logs"),
            "--trainer.enable_progress_bar", "false", "--trainer.max_steps", "2"]
    run(args)
    folder = tmp_path / "logs" / "lightning_logs" / "version_0" / "checkpoints"
    assert not (folder / "last.ckpt").exists(), "the user's save_last: false is kept"
    with pytest.raises(FedMetaConfigError, match=r"--ckpt_path last: no last\*\.ckpt in .*but 1 other checkpoint") \
            as info:
        run([*args, "--ckpt_path", "last"])
    assert str(folder) in str(info.value) and "epoch=0-step=2.ckpt" in str(info.value)
    assert not (tmp_path / "logs" / "lightning_logs" / "version_1").exists(), "refused before a new run started"


# ---- item 6: a class_path to the user's own module ---------------------------------------------------------------

def _own_module_config(tmp_path: Path, class_path: str) -> Path:
    (tmp_path / "fedmeta_trap_net.py").write_text(
        "import torch.nn as nn\n\n\nclass Net(nn.Sequential):\n"
        "    def __init__(self, hidden: int = 8):\n"
        "        super().__init__(nn.Linear(60, hidden), nn.ReLU(), nn.Linear(hidden, 10))\n")
    path = tmp_path / "own.yaml"
    config = yaml.safe_load(SMALL)
    config["model"]["model"] = {"class_path": class_path, "init_args": {"hidden": 4}}
    path.write_text(yaml.safe_dump(config))
    return path


def test_class_path_of_a_module_in_the_working_directory_imports_without_pythonpath(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "fedmeta_trap_net", raising=False)
    config = _own_module_config(tmp_path, "fedmeta_trap_net.Net")
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(config), "--print_config"])
    assert info.value.code in (0, None), capsys.readouterr().err
    assert yaml.safe_load(capsys.readouterr().out)["model"]["model"]["class_path"] == "fedmeta_trap_net.Net"


def test_class_path_that_cannot_be_imported_is_one_line_naming_the_option_path_and_module(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    config = _own_module_config(tmp_path, "fedmeta_trap_nett.Net")  # a typo in the module name
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", str(config)])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("fedmeta: error: model.model: class_path 'fedmeta_trap_nett.Net' cannot be imported: "
                          "No module named 'fedmeta_trap_nett'")
    assert str(tmp_path) in err


# ---- item 8: what --help offers -----------------------------------------------------------------------------------

def test_help_lists_algorithms_and_compare_and_not_predict(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        run(["--help"])
    assert info.value.code in (0, None)
    shown = capsys.readouterr().out
    commands = shown[shown.index("Available subcommands"):]
    for name in ("fit", "validate", "test", "algorithms", "compare"):
        assert f"\n    {name} " in commands, name
    assert "List every registered algorithm" in commands and "Plot and tabulate several runs" in commands
    assert "predict" not in commands
    with pytest.raises(SystemExit) as info:
        run(["predict", "--config", str(REPO / "configs" / "quickstart.yaml")])
    assert info.value.code == 2


# ---- item 11: a quiet console ---------------------------------------------------------------------------------------

NOISE = ("💡", "Tip:", "litlogger", "litmodels", "GPU available: False", "TPU available", "FLOPs", "Flops",
         "Validation DataLoader", "LeafSpec", "deprecated", "Epoch ", "No CUDA runtime", "\r", "┏")


def test_fit_into_a_log_file_has_one_line_per_evaluation_and_no_third_party_noise(tmp_path: Path) -> None:
    config = _config(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "lightning_fedmeta.cli", "fit", "--config", str(config)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    console = done.stdout + done.stderr
    for noise in NOISE:
        assert noise not in console, (noise, console)
    lines = [line for line in done.stdout.splitlines() if line.startswith("round ")]
    assert [line.split(":")[0] for line in lines] == ["round 2/4", "round 4/4"], done.stdout
    assert all("clients 3, loss " in line and "val/acc_weighted 0." in line for line in lines), lines
    for useful in ("Seed set to 0", "FederatedDataModule: synthetic", "FedAvg(", "Total params",
                   "Personalized evaluation after round 4"):
        assert useful in console, useful


def test_cuda_home_notice_is_dropped_and_other_torch_warnings_kept(caplog: pytest.LogCaptureFixture) -> None:
    quiet_console()
    log = logging.getLogger("torch.utils.cpp_extension")
    with caplog.at_level(logging.WARNING):
        log.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local/cuda")
        log.warning("something else")
    assert "No CUDA runtime" not in caplog.text and "something else" in caplog.text


def test_progress_bar_shows_the_latest_rounds_loss_not_the_last_logged_one() -> None:
    bar = RoundProgressBar(plain=True)
    bar._train_progress_bar = Tqdm(disable=True)
    # train/loss was logged at round 1 (every log_every_n_steps rounds); round 2 just ended with loss 0.25
    trainer = SimpleNamespace(global_step=2, loggers=[], progress_bar_metrics={"train/loss": 0.9, "clients": 3.0},
                              callback_metrics={"val/acc_weighted": torch.tensor(0.75)}, max_steps=4)
    module = SimpleNamespace()
    bar.on_train_batch_end(trainer, module, {"loss": torch.tensor(0.25)}, None, 1)  # type: ignore[arg-type]
    assert bar.get_metrics(trainer, module)["loss"] == 0.25  # type: ignore[arg-type]
    assert bar.evaluation_line(trainer, module) == (  # type: ignore[arg-type]
        "round 2/4: clients 3, loss 0.2500, val/acc_weighted 0.7500")


# ---- item 7: what ran is what the YAML says; an ignored optimizer is named -------------------------------------------

def test_print_config_and_the_saved_config_show_every_algorithm_hyper_parameter(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["fit", "--config", str(_config(tmp_path)), "--print_config"])
    assert done.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)["model"]["algorithm"]
    assert printed == {"name": "fedavg", "local_lr": 0.05, "local_steps": 2, "batch_size": 8, "finetune_steps": 0,
                       "finetune_lr": None, "finetune_batch_size": 32,  # None: follows local_lr, as in the code
                       "local_epochs": None, "finetune_epochs": None, "drop_last": False}
    run(["fit", "--config", str(_config(tmp_path)), "--trainer.default_root_dir", str(tmp_path / "logs"),
         "--trainer.max_steps", "2", "--trainer.enable_progress_bar", "false"])
    saved = yaml.safe_load((tmp_path / "logs" / "lightning_logs" / "version_0" / "config.yaml").read_text())
    assert saved["model"]["algorithm"] == printed


def test_a_lightning_module_models_own_optimizer_is_named_as_unused() -> None:
    import lightning as L
    from torch import nn

    from tests.helpers import fit, tiny_datamodule, tiny_module

    class Net(L.LightningModule):
        def __init__(self, lr: float = 0.3) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.layer = nn.Linear(5, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)

    module = tiny_module({"name": "fedavg", "local_lr": 0.05, "local_steps": 1, "batch_size": 4}, model=Net)
    with pytest.warns(UserWarning, match=r"Net's configure_optimizers and lr = 0\.3 are not used: .*"
                                         r"model\.algorithm\.local_lr = 0\.05"):
        fit(module, tiny_datamodule(), 1)


def test_a_plain_trainer_shows_rounds_not_epochs() -> None:
    """Lightning's own bar, on a plain Trainer, says "Epoch 3/-2" (max_epochs = -1); the module replaces it by
    RoundProgressBar, and leaves a chosen bar (a subclass) or no bar alone."""
    import lightning as L
    from lightning.pytorch.callbacks import TQDMProgressBar

    from tests.helpers import tiny_datamodule, tiny_module

    class Mine(TQDMProgressBar):
        pass

    spec = {"name": "fedavg", "local_lr": 0.05, "local_steps": 1, "batch_size": 4}
    for callbacks, expected in (([], RoundProgressBar), ([TQDMProgressBar()], RoundProgressBar), ([Mine()], Mine)):
        trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_model_summary=False, callbacks=callbacks)
        trainer.fit(tiny_module(spec), tiny_datamodule())
        bars = [c for c in trainer.callbacks if isinstance(c, TQDMProgressBar) or type(c).__name__.endswith("Bar")]
        assert [type(b) for b in bars] == [expected]
