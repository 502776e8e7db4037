"""Per-client BatchNorm running statistics through ClientContext (running_stats.prepare_model + for_client)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, grad_and_value, jvp, vjp

from lightning_fedmeta.client.batchnorm_stats import FunctionalBatchNorm1d, client_buffers, prepare_model
from lightning_fedmeta.client.execution import run_clients
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_axpy


def _mlp_bn1d(momentum: float | None) -> tuple[nn.Module, tuple[int, ...]]:
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6, momentum=momentum), nn.ReLU(), nn.Linear(6, 3)), (5,)


def _conv_bn1d(momentum: float | None) -> tuple[nn.Module, tuple[int, ...]]:
    """BatchNorm1d on a ``[B, C, L]`` input (statistics over the batch and the length)."""
    model = nn.Sequential(
        nn.Conv1d(2, 4, 3), nn.BatchNorm1d(4, momentum=momentum), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5, 3)
    )
    return model, (2, 7)


def _conv_bn2d(momentum: float | None) -> tuple[nn.Module, tuple[int, ...]]:
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4, momentum=momentum), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 3 * 3, 6), nn.BatchNorm1d(6, momentum=momentum), nn.Linear(6, 3),
    )
    return model, (2, 5, 5)


BUILDERS = {"bn1d": _mlp_bn1d, "bn1d-seq": _conv_bn1d, "bn2d": _conv_bn2d}


def _params(model: nn.Module) -> Params:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _buffers(model: nn.Module) -> Params:
    return {k: v.detach().clone() for k, v in model.named_buffers()}


def _batch(shape: tuple[int, ...], b: int = 8, real: int | None = None, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(b)
    if real is not None:
        mask[real:] = 0.0
    return Batch(torch.randn(b, *shape, generator=g), torch.randint(0, 3, (b,), generator=g), mask)


def _real_rows(batch: Batch, real: int) -> Batch:
    return Batch(batch.x[:real], batch.y[:real], batch.mask[:real])


def _assert_trees_close(a: Params, b: Params, atol: float = 1e-6, rtol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=rtol, msg=lambda m, k=k: f"{k}: {m}")
        else:
            assert torch.equal(a[k], b[k]), (k, a[k], b[k])


# ----------------------------------------------------------------------------------------------
# PyTorch's own BatchNorm is the reference
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("arch", list(BUILDERS))
def test_running_stats_after_sgd_steps_equal_pytorch_batchnorm(arch: str, momentum: float | None) -> None:
    """k train-mode sgd_steps advance the bound statistics exactly as nn.BatchNorm's own forwards (same
    parameters, same batches) do, incl. num_batches_tracked; the loss and gradient are PyTorch's too."""
    torch.manual_seed(0)
    model, shape = BUILDERS[arch](momentum)
    reference = copy.deepcopy(model).train()
    names = prepare_model(model)
    assert len(names) == 3 * sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    model.train()
    start = {n: b + 0.3 if b.is_floating_point() else b + 2 for n, b in _buffers(model).items()}
    with torch.no_grad():  # a client whose statistics are not the module's
        for n, b in reference.named_buffers():
            b.copy_(start[n])
    ctx = ClientContext(model).for_client(start)
    w = _params(model)
    for t in range(4):
        batch = _batch(shape, seed=t)
        for n, p in reference.named_parameters():
            p.data.copy_(w[n])
        reference.zero_grad()
        ref_loss = F.cross_entropy(reference(batch.x), batch.y)  # advances the reference's buffers
        ref_loss.backward()
        new_w, loss = ctx.sgd_step(w, batch, 0.2)
        torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-6, rtol=1e-6)
        expected_w = {n: w[n] - 0.2 * p.grad for n, p in reference.named_parameters()}
        _assert_trees_close(new_w, expected_w, atol=1e-5, rtol=1e-5)
        w = new_w
    updated = ctx.updated_buffers()
    assert set(updated) == set(names)
    _assert_trees_close(updated, {n: b for n, b in reference.named_buffers() if n in names})
    for name in names:
        if name.endswith("num_batches_tracked"):
            assert int(updated[name]) == 2 + 4


