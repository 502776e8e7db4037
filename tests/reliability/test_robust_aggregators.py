"""Robust aggregation rules (lightning_fedmeta/reliability/robust.py) against hand computations and closed forms."""

from __future__ import annotations

import itertools
import math
import re
import warnings

import pytest
import torch

from lightning_fedmeta.client.functional import weighted_sum
from lightning_fedmeta.reliability.robust import (
    AGGREGATORS,
    AggregatorSpec,
    aggregate_rows,
    bulyan,
    check_aggregator,
    clip_rows,
    flatten_rows,
    geometric_median,
    krum_scores,
    parse_aggregator,
    unflatten_row,
)

EQUAL = torch.full((5,), 0.2, dtype=torch.float64)
UNEQUAL = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15], dtype=torch.float64)
WEIGHTS = pytest.mark.parametrize("weights", [EQUAL, UNEQUAL], ids=["equal", "unequal"])


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


# ----------------------------------------------------------------------------------------------
# parsing
# ----------------------------------------------------------------------------------------------
def test_parse_accepts_none_names_and_mappings() -> None:
    assert parse_aggregator(None) == AggregatorSpec("mean")
    assert parse_aggregator("median") == AggregatorSpec("median")
    assert parse_aggregator({"name": "trimmed_mean", "beta": 0.2}) == AggregatorSpec("trimmed_mean", beta=0.2)
    assert parse_aggregator({"name": "multi_krum", "f": 2, "m": 5, "clip": 3}) == AggregatorSpec(
        "multi_krum", f=2, m=5, clip=3.0)
    assert parse_aggregator({"clip": 1.5}) == AggregatorSpec("mean", clip=1.5)
    assert parse_aggregator({"name": "geometric_median", "iterations": 7, "eps": 1e-6}).iterations == 7
    assert parse_aggregator(AggregatorSpec("krum", f=1)) == AggregatorSpec("krum", f=1)
    assert [parse_aggregator(n).needs_f for n in AGGREGATORS] == [n in ("krum", "multi_krum", "bulyan")
                                                                   for n in AGGREGATORS]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("average", "model.aggregator: unknown aggregator 'average'; choose one of mean, median, trimmed_mean, krum"),
        ({"name": "krum", "beta": 0.2}, "model.aggregator.beta does not apply to the krum rule"),
        ({"name": "median", "f": 1}, "model.aggregator.f does not apply to the median rule"),
        ({"name": "mean", "m": 1}, "model.aggregator.m does not apply to the mean rule"),
        ({"name": "trimmed_mean", "bta": 0.2}, "model.aggregator.bta: unknown key"),
        ({"name": "trimmed_mean", "beta": 0.7}, "model.aggregator.beta must be a number in [0, 0.5), got 0.7"),
        ({"name": "trimmed_mean", "beta": "0.1"}, "model.aggregator.beta must be a number in [0, 0.5), got '0.1'"),
        ({"name": "krum", "f": -1}, "model.aggregator.f must be an integer >= 0"),
        ({"name": "krum", "f": 1.0}, "model.aggregator.f must be an integer >= 0"),
        ({"name": "krum", "f": True}, "model.aggregator.f must be an integer >= 0"),
        ({"name": "multi_krum", "m": 0}, "model.aggregator.m must be an integer >= 1"),
        ({"name": "median", "clip": 0}, "model.aggregator.clip must be a finite number > 0"),
        ({"name": "median", "clip": float("inf")}, "model.aggregator.clip must be a finite number > 0"),
        ({"name": "geometric_median", "iterations": 0}, "model.aggregator.iterations must be an integer >= 1"),
        ({"name": "geometric_median", "eps": -1.0}, "model.aggregator.eps must be a finite number > 0"),
        ({"name": 3}, "model.aggregator.name: unknown aggregator 3"),
        (3, "model.aggregator must be a rule's name"),
    ],
)
def test_parse_refuses_with_the_option_named(spec: object, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_aggregator(spec)  # type: ignore[arg-type]
    assert message in str(err.value)


def test_parse_names_the_option_the_caller_gives() -> None:
    with pytest.raises(ValueError, match=r"^aggregator\.beta must be"):
        parse_aggregator({"name": "trimmed_mean", "beta": 1}, option="aggregator")


# ----------------------------------------------------------------------------------------------
# check_aggregator
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "n", "f", "message"),
    [
        (AggregatorSpec("krum"), 6, 2, "model.aggregator: krum needs n > 2f + 2 updates per round, got n=6, f=2"),
        (AggregatorSpec("multi_krum"), 4, 1, "multi_krum needs n > 2f + 2 updates per round, got n=4, f=1"),
        (AggregatorSpec("bulyan"), 6, 1, "model.aggregator: bulyan needs n >= 4f + 3 updates per round, got n=6, f=1"),
        (AggregatorSpec("bulyan"), 10, 2, "bulyan needs n >= 4f + 3 updates per round, got n=10, f=2 (4f + 3 = 11)"),
        (AggregatorSpec("multi_krum", m=9), 10, 2, "model.aggregator.m must be in [1, n - f] = [1, 8] with n=10, f=2"),
        # beta < 0.5 leaves 2*floor(beta*n) < n for every n; a hand-made spec outside that range is refused by the
        # rule's constructor, naming the option
        (AggregatorSpec("trimmed_mean", beta=0.5), 4, 0, "model.aggregator.beta must be a number in [0, 0.5), got 0.5"),
        (AggregatorSpec("median"), 0, 0, "the number of updates per round must be >= 1, got n=0"),
        (AggregatorSpec("krum"), 9, -1, "model.aggregator.f must be an integer >= 0, got f=-1"),
    ],
)
def test_check_refuses_impossible_rules(spec: AggregatorSpec, n: int, f: int, message: str) -> None:
    with pytest.raises(ValueError) as err:
        check_aggregator(spec, n, f)
    assert message in str(err.value)


