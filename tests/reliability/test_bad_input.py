"""Bad input gets a clear error before round 1, and divergence stops the run without corrupting checkpoints."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn

from lightning_fedmeta import FederatedModule, create_algorithm
from lightning_fedmeta.client.sampling import sample_clients
from lightning_fedmeta.data import FederatedDataModule
from tests.helpers import TinyDataset, make_tiny_clients, make_trainer, tiny_data, tiny_datamodule, tiny_linear


def _written(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def _fit_expecting(error: type[Exception], match: str, tmp_path: Path, module: FederatedModule,
                   datamodule: FederatedDataModule) -> None:
    trainer = make_trainer(3, default_root_dir=str(tmp_path), enable_checkpointing=True)
    with pytest.raises(error, match=match):
        trainer.fit(module, datamodule)
    assert trainer.global_step == 0, "a round ran before the error"
    assert _written(tmp_path) == [], "something was written before the error"


# ----------------------------------------------------------------------------------------------
# names
# ----------------------------------------------------------------------------------------------
def test_unknown_algorithm_name_lists_the_available_ones() -> None:
    with pytest.raises(ValueError, match="unknown algorithm 'fedavgg'") as info:
        FederatedModule(model=tiny_linear(), algorithm="fedavgg")
    for name in ("fedavg", "fedprox", "scaffold"):
        assert name in str(info.value)
    with pytest.raises(ValueError, match="available: .*fedavg"):
        FederatedModule(model=tiny_linear(), algorithm={"name": "nope", "local_lr": 0.1})


def test_algorithm_mapping_without_name_is_rejected() -> None:
    with pytest.raises(ValueError, match="needs a 'name' key"):
        FederatedModule(model=tiny_linear(), algorithm={"local_lr": 0.1})


def test_unknown_dataset_name_lists_the_available_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown dataset 'imagenet'.*synthetic"):
        FederatedDataModule(dataset="imagenet")


# ----------------------------------------------------------------------------------------------
# impossible numbers
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("clients_per_round", [0, -2])
def test_non_positive_clients_per_round_is_rejected(clients_per_round: int) -> None:
    with pytest.raises(ValueError, match=rf"clients_per_round must be an integer >= 1.*got {clients_per_round}"):
        FederatedModule(model=tiny_linear(), clients_per_round=clients_per_round)


def test_more_clients_per_round_than_clients_fails_before_round_one(tmp_path: Path) -> None:
    module = FederatedModule(model=tiny_linear(), clients_per_round=7)
    _fit_expecting(ValueError, "clients_per_round=7 exceeds the 6 training clients", tmp_path, module,
                   tiny_datamodule())


def test_more_clients_per_round_than_non_held_out_clients_is_rejected(tmp_path: Path) -> None:
    module = FederatedModule(model=tiny_linear(), clients_per_round=5, holdout_clients=2)
    _fit_expecting(ValueError, r"exceeds the 4 training clients \(6 clients, 2 held out\)", tmp_path, module,
                   tiny_datamodule())


@pytest.mark.parametrize("fraction", [0.0, 1.5, -0.1])
def test_fraction_outside_zero_one_is_rejected(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\]"):
        FederatedModule(model=tiny_linear(), fraction=fraction)


@pytest.mark.parametrize(
    ("name", "hparams", "message"),
    [
        ("fedavg", {"local_lr": -0.1}, "local_lr must be >= 0, got -0.1"),
        ("fedavg", {"finetune_lr": -1.0}, "finetune_lr must be >= 0, got -1.0"),
        ("fedavg", {"local_steps": 0}, "local_steps must be an integer >= 1, got 0"),
        ("fedavg", {"batch_size": 0}, "batch_size must be > 0, got 0"),
        ("fedprox", {"mu": -0.5}, "mu must be >= 0, got -0.5"),
        ("fedprox", {"local_lr": float("nan")}, "local_lr must be >= 0, got nan"),
        ("scaffold", {"local_lr": 0.0}, "SCAFFOLD needs local_lr > 0"),
        ("scaffold", {"local_lr": -1.0}, "local_lr must be >= 0"),
    ],
)
def test_impossible_hyper_parameters_name_the_value(name: str, hparams: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        create_algorithm(name, **hparams)
    with pytest.raises(ValueError, match=re.escape(message)):
        FederatedModule(model=tiny_linear(), algorithm={"name": name, **hparams})


@pytest.mark.parametrize("server_lr", [-1.0, float("nan"), float("inf")])
def test_negative_server_lr_is_rejected(server_lr: float) -> None:
    with pytest.raises(ValueError, match="server_lr must be a finite number >= 0"):
        FederatedModule(model=tiny_linear(), server_lr=server_lr)


@pytest.mark.parametrize("alpha", [0, -1.0])
def test_dirichlet_alpha_must_be_positive(alpha: float) -> None:
    with pytest.raises(ValueError, match=rf"dirichlet_alpha must be > 0, got {alpha}"):
        FederatedDataModule(dataset="fashion_mnist", partition="dirichlet", dirichlet_alpha=alpha)


def test_unknown_choices_of_the_module_are_rejected() -> None:
    with pytest.raises(ValueError, match="aggregation must be 'samples' or 'uniform'"):
        FederatedModule(model=tiny_linear(), aggregation="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="client_batching must be"):
        FederatedModule(model=tiny_linear(), client_batching="threads")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="holdout_clients=6 leaves no training client"):
        FederatedModule(model=tiny_linear(), holdout_clients=6).attach_data(tiny_data())


def test_vmap_requested_for_a_model_with_dropout_says_why() -> None:
    model = nn.Sequential(nn.Linear(5, 4), nn.Dropout(0.5), nn.Linear(4, 3))
    module = FederatedModule(model=model, client_batching="vmap", clients_per_round=2)
    with pytest.raises(ValueError, match="client_batching='vmap' is impossible.*dropout"):
        module.attach_data(tiny_data())


def test_vmap_requested_for_a_model_with_batchnorm_runs_batched_with_per_client_statistics() -> None:
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    module = FederatedModule(model=model, client_batching="vmap", clients_per_round=2)
    module.attach_data(tiny_data())
    assert module.batching == "vmap" and model[1].track_running_stats
    assert module.client_buffers.tensors["1.running_mean"].shape == (6, 4)


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------
class _DatasetWithEmptyClient(TinyDataset):
    def __init__(self, split: str) -> None:
        super().__init__(4)
        self.split = split
        self.client_names = ["ana", "ben", "cleo", "dan"]

    def client_data(self) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
        clients = make_tiny_clients(4)
        trx, try_, tex, tey = clients[2]
        clients[2] = (trx[:0], try_[:0], tex, tey) if self.split == "train" else (trx, try_, tex[:0], tey[:0])
        return clients


@pytest.mark.parametrize("split", ["train", "test"])
def test_partition_leaving_a_client_empty_names_the_client(tmp_path: Path, split: str) -> None:
    dm = FederatedDataModule(dataset=_DatasetWithEmptyClient(split))
    module = FederatedModule(model=tiny_linear(), clients_per_round=2)
    _fit_expecting(ValueError, rf"1 client\(s\) with no {split} samples: cleo \(index 2\)", tmp_path, module, dm)


def test_missing_mnist_files_say_download_true(tmp_path: Path) -> None:
    dm = FederatedDataModule(dataset="mnist", root=str(tmp_path / "data"))
    module = FederatedModule(model=None, clients_per_round=2)
    _fit_expecting(FileNotFoundError, "download: true", tmp_path, module, dm)


def test_missing_fashion_mnist_files_give_the_apt_get_command(tmp_path: Path) -> None:
    dm = FederatedDataModule(dataset="fashion_mnist", root=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match=re.escape("apt-get install -y dataset-fashion-mnist")):
        dm.setup("fit")


# ----------------------------------------------------------------------------------------------
# divergence
# ----------------------------------------------------------------------------------------------
class _PoisonedDataset(TinyDataset):
    """Client ``bad`` has features of size 1e30: its local loss overflows to inf/NaN in its 2nd local step."""

    def __init__(self, bad: int) -> None:
        super().__init__(6)
        self.bad = bad

    def client_data(self) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
        clients = make_tiny_clients(6)
        trx, try_, tex, tey = clients[self.bad]
        clients[self.bad] = (trx * 1e30, try_, tex, tey)
        return clients


def test_non_finite_loss_names_round_and_client_and_keeps_last_checkpoint(tmp_path: Path) -> None:
    seed, per_round = 0, 2
    first = sample_clients(seed, 0, torch.arange(6), per_round).tolist()
    second = sample_clients(seed, 1, torch.arange(6), per_round).tolist()
    bad = next(c for c in second if c not in first)  # healthy round 0, poisoned round 1

    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_last=True)
    module = FederatedModule(
        model=tiny_linear(), algorithm={"name": "fedavg", "local_lr": 0.1, "local_steps": 3, "batch_size": None},
        clients_per_round=per_round, seed=seed,
    )
    trainer = make_trainer(5, enable_checkpointing=True, callbacks=[ckpt])
    with pytest.raises(FloatingPointError, match=rf"round 1: client client_{bad} \(index {bad}\)"):
        trainer.fit(module, FederatedDataModule(dataset=_PoisonedDataset(bad), eval_every=10))
    assert trainer.global_step == 1
    after_round_0 = {k: v.clone() for k, v in module.model.state_dict().items()}
    assert all(torch.isfinite(v).all() for v in after_round_0.values())  # the bad update was not applied

    last = tmp_path / "last.ckpt"
    saved = torch.load(last, weights_only=True)
    assert saved["global_step"] == 1
    loaded = FederatedModule.load_from_checkpoint(last, model=nn.Linear(5, 3))
    for k, v in after_round_0.items():
        assert torch.equal(loaded.model.state_dict()[k], v), k

    # the checkpoint resumes: on healthy data the run continues from round 1
    resumed = FederatedModule(model=nn.Linear(5, 3), algorithm=module.hparams["algorithm"],
                              clients_per_round=per_round, seed=seed)
    trainer = make_trainer(2)
    trainer.fit(resumed, tiny_datamodule(eval_every=10), ckpt_path=str(last))
    assert trainer.global_step == 2
    assert all(torch.isfinite(p).all() for p in resumed.model.parameters())


# ----------------------------------------------------------------------------------------------
# combinations that would silently give wrong numbers
# ----------------------------------------------------------------------------------------------
def test_fraction_and_clients_per_round_together_are_refused() -> None:
    """The docs say exclusive; the old code silently used ``fraction``."""
    with pytest.raises(ValueError, match=r"clients_per_round or fraction, not both.*clients_per_round=3.*fraction=0.5"):
        FederatedModule(model=tiny_linear(), clients_per_round=3, fraction=0.5)
    module = FederatedModule(model=tiny_linear(), fraction=0.5)
    module.attach_data(tiny_data())
    assert module.num_sampled == 3
    assert FederatedModule(model=tiny_linear()).clients_per_round == 10  # neither given: the default


@pytest.mark.parametrize("name", ["ifca", "cfl", "mocha", "mtl_mean", "mtl_pairwise", "perfedmaml"])
def test_algorithms_updating_models_outside_the_server_optimizer_refuse_fedopt(name: str) -> None:
    """FedAdam/FedYogi (or a server lr other than 1) would do nothing to these algorithms' cluster,
    personal or task models: refuse the combination at construction, naming the algorithm."""
    with pytest.raises(ValueError, match=rf"{name} updates its models outside the server optimizer"):
        FederatedModule(model=tiny_linear(), algorithm=name, server_optimizer=lambda p: torch.optim.Adam(p, lr=0.01))
    with pytest.raises(ValueError, match=r"server_lr=0.5"):
        FederatedModule(model=tiny_linear(), algorithm=name, server_lr=0.5)
    FederatedModule(model=tiny_linear(), algorithm=name)  # the default SGD(lr=1) is their exact server step


def test_algorithms_stepped_by_the_server_optimizer_accept_fedopt() -> None:
    for name in ("fedavg", "scaffold", "ditto", "fedmaml", "fedrep"):
        FederatedModule(model=tiny_linear(), algorithm=name, server_optimizer=lambda p: torch.optim.Adam(p, lr=0.01))


@pytest.mark.parametrize("outputs", [2, 7])
def test_model_output_size_must_match_the_number_of_classes(tmp_path: Path, outputs: int) -> None:
    """Fewer outputs than classes crashed inside torch ('index 7 is out of bounds'); more trained silently."""
    torch.manual_seed(0)
    module = FederatedModule(model=nn.Linear(5, outputs), clients_per_round=2)
    _fit_expecting(ValueError, rf"output has shape \(2, {outputs}\).*3 classes.*must output 3 logits", tmp_path,
                   module, tiny_datamodule())


def test_a_model_that_cannot_take_the_inputs_says_so_before_training(tmp_path: Path) -> None:
    module = FederatedModule(model=nn.Linear(7, 3), clients_per_round=2)
    _fit_expecting(ValueError, r"cannot take this data's inputs: a batch of shape \(2, 5\)", tmp_path, module,
                   tiny_datamodule())
