"""One policy for non-finite client outputs and aggregates, used by the simulation and a Flower deployment
(``RoundEngine.nonfinite``; issue 39, item 2): ``"raise"`` stops naming the client (the simulation's default),
``"drop"`` leaves a non-finite client out with renormalised weights and skips a round whose aggregate is not
finite (a deployment's: an untrusted node must not stop the run)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lightning_fedmeta.algorithms.base import ClientOutput
from lightning_fedmeta.loop.round import RoundResult
from tests.helpers import tiny_data, tiny_module


def _engine_and_round(nonfinite: str) -> tuple[object, RoundResult, torch.optim.Optimizer]:
    module = tiny_module({"name": "fedavg", "local_steps": 1, "batch_size": 4}, clients_per_round=3)
    module.attach_data(tiny_data())
    engine = module.engine
    engine.use_nonfinite(nonfinite)
    result = engine.compute(0)
    assert result is not None and result.clients.numel() == 3
    optimizer = torch.optim.SGD(module.model.parameters(), lr=1.0)
    return engine, result, optimizer


def _poisoned(result: RoundResult, row: int) -> RoundResult:
    """``result`` with client ``row``'s update made infinite."""
    delta = {k: v.clone() for k, v in result.output.delta.items()}
    next(iter(delta.values()))[row] = float("inf")
    return replace(result, output=ClientOutput(delta, *result.output[1:]))


def test_raise_names_the_client_and_stops() -> None:
    engine, result, optimizer = _engine_and_round("raise")
    bad = _poisoned(result, 1)
    with pytest.raises(FloatingPointError, match=f"index {int(result.clients[1])}"):
        engine.finite_result(bad)
    before = [p.detach().clone() for p in engine.model.parameters()]
    with pytest.raises(FloatingPointError, match="aggregated update is not finite"):
        engine.serve(0, bad, optimizer)  # the server half on an unchecked result: its aggregate is not finite
    assert all(torch.equal(a, p) for a, p in zip(before, engine.model.parameters(), strict=True))


def test_drop_leaves_the_client_out_with_renormalised_weights() -> None:
    engine, result, optimizer = _engine_and_round("drop")
    kept = engine.finite_result(_poisoned(result, 1))
    assert kept is not None
    assert kept.clients.tolist() == [int(result.clients[0]), int(result.clients[2])]
    assert torch.allclose(kept.weights, engine.federation.weights(kept.clients))
    assert float(kept.weights.sum()) == pytest.approx(1.0)
    for name, v in kept.output.delta.items():
        assert torch.equal(v, result.output.delta[name][[0, 2]])
    assert engine.finite_result(result) is result  # a finite round is untouched
    nobody = _poisoned(_poisoned(_poisoned(result, 0), 1), 2)
    assert engine.finite_result(nobody) is None


def test_drop_skips_a_round_whose_aggregate_is_not_finite() -> None:
    engine, result, optimizer = _engine_and_round("drop")
    before = [p.detach().clone() for p in engine.model.parameters()]
    report = engine.serve(0, _poisoned(result, 1), optimizer)
    assert report.skipped is not None and "not finite" in report.skipped
    assert all(torch.equal(a, p) for a, p in zip(before, engine.model.parameters(), strict=True))
    assert not bool(engine.federation.seen.any())  # nothing committed
