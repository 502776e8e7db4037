"""Resuming (or loading) a checkpoint with other settings is refused before training, naming every setting that
differs; the execution-only settings on the allow-list may change and are reported (docs/reliability.md,
"Crashes and checkpoints"; lightning_fedmeta/persistence/checksums.py,
lightning_fedmeta/persistence/checkpoint_files.py, lightning_fedmeta/persistence/safe_loading.py and
lightning_fedmeta/frontends/resume_settings.py)."""

from __future__ import annotations

import inspect
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.cli import FedMetaConfigError, run
from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.frontends.resume_settings import (
    CHANGEABLE_DATA_SETTINGS,
    CHANGEABLE_MODEL_SETTINGS,
    RUN_RECORD_KEYS,
    fedmeta_run_record,
)
from lightning_fedmeta.persistence.checksums import CHECKSUM_KEY, CheckpointWithoutChecksumWarning, seal_checkpoint
from lightning_fedmeta.persistence.memory_store import flatten_state
from lightning_fedmeta.persistence.safe_loading import CheckpointSettingsError
from tests.helpers import make_trainer, tiny_data, tiny_datamodule

FEDAVG = {"name": "fedavg", "local_lr": 0.2, "local_steps": 2, "batch_size": 4}
SCAFFOLD = {"name": "scaffold", "local_lr": 0.2, "local_steps": 2, "batch_size": 4}


def _module(algorithm: dict[str, Any] = SCAFFOLD, **overrides: Any) -> FederatedModule:
    torch.manual_seed(0)
    kwargs: dict[str, Any] = {"model": nn.Linear(5, 3), "algorithm": algorithm, "clients_per_round": 3, "seed": 4}
    kwargs.update(overrides)
    return FederatedModule(**kwargs)


def _refuse_rounds(module: FederatedModule) -> list[int]:
    """Replace ``module.training_step`` by a stub that records the call and raises: a check that lets a round run
    fails the test at once. (A stub returning ``None`` makes Lightning skip the optimizer step, so ``global_step``
    never reaches ``max_steps`` and the fit runs forever.)"""
    entered: list[int] = []

    def no_round(*args: Any, **kwargs: Any) -> None:
        entered.append(1)
        raise AssertionError("a round ran: the checkpoint should have been refused before any")

    module.training_step = no_round  # type: ignore[method-assign]
    return entered


@pytest.fixture(scope="module")
def fedavg_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """FedAvg (every reliability option applies to it) after 2 rounds, all options at their defaults."""
    path = tmp_path_factory.mktemp("settings") / "fedavg.ckpt"
    trainer = make_trainer(2)
    trainer.fit(_module(FEDAVG), tiny_datamodule())
    trainer.save_checkpoint(path)
    return path


# ----------------------------------------------------------------------------------------------
# every module option must match, unless it is on the allow-list
# ----------------------------------------------------------------------------------------------
#: a valid value other than the checkpoint's for every FederatedModule option (extra arguments it needs)
OTHER_VALUES: dict[str, tuple[Any, dict[str, Any]]] = {
    "algorithm": ({"name": "fedprox", "local_lr": 0.2, "local_steps": 2, "batch_size": 4}, {}),
    "clients_per_round": (4, {}),
    "fraction": (0.5, {"clients_per_round": None}),
    "aggregation": ("uniform", {}),
    "server_lr": (0.5, {}),
    "client_batching": ("loop", {}),
    "client_chunk_size": (2, {}),
    "compile_clients": (False, {}),
    "step_schedule": ("lockstep", {}),
    "cuda_graphs": (False, {}),
    "client_state": ("disk", {}),
    "client_state_dir": ("client_state_elsewhere", {}),
    "holdout_clients": (1, {}),
    "seed": (5, {}),
    "loss": ("nll", {}),
    "metrics": ({"acc": "accuracy", "top": "accuracy"}, {}),
    "client_dropout": (0.2, {}),
    "over_selection": (0.5, {}),
    "local_steps_dist": ([1, 2, 1, 2, 1, 2], {}),
    "aggregator": ("median", {}),
    "byzantine": ({"fraction": 0.2, "attack": "sign_flip"}, {}),
    "dp": ({"clip": 1.0, "noise_multiplier": 1.0}, {"aggregation": "uniform"}),
    "compression": ("float16", {}),
}
#: options that are not hyper-parameters: the architecture (named by model_class), and the server optimizer and
#: scheduler (factories; compared as built optimizers when fitting: test_another_server_optimizer_is_refused)
NOT_HYPER_PARAMETERS = {"model", "server_optimizer", "server_lr_scheduler"}


