"""``torch.func`` helpers: parameter trees, masked batches and a client's view of the model.

A client's local procedure never touches an ``nn.Module``'s parameters. It receives the
parameters as a dict ``{name: tensor}`` and calls the model through
``torch.func.functional_call``, so the same procedure runs for one client or, under
``torch.func.vmap``, for many clients at once (parameters stacked along a leading axis).

Batches carry a ``mask`` (1.0 for a real sample, 0.0 for padding) so clients with fewer
samples than the batch size, or full-batch steps over clients of different sizes, keep one
tensor shape: the loss is the masked mean ``Σ_j m_j ℓ_j / Σ_j m_j``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, grad_and_value, jvp, vjp

from lightning_fedmeta.client import batchnorm_stats as running_stats
from lightning_fedmeta.client.compiled import ZERO
from lightning_fedmeta.client.trainable import frozen_parameters

if TYPE_CHECKING:
    from lightning_fedmeta.client.compiled import PrimitiveCompiler

__all__ = [
    "Params",
    "Batch",
    "ClientContext",
    "tree_sub",
    "tree_scale",
    "tree_axpy",
    "tree_dot",
    "tree_sq_norm",
    "tree_zeros_like",
    "tree_weighted_sum",
    "weighted_sum",
    "cross_entropy_per_sample",
    "model_logits",
]

Params = dict[str, Tensor]
PerSampleLoss = Callable[[Tensor, Tensor], Tensor]


class Batch(NamedTuple):
    """A (possibly padded) mini-batch: ``x [B, *input]``, ``y [B]``, ``mask [B]`` (float, 1 = real).

    With leading axes (``[steps, per_step, B, ...]``) it holds a client's whole round of batches;
    ``batch[t]`` style access is done with :func:`Batch.at`.
    """

    x: Tensor
    y: Tensor
    mask: Tensor

    def at(self, *index: int) -> Batch:
        """The batch at ``index`` along the leading (step, per-step) axes."""
        return Batch(self.x[index], self.y[index], self.mask[index])

    def slice(self, start: int | None = None, stop: int | None = None) -> Batch:
        """The steps ``start:stop`` along the leading (step) axis, as Python slices them (``batches.slice(2)``: every
        step from the third on), each of ``x``, ``y`` and ``mask`` alike."""
        return Batch(self.x[start:stop], self.y[start:stop], self.mask[start:stop])


def has_samples(batch: Batch) -> Tensor:
    """Whether ``batch`` holds at least one real sample (0-d bool; vmap-safe).

    A local step on an empty batch is a step the client did not take: a straggler with a budget of ``τ_c`` local
    steps sees empty batches after its ``τ_c``-th step (:mod:`lightning_fedmeta.reliability.participation`). Plain SGD
    steps on
    them are no-ops by themselves (the masked loss and its gradient are 0); steps with other terms (a proximal
    pull, a control-variate correction) gate their rate with this flag."""
    return batch.mask.sum() > 0


# ----------------------------------------------------------------------------------------------
# parameter-tree arithmetic (dicts of tensors with identical keys)
# ----------------------------------------------------------------------------------------------
def tree_sub(a: Params, b: Params) -> Params:
    return {k: a[k] - b[k] for k in a}


def tree_scale(a: Params, s: float | Tensor) -> Params:
    return {k: a[k] * s for k in a}


def tree_axpy(alpha: float | Tensor, x: Params, y: Params) -> Params:
    """``y + alpha * x``, the building block of every SGD-like step (one fused kernel for a Python ``alpha``)."""
    if isinstance(alpha, Tensor):
        return {k: y[k] + alpha * x[k] for k in y}
    return {k: torch.add(y[k], x[k], alpha=alpha) for k in y}


def tree_dot(a: Params, b: Params) -> Tensor:
    return sum((a[k] * b[k]).sum() for k in a)  # type: ignore[return-value]


def tree_sq_norm(a: Params) -> Tensor:
    return tree_dot(a, a)


def tree_zeros_like(a: Params) -> Params:
    return {k: torch.zeros_like(v) for k, v in a.items()}


#: the largest stacked tensor :func:`weighted_sum` multiplies whole (2^28 elements: 1 GiB of float32)
WEIGHTED_SUM_BLOCK_ELEMENTS = 1 << 28


def weighted_sum(weights: Tensor, stacked: Tensor) -> Tensor:
    """``Σ_i w_{…i} a_i``: contracts the last axis of ``weights [..., C]`` with the leading axis of
    ``stacked [C, ...]`` (as ``torch.tensordot(weights, stacked, dims=1)``), in ``stacked``'s dtype.

    An elementwise product and a sum, not a matrix product: autocast (``bf16-mixed``) leaves it in the
    parameters' precision, so aggregates and selected rows stay float32 under mixed precision.

    Above :data:`WEIGHTED_SUM_BLOCK_ELEMENTS` elements (a cohort of large models: 1000 ResNet-18 deltas are 45 GB)
    the sum runs over blocks of clients, so the product ``w·a`` is never materialised whole; the blocking depends on
    the shape alone, so the numbers never depend on how the clients were batched.
    """
    lead = weights.shape[:-1]
    w = weights.to(stacked.dtype).reshape(*lead, weights.shape[-1], *([1] * (stacked.dim() - 1)))
    rows = stacked.shape[0]
    if stacked.numel() <= WEIGHTED_SUM_BLOCK_ELEMENTS or rows < 2:
        return (w * stacked).sum(dim=len(lead))
    block = max(1, WEIGHTED_SUM_BLOCK_ELEMENTS // max(1, stacked[0].numel()))
    axis = len(lead)
    total = None
    for start in range(0, rows, block):
        part = (w.narrow(axis, start, min(block, rows - start)) * stacked[start:start + block]).sum(dim=axis)
        total = part if total is None else total + part
    return total


def tree_weighted_sum(stacked: Params, weights: Tensor) -> Params:
    """``Σ_i w_i a_i`` for a tree whose leaves are stacked along axis 0 (one row per client)."""
    return {k: weighted_sum(weights, v) for k, v in stacked.items()}


# ----------------------------------------------------------------------------------------------
# losses
# ----------------------------------------------------------------------------------------------
def cross_entropy_per_sample(logits: Tensor, y: Tensor) -> Tensor:
    """Per-sample cross-entropy ``-log softmax(logits)[y]`` (half/bfloat16 logits are upcast to float32)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits, y, reduction="none")


