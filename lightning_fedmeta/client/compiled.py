"""Compiled client primitives: each step of :class:`~lightning_fedmeta.client.functional.ClientContext` compiled
once, batched over the clients, and reused for every local step and every round.

Why: under ``torch.func.vmap`` every small operation of a client step pays functorch's dispatch, and
some CPU kernels are slow on small tensors (ELU's ``expm1`` runs at about 10 ns per element), so an eager
round of workload W sits at about 5× its GEMM floor (benchmarks/results/speed.md). ``torch.compile`` of
the whole vmapped ``client_update`` fixes that, but dynamo unrolls its Python loop over the τ local
steps: the compiled program, and the time to compile it, grow with τ (minutes on a cold cache for
Per-FedAvg HF). Compiling the *primitives* instead (``sgd_step``, ``loss_and_grad``, ``grad``, ``hvp``,
``loss``, ``predict``) gives a few small programs, each compiled once and called τ times per round.

How: :func:`~lightning_fedmeta.client.execution.run_clients` runs ``client_update`` under ``vmap`` as before, so
every algorithm (built-in or plugin) is unchanged. When the context calls a primitive with only that one
``vmap`` level active, the call leaves the ``vmap`` the way a custom batching rule does (what
``torch.autograd.Function``'s ``vmap`` staticmethod does, PyTorch docs "Extending torch.func with
autograd.Function", without its generic wrapping, which cost ~0.3 ms per call): it takes each argument's
underlying tensor with all clients stacked along one axis (``_unwrap_batched``), steps below the ``vmap``
level (``interpreter.lower()``), calls ``torch.compile(vmap(primitive))`` on them and hands the stacked
results back to the surrounding ``vmap`` (``_add_batch_dim``). The algorithm's own arithmetic between
primitives stays eager under ``vmap``.

Numbers: a compiled primitive computes the same function with fused, re-ordered floating-point
operations, so results agree with the eager path to rounding (tested to 1e-5 relative), not bit for bit.
A primitive that cannot be compiled (no C++ compiler, an operation dynamo cannot trace) warns once and
runs eagerly, batched the same way. Calls that need a gradient through the primitive (FedMAML's second
order, a user's ``grad`` around ``ctx.sgd_step``), calls under an extra ``torch.func`` transform, and
contexts with per-client BatchNorm statistics always run eagerly.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch._C._functorch import _add_batch_dim, _unwrap_batched
from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter
from torch.func import vmap
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from lightning_fedmeta.client.graphs import MAX_GRAPHS, CudaGraphs, GraphBackend, GraphedCall

__all__ = [
    "AUTO_COMPILE_SECONDS",
    "COMPILE_SAVING",
    "PROGRAM_COMPILE_SECONDS",
    "ZERO",
    "client_buckets",
    "CompileStats",
    "PrimitiveCompiler",
    "describe_decision",
    "only_client_vmap",
    "worth_compiling",
]

#: ``compile_clients="auto"`` compiles when the rounds left would spend at least this many seconds in eager
#: client computation. Compiling costs about 3–25 s once (warm or cold cache, benchmarks/results/speed.md)
#: and makes rounds about 2–3× faster, so at this threshold it saves at least the time it costs.
AUTO_COMPILE_SECONDS = 30.0
#: the compile time of one program (one primitive at one bucket size) the "auto" decision budgets: 18–27 s measured
#: for PFLlib's CNN step on this project's 2-core CPU machine (cold cache), 3–25 s for workload W
PROGRAM_COMPILE_SECONDS = 20.0
#: the fraction of eager client time compiling saves, at the least: the CNN's step went from 6 to 4 ms (1.5×)
COMPILE_SAVING = 1 / 3


def worth_compiling(
    rounds_left: int | None, eager_round_seconds: float, threshold: float = AUTO_COMPILE_SECONDS, programs: int = 1
) -> bool:
    """Whether compiling pays: ``rounds_left`` rounds of ``eager_round_seconds`` each reach ``threshold`` seconds of
    eager client computation, and the time saved, ``rounds_left·eager·COMPILE_SAVING``, covers compiling
    ``programs`` programs (``programs·PROGRAM_COMPILE_SECONDS``). An unknown number of rounds never compiles: eager
    is never wrong."""
    if rounds_left is None:
        return False
    eager = rounds_left * eager_round_seconds
    return eager >= threshold and eager * COMPILE_SAVING >= programs * PROGRAM_COMPILE_SECONDS


def describe_decision(decision: bool, rounds_left: int | None, eager_round_seconds: float, programs: int = 1) -> str:
    """The log line of an automatic decision: what was measured and what follows."""
    ms = 1e3 * eager_round_seconds
    if rounds_left is None:
        return (f"the run has no step limit, so the client steps stay eager ({ms:.0f} ms per round); "
                "set compile_clients=true to compile them")
    total = rounds_left * eager_round_seconds
    verdict = "compiling the client steps" if decision else "the client steps stay eager"
    return (f"{verdict}: {rounds_left} rounds left x {ms:.0f} ms eager = {total:.0f} s, saving about "
            f"{total * COMPILE_SAVING:.0f} s against ~{programs * PROGRAM_COMPILE_SECONDS:.0f} s to compile {programs} "
            f"program(s) (compiles when eager >= {AUTO_COMPILE_SECONDS:.0f} s and the saving covers the compile; "
            "set compile_clients=true/false to choose)")


class _Zero:
    """The marker of an output that is zero on an empty batch (its shape and dtype those of the computed one)."""

    def __repr__(self) -> str:
        return "ZERO"


#: in a primitive's empty-batch result (``empty`` of :meth:`PrimitiveCompiler.call`): "zeros like the computed output"
ZERO = _Zero()


def client_buckets(clients: int, whole: frozenset[int] | set[int] = frozenset()) -> list[int]:
    """The sizes a compiled call of ``clients`` clients runs in: ``[clients]`` when it is one of the ``whole`` sizes
    (the round's usual call, e.g. a full chunk), else its binary decomposition, largest first (``10 → [8, 2]``,
    ``7 → [4, 2, 1]``). Compiled programs have static shapes; with these buckets every number of clients up to
    ``2^k`` is served by at most ``k + 1`` programs per primitive (plus the whole sizes), so rounds of changing sizes
    (step groups, compacted steps, dropout) never recompile into dynamo's limit."""
    if clients < 1:
        raise ValueError(f"client_buckets needs at least one client, got {clients}")
    if clients in whole:
        return [clients]
    return [1 << bit for bit in range(clients.bit_length() - 1, -1, -1) if clients >> bit & 1]