def test_the_table_covers_every_module_option() -> None:
    options = set(inspect.signature(FederatedModule.__init__).parameters) - {"self"}
    missing = sorted(options - set(OTHER_VALUES) - NOT_HYPER_PARAMETERS)
    assert not missing, f"give OTHER_VALUES a valid other value of the new option(s) {missing}"
    assert set(CHANGEABLE_MODEL_SETTINGS) == {
        "client_batching", "client_chunk_size", "compile_clients", "client_state", "client_state_dir",
        "step_schedule", "cuda_graphs",
    }
    assert set(CHANGEABLE_DATA_SETTINGS) == {"root", "download", "eval_every", "eval_clients"}


@pytest.mark.parametrize("option", sorted(OTHER_VALUES))
def test_resuming_with_another_value_of_an_option_is_refused_unless_it_may_change(
    fedavg_ckpt: Path, option: str, caplog: pytest.LogCaptureFixture
) -> None:
    value, needs = OTHER_VALUES[option]
    module = _module(**{"algorithm": FEDAVG, option: value, **needs})
    entered = _refuse_rounds(module)
    trainer = make_trainer(2)  # resumed at round 2 of 2: no round to run
    saved = torch.load(fedavg_ckpt, weights_only=True)["hyper_parameters"]
    if option in CHANGEABLE_MODEL_SETTINGS:
        with caplog.at_level(logging.INFO):
            trainer.fit(module, tiny_datamodule(), ckpt_path=str(fedavg_ckpt))
        assert f"model.{option}: checkpoint {saved[option]!r}, given {value!r}" in caplog.text
        return
    error = ValueError if option == "loss" else CheckpointSettingsError
    with pytest.raises(error) as info:
        trainer.fit(module, tiny_datamodule(), ckpt_path=str(fedavg_ckpt))
    assert not entered
    message = str(info.value)
    if option == "loss":  # compared by the loss it resolves to (None and "cross_entropy" are the same)
        assert "trained with loss 'cross_entropy', this module uses 'nll'" in message
    elif option == "algorithm":
        assert "\n  model.algorithm.name: checkpoint 'fedavg', given 'fedprox'\n" in message
    else:
        assert f"\n  model.{option}: checkpoint {saved[option]!r}, given {value!r}\n" in message


def test_evaluation_only_settings_may_change_when_a_checkpoint_is_only_loaded(fedavg_ckpt: Path) -> None:
    other = {"acc": "accuracy", "top": "accuracy"}
    loaded = FederatedModule.load_from_checkpoint(fedavg_ckpt, model=nn.Linear(5, 3), metrics=other,
                                                  algorithm={**FEDAVG, "finetune_steps": 3})
    assert loaded.algorithm.finetune_steps == 3 and loaded.metrics == other
    loaded.attach_data(tiny_data())  # the saved per-client states of other metrics are not restored
    assert loaded.last_summary == {}
    with pytest.raises(CheckpointSettingsError, match=r"model.seed: checkpoint 4, given 5"):
        FederatedModule.load_from_checkpoint(fedavg_ckpt, model=nn.Linear(5, 3), seed=5)


def test_an_option_the_checkpoint_predates_counts_as_its_default(fedavg_ckpt: Path, tmp_path: Path) -> None:
    """A checkpoint written before an option existed ran with its default: another value is refused."""
    checkpoint = torch.load(fedavg_ckpt, weights_only=True)
    del checkpoint["hyper_parameters"]["client_dropout"]
    path = tmp_path / "older.ckpt"
    torch.save(seal_checkpoint(checkpoint), path)
    with pytest.raises(CheckpointSettingsError, match=r"model.client_dropout: checkpoint 0.0, given 0.2"):
        FederatedModule.load_from_checkpoint(path, model=nn.Linear(5, 3), client_dropout=0.2)
    loaded = FederatedModule.load_from_checkpoint(path, model=nn.Linear(5, 3))
    assert loaded.hparams["client_dropout"] == 0.0


