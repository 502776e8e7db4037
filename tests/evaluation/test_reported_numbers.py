"""The numbers a run reports are those of the rounds they are labelled with.

* A fit ends with an evaluation of the final model, also when ``max_steps`` is not a multiple of
  ``eval_every`` (the last epoch is shortened), so the final table, ``last_summary`` and the history's
  last entry are the final round's.
* The evaluation schedule depends on the round alone (multiples of ``eval_every``, plus the final
  round): a run resumed from a checkpoint taken between two evaluations evaluates at the same rounds,
  with the same numbers, as the uninterrupted run.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.cli import run
from lightning_fedmeta.data import datamodule as dm_module
from lightning_fedmeta.frontends.callbacks import HISTORY_FILE, PlotCallback, read_history
from tests.helpers import REPO, make_trainer, tiny_datamodule, tiny_module

QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
# a cheaper quick start: same data and algorithm, fewer local steps and clients per round
CHEAP = ["--model.algorithm.local_steps", "2", "--model.clients_per_round", "5"]
METRICS = ("acc_weighted", "acc_mean", "acc_worst10", "loss_weighted")


# ----------------------------------------------------------------------------------------------
# the schedule as a function of the round
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("done", "max_steps", "expected"),
    [(0, 25, 10), (10, 25, 10), (20, 25, 5), (15, 30, 5), (15, 100, 5), (0, 4, 4), (7, -1, 3), (25, 25, 0)],
)
def test_rounds_until_evaluation_stops_at_the_next_multiple_or_at_max_steps(
    done: int, max_steps: int, expected: int
) -> None:
    assert dm_module.rounds_until_evaluation(done, 10, max_steps) == expected


def test_the_training_loader_of_a_resumed_trainer_runs_to_the_next_multiple_of_eval_every() -> None:
    class _Trainer:  # what the datamodule reads of the trainer
        global_step, max_steps = 15, 30

    dm = dm_module.FederatedDataModule(eval_every=10)
    assert [int(t) for t in dm.train_dataloader()] == list(range(10))  # no trainer: a whole epoch
    dm.trainer = _Trainer()  # type: ignore[assignment]
    assert [int(t) for t in dm.train_dataloader()] == [5, 6, 7, 8, 9]  # rounds 15-19: up to the evaluation at 20


# ----------------------------------------------------------------------------------------------
# defect 1: the final table must be the final round's
# ----------------------------------------------------------------------------------------------
def _table(text: str) -> tuple[int, list[float]]:
    """The round and the ``clients`` row of the last summary table printed."""
    rounds = re.findall(r"Personalized evaluation after round (\d+)", text)
    rows = re.findall(r"^clients((?:\s+[0-9.]+)+)\s*$", text, flags=re.M)
    assert rounds and rows, text[-3000:]
    return int(rounds[-1]), [float(v) for v in rows[-1].split()]


def test_a_fit_ends_with_an_evaluation_of_the_final_round(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)  # the table is logged by rank_zero_info
    root = tmp_path / "fit"
    cli = run(["fit", "--config", QUICKSTART, "--trainer.max_steps", "25", "--data.eval_every", "10", *CHEAP,
               "--trainer.default_root_dir", str(root), *QUIET])
    assert cli.trainer.global_step == 25  # type: ignore[attr-defined]
    printed_round, printed = _table(caplog.text)
    caplog.clear()

    doc = read_history(next(root.rglob(HISTORY_FILE)))
    assert [(h["round"], h["stage"]) for h in doc["history"]] == [(10, "val"), (20, "val"), (25, "val")]
    assert doc["per_client_round"] == 25
    final = doc["history"][-1]["metrics"]
    summary = cli.model.last_summary["clients"]  # type: ignore[attr-defined]
    for name in METRICS:
        assert final[f"val/{name}"] == pytest.approx(float(summary[name]), abs=1e-7), name
    assert printed_round == 25
    table = ("acc_weighted", "acc_mean", "acc_worst10", "loss_weighted", "loss_mean", "loss_worst10")
    assert printed == pytest.approx([final[f"val/{n}"] for n in table], abs=5e-5)
    assert doc["per_client_accuracy"] == pytest.approx(
        cli.model.last_per_client_accuracy.tolist()  # type: ignore[attr-defined]
    )

    # an independent evaluation of the final weights: `fedmeta test` on the last checkpoint
    ckpt = max(root.rglob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    assert torch.load(ckpt, weights_only=True)["global_step"] == 25
    tested = run(["test", "--config", QUICKSTART, "--data.eval_every", "10", *CHEAP, "--ckpt_path", str(ckpt),
                  "--trainer.default_root_dir", str(tmp_path / "test"), "--plots", "false", *QUIET])
    test_round, test_printed = _table(caplog.text)
    assert test_round == 25
    logged = tested.trainer.callback_metrics  # type: ignore[attr-defined]
    for name in METRICS:
        assert float(logged[f"test/{name}"]) == pytest.approx(final[f"val/{name}"], abs=1e-6), name
    assert test_printed == printed


# ----------------------------------------------------------------------------------------------
# defect 2: resuming between two evaluations keeps the schedule and the numbers
# ----------------------------------------------------------------------------------------------
FEDAVG = {"name": "fedavg", "local_lr": 0.2, "local_steps": 2, "batch_size": 4, "finetune_steps": 1}


def _module(init_seed: int = 0) -> FederatedModule:
    return tiny_module(FEDAVG, init_seed=init_seed, seed=1)


def _rounds(history: list[dict]) -> list[int]:
    return [h["round"] for h in history if h["stage"] == "val"]


@pytest.mark.parametrize("interrupt_at", [15, 20], ids=["between-evaluations", "at-an-evaluation"])
def test_a_run_resumed_between_evaluations_evaluates_at_the_same_rounds(tmp_path: Path, interrupt_at: int) -> None:
    straight_plots = PlotCallback(tmp_path / "straight")
    straight = _module()
    make_trainer(30, callbacks=[straight_plots]).fit(straight, tiny_datamodule(eval_every=10))
    assert _rounds(straight_plots.history) == [10, 20, 30]

    # a run meant to go to 30 rounds, killed after round `interrupt_at` (checkpoints every 5 rounds)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    make_trainer(interrupt_at + 2, enable_checkpointing=True, callbacks=[ckpt, PlotCallback(tmp_path / "first")]).fit(
        _module(), tiny_datamodule(eval_every=10)
    )
    path = next((tmp_path / "ckpt").glob(f"*step={interrupt_at}.ckpt"))

    resumed_plots = PlotCallback(tmp_path / "resumed")
    resumed = _module(init_seed=7)
    trainer = make_trainer(30, callbacks=[resumed_plots])
    trainer.fit(resumed, tiny_datamodule(eval_every=10), ckpt_path=str(path))
    assert trainer.global_step == 30
    for k, v in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[k], v), k

    # same evaluation rounds (the history before the interruption comes from the checkpoint) ...
    rounds = set(_rounds(resumed_plots.history))
    if interrupt_at == 15:
        assert sorted(rounds) == [10, 20, 30]
    else:
        # a checkpoint written at the end of round 20 precedes round 20's validation, and Lightning
        # does not repeat that validation on resume (docs/faq.md); every later evaluation is kept
        assert {10, 30} <= rounds <= {10, 20, 30}, rounds
    # ... with exactly the same numbers
    by_round = {h["round"]: h["metrics"] for h in straight_plots.history}
    for h in resumed_plots.history:
        assert h["metrics"] == by_round[h["round"]], h["round"]
    for name, v in straight.last_summary["clients"].items():
        assert torch.equal(resumed.last_summary["clients"][name], v), name
    assert torch.equal(resumed.last_per_client_accuracy, straight.last_per_client_accuracy)