def model_logits(out: Any) -> Any:
    """The tensor the loss and the metrics take from a model's forward: ``out`` itself when it is a tensor (every
    model that returns its logits, unchanged), else ``out.logits`` when ``out`` carries a tensor by that name (the
    ``ModelOutput`` of a Hugging Face ``transformers`` model, e.g. ``CausalLMOutput``, and of a ``peft`` model around
    one), else ``out`` unchanged (the model-output check reports what it is)."""
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    return logits if isinstance(logits, Tensor) else out


_SCALARS = (bool, int, float, str, type(None))


def _function_key(fn: Callable[..., Any]) -> tuple[Any, ...]:
    """What identifies the program of :meth:`ClientContext.step`: the function, its object, and the Python
    scalars it can read from that object and from its closure (a changed hyper-parameter is a new program)."""
    func = getattr(fn, "__func__", fn)
    owner = getattr(fn, "__self__", None)
    owned = tuple(sorted((k, v) for k, v in getattr(owner, "__dict__", {}).items() if isinstance(v, _SCALARS)))
    cells = tuple(
        c.cell_contents for c in (getattr(func, "__closure__", None) or ()) if isinstance(c.cell_contents, _SCALARS)
    )
    return (func, id(owner), owned, cells)


def _unwrap_dead(t: Tensor) -> Tensor:
    """``t`` without the wrappers of ``torch.func`` transforms that have exited (a detached statistic
    recorded inside a caller's ``grad``); a live tensor is returned as is."""
    while torch._C._functorch.is_dead_tensor_wrapper(t):
        t = torch._C._functorch.unwrap_if_dead(t)
    return t


