"""The pure pieces of client-level DP (lightning_fedmeta.privacy.mechanism): clipping, noise, adaptive clip, accounting.

ε is checked against Opacus called directly (its RDPAccountant and its analysis functions) and, for q = 1,
against the closed form of the Gaussian mechanism's RDP; the other functions against hand computations.
"""

from __future__ import annotations

import ast
import math
import pathlib
import sys

import numpy as np
import pytest
import torch

from lightning_fedmeta.privacy import mechanism as privacy
from lightning_fedmeta.privacy.mechanism import (
    AdaptiveClipSpec,
    DPSpec,
    PrivacyAccountant,
    adapt_clip,
    clip_rows,
    gaussian_noise,
    noise_multipliers,
    parse_dp,
)

opacus_accountants = pytest.importorskip("opacus.accountants")
from opacus.accountants.analysis import rdp as opacus_rdp  # noqa: E402

CASES = [  # (q, σ, rounds, δ)
    (0.01, 1.0, 100, 1e-5),
    (0.1, 0.8, 30, 1e-3),
    (0.005, 2.5, 1000, 1e-6),
    (0.5, 1.3, 7, 1e-5),
    (1.0, 4.0, 20, 1e-5),
]


# ----------------------------------------------------------------------------------------------
# accountant
# ----------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:Optimal order is the")  # Opacus called directly warns; ours is silent
@pytest.mark.parametrize("q,sigma,rounds,delta", CASES)
def test_epsilon_equals_opacus_accountant_and_analysis(q: float, sigma: float, rounds: int, delta: float) -> None:
    ours = PrivacyAccountant(sigma, q)
    reference = opacus_accountants.RDPAccountant()
    for _ in range(rounds):
        ours.step()
        reference.step(noise_multiplier=sigma, sample_rate=q)
    assert ours.rounds == rounds
    assert ours.epsilon(delta) == reference.get_epsilon(delta)
    orders = opacus_accountants.RDPAccountant.DEFAULT_ALPHAS
    rdp = opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=rounds, orders=orders)
    eps, _ = opacus_rdp.get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
    assert ours.epsilon(delta) == float(eps)
    bulk = PrivacyAccountant(sigma, q)
    bulk.step(rounds)
    assert bulk.epsilon(delta) == ours.epsilon(delta)


def test_full_participation_matches_the_gaussian_closed_form() -> None:
    """q = 1: the RDP of T Gaussian releases is T·α/(2σ²) (Mironov 2017, Prop. 7), converted by Balle et al.
    2020, Thm. 21: ε = min_α RDP(α) + log((α−1)/α) − (log δ + log α)/(α − 1), over Opacus's orders."""
    sigma, rounds, delta = 3.0, 50, 1e-5
    acc = PrivacyAccountant(sigma, 1.0)
    acc.step(rounds)
    alphas = np.array(opacus_accountants.RDPAccountant.DEFAULT_ALPHAS, dtype=float)
    eps = rounds * alphas / (2 * sigma**2) + np.log((alphas - 1) / alphas) - (math.log(delta) + np.log(alphas)) / (
        alphas - 1
    )
    assert acc.epsilon(delta) == pytest.approx(float(eps.min()), rel=1e-12)
    # a smaller sample rate amplifies privacy; more noise, fewer rounds or a larger δ give a smaller ε
    sub = PrivacyAccountant(sigma, 0.1)
    sub.step(rounds)
    assert sub.epsilon(delta) < acc.epsilon(delta)


def test_epsilon_before_any_round_and_without_noise() -> None:
    acc = PrivacyAccountant(1.0, 0.1)
    assert acc.epsilon(1e-5) == 0.0 and acc.rounds == 0
    assert acc.epsilon_after(0, 1e-5) == 0.0
    silent = PrivacyAccountant(0.0, 0.1)
    assert silent.epsilon(1e-5) == 0.0
    assert silent.epsilon_after(1, 1e-5) == math.inf
    silent.step()
    assert silent.epsilon(1e-5) == math.inf


def test_epsilon_after_does_not_mutate_and_equals_stepping() -> None:
    acc = PrivacyAccountant(1.1, 0.02)
    acc.step(40)
    before = acc.state_dict()
    predicted = acc.epsilon_after(25, 1e-5)
    assert acc.state_dict() == before and acc.rounds == 40
    assert predicted > acc.epsilon(1e-5)
    acc.step(25)
    assert acc.epsilon(1e-5) == predicted


def test_state_dict_round_trip_through_a_weights_only_checkpoint(tmp_path: pathlib.Path) -> None:
    acc = PrivacyAccountant(0.9, 0.05)
    acc.step(12)
    path = tmp_path / "acc.pt"
    torch.save({"accountant": acc.state_dict()}, path)
    state = torch.load(path, weights_only=True)["accountant"]
    restored = PrivacyAccountant(0.9, 0.05)
    restored.load_state_dict(state)
    assert restored.rounds == 12
    assert restored.epsilon(1e-5) == acc.epsilon(1e-5)
    restored.step(3)
    acc.step(3)
    assert restored.epsilon(1e-5) == acc.epsilon(1e-5)