def test_the_algorithm_is_compared_by_its_built_hyper_parameters(fedavg_ckpt: Path) -> None:
    """A name, a mapping with defaults spelled out, or an instance: the same algorithm is accepted; another
    hyper-parameter value is named; evaluation-only ones may change when the checkpoint is only loaded."""
    from lightning_fedmeta import create_algorithm

    instance = create_algorithm("fedavg", local_lr=0.2, local_steps=2, batch_size=4)
    for same in ({**FEDAVG, "finetune_steps": 0}, instance):
        module = _module(same)
        module.attach_data(tiny_data())
        module.on_load_checkpoint(torch.load(fedavg_ckpt, weights_only=True))
    with pytest.raises(CheckpointSettingsError, match=r"model.algorithm.local_lr: checkpoint 0.2, given 0.1\n"):
        FederatedModule.load_from_checkpoint(fedavg_ckpt, model=nn.Linear(5, 3), algorithm={**FEDAVG, "local_lr": 0.1})


# ----------------------------------------------------------------------------------------------
# Trainer.fit(ckpt_path=...) from Python
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scaffold_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, FederatedModule]:
    """SCAFFOLD with a momentum server optimizer: a checkpoint after round 2 of 4, and the uninterrupted run."""
    root = tmp_path_factory.mktemp("scaffold")
    optimizer = {"server_optimizer": lambda p: torch.optim.SGD(p, lr=0.8, momentum=0.9)}
    straight = _module(**optimizer)
    make_trainer(4).fit(straight, tiny_datamodule(eval_every=2))
    first = _module(**optimizer)
    checkpoint = ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_last=True)
    make_trainer(2, enable_checkpointing=True, callbacks=[checkpoint]).fit(first, tiny_datamodule(eval_every=2))
    return root / "last.ckpt", straight


MOMENTUM = {"server_optimizer": lambda p: torch.optim.SGD(p, lr=0.8, momentum=0.9)}


@pytest.mark.parametrize(
    "module_args, datamodule, expected",
    [
        ({"seed": 5}, tiny_datamodule(), ["model.seed: checkpoint 4, given 5"]),
        ({"algorithm": "fedavg"}, tiny_datamodule(), ["model.algorithm.name: checkpoint 'scaffold', given 'fedavg'"]),
        ({}, tiny_datamodule(num_clients=8), ["number of clients in the data: checkpoint 6, given 8"]),
        ({"seed": 5, "clients_per_round": 2}, tiny_datamodule(), ["model.clients_per_round: checkpoint 3, given 2",
                                                                  "model.seed: checkpoint 4, given 5"]),
        ({"server_optimizer": lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9)}, tiny_datamodule(),
         ["model.server_optimizer.lr: checkpoint 0.8, given 0.5"]),
        ({"server_optimizer": lambda p: torch.optim.Adam(p, lr=0.8)}, tiny_datamodule(),
         ["model.server_optimizer: checkpoint 'torch.optim.sgd.SGD', given 'torch.optim.adam.Adam'"]),
    ],
    ids=["seed", "algorithm", "num-clients", "two-settings", "optimizer-lr", "optimizer-class"],
)
def test_fit_from_a_checkpoint_with_other_settings_is_refused_before_any_round(
    scaffold_run: tuple[Path, FederatedModule], module_args: dict[str, Any], datamodule: Any, expected: list[str]
) -> None:
    module = _module(**{**MOMENTUM, **module_args})
    trainer = make_trainer(4)
    entered = _refuse_rounds(module)
    with pytest.raises(CheckpointSettingsError) as info:
        trainer.fit(module, datamodule, ckpt_path=str(scaffold_run[0]))
    assert not entered
    message = str(info.value)
    assert message.startswith(f"checkpoint {scaffold_run[0]} was written with other settings than this run's")
    listed = [line.strip() for line in message.splitlines() if line.startswith("  ")]
    assert listed == expected


def test_a_checkpoint_records_every_entry_of_the_run_record(scaffold_run: tuple[Path, FederatedModule]) -> None:
    saved = torch.load(scaffold_run[0], weights_only=True)["fedmeta"]["record"]
    assert set(fedmeta_run_record(_module().algorithm, None)) == set(RUN_RECORD_KEYS)
    missing = [key for key in RUN_RECORD_KEYS if key not in saved]
    assert not missing, f"the checkpoint's run record lacks {missing}"
    assert saved["server_optimizer"]["class"] == "torch.optim.sgd.SGD"
    defaults = saved["server_optimizer"]["defaults"]
    assert defaults["lr"] == 0.8 and defaults["momentum"] == 0.9


