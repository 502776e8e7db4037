"""PFLlib's pathological and min-size Dirichlet splits, its per-client train/test split, FL-bench's user split and
the Flower Datasets adapter (lightning_fedmeta.data.splits), and their wiring into FederatedDataModule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedmeta.data.splits import (
    dirichlet_min_size,
    flower_partition,
    pathological,
    per_client_train_test,
    pfllib_least_samples,
    user_split,
)

LABELS = np.repeat(np.arange(10), 100)  # 10 classes x 100 rows, in class order


def _disjoint(parts) -> bool:
    rows = np.concatenate([np.asarray(p) for p in parts])
    return rows.size == np.unique(rows).size


def test_pathological_balanced_counts_by_hand():
    # K=20, C=10, 2 slots: ceil(20/10*2)=4 clients share each class, 100/4 = 25 rows each; classes 0-4 fill
    # clients 0-3, 4-7, ..., so client k holds classes (k//4)*2... : every client 2 classes x 25 rows.
    parts = pathological(LABELS, 20, 2, balance=True, seed=0)
    assert [p.size for p in parts] == [50] * 20
    assert _disjoint(parts)
    assert [sorted(set(LABELS[p])) for p in parts[:4]] == [[0, 1]] * 4
    assert sorted(set(LABELS[parts[19]])) == [8, 9]
    # balance=True draws nothing: any seed gives the same split, in dataset order within each class
    same = pathological(LABELS, 20, 2, balance=True, seed=7)
    assert all(np.array_equal(a, b) for a, b in zip(parts, same, strict=True))
    assert np.array_equal(parts[0], np.r_[0:25, 100:125])


def test_pathological_balanced_remainder_goes_to_the_last_client():
    parts = pathological(np.repeat(np.arange(2), [10, 7]), 3, 2, balance=True)  # 3 clients share each class
    assert [p.size for p in parts] == [3 + 2, 3 + 2, 4 + 3]


def test_pathological_unbalanced_sizes_are_seeded_and_within_bounds():
    a = pathological(LABELS, 20, 2, balance=False, seed=1)
    b = pathological(LABELS, 20, 2, balance=False, seed=1)
    c = pathological(LABELS, 20, 2, balance=False, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert [p.size for p in a] != [p.size for p in c]
    assert _disjoint(a) and sum(p.size for p in a) == LABELS.size
    least = pfllib_least_samples(LABELS.size, 20)
    assert least == 25  # int(min(10 / 0.25, 1000 / 20 / 2))
    for k in (0, 1, 2):  # the first 3 sharers of class 0 draw randint(max(25/10, 25/10), 25)
        assert 2 <= np.count_nonzero(LABELS[a[k]] == 0) < 25


def test_pathological_refuses_clients_left_empty():
    # 4 clients share each 2-row class: int(2 / 4) = 0 rows for the first three, the rest to the last
    with pytest.raises(ValueError, match=r"leaves 3 of 4 clients without rows \(e.g. client 0\)"):
        pathological(np.array([0, 0, 1, 1]), 4, 2, balance=True)


def test_dirichlet_min_size_respects_the_minimum_and_seed():
    y = np.random.RandomState(0).randint(0, 10, 4000)
    a = dirichlet_min_size(y, 20, 0.1, least_samples=40, seed=3)
    assert min(p.size for p in a) >= 40 and _disjoint(a) and sum(p.size for p in a) == y.size
    b = dirichlet_min_size(y, 20, 0.1, least_samples=40, seed=3)
    c = dirichlet_min_size(y, 20, 0.1, least_samples=40, seed=4)
    assert all(np.array_equal(x, z) for x, z in zip(a, b, strict=True))
    assert [p.size for p in a] != [p.size for p in c]


def test_dirichlet_min_size_gives_up_after_the_retry_limit():
    y = np.repeat(np.arange(2), 50)
    with pytest.raises(ValueError, match=r"after 3 attempts the smallest of 10 clients still has \d+ rows, fewer than "
                                         r"the minimum 10"):
        dirichlet_min_size(y, 10, 0.01, least_samples=10, max_retries=3, seed=0)


def test_per_client_train_test_fraction_and_sklearn_order():
    parts = [np.arange(10, 30), np.arange(40, 47)]
    train, test = per_client_train_test(parts, 0.75, seed=5)
    assert [t.numel() for t in train] == [15, 5] and [t.numel() for t in test] == [5, 2]  # floor(0.75 n) train
    perm = np.random.RandomState(5).permutation(20)  # sklearn's ShuffleSplit: test = perm[:n_test]
    assert torch.equal(test[0], torch.from_numpy(np.sort(parts[0][perm[:5]])))
    for tr, te, p in zip(train, test, parts, strict=True):
        assert sorted(tr.tolist() + te.tolist()) == p.tolist()
    again, _ = per_client_train_test(parts, 0.75, seed=5)
    other, _ = per_client_train_test(parts, 0.75, seed=6)
    assert all(torch.equal(a, b) for a, b in zip(train, again, strict=True)) and not torch.equal(train[0], other[0])
    with pytest.raises(ValueError, match="client 0 has 1 rows"):
        per_client_train_test([np.arange(1)], 0.75)


def test_one_stream_continues_from_partition_to_split():
    # PFLlib draws the partition and then the per-client split from one generator: a shared RandomState
    rng = np.random.RandomState(1)
    parts = pathological(LABELS, 20, 2, balance=False, seed=rng)
    train, _ = per_client_train_test(parts, 0.75, seed=rng)
    rng2 = np.random.RandomState(1)
    pathological(LABELS, 20, 2, balance=False, seed=rng2)
    n = parts[0].size
    n_test = n - int(0.75 * n)
    assert np.array_equal(np.sort(parts[0][rng2.permutation(n)[n_test:]]), train[0].numpy())


def test_user_split_is_fl_bench_index_order():
    assert user_split(10, test_ratio=0.2, val_ratio=0.1) == {"train": list(range(7)), "val": [7], "test": [8, 9]}
    with pytest.raises(ValueError, match="no training client"):
        user_split(2, test_ratio=0.5, val_ratio=0.5)


class _EveryOther:
    """A partitioner of Flower Datasets' shape: ``dataset`` setter, ``num_partitions``, ``load_partition(i)``."""

    def __init__(self, num_partitions: int) -> None:
        self._n, self._dataset = num_partitions, None

    @property
    def dataset(self):
        return self._dataset

    @dataset.setter
    def dataset(self, value) -> None:
        self._dataset = value

    @property
    def num_partitions(self) -> int:
        return self._n

    def load_partition(self, partition_id: int):
        labels = self._dataset["label"]
        return self._dataset.select([i for i in range(len(labels)) if i % self._n == partition_id])


