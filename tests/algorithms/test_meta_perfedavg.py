"""Per-FedAvg (fo / hf / exact): the local step against closed forms, autograd and FedAvg."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_fedmeta.algorithms.fedavg import FedAvg
from lightning_fedmeta.algorithms.perfedavg import PerFedAvg
from lightning_fedmeta.client.functional import Batch, ClientContext
from tests.helpers import one_client, tanh_mlp, train_small


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
class _Quadratic(nn.Module):
    """A "model" whose per-sample output is f(w) = ½ wᵀAw − bᵀw for every input (float64)."""

    def __init__(self, a: Tensor, b: Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([0.3, -0.7, 1.1], dtype=torch.float64))
        self.register_buffer("a", a)
        self.register_buffer("b", b)

    def forward(self, x: Tensor) -> Tensor:
        value = 0.5 * self.w @ self.a @ self.w - self.b @ self.w
        return value.expand(x.shape[0])


def _identity_loss(out: Tensor, y: Tensor) -> Tensor:
    return out


def _cross_entropy64(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits, y, reduction="none")  # keeps float64 (the default loss casts to float32)


def _batches(gen: torch.Generator, steps: int, per_step: int, size: int, dim: int, dtype: torch.dtype) -> Batch:
    x = torch.randn(steps, per_step, size, dim, generator=gen, dtype=dtype)
    y = torch.randint(0, 3, (steps, per_step, size), generator=gen)
    return Batch(x, y, torch.ones(steps, per_step, size, dtype=dtype))


def _params(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _flat(params: dict[str, Tensor]) -> Tensor:
    return torch.cat([v.reshape(-1) for v in params.values()])


# ----------------------------------------------------------------------------------------------
# maths of one local step
# ----------------------------------------------------------------------------------------------
def test_exact_step_equals_closed_form_on_quadratic() -> None:
    a = torch.tensor([[2.0, 0.5, 0.0], [0.5, 1.5, 0.3], [0.0, 0.3, 1.0]], dtype=torch.float64)
    b = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    model = _Quadratic(a, b)
    ctx = ClientContext(model, per_sample_loss=_identity_loss)
    alpha, beta = 0.1, 0.3
    algo = PerFedAvg(variant="exact", alpha=alpha, beta=beta, local_steps=1, batch_size=4)
    batches = _batches(torch.Generator().manual_seed(0), 1, 3, 4, 1, torch.float64)
    w = _params(model)
    out = algo.client_update(ctx, w, batches, {}, {}, one_client())

    w0 = w["w"]
    w_tilde = w0 - alpha * (a @ w0 - b)
    expected = w0 - beta * (torch.eye(3, dtype=torch.float64) - alpha * a) @ (a @ w_tilde - b)
    torch.testing.assert_close(w0 + out.delta["w"], expected, atol=1e-12, rtol=0)


def test_exact_step_equals_autograd_through_inner_step_on_logistic_regression() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    ctx = ClientContext(model, per_sample_loss=_cross_entropy64)
    alpha, beta = 0.2, 0.5
    algo = PerFedAvg(variant="exact", alpha=alpha, beta=beta, local_steps=1, batch_size=8)
    b = _batches(torch.Generator().manual_seed(3), 1, 3, 8, 4, torch.float64)
    # D″ = D, so the exact step is the gradient of w ↦ f(w − α∇f(w; D); D′)
    b = Batch(torch.stack([b.x[:, 0], b.x[:, 1], b.x[:, 0]], 1), torch.stack([b.y[:, 0], b.y[:, 1], b.y[:, 0]], 1),
              b.mask)
    w = _params(model)
    out = algo.client_update(ctx, w, b, {}, {}, one_client())

    leaves = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    inner = ctx.loss(leaves, b.at(0, 0))
    grads = torch.autograd.grad(inner, list(leaves.values()), create_graph=True)
    adapted = {k: leaves[k] - alpha * g for k, g in zip(leaves, grads, strict=True)}
    meta = torch.autograd.grad(ctx.loss(adapted, b.at(0, 1)), list(leaves.values()))
    for (k, v), g in zip(w.items(), meta, strict=True):
        torch.testing.assert_close(v + out.delta[k], v - beta * g, atol=1e-6, rtol=0)


def test_hessian_free_error_shrinks_like_delta_squared() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    ctx = ClientContext(model, per_sample_loss=_cross_entropy64)
    batches = _batches(torch.Generator().manual_seed(5), 1, 3, 16, 4, torch.float64)
    w = _params(model)
    common = {"alpha": 0.5, "beta": 1.0, "local_steps": 1, "batch_size": 16}
    exact = _flat(PerFedAvg(variant="exact", **common).client_update(ctx, w, batches, {}, {}, one_client()).delta)
    errors = []
    for delta in (1e-2, 1e-3):
        hf = PerFedAvg(variant="hf", delta=delta, **common).client_update(ctx, w, batches, {}, {}, one_client()).delta
        errors.append(float((_flat(hf) - exact).norm()))
    assert errors[1] > 0
    assert 60 < errors[0] / errors[1] < 160, errors


def test_first_order_with_alpha_zero_equals_fedavg_local_sgd() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    ctx = ClientContext(model)
    batches = _batches(torch.Generator().manual_seed(2), 4, 2, 8, 4, torch.float32)
    w = _params(model)
    fo = PerFedAvg(variant="fo", alpha=0.0, beta=0.1, local_steps=4, batch_size=8)
    fedavg = FedAvg(local_steps=4, local_lr=0.1, batch_size=8)
    # FO steps with D′ = batch 1 of each step; FedAvg sees exactly those batches
    d_prime = Batch(batches.x[:, 1:2], batches.y[:, 1:2], batches.mask[:, 1:2])
    out_fo = fo.client_update(ctx, w, batches, {}, {}, one_client())
    out_avg = fedavg.client_update(ctx, w, d_prime, {}, {}, one_client())
    for k in w:
        assert torch.equal(out_fo.delta[k], out_avg.delta[k])


def test_round_plan_draws_two_batches_for_fo_and_three_for_hf_and_exact() -> None:
    assert PerFedAvg(variant="fo", batch_size=40).round_plan().per_step == 2
    assert PerFedAvg(variant="hf").round_plan().per_step == 3
    plan = PerFedAvg(variant="exact", local_steps=7, batch_size=40).round_plan()
    assert (plan.steps, plan.per_step, plan.batch_size) == (7, 3, 40)


def test_evaluation_defaults_are_one_full_batch_step_at_alpha() -> None:
    algo = PerFedAvg(alpha=0.03, beta=0.2)
    assert (algo.finetune_steps, algo.finetune_lr, algo.finetune_batch_size) == (1, 0.03, None)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"variant": "second"}, r"variant must be one of \['exact', 'fo', 'hf'\], got 'second'"),
        ({"delta": 0.0}, r"delta must be > 0, got 0.0"),
        ({"alpha": -1.0}, r"alpha must be >= 0, got -1.0"),
        ({"beta": -0.1}, r"beta must be >= 0, got -0.1"),
    ],
)
def test_invalid_hyper_parameters_raise_with_value_and_range(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PerFedAvg(**kwargs)


# ----------------------------------------------------------------------------------------------
# whole rounds
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["fo", "hf", "exact"])
def test_loop_and_vmap_clients_give_the_same_global_model(variant: str) -> None:
    algo = {"name": "perfedavg", "variant": variant, "alpha": 0.05, "beta": 0.1, "local_steps": 1, "batch_size": 8}
    looped = _flat(_params(train_small(algo, "loop").model))
    batched = _flat(_params(train_small(algo, "vmap").model))
    torch.testing.assert_close(looped, batched, atol=1e-6, rtol=0)
    initial = _flat(_params(tanh_mlp()))
    assert (looped - initial).abs().max() > 1e-4