def test_prepare_model_is_idempotent_and_keeps_pytorch_behaviour_outside_a_context() -> None:
    torch.manual_seed(0)
    model, shape = _conv_bn2d(0.1)
    reference = copy.deepcopy(model)
    keys = list(model.state_dict())
    names = prepare_model(model)
    assert names == ["1.running_mean", "1.running_var", "1.num_batches_tracked",
                     "5.running_mean", "5.running_var", "5.num_batches_tracked"]
    classes = [type(m) for m in model.modules()]
    assert prepare_model(model) == names
    assert [type(m) for m in model.modules()] == classes
    assert isinstance(model[5], nn.BatchNorm1d) and isinstance(model[5], FunctionalBatchNorm1d)
    assert list(model.state_dict()) == keys
    x = _batch(shape).x
    torch.testing.assert_close(model(x), reference(x))  # a plain call is PyTorch's BatchNorm (in place)
    _assert_trees_close(_buffers(model), _buffers(reference))
    model.eval(), reference.eval()
    torch.testing.assert_close(model(x), reference(x))
    assert client_buffers(model, 3)["1.running_var"].shape == (3, 4)


def test_models_without_tracked_batchnorm_are_left_alone() -> None:
    plain = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, track_running_stats=False), nn.Linear(4, 2))
    before = [type(m) for m in plain.modules()]
    assert prepare_model(plain) == []
    assert [type(m) for m in plain.modules()] == before


# ----------------------------------------------------------------------------------------------
# masks
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["bn1d", "bn2d"])
def test_padding_rows_do_not_change_the_statistics_loss_or_gradient(arch: str) -> None:
    torch.manual_seed(0)
    model, shape = BUILDERS[arch](0.1)
    prepare_model(model)
    ctx = ClientContext(model)
    params = _params(model)
    padded = _batch(shape, b=8, real=5)
    padded = Batch(padded.x.clone(), padded.y, padded.mask)
    padded.x[5:] = 50.0  # padding far from the data: it would shift any unmasked statistic
    real = _real_rows(padded, 5)
    a, b = ctx.for_client(_buffers(model)), ctx.for_client(_buffers(model))
    wa, wb = params, params
    for _ in range(3):
        wa, loss_a = a.sgd_step(wa, padded, 0.1)
        wb, loss_b = b.sgd_step(wb, real, 0.1)
        torch.testing.assert_close(loss_a, loss_b, atol=1e-6, rtol=1e-6)  # masked normalisation
    _assert_trees_close(wa, wb)
    _assert_trees_close(a.updated_buffers(), b.updated_buffers())
    _assert_trees_close(ctx.grad(params, padded), ctx.grad(params, real))  # unbound context: the same
    for got, want in zip(ctx.accuracy_counts(params, padded), ctx.accuracy_counts(params, real), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)


def test_a_batch_without_real_rows_changes_nothing() -> None:
    torch.manual_seed(0)
    model, shape = _mlp_bn1d(None)
    prepare_model(model)
    start = _buffers(model)
    ctx = ClientContext(model).for_client(start)
    empty = _batch(shape, real=0)
    ctx.loss_and_grad(_params(model), empty)
    _assert_trees_close(ctx.updated_buffers(), start, atol=0.0, rtol=0.0)


