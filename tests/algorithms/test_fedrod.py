"""FedRoD: the conformance kit, the local step against plain PyTorch autograd on unequal clients, the prior, and a
run with held-out clients and partial participation."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_fedmeta.algorithms.base import client_records
from lightning_fedmeta.algorithms.fedavg import FedAvg
from lightning_fedmeta.algorithms.fedrod import ABSENT_SHIFT, FedRoD, balanced_log_prior
from lightning_fedmeta.client.functional import Batch, ClientContext
from lightning_fedmeta.testing import client_record
from tests.conftest import run_plain_rounds
from tests.helpers import tanh_mlp, tiny_data, tiny_module

LR = 0.3


def _client_batches(client: int, steps: int = 3, batch: int = 4) -> Batch:
    """``steps`` batches of one client of :func:`tiny_data` (clients have 5 to 14 samples and different labels)."""
    x, y = tiny_data().client_train(client)
    idx = (torch.arange(steps * batch) * 3 + client).remainder(x.shape[0]).view(steps, 1, batch)
    return Batch(x[idx], y[idx], torch.ones(steps, 1, batch))


def _reference(model: nn.Sequential, head_p: nn.Linear, batches: Batch, counts: torch.Tensor) -> None:
    """The authors' local loop (PFLlib clientrod.py) in plain PyTorch, in place: balanced softmax on body and
    generic head, cross-entropy of the detached generic logits plus the personal head on detached features."""
    body, head_g = model[:-1], model[-1]
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt_p = torch.optim.SGD(head_p.parameters(), lr=LR)
    for t in range(batches.x.shape[0]):
        x, y = batches.x[t, 0], batches.y[t, 0]
        rep = body(x)
        out_g = head_g(rep)
        loss = F.cross_entropy(out_g + counts.float().log(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss_p = F.cross_entropy(out_g.detach() + head_p(rep.detach()), y)
        opt_p.zero_grad()
        loss_p.backward()
        opt_p.step()


@pytest.mark.parametrize("client", [0, 3])
def test_fedrod_two_rounds_equal_plain_pytorch_on_unequal_clients(client: int) -> None:
    """Two calls of client_update (the client unseen, then seen with its stored head) equal the authors' loop: the
    uploaded Δ, the personal head, and the personalised model's logits θ_g(z) + θ_p(z). Client 0 lacks a class:
    the reference shifts it by log 0 = −∞, ours by −10⁴, with the same result."""
    data = tiny_data()
    counts = data.label_counts[client]
    model = tanh_mlp(seed=1)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    alg = FedRoD(local_lr=LR, local_steps=3, batch_size=4)
    records = client_records(data.train_counts.tolist())
    alg.bind_clients(records, data.label_counts)
    states = alg.init_client_states(params, records)
    state = {"personal_head": {k: v[client] for k, v in states["personal_head"].items()},
             "log_prior": states["log_prior"][client]}
    ctx = ClientContext(model)
    ref, head_p = copy.deepcopy(model), nn.Linear(8, 3)
    nn.init.zeros_(head_p.weight)
    nn.init.zeros_(head_p.bias)
    w = params
    for r, batches in enumerate([_client_batches(client), _client_batches(client, steps=2)]):
        record = client_record(int(data.train_counts[client]), index=client, seen=r > 0)
        out = alg.client_update(ctx, w, batches, state, {}, record)
        _reference(ref, head_p, batches, counts)
        w = {k: w[k] + out.delta[k] for k in w}
        state = out.state
        for k, v in ref.named_parameters():
            torch.testing.assert_close(w[k], v.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(state["personal_head"]["2.weight"], head_p.weight.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(state["personal_head"]["2.bias"], head_p.bias.detach(), rtol=0, atol=1e-6)
    personal = alg.personalize(ctx, w, _client_batches(client, steps=0), state, {},
                               client_record(10, index=client, seen=True))
    x = data.client_test(client)[0]
    want = ref(x) + head_p(ref[:-1](x))
    torch.testing.assert_close(ctx.predict(personal, x), want.detach(), rtol=0, atol=1e-5)


def test_fedrod_generic_part_is_fedavg_without_the_prior_and_differs_with_it() -> None:
    """``balanced=False``: the upload is FedAvg's client update; with the balanced softmax on a client whose
    classes are unequal it is not (the prior moves the generic model)."""
    data = tiny_data()
    client = 2
    model = tanh_mlp(seed=2)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    ctx, batches = ClientContext(model), _client_batches(client)
    record = client_record(int(data.train_counts[client]), index=client)
    fedavg = FedAvg(local_lr=LR).client_update(ctx, params, batches, {}, {}, record).delta
    deltas = {}
    for balanced in (False, True):
        alg = FedRoD(local_lr=LR, balanced=balanced)
        records = client_records(data.train_counts.tolist())
        alg.bind_clients(records, data.label_counts)
        states = alg.init_client_states(params, records)
        state = {"personal_head": {k: v[client] for k, v in states["personal_head"].items()},
                 "log_prior": states["log_prior"][client]}
        deltas[balanced] = alg.client_update(ctx, params, batches, state, {}, record).delta
    for k in params:
        torch.testing.assert_close(deltas[False][k], fedavg[k], rtol=0, atol=1e-6)
    assert len(set(data.label_counts[client].tolist())) > 1, "the client's classes are unequal"
    assert max(float((deltas[True][k] - fedavg[k]).abs().max()) for k in params) > 1e-3


def test_balanced_log_prior_is_log_counts_and_finite_for_absent_classes() -> None:
    prior = balanced_log_prior(torch.tensor([4, 0, 1]))
    assert torch.equal(prior, torch.tensor([float(torch.tensor(4.0).log()), ABSENT_SHIFT, 0.0]))
    assert torch.softmax(torch.zeros(3) + prior, 0)[1] == 0


def test_fedrod_held_out_clients_and_partial_participation() -> None:
    """6 clients, 2 held out, 2 sampled a round: stored priors are the data's; a held-out (and a never-sampled)
    client is evaluated with the generic model; a trained one with head θ_g + θ_p (its stored θ_p)."""
    module = tiny_module({"name": "fedrod", "local_lr": 0.2, "local_steps": 2, "batch_size": 4},
                         model=lambda: tanh_mlp(seed=0), clients_per_round=2, holdout_clients=2, seed=3)
    data = tiny_data()
    module.attach_data(data)
    run_plain_rounds(module, 1)
    states = module.client_states.tensors
    torch.testing.assert_close(states["log_prior"], balanced_log_prior(data.label_counts))
    glob = module._global_params()
    held = module.is_holdout.nonzero().flatten().tolist()
    trained = module.seen.nonzero().flatten().tolist()
    never = [i for i in range(6) if i not in trained]
    assert len(held) == 2 and len(trained) == 2 and len(never) == 4
    for i in never:
        got = dict(module.personalize(i).named_parameters())
        assert all(torch.equal(got[k], glob[k]) for k in glob), i
    for i in trained:
        got = dict(module.personalize(i).named_parameters())
        head = states["personal_head"]
        assert float(head["2.weight"][i].abs().max()) > 0, "the personal head trained"
        torch.testing.assert_close(got["2.weight"], glob["2.weight"] + head["2.weight"][i], rtol=0, atol=1e-6)
        assert torch.equal(got["0.weight"], glob["0.weight"])
