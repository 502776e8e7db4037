"""Federated Reptile: FedAvg's client, a server step of size server_lr, one-step evaluation."""

from __future__ import annotations

import pytest
import torch

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.reptile import Reptile
from lightning_fedmeta.client.functional import Batch, ClientContext, tree_weighted_sum
from lightning_fedmeta.data import from_client_tensors
from tests.helpers import SmallClients, flat_params, one_client, tanh_mlp, train_small


def test_reptile_with_server_lr_one_equals_fedavg_whole_rounds() -> None:
    reptile = train_small({"name": "reptile", "alpha": 0.1, "local_steps": 3, "batch_size": 8}, server_lr=1.0)
    fedavg = train_small({"name": "fedavg", "local_lr": 0.1, "local_steps": 3, "batch_size": 8}, server_lr=1.0)
    assert torch.equal(flat_params(reptile.model), flat_params(fedavg.model))
    assert (flat_params(reptile.model) - flat_params(tanh_mlp())).abs().max() > 1e-3


def test_server_step_is_server_lr_times_the_weighted_mean_adaptation() -> None:
    algo = {"name": "reptile", "alpha": 0.1, "local_steps": 2, "batch_size": 8}
    probe = FederatedModule(model=tanh_mlp(), algorithm=algo, clients_per_round=3)
    probe.attach_data(from_client_tensors(SmallClients().client_data(), 3))
    w0 = {n: p.detach().clone() for n, p in probe.model.named_parameters()}
    _, out, weights = probe.compute_round(0)
    mean_delta = tree_weighted_sum(out.delta, weights)

    trained = train_small(algo, steps=1, server_lr=0.5)
    for name, p in trained.model.named_parameters():
        torch.testing.assert_close(p.detach(), w0[name] + 0.5 * mean_delta[name], atol=1e-6, rtol=0)


def test_evaluation_model_is_one_full_batch_sgd_step_at_alpha() -> None:
    algo = Reptile(alpha=0.07)
    assert (algo.eval_plan().steps, algo.eval_plan().batch_size, algo.finetune_lr) == (1, None, 0.07)
    model = tanh_mlp()
    ctx = ClientContext(model)
    g = torch.Generator().manual_seed(0)
    batch = Batch(torch.randn(1, 1, 10, 5, generator=g), torch.randint(0, 3, (1, 1, 10), generator=g),
                  torch.ones(1, 1, 10))
    w = {n: p.detach() for n, p in model.named_parameters()}
    personal = algo.personalize(ctx, w, batch, {}, {}, one_client())
    expected, _ = ctx.sgd_step(w, batch.at(0, 0), 0.07)
    for k in w:
        assert torch.equal(personal[k], expected[k])


def test_loop_and_vmap_clients_give_the_same_global_model() -> None:
    algo = {"name": "reptile", "alpha": 0.1, "local_steps": 2, "batch_size": 8}
    looped = flat_params(train_small(algo, "loop", server_lr=0.7).model)
    batched = flat_params(train_small(algo, "vmap", server_lr=0.7).model)
    torch.testing.assert_close(looped, batched, atol=1e-6, rtol=0)


def test_negative_alpha_raises_with_value() -> None:
    with pytest.raises(ValueError, match=r"alpha must be >= 0, got -0.5"):
        Reptile(alpha=-0.5)
