"""APFL: the conformance kit, α = 0 is FedAvg and α = 1 is local training (unequal clients, held-out clients,
partial participation), and the adaptive step against plain PyTorch autograd through the mixed model."""

from __future__ import annotations

import torch

from lightning_fedmeta.algorithms.apfl import APFL
from lightning_fedmeta.algorithms.fedavg import FedAvg
from lightning_fedmeta.client.functional import Batch, ClientContext
from lightning_fedmeta.testing import client_record
from tests.conftest import run_plain_rounds
from tests.helpers import tanh_mlp, tiny_data, tiny_module

LR = 0.3


def _client_batches(client: int, steps: int = 3, batch: int = 4) -> Batch:
    x, y = tiny_data().client_train(client)
    idx = (torch.arange(steps * batch) * 3 + client).remainder(x.shape[0]).view(steps, 1, batch)
    return Batch(x[idx], y[idx], torch.ones(steps, 1, batch))


def _params(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tanh_mlp(seed=seed).named_parameters()}


def test_apfl_alpha_zero_is_fedavg_with_held_out_clients_and_partial_participation() -> None:
    """α fixed at 0: the global model follows FedAvg's round for round (6 unequal clients, 2 held out, 2 a round),
    and every client, trained, unsampled or held out, is evaluated with it."""
    modules = {}
    for name, extra in (("fedavg", {}), ("apfl", {"alpha": 0.0, "adaptive": False})):
        module = tiny_module({"name": name, "local_lr": LR, "local_steps": 3, "batch_size": 4, **extra},
                             model=lambda: tanh_mlp(seed=0), clients_per_round=2, holdout_clients=2, seed=5)
        module.attach_data(tiny_data())
        run_plain_rounds(module, 3)
        modules[name] = module
    apfl, fedavg = modules["apfl"], modules["fedavg"]
    glob = apfl._global_params()
    for k, v in fedavg._global_params().items():
        torch.testing.assert_close(glob[k], v, rtol=0, atol=1e-6)
    assert 0 < int(apfl.seen.sum()) < 4 and int(apfl.is_holdout.sum()) == 2
    for i in range(6):
        got = dict(apfl.personalize(i).named_parameters())
        assert all(torch.equal(got[k], glob[k]) for k in glob), i


def test_apfl_alpha_one_is_local_training_whatever_the_global_model() -> None:
    """α fixed at 1: v_k is plain SGD from its stored value on its own batches (checked against FedAvg's local SGD
    from v_k), for two different global models; the upload is FedAvg's client update from w."""
    alg = APFL(alpha=1.0, adaptive=False, local_lr=LR)
    fedavg = FedAvg(local_lr=LR)
    ctx = ClientContext(tanh_mlp())
    for client in (1, 3):  # 8 and 14 samples, different labels
        batches, v0 = _client_batches(client), _params(seed=7)
        record = client_record(int(tiny_data().train_counts[client]), index=client, seen=True)
        local = fedavg.client_update(ctx, v0, batches, {}, {}, record).delta
        for w in (_params(seed=1), _params(seed=2)):
            out = alg.client_update(ctx, w, batches, {"personal": v0, "alpha": torch.tensor(1.0)}, {}, record)
            for k in v0:
                torch.testing.assert_close(out.state["personal"][k], v0[k] + local[k], rtol=0, atol=1e-6)
            global_part = fedavg.client_update(ctx, w, batches, {}, {}, record).delta
            assert all(torch.equal(out.delta[k], global_part[k]) for k in w)
            personal = alg.personalize(ctx, w, _client_batches(client, steps=0), out.state, {}, record)
            assert all(torch.equal(personal[k], out.state["personal"][k]) for k in w)


def test_apfl_adaptive_step_equals_autograd_through_the_mixed_model() -> None:
    """Unequal clients, α adaptive: v and α step along PyTorch autograd's gradients of f(α v + (1 − α) w_k) (α
    clipped to [0, 1]), w_k by plain SGD, all at the values before the step."""
    model = tanh_mlp()
    alg = APFL(alpha=0.4, local_lr=LR, alpha_lr=2.0)
    for client in (0, 3):
        batches, w0, v0 = _client_batches(client), _params(seed=1), _params(seed=2)
        record = client_record(int(tiny_data().train_counts[client]), index=client, seen=True)
        out = alg.client_update(ClientContext(model), w0, batches, {"personal": v0, "alpha": torch.tensor(0.4)}, {},
                                record)
        w, v, alpha = dict(w0), dict(v0), torch.tensor(0.4)
        for t in range(batches.x.shape[0]):
            x, y = batches.x[t, 0], batches.y[t, 0]
            wt = {k: t_.clone().requires_grad_() for k, t_ in w.items()}
            vt = {k: t_.clone().requires_grad_() for k, t_ in v.items()}
            at = alpha.clone().requires_grad_()
            loss_w = torch.nn.functional.cross_entropy(torch.func.functional_call(model, wt, (x,)), y)
            gw = torch.autograd.grad(loss_w, list(wt.values()))
            mixed = {k: at * vt[k] + (1 - at) * w[k] for k in v}
            loss_v = torch.nn.functional.cross_entropy(torch.func.functional_call(model, mixed, (x,)), y)
            *gv, ga = torch.autograd.grad(loss_v, [*vt.values(), at])
            w = {k: w[k] - LR * g for k, g in zip(w, gw, strict=True)}
            v = {k: v[k] - LR * g for k, g in zip(v, gv, strict=True)}
            alpha = (alpha - 2.0 * ga).clamp(0, 1).detach()
        for k in w0:
            torch.testing.assert_close(out.delta[k], w[k] - w0[k], rtol=0, atol=1e-6)
            torch.testing.assert_close(out.state["personal"][k], v[k], rtol=0, atol=1e-6)
        torch.testing.assert_close(out.state["alpha"], alpha, rtol=0, atol=1e-6)
        assert abs(float(alpha) - 0.4) > 1e-3, "α moved"
