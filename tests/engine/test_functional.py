"""ClientContext's derivatives against closed forms and against each other."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import vmap

from lightning_fedmeta.client.functional import Batch, ClientContext, tree_axpy


def _squared_loss(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * (pred.squeeze(-1) - y.to(pred.dtype)) ** 2


def test_hvp_of_least_squares_equals_the_closed_form_hessian_product() -> None:
    """f(w) = mean_j ½(xⱼᵀw − yⱼ)²  ⇒  ∇²f = XᵀX / n, whatever w."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False).double()
    ctx = ClientContext(model, per_sample_loss=_squared_loss)
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    batch = Batch(x, y, torch.ones(7, dtype=torch.float64))
    params = {"weight": torch.randn(1, 4, dtype=torch.float64)}
    v = {"weight": torch.randn(1, 4, dtype=torch.float64)}
    expected = (x.T @ x / 7 @ v["weight"].T).T
    torch.testing.assert_close(ctx.hvp(params, batch, v)["weight"], expected)
    torch.testing.assert_close(ctx.hvp_forward_over_reverse(params, batch, v)["weight"], expected)


def test_reverse_and_forward_hvp_agree_on_an_mlp_under_vmap() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ELU(), nn.Linear(8, 3))
    ctx = ClientContext(model)
    c = 3
    params = {k: v.detach().unsqueeze(0).repeat(c, *[1] * v.dim()) + 0.1 * torch.randn(c, *v.shape)
              for k, v in model.named_parameters()}
    vec = {k: torch.randn_like(v) for k, v in params.items()}
    batch = Batch(torch.randn(c, 10, 6), torch.randint(0, 3, (c, 10)), torch.ones(c, 10))
    rev = vmap(ctx.hvp)(params, batch, vec)
    fwd = vmap(ctx.hvp_forward_over_reverse)(params, batch, vec)
    for k in rev:
        torch.testing.assert_close(rev[k], fwd[k], atol=1e-5, rtol=1e-4)


def test_masked_rows_do_not_change_loss_or_gradient() -> None:
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    ctx = ClientContext(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    real = Batch(x[:4], y[:4], torch.ones(4))
    padded = Batch(x, y, torch.tensor([1.0, 1, 1, 1, 0, 0]))
    torch.testing.assert_close(ctx.loss(params, padded), ctx.loss(params, real))
    g_pad, g_real = ctx.grad(params, padded), ctx.grad(params, real)
    for k in params:
        torch.testing.assert_close(g_pad[k], g_real[k])
    stepped = tree_axpy(-0.5, g_real, params)
    torch.testing.assert_close(ctx.sgd_step(params, padded, 0.5)[0]["weight"], stepped["weight"])


def test_weighted_sum_in_blocks_equals_the_whole_product(monkeypatch) -> None:
    """Above the block threshold the sum runs over blocks of clients (no whole ``w·a`` temporary)."""
    import lightning_fedmeta.client.functional as functional

    g = torch.Generator().manual_seed(0)
    stacked, weights = torch.randn(7, 3, 5, generator=g, dtype=torch.float64), torch.rand(7, generator=g)
    whole = functional.weighted_sum(weights, stacked)
    monkeypatch.setattr(functional, "WEIGHTED_SUM_BLOCK_ELEMENTS", 2 * 15)  # blocks of 2 clients
    blocked = functional.weighted_sum(weights, stacked)
    torch.testing.assert_close(blocked, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(blocked, torch.tensordot(weights.double(), stacked, dims=1), rtol=1e-12, atol=1e-12)


def test_batch_slice_cuts_every_field_along_the_step_axis() -> None:
    x, y, mask = torch.arange(24.0).reshape(4, 1, 3, 2), torch.arange(12).reshape(4, 1, 3), torch.ones(4, 1, 3)
    batches = Batch(x, y, mask)
    tail = batches.slice(1)
    assert isinstance(tail, Batch)
    assert torch.equal(tail.x, x[1:]) and torch.equal(tail.y, y[1:]) and torch.equal(tail.mask, mask[1:])
    middle = batches.slice(1, 3)
    assert middle.x.shape[0] == 2 and torch.equal(middle.y, y[1:3])
    assert batches.slice().x.shape == x.shape and batches.slice(4).x.shape[0] == 0