@pytest.mark.parametrize(
    ("spec", "n", "f", "past", "refusal"),
    [
        # the smallest n with n > 2f + 2; n = 6 is refused
        (AggregatorSpec("krum"), 7, 2, (AggregatorSpec("krum"), 6, 2), "krum needs n > 2f + 2"),
        # the largest m = n − f; m = 9 is refused
        (AggregatorSpec("multi_krum", m=8), 10, 2, (AggregatorSpec("multi_krum", m=9), 10, 2),
         "model.aggregator.m must be in [1, n - f]"),
        # n = 4f + 3; n = 6 is refused
        (AggregatorSpec("bulyan"), 7, 1, (AggregatorSpec("bulyan"), 6, 1), "bulyan needs n >= 4f + 3"),
        # 2⌊βn⌋ = 2 < 3: one value per coordinate is left; 2⌊0.5 · 2⌋ = 2 = n leaves none
        (AggregatorSpec("trimmed_mean", beta=0.49), 3, 0, (AggregatorSpec("trimmed_mean", beta=0.5), 2, 0),
         "model.aggregator.beta must be a number in [0, 0.5)"),
        # one update; none is refused
        (AggregatorSpec("median"), 1, 0, (AggregatorSpec("median"), 0, 0),
         "the number of updates per round must be >= 1"),
    ],
    ids=["krum", "multi_krum", "bulyan", "trimmed_mean", "median"],
)
def test_check_accepts_the_boundary_cases(
    spec: AggregatorSpec, n: int, f: int, past: tuple[AggregatorSpec, int, int], refusal: str
) -> None:
    """At the edge of its condition a rule is accepted without a word and runs: on ``n − f`` honest rows near
    ``base`` and ``f`` rows far away it returns a finite update inside the honest rows' coordinate-wise range (the
    exact one where the rule has a closed form here); one step past the edge is refused, naming the condition."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_aggregator(spec, n, f) is None
    g = torch.Generator().manual_seed(n)
    base = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    honest = base + 0.1 * torch.randn(n - f, 4, generator=g, dtype=torch.float64)
    rows = torch.cat([honest, 100.0 + torch.randn(f, 4, generator=g, dtype=torch.float64)])
    out = aggregate_rows(spec, rows, torch.full((n,), 1 / n, dtype=torch.float64), f=f)
    assert out.shape == (4,) and bool(torch.isfinite(out).all())
    assert bool((out >= honest.min(0).values).all() and (out <= honest.max(0).values).all()), out
    if spec.name == "krum":  # the honest row with the least score
        assert any(torch.equal(out, row) for row in honest)
    elif spec.name == "multi_krum":  # m = n − f: the mean of exactly the honest rows
        torch.testing.assert_close(out, honest.mean(0), rtol=1e-12, atol=1e-12)
    elif spec.name in ("trimmed_mean", "median"):  # one value left per coordinate: the median
        assert torch.equal(out, honest.median(0).values)
    with pytest.raises(ValueError, match=re.escape(refusal)):
        check_aggregator(*past)


def test_aggregate_rows_checks_the_rows_that_take_part() -> None:
    rows = torch.randn(6, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="krum needs n > 2f \\+ 2 updates per round, got n=6, f=2"):
        aggregate_rows(AggregatorSpec("krum"), rows, torch.full((6,), 1 / 6, dtype=torch.float64), f=2)


# ----------------------------------------------------------------------------------------------
# flattening
# ----------------------------------------------------------------------------------------------
def test_flatten_and_unflatten_are_inverse_in_key_order() -> None:
    tree = {"b": torch.arange(12.0).reshape(3, 2, 2), "a": torch.arange(3.0).reshape(3, 1) + 100}
    rows = flatten_rows(tree)
    assert rows.shape == (3, 5)
    assert rows[1].tolist() == [4.0, 5.0, 6.0, 7.0, 101.0]
    back = unflatten_row(rows[2], tree)
    assert list(back) == ["b", "a"]
    assert torch.equal(back["b"], tree["b"][2]) and torch.equal(back["a"], tree["a"][2])
    with pytest.raises(ValueError, match="the vector has 4 entries, the leaves 5"):
        unflatten_row(rows[0, :4], tree)


# ----------------------------------------------------------------------------------------------
# mean, median, trimmed mean, clipping
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_mean_is_weighted_sum_bit_for_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(7, 33, generator=g).to(dtype)
    weights = torch.rand(7, generator=g, dtype=torch.float64)
    weights = weights / weights.sum()
    out = aggregate_rows(AggregatorSpec("mean"), rows, weights)
    assert out.dtype == dtype
    assert torch.equal(out, weighted_sum(weights, rows))


@WEIGHTS
def test_coordinate_median_of_hand_written_rows(weights: torch.Tensor) -> None:
    rows = _t([[1, 10], [3, -2], [2, 5], [100, 0], [-7, 4]])
    # column 0 sorted: -7 1 2 3 100 -> 2; column 1 sorted: -2 0 4 5 10 -> 4 (unweighted: the weights do not matter)
    assert aggregate_rows(AggregatorSpec("median"), rows, weights).tolist() == [2.0, 4.0]


def test_median_of_an_even_count_is_the_mean_of_the_two_middle_values() -> None:
    rows = _t([[1, 0], [2, 0], [3, 1], [10, 1]])
    assert aggregate_rows(AggregatorSpec("median"), rows, torch.full((4,), 0.25)).tolist() == [2.5, 0.5]


@WEIGHTS
def test_trimmed_mean_of_hand_written_rows(weights: torch.Tensor) -> None:
    rows = _t([[1, 10], [3, -2], [2, 5], [100, 0], [-7, 4]])
    spec = AggregatorSpec("trimmed_mean", beta=0.2)  # floor(0.2 * 5) = 1 value trimmed at each end
    # column 0: drop -7 and 100 -> mean(1, 2, 3) = 2; column 1: drop -2 and 10 -> mean(0, 4, 5) = 3
    assert aggregate_rows(spec, rows, weights).tolist() == [2.0, 3.0]
    # beta = 0.1: floor(0.5) = 0 trimmed -> the plain (unweighted) mean
    torch.testing.assert_close(aggregate_rows(AggregatorSpec("trimmed_mean", beta=0.1), rows, weights),
                               rows.mean(dim=0))


def test_trimmed_mean_counts_beta_n_without_float_error() -> None:
    rows = torch.arange(10.0, dtype=torch.float64).reshape(10, 1)  # 0.3 * 10 = 3.0000000000000004
    out = aggregate_rows(AggregatorSpec("trimmed_mean", beta=0.3), rows, torch.full((10,), 0.1))
    assert out.tolist() == [4.5]  # mean(3, 4, 5, 6)


def test_zero_weight_rows_take_no_part_in_unweighted_rules() -> None:
    rows = _t([[1], [2], [3], [1000], [-1000]])
    weights = torch.tensor([0.2, 0.5, 0.3, 0.0, 0.0])
    assert aggregate_rows(AggregatorSpec("median"), rows, weights).tolist() == [2.0]


def test_clipping_bounds_every_norm_and_keeps_short_rows() -> None:
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(6, 40, generator=g, dtype=torch.float64) * torch.tensor([0.01, 1, 3, 10, 0.1, 0])[:, None]
    clipped = clip_rows(rows, 2.0)
    norms = torch.linalg.vector_norm(rows, dim=1)
    new = torch.linalg.vector_norm(clipped, dim=1)
    assert bool((new <= 2.0 + 1e-12).all())
    short = norms <= 2.0
    assert torch.equal(clipped[short], rows[short])
    torch.testing.assert_close(new[~short], torch.full_like(new[~short], 2.0))
    # the direction is kept: Δ_i · 2 / ‖Δ_i‖
    torch.testing.assert_close(clipped[~short], rows[~short] * (2.0 / norms[~short])[:, None])
    weights = torch.full((6,), 1 / 6, dtype=torch.float64)
    torch.testing.assert_close(aggregate_rows(AggregatorSpec("mean", clip=2.0), rows, weights),
                               weighted_sum(weights, clipped), rtol=0, atol=0)
    torch.testing.assert_close(aggregate_rows(AggregatorSpec("median", clip=2.0), rows, weights),
                               clipped.sort(dim=0).values[2:4].mean(dim=0))


# ----------------------------------------------------------------------------------------------
# Krum, Multi-Krum, Bulyan
# ----------------------------------------------------------------------------------------------
KRUM_ROWS = _t([[0, 0], [1, 0], [0, 2], [1, 1], [10, 10]])


def test_krum_scores_equal_the_hand_computation() -> None:
    # n = 5, f = 1: each score sums the n - f - 2 = 2 smallest squared distances to the others.
    # d01=1 d02=4 d03=2 d04=200 d12=5 d13=1 d14=181 d23=2 d24=164 d34=162
    # s0 = 1+2, s1 = 1+1, s2 = 2+4, s3 = 1+2, s4 = 162+164
    assert krum_scores(KRUM_ROWS, 1).tolist() == [3.0, 2.0, 6.0, 3.0, 326.0]


@WEIGHTS
def test_krum_picks_the_row_with_the_least_score(weights: torch.Tensor) -> None:
    assert aggregate_rows(AggregatorSpec("krum"), KRUM_ROWS, weights, f=1).tolist() == [1.0, 0.0]
    assert aggregate_rows(AggregatorSpec("krum", f=1), KRUM_ROWS, weights, f=0).tolist() == [1.0, 0.0]


@WEIGHTS
def test_multi_krum_averages_the_rows_with_the_least_scores(weights: torch.Tensor) -> None:
    spec = AggregatorSpec("multi_krum")
    # m = n - f = 4: rows 1 (2), 0 (3), 3 (3), 2 (6); the outlier is out
    assert aggregate_rows(spec, KRUM_ROWS, weights, f=1).tolist() == [0.5, 0.75]
    # m = 2: row 1, then row 0 (ties with row 3 at 3: the lower index)
    assert aggregate_rows(AggregatorSpec("multi_krum", m=2), KRUM_ROWS, weights, f=1).tolist() == [0.5, 0.0]
    got = aggregate_rows(AggregatorSpec("multi_krum", m=3), KRUM_ROWS, weights, f=1)
    torch.testing.assert_close(got, _t([[2 / 3, 1 / 3]])[0])


def test_bulyan_on_a_constructed_case() -> None:
    # n = 7, f = 1: theta = 5 Krum selections, then the beta = 3 values closest to the median.
    # Selections (scores over max(r - f - 2, 1) neighbours of the r rows left): 2 (tie with 3), 3, 1 (tie
    # with 4), 4, 0 (tie with 5) -> S = {2, 3, 1, 4, 0}, median 2, closest three 2, 1, 3 -> 2.
    rows = _t([[0], [1], [2], [3], [4], [5], [100]])
    assert aggregate_rows(AggregatorSpec("bulyan"), rows, torch.full((7,), 1 / 7), f=1).tolist() == [2.0]


def _reference_bulyan(rows: list[list[float]], f: int) -> list[float]:
    """El Mhamdi et al. 2018, Algorithm 1, in plain Python (the same neighbour count as the library)."""
    def sq(a: list[float], b: list[float]) -> float:
        return sum((x - y) ** 2 for x, y in zip(a, b, strict=True))

    left = list(range(len(rows)))
    chosen = []
    for _ in range(len(rows) - 2 * f):
        r = len(left)
        k = min(max(r - f - 2, 1), r - 1)
        scores = [sum(sorted(sq(rows[i], rows[j]) for j in left if j != i)[:k]) for i in left]
        pick = left[scores.index(min(scores))]
        chosen.append(pick)
        left.remove(pick)
    beta = len(chosen) - 2 * f
    out = []
    for c in range(len(rows[0])):
        vals = sorted(rows[i][c] for i in chosen)
        m = len(vals)
        med = vals[(m - 1) // 2] if m % 2 else (vals[m // 2 - 1] + vals[m // 2]) / 2
        closest = sorted((abs(rows[i][c] - med), pos) for pos, i in enumerate(chosen))[:beta]
        out.append(sum(rows[chosen[pos]][c] for _, pos in closest) / beta)
    return out


@pytest.mark.parametrize(("n", "f"), [(7, 1), (11, 2), (12, 2)])
def test_bulyan_matches_a_plain_python_reference(n: int, f: int) -> None:
    g = torch.Generator().manual_seed(n)
    rows = torch.randn(n, 4, generator=g, dtype=torch.float64)
    rows[:f] += 50.0  # the Byzantine ones
    expected = _reference_bulyan(rows.tolist(), f)
    torch.testing.assert_close(bulyan(rows, f), torch.tensor(expected, dtype=torch.float64))
    assert bool((bulyan(rows, f).abs() < 5).all())  # the outliers are not averaged in


# ----------------------------------------------------------------------------------------------
# geometric median (smoothed Weiszfeld)
# ----------------------------------------------------------------------------------------------
def test_geometric_median_of_collinear_points_is_their_weighted_median() -> None:
    points = _t([[0, 0], [1, 0], [5, 0]])
    equal = torch.full((3,), 1 / 3, dtype=torch.float64)
    torch.testing.assert_close(geometric_median(points, equal), _t([[1, 0]])[0], atol=1e-6, rtol=0)
    # weights 0.2, 0.35, 0.45: left mass at 1 is 0.55 > 0.5 and right mass 0.45 < 0.5 -> 1 again; with
    # 0.2, 0.25, 0.55 the point 5 holds more than half the mass -> 5
    torch.testing.assert_close(geometric_median(points, _t([[0.2, 0.35, 0.45]])[0]), _t([[1, 0]])[0],
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(geometric_median(points, _t([[0.2, 0.25, 0.55]])[0]), _t([[5, 0]])[0],
                               atol=1e-6, rtol=0)


def test_geometric_median_of_a_symmetric_configuration_is_its_centre() -> None:
    # a square around (3, -1) plus a point at its centre: the centre, whatever symmetric weights
    centre = torch.tensor([3.0, -1.0], dtype=torch.float64)
    offsets = _t([[2, 0], [0, 2], [-2, 0], [0, -2], [0, 0]])
    weights = torch.tensor([0.1, 0.3, 0.1, 0.3, 0.2], dtype=torch.float64)
    torch.testing.assert_close(geometric_median(centre + offsets, weights), centre, atol=1e-8, rtol=0)


def _objective(z: torch.Tensor, points: torch.Tensor, weights: torch.Tensor) -> float:
    return float((weights * torch.linalg.vector_norm(points - z, dim=1)).sum())


@WEIGHTS
def test_geometric_median_against_a_brute_force_minimiser(weights: torch.Tensor) -> None:
    g = torch.Generator().manual_seed(3)
    points = torch.randn(5, 2, generator=g, dtype=torch.float64) * 3
    got = aggregate_rows(AggregatorSpec("geometric_median"), points, weights)
    # brute force: a grid, refined 12 times around its best point
    best, half = points.mean(dim=0), 10.0
    for _ in range(12):
        axis = torch.linspace(-half, half, 81, dtype=torch.float64)
        grid = torch.stack(torch.meshgrid(axis, axis, indexing="ij"), dim=-1).reshape(-1, 2) + best
        values = (weights * torch.cdist(grid, points)).sum(dim=1)
        best, half = grid[int(values.argmin())], half / 8
    # (with unequal weights the minimiser is the data point of weight 0.4, reached up to the smoothing eps)
    assert _objective(got, points, weights) <= _objective(best, points, weights) + 1e-7
    torch.testing.assert_close(got, best, atol=1e-6, rtol=0)
    assert not torch.allclose(got, weighted_sum(weights, points), atol=1e-3)  # not just the mean


def test_geometric_median_resists_an_outlier_the_mean_follows() -> None:
    rows = torch.cat([torch.zeros(4, 3, dtype=torch.float64), torch.full((1, 3), 1e6, dtype=torch.float64)])
    weights = torch.full((5,), 0.2, dtype=torch.float64)
    assert float(aggregate_rows(AggregatorSpec("geometric_median"), rows, weights).abs().max()) < 1e-3
    assert float(aggregate_rows(AggregatorSpec("mean"), rows, weights).abs().min()) == pytest.approx(2e5)


# ----------------------------------------------------------------------------------------------
# FedNova
# ----------------------------------------------------------------------------------------------
def test_fednova_with_unequal_steps_and_weights_matches_the_formula() -> None:
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(4, 6, generator=g, dtype=torch.float64)
    weights = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    steps = torch.tensor([1, 3, 5, 2])
    tau_eff = 0.1 * 1 + 0.2 * 3 + 0.3 * 5 + 0.4 * 2  # = 3.0
    expected = tau_eff * (0.1 * rows[0] / 1 + 0.2 * rows[1] / 3 + 0.3 * rows[2] / 5 + 0.4 * rows[3] / 2)
    got = aggregate_rows(AggregatorSpec("fednova"), rows, weights, steps=steps)
    torch.testing.assert_close(got, expected, rtol=1e-14, atol=1e-14)
    # equal steps: the weighted mean
    same = aggregate_rows(AggregatorSpec("fednova"), rows, weights, steps=torch.full((4,), 7))
    torch.testing.assert_close(same, weighted_sum(weights, rows), rtol=1e-14, atol=1e-14)
    # a client that took no step contributes nothing (and is not divided by zero)
    none = aggregate_rows(AggregatorSpec("fednova"), rows, weights, steps=torch.tensor([0, 3, 5, 2]))
    tau0 = 0.2 * 3 + 0.3 * 5 + 0.4 * 2
    torch.testing.assert_close(none, tau0 * (0.2 * rows[1] / 3 + 0.3 * rows[2] / 5 + 0.4 * rows[3] / 2))
    with pytest.raises(ValueError, match="fednova needs the local steps"):
        aggregate_rows(AggregatorSpec("fednova"), rows, weights)


# ----------------------------------------------------------------------------------------------
# every rule: dtypes, determinism, robustness to one far outlier
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", AGGREGATORS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_every_rule_keeps_dtype_and_is_deterministic(name: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(9, 17, generator=g).to(dtype)
    weights = torch.rand(9, generator=g)
    weights = weights / weights.sum()
    steps = torch.arange(1, 10)
    a = aggregate_rows(AggregatorSpec(name), rows, weights, f=1, steps=steps)
    b = aggregate_rows(AggregatorSpec(name), rows.clone(), weights.clone(), f=1, steps=steps)
    assert a.shape == (17,) and a.dtype == dtype
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["median", "trimmed_mean", "krum", "multi_krum", "bulyan", "geometric_median"])
def test_robust_rules_ignore_one_far_outlier(name: str) -> None:
    g = torch.Generator().manual_seed(6)
    honest = 1.0 + 0.1 * torch.randn(8, 5, generator=g, dtype=torch.float64)
    rows = torch.cat([honest[:3], torch.full((1, 5), -1e4, dtype=torch.float64), honest[3:]])
    weights = torch.full((9,), 1 / 9, dtype=torch.float64)
    spec = AggregatorSpec(name, beta=0.2) if name == "trimmed_mean" else AggregatorSpec(name)  # floor(0.2 * 9) = 1
    out = aggregate_rows(spec, rows, weights, f=1)
    assert float((out - 1.0).abs().max()) < 0.5
    assert float(aggregate_rows(AggregatorSpec("mean"), rows, weights).max()) < -1000


def test_scores_are_invariant_to_the_row_order() -> None:
    g = torch.Generator().manual_seed(7)
    rows = torch.randn(6, 3, generator=g, dtype=torch.float64)
    scores = krum_scores(rows, 1)
    for perm in itertools.islice(itertools.permutations(range(6)), 0, 720, 97):
        p = torch.tensor(perm)
        torch.testing.assert_close(krum_scores(rows[p], 1), scores[p])
    # and equal to the definition: sum of the n - f - 2 = 3 smallest squared distances to the others
    d = torch.cdist(rows, rows) ** 2
    expected = [sorted(d[i, j].item() for j in range(6) if j != i)[:3] for i in range(6)]
    torch.testing.assert_close(scores, torch.tensor([math.fsum(e) for e in expected], dtype=torch.float64))
