"""FedRep and FedPer: shared body averaged, personal heads kept by the clients, loop/vmap agreement."""

from __future__ import annotations

from operator import itemgetter

import pytest
import torch
from torch import nn
from torch.func import grad

from lightning_fedmeta import ClientRecord, FederatedModule
from lightning_fedmeta.algorithms.shared_representation import FedPer, FedRep, head_names
from lightning_fedmeta.client.functional import Batch, ClientContext
from lightning_fedmeta.persistence.memory_store import flatten_state, map_state
from tests.conftest import run_plain_rounds
from tests.helpers import one_client, tiny_data, tiny_module

FEDREP = {"name": "fedrep", "local_lr": 0.2, "local_steps": 2, "head_steps": 2, "batch_size": 4}
FEDPER = {"name": "fedper", "local_lr": 0.2, "local_steps": 3, "batch_size": 4}


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))


def _module(algorithm: dict, batching: str = "loop", clients_per_round: int = 3) -> FederatedModule:
    return tiny_module(dict(algorithm), model=_net, clients_per_round=clients_per_round, client_batching=batching,
                       seed=3)


def test_default_head_is_the_last_layer() -> None:
    names = [n for n, _ in _net().named_parameters()]
    assert head_names(names, None) == ["2.weight", "2.bias"]
    assert head_names(names, "2") == ["2.weight", "2.bias"]
    assert head_names(names, ["0.bias", "2."]) == ["0.bias", "2.weight", "2.bias"]
    with pytest.raises(ValueError, match="matches no parameter"):
        head_names(names, "head")
    with pytest.raises(ValueError, match="leaving no shared body"):
        head_names(["weight", "bias"], None)


@pytest.mark.parametrize("algorithm", [FEDREP, FEDPER], ids=["fedrep", "fedper"])
def test_body_is_shared_heads_stay_personal_and_the_global_head_is_their_mean(algorithm: dict) -> None:
    module = _module(algorithm, "vmap", clients_per_round=6)
    module.attach_data(tiny_data())
    init = {k: v.clone() for k, v in module._global_params().items()}
    run_plain_rounds(module, 3)
    params = module._global_params()
    alg = module.algorithm
    states = module.client_states.tensors
    records = module.records(torch.arange(6))
    models = [
        alg.personal_start(params, map_state(itemgetter(c), states), {}, ClientRecord(*(t[c] for t in records)))
        for c in range(6)
    ]
    for k in ("0.weight", "0.bias"):
        assert not torch.equal(params[k], init[k]), "the body was not trained"
        for m in models:
            assert torch.equal(m[k], params[k])
    p = module.client_weight.float()
    for k in ("2.weight", "2.bias"):
        assert all(torch.equal(m[k], states["head"][k][c]) for c, m in enumerate(models)), "own head not used"
        # full participation, server lr 1: the global head is the p-weighted mean of the clients' heads
        torch.testing.assert_close(params[k], torch.tensordot(p, states["head"][k], dims=1), atol=1e-6, rtol=0)
    heads = states["head"]["2.weight"]
    assert (heads - heads[0]).abs().amax(dim=(1, 2))[1:].min() > 1e-4, "heads should differ between clients"


@pytest.mark.parametrize("algorithm", [FEDREP, FEDPER], ids=["fedrep", "fedper"])
def test_a_client_that_never_trained_uses_the_mean_head_not_its_initial_one(algorithm: dict) -> None:
    module = _module(algorithm, "vmap", clients_per_round=2)
    module.attach_data(tiny_data())
    run_plain_rounds(module, 1)
    never = int((~module.seen).nonzero()[0, 0])
    params = module._global_params()
    state = map_state(lambda v: v[never], module.client_states.tensors)
    record = ClientRecord(*(t[0] for t in module.records(torch.tensor([never]))))
    start = module.algorithm.personal_start(params, state, {}, record)
    for k in ("2.weight", "2.bias"):
        assert torch.equal(start[k], params[k])
        assert not torch.equal(start[k], state["head"][k]), "the test needs the initial head to differ"
    personal = module.personalize(never)
    assert torch.equal(personal.state_dict()["2.weight"], params["2.weight"])