# ----------------------------------------------------------------------------------------------
# loop == vmap
# ----------------------------------------------------------------------------------------------
def test_loop_equals_vmap_over_clients_with_different_statistics() -> None:
    torch.manual_seed(0)
    model, shape = _conv_bn2d(0.1)
    prepare_model(model)
    ctx = ClientContext(model)
    c, steps, b = 4, 4, 6
    stacked = client_buffers(model, c)
    offset = torch.arange(c)
    stacked = {n: v + offset.view(-1, *[1] * (v.dim() - 1)).to(v.dtype) * (0.2 if v.is_floating_point() else 1)
               for n, v in stacked.items()}
    x, y = torch.randn(c, steps, b, *shape), torch.randint(0, 3, (c, steps, b))
    mask = torch.ones(c, steps, b)
    for i in range(c):
        mask[i, :, b - i:] = 0.0  # clients with 6, 5, 4 and 3 real samples
    batches = Batch(x, y, mask)

    def client(params: Params, batches: Batch, buffers: Params) -> tuple[Params, Params, Tensor]:
        bound = ctx.for_client(buffers)
        w = params
        for t in range(3):
            w, _ = bound.sgd_step(w, Batch(batches.x[t], batches.y[t], batches.mask[t]), 0.1)
        # a caller's own grad transform around ctx.loss (as FedRep's head/body steps do)
        g, loss = grad_and_value(lambda p: bound.loss(p, Batch(batches.x[3], batches.y[3], batches.mask[3])))(w)
        w = tree_axpy(-0.1, g, w)
        w, _ = bound.sgd_step(w, Batch(batches.x[0], batches.y[0], batches.mask[0]), 0.1)
        return w, bound.updated_buffers(), loss

    looped = run_clients(client, (_params(model),), (batches, stacked), c, mode="loop")
    batched = run_clients(client, (_params(model),), (batches, stacked), c, mode="vmap")
    for a, b_ in zip(looped[:2], batched[:2], strict=True):
        _assert_trees_close(a, b_)
    torch.testing.assert_close(looped[2], batched[2], atol=1e-6, rtol=1e-6)
    assert looped[1]["1.num_batches_tracked"].tolist() == [5, 6, 7, 8]
    # every client's statistics are its own
    assert not torch.allclose(looped[1]["1.running_mean"][0], looped[1]["1.running_mean"][1])


# ----------------------------------------------------------------------------------------------
# what does not advance
# ----------------------------------------------------------------------------------------------
def test_hvp_does_not_advance_the_statistics() -> None:
    torch.manual_seed(0)
    model, shape = _mlp_bn1d(0.1)
    model = model.double()
    prepare_model(model)
    start = {n: v + 0.5 if v.is_floating_point() else v for n, v in _buffers(model).items()}
    ctx = ClientContext(model).for_client(start)
    params = {k: v.double() for k, v in _params(model).items()}
    batch = _batch(shape, real=6)
    batch = Batch(batch.x.double(), batch.y, batch.mask.double())
    v = {k: torch.randn_like(p) for k, p in params.items()}
    rev = ctx.hvp(params, batch, v)
    fwd = ctx.hvp_forward_over_reverse(params, batch, v)
    _assert_trees_close(rev, fwd, atol=1e-10, rtol=1e-8)
    _assert_trees_close(ctx.updated_buffers(), start, atol=0.0, rtol=0.0)
    ctx.frozen().loss_and_grad(params, batch)
    _assert_trees_close(ctx.updated_buffers(), start, atol=0.0, rtol=0.0)
    ctx.grad(params, batch)  # a counted forward does advance
    assert int(ctx.updated_buffers()["1.num_batches_tracked"]) == 1
    assert not torch.equal(ctx.updated_buffers()["1.running_mean"], start["1.running_mean"])


def test_eval_mode_uses_the_bound_statistics_and_does_not_change_them() -> None:
    torch.manual_seed(0)
    model, shape = _conv_bn2d(0.1)
    prepare_model(model)
    model.eval()
    params = _params(model)
    batch = _batch(shape, real=6)
    client = {n: (v + torch.rand_like(v) if n.endswith("running_var") else v + torch.randn_like(v))
              if v.is_floating_point() else v + 3 for n, v in _buffers(model).items()}
    reference = copy.deepcopy(model).eval()
    with torch.no_grad():
        for n, b in reference.named_buffers():
            b.copy_(client[n])
    ctx = ClientContext(model)
    bound = ctx.for_client(client)
    torch.testing.assert_close(bound.predict(params, batch.x), reference(batch.x))
    expected_loss = F.cross_entropy(reference(batch.x)[:6], batch.y[:6])
    torch.testing.assert_close(bound.loss(params, batch), expected_loss)
    bound.sgd_step(params, batch, 0.1)
    bound.grad(params, batch)
    _assert_trees_close(bound.updated_buffers(), client, atol=0.0, rtol=0.0)
    # without bound statistics, eval mode uses the module's own buffers
    torch.testing.assert_close(ctx.predict(params, batch.x), model(batch.x))
    assert not torch.allclose(ctx.predict(params, batch.x), bound.predict(params, batch.x))


