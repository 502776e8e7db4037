"""lightning_fedmeta inside an ordinary Lightning project: user models and data, stock callbacks and loggers.

Every test is a small run (a handful of clients, a few rounds) on synthetic data.
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import (
    Callback,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    RichProgressBar,
)
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch import nn

from lightning_fedmeta import FederatedData, FederatedDataset, FederatedModule, from_client_tensors
from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.frontends.callbacks import PlotCallback, RoundProgressBar
from tests.helpers import make_trainer

NUM_CLASSES = 4


class SmallUserCNN(nn.Module):
    """A user's own network: conv, LayerNorm, dropout, linear head on ``[1, 8, 8]`` images."""

    def __init__(self, p_dropout: float = 0.25) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.LayerNorm([4, 8, 8])
        self.drop = nn.Dropout(p_dropout)
        self.head = nn.Linear(4 * 8 * 8, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(torch.relu(self.norm(self.conv(x)))).flatten(1))


class BatchNormCNN(nn.Module):
    """A network with BatchNorm (running statistics tracked unless ``track_running_stats=False``)."""

    def __init__(self, track_running_stats: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4, track_running_stats=track_running_stats)
        self.head = nn.Linear(4 * 8 * 8, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


class UserImageClients:
    """A user's federated data object following the ``FederatedDataset`` protocol.

    Client ``i`` sees images whose class ``c`` is a bright quadrant pattern plus noise; clients
    differ in their label mix. The tensors are held as a ``FederatedData`` built with
    ``from_client_tensors`` and handed out per client by ``client_data()``.
    """

    num_classes = NUM_CLASSES

    def __init__(self, num_clients: int = 6, train: int = 24, test: int = 12, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        patterns = torch.zeros(NUM_CLASSES, 1, 8, 8)
        for c in range(NUM_CLASSES):
            r, q = divmod(c, 2)
            patterns[c, 0, 4 * r : 4 * r + 4, 4 * q : 4 * q + 4] = 0.6
        clients = []
        for i in range(num_clients):
            probs = torch.full((NUM_CLASSES,), 0.1)
            probs[i % NUM_CLASSES] = 1.0
            y = torch.multinomial(probs, train + test, replacement=True, generator=g)
            x = patterns[y] + torch.randn(train + test, 1, 8, 8, generator=g)
            clients.append((x[:train], y[:train], x[train:], y[train:]))
        self.data: FederatedData = from_client_tensors(clients, NUM_CLASSES, [f"site{i}" for i in range(num_clients)])
        self.client_names = self.data.client_names

    def client_data(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        return [(*self.data.client_train(i), *self.data.client_test(i)) for i in range(self.data.num_clients)]


def _trainer(tmp_path: Path, max_steps: int, **kwargs: object) -> L.Trainer:
    return make_trainer(max_steps, default_root_dir=str(tmp_path), **kwargs)


def _synthetic_dm(eval_every: int = 2, seed: int = 0) -> FederatedDataModule:
    # seed equals FederatedModule's default seed: with a logger, Lightning merges both hparams and
    # rejects a shared key with different values (see test_logger_accepts_different_module_and_data_seeds)
    return FederatedDataModule(dataset="synthetic", num_clients=8, eval_every=eval_every, data_seed=seed)


def _fedavg(**kwargs: object) -> FederatedModule:
    args: dict[str, object] = {
        "algorithm": {"name": "fedavg", "local_lr": 0.05, "local_steps": 3}, "clients_per_round": 3,
    }
    args.update(kwargs)
    return FederatedModule(**args)  # type: ignore[arg-type]


@pytest.fixture
def info_log() -> Iterator[list[str]]:
    """Messages of ``rank_zero_info`` (Lightning's loggers do not propagate to pytest's caplog)."""
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = _Keep(level=logging.INFO)
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch.utilities.rank_zero",
                                              "lightning.fabric.utilities.rank_zero")]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    yield records
    for lg, level in zip(loggers, old, strict=True):
        lg.removeHandler(handler)
        lg.setLevel(level)


# ------------------------------------------------------------------------------------------------
# user models and user data
# ------------------------------------------------------------------------------------------------
def test_user_dataset_object_satisfies_protocol() -> None:
    assert isinstance(UserImageClients(), FederatedDataset)


def test_user_cnn_with_dropout_on_user_dataset_runs_looped_and_says_why(
    tmp_path: Path, info_log: list[str]
) -> None:
    L.seed_everything(0)
    dm = FederatedDataModule(dataset=UserImageClients(), eval_every=2)
    module = _fedavg(model=SmallUserCNN(), algorithm={"name": "fedavg", "local_lr": 0.1, "local_steps": 3})
    _trainer(tmp_path, 4).fit(module, dm)
    assert module.batching == "loop"
    assert any("dropout drawn per client (drop)" in m and "running clients looped" in m for m in info_log)
    assert module.data is not None and module.data.client_names[0] == "site0"
    acc = float(module.last_summary["clients"]["acc_weighted"])
    assert 0.0 <= acc <= 1.0


def test_batchnorm_with_running_stats_keeps_them_per_client_and_trains_batched(
    tmp_path: Path, info_log: list[str]
) -> None:
    dm = FederatedDataModule(dataset=UserImageClients(), eval_every=2)
    model = BatchNormCNN()
    module = _fedavg(model=model)
    _trainer(tmp_path, 2).fit(module, dm)
    assert module.batching == "vmap"
    assert model.bn.track_running_stats and model.bn.running_mean is not None
    assert module.stat_names == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    assert any("BatchNorm running statistics" in m and "kept per client" in m for m in info_log)
    assert torch.isfinite(module.last_summary["clients"]["loss_weighted"])


def test_batchnorm_with_batch_statistics_only_runs_batched(tmp_path: Path) -> None:
    """The documented workaround: BatchNorm without running statistics is pure and vmap-able."""
    model = BatchNormCNN()
    torch.func.replace_all_batch_norm_modules_(model)
    dm = FederatedDataModule(dataset=UserImageClients(), eval_every=2)
    module = _fedavg(model=model)
    _trainer(tmp_path, 2).fit(module, dm)
    assert module.batching == "vmap"
    assert torch.isfinite(module.last_summary["clients"]["loss_weighted"])


# ------------------------------------------------------------------------------------------------
# stock callbacks
# ------------------------------------------------------------------------------------------------
class _PerClientByRound(Callback):
    """Keeps each evaluation's per-client accuracy, keyed by round."""

    def __init__(self) -> None:
        self.acc: dict[int, torch.Tensor] = {}

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.acc[int(trainer.global_step)] = pl_module.last_per_client_accuracy.clone()  # type: ignore[union-attr]


def test_model_checkpoint_on_personalised_metric_reloads_and_personalizes_to_same_accuracy(tmp_path: Path) -> None:
    L.seed_everything(3)
    dm = FederatedDataModule(dataset=UserImageClients(), eval_every=2)
    algo = {"name": "fedavg", "local_lr": 0.1, "local_steps": 3, "finetune_steps": 2, "finetune_batch_size": 8}
    module = _fedavg(model=SmallUserCNN(), algorithm=algo)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/acc_weighted", mode="max", save_top_k=1)
    per_round = _PerClientByRound()
    _trainer(tmp_path, 4, enable_checkpointing=True, callbacks=[ckpt, per_round]).fit(module, dm)
    assert ckpt.best_model_path, "ModelCheckpoint saved nothing for monitor='val/acc_weighted'"

    # Lightning does not save nn.Module arguments in hparams: the user passes the architecture again
    loaded = FederatedModule.load_from_checkpoint(ckpt.best_model_path, model=SmallUserCNN())
    loaded.attach_data(dm.federated_data)  # type: ignore[arg-type]
    round_idx = int(torch.load(ckpt.best_model_path, weights_only=False)["global_step"])
    client = 1
    personal = loaded.personalize(client, round_idx=round_idx)
    assert isinstance(personal, nn.Module)
    x, y = dm.federated_data.client_test(client)  # type: ignore[union-attr]
    with torch.no_grad():
        acc = (personal(x).argmax(-1) == y).float().mean().item()
    reported = per_round.acc[round_idx]
    assert 0.0 < float(reported.min()) < 1.0 or 0.0 < float(reported.max()) < 1.0, "too easy a task to compare"
    assert acc == pytest.approx(float(reported[client]), abs=1e-6)


def test_early_stopping_on_worst_decile_stops_before_max_steps(tmp_path: Path) -> None:
    stop = EarlyStopping(monitor="val/acc_worst10", mode="max", patience=1, min_delta=1.0)
    trainer = _trainer(tmp_path, 40, callbacks=[stop])
    trainer.fit(_fedavg(), _synthetic_dm(eval_every=2))
    assert trainer.global_step == 4  # first evaluation sets the best; the second cannot beat it by 1.0
    assert stop.stopped_epoch == 1


def test_lr_monitor_and_csv_logger_record_every_round_and_the_step_lr_schedule(tmp_path: Path) -> None:
    module = _fedavg(server_lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 5))
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = _trainer(tmp_path, 8, logger=logger, log_every_n_steps=1,
                       callbacks=[LearningRateMonitor(logging_interval="step")])
    trainer.fit(module, _synthetic_dm(eval_every=4))
    with open(Path(logger.log_dir) / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    losses = {int(r["step"]) for r in rows if r.get("train/loss")}
    assert losses == set(range(8)), "train/loss must be logged once per round"
    lrs = {int(r["step"]): float(r["lr-SGD"]) for r in rows if r.get("lr-SGD")}
    assert lrs[0] == pytest.approx(1.0) and lrs[4] == pytest.approx(1.0)
    assert lrs[5] == pytest.approx(0.1) and lrs[7] == pytest.approx(0.1)
    assert sum(1 for r in rows if r.get("val/acc_weighted")) == 2


def test_logger_accepts_different_module_and_data_seeds(tmp_path: Path) -> None:
    logger = CSVLogger(str(tmp_path), name="seeds")
    _trainer(tmp_path, 1, logger=logger).fit(_fedavg(seed=0), _synthetic_dm(eval_every=1, seed=1))


def test_tensorboard_logger_writes_per_round_and_personalised_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(str(tmp_path), name="tb")
    _trainer(tmp_path, 4, logger=logger, log_every_n_steps=1).fit(_fedavg(), _synthetic_dm(eval_every=2))
    events = EventAccumulator(logger.log_dir)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "clients", "val/acc_weighted", "val/acc_worst10"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [0, 1, 2, 3]
    assert len(events.Scalars("val/acc_weighted")) == 2


# ------------------------------------------------------------------------------------------------
# progress bars, seeding, fast_dev_run
# ------------------------------------------------------------------------------------------------
def test_rich_progress_bar_runs_a_federated_fit(tmp_path: Path) -> None:
    """A Rich bar of the user's own class runs a federated fit; Lightning's own RichProgressBar (which a plain Trainer
    makes when rich is installed, and which counts epochs: "Epoch 3/-2") is replaced by RoundProgressBar."""

    class MyRichBar(RichProgressBar):
        pass

    trainer = _trainer(tmp_path, 3, enable_progress_bar=True, callbacks=[MyRichBar()])
    trainer.fit(_fedavg(), _synthetic_dm(eval_every=3))
    assert trainer.global_step == 3
    assert isinstance(trainer.progress_bar_callback, MyRichBar)
    plain = _trainer(tmp_path, 3, enable_progress_bar=True, callbacks=[RichProgressBar()])
    plain.fit(_fedavg(), _synthetic_dm(eval_every=3))
    assert type(plain.progress_bar_callback) is RoundProgressBar


def test_round_progress_bar_counts_rounds_over_the_whole_run(tmp_path: Path) -> None:
    bar = RoundProgressBar(plain=False)  # the bar itself (plain=None draws none where stdout is not a terminal)
    trainer = _trainer(tmp_path, 6, enable_progress_bar=True, callbacks=[bar])
    module = _fedavg()
    trainer.fit(module, _synthetic_dm(eval_every=2))  # 3 epochs of 2 rounds
    tqdm_bar = bar.train_progress_bar
    assert tqdm_bar.total == 6 and tqdm_bar.n == 6
    assert tqdm_bar.desc.startswith("Rounds")
    shown = bar.get_metrics(trainer, module)
    assert shown["round"] == 6 and shown["clients"] == 3
    assert "loss" in shown and "train/loss" not in shown and "v_num" not in shown


def test_seed_everything_makes_a_dropout_run_repeatable(tmp_path: Path) -> None:
    def final_params() -> dict[str, torch.Tensor]:
        L.seed_everything(11)
        module = _fedavg(model=SmallUserCNN())
        _trainer(tmp_path, 2).fit(module, FederatedDataModule(dataset=UserImageClients(), eval_every=2))
        return {k: v.detach().clone() for k, v in module.model.state_dict().items()}  # type: ignore[union-attr]

    a, b = final_params(), final_params()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_fast_dev_run_runs_one_round_and_writes_no_plots(tmp_path: Path) -> None:
    trainer = L.Trainer(fast_dev_run=True, default_root_dir=str(tmp_path), callbacks=[PlotCallback()],
                        enable_progress_bar=False, enable_model_summary=False)
    module = _fedavg()
    trainer.fit(module, _synthetic_dm(eval_every=5))
    assert trainer.global_step == 1
    assert module.last_summary  # the evaluation step ran
    assert not list(tmp_path.rglob("*.png"))