@pytest.mark.parametrize("key", RUN_RECORD_KEYS)
def test_a_checkpoint_whose_run_record_lacks_an_entry_is_refused_naming_it(
    scaffold_run: tuple[Path, FederatedModule], tmp_path: Path, key: str
) -> None:
    """Without its ``server_optimizer`` record a checkpoint resumed under another optimizer learning rate ran
    forever in this test's stubbed fit, and under another optimizer class failed with ``KeyError: 'step'`` in
    Lightning's optimizer restore: every entry of the record must be there, or the checkpoint is refused, naming
    the entry, before any round, for fit and for load_from_checkpoint alike."""
    checkpoint = torch.load(scaffold_run[0], weights_only=True)
    checkpoint["fedmeta"]["record"].pop(key, None)
    path = tmp_path / f"without-{key}.ckpt"
    torch.save(seal_checkpoint(checkpoint), path)
    message = re.escape(f"checkpoint {path} has no record of '{key}' in checkpoint['fedmeta']['record']")
    for optimizer in (MOMENTUM, {"server_optimizer": lambda p: torch.optim.Adam(p, lr=0.8)}):
        module = _module(**optimizer)
        entered = _refuse_rounds(module)
        with pytest.raises(CheckpointSettingsError, match=message):
            make_trainer(4).fit(module, tiny_datamodule(eval_every=2), ckpt_path=str(path))
        assert not entered
    with pytest.raises(CheckpointSettingsError, match=message):
        FederatedModule.load_from_checkpoint(path, model=nn.Linear(5, 3))


def test_a_checkpoint_without_checksum_predates_the_run_record_and_resumes_without_it(
    scaffold_run: tuple[Path, FederatedModule], tmp_path: Path
) -> None:
    """A checkpoint written before checksums (and the run record, which came with them) has no record to check:
    it resumes with a warning, as before, and its hyper-parameters are still compared."""
    checkpoint = torch.load(scaffold_run[0], weights_only=True)
    for key in RUN_RECORD_KEYS:
        checkpoint["fedmeta"]["record"].pop(key, None)
    del checkpoint[CHECKSUM_KEY]
    path = tmp_path / "old.ckpt"
    torch.save(checkpoint, path)
    trainer = make_trainer(3)
    with pytest.warns(CheckpointWithoutChecksumWarning):
        trainer.fit(_module(**MOMENTUM), tiny_datamodule(eval_every=2), ckpt_path=str(path))
    assert trainer.global_step == 3
    with pytest.warns(CheckpointWithoutChecksumWarning), pytest.raises(CheckpointSettingsError, match="model.seed"):
        make_trainer(3).fit(_module(**MOMENTUM, seed=5), tiny_datamodule(eval_every=2), ckpt_path=str(path))


def test_a_federated_datamodule_with_another_setting_is_named(tmp_path: Path) -> None:
    def data(**kw: Any) -> FederatedDataModule:
        return FederatedDataModule(dataset="synthetic", num_clients=6, eval_every=2, **kw)

    trainer = make_trainer(2)
    trainer.fit(_module(model=None), data())
    trainer.save_checkpoint(tmp_path / "s.ckpt")
    with pytest.raises(CheckpointSettingsError, match=r"\n  data.data_seed: checkpoint 0, given 1\n"):
        make_trainer(3).fit(_module(model=None), data(data_seed=1), ckpt_path=str(tmp_path / "s.ckpt"))


