"""LG-FedAvg: local lower layers, global top layers; FedPer with the split reversed (issue 27)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.lg_fedavg import LGFedAvg
from lightning_fedmeta.client.functional import Batch, ClientContext
from lightning_fedmeta.persistence.memory_store import map_state
from tests.conftest import run_plain_rounds
from tests.helpers import one_client, tiny_data

LOCAL = ("0.weight", "0.bias")
GLOBAL = ("2.weight", "2.bias")
COMMON = {"local_lr": 0.3, "local_steps": 3, "batch_size": 4}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def _module(algorithm: dict) -> FederatedModule:
    module = FederatedModule(model=_net(), algorithm=algorithm, clients_per_round=3, seed=5, holdout_clients=1)
    module.attach_data(tiny_data())
    return module


def test_lg_fedavg_is_fedper_with_the_split_reversed() -> None:
    """LG-FedAvg sharing the top layer == FedPer keeping the bottom layer on the first round (3 of 5 unequal
    training clients, all untrained, so both start from the initial local layers): the same global top layer and
    client states. Later they differ only where FedPer starts an untrained client from the mean head and LG-FedAvg
    from the initial local layers π⁰ (which it never sends); a held-out client is evaluated with (θ, π⁰)."""
    lg = _module({"name": "lg_fedavg", **COMMON})
    fedper = _module({"name": "fedper", "head_prefix": "0", **COMMON})
    initial = {k: v.clone() for k, v in lg.model.state_dict().items()}
    rounds = [run_plain_rounds(m, 1) for m in (lg, fedper)]
    assert all(torch.equal(a, b) for a, b in zip(*rounds, strict=True))
    for k, v in fedper.model.state_dict().items():
        expected = initial[k] if k in LOCAL else v  # LG-FedAvg's global local layers stay π⁰
        torch.testing.assert_close(lg.model.state_dict()[k], expected, rtol=0, atol=1e-6)
    for k in LOCAL:
        torch.testing.assert_close(lg.client_states.tensors["personal"][k], fedper.client_states.tensors["head"][k],
                                   rtol=0, atol=1e-6)
    held_out = int(lg.holdout[0])
    for k, v in lg.personalize(held_out).state_dict().items():  # finetune_steps = 0: (θ, π⁰)
        torch.testing.assert_close(v, lg.model.state_dict()[k], rtol=0, atol=0)


def test_client_trains_its_own_representation_with_the_global_top_layer() -> None:
    """One client by hand: joint SGD from (its stored bottom layer, the global top layer); it keeps the bottom
    layer and uploads the change of both; a client that never trained starts from the global bottom layer."""
    model = _net()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = tiny_data().client_train(2)
    idx = torch.arange(12).remainder(x.shape[0]).view(3, 1, 4)
    batches = Batch(x[idx], y[idx], torch.ones(3, 1, 4))
    ctx = ClientContext(model)
    alg = LGFedAvg(local_steps=3, local_lr=0.3)
    state = map_state(lambda v: v + 0.5, alg.init_client_state(params))
    assert sorted(state["personal"]) == sorted(LOCAL)
    for seen, start_local in ((True, state["personal"]), (False, state["personal"])):  # π_i: π⁰ until trained
        out = alg.client_update(ctx, params, batches, state, {}, one_client(seen=seen))
        w = {**params, **{k: start_local[k] for k in LOCAL}}
        for t in range(3):
            w, _ = ctx.sgd_step(w, batches.at(t, 0), 0.3)
        for k in LOCAL:
            torch.testing.assert_close(out.state["personal"][k], w[k], rtol=0, atol=1e-7)
        for k in params:  # the local layers' Δ is 0: they are not uploaded
            expected = torch.zeros_like(params[k]) if k in LOCAL else w[k] - params[k]
            torch.testing.assert_close(out.delta[k], expected, rtol=0, atol=1e-7)


def test_global_layers_are_named_by_global_prefix() -> None:
    params = dict(_net().named_parameters())
    assert LGFedAvg().personal_names(params) == list(LOCAL)
    assert LGFedAvg(global_prefix=["0", "2.bias"]).personal_names(params) == ["2.weight"]
    with pytest.raises(ValueError, match="does not leave both global and local layers"):
        LGFedAvg(global_prefix=["0", "2"]).personal_names(params)
    with pytest.raises(ValueError, match="global_prefix must be"):
        LGFedAvg(global_prefix=[2])  # type: ignore[list-item]