def test_a_resumed_run_with_other_settings_composes_both_phases() -> None:
    first = PrivacyAccountant(1.0, 0.05)
    first.step(10)
    second = PrivacyAccountant(2.0, 0.1)  # resumed with more noise and a larger cohort
    second.load_state_dict(first.state_dict())
    second.step(5)
    reference = opacus_accountants.RDPAccountant()
    for _ in range(10):
        reference.step(noise_multiplier=1.0, sample_rate=0.05)
    for _ in range(5):
        reference.step(noise_multiplier=2.0, sample_rate=0.1)
    assert second.rounds == 15
    assert second.epsilon(1e-5) == reference.get_epsilon(1e-5)


@pytest.mark.parametrize("z,q", [(-1.0, 0.1), (math.inf, 0.1), (1.0, 0.0), (1.0, 1.5)])
def test_accountant_refuses_bad_settings(z: float, q: float) -> None:
    with pytest.raises(ValueError, match="noise_multiplier|sample_rate"):
        PrivacyAccountant(z, q)


def test_opacus_is_imported_lazily_and_missing_opacus_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    tree = ast.parse(pathlib.Path(privacy.__file__).read_text())
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top_level if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top_level if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.startswith("opacus")]
    monkeypatch.setitem(sys.modules, "opacus.accountants", None)
    acc = PrivacyAccountant(1.0, 0.1)
    acc.step()
    with pytest.raises(ImportError, match=r'pip install "lightning-fedmeta\[privacy\]"'):
        acc.epsilon(1e-5)


# ----------------------------------------------------------------------------------------------
# clipping and noise
# ----------------------------------------------------------------------------------------------
def test_clip_rows_bounds_every_norm_and_keeps_rows_inside_the_ball() -> None:
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(50, 37, generator=g) * torch.linspace(0.01, 3.0, 50).unsqueeze(1)
    rows[7] = 0.0
    clip = 1.5
    clipped, norms = clip_rows(rows, clip)
    assert torch.equal(norms, torch.linalg.vector_norm(rows, dim=1))
    new_norms = torch.linalg.vector_norm(clipped, dim=1)
    assert bool((new_norms <= clip * (1 + 1e-6)).all())
    inside = norms <= clip
    assert 0 < int(inside.sum()) < 50
    assert torch.equal(clipped[inside], rows[inside])  # bit for bit, the zero row included
    outside = ~inside
    torch.testing.assert_close(new_norms[outside], torch.full((int(outside.sum()),), clip), rtol=1e-6, atol=0)
    # the direction is kept: clipped = rows · C/‖row‖
    torch.testing.assert_close(clipped[outside], rows[outside] * (clip / norms[outside]).unsqueeze(1))
    # a tensor clip gives the same result
    again, _ = clip_rows(rows, torch.tensor(clip))
    assert torch.equal(again, clipped)


def test_clip_rows_at_infinity_is_the_identity() -> None:
    rows = torch.randn(6, 11, dtype=torch.float64) * 1e30
    clipped, norms = clip_rows(rows, math.inf)
    assert torch.equal(clipped, rows)
    assert torch.equal(norms, torch.linalg.vector_norm(rows, dim=1))
    assert torch.equal(clip_rows(rows, torch.tensor(math.inf))[0], rows)
    with pytest.raises(ValueError, match=r"\[n, d\]"):
        clip_rows(rows[0], 1.0)


def test_gaussian_noise_is_the_generators_draw_scaled() -> None:
    like = torch.zeros(4, 5, dtype=torch.float64)
    noise = gaussian_noise(like, 0.3, torch.Generator().manual_seed(11))
    expected = torch.randn(4, 5, generator=torch.Generator().manual_seed(11), dtype=torch.float64) * 0.3
    assert noise.dtype == torch.float64 and torch.equal(noise, expected)
    half = gaussian_noise(torch.zeros(3, dtype=torch.bfloat16), 2.0, torch.Generator().manual_seed(1))
    expected = (torch.randn(3, generator=torch.Generator().manual_seed(1)) * 2.0).to(torch.bfloat16)
    assert half.dtype == torch.bfloat16 and torch.equal(half, expected)
    # the empirical standard deviation of many draws is std
    big = gaussian_noise(torch.zeros(200_000), 0.7, torch.Generator().manual_seed(3))
    assert abs(float(big.std()) - 0.7) < 0.005 and abs(float(big.mean())) < 0.005


