"""FedDBE against a plain-PyTorch re-implementation of the authors' client (PFLlib's clientdbe: a running mean of
the representations, a personal client_mean added before the head, two SGD optimisers) and server (FedAvg, the
global mean from the initialisation round), with unequal clients, partial participation and a held-out client."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.feddbe import FedDBE
from lightning_fedmeta.client.sampling import sample_clients
from tests.conftest import run_plain_rounds
from tests.helpers import tanh_mlp, tiny_data

ALG = {"name": "feddbe", "kappa": 3.0, "momentum": 0.5, "local_lr": 0.2, "local_steps": 3, "batch_size": 4}


def _reference_client(net: nn.Sequential, mu: Tensor, batches: tuple[Tensor, Tensor, Tensor],
                      global_mean: Tensor | None, kappa: float, momentum: float, lr: float) -> tuple[Tensor, Tensor]:
    """The authors' local epoch on the real rows of each batch; returns (client_mean, final running mean)."""
    client_mean = nn.Parameter(mu.clone())
    running = torch.zeros_like(mu)
    for x, y, m in zip(*batches, strict=True):
        x, y = x[0][m[0] > 0], y[0][m[0] > 0]
        rep = net[:-1](x)
        running = (1 - momentum) * running + momentum * rep.mean(0)
        if global_mean is None:
            loss = F.cross_entropy(net[-1](rep), y)
        else:
            loss = F.cross_entropy(net[-1](rep + client_mean), y) + kappa * (0.5 * (running - global_mean) ** 2).mean()
        net.zero_grad()
        client_mean.grad = None
        loss.backward()
        with torch.no_grad():
            for p in net.parameters():
                p -= lr * p.grad
            if client_mean.grad is not None:
                client_mean -= lr * client_mean.grad
        running = running.detach()
    return client_mean.detach(), running


def test_feddbe_matches_plain_pytorch_with_partial_participation_and_a_new_client() -> None:
    """Unequal clients, 3 of 5 eligible clients a round, one held out: after three rounds the global model, every
    trained client's μ_i and the global mean ḡ equal the reference; a trained client is scored with
    h(φ(x) + μ_i), the held-out client with the global model. Changing the rule (no stop-gradient on the running
    mean, ḡ weighted equally, μ not trained) fails."""
    module = FederatedModule(model=tanh_mlp(), algorithm=dict(ALG), clients_per_round=3, holdout_clients=1, seed=3)
    module.attach_data(tiny_data())
    glob = copy.deepcopy(module.model)
    mus: dict[int, Tensor] = {}
    global_mean: Tensor | None = None
    sizes = module.records(torch.arange(6)).num_samples.to(torch.float64)
    for r in range(3):
        sampled = sample_clients(module.seed, r, module.eligible, module.num_sampled)
        b = module._batches("train", r, sampled, module.algorithm.round_plan())
        n = sizes[sampled]
        nets, means = [], []
        for i, c in enumerate(sampled.tolist()):
            net = copy.deepcopy(glob)
            mus[c], running = _reference_client(net, mus.get(c, torch.zeros(8)), (b.x[i], b.y[i], b.mask[i]),
                                                global_mean, ALG["kappa"], ALG["momentum"], ALG["local_lr"])
            nets.append(net)
            means.append(running)
        with torch.no_grad():
            for name, p in glob.named_parameters():
                p.copy_(sum(float(n[i] / n.sum()) * dict(net.named_parameters())[name] for i, net in enumerate(nets)))
        if global_mean is None:
            global_mean = sum(float(n[i] / n.sum()) * means[i] for i in range(len(means)))
        assert torch.equal(run_plain_rounds(module, 1, first=r)[0], sampled)
    for name, p in glob.named_parameters():
        torch.testing.assert_close(dict(module.model.named_parameters())[name], p, rtol=0, atol=1e-5)
    torch.testing.assert_close(module.server_state["global_mean"], global_mean, rtol=0, atol=1e-5)
    stored = module.client_states.tensors["client_mean"]
    trained_after_round_0 = [c for c, mu in mus.items() if mu.abs().sum() > 0]
    assert trained_after_round_0, "some client trained its μ_i once ḡ was set"
    x = torch.randn(6, 5)
    for c in trained_after_round_0:
        torch.testing.assert_close(stored[c], mus[c], rtol=0, atol=1e-5)
        with torch.no_grad():
            expected = glob[-1](glob[:-1](x) + mus[c])
            torch.testing.assert_close(module.personalize(c, round_idx=3)(x), expected, rtol=0, atol=1e-5)
    new = int(module.holdout[0])
    with torch.no_grad():
        torch.testing.assert_close(module.personalize(new, round_idx=3)(x), glob(x), rtol=0, atol=1e-6)


def test_feddbe_first_round_is_fedavg() -> None:
    """Before ḡ exists (the initialisation round) FedDBE is FedAvg: the same global model after round 0 as the
    existing ``fedavg`` on the same draws, with unequal clients and 3 of 6 sampled."""
    models = {}
    for name in ("feddbe", "fedavg"):
        alg = {**ALG, "name": name} if name == "feddbe" else {"name": "fedavg", "local_lr": 0.2, "local_steps": 3,
                                                              "batch_size": 4}
        module = FederatedModule(model=tanh_mlp(), algorithm=alg, clients_per_round=3, seed=3)
        module.attach_data(tiny_data())
        run_plain_rounds(module, 1)
        models[name] = dict(module.model.named_parameters())
    for k, v in models["fedavg"].items():
        torch.testing.assert_close(models["feddbe"][k], v, rtol=0, atol=1e-6)


def test_feddbe_refuses_a_head_without_bias_and_bad_arguments() -> None:
    with pytest.raises(ValueError, match="kappa must be >= 0"):
        FedDBE(kappa=-1.0)
    with pytest.raises(ValueError, match="momentum must be > 0"):
        FedDBE(momentum=0.0)
    params = dict(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3, bias=False)).named_parameters())
    with pytest.raises(ValueError, match="give the last nn.Linear a bias"):
        FedDBE().init_client_state(params)