def _ctx_params_batches() -> tuple[ClientContext, dict[str, torch.Tensor], Batch]:
    torch.manual_seed(1)
    model = _net()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    x, y = tiny_data().client_train(2)
    idx = torch.arange(16).remainder(x.shape[0]).view(4, 1, 4)
    return ClientContext(model), params, Batch(x[idx], y[idx], torch.ones(4, 1, 4))


def test_fedrep_trains_head_with_body_fixed_then_body_with_head_fixed() -> None:
    ctx, params, batches = _ctx_params_batches()
    alg = FedRep(head_steps=2, local_steps=2, local_lr=0.3)
    state = map_state(lambda v: v + 0.1, alg.init_client_state(params))
    out = alg.client_update(ctx, params, batches, state, {}, one_client(seen=True))

    body = {k: params[k] for k in ("0.weight", "0.bias")}
    head = {k: state["head"][k] for k in ("2.weight", "2.bias")}
    for t in range(2):
        g = grad(lambda h, b: ctx.loss({**body, **h}, b))(head, batches.at(t, 0))
        head = {k: head[k] - 0.3 * g[k] for k in head}
    for t in range(2, 4):
        g = grad(lambda w, b: ctx.loss({**w, **head}, b))(body, batches.at(t, 0))
        body = {k: body[k] - 0.3 * g[k] for k in body}
    for k in head:
        torch.testing.assert_close(out.state["head"][k], head[k], rtol=0, atol=1e-7)
    for k in body:
        torch.testing.assert_close(out.delta[k], body[k] - params[k], rtol=0, atol=1e-7)


def test_fedper_trains_body_and_head_jointly() -> None:
    ctx, params, batches = _ctx_params_batches()
    batches = Batch(*(t[:3] for t in batches))  # the round's plan: local_steps = 3 batches, all walked
    alg = FedPer(local_steps=3, local_lr=0.3)
    state = map_state(lambda v: v + 0.1, alg.init_client_state(params))
    out = alg.client_update(ctx, params, batches, state, {}, one_client(seen=True))
    w = {**params, **{k: state["head"][k] for k in ("2.weight", "2.bias")}}
    for t in range(3):
        w, _ = ctx.sgd_step(w, batches.at(t, 0), 0.3)
    for k in ("2.weight", "2.bias"):
        torch.testing.assert_close(out.state["head"][k], w[k], rtol=0, atol=1e-7)
    for k in ("0.weight", "0.bias"):
        torch.testing.assert_close(out.delta[k], w[k] - params[k], rtol=0, atol=1e-7)


@pytest.mark.parametrize("algorithm", [FEDREP, FEDPER], ids=["fedrep", "fedper"])
def test_loop_and_vmap_clients_agree(algorithm: dict) -> None:
    runs = {}
    for mode in ("loop", "vmap"):
        module = _module(algorithm, mode)
        module.attach_data(tiny_data())
        run_plain_rounds(module, 3)
        runs[mode] = module
    for k, v in runs["loop"].model.state_dict().items():
        torch.testing.assert_close(runs["vmap"].model.state_dict()[k], v, rtol=0, atol=1e-6)
    for k, v in flatten_state(runs["loop"].client_states.tensors).items():
        torch.testing.assert_close(flatten_state(runs["vmap"].client_states.tensors)[k], v, rtol=0, atol=1e-6)


def test_bad_hyperparameters_are_rejected() -> None:
    with pytest.raises(ValueError, match="head_steps must be an integer >= 1"):
        FedRep(head_steps=0)
    with pytest.raises(ValueError, match="head_prefix must be"):
        FedPer(head_prefix=[1])  # type: ignore[list-item]
