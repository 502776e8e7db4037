"""The streamed aggregate (issue 29: 1000 ResNet-18 clients did not fit one GPU because every update was stacked):
``Σ w_i Δ_i`` summed chunk by chunk equals the stacked aggregate, keeps no stacked update, checks every chunk as
the stacked path checks the round, and is used exactly where the default weighted mean is the whole server side."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.client.execution import run_clients
from lightning_fedmeta.data.federated import from_client_tensors
from lightning_fedmeta.persistence.memory_store import flatten_state
from lightning_fedmeta.registry import load_algorithm
from tests.helpers import NUM_CLASSES, NUM_FEATURES, make_tiny_clients

#: unequal clients (3 to 40 training rows); two are held out, 5 of the other 10 take part in each round
SIZES = [3, 25, 9, 40, 14, 5, 31, 11, 17, 6, 22, 8]


def _module(algorithm: dict[str, Any], *, batching: str = "vmap", chunk: int | None = 2, stream: bool = True,
            **kwargs: Any) -> FederatedModule:
    cls = load_algorithm(algorithm["name"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(NUM_FEATURES, 8), nn.Tanh(), nn.Linear(8, NUM_CLASSES))
    m = FederatedModule(model=model, algorithm={**cls.example_arguments(), **algorithm},
                        clients_per_round=5, holdout_clients=2, client_batching=batching, client_chunk_size=chunk,
                        compile_clients=False, seed=4, **kwargs)
    m.attach_data(from_client_tensors(make_tiny_clients(len(SIZES), train_sizes=SIZES), NUM_CLASSES))
    m.engine.stream_aggregate = stream
    return m


def _fit(m: FederatedModule, rounds: int = 3) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list]:
    """``rounds`` rounds of the engine; the global parameters, every client's state and the logged metrics."""
    optimizer = torch.optim.SGD(m.model.parameters(), lr=1.0)
    reports = [m.engine.run_round(r, optimizer) for r in range(rounds)]
    states = {k: v.clone() for k, v in flatten_state(m.engine.client_states.tensors).items()}
    return m.engine.global_params(), states, [{k: float(v) for k, v in r.metrics.items()} for r in reports]


def _assert_same_fit(a: tuple, b: tuple, atol: float) -> None:
    for name in a[0]:
        torch.testing.assert_close(a[0][name], b[0][name], rtol=0, atol=atol)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=0, atol=atol)
    assert [r.keys() for r in a[2]] == [r.keys() for r in b[2]]
    assert [v for r in a[2] for v in r.values()] == pytest.approx([v for r in b[2] for v in r.values()], abs=atol)


STREAMED = [{"name": "fedavg", "local_lr": 0.1}, {"name": "fedprox", "mu": 0.1}, {"name": "reptile"},
            {"name": "perfedavg", "variant": "hf"}, {"name": "ditto", "lam": 0.1}]


@pytest.mark.parametrize("algorithm", STREAMED, ids=lambda a: a["name"])
@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_streamed_rounds_equal_stacked_rounds(algorithm: dict[str, Any], batching: str) -> None:
    """Three rounds of 5 of 10 unequal clients in chunks of 2 (three partial sums a round), streamed and stacked:
    parameters, client states (Ditto's personal models) and metrics agree to float32 reassociation."""
    streamed = _module(algorithm, batching=batching)
    assert streamed.engine.streams_round()
    _assert_same_fit(_fit(streamed), _fit(_module(algorithm, batching=batching, stream=False)), atol=2e-6)


@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_one_chunk_streams_bit_for_bit(batching: str) -> None:
    """With every client in one chunk the streamed sum is the stacked path's weighted sum of the same tensor: the
    runs are equal bit for bit (why the fingerprinted runs did not change)."""
    a = _fit(_module({"name": "fedavg"}, batching=batching, chunk=None))
    b = _fit(_module({"name": "fedavg"}, batching=batching, chunk=None, stream=False))
    for name in a[0]:
        assert torch.equal(a[0][name], b[0][name])
    assert a[2] == b[2]


def test_streamed_rounds_with_local_epochs_in_step_groups_equal_stacked() -> None:
    """Under ``local_epochs`` the clients run in step groups, each summed separately: still the stacked result."""
    algorithm = {"name": "fedavg", "local_epochs": 2, "batch_size": 4}
    streamed = _module(algorithm)
    _assert_same_fit(_fit(streamed), _fit(_module(algorithm, stream=False)), atol=2e-6)


def test_a_streamed_round_never_holds_more_than_a_chunk_of_updates(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every chunk's outputs leave ``run_clients`` without their updates (the reducer kept only their weighted sum),
    the chunks hold at most ``client_chunk_size`` updates, and the server receives one summed row."""
    import lightning_fedmeta.loop.clients as clients_module  # the client half's run_clients call

    seen: list[int] = []

    def spying_run_clients(*args: Any, reduce: Any = None, **kwargs: Any) -> Any:
        def spy(pair: Any, chunk: slice) -> Any:
            seen.append(max(t.shape[0] for t in pair[0].delta.values()))
            kept = reduce(pair, chunk)
            assert kept[0].delta == {}, "a reduced chunk keeps no update"
            return kept
        return run_clients(*args, reduce=spy, **kwargs)

    monkeypatch.setattr(clients_module, "run_clients", spying_run_clients)
    m = _module({"name": "fedavg"}, chunk=2)
    results = []
    original = m.engine.combine
    monkeypatch.setattr(m.engine, "combine", lambda result, clip=float("inf"): results.append(result)
                        or original(result, clip))
    _fit(m, rounds=2)
    assert seen == [2, 2, 1, 2, 2, 1]
    assert all(r.delta_summed and all(v.shape[0] == 1 for v in r.output.delta.values()) for r in results)
    assert all(r.output.metrics["loss"].shape == (5,) for r in results)  # the clients' metrics are kept


def test_a_non_finite_client_in_a_streamed_chunk_is_named_before_the_sum() -> None:
    """A client whose update is not finite is named (as on the stacked path), and the model is left untouched,
    even though its chunk's partial sum would hide which client it was."""
    m = _module({"name": "fedavg"}, chunk=2)
    clients = m.engine.federation.round_clients(0).tolist()
    bad = clients[3]  # in the second chunk
    lo = int(m.engine.data.train_offsets[bad])
    m.engine.data.train_x[lo] = float("nan")
    before = {k: v.clone() for k, v in m.engine.global_params().items()}
    with pytest.raises(FloatingPointError, match=f"index {bad}"):
        m.engine.run_round(0, torch.optim.SGD(m.model.parameters(), lr=1.0))
    assert all(torch.equal(before[k], v) for k, v in m.engine.global_params().items())


@pytest.mark.parametrize(("algorithm", "options", "expected"), [
    ({"name": "fedavg"}, {}, True),
    ({"name": "ditto"}, {}, True),
    ({"name": "fedavg"}, {"compression": {"download": "float16"}}, True),
    ({"name": "scaffold"}, {}, False),  # its own aggregate (control variates)
    ({"name": "ifca"}, {}, False),
    ({"name": "fedavg"}, {"aggregator": {"name": "median"}}, False),
    ({"name": "fedavg"}, {"compression": {"upload": "topk", "fraction": 0.5}}, False),
])
def test_which_rounds_stream(algorithm: dict[str, Any], options: dict[str, Any], expected: bool) -> None:
    """Streaming needs the default weighted mean as the whole server side and updates nobody rewrites."""
    assert _module(algorithm, **options).engine.streams_round() is expected