def test_execution_settings_and_the_evaluation_schedule_may_change_and_are_reported(
    scaffold_run: tuple[Path, FederatedModule], caplog: pytest.LogCaptureFixture
) -> None:
    """Another eval_every and another vmap chunk size: the run resumes, says what changed, and its training
    state is the uninterrupted run's to rounding (a chunk of 1 client and one of 3 run other kernels: bit for bit
    on some CPUs, not on the AVX-512 CI machine, where unchanged main differed in the last bits; SCAFFOLD's control
    variates divide parameter differences by K·η, hence 1e-5 for the client state)."""
    path, straight = scaffold_run
    resumed = _module(**MOMENTUM, client_chunk_size=1)
    with caplog.at_level(logging.INFO):
        make_trainer(4).fit(resumed, tiny_datamodule(eval_every=3), ckpt_path=str(path))
    assert ("settings changed since the checkpoint (allowed): model.client_chunk_size: checkpoint 'auto', given 1; "
            "data.eval_every: checkpoint 2, given 3; trainer.max_steps: checkpoint 2, given 4") in caplog.text
    for k, v in straight.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[k], v, rtol=1e-6, atol=1e-7)
    for k, v in flatten_state(straight.client_states.tensors).items():
        torch.testing.assert_close(flatten_state(resumed.client_states.tensors)[k], v, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# the command line
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
  algorithm: {name: scaffold, local_lr: 0.05, local_steps: 2, batch_size: 8}
  clients_per_round: 3
  compile_clients: false
data:
  dataset: synthetic
  num_clients: 6
  eval_every: 2
plots: false
"""


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``fedmeta fit`` of SCAFFOLD for 2 rounds: its config and its last checkpoint (default log layout)."""
    root = tmp_path_factory.mktemp("cli")
    config = root / "scaffold.yaml"
    config.write_text(CLI_CONFIG)
    run(["fit", "--config", str(config), "--trainer.default_root_dir", str(root / "logs")])
    return config, root / "logs" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--model.algorithm.name", "fedavg"], ["model.algorithm.name: checkpoint 'scaffold', given 'fedavg'"]),
        (["--data.num_clients", "8", "--model.seed", "1"], ["model.seed: checkpoint 0, given 1",
                                                            "data.num_clients: checkpoint 6, given 8"]),
        (["--model.algorithm.local_steps", "3"], ["model.algorithm.local_steps: checkpoint 2, given 3"]),
    ],
    ids=["algorithm", "data-and-seed", "hyper-parameter"],
)
def test_the_cli_refuses_a_resume_with_other_settings(cli_run: tuple[Path, Path], tmp_path: Path,
                                                      extra: list[str], expected: list[str]) -> None:
    """LightningCLI would silently replace the given model arguments by the checkpoint's (continuing SCAFFOLD
    under --model.algorithm.name fedavg), and take another num_clients into a crash or mismatched state."""
    config, ckpt = cli_run
    with pytest.raises(FedMetaConfigError) as info:
        run(["fit", "--config", str(config), "--ckpt_path", str(ckpt), "--trainer.default_root_dir", str(tmp_path),
             "--trainer.max_steps", "3", *extra])
    listed = [line.strip() for line in str(info.value).splitlines() if line.startswith("  ")]
    assert listed == expected
    assert not list(tmp_path.rglob("*.ckpt"))  # refused before anything ran


def test_the_cli_resumes_with_changeable_settings_and_takes_the_rest_from_the_checkpoint(
    cli_run: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config, ckpt = cli_run
    with caplog.at_level(logging.INFO):
        cli = run(["fit", "--config", str(config), "--ckpt_path", str(ckpt), "--trainer.default_root_dir",
                   str(tmp_path / "a"), "--trainer.max_steps", "3", "--model.client_chunk_size", "2"])
    assert cli.trainer.global_step == 3
    assert "model.client_chunk_size: checkpoint 'auto', given 2" in caplog.text
    assert "trainer.max_steps: checkpoint 2, given 3" in caplog.text
    # no --config: every model and data setting comes from the checkpoint (and the run continues SCAFFOLD)
    with caplog.at_level(logging.INFO):
        cli = run(["fit", "--ckpt_path", str(ckpt), "--trainer.default_root_dir", str(tmp_path / "b"),
                   "--trainer.max_steps", "3", "--plots", "false", "--trainer.enable_progress_bar", "false"])
    assert cli.trainer.global_step == 3
    assert type(cli.model.algorithm).__name__ == "Scaffold" and cli.datamodule.num_clients == 6
    assert "settings not given, taken from the checkpoint: data.eval_every, data.num_clients, model.algorithm, " \
           "model.clients_per_round, model.compile_clients" in caplog.text


def test_ckpt_path_last_finds_the_last_checkpoint_of_an_earlier_process(tmp_path: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The default logger writes each run into a new version_N folder: ``last`` is looked up in the earlier
    ones (Lightning alone looks in the new one, finds nothing and starts from round 0)."""
    config = tmp_path / "scaffold.yaml"
    config.write_text(CLI_CONFIG)
    args = ["fit", "--config", str(config), "--trainer.default_root_dir", str(tmp_path / "logs")]
    with pytest.warns(UserWarning, match=r"--ckpt_path last: no last\*\.ckpt in .*; this run starts at round 0"):
        first = run([*args, "--ckpt_path", "last"])
    assert first.trainer.global_step == 2
    with caplog.at_level(logging.INFO):
        resumed = run([*args, "--ckpt_path", "last", "--trainer.max_steps", "3"])
    found = tmp_path / "logs" / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert f"--ckpt_path last: resuming from {found}" in caplog.text
    assert resumed.trainer.global_step == 3
    assert torch.load(tmp_path / "logs" / "lightning_logs" / "version_1" / "checkpoints" / "last.ckpt",
                      weights_only=True)["global_step"] == 3