def only_client_vmap() -> bool:
    """Whether exactly one ``torch.func`` transform is active and it is a ``vmap`` (the clients' axis)."""
    stack = torch._C._functorch.get_interpreter_stack()
    return stack is not None and len(stack) == 1 and stack[0].key() == torch._C._functorch.TransformType.Vmap


@dataclass
class CompileStats:
    """What a :class:`PrimitiveCompiler` did: programs compiled, seconds spent in the calls that compiled
    them (tracing, code generation, the C++ compiler), calls served compiled, and failures."""

    programs: int = 0
    compile_seconds: float = 0.0
    compiled_calls: int = 0
    eager_calls: int = 0
    failures: list[str] = field(default_factory=list)
    graphs: int = 0  #: captured calls (one per primitive and shape)
    replays: int = 0  #: calls served by replaying a captured graph


class _Primitive:
    """One call of a primitive: ``fn(*operands)`` per client, with the operands flattened to tensors
    (``spec`` rebuilds them), computed for all clients at once by :meth:`batched`."""

    def __init__(self, owner: PrimitiveCompiler, key: Any, fn: Callable[..., Any], spec: TreeSpec) -> None:
        self.owner = owner
        self.key = key
        self.fn = fn
        self.spec = spec
        self.out_spec: TreeSpec | None = None

    def per_client(self, *leaves: Tensor) -> Any:
        return self.fn(*tree_unflatten(list(leaves), self.spec))

    def flat(self, out: Any) -> tuple[Tensor, ...]:
        leaves, self.out_spec = tree_flatten(out)
        return tuple(leaves)

    def batched(self, batch_size: int, in_dims: tuple[int | None, ...], leaves: tuple[Tensor, ...]) -> tuple[Any, Any]:
        """The primitive on all clients at once: every operand stacked along axis 0 (an operand shared by all
        clients is repeated, so one program serves every call), results stacked along axis 0. Eager (the eager
        path's own batching) when compiling is off (a compacted call)."""

        def eager() -> Any:  # the eager path's own batching of each operand: the eager numbers, bit for bit
            return vmap(self.per_client, in_dims=in_dims)(*leaves)

        if not (self.owner.enabled or self.owner.graphs):
            out = self.flat(eager())
            return out, (0,) * len(out)
        pieces = client_buckets(batch_size, self.owner.whole_sizes) if self.owner.enabled else [batch_size]
        if len(pieces) == 1:
            stacked = _without_aliases(tuple(
                self.owner._repeated(t, batch_size) if d is None else t.movedim(d, 0)
                for t, d in zip(leaves, in_dims, strict=True)
            ))
            out = self.flat(self.owner._run(self, stacked, eager))
            return out, (0,) * len(out)
        parts, start = [], 0
        for size in pieces:  # one program per bucket size: a few shapes serve every number of clients
            rows = slice(start, start + size)
            sub = tuple(t if d is None else t.movedim(d, 0)[rows].contiguous()
                        for t, d in zip(leaves, in_dims, strict=True))
            sub_dims = tuple(None if d is None else 0 for d in in_dims)
            stacked = _without_aliases(tuple(self.owner._repeated(t, size) if d is None else t
                                             for t, d in zip(sub, sub_dims, strict=True)))
            parts.append(self.flat(self.owner._run(
                self, stacked, lambda sub=sub, sub_dims=sub_dims: vmap(self.per_client, in_dims=sub_dims)(*sub))))
            start += size
        out = tuple(torch.cat(column) for column in zip(*parts, strict=True))
        return out, (0,) * len(out)


