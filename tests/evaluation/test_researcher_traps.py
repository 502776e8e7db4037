"""Traps a researcher met on an ordinary day (issue 31): options that were silently ignored, a client's model that
could not be inspected after an evaluation, a metric the library's own message suggested that crashed, and a demo
whose numbers looked broken. Each test reproduces what the user did."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torchmetrics.classification import MultilabelAUROC, MultilabelAveragePrecision, MultilabelF1Score

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.data.lightning_adapter import LightningDataPartition
from tests.data.test_data_tasks import TinyWithTest
from tests.helpers import REPO, make_trainer, tiny_datamodule, tiny_linear


# ----------------------------------------------------------------------------------------------
# item 2: the data module's split options reach the partition of a user's LightningDataModule
# ----------------------------------------------------------------------------------------------
def _train_splits(**data: object) -> list[tuple[Tensor, Tensor]]:
    """Each client's ``(train_x, train_y)`` in ``FederatedDataModule(LightningDataPartition(dm), **data)``."""
    dm = FederatedDataModule(dataset=LightningDataPartition(TinyWithTest()), **data)  # type: ignore[arg-type]
    dm.setup("fit")
    assert dm.federated_data is not None
    return [dm.federated_data.client_train(k) for k in range(dm.federated_data.num_clients)]


def _same(a: list[tuple[Tensor, Tensor]], b: list[tuple[Tensor, Tensor]]) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) for x, y in zip(a, b, strict=True))


def test_data_seed_changes_a_lightning_datamodule_split_and_the_same_seed_repeats_it() -> None:
    seed0, seed1, again0 = (_train_splits(num_clients=4, data_seed=s) for s in (0, 1, 0))
    assert not _same(seed0, seed1), "--data.data_seed 0 and 1 must give different splits (three-seed recipe)"
    assert _same(seed0, again0)


def test_num_clients_partition_and_cap_of_the_data_module_reach_the_split() -> None:
    assert len(_train_splits(num_clients=5)) == 5
    shards = _train_splits(num_clients=3, partition="shards", classes_per_client=1)
    assert [y.unique().numel() for _, y in shards] == [1, 1, 1], "one label-sorted shard each: one class"
    skewed = _train_splits(num_clients=3, partition="dirichlet", dirichlet_alpha=0.05)
    assert not _same(skewed, _train_splits(num_clients=3, partition="dirichlet", dirichlet_alpha=100.0))
    assert [len(y) for _, y in _train_splits(num_clients=3, max_samples_per_client=7)] == [7, 7, 7]