def test_for_client_never_mutates_its_inputs_or_the_module() -> None:
    torch.manual_seed(0)
    model, shape = _conv_bn2d(None)
    prepare_model(model)
    module_before = _buffers(model)
    given = _buffers(model)
    kept = {n: v.clone() for n, v in given.items()}
    ctx = ClientContext(model)
    bound = ctx.for_client(given)
    w = _params(model)
    for t in range(2):
        w, _ = bound.sgd_step(w, _batch(shape, real=5, seed=t), 0.1)
        bound.loss(w, _batch(shape, seed=10 + t))
    ctx.loss_and_grad(w, _batch(shape))  # an unbound context in train mode: batch statistics, nothing written
    assert ctx.updated_buffers() == {}
    _assert_trees_close(given, kept, atol=0.0, rtol=0.0)
    _assert_trees_close(_buffers(model), module_before, atol=0.0, rtol=0.0)
    assert int(bound.updated_buffers()["1.num_batches_tracked"]) == 4


def test_unbound_train_mode_uses_batch_statistics() -> None:
    torch.manual_seed(0)
    model, shape = _conv_bn2d(0.1)
    reference = copy.deepcopy(model).train()
    prepare_model(model)
    batch = _batch(shape)
    torch.testing.assert_close(ClientContext(model).loss(_params(model), batch),
                               F.cross_entropy(reference(batch.x), batch.y))


# ----------------------------------------------------------------------------------------------
# models without BatchNorm: bit for bit what ClientContext computed before
# ----------------------------------------------------------------------------------------------
def test_a_model_without_batchnorm_gives_exactly_the_plain_functional_results() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ELU(), nn.Linear(8, 3))
    classes = [type(m) for m in model.modules()]
    assert prepare_model(model) == []
    assert [type(m) for m in model.modules()] == classes
    buffers = dict(model.named_buffers())
    params = _params(model)
    batch = _batch((5,), real=6)
    v = {k: torch.randn_like(p) for k, p in params.items()}

    def predict(p: Params) -> Tensor:
        return functional_call(model, (p, buffers), (batch.x,))

    def loss(p: Params) -> Tensor:
        per = F.cross_entropy(predict(p), batch.y, reduction="none")
        return (per * batch.mask).sum() / batch.mask.sum().clamp_min(1.0)

    g = grad(loss)(params)
    g_v, value = grad_and_value(loss)(params)
    hvp = vjp(grad(loss), params)[1](v)[0]
    hvp_fwd = jvp(grad(loss), (params,), (v,))[1]
    logits = predict(params)
    per = F.cross_entropy(logits, batch.y, reduction="none")
    counts = (((logits.argmax(-1) == batch.y).float() * batch.mask).sum(), batch.mask.sum(), (per * batch.mask).sum())

    def exact(a: Params | Tensor, b: Params | Tensor) -> None:
        if isinstance(a, Tensor):
            assert torch.equal(a, b)  # type: ignore[arg-type]
        else:
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # type: ignore[union-attr]

    base = ClientContext(model)
    for ctx in (base, base.for_client({})):
        exact(ctx.predict(params, batch.x), logits)
        exact(ctx.loss(params, batch), loss(params))
        exact(ctx.grad(params, batch), g)
        got_value, got_g = ctx.loss_and_grad(params, batch)
        exact(got_value, value)
        exact(got_g, g_v)
        exact(ctx.hvp(params, batch, v), hvp)
        exact(ctx.hvp_forward_over_reverse(params, batch, v), hvp_fwd)
        stepped, step_loss = ctx.sgd_step(params, batch, 0.3)
        exact(stepped, {k: torch.add(params[k], g_v[k], alpha=-0.3) for k in params})
        exact(step_loss, value)
        for got, want in zip(ctx.accuracy_counts(params, batch), counts, strict=True):
            exact(got, want)
    assert base.for_client({}).updated_buffers() == {}


def test_for_client_rejects_names_that_are_not_buffers() -> None:
    model, _ = _mlp_bn1d(0.1)
    prepare_model(model)
    with pytest.raises(KeyError, match="not buffers"):
        ClientContext(model).for_client({"0.weight": torch.zeros(6, 5)})

