"""Datasets for every task: synthetic regression / multi-label / next-token, the LEAF reader, the datamodule adapter."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_fedmeta.data.federated import FederatedData, FederatedDataset, from_client_tensors
from lightning_fedmeta.data.leaf import ALL_LETTERS, LeafDataset
from lightning_fedmeta.data.lightning_adapter import LightningDataPartition
from lightning_fedmeta.data.synthetic_tasks import (
    bayes_accuracy,
    make_synthetic_multilabel,
    make_synthetic_next_token,
    make_synthetic_regression,
    next_token_chains,
    stationary_distribution,
)


def _same(a: FederatedData, b: FederatedData) -> bool:
    return all(
        torch.equal(getattr(a, f), getattr(b, f))
        for f in ("train_x", "train_y", "train_offsets", "test_x", "test_y", "test_offsets")
    )


# ---------------------------------------------------------------------------------------------------
# synthetic generators


GENERATORS = {
    "regression": lambda seed: make_synthetic_regression(num_clients=5, dim=8, seed=seed),
    "multilabel": lambda seed: make_synthetic_multilabel(num_clients=5, dim=8, num_labels=4, seed=seed),
    "next_token": lambda seed: make_synthetic_next_token(num_clients=5, vocab_size=6, seq_len=7, seed=seed),
}


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generators_are_pure_functions_of_the_seed_with_unequal_clients(name: str) -> None:
    a, b, c = GENERATORS[name](3), GENERATORS[name](3), GENERATORS[name](4)
    assert _same(a, b)
    assert not _same(a, c)
    assert a.task == name
    assert a.num_clients == 5
    assert len(set(a.train_counts.tolist())) > 1, "client sizes are power-law, not equal"
    assert int(a.train_counts.min()) >= 1 and int(a.test_counts.min()) >= 1
    # the FedProx 90/10 split of each client's n_k samples
    n = a.train_counts + a.test_counts
    assert torch.equal(a.train_counts, (0.9 * n.double()).long())


def test_regression_shapes_scale_and_heterogeneity() -> None:
    d = make_synthetic_regression(num_clients=6, dim=5, noise=0.05, seed=1)
    assert d.num_classes is None and d.train_x.dtype == torch.float32
    assert d.train_y.shape == (d.train_x.shape[0],) and d.train_y.dtype == torch.float32
    ys = torch.cat([d.train_y, d.test_y])
    assert abs(float(ys.pow(2).mean()) - (1 + 0.05**2)) < 0.05, "targets have unit mean square"
    d3 = make_synthetic_regression(num_clients=3, dim=5, target_dim=3, seed=1)
    assert d3.train_y.shape == (d3.train_x.shape[0], 3) and d3.target_shape == (3,)

    # each client's least-squares solution fits it to the noise level; they differ, and one global fit is poor
    def design(x: Tensor) -> Tensor:
        return torch.cat([x, torch.ones(x.shape[0], 1)], 1).double()

    coefs, own_mse = [], []
    for k in range(d.num_clients):
        x, y = d.client_train(k)
        w = torch.linalg.lstsq(design(x), y.double()[:, None]).solution
        coefs.append(w.flatten())
        own_mse.append(float((design(x) @ w - y.double()[:, None]).pow(2).mean()))
    assert max(own_mse) < 0.01
    dists = [float((coefs[i] - coefs[j]).norm()) for i in range(6) for j in range(i)]
    assert min(dists) > 0.1
    w_all = torch.linalg.lstsq(design(d.train_x), d.train_y.double()[:, None]).solution
    global_mse = float((design(d.train_x) @ w_all - d.train_y.double()[:, None]).pow(2).mean())
    assert global_mse > 10 * max(own_mse)


def test_regression_shared_component_leaves_the_inputs_alone() -> None:
    a = make_synthetic_regression(num_clients=4, dim=5, seed=2)
    b = make_synthetic_regression(num_clients=4, dim=5, seed=2, shared=3.0)
    assert torch.equal(a.train_x, b.train_x) and not torch.equal(a.train_y, b.train_y)


def test_multilabel_labels_are_binary_balanced_overall_and_differ_between_clients() -> None:
    d = make_synthetic_multilabel(num_clients=8, dim=10, num_labels=5, seed=0, positive_rate=0.3)
    assert d.train_y.shape == (d.train_x.shape[0], 5) and d.num_classes == 5
    assert d.train_y.dtype == torch.float32 and set(d.train_y.unique().tolist()) <= {0.0, 1.0}
    ys = torch.cat([d.train_y, d.test_y])
    rate = ys.mean(0)
    assert torch.all((rate - 0.3).abs() < 0.02), rate
    assert torch.all(ys.amax(0) == 1) and torch.all(ys.amin(0) == 0)
    per_client = torch.stack([d.client_train(k)[1].mean(0) for k in range(d.num_clients)])
    assert float(per_client.std(0).mean()) > 0.1, "clients' label rates differ"


def test_next_token_windows_and_targets() -> None:
    d = make_synthetic_next_token(num_clients=4, vocab_size=7, seq_len=9, seed=0)
    n = d.train_x.shape[0]
    assert d.train_x.shape == (n, 9) and d.train_y.shape == (n, 9)
    assert d.train_x.dtype == torch.long and d.train_y.dtype == torch.long and d.num_classes == 7
    assert torch.equal(d.train_y[:, :-1], d.train_x[:, 1:]), "y is x shifted by one token"
    assert 0 <= int(d.train_x.min()) and int(d.train_y.max()) < 7
    last = make_synthetic_next_token(num_clients=4, vocab_size=7, seq_len=9, seed=0, targets="last")
    assert last.train_y.shape == (n,)
    assert torch.equal(last.train_x, d.train_x) and torch.equal(last.train_y, d.train_y[:, -1])


def test_next_token_text_follows_the_client_chains_and_personalisation_can_win() -> None:
    v = 6
    d = make_synthetic_next_token(num_clients=6, vocab_size=v, seq_len=20, seed=5)
    shared, chains = next_token_chains(num_clients=6, vocab_size=v, seed=5)
    assert np.allclose(chains.sum(-1), 1.0)
    k = int(d.train_counts.argmax())
    x, y = d.client_train(k)
    counts = np.zeros((v, v))
    np.add.at(counts, (x.numpy().ravel(), y.numpy().ravel()), 1)
    assert np.abs(counts / counts.sum(1, keepdims=True) - chains[k]).max() < 0.06
    # with the defaults (V = 16, mix = 0.5) a client's own chain predicts clearly better than the shared one
    shared16, chains16 = next_token_chains(seed=5)
    own = np.array([bayes_accuracy(p) for p in chains16])
    glob = np.array([bayes_accuracy(p, shared16) for p in chains16])
    assert np.all(own >= glob - 1e-12) and own.mean() > glob.mean() + 0.03
    # mix = 0: one chain for everybody, nothing to personalise
    shared0, chains0 = next_token_chains(num_clients=3, vocab_size=v, mix=0.0, seed=5)
    assert np.allclose(chains0, shared0[None])
    assert bayes_accuracy(chains0[0], shared0) == pytest.approx(bayes_accuracy(chains0[0]))


def test_bayes_accuracy_and_stationary_distribution_on_known_chains() -> None:
    cycle = np.roll(np.eye(4), 1, axis=1)  # 0 -> 1 -> 2 -> 3 -> 0
    assert np.allclose(stationary_distribution(cycle), 0.25)
    assert bayes_accuracy(cycle) == pytest.approx(1.0)
    assert bayes_accuracy(cycle, np.eye(4)) == pytest.approx(0.0)
    assert bayes_accuracy(np.full((5, 5), 0.2)) == pytest.approx(0.2)
    two = np.array([[0.9, 0.1], [0.5, 0.5]])
    pi = stationary_distribution(two)
    assert np.allclose(pi @ two, pi) and pi.sum() == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: make_synthetic_regression(alpha=-1.0), "alpha"),
        (lambda: make_synthetic_regression(noise=-0.1), "noise"),
        (lambda: make_synthetic_regression(target_dim=0), "target_dim"),
        (lambda: make_synthetic_multilabel(positive_rate=1.0), "positive_rate"),
        (lambda: make_synthetic_multilabel(num_labels=0), "num_labels"),
        (lambda: make_synthetic_next_token(mix=1.5), "mix"),
        (lambda: make_synthetic_next_token(targets="all"), "targets"),
        (lambda: make_synthetic_next_token(vocab_size=1), "vocab_size"),
        (lambda: make_synthetic_next_token(test_fraction=1.0), "test_fraction"),
        (lambda: bayes_accuracy(np.eye(3), np.eye(2)), "predictor"),
    ],
)
def test_generators_reject_bad_arguments(call: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------------------
# LEAF reader


def _write(path: Path, users: dict[str, tuple[list[Any], list[Any]]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    content = {
        "users": list(users),
        "num_samples": [len(x) for x, _ in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }
    path.write_text(json.dumps(content))


def _femnist_samples(n: int, label: int, value: float) -> tuple[list[Any], list[Any]]:
    return [[value] * 784 for _ in range(n)], [label] * n


def _femnist_root(root: Path) -> Path:
    """Users b and a in one train file, c and more of a in a second; a test file; e only in train, d only in test."""
    _write(root / "train" / "all_data_0_niid_train.json",
           {"b": _femnist_samples(3, 5, 1.0), "a": _femnist_samples(2, 61, 0.25), "e": _femnist_samples(4, 0, 1.0)})
    _write(root / "train" / "all_data_1_niid_train.json",
           {"c": _femnist_samples(4, 7, 0.5), "a": _femnist_samples(1, 3, 0.0)})
    _write(root / "test" / "all_data_0_niid_test.json",
           {"a": _femnist_samples(1, 61, 1.0), "b": _femnist_samples(1, 5, 1.0), "c": _femnist_samples(2, 7, 1.0),
            "d": _femnist_samples(1, 1, 1.0)})
    return root


def test_leaf_femnist_reads_users_of_both_splits_across_files(tmp_path: Path) -> None:
    ds = LeafDataset(str(_femnist_root(tmp_path)))
    assert isinstance(ds, FederatedDataset)
    assert ds.resolved_kind == "femnist" and ds.num_classes == 62 and ds.task == "classification"
    assert ds.client_names == ["a", "b", "c"]  # sorted; e (train only) and d (test only) skipped
    clients = ds.client_data()
    trx, try_, tex, tey = clients[0]
    assert trx.shape == (3, 1, 28, 28) and trx.dtype == torch.float32  # a: 2 + 1 samples from two files
    assert try_.tolist() == [61, 61, 3] and try_.dtype == torch.long
    assert trx[:, 0, 0, 0].tolist() == [0.25, 0.25, 0.0], "pixels are kept as stored"
    assert tex.shape == (1, 1, 28, 28) and tey.tolist() == [61]
    data = from_client_tensors(clients, ds.num_classes, ds.client_names, ds.task)
    assert data.train_counts.tolist() == [3, 3, 4] and data.test_counts.tolist() == [1, 1, 2]
    # the parent folder (leaf/data/femnist with data/train, data/test) works too
    parent = tmp_path.parent / (tmp_path.name + "_parent")
    _femnist_root(parent / "data")
    assert LeafDataset(str(parent), kind="femnist").client_names == ["a", "b", "c"]


def test_leaf_filters_by_min_samples_and_max_clients(tmp_path: Path) -> None:
    root = str(_femnist_root(tmp_path))
    assert LeafDataset(root, min_samples=4).client_names == ["c"]
    assert LeafDataset(root, max_clients=2).client_names == ["a", "b"]


def _sentence(i: int) -> str:
    text = "To be, or not to be: that is the question. " * 3
    return text[i : i + 80]


def test_leaf_shakespeare_maps_characters_to_leaf_indices(tmp_path: Path) -> None:
    assert len(ALL_LETTERS) == 80 and len(set(ALL_LETTERS)) == 80
    xs = [_sentence(i) for i in range(5)]
    ys = [_sentence(i + 1)[-1] for i in range(5)]
    _write(tmp_path / "train" / "p0.json", {"HAMLET": (xs[:3], ys[:3])})
    _write(tmp_path / "train" / "p1.json", {"OPHELIA": (xs[3:], ys[3:])})
    _write(tmp_path / "test" / "p0.json", {"HAMLET": (xs[:1], ys[:1]), "OPHELIA": (xs[1:2], ys[1:2])})
    ds = LeafDataset(str(tmp_path))
    assert ds.resolved_kind == "shakespeare" and ds.num_classes == 80 and ds.task == "next_token"
    assert ds.client_names == ["HAMLET", "OPHELIA"]
    trx, try_, tex, tey = ds.client_data()[0]
    assert trx.shape == (3, 80) and trx.dtype == torch.long and try_.shape == (3,) and try_.dtype == torch.long
    assert trx[0].tolist() == [ALL_LETTERS.find(c) for c in xs[0]]
    assert try_.tolist() == [ALL_LETTERS.find(c) for c in ys[:3]]
    data = from_client_tensors(ds.client_data(), ds.num_classes, ds.client_names, ds.task)
    assert data.task == "next_token" and data.input_shape == (80,)


def test_leaf_shakespeare_unknown_characters_are_replaced_or_rejected(tmp_path: Path) -> None:
    x = "é" + _sentence(0)[1:]
    _write(tmp_path / "train" / "p.json", {"u": ([x, _sentence(1)], ["|", "a"])})
    _write(tmp_path / "test" / "p.json", {"u": ([_sentence(2)], ["b"])})
    trx, try_, _, _ = LeafDataset(str(tmp_path)).client_data()[0]
    assert int(trx[0, 0]) == ALL_LETTERS.index(" ") and int(try_[0]) == ALL_LETTERS.index(" ")
    with pytest.raises(ValueError, match="not in LEAF's vocabulary"):
        LeafDataset(str(tmp_path), unknown_char=None).client_data()


def test_leaf_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a folder"):
        LeafDataset(str(tmp_path / "missing"))
    (tmp_path / "train").mkdir()
    with pytest.raises(ValueError, match="test/"):
        LeafDataset(str(tmp_path))
    (tmp_path / "test").mkdir()
    with pytest.raises(ValueError, match=r"no \*\.json"):
        LeafDataset(str(tmp_path)).client_data()
    _write(tmp_path / "train" / "a.json", {"u1": _femnist_samples(2, 1, 1.0)})
    _write(tmp_path / "test" / "a.json", {"u2": _femnist_samples(2, 1, 1.0)})
    with pytest.raises(ValueError, match="-t sample"):
        LeafDataset(str(tmp_path)).client_data()
    _write(tmp_path / "test" / "a.json", {"u1": ([[1.0] * 10], [1])})
    with pytest.raises(ValueError, match="784"):
        LeafDataset(str(tmp_path), kind="femnist").client_data()
    with pytest.raises(ValueError, match="kind"):
        LeafDataset(str(tmp_path), kind="celeba")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_samples"):
        LeafDataset(str(tmp_path), min_samples=0)


# ---------------------------------------------------------------------------------------------------
# LightningDataModule adapter


class _DictSet(Dataset):
    def __init__(self, x: Tensor, y: Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return self.x.shape[0]

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class TinyDataModule(L.LightningDataModule):
    """120 train / 30 test samples of 4 features and 3 classes (or float targets), made in code."""

    def __init__(self, batches: str = "tuple", float_targets: bool = False, with_test: bool = True,
                 shuffle: bool = False, num_classes: int | None = None) -> None:
        super().__init__()
        self.batches, self.float_targets, self.with_test, self.shuffle = batches, float_targets, with_test, shuffle
        if num_classes is not None:
            self.num_classes = num_classes
        self.calls: list[str] = []

    def prepare_data(self) -> None:
        self.calls.append("prepare")

    def setup(self, stage: str) -> None:
        self.calls.append(stage)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(150, 4, generator=g)
        y = torch.arange(150) % 3
        if self.float_targets:
            y = x.sum(1)
        self.train, self.test = (x[:120], y[:120]), (x[120:], y[120:])

    def _loader(self, xy: tuple[Tensor, Tensor], shuffle: bool = False) -> DataLoader:
        ds = _DictSet(*xy) if self.batches == "dict" else TensorDataset(*xy)
        return DataLoader(ds, batch_size=7 if self.batches != "bad" else 1, shuffle=shuffle)

    def train_dataloader(self) -> DataLoader:
        if self.batches == "bad":
            return DataLoader(TensorDataset(self.train[0], self.train[1], self.train[1]), batch_size=5)
        return self._loader(self.train, self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.test)


class TinyWithTest(TinyDataModule):
    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test)


def _rows(t: Tensor) -> set[tuple[float, ...]]:
    return {tuple(r.tolist()) for r in t}


def test_adapter_partitions_every_train_sample_and_matches_test_labels() -> None:
    dm = TinyWithTest()
    ds = LightningDataPartition(dm, num_clients=4, partition="dirichlet", dirichlet_alpha=0.5, seed=1)
    assert isinstance(ds, FederatedDataset)
    clients = ds.client_data()
    assert dm.calls == ["prepare", "fit", "test"]
    assert ds.num_classes == 3 and ds.task == "classification"
    assert len(clients) == 4 and sum(c[0].shape[0] for c in clients) == 120
    assert _rows(torch.cat([c[0] for c in clients])) == _rows(dm.train[0])
    for trx, try_, _, tey in clients:
        assert trx.dtype == torch.float32 and try_.dtype == torch.long
        assert set(tey.tolist()) <= set(try_.tolist()), "matching test split follows the train labels"
    data = from_client_tensors(clients, ds.num_classes, task=ds.task)
    assert data.label_counts.sum() == 120
    again = LightningDataPartition(TinyWithTest(), num_clients=4, partition="dirichlet", seed=1).client_data()
    assert all(torch.equal(a, b) for c1, c2 in zip(clients, again, strict=True) for a, b in zip(c1, c2, strict=True))


def test_adapter_reads_dict_batches_like_tuple_batches_and_shuffled_loaders_deterministically() -> None:
    tuple_ds = LightningDataPartition(TinyWithTest(), num_clients=3, partition="shards", classes_per_client=1)
    dict_ds = LightningDataPartition(TinyWithTest(batches="dict"), num_clients=3, partition="shards",
                                     classes_per_client=1)
    for c1, c2 in zip(tuple_ds.client_data(), dict_ds.client_data(), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(c1, c2, strict=True))
        assert c1[1].unique().numel() == 1, "one shard of a label-sorted split: one class"
    before = torch.get_rng_state()
    s1 = LightningDataPartition(TinyWithTest(shuffle=True), num_clients=3, seed=4).client_data()
    s2 = LightningDataPartition(TinyWithTest(shuffle=True), num_clients=3, seed=4).client_data()
    assert torch.equal(torch.get_rng_state(), before), "the global random state is left alone"
    assert all(torch.equal(a[0], b[0]) for a, b in zip(s1, s2, strict=True))


def test_adapter_float_targets_allow_only_iid() -> None:
    with pytest.raises(ValueError, match="partition='iid'"):
        LightningDataPartition(TinyWithTest(float_targets=True), num_clients=3, partition="dirichlet").client_data()
    ds = LightningDataPartition(TinyWithTest(float_targets=True), num_clients=3, max_samples_per_client=20)
    clients = ds.client_data()
    assert ds.task == "regression" and ds.num_classes is None
    assert [c[0].shape[0] for c in clients] == [20, 20, 20] and [c[2].shape[0] for c in clients] == [10, 10, 10]
    assert clients[0][1].dtype == torch.float32


def test_adapter_falls_back_to_the_val_loader_and_reads_declared_num_classes() -> None:
    dm = TinyDataModule(num_classes=5)
    ds = LightningDataPartition(dm, num_clients=2, test="iid")
    with pytest.warns(UserWarning, match="val_dataloader"):
        clients = ds.client_data()
    assert ds.num_classes == 5 and sum(c[2].shape[0] for c in clients) == 30
    assert "test" not in dm.calls


def test_adapter_rejects_bad_batches_and_arguments() -> None:
    with pytest.raises(ValueError, match="list of length 3"):
        LightningDataPartition(TinyWithTest(batches="bad"), num_clients=2).client_data()
    with pytest.raises(ValueError, match="LightningDataModule"):
        LightningDataPartition(object(), num_clients=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="partition"):
        LightningDataPartition(TinyWithTest(), partition="perfedavg_paper")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_clients"):
        LightningDataPartition(TinyWithTest(), num_clients=0)


def test_adapter_is_buildable_from_a_class_path_config() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--dataset", type=FederatedDataset)
    cfg = parser.parse_object({"dataset": {
        "class_path": "lightning_fedmeta.data.lightning_adapter.LightningDataPartition",
        "init_args": {"datamodule": {"class_path": f"{__name__}.TinyWithTest"}, "num_clients": 3,
                      "partition": "dirichlet"},
    }})
    ds = parser.instantiate_classes(cfg).dataset
    assert isinstance(ds, LightningDataPartition) and isinstance(ds.datamodule, TinyWithTest)
    assert len(ds.client_data()) == 3