def test_zero_noise_is_exact_zeros_and_draws_nothing() -> None:
    g = torch.Generator().manual_seed(5)
    state = g.get_state()
    like = torch.full((3, 2), math.inf)
    out = gaussian_noise(like, 0.0, g)
    assert torch.equal(out, torch.zeros(3, 2)) and torch.equal(g.get_state(), state)
    with pytest.raises(ValueError, match="standard deviation"):
        gaussian_noise(like, math.inf, g)


# ----------------------------------------------------------------------------------------------
# noise multipliers and adaptive clipping
# ----------------------------------------------------------------------------------------------
def test_noise_multipliers_without_adaptive_clipping() -> None:
    assert noise_multipliers(DPSpec(noise_multiplier=1.3), 10) == (1.3, 0.0)


def test_noise_multipliers_follow_theorem_1_of_andrew_et_al() -> None:
    # cohort 100: the default σ_b = 100/20 = 5, so σ_Δ = (1 − 1/100)^(−1/2) for z = 1
    spec = DPSpec(noise_multiplier=1.0, adaptive=AdaptiveClipSpec())
    sigma_delta, sigma_b = noise_multipliers(spec, 100)
    assert sigma_b == 5.0
    assert sigma_delta == pytest.approx(1 / math.sqrt(0.99), rel=1e-15)
    # explicit σ_b = 2, z = 3: σ_Δ = (1/9 − 1/16)^(−1/2) = 12/√7
    spec = DPSpec(noise_multiplier=3.0, adaptive=AdaptiveClipSpec(count_noise_multiplier=2.0))
    sigma_delta, sigma_b = noise_multipliers(spec, 7)
    assert sigma_b == 2.0 and sigma_delta == pytest.approx(12 / math.sqrt(7), rel=1e-14)
    # the pair is as private as one Gaussian mechanism with multiplier z
    assert (sigma_delta**-2 + (2 * sigma_b) ** -2) ** -0.5 == pytest.approx(3.0, rel=1e-14)
    # no noise at all
    assert noise_multipliers(DPSpec(noise_multiplier=0.0, adaptive=AdaptiveClipSpec()), 10) == (0.0, 0.0)


def test_noise_multipliers_refuse_a_count_noise_too_small() -> None:
    spec = DPSpec(noise_multiplier=1.0, adaptive=AdaptiveClipSpec())  # cohort 10: σ_b = 0.5, 2σ_b = 1 = z
    with pytest.raises(ValueError, match=r"model\.dp\.noise_multiplier=1\.0 must be below 2·σ_b = 1\.0"):
        noise_multipliers(spec, 10)
    spec = DPSpec(noise_multiplier=1.0, adaptive=AdaptiveClipSpec(count_noise_multiplier=0.25))
    with pytest.raises(ValueError, match=r"dp\.adaptive_clip\.count_noise_multiplier = 0\.25"):
        noise_multipliers(spec, 1000, option="dp")


def test_adapt_clip_matches_the_hand_computation() -> None:
    spec = DPSpec(clip=1.0, noise_multiplier=0.5,
                  adaptive=AdaptiveClipSpec(target_quantile=0.3, lr=0.4, count_noise_multiplier=0.75))
    norms = torch.tensor([0.5, 0.8, 1.0, 2.0, 3.0])  # 3 of 5 unclipped at C = 1 (‖Δ‖ ≤ C counts)
    xi = float(torch.randn((), generator=torch.Generator().manual_seed(42), dtype=torch.float64))
    b_bar = (3 + 0.75 * xi) / 5
    expected = 1.0 * math.exp(-0.4 * (b_bar - 0.3))
    assert adapt_clip(1.0, norms, 5, spec, xi) == pytest.approx(expected, rel=1e-15)


def test_adapt_clip_moves_towards_the_target_quantile() -> None:
    """Without count noise: all updates inside C (b̄ = 1 > γ) shrinks C by exp(−η(1 − γ)); none inside
    (b̄ = 0 < γ) grows it by exp(ηγ); exactly γ of them leaves it unchanged."""
    spec = DPSpec(clip=2.0, noise_multiplier=0.0,
                  adaptive=AdaptiveClipSpec(target_quantile=0.5, lr=0.2, count_noise_multiplier=0.0))
    small, large = torch.full((4,), 0.1), torch.full((4,), 10.0)
    assert adapt_clip(2.0, small, 4, spec, 5.0) == pytest.approx(2.0 * math.exp(-0.1), rel=1e-15)  # σ_b = 0: ξ unused
    assert adapt_clip(2.0, large, 4, spec) == pytest.approx(2.0 * math.exp(0.1), rel=1e-15)
    assert adapt_clip(2.0, torch.tensor([0.1, 0.1, 10.0, 10.0]), 4, spec) == 2.0
    with pytest.raises(ValueError, match="adaptive_clip"):
        adapt_clip(2.0, small, 4, DPSpec())


