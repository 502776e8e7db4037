"""centered_clipping: the contract (one call of the kit), then its own closed-form behaviour and its options.

Run against the INSTALLED distribution (``pip install ./plugins/fedmeta-centered-clip``)."""

from __future__ import annotations

import pytest
import torch
from lightning_fedmeta.reliability.robust import aggregate_rows, parse_aggregator
from lightning_fedmeta.testing import check_aggregator

from fedmeta_centered_clip import CenteredClipping


def test_centered_clipping_keeps_the_contract_of_a_robust_rule() -> None:
    check_aggregator({"name": "centered_clipping", "tau": 0.5, "iterations": 2})


def test_a_large_tau_is_the_mean_after_one_iteration() -> None:
    """τ above every distance: no clipping, so v¹ = v⁰ + mean(Δ_i − v⁰) = mean(Δ_i)."""
    rows = torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, -2.0]], dtype=torch.float64)
    out = CenteredClipping(tau=1e9, iterations=1)(rows, torch.full((3,), 1 / 3))
    torch.testing.assert_close(out, rows.mean(0))


def test_an_outlier_moves_the_estimate_by_at_most_tau_over_n_per_iteration() -> None:
    honest = torch.zeros(4, 3, dtype=torch.float64)
    rows = torch.cat([honest, torch.full((1, 3), 1e6, dtype=torch.float64)])
    spec = parse_aggregator({"name": "centered_clipping", "tau": 0.5, "iterations": 3})
    out = aggregate_rows(spec, rows, torch.full((5,), 0.2, dtype=torch.float64))
    assert float(torch.linalg.vector_norm(out)) <= 3 * 0.5 / 5 + 1e-12


@pytest.mark.parametrize(("options", "message"), [
    ({"tau": 0}, r"model\.aggregator\.tau must be a finite number > 0, got 0"),
    ({"iterations": 0}, r"model\.aggregator\.iterations must be an integer >= 1"),
    ({"beta": 0.1}, r"model\.aggregator\.beta does not apply to the centered_clipping rule"),
    ({"radius": 1.0}, r"model\.aggregator\.radius: unknown key; centered_clipping accepts name, clip, tau, iterations"),
])
def test_options_are_checked_by_the_constructor_and_named(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_aggregator({"name": "centered_clipping", **options})