class PrimitiveCompiler:
    """Compiles the client context's primitives, batched over clients, on demand.

    Args:
        enabled: whether calls are compiled now (the module switches it, e.g. on after ``compile_clients="auto"``
            decided the run is long enough; off for evaluation).
        backend: ``torch.compile`` backend (``"inductor"``: fused C++/OpenMP kernels on CPU, Triton on GPU).
        skip_isa_probe: trust the CPU's reported vector instructions (``/proc/cpuinfo``) instead of letting
            inductor compile one test program per instruction set on a cold cache (6–10 s on a 2-core
            machine). A compiler that rejects the flags makes the compile fail, which falls back to eager.

    A primitive is keyed by its name and static arguments (Python numbers such as a learning rate); each
    distinct shape of the stacked operands (clients per chunk, batch size) is one program (``dynamic=False``:
    static shapes give the fastest CPU kernels and the numbers do not depend on which other shapes were seen).
    """

    def __init__(self, enabled: bool = False, backend: str = "inductor", skip_isa_probe: bool = True,
                 graphs: bool = False, graph_backend: GraphBackend | None = None) -> None:
        self.enabled = enabled
        #: capture each batched primitive call (compiled or not) once per shape and replay it
        #: (:mod:`lightning_fedmeta.client.graphs`; ``model.cuda_graphs``)
        self.graphs = graphs
        self.graph_backend: GraphBackend = graph_backend or CudaGraphs()
        self._graphed: dict[Any, GraphedCall] = {}
        self._graph_failed: set[Any] = set()
        self.backend = backend
        self.skip_isa_probe = skip_isa_probe
        self.stats = CompileStats()
        self._programs: dict[Any, Callable[..., Any] | None] = {}
        self._shapes: set[Any] = set()
        self._failed: set[Any] = set()  # primitives that could not compile: eager from then on, not even batched here
        self._specs: dict[Any, list[TreeSpec]] = {}  # operand structures seen per primitive (part of a program's key)
        self._modules: dict[int, list[nn.Module]] = {}
        self._repeats: dict[tuple[int, int, int], tuple[Tensor, Tensor]] = {}
        self._inside = False
        #: skip the clients whose batch is empty in calls that give their empty-batch result
        #: (``step_schedule="compacted"``; set by the engine for each training round)
        self.compact = False
        #: client-steps a compacted call computed and skipped (the benchmark's count of padded work avoided)
        self.compacted_steps = [0, 0]
        #: client counts compiled as one program (the engine's usual call size); others run in binary buckets
        self.whole_sizes: set[int] = set()

    # -- the context's entry point ---------------------------------------------------------------
    def call(self, key: Any, fn: Callable[..., Any], operands: tuple[Any, ...],
             empty: Callable[..., Any] | None = None, active: Tensor | None = None) -> Any:
        """``fn(*operands)`` for the current client, computed for all clients by the compiled program, or
        ``NotImplemented`` when this call must run eagerly (compiling off, not directly under the clients'
        ``vmap``, an operand requiring grad, or already inside a compiled primitive).

        With :attr:`compact`, ``empty(*operands)`` (this client's result on an empty batch, :data:`ZERO` marking
        zeros) and ``active`` (whether this client's batch holds a sample), only the active clients are computed
        (compiled or eagerly) and the others get ``empty``'s result: a step a finished client would take on a
        padded batch costs nothing."""
        compacting = self.compact and empty is not None and active is not None
        serves = self.enabled or self.graphs or compacting
        if not serves or self._inside or key in self._failed or not only_client_vmap():
            return NotImplemented
        leaves, spec = tree_flatten(operands)
        if any(not isinstance(t, Tensor) for t in leaves):  # e.g. a number inside a dict: not batchable as is
            return NotImplemented
        if torch.is_grad_enabled() and any(t.requires_grad for t in leaves):
            return NotImplemented
        interpreter = retrieve_current_functorch_interpreter()
        level = interpreter.level()
        unwrapped = [_unwrap_batched(t, level) for t in leaves]
        in_dims = tuple(d for _, d in unwrapped)
        if all(d is None for d in in_dims):  # nothing per client: one eager call serves all
            return NotImplemented
        primitive = _Primitive(self, key, fn, spec)
        size = interpreter.batch_size()
        if compacting:
            assert active is not None and empty is not None
            flags, flag_dim = _unwrap_batched(active, level)
            flags = flags.expand(size) if flag_dim is None else flags.movedim(flag_dim, 0)
            if not bool(flags.all()) and bool(flags.any()):
                idle = tree_flatten(empty(*operands))[0]  # this client's empty-batch result, still under the vmap
                idle_rows = [t if t is ZERO else _unwrap_batched(t, level) for t in idle]
                with interpreter.lower():
                    out = self._compacted(primitive, size, flags, in_dims, tuple(t for t, _ in unwrapped), idle_rows)
                assert primitive.out_spec is not None
                return tree_unflatten([_add_batch_dim(t, 0, level) for t in out], primitive.out_spec)
        with interpreter.lower():  # leave the clients' vmap: plain tensors with the clients stacked
            out, _ = primitive.batched(size, in_dims, tuple(t for t, _ in unwrapped))
        assert primitive.out_spec is not None
        return tree_unflatten([_add_batch_dim(t, 0, level) for t in out], primitive.out_spec)

    def _compacted(self, primitive: _Primitive, size: int, flags: Tensor, in_dims: tuple[int | None, ...],
                   leaves: tuple[Tensor, ...], idle: list[Any]) -> list[Tensor]:
        """The primitive on the active clients only (``flags``), scattered into the idle clients' results."""
        index = flags.nonzero().squeeze(1)
        chosen = tuple(t if d is None else t.index_select(d, index) for t, d in zip(leaves, in_dims, strict=True))
        computed, _ = primitive.batched(index.numel(), in_dims, chosen)
        self.compacted_steps[0] += index.numel()
        self.compacted_steps[1] += size - index.numel()
        if len(idle) != len(computed):
            raise RuntimeError(f"the empty-batch result of primitive {primitive.key[0]!r} has {len(idle)} outputs, "
                               f"the primitive {len(computed)}")
        out = []
        for done, rest in zip(computed, idle, strict=True):
            if rest is ZERO:
                base = done.new_zeros((size, *done.shape[1:]))
            else:
                t, d = rest
                base = t.unsqueeze(0).expand(size, *t.shape) if d is None else t.movedim(d, 0)
                base = base.to(done.dtype)
            out.append(base.index_copy(0, index, done))
        return out

    def new_call(self) -> None:
        """Forget the repeated copies of shared operands (called by the module before each batch of clients)."""
        self._repeats.clear()

    def _repeated(self, t: Tensor, batch_size: int) -> Tensor:
        """``t`` repeated for every client, ``[batch_size, *t.shape]``; one copy per tensor and client count until
        :meth:`new_call` (a prox centre or a control variate is shared by all τ steps of a round)."""
        key = (id(t), t._version, batch_size)
        hit = self._repeats.get(key)
        if hit is not None and hit[0] is t:
            return hit[1]
        copy = t.unsqueeze(0).expand(batch_size, *t.shape).contiguous()
        self._repeats[key] = (t, copy)  # keeps t alive, so its id is not reused while the copy is kept
        return copy

    # -- compiling and running ----------------------------------------------------------------------
    @contextlib.contextmanager
    def _inductor_options(self) -> Iterator[None]:
        if self.backend != "inductor" or not self.skip_isa_probe:
            yield
            return
        import torch._inductor.config as inductor_config

        with inductor_config.patch({"cpp.vec_isa_ok": True}):
            yield

    def _program(self, key: Any, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        if key not in self._programs:
            autocast = key[0][2]

            def per_client(*leaves: Tensor) -> Any:
                with _autocast(autocast):
                    return fn(*leaves)

            self._programs[key] = torch.compile(
                _own_code(vmap(per_client)), backend=self.backend, dynamic=False, fullgraph=True,
                options={"guard_filter_fn": _tensor_guards},
            )
        return self._programs[key]

    def _structure(self, primitive: _Primitive) -> int:
        """Which operand structure (pytree spec) of this primitive the call has: programs take flat tensors."""
        seen = self._specs.setdefault(primitive.key, [])
        for i, spec in enumerate(seen):
            if spec == primitive.spec:
                return i
        seen.append(primitive.spec)
        return len(seen) - 1

    def _training_flags(self, key: Any) -> tuple[bool, ...]:
        """The train/eval flags of the modules of the context in ``key`` (a program traced in one mode must not
        serve the other: dropout, normalisation, a model's own ``if self.training``)."""
        model = getattr(key[1], "model", None)
        if model is None:
            return ()
        modules = self._modules.get(id(model))
        if modules is None:
            modules = self._modules[id(model)] = list(model.modules())
        return tuple(m.training for m in modules)

    def _run(self, primitive: _Primitive, stacked: tuple[Any, ...], eager: Callable[[], Any]) -> Any:
        self._inside = True
        try:
            key = (primitive.key, self._structure(primitive), _autocast_state(), self._training_flags(primitive.key))
            # one program (its own code object) per shape: dynamo never recompiles one, so no recompile limit
            shape_key = (key, tuple((t.shape, t.dtype, t.device) for t in stacked))
            if not self.enabled:  # captured only: the primitive batched over the stacked clients, uncompiled
                return self._replayed(shape_key, primitive, vmap(primitive.per_client), stacked)
            program = self._program(shape_key, primitive.per_client)
            if program is None:
                self.stats.eager_calls += 1
                return eager()
            first = shape_key not in self._shapes
            t0 = time.perf_counter()
            try:
                with self._inductor_options() if first else contextlib.nullcontext():
                    out = self._replayed(shape_key, primitive, program, stacked) if self.graphs else program(*stacked)
            except Exception as exc:  # a primitive torch.compile cannot handle: eager from now on
                self._programs[shape_key] = None
                reason = _reason(exc)
                self.stats.failures.append(f"{primitive.key[0]}: {reason}")
                warnings.warn(
                    f"torch.compile could not compile the client primitive {primitive.key[0]!r} ({reason}); it runs "
                    "eagerly (batched) from now on. Set compile_clients=False to silence this.",
                    stacklevel=2,
                )
                self._failed.add(primitive.key)
                self.stats.eager_calls += 1
                return eager()
            if first:
                self._shapes.add(shape_key)
                self.stats.programs += 1
                self.stats.compile_seconds += time.perf_counter() - t0
            self.stats.compiled_calls += 1
            return out
        finally:
            self._inside = False


    def _replayed(self, shape_key: Any, primitive: _Primitive, program: Callable[..., Any],
                  stacked: tuple[Any, ...]) -> Any:
        """``program(*stacked)`` through its captured graph (captured on the first call of this shape; a call
        that cannot be captured warns once and runs uncaptured from then on)."""
        call = self._graphed.get(shape_key)
        if call is None and shape_key not in self._graph_failed and len(self._graphed) < MAX_GRAPHS:
            try:
                call = self._graphed[shape_key] = GraphedCall(program, stacked, self.graph_backend)
                self.stats.graphs += 1
            except Exception as exc:  # e.g. an operation that synchronises with the host
                self._graph_failed.add(shape_key)
                reason = _reason(exc)
                self.stats.failures.append(f"{primitive.key[0]} (graph capture): {reason}")
                warnings.warn(f"the client primitive {primitive.key[0]!r} could not be captured as a CUDA graph "
                              f"({reason}); it runs uncaptured. Set cuda_graphs=False to silence this.", stacklevel=3)
        if call is None:
            return program(*stacked)
        self.stats.replays += 1
        return call(*stacked)


#: the guards a program keeps: each input tensor's metadata, and whether inputs are the same tensor
_KEPT_GUARDS = frozenset({"TENSOR_MATCH", "DUPLICATE_INPUT", "NO_TENSOR_ALIASING"})


def _tensor_guards(entries: list[Any]) -> list[bool]:
    """Guard filter of the programs: keep the tensors' guards (see :func:`_own_code` for why the rest go)."""
    return [entry.guard_type in _KEPT_GUARDS for entry in entries]


def _without_aliases(stacked: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """``stacked`` with any tensor that shares memory with an earlier one copied: a program compiled for inputs
    that alias each other (e.g. a prox step's model and centre, both the shared global model in a round's first
    step) must never serve inputs that do not, nor the reverse, so programs only ever see distinct memory."""
    seen: set[int] = set()
    out = []
    for t in stacked:
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        out.append(t)
    return tuple(out)


def _reason(exc: BaseException) -> str:
    """The root cause of a compile failure in one line (dynamo wraps backend errors in BackendCompilerFailed)."""
    while True:
        inner = getattr(exc, "inner_exception", None) or exc.__cause__
        if not isinstance(inner, BaseException) or inner is exc:
            break
        exc = inner
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` behind a function with a code object of its own.

    Dynamo keeps compiled programs per code object and picks one by its guards. The programs here keep only
    the guards on their tensors (shapes, strides, dtypes, devices: dynamo's default guards on the model's
    modules cost ~0.3 ms per call); everything else a program depends on (the primitive, the context, static
    arguments, train/eval mode, autocast) is in its key. Without a code object of its own, two primitives
    called with tensors of the same shapes (``grad`` and ``loss_and_grad``) would share one cache entry.
    ``fullgraph=True`` keeps the whole primitive in that one frame (a graph break would resume in shared code).
    """
    namespace: dict[str, Any] = {"_fn": fn}
    exec("def program(*operands):\n    return _fn(*operands)\n", namespace)  # a new code object per call
    return namespace["program"]


def _autocast_state() -> tuple[tuple[str, bool, torch.dtype], ...]:
    """The ambient autocast setting of the CPU and CUDA (part of a program's key, re-entered inside it)."""
    state = []
    for device in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device):
            state.append((device, True, torch.get_autocast_dtype(device)))
    return tuple(state)


@contextlib.contextmanager
def _autocast(state: tuple[tuple[str, bool, torch.dtype], ...]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device, enabled, dtype in state:
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
        yield

