"""Partitioners: determinism, disjointness, exact class counts, argument validation."""

from __future__ import annotations

import pytest
import torch

from lightning_fedmeta.data import (
    cap_client_sizes,
    dirichlet,
    iid,
    matching_test_split,
    perfedavg_paper,
    shards,
)


def _labels(per_class: int = 300, num_classes: int = 10, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(num_classes).repeat_interleave(per_class)
    return y[torch.randperm(y.numel(), generator=g)]


def _assert_disjoint(parts: list[torch.Tensor], n: int) -> None:
    allidx = torch.cat(parts)
    assert allidx.dtype == torch.long
    assert allidx.unique().numel() == allidx.numel(), "a sample is in two clients"
    assert int(allidx.min()) >= 0 and int(allidx.max()) < n


PARTITIONERS = {
    "iid": lambda y, seed: iid(y, 20, seed),
    "dirichlet": lambda y, seed: dirichlet(y, 20, 0.3, seed),
    "shards": lambda y, seed: shards(y, 20, 2, seed),
    "perfedavg_paper": lambda y, seed: perfedavg_paper(y, 20, 20, seed),
}


@pytest.mark.parametrize("name", sorted(PARTITIONERS))
def test_no_sample_is_given_to_two_clients(name: str) -> None:
    y = _labels()
    parts = PARTITIONERS[name](y, 0)
    assert len(parts) == 20
    _assert_disjoint(parts, y.numel())


@pytest.mark.parametrize("name", sorted(PARTITIONERS))
def test_partition_is_a_pure_function_of_the_seed(name: str) -> None:
    y = _labels()
    a, b = PARTITIONERS[name](y, 7), PARTITIONERS[name](y, 7)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_iid_covers_every_sample_in_near_equal_parts() -> None:
    y = _labels(per_class=101)
    parts = iid(y, 7, seed=3)
    sizes = [p.numel() for p in parts]
    assert sum(sizes) == y.numel() and max(sizes) - min(sizes) <= 1


def test_dirichlet_is_reproducible_from_seed_and_different_seeds_differ() -> None:
    y = _labels()
    a, b, c = dirichlet(y, 10, 0.5, seed=1), dirichlet(y, 10, 0.5, seed=1), dirichlet(y, 10, 0.5, seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(a, c, strict=True))
    assert sum(p.numel() for p in a) == y.numel()


def test_dirichlet_small_alpha_is_more_label_skewed_than_large_alpha() -> None:
    y = _labels()

    def mean_classes(alpha: float) -> float:
        parts = dirichlet(y, 10, alpha, seed=0)
        return sum(y[p].unique().numel() for p in parts) / len(parts)

    assert mean_classes(0.05) < mean_classes(100.0)


@pytest.mark.parametrize("alpha", [0.1, 1.0, 10.0])
def test_dirichlet_class_shares_follow_dir_alpha_ones(alpha: float) -> None:
    """The shares ``p_c`` of class c over the K clients are drawn from ``Dir(α·1_K)``: for p ~ Dir(α·1_K),
    ``E[Σ_k p_k²] = K · α(α + 1) / (Kα(Kα + 1)) = (α + 1) / (Kα + 1)``, while ``Dir(α/K·1_K)`` (the concentration
    spread over the clients, a common slip) gives ``(α/K + 1) / (α + 1)``: 1.7 to 3 times as much for these α.
    The sample mean over 10 classes × 20 seeds must be within 4 standard errors of the first, plus the
    rounding of the cuts (each share is ``floor(cumsum(p) n_c) / n_c``, off by less than 1/n_c)."""
    classes, per_class, k = 10, 1000, 10
    y = torch.arange(classes).repeat_interleave(per_class)
    sums = []
    for seed in range(20):
        parts = dirichlet(y, k, alpha, seed=seed)
        counts = torch.stack([torch.bincount(y[p], minlength=classes) for p in parts], dim=1).double()  # [C, K]
        assert torch.equal(counts.sum(1), torch.full((classes,), float(per_class), dtype=torch.float64))
        sums.append(((counts / per_class) ** 2).sum(1))
    values = torch.cat(sums)
    mean, stderr = values.mean().item(), values.std().item() / values.numel() ** 0.5
    expected, spread_over_k = (alpha + 1) / (k * alpha + 1), (alpha / k + 1) / (alpha + 1)
    tolerance = 4 * stderr + 2 / per_class
    assert abs(spread_over_k - expected) > 4 * tolerance  # the test can tell the two apart
    assert abs(mean - expected) < tolerance, (
        f"E[sum_k p_ck^2] = {mean:.4f} ± {stderr:.4f}; Dir(alpha*1) gives {expected:.4f}, "
        f"Dir(alpha/K*1) gives {spread_over_k:.4f}"
    )


@pytest.mark.parametrize("alpha", [0.0, -1.0])
def test_dirichlet_rejects_nonpositive_alpha_naming_the_value(alpha: float) -> None:
    with pytest.raises(ValueError, match=f"alpha must be > 0, got {alpha}"):
        dirichlet(_labels(), 5, alpha, seed=0)


def test_shards_gives_each_client_at_most_classes_per_client_classes_plus_boundaries() -> None:
    y = _labels(per_class=200)  # 2000 samples, 40 shards of 50: shards never straddle a class
    parts = shards(y, 20, 2, seed=0)
    assert all(y[p].unique().numel() <= 2 for p in parts)
    assert sum(p.numel() for p in parts) == y.numel()


@pytest.mark.parametrize("cpc", [0, 11, -2])
def test_shards_rejects_classes_per_client_out_of_range(cpc: int) -> None:
    with pytest.raises(ValueError, match=rf"classes_per_client must be an integer in \[1, 10\].*got {cpc}"):
        shards(_labels(), 5, cpc, seed=0)


@pytest.mark.parametrize("k", [0, -3])
def test_partitioners_reject_nonpositive_num_clients(k: int) -> None:
    with pytest.raises(ValueError, match=f"num_clients must be a positive integer, got {k}"):
        iid(_labels(), k, seed=0)


def test_perfedavg_paper_gives_exact_per_client_class_counts() -> None:
    y = _labels(per_class=1200)
    a, k = 50, 20
    parts = perfedavg_paper(y, k, a, seed=0)
    _assert_disjoint(parts, y.numel())
    for i, p in enumerate(parts):
        counts = torch.bincount(y[p], minlength=10)
        expected = torch.zeros(10, dtype=torch.long)
        if i < k // 2:
            expected[:5] = a
        else:
            j = (i - k // 2) % 5
            expected[j], expected[5 + j] = a // 2, 2 * a
        assert torch.equal(counts, expected), (i, counts.tolist())


def test_perfedavg_paper_class_counts_do_not_depend_on_seed_but_images_do() -> None:
    y = _labels(per_class=1200)
    a, b = perfedavg_paper(y, 10, 40, seed=0), perfedavg_paper(y, 10, 40, seed=1)
    for p, q in zip(a, b, strict=True):
        assert torch.equal(torch.bincount(y[p], minlength=10), torch.bincount(y[q], minlength=10))
    assert not all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_perfedavg_paper_reports_the_short_class_with_numbers() -> None:
    y = _labels(per_class=100)
    # class 0: 5 clients * 30 + 1 client * 15 = 165 > 100
    with pytest.raises(ValueError, match="class 0 needs 165 but has 100"):
        perfedavg_paper(y, 10, 30, seed=0)


def test_cap_client_sizes_keeps_a_random_subset() -> None:
    parts = iid(_labels(), 4, seed=0)
    capped = cap_client_sizes(parts, 100, seed=0)
    for p, c in zip(parts, capped, strict=True):
        assert c.numel() == 100 and torch.isin(c, p).all()


def test_matching_test_split_is_disjoint_and_follows_train_class_set() -> None:
    y_train, y_test = _labels(per_class=300), _labels(per_class=100, seed=5)
    parts = dirichlet(y_train, 8, 0.3, seed=0)
    train_labels = [y_train[p] for p in parts]
    tests = matching_test_split(train_labels, y_test, seed=0)
    _assert_disjoint(tests, y_test.numel())
    assert sum(t.numel() for t in tests) == y_test.numel()  # every class is trained on by someone
    for tl, t in zip(train_labels, tests, strict=True):
        assert set(y_test[t].tolist()) <= set(tl.tolist())


def test_matching_test_split_shares_are_proportional_to_train_shares() -> None:
    # class 0: clients hold 30 / 10 / 0 train samples -> 40 test samples split 30 / 10 / 0
    train = [torch.tensor([0] * 30 + [1] * 5), torch.tensor([0] * 10), torch.tensor([1] * 15)]
    test = torch.tensor([0] * 40 + [1] * 8)
    tests = matching_test_split(train, test, seed=0)
    counts = [torch.bincount(test[t], minlength=2).tolist() for t in tests]
    assert counts == [[30, 2], [10, 0], [0, 6]]


def test_matching_test_split_is_reproducible_from_seed() -> None:
    y_train, y_test = _labels(), _labels(per_class=50, seed=9)
    train_labels = [y_train[p] for p in shards(y_train, 10, 2, seed=0)]
    a = matching_test_split(train_labels, y_test, seed=4)
    b = matching_test_split(train_labels, y_test, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