@pytest.mark.parametrize(
    ("adapter", "data", "match"),
    [
        ({"num_clients": 20}, {}, r"LightningDataPartition\(num_clients=20\).*data.num_clients=30"),
        ({"seed": 4}, {"data_seed": 1}, r"LightningDataPartition\(seed=4\).*data_seed=1.*--data.data_seed"),
        ({"partition": "dirichlet"}, {"partition": "shards"}, r"partition='dirichlet'.*partition='shards'"),
        ({}, {"partition": "perfedavg_paper"}, r"data.partition must be one of \['iid', 'dirichlet', 'shards'\]"),
    ],
)
def test_a_split_option_given_in_two_places_or_inapplicable_is_refused_by_name(
    adapter: dict[str, object], data: dict[str, object], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        FederatedDataModule(dataset=LightningDataPartition(TinyWithTest(), **adapter), **data)  # type: ignore[arg-type]


def test_an_option_given_in_both_places_alike_is_accepted() -> None:
    dm = FederatedDataModule(  # type: ignore[arg-type]
        dataset=LightningDataPartition(TinyWithTest(), num_clients=4, seed=2), num_clients=4, data_seed=2,
    )
    dm.setup("fit")
    assert dm.federated_data is not None and dm.federated_data.num_clients == 4


# ----------------------------------------------------------------------------------------------
# item 4: a multi-label torchmetrics metric gets its targets in the dtype it needs
# ----------------------------------------------------------------------------------------------
def _multilabel_clients() -> list[tuple[Tensor, ...]]:
    """Six clients, 4 features, 3 labels from client-shifted linear scores (float 0/1 targets, as BCE needs)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=g)
    out = []
    for i, n in enumerate((20, 30, 25, 40, 22, 35)):
        x = torch.randn(n + 16, 4, generator=g) + 0.3 * (i % 3)
        y = (x @ w + 0.3 * torch.randn(n + 16, 3, generator=g) > 0).float()
        out.append((x[:n], y[:n], x[n:], y[n:]))
    return out


class _MultilabelClients:
    num_classes, task = 3, "multilabel"

    def client_data(self) -> list[tuple[Tensor, ...]]:
        return _multilabel_clients()


def test_multilabel_auroc_with_thresholds_and_average_precision_work_in_a_short_fit() -> None:
    metrics = {"auroc": MultilabelAUROC(num_labels=3, thresholds=100),
               "ap": MultilabelAveragePrecision(num_labels=3, thresholds=100), "f1": MultilabelF1Score(num_labels=3)}
    module = FederatedModule(nn.Linear(4, 3), {"name": "fedavg", "local_steps": 3, "local_lr": 0.3},
                             clients_per_round=3, metrics=metrics)
    make_trainer(4).fit(module, FederatedDataModule(dataset=_MultilabelClients(), eval_every=2))  # type: ignore[arg-type]
    for i in range(6):
        x, y = module.data.client_test(i)
        with torch.no_grad():
            z = module.personalize(i)(x)
        for key, metric in metrics.items():
            direct = type(metric)(num_labels=3, **({"thresholds": 100} if key != "f1" else {}))(z, y.long())
            assert float(module.last_per_client[key][i]) == pytest.approx(float(direct), abs=1e-6), (key, i)
    assert 0.5 < float(module.last_summary["clients"]["auroc_weighted"]) <= 1.0


# ----------------------------------------------------------------------------------------------
# item 3: a client's model can be inspected after trainer.validate (no buffer of the inference mode is reused)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "algorithm",
    [{"name": "ditto"}, {"name": "mtl_mean"}, {"name": "mtl_pairwise"}, {"name": "mtl_graph", "knn": 2},
     {"name": "mocha", "local_iters": 5}],
    ids=lambda a: a["name"],
)
def test_personalize_after_trainer_validate_for_training_and_held_out_clients(algorithm: dict[str, object]) -> None:
    module = FederatedModule(tiny_linear(), algorithm=algorithm, clients_per_round=3, holdout_clients=2)
    dm, trainer = tiny_datamodule(), make_trainer(2)
    trainer.fit(module, dm)
    trainer.validate(module, dm, verbose=False)  # under inference mode, as Lightning validates by default
    held_out = int(module.holdout.nonzero()[0, 0])
    for client in (int(module.eligible.nonzero()[0, 0]), held_out):
        x, y = module.data.client_test(client)
        with torch.no_grad():
            logits = module.personalize(client)(x)
        assert logits.shape == (len(y), 3) and bool(torch.isfinite(logits).all())


# ----------------------------------------------------------------------------------------------
# item 12: the regression demo's per-client R² means something
# ----------------------------------------------------------------------------------------------
def test_the_regression_demo_config_gives_a_positive_per_client_r2(tmp_path: Path) -> None:
    from lightning_fedmeta.cli import run

    cli = run(["fit", "--config", str(REPO / "configs" / "tasks" / "regression.yaml"), "--trainer.max_steps", "40",
               "--model.compile_clients", "false", "--trainer.default_root_dir", str(tmp_path),
               "--trainer.enable_progress_bar", "false", "--trainer.logger", "false",
               "--trainer.enable_checkpointing", "false"])
    clients = cli.model.last_summary["clients"]  # type: ignore[attr-defined]
    assert float(clients["r2_weighted"]) > 0.2 and float(clients["r2_mean"]) > 0.1, clients


def test_split_options_a_users_own_clients_cannot_follow_are_named_as_ignored() -> None:
    """A FederatedDataset brings its own clients: --data.num_clients, --data.partition and --data.data_seed cannot
    change them, and a user who sets them is told so instead of getting a silently identical split."""
    import warnings

    from lightning_fedmeta.data import FederatedDataModule
    from tests.helpers import TinyDataset

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FederatedDataModule(dataset=TinyDataset(6))
        assert not [w for w in caught if "do not apply" in str(w.message)]
        FederatedDataModule(dataset=TinyDataset(6), num_clients=12, partition="shards", data_seed=3)
    messages = [str(w.message) for w in caught if "do not apply" in str(w.message)]
    assert messages == ["data.num_clients=12, data.partition='shards', data.data_seed=3 do not apply to TinyDataset: "
                        "it brings its own clients (FederatedDataset.client_data), so these options are ignored"]