class ClientContext:
    """A client's functional view of the model: loss, gradients, Hessian-vector products, SGD.

    Every method is a pure function of its arguments, safe under ``torch.func.vmap``.
    The loss on a batch is the masked mean ``f(w; D) = Σ_j m_j ℓ(h_w(x_j), y_j) / Σ_j m_j``.

    BatchNorm layers prepared with :func:`lightning_fedmeta.client.batchnorm_stats.prepare_model` run
    functionally: in train mode they normalise with the statistics of the batch's real samples (the
    ``mask``; a padded batch gives the loss of its real rows), in eval mode with running statistics.
    A context bound to one client's running statistics (:meth:`for_client`) advances them, as
    PyTorch's BatchNorm does, on every train-mode forward of :meth:`loss`, :meth:`grad`,
    :meth:`loss_and_grad` and :meth:`sgd_step` (not inside :meth:`hvp`, :meth:`predict` or
    :meth:`accuracy_counts`); :meth:`updated_buffers` returns them. Without bound statistics, eval
    mode uses ``buffers`` (the module's own by default). Models without prepared BatchNorm layers run
    exactly as plain ``functional_call``.

    Frozen parameters (``requires_grad=False``, :mod:`lightning_fedmeta.client.trainable`) are held with the
    buffers: read once here, they go to ``functional_call`` next to the buffers for every name ``params`` does not
    give, so the trees a client step passes around hold the trainable parameters only and, under ``vmap``, the
    frozen ones are captured unbatched (one copy for every client of the batch).

    Args:
        model: the architecture; its trainable parameters are ignored (``params`` replace them), its frozen ones
            (``requires_grad=False``) are used as they are unless ``params`` names them.
        buffers: the model's buffers (passed unchanged to ``functional_call``).
        per_sample_loss: ``(logits, y) -> [B]`` per-sample losses.
        compiler: compiles :meth:`predict`, :meth:`loss`, :meth:`grad`, :meth:`loss_and_grad`, :meth:`hvp` and
            :meth:`sgd_step` once each, batched over the clients of a ``vmap``
            (:mod:`lightning_fedmeta.client.compiled`);
            ``None`` runs them eagerly. Either way they compute the same function.
    """

    def __init__(
        self,
        model: nn.Module,
        buffers: Params | None = None,
        per_sample_loss: PerSampleLoss = cross_entropy_per_sample,
        compiler: PrimitiveCompiler | None = None,
    ) -> None:
        self.model = model
        self.buffers = dict(buffers) if buffers is not None else dict(model.named_buffers())
        #: the frozen parameters (requires_grad=False), shared by every client and never batched
        self.frozen_params: Params = frozen_parameters(model)
        self.per_sample_loss = per_sample_loss
        self._own_loss = per_sample_loss  # the loss compiled and compacted calls may use (see _dispatch)
        #: prepared BatchNorm layers with their names (empty: the plain functional_call path)
        self._layers = running_stats.tracked_layers(model)
        self._stat_names = running_stats.running_stat_names(model) if self._layers else []
        #: this client's buffers (running statistics), replaced on every counted train-mode forward
        self._bound: Params | None = None
        #: whether forwards advance the bound statistics (False inside hvp)
        self._counting = True
        #: whether a statistic may have been recorded inside a caller's grad transform (see :meth:`loss`)
        self._may_leak = False
        #: compiles the primitives batched over clients (``FederatedModule(compile_clients=...)``); None: eager
        self.compiler: PrimitiveCompiler | None = compiler

    def constants(self, params: Params, buffers: Params) -> Params:
        """What ``functional_call`` takes next to ``params``: ``buffers`` and the frozen parameters ``params`` does
        not name (``buffers`` itself for a model without frozen parameters)."""
        if not self.frozen_params:
            return buffers
        return {**{k: v for k, v in self.frozen_params.items() if k not in params}, **buffers}

    # -- per-client running statistics --------------------------------------------------------
    def for_client(self, buffers: Params) -> ClientContext:
        """A context bound to one client's buffers (under vmap: its row of the stacked buffers).

        ``buffers`` replace the module's buffers of the same names (typically the running statistics
        of :func:`~lightning_fedmeta.client.batchnorm_stats.prepare_model`; running statistics not given start
        from ``self.buffers``). The tensors passed in are never modified.
        """
        unknown = sorted(set(buffers) - set(self.buffers))
        if unknown:
            raise KeyError(f"for_client: {unknown[:3]} are not buffers of the model")
        ctx = copy.copy(self)
        ctx._bound = {**{name: self.buffers[name] for name in self._stat_names}, **buffers}
        ctx._counting = True
        ctx._may_leak = False
        return ctx

    def updated_buffers(self) -> Params:
        """The bound buffers after every forward so far (``{}`` for a context not bound by :meth:`for_client`)."""
        if self._bound is None:
            return {}
        if not self._may_leak:
            return dict(self._bound)
        return {k: _unwrap_dead(v) for k, v in self._bound.items()}

    def _forward(self, params: Params, x: Tensor, mask: Tensor | None, count: bool) -> tuple[Tensor, Params]:
        """``h_w(x)`` through prepared BatchNorm layers, and the advanced running statistics (``{}``
        unless ``count`` and bound); the statistics are detached, so they may leave a grad transform as aux."""
        buffers = self.buffers if self._bound is None else {**self.buffers, **self.updated_buffers()}
        record: dict[nn.Module, tuple[Tensor, Tensor, Tensor | None]] | None = None
        if count and self._counting and self._bound is not None:
            record = {}
        with running_stats.statistics_scope(mask, record):
            out = model_logits(functional_call(self.model, (params, self.constants(params, buffers)), (x,)))
        return out, ({} if record is None else running_stats.updates_by_name(self._layers, record))

    def _loss_and_stats(self, params: Params, batch: Batch) -> tuple[Tensor, Params]:
        out, stats = self._forward(params, batch.x, batch.mask, count=True)
        per_sample = self.per_sample_loss(out, batch.y)
        mask = batch.mask.to(per_sample.dtype)
        return (per_sample * mask).sum() / mask.sum().clamp_min(1.0), stats

    def _advance(self, stats: Params) -> None:
        if stats and self._bound is not None:
            self._bound = {**self._bound, **stats}

    # -- compiled primitives ---------------------------------------------------------------------
    def _dispatch(self, name: Any, impl: Callable[..., Any], operands: tuple[Any, ...],
                  empty: Callable[..., Any] | None = None) -> Any:
        """``impl(*operands)``, through the compiled batched program when a
        :class:`~lightning_fedmeta.client.compiled.PrimitiveCompiler` is attached and may serve this call (see
        :mod:`lightning_fedmeta.client.compiled`), else eagerly. Python numbers among ``operands`` are static: part of
        the program's key, not inputs. Contexts with prepared BatchNorm layers run eagerly.

        ``empty(*operands)`` is the primitive's result on an empty batch (the operand at position 1 is the batch),
        with :data:`~lightning_fedmeta.client.compiled.ZERO` for zeros: a compacting compiler (``step_schedule=
        "compacted"``) computes only the clients whose batch holds a sample and gives the others this result."""
        compiler = self.compiler
        if compiler is None or self._layers or self.per_sample_loss is not self._own_loss:
            # a loss replaced inside a client step (FedRoD's balanced softmax) may close over that client's tensors,
            # which a call outside the clients' vmap cannot see: such calls run as they are
            return impl(*operands)
        compacting = compiler.compact and empty is not None
        if not (compiler.enabled or compiler.graphs or compacting):  # eager rounds pay nothing for the compiler
            return impl(*operands)
        statics = tuple((i, o) for i, o in enumerate(operands) if o is None or isinstance(o, (bool, int, float, str)))
        fn, idle = impl, empty
        if statics:
            fixed = dict(statics)
            tensors = tuple(o for i, o in enumerate(operands) if i not in fixed)
            n = len(operands)

            def _full(ops: tuple[Any, ...]) -> tuple[Any, ...]:
                it = iter(ops)
                return tuple(fixed[i] if i in fixed else next(it) for i in range(n))

            def fn(*ops: Any) -> Any:
                return impl(*_full(ops))

            if empty is not None:
                def idle(*ops: Any) -> Any:
                    return empty(*_full(ops))
        else:
            tensors = operands
        active = has_samples(operands[1]) if compacting and isinstance(operands[1], Batch) else None
        out = compiler.call((name, self, statics), fn, tensors, empty=idle, active=active)
        return impl(*operands) if out is NotImplemented else out

    def step(self, fn: Callable[..., Any], *operands: Any) -> Any:
        """``fn(self, *operands)`` as one primitive: an algorithm's whole local step (several gradients and the
        update between them), compiled once and batched over the clients like :meth:`sgd_step` when the module
        compiles (``compile_clients``), else simply called.

        ``fn`` must be a pure function of the context and its operands (pytrees of tensors; Python numbers are
        static). The Python numbers, strings and flags of its object (``fn.__self__``, e.g. an algorithm's
        hyper-parameters) and of its closure are part of the program's key, so changing one compiles a new
        program instead of reusing a stale one. Built-in uses: Per-FedAvg's meta step, the proximal step.
        """
        compiler = self.compiler
        empty = getattr(fn, "empty_batch", None)
        if compiler is None or self._layers or not (compiler.enabled or compiler.graphs
                                                    or (compiler.compact and empty is not None)):
            return fn(self, *operands)  # eager: no program key, no context copy
        plain = self._uncompiled()
        return self._dispatch(("step", *_function_key(fn)), lambda *ops: fn(plain, *ops), operands, empty)

    def _uncompiled(self) -> ClientContext:
        """This context without its compiler: what a compiled step's own primitive calls go through (they are
        part of the step's program, not programs of their own)."""
        if self.compiler is None:
            return self
        ctx = copy.copy(self)
        ctx.compiler = None
        return ctx

    # -- forward ----------------------------------------------------------------------------
    def predict(self, params: Params, x: Tensor) -> Tensor:
        """Model output ``h_w(x)`` with ``params`` in place of the module's parameters."""
        return self._dispatch("predict", self._predict, (params, x))

    def _predict(self, params: Params, x: Tensor) -> Tensor:
        if self._layers:
            return self._forward(params, x, None, count=False)[0]
        return model_logits(functional_call(self.model, (params, self.constants(params, self.buffers)), (x,)))

    def loss(self, params: Params, batch: Batch) -> Tensor:
        """Masked mean loss ``f(w; D)``."""
        return self._dispatch("loss", self._loss, (params, batch), _empty_loss)

    def _loss(self, params: Params, batch: Batch) -> Tensor:
        if self._layers:
            value, stats = self._loss_and_stats(params, batch)
            self._advance(stats)
            # called inside a caller's own grad transform, the statistics belong to its level: once the
            # transform exits they are dead wrappers, unwrapped by updated_buffers
            self._may_leak = self._may_leak or bool(stats)
            return value
        per_sample = self.per_sample_loss(self._predict(params, batch.x), batch.y)
        mask = batch.mask.to(per_sample.dtype)
        return (per_sample * mask).sum() / mask.sum().clamp_min(1.0)

    # -- derivatives --------------------------------------------------------------------------
    def grad(self, params: Params, batch: Batch) -> Params:
        """``∇f(w; D)`` by reverse mode (``torch.func.grad``)."""
        return self._dispatch("grad", self._grad, (params, batch), _empty_grad)

    def _grad(self, params: Params, batch: Batch) -> Params:
        if self._layers:
            g, stats = grad(self._loss_and_stats, has_aux=True)(params, batch)
            self._advance(stats)
            return g
        return grad(self._loss)(params, batch)

    def loss_and_grad(self, params: Params, batch: Batch) -> tuple[Tensor, Params]:
        """``(f(w; D), ∇f(w; D))`` in one backward pass."""
        return self._dispatch("loss_and_grad", self._loss_and_grad, (params, batch), _empty_loss_and_grad)

    def _loss_and_grad(self, params: Params, batch: Batch) -> tuple[Tensor, Params]:
        if self._layers:
            g, (value, stats) = grad_and_value(self._loss_and_stats, has_aux=True)(params, batch)
            self._advance(stats)
            return value, g
        g, value = grad_and_value(self._loss)(params, batch)
        return value, g

    def frozen(self) -> ClientContext:
        """A snapshot of this context whose forwards do not advance the bound running statistics (for
        evaluation-like forwards inside a client step); the same context for models without BatchNorm."""
        if not self._layers:
            return self
        ctx = copy.copy(self)
        ctx._counting = False
        return ctx

    def hvp(self, params: Params, batch: Batch, v: Params) -> Params:
        """Exact Hessian-vector product ``∇²f(w; D) v`` by reverse-over-reverse: the vector-Jacobian
        product of the gradient, ``vᵀ ∇²f = (∇²f v)ᵀ`` since the Hessian is symmetric.

        No Hessian is formed; the cost is a few gradient evaluations. It is chosen over
        forward-over-reverse (jvp of grad; see :meth:`hvp_forward_over_reverse`) because it is faster
        under ``vmap`` and, unlike it, ``torch.compile`` can trace it (timings: benchmarks/results/speed.md).
        Its forwards do not advance bound running statistics (they re-evaluate a counted gradient).
        """
        return self._dispatch("hvp", self._hvp, (params, batch, v))

    def _hvp(self, params: Params, batch: Batch, v: Params) -> Params:
        ctx = self.frozen()
        _, pullback = vjp(lambda p: ctx._grad(p, batch), params)
        return pullback(v)[0]

    def hvp_forward_over_reverse(self, params: Params, batch: Batch, v: Params) -> Params:
        """The same product by forward-over-reverse (jvp of grad); kept as a cross-check."""
        ctx = self.frozen()
        return jvp(lambda p: ctx._grad(p, batch), (params,), (v,))[1]

    # -- steps --------------------------------------------------------------------------------
    def sgd_step(self, params: Params, batch: Batch, lr: float | Tensor) -> tuple[Params, Tensor]:
        """One SGD step ``w − lr ∇f(w; D)``; returns the new parameters and ``f(w; D)``."""
        return self._dispatch("sgd_step", self._sgd_step, (params, batch, lr), _empty_sgd_step)

    def _sgd_step(self, params: Params, batch: Batch, lr: float | Tensor) -> tuple[Params, Tensor]:
        loss, g = self._loss_and_grad(params, batch)
        return tree_axpy(-lr, g, params), loss

    def accuracy_counts(self, params: Params, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        """``(correct, count, loss_sum)`` over the real (unmasked) samples of ``batch``."""
        if self._layers:
            logits = self._forward(params, batch.x, batch.mask, count=False)[0]
        else:
            logits = self._predict(params, batch.x)
        per_sample = self.per_sample_loss(logits, batch.y)
        mask = batch.mask.to(per_sample.dtype)
        correct = ((logits.argmax(-1) == batch.y).to(per_sample.dtype) * mask).sum()
        return correct, mask.sum(), (per_sample * mask).sum()


# ----------------------------------------------------------------------------------------------
# the primitives' results on an empty batch (a step a client does not take: ``step_schedule="compacted"``)
# ----------------------------------------------------------------------------------------------
def _empty_loss(params: Params, batch: Batch) -> Any:
    """``f(w; ∅) = 0``: the masked mean over no sample (``Σ 0 / max(1, 0)``)."""
    return ZERO


def _empty_grad(params: Params, batch: Batch) -> Any:
    """``∇f(w; ∅) = 0``: every per-sample term is multiplied by its mask, 0."""
    return {k: ZERO for k in params}


def _empty_loss_and_grad(params: Params, batch: Batch) -> Any:
    return _empty_loss(params, batch), _empty_grad(params, batch)


def _empty_sgd_step(params: Params, batch: Batch, lr: Any) -> Any:
    """``(w − lr·0, 0) = (w, 0)``."""
    return dict(params), _empty_loss(params, batch)
