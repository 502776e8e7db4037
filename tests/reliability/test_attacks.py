"""Simulated Byzantine attacks (lightning_fedmeta/reliability/attacks.py) against their formulas."""

from __future__ import annotations

import pytest
import torch

from lightning_fedmeta.client.sampling import generator_for
from lightning_fedmeta.reliability.attacks import (
    ATTACKS,
    ByzantineSpec,
    alie_z,
    attack_rows,
    choose_byzantine_clients,
    flip_labels,
    parse_byzantine,
)

BYZ = torch.tensor([False, True, False, False, True, False])


def _rows() -> torch.Tensor:
    return torch.randn(6, 9, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


# ----------------------------------------------------------------------------------------------
# parsing
# ----------------------------------------------------------------------------------------------
def test_parse_byzantine_accepts_each_attack_and_its_parameter() -> None:
    assert parse_byzantine(None) is None
    assert parse_byzantine({"fraction": 0.2, "attack": "sign_flip"}) == ByzantineSpec(0.2, "sign_flip")
    assert parse_byzantine({"fraction": 0.1, "attack": "scaled", "scale": -4}).scale == -4.0
    assert parse_byzantine({"fraction": 0.1, "attack": "gaussian", "std": 3}).std == 3.0
    assert parse_byzantine({"fraction": 0.1, "attack": "alie", "z": 1.5}).z == 1.5
    assert parse_byzantine({"fraction": 0.1, "attack": "alie", "z": None}).z is None
    assert parse_byzantine({"fraction": 0.3, "attack": "ipm", "epsilon": 2}).epsilon == 2.0
    assert parse_byzantine(ByzantineSpec(0.2, "ipm", epsilon=0.5)) == ByzantineSpec(0.2, "ipm", epsilon=0.5)
    assert [ByzantineSpec(0.1, a).poisons_model for a in ATTACKS] == [a != "label_flip" for a in ATTACKS]
    # the literature's defaults
    spec = ByzantineSpec(0.1, "gaussian")
    assert (spec.scale, spec.std, spec.z, spec.epsilon) == (10.0, 200.0, None, 0.1)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"attack": "sign_flip"}, "model.byzantine.fraction is required"),
        ({"fraction": 0.2}, "model.byzantine.attack is required"),
        ({"fraction": 0.2, "attack": "flip"}, "model.byzantine.attack: unknown attack 'flip'; choose one of "
                                               "sign_flip, scaled, gaussian, alie, ipm, label_flip"),
        ({"fraction": 0.5, "attack": "ipm"}, "model.byzantine.fraction must be a number in (0, 0.5), got 0.5"),
        ({"fraction": 0, "attack": "ipm"}, "model.byzantine.fraction must be a number in (0, 0.5), got 0"),
        ({"fraction": "0.1", "attack": "ipm"}, "model.byzantine.fraction must be a number in (0, 0.5)"),
        ({"fraction": 0.1, "attack": "gaussian", "scale": 2}, "model.byzantine.scale does not apply to the gaussian"),
        ({"fraction": 0.1, "attack": "sign_flip", "epsilon": 2}, "model.byzantine.epsilon does not apply"),
        ({"fraction": 0.1, "attack": "ipm", "eps": 2}, "model.byzantine.eps: unknown key"),
        ({"fraction": 0.1, "attack": "gaussian", "std": 0}, "model.byzantine.std must be a finite number > 0"),
        ({"fraction": 0.1, "attack": "ipm", "epsilon": "big"}, "model.byzantine.epsilon must be a finite number > 0"),
        ({"fraction": 0.1, "attack": "alie", "z": float("nan")}, "model.byzantine.z must be a finite number"),
        ({"fraction": 0.1, "attack": "scaled", "scale": True}, "model.byzantine.scale must be a finite number"),
        ([0.1, "ipm"], "model.byzantine must be a mapping"),
    ],
)
def test_parse_byzantine_refuses_with_the_option_named(spec: object, message: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_byzantine(spec)  # type: ignore[arg-type]
    assert message in str(err.value)


# ----------------------------------------------------------------------------------------------
# who is Byzantine
# ----------------------------------------------------------------------------------------------
def test_byzantine_clients_are_a_pure_function_of_the_seed() -> None:
    eligible = torch.tensor([0, 2, 3, 5, 7, 8, 9, 11, 12, 14])
    chosen = choose_byzantine_clients(7, eligible, 0.2)
    perm = torch.randperm(10, generator=generator_for(7, "byzantine"))
    assert chosen.tolist() == sorted(eligible[perm[:2]].tolist())
    assert torch.equal(chosen, choose_byzantine_clients(7, eligible.clone(), 0.2))
    assert set(chosen.tolist()) <= set(eligible.tolist())
    assert chosen.tolist() == sorted(chosen.tolist())
    others = {tuple(choose_byzantine_clients(s, eligible, 0.2).tolist()) for s in range(20)}
    assert len(others) > 5


@pytest.mark.parametrize(("k", "fraction", "count"), [(10, 0.1, 1), (10, 0.3, 3), (10, 0.25, 3), (10, 0.01, 1),
                                                     (7, 0.2, 1), (7, 0.3, 2), (100, 0.49, 49)])
def test_byzantine_count_rounds_half_up_and_is_at_least_one(k: int, fraction: float, count: int) -> None:
    assert choose_byzantine_clients(0, torch.arange(k), fraction).numel() == count


def test_byzantine_clients_must_leave_an_honest_one() -> None:
    with pytest.raises(ValueError, match="makes 1 of the 1 training clients Byzantine: no honest client is left"):
        choose_byzantine_clients(0, torch.tensor([4]), 0.1)


# ----------------------------------------------------------------------------------------------
# the attacks against their formulas
# ----------------------------------------------------------------------------------------------
def _check_honest_untouched(out: torch.Tensor, rows: torch.Tensor) -> None:
    assert torch.equal(out[~BYZ], rows[~BYZ])


def test_sign_flip_sends_minus_the_honest_mean() -> None:
    rows = _rows()
    out = attack_rows(ByzantineSpec(0.2, "sign_flip"), rows, BYZ, torch.Generator())
    _check_honest_untouched(out, rows)
    mu = (rows[0] + rows[2] + rows[3] + rows[5]) / 4
    torch.testing.assert_close(out[1], -mu)
    torch.testing.assert_close(out[4], -mu)


@pytest.mark.parametrize("epsilon", [0.1, 3.0])
def test_ipm_sends_minus_epsilon_times_the_honest_mean(epsilon: float) -> None:
    rows = _rows()
    out = attack_rows(ByzantineSpec(0.2, "ipm", epsilon=epsilon), rows, BYZ, torch.Generator())
    _check_honest_untouched(out, rows)
    mu = rows[~BYZ].mean(dim=0)
    torch.testing.assert_close(out[BYZ], (-epsilon * mu).expand(2, -1))


def test_alie_z_is_baruch_et_al_z_max() -> None:
    # n = 10: s = 6 - f; z = Phi^-1((10 - s) / 10)
    assert alie_z(10, 1) == pytest.approx(0.0, abs=1e-12)  # Phi^-1(0.5)
    assert alie_z(10, 2) == pytest.approx(0.2533471031357997, abs=1e-12)  # Phi^-1(0.6)
    assert alie_z(10, 3) == pytest.approx(0.5244005127080407, abs=1e-12)  # Phi^-1(0.7)
    assert alie_z(50, 12) == pytest.approx(0.5828415072712162, abs=1e-12)  # s = 14, Phi^-1(0.72)
    assert alie_z(4, 3) == pytest.approx(0.6744897501960817, abs=1e-12)  # s = max(0, 1) = 1: Phi^-1(0.75)


@pytest.mark.parametrize("z", [None, 1.5])
def test_alie_sends_the_honest_mean_plus_z_standard_deviations(z: float | None) -> None:
    rows = _rows()
    out = attack_rows(ByzantineSpec(0.2, "alie", z=z), rows, BYZ, torch.Generator())
    _check_honest_untouched(out, rows)
    h = rows[~BYZ]
    mu = h.mean(dim=0)
    sigma = ((h - mu) ** 2).sum(dim=0).div(3).sqrt()  # Bessel-corrected over the 4 honest rows
    zz = alie_z(6, 2) if z is None else z  # n = 6, f = 2: s = 2, Phi^-1(4/6)
    assert alie_z(6, 2) == pytest.approx(0.4307272992954576, abs=1e-12)
    torch.testing.assert_close(out[BYZ], (mu + zz * sigma).expand(2, -1))


@pytest.mark.parametrize("scale", [10.0, -4.0])
def test_scaled_multiplies_each_byzantine_clients_own_delta(scale: float) -> None:
    rows = _rows()
    out = attack_rows(ByzantineSpec(0.2, "scaled", scale=scale), rows, BYZ, torch.Generator())
    _check_honest_untouched(out, rows)
    torch.testing.assert_close(out[BYZ], scale * rows[BYZ], rtol=0, atol=0)


def test_gaussian_draws_from_the_generator_only() -> None:
    rows = _rows()
    spec = ByzantineSpec(0.2, "gaussian", std=3.0)
    torch.manual_seed(123)  # the global RNG must play no part
    out = attack_rows(spec, rows, BYZ, torch.Generator().manual_seed(9))
    torch.manual_seed(456)
    again = attack_rows(spec, rows, BYZ, torch.Generator().manual_seed(9))
    _check_honest_untouched(out, rows)
    assert torch.equal(out, again)
    expected = torch.randn(2, 9, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * 3.0
    torch.testing.assert_close(out[BYZ], expected, rtol=0, atol=0)
    other = attack_rows(spec, rows, BYZ, torch.Generator().manual_seed(10))
    assert not torch.equal(other[BYZ], out[BYZ])
    # a large sample has the stated standard deviation
    big = attack_rows(ByzantineSpec(0.2, "gaussian"), torch.zeros(2, 20000), torch.tensor([True, False]),
                      torch.Generator().manual_seed(0))
    assert float(big[0].std()) == pytest.approx(200.0, rel=0.03)
    assert torch.equal(big[1], torch.zeros(20000))


def test_label_flip_and_no_byzantine_row_leave_rows_unchanged() -> None:
    rows = _rows()
    assert attack_rows(ByzantineSpec(0.2, "label_flip"), rows, BYZ, torch.Generator()) is rows
    none = torch.zeros(6, dtype=torch.bool)
    for attack in ATTACKS:
        assert attack_rows(ByzantineSpec(0.2, attack), rows, none, torch.Generator()) is rows


def test_all_byzantine_rows_use_the_statistics_of_all_rows() -> None:
    rows = _rows()
    every = torch.ones(6, dtype=torch.bool)
    out = attack_rows(ByzantineSpec(0.2, "sign_flip"), rows, every, torch.Generator())
    torch.testing.assert_close(out, (-rows.mean(dim=0)).expand(6, -1))


def test_attacks_keep_dtype_and_do_not_modify_their_input() -> None:
    rows = _rows().to(torch.bfloat16)
    before = rows.clone()
    for attack in ATTACKS:
        out = attack_rows(ByzantineSpec(0.2, attack), rows, BYZ, torch.Generator().manual_seed(0))
        assert out.dtype == torch.bfloat16 and out.shape == rows.shape
    assert torch.equal(rows, before)
    with pytest.raises(ValueError, match="byzantine has 3 entries for 6 rows"):
        attack_rows(ByzantineSpec(0.2, "ipm"), rows, BYZ[:3], torch.Generator())


def test_flip_labels_maps_y_to_c_minus_one_minus_y() -> None:
    y = torch.tensor([0, 1, 2, 9, 5])
    assert flip_labels(y, 10).tolist() == [9, 8, 7, 0, 4]
    assert torch.equal(flip_labels(flip_labels(y, 10), 10), y)
    assert flip_labels(y, 10).dtype == y.dtype
