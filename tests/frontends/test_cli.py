"""The ``fedmeta`` command, run in-process through :func:`lightning_fedmeta.cli.run`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from lightning_fedmeta.cli import main, run
from tests.helpers import REPO

QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
QUIET = ["--plots", "false", "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    root = tmp_path_factory.mktemp("cli_fit")
    cli = run(["fit", "--config", QUICKSTART, "--trainer.max_steps", "4", "--trainer.default_root_dir", str(root),
               *QUIET])
    return root, cli


def test_fit_with_the_quickstart_config_completes_and_writes_a_checkpoint(fitted: tuple[Path, object]) -> None:
    root, cli = fitted
    assert cli.trainer.global_step == 4  # type: ignore[attr-defined]
    assert cli.model.algorithm.name == "fedavg"  # type: ignore[attr-defined]
    ckpts = sorted(root.rglob("*.ckpt"))
    assert [p.name for p in ckpts] == ["epoch=0-step=4.ckpt", "last.ckpt"]  # last.ckpt for --ckpt_path last
    saved = torch.load(ckpts[0], weights_only=True)
    assert saved["global_step"] == 4
    assert saved["hyper_parameters"]["algorithm"]["name"] == "fedavg"
    assert list(root.rglob("config.yaml")), "LightningCLI saves the resolved config next to the logs"


def test_test_subcommand_evaluates_a_checkpoint_from_fit(fitted: tuple[Path, object], tmp_path: Path) -> None:
    root, fit_cli = fitted
    ckpt = next(root.rglob("*.ckpt"))
    cli = run(["test", "--config", QUICKSTART, "--ckpt_path", str(ckpt), "--trainer.default_root_dir",
               str(tmp_path), *QUIET])
    metrics = cli.trainer.callback_metrics  # type: ignore[attr-defined]
    assert 0.0 <= float(metrics["test/acc_weighted"]) <= 1.0
    assert float(metrics["test/acc_worst10"]) <= float(metrics["test/acc_mean"]) + 1e-6
    # the tested model is the checkpoint's, not a fresh initialisation
    for k, v in fit_cli.model.model.state_dict().items():  # type: ignore[attr-defined]
        assert torch.equal(cli.model.model.state_dict()[k], v), k  # type: ignore[attr-defined]


def test_print_config_prints_yaml_with_the_algorithm(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        run(["fit", "--config", QUICKSTART, "--print_config"])
    assert info.value.code in (0, None)
    printed = capsys.readouterr().out
    config = yaml.safe_load(printed)
    assert config["model"]["algorithm"]["name"] == "fedavg"
    assert config["model"]["algorithm"]["local_lr"] == 0.05
    assert config["trainer"]["max_steps"] == 100


def test_algorithm_and_hyper_parameter_override_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run(["fit", "--config", QUICKSTART, "--model.algorithm", '{"name": "scaffold", "local_lr": 0.1}',
             "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)
    algorithm = config["model"]["algorithm"]  # every hyper-parameter, the given ones as given
    assert algorithm["name"] == "scaffold" and algorithm["local_lr"] == 0.1 and algorithm["local_steps"] == 10


def test_algorithms_command_lists_builtins_with_their_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["algorithms"]) is None
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["algorithm", "distribution"]
    rows = {line.split()[0]: line.split()[1] for line in lines[1:] if line.strip()}
    for name in ("fedavg", "fedprox", "scaffold"):
        assert rows[name] == "lightning-fedmeta", lines


def test_unknown_algorithm_in_the_config_fails_before_training(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown algorithm 'fedavgx'; available: .*fedavg"):
        run(["fit", "--config", QUICKSTART, "--model.algorithm", '{"name": "fedavgx"}',
             "--trainer.default_root_dir", str(tmp_path), *QUIET])
    assert not list(tmp_path.rglob("*.ckpt"))


def test_unknown_algorithm_from_the_console_script_prints_the_message_alone_with_a_suggestion(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["fit", "--config", QUICKSTART, "--model.algorithm", '{"name": "fedavgx"}',
              "--trainer.default_root_dir", str(tmp_path), *QUIET])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("fedmeta: error: unknown algorithm 'fedavgx'; available: "), err
    assert "did you mean 'fedavg'?" in lines[-1], err
    assert not list(tmp_path.rglob("*.ckpt"))


def test_an_unknown_algorithm_name_suggests_the_closest_registered_names() -> None:
    from lightning_fedmeta.registry import create_algorithm

    with pytest.raises(ValueError, match=r"unknown algorithm 'scafold'; available: .*did you mean 'scaffold'\?"):
        create_algorithm("scafold")
    with pytest.raises(ValueError) as info:
        create_algorithm("qqqqqqqq")
    assert "did you mean" not in str(info.value)


@pytest.mark.parametrize("subcommand", ["test", "validate"])
def test_evaluating_without_a_checkpoint_is_refused_with_how_to_pass_one(
    subcommand: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [subcommand, "--config", QUICKSTART, "--trainer.default_root_dir", str(tmp_path), *QUIET]
    with pytest.raises(ValueError, match=rf"fedmeta {subcommand} needs a trained model: .*--ckpt_path "):
        run(args)
    with pytest.raises(SystemExit) as info:  # the console script: one message, exit status 2
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--ckpt_path" in err and "--untrained true" in err
    assert not list(tmp_path.rglob("*")), "nothing may be evaluated or written"


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--model.local_steps_dist", "[1, 2, 3]", "model.local_steps_dist as a list needs one budget per client: 30"),
    ("--model.clients_per_round", "31", "clients_per_round=31 exceeds the 30 training clients"),
    ("--model.aggregator", "{name: krum, f: 5}", "krum"),
])
def test_options_that_do_not_fit_the_data_are_refused_at_setup_with_the_message_alone(
    option: str, value: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in setup (they need the data), before round 1: exit status 2, no traceback."""
    args = ["fit", "--config", QUICKSTART, option, value, "--trainer.default_root_dir", str(tmp_path), *QUIET]
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err


@pytest.mark.parametrize("keyword", ["last", "best"])
def test_checkpoint_keywords_of_an_earlier_fit_are_refused_by_a_fresh_test(keyword: str, tmp_path: Path) -> None:
    # Lightning resolves them from the same Trainer's fit: in a new process "last" loads nothing
    # (a warning, then the untrained model is scored) and "best" fails after building everything
    with pytest.raises(ValueError, match=rf"--ckpt_path {keyword} names a checkpoint of a fit run by the same"):
        run(["test", "--config", QUICKSTART, "--ckpt_path", keyword, "--trainer.default_root_dir", str(tmp_path),
             *QUIET])
    assert not list(tmp_path.rglob("*"))


def test_untrained_flag_evaluates_the_initial_model_at_round_0(tmp_path: Path) -> None:
    cli = run(["test", "--config", QUICKSTART, "--untrained", "true", "--trainer.default_root_dir", str(tmp_path),
               *QUIET])
    assert cli.model.trained_rounds() == 0  # type: ignore[attr-defined]
    assert 0.0 <= float(cli.trainer.callback_metrics["test/acc_weighted"]) <= 1.0  # type: ignore[attr-defined]