def test_flower_partition_with_a_partitioner_of_that_shape():
    y = np.arange(12) % 4
    parts = flower_partition(_EveryOther(3), y)
    assert [p.tolist() for p in parts] == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]
    with pytest.raises(ValueError, match="not a Flower Datasets partitioner"):
        flower_partition(object(), y)


def test_flower_partition_equals_flower_datasets_itself():
    fp = pytest.importorskip("flwr_datasets.partitioner", reason="the flower-datasets extra is not installed")
    datasets = pytest.importorskip("datasets")
    y = np.random.RandomState(0).randint(0, 5, 300)
    x = np.arange(300) * 7
    for make in (lambda: fp.IidPartitioner(num_partitions=6),
                 lambda: fp.DirichletPartitioner(num_partitions=6, partition_by="label", alpha=0.5, seed=3,
                                                 min_partition_size=0)):
        ours = flower_partition(make(), y)
        theirs = make()
        theirs.dataset = datasets.Dataset.from_dict({"label": y.tolist(), "x": x.tolist()})
        for i, rows in enumerate(ours):
            assert sorted(theirs.load_partition(i)["x"]) == sorted(x[rows.numpy()].tolist())


def _fake_fmnist(root, n_train=400, n_test=100):
    from tests.data.test_datasets_more import write_idx

    rs = np.random.RandomState(0)
    for stem, n in (("train", n_train), ("t10k", n_test)):
        write_idx(root / f"{stem}-images-idx3-ubyte", rs.randint(0, 256, (n, 28, 28)).astype(np.uint8))
        write_idx(root / f"{stem}-labels-idx1-ubyte", (np.arange(n) % 10).astype(np.uint8))


def test_datamodule_pfllib_protocol(tmp_path):
    from lightning_fedmeta.data import FederatedDataModule

    _fake_fmnist(tmp_path)
    dm = FederatedDataModule(dataset="mnist", root=str(tmp_path), partition="pathological", num_clients=5,
                             classes_per_client=2, balance=True, test_split="per_client", data_seed=1)
    dm.setup()
    data = dm.federated_data
    # merged pool of 500 rows, 50 per class; ceil(5/10*2)=1 client per class: client k gets classes 2k, 2k+1
    assert (data.train_counts + data.test_counts).tolist() == [100] * 5
    assert data.train_counts.tolist() == [75] * 5
    assert sorted(data.client_train(0)[1].unique().tolist()) == [0, 1]
    again = FederatedDataModule(dataset="mnist", root=str(tmp_path), partition="pathological", num_clients=5,
                                balance=True, test_split="per_client", data_seed=1)
    again.setup()
    assert torch.equal(again.federated_data.train_x, data.train_x)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"partition": "pathologic"}, "unknown partition 'pathologic'"),
    ({"test_split": "user"}, "unknown test_split 'user'"),
    ({"train_fraction": 1.0}, r"train_fraction must be in \(0, 1\)"),
    ({"max_retries": 0}, "max_retries must be an integer >= 1"),
    ({"partition": "flower"}, "partition: flower needs data.partitioner"),
    ({"partitioner": _EveryOther(3)}, "partition: flower needs data.partitioner"),
    ({"partition": "flower", "partitioner": object()}, "has no 'num_partitions'"),
    ({"dataset": "cifar100", "root": None}, "needs a `root` folder"),
    ({"dataset": "femnist", "root": None}, "LEAF's train/ and test/ JSON files"),
])
def test_datamodule_refuses_bad_split_options(kwargs, message):
    from lightning_fedmeta.data import FederatedDataModule

    with pytest.raises(ValueError, match=message):
        FederatedDataModule(**{"dataset": "mnist", "root": "/nonexistent", **kwargs})


def test_datamodule_flower_partitioner(tmp_path):
    from lightning_fedmeta.data import FederatedDataModule

    _fake_fmnist(tmp_path)
    dm = FederatedDataModule(dataset="mnist", root=str(tmp_path), partition="flower", partitioner=_EveryOther(4),
                             num_clients=4)
    dm.setup()
    assert dm.federated_data.train_counts.tolist() == [100] * 4
    bad = FederatedDataModule(dataset="mnist", root=str(tmp_path), partition="flower", partitioner=_EveryOther(3),
                              num_clients=4)
    with pytest.raises(ValueError, match="num_partitions=3 but data.num_clients=4"):
        bad.setup()
