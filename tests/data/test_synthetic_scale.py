"""The synthetic population at scale (lightning_fedmeta/data/synthetic_scale.py): the stated size law, the
FedProx input structure, determinism per seed and independence of the chunking."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.data.synthetic_scale import make_synthetic_scale, power_law_sizes

FIELDS = ("train_x", "train_y", "train_offsets", "test_x", "test_y", "test_offsets")


def test_sizes_follow_the_stated_power_law() -> None:
    """P(n >= s) = (n_min/s)^gamma for integers n_min <= s <= n_max, and n is capped at n_max."""
    k = 200_000
    sizes = power_law_sizes(k, min_samples=10, exponent=2.0, max_samples=500, rng=np.random.default_rng(1))
    assert sizes.min() == 10 and sizes.max() == 500
    for s in (10, 11, 15, 20, 40, 100, 250, 500):
        expected = (10 / s) ** 2
        got = float((sizes >= s).mean())
        # binomial standard error sqrt(p(1-p)/K) <= 0.0012: 5 standard errors
        assert abs(got - expected) <= 5 * (expected * (1 - expected) / k) ** 0.5 + 1e-12, (s, got, expected)
    # another exponent and minimum: the law moves with them
    other = power_law_sizes(k, min_samples=4, exponent=1.0, max_samples=10**6, rng=np.random.default_rng(2))
    assert abs(float((other >= 40).mean()) - 0.1) < 0.004


def test_the_dataset_splits_every_client_as_stated() -> None:
    data = make_synthetic_scale(num_clients=2000, seed=3)
    sizes = data.train_counts + data.test_counts
    assert torch.equal(data.train_counts, torch.floor(0.9 * sizes.double()).long())
    assert int(data.test_counts.min()) >= 1 and int(sizes.min()) >= 10 and int(sizes.max()) <= 500
    assert data.train_x.dtype == torch.float32 and data.train_x.shape[1] == 60 and data.num_classes == 10
    assert data.task == "classification" and int(data.train_y.max()) <= 9
    # the sizes are the law's draws from the "sizes" stream (the generator's first spawned stream)
    rng = np.random.default_rng(np.random.SeedSequence(3).spawn(6)[0])
    assert sizes.tolist() == power_law_sizes(2000, 10, 2.0, 500, rng).tolist()


def test_inputs_have_fedprox_covariance_within_a_client() -> None:
    """x ~ N(v_k, diag(j^-1.2)): the pooled within-client variance of feature j is j^-1.2 (FedProx, §5.1)."""
    data = make_synthetic_scale(num_clients=3000, seed=0)
    x = data.train_x.double()
    owner = torch.repeat_interleave(torch.arange(data.num_clients), data.train_counts)
    counts = data.train_counts.double()
    means = torch.zeros(data.num_clients, 60, dtype=torch.float64).index_add_(0, owner, x) / counts[:, None]
    resid = x - means[owner]
    dof = float((counts - 1).sum())
    var = (resid**2).sum(0) / dof
    expected = torch.arange(1, 61, dtype=torch.float64) ** -1.2
    torch.testing.assert_close(var, expected, rtol=0.03, atol=0)
    # between clients: v_k ~ N(B_k, 1), B_k ~ N(0, beta^2 = 1): the client means of feature 60 vary with
    # variance 1 + 1 = 2 (plus the small sampling noise of a mean)
    spread = float(means[:, -1].var())
    assert 1.8 < spread < 2.2


def test_same_seed_same_data_other_seed_other_data() -> None:
    a, b, c = (make_synthetic_scale(num_clients=500, seed=s) for s in (5, 5, 6))
    assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS)
    assert not torch.equal(a.train_offsets, c.train_offsets)


@pytest.mark.parametrize("chunk", [1, 37, 1000])
def test_the_data_do_not_depend_on_the_chunking(chunk: int) -> None:
    whole = make_synthetic_scale(num_clients=700, seed=2, chunk_samples=10**8)
    chunked = make_synthetic_scale(num_clients=700, seed=2, chunk_samples=chunk)
    for field in FIELDS:
        assert torch.equal(getattr(whole, field), getattr(chunked, field)), field


def test_datamodule_builds_it_by_name() -> None:
    dm = FederatedDataModule(dataset="synthetic_scale", num_clients=400, data_seed=4, synthetic_alpha=0.5,
                             synthetic_beta=0.5)
    dm.setup("fit")
    direct = make_synthetic_scale(0.5, 0.5, num_clients=400, seed=4)
    assert all(torch.equal(getattr(dm.federated_data, f), getattr(direct, f)) for f in FIELDS)
    assert dm.num_classes == 10


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"min_samples": 1}, "min_samples"), ({"max_samples": 5}, "max_samples"), ({"exponent": 0.0}, "exponent"),
     ({"test_fraction": 0.95}, "test_fraction"), ({"alpha": -1.0}, "alpha"), ({"num_clients": 0}, "num_clients")],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_synthetic_scale(**{"num_clients": 10, **kwargs})
