"""FedMAML: support/query split, first- and second-order meta-gradients, the server meta step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import vmap

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.fedmaml import FedMAML, maml_meta_gradient, split_support_query
from lightning_fedmeta.client.functional import Batch, ClientContext, tree_weighted_sum
from lightning_fedmeta.data import from_client_tensors
from tests.helpers import SmallClients, flat_params, one_client, tanh_mlp, train_small


def _cross_entropy64(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits, y, reduction="none")


def _padded_batch(real: int, width: int, dtype: torch.dtype = torch.float32) -> Batch:
    """A drawn batch of ``width`` slots whose first ``real`` are real samples (rows 0..real-1)."""
    x = torch.arange(width, dtype=dtype).unsqueeze(1).repeat(1, 5) / width
    x[real:] = 0.0  # padding repeats a real row in the loop; its value must not matter
    y = torch.arange(width) % 3
    mask = (torch.arange(width) < real).to(dtype)
    return Batch(x, y, mask)


# ----------------------------------------------------------------------------------------------
# support / query split
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("real", "width"), [(16, 16), (11, 16), (5, 16), (1, 16), (7, 7)])
def test_support_and_query_are_disjoint_and_cover_the_real_samples(real: int, width: int) -> None:
    batch = _padded_batch(real, width)
    support, query = split_support_query(batch)
    rows_tr = {int(round(float(r))) for r, m in zip(support.x[:, 0] * width, support.mask, strict=True) if m > 0}
    rows_val = {int(round(float(r))) for r, m in zip(query.x[:, 0] * width, query.mask, strict=True) if m > 0}
    assert rows_tr.isdisjoint(rows_val)
    assert rows_tr | rows_val == set(range(real))
    assert len(rows_tr) == (real + 1) // 2 and len(rows_val) == real // 2
    assert support.x.shape[0] == (width + 1) // 2 and query.x.shape[0] == width // 2


def test_split_under_vmap_equals_split_per_client() -> None:
    batches = [_padded_batch(r, 12) for r in (12, 9, 4)]
    stacked = Batch(*(torch.stack(parts) for parts in zip(*batches, strict=True)))
    support_v, query_v = vmap(split_support_query)(stacked)
    for i, b in enumerate(batches):
        support, query = split_support_query(b)
        for got, want in ((support_v, support), (query_v, query)):
            assert torch.equal(got.mask[i], want.mask)
            assert torch.equal(got.x[i] * got.mask[i, :, None], want.x * want.mask[:, None])


# ----------------------------------------------------------------------------------------------
# meta-gradients
# ----------------------------------------------------------------------------------------------
def _autograd_meta_gradient(
    ctx: ClientContext, w: dict[str, Tensor], support: Batch, query: Batch, alpha: float, second_order: bool
) -> list[Tensor]:
    leaves = {k: v.clone().requires_grad_(True) for k, v in w.items()}
    grads = torch.autograd.grad(ctx.loss(leaves, support), list(leaves.values()), create_graph=second_order)
    adapted = {k: leaves[k] - alpha * g for k, g in zip(leaves, grads, strict=True)}
    if not second_order:
        adapted = {k: v.detach().requires_grad_(True) for k, v in adapted.items()}
        return list(torch.autograd.grad(ctx.loss(adapted, query), list(adapted.values())))
    return list(torch.autograd.grad(ctx.loss(adapted, query), list(leaves.values())))


@pytest.mark.parametrize("second_order", [True, False])
def test_uploaded_delta_is_minus_the_maml_gradient_of_autograd(second_order: bool) -> None:
    model = tanh_mlp(dtype=torch.float64)
    ctx = ClientContext(model, per_sample_loss=_cross_entropy64)
    g = torch.Generator().manual_seed(4)
    batches = Batch(torch.randn(1, 1, 20, 5, generator=g, dtype=torch.float64),
                    torch.randint(0, 3, (1, 1, 20), generator=g), torch.ones(1, 1, 20, dtype=torch.float64))
    w = {n: p.detach() for n, p in model.named_parameters()}
    algo = FedMAML(alpha=0.3, second_order=second_order, batch_size=10)
    out = algo.client_update(ctx, w, batches, {}, {}, one_client())
    support, query = split_support_query(batches.at(0, 0))
    expected = _autograd_meta_gradient(ctx, w, support, query, 0.3, second_order)
    for d, e in zip(out.delta.values(), expected, strict=True):
        torch.testing.assert_close(d, -e, atol=1e-10, rtol=0)
    other = FedMAML(alpha=0.3, second_order=not second_order, batch_size=10).client_update(
        ctx, w, batches, {}, {}, one_client()
    )
    assert max(float((other.delta[k] - out.delta[k]).abs().max()) for k in w) > 1e-6


def test_several_local_steps_average_the_meta_gradients_at_theta() -> None:
    model = tanh_mlp()
    ctx = ClientContext(model)
    g = torch.Generator().manual_seed(5)
    batches = Batch(torch.randn(3, 1, 8, 5, generator=g), torch.randint(0, 3, (3, 1, 8), generator=g),
                    torch.ones(3, 1, 8))
    w = {n: p.detach() for n, p in model.named_parameters()}
    out = FedMAML(alpha=0.1, local_steps=3, batch_size=4).client_update(ctx, w, batches, {}, {}, one_client())
    per_step = [maml_meta_gradient(ctx, w, *split_support_query(batches.at(t, 0)), 0.1, False)[0] for t in range(3)]
    for k in w:
        torch.testing.assert_close(out.delta[k], -sum(p[k] for p in per_step) / 3, atol=1e-7, rtol=0)


def test_round_plan_draws_batches_of_twice_the_batch_size() -> None:
    plan = FedMAML(batch_size=16, local_steps=2).round_plan()
    assert (plan.steps, plan.per_step, plan.batch_size) == (2, 1, 32)
    assert FedMAML(batch_size=None).round_plan().batch_size is None


# ----------------------------------------------------------------------------------------------
# whole rounds
# ----------------------------------------------------------------------------------------------
def test_server_meta_step_uses_server_lr_as_beta() -> None:
    algo = {"name": "fedmaml", "alpha": 0.1, "batch_size": 4}
    probe = FederatedModule(model=tanh_mlp(), algorithm=algo, clients_per_round=3)
    probe.attach_data(from_client_tensors(SmallClients().client_data(), 3))
    w0 = {n: p.detach().clone() for n, p in probe.model.named_parameters()}
    _, out, weights = probe.compute_round(0)
    mean_grad = {k: -v for k, v in tree_weighted_sum(out.delta, weights).items()}
    trained = train_small(algo, steps=1, server_lr=0.25)
    for name, p in trained.model.named_parameters():
        torch.testing.assert_close(p.detach(), w0[name] - 0.25 * mean_grad[name], atol=1e-6, rtol=0)


@pytest.mark.parametrize("second_order", [False, True])
def test_loop_and_vmap_clients_give_the_same_global_model(second_order: bool) -> None:
    algo = {"name": "fedmaml", "alpha": 0.1, "batch_size": 5, "second_order": second_order}
    looped = flat_params(train_small(algo, "loop", server_lr=0.5).model)
    batched = flat_params(train_small(algo, "vmap", server_lr=0.5).model)
    torch.testing.assert_close(looped, batched, atol=1e-6, rtol=0)
    assert (looped - flat_params(tanh_mlp())).abs().max() > 1e-4


def test_negative_alpha_raises_with_value() -> None:
    with pytest.raises(ValueError, match=r"alpha must be >= 0, got -1"):
        FedMAML(alpha=-1)