def test_adapt_clip_tracks_the_median_of_a_fixed_norm_distribution() -> None:
    """Iterated with the default γ = 0.5, the clip converges near the median norm (Andrew et al., Fig. 1)."""
    spec = DPSpec(clip=0.05, noise_multiplier=1.0, adaptive=AdaptiveClipSpec())
    norms_g = torch.Generator().manual_seed(1)
    clip = 0.05
    for r in range(300):
        norms = torch.rand(100, generator=norms_g, dtype=torch.float64) * 4  # median 2
        xi = float(torch.randn((), generator=torch.Generator().manual_seed(r), dtype=torch.float64))
        clip = adapt_clip(clip, norms, 100, spec, xi)
    assert 1.6 < clip < 2.4


# ----------------------------------------------------------------------------------------------
# parsing
# ----------------------------------------------------------------------------------------------
def test_parse_dp_reads_every_key() -> None:
    assert parse_dp(None) is None
    assert parse_dp({}) == DPSpec()
    spec = parse_dp({"clip": 0.5, "noise_multiplier": 2, "delta": 1e-6, "target_epsilon": 8,
                     "adaptive_clip": {"target_quantile": 0.7, "lr": 0.1, "count_noise_multiplier": 3}})
    assert spec == DPSpec(clip=0.5, noise_multiplier=2.0, delta=1e-6, target_epsilon=8.0,
                          adaptive=AdaptiveClipSpec(target_quantile=0.7, lr=0.1, count_noise_multiplier=3.0))
    assert parse_dp({"adaptive_clip": True}).adaptive == AdaptiveClipSpec()  # type: ignore[union-attr]
    assert parse_dp({"adaptive_clip": False}).adaptive is None  # type: ignore[union-attr]
    assert parse_dp({"clip": ".inf", "noise_multiplier": 0}).clip == math.inf  # type: ignore[union-attr]
    assert parse_dp({"clip": math.inf, "noise_multiplier": 0.0}).clip == math.inf  # type: ignore[union-attr]
    assert parse_dp(spec) is spec


@pytest.mark.parametrize("value,message", [
    ({"clipp": 1.0}, r"model\.dp\.clipp is not an option"),
    ({"clip": -1}, r"model\.dp\.clip must be > 0 .*-1"),
    ({"clip": 0}, r"model\.dp\.clip must be > 0"),
    ({"clip": "big"}, r"model\.dp\.clip must be a number, got 'big'"),
    ({"clip": True}, r"model\.dp\.clip must be a number, got True"),
    ({"clip": math.inf}, r"model\.dp\.clip=inf .*noise_multiplier=1\.0"),
    ({"clip": math.inf, "noise_multiplier": 0, "adaptive_clip": True}, r"model\.dp\.clip must be finite"),
    ({"noise_multiplier": -0.5}, r"model\.dp\.noise_multiplier must be a finite number >= 0, got -0\.5"),
    ({"noise_multiplier": math.nan}, r"model\.dp\.noise_multiplier must be a finite number"),
    ({"delta": 1.0}, r"model\.dp\.delta must be in \(0, 1\), got 1\.0"),
    ({"target_epsilon": 0}, r"model\.dp\.target_epsilon must be a finite number > 0, got 0"),
    ({"target_epsilon": 3, "noise_multiplier": 0}, r"model\.dp\.target_epsilon=3\.0 needs noise"),
    ({"adaptive_clip": "yes"}, r"model\.dp\.adaptive_clip must be true, false or a mapping"),
    ({"adaptive_clip": {"quantile": 0.5}}, r"model\.dp\.adaptive_clip\.quantile is not an option"),
    ({"adaptive_clip": {"target_quantile": 1.5}}, r"model\.dp\.adaptive_clip\.target_quantile must be in \(0, 1\), "
                                                  r"got 1\.5"),
    ({"adaptive_clip": {"lr": 0}}, r"model\.dp\.adaptive_clip\.lr must be a finite number > 0, got 0"),
    ({"adaptive_clip": {"count_noise_multiplier": -1}}, r"model\.dp\.adaptive_clip\.count_noise_multiplier"),
    ([1, 2], r"model\.dp must be a mapping"),
])
def test_parse_dp_errors_name_the_option_and_the_value(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_dp(value)  # type: ignore[arg-type]


def test_parse_dp_uses_the_given_option_name_and_dataclasses_check_themselves() -> None:
    with pytest.raises(ValueError, match=r"^dp\.delta must be in"):
        parse_dp({"delta": 0}, option="dp")
    with pytest.raises(ValueError, match=r"dp\.noise_multiplier"):
        DPSpec(noise_multiplier=-1.0)
    with pytest.raises(ValueError, match=r"dp\.adaptive_clip\.target_quantile"):
        AdaptiveClipSpec(target_quantile=0.0)
