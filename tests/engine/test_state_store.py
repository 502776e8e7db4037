"""ClientStateStore holds a dict of ``[K, ...]`` tensors, or a nested dict of them (flattened only in
``state_dict``), and gathers/scatters client rows the same way for both."""

from __future__ import annotations

import pytest
import torch

from lightning_fedmeta.client.execution import run_clients
from lightning_fedmeta.persistence.memory_store import ClientStateStore, flatten_state, unflatten_state


def _nested(k: int = 4) -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "personal": {"0.weight": torch.randn(k, 3, 2, generator=g), "0.bias": torch.randn(k, 3, generator=g)},
        "cluster": torch.arange(k),
    }


def test_a_flat_state_is_saved_as_it_is() -> None:
    flat = {"c_i.weight": torch.ones(3, 2), "c_i.bias": torch.zeros(3)}
    store = ClientStateStore(flat)
    assert list(store.state_dict()) == ["c_i.weight", "c_i.bias"] and store.keys() == ["c_i.weight", "c_i.bias"]
    assert len(store) == 2 and store.nbytes() == 4 * 9
    again = ClientStateStore()
    again.load_state_dict(store.state_dict())
    assert set(again.tensors) == set(flat) and all(torch.equal(again.tensors[k], v) for k, v in flat.items())


def test_a_nested_state_is_flattened_only_in_the_state_dict_and_restored() -> None:
    state = _nested()
    store = ClientStateStore(state)
    saved = store.state_dict()
    assert sorted(saved) == ["cluster", "personal/0.bias", "personal/0.weight"]
    assert flatten_state(unflatten_state(saved)).keys() == saved.keys()
    loaded = ClientStateStore()
    loaded.load_state_dict(saved)
    assert torch.equal(loaded.tensors["personal"]["0.weight"], state["personal"]["0.weight"])
    assert len(loaded) == 3


def test_gather_and_scatter_keep_the_nesting() -> None:
    store = ClientStateStore(_nested())
    idx = torch.tensor([2, 0])
    rows = store.gather(idx)
    assert rows["personal"]["0.weight"].shape == (2, 3, 2) and torch.equal(rows["cluster"], torch.tensor([2, 0]))
    rows["personal"]["0.weight"] = rows["personal"]["0.weight"] + 1.0
    before = store.tensors["personal"]["0.weight"].clone()
    store.scatter(idx, rows)
    after = store.tensors["personal"]["0.weight"]
    assert torch.equal(after[[2, 0]], before[[2, 0]] + 1.0) and torch.equal(after[[1, 3]], before[[1, 3]])
    with pytest.raises(KeyError, match="client state keys changed"):
        store.scatter(idx, {"cluster": rows["cluster"]})


def test_keys_a_checkpoint_could_not_hold_are_refused_when_the_store_is_built() -> None:
    with pytest.raises(ValueError, match="without '/'"):
        ClientStateStore({"a/b": torch.zeros(2)})
    with pytest.raises(ValueError, match="not a tensor or a dict"):
        ClientStateStore({"a": 1.0})


@pytest.mark.parametrize("mode", ["loop", "vmap"])
def test_nested_client_state_runs_looped_and_batched(mode: str) -> None:
    rows = ClientStateStore(_nested()).gather(torch.arange(4))

    def fn(scale: torch.Tensor, state: dict) -> dict:
        return {"personal": {k: v * scale for k, v in state["personal"].items()}, "cluster": state["cluster"] + 1}

    out = run_clients(fn, (torch.tensor(2.0),), (rows,), 4, mode, chunk_size=3)
    assert torch.equal(out["personal"]["0.bias"], 2.0 * rows["personal"]["0.bias"])
    assert torch.equal(out["cluster"], rows["cluster"] + 1)
