"""A plugin author's kit: check that an algorithm keeps the contract of the federated loop.

In the spirit of scikit-learn's ``check_estimator``, one call runs an algorithm through the loop on
tiny clients of unequal sizes (two held out, three of the six others sampled per round) and checks
everything the loop relies on. A plugin's whole conformance test is::

    from lightning_fedmeta.testing import check_algorithm

    def test_pfedme():
        check_algorithm("pfedme")

The checks (each callable alone, with the same arguments as :func:`check_algorithm`):

* :func:`check_round`: real rounds with state write-back. What ``init_client_states``,
  ``init_server_state``, ``client_update`` and ``aggregate`` return has the right keys, shapes,
  dtypes and devices and is finite; metrics are one scalar per client; ``client_update`` leaves
  its inputs alone; the sampled clients' rows (and only theirs) are written back and marked seen.
* :func:`check_loop_equals_vmap`: looped and batched (``vmap``) clients give the same rounds and
  the same evaluation, to a tolerance (skipped for ``batchable = False`` algorithms and for
  models with dropout).
* :func:`check_personalize_matches_evaluation`: after a short ``Trainer.fit``, each client's
  logged accuracy and loss are those of ``module.personalize(i)`` on its test data, for training
  and held-out clients; a client that never trained does not read its stored (initial) state.
* :func:`check_resume_is_bit_exact`: a run resumed from a Lightning checkpoint written mid-run ends
  bit for bit where the uninterrupted run ends (model, client states, server state, ``seen``,
  per-client evaluation).
* :func:`check_bf16`: a ``precision="bf16-mixed"`` run on the CPU stays finite.

A failed check raises ``AssertionError`` naming the algorithm, the check and the problem, e.g.
``'ditto' (Ditto) failed check_round: AlgorithmContractError: Ditto.client_update (algorithm 'ditto')
returned state['personal']['0.weight'] with shape [8] per client, but its stored row ...``.

Fixtures: :func:`tiny_clients` (a :class:`~lightning_fedmeta.FederatedDataset` of unequal clients),
:func:`tiny_mlp`, :func:`quadratic_client` (a client whose loss is a known quadratic, for checks
against a closed form) and :func:`client_record` (one client's record, for direct calls).

This module needs neither pytest nor a GPU. It runs on the CPU, in a few seconds per algorithm.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor, nn

from lightning_fedmeta.algorithms.base import Algorithm, ClientOutput, ClientRecord, client_records
from lightning_fedmeta.client.execution import choose_batching, run_clients
from lightning_fedmeta.client.functional import Batch, ClientContext, Params, model_logits
from lightning_fedmeta.client.sampling import stable_seed
from lightning_fedmeta.communication.accounting import payload_bytes, upload_of_client
from lightning_fedmeta.data.datamodule import FederatedDataModule
from lightning_fedmeta.data.federated import FederatedData, FederatedDataset, from_client_tensors
from lightning_fedmeta.loop.server import apply_server_step
from lightning_fedmeta.loop.validation import (
    named_leaves,
    validate_aggregate_output,
    validate_client_output,
    validate_init_client_states,
    validate_init_server_state,
)
from lightning_fedmeta.module import FederatedModule
from lightning_fedmeta.persistence.memory_store import flatten_state, map_state, unflatten_state
from lightning_fedmeta.registry import create_algorithm, load_algorithm

__all__ = [
    "CHECKS",
    "AlgorithmSpec",
    "QuadraticClient",
    "TinyClients",
    "check_aggregator",
    "check_algorithm",
    "check_bf16",
    "check_dataset",
    "check_partitioner",
    "check_loop_equals_vmap",
    "check_personalize_matches_evaluation",
    "check_resume_is_bit_exact",
    "check_round",
    "client_record",
    "quadratic_client",
    "tiny_clients",
    "tiny_mlp",
]

AlgorithmSpec = str | Mapping[str, Any] | Algorithm | type[Algorithm]
"""An algorithm as :func:`check_algorithm` accepts it: a registered name, a mapping
``{"name": ..., <hyper-parameters>}``, an :class:`~lightning_fedmeta.Algorithm` instance (deep-copied
for every run) or an ``Algorithm`` subclass (built with its defaults)."""

CHECKS = (
    "check_round",
    "check_loop_equals_vmap",
    "check_personalize_matches_evaluation",
    "check_resume_is_bit_exact",
    "check_bf16",
    "check_exchange",
    "check_population_view",
)
"""The checks :func:`check_algorithm` runs, in this order (the names its ``skip`` argument accepts)."""

DEFAULT_SIZES = (6, 20, 9, 14, 5, 30, 8, 11)
"""Training-set sizes of the default clients: unequal, some smaller than any batch size."""


# ----------------------------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------------------------
class TinyClients(FederatedDataset):
    """Clients of a small classification problem with unequal sizes, feature shift and label skew.

    A :class:`~lightning_fedmeta.FederatedDataset`: pass it to ``FederatedDataModule(dataset=...)``,
    or its ``client_data()`` to :func:`~lightning_fedmeta.from_client_tensors`. The samples are a pure
    function of the arguments.
    """

    def __init__(
        self,
        sizes: Sequence[int] = DEFAULT_SIZES,
        test_size: int = 6,
        num_features: int = 5,
        num_classes: int = 3,
        seed: int = 4,
    ) -> None:
        if not sizes or min(sizes) < 1 or test_size < 1:
            raise ValueError(f"every client needs >= 1 train and test sample, got sizes={list(sizes)}, "
                             f"test_size={test_size}")
        self.sizes = [int(n) for n in sizes]
        self.test_size = int(test_size)
        self.num_features = int(num_features)
        self.num_classes = int(num_classes)
        self.seed = int(seed)
        self.client_names = [f"client_{i}" for i in range(len(self.sizes))]

    @property
    def num_clients(self) -> int:
        return len(self.sizes)

    def client_data(self) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
        g = torch.Generator().manual_seed(self.seed)
        w_true = torch.randn(self.num_features, self.num_classes, generator=g)
        clients = []
        for i, n in enumerate(self.sizes):
            shift = torch.randn(self.num_features, generator=g) * 0.5 * (i % 3)
            x = torch.randn(n + self.test_size, self.num_features, generator=g) + shift
            noise = 0.3 * torch.randn(n + self.test_size, self.num_classes, generator=g)
            y = (x @ w_true + noise).argmax(1)
            clients.append((x[:n], y[:n], x[n:], y[n:]))
        return clients

    def federated_data(self) -> FederatedData:
        """The clients as :class:`~lightning_fedmeta.FederatedData` (for ``module.attach_data``)."""
        return from_client_tensors(self.client_data(), self.num_classes, self.client_names)


def tiny_clients(
    num_clients: int = 8,
    *,
    sizes: Sequence[int] | None = None,
    test_size: int = 6,
    num_features: int = 5,
    num_classes: int = 3,
    seed: int = 4,
) -> TinyClients:
    """A :class:`TinyClients` dataset: ``num_clients`` clients with training sets of unequal sizes
    (``6, 20, 9, 14, 5, 30, 8, 11``, repeated; or ``sizes``) and ``test_size`` test samples each."""
    if sizes is None:
        sizes = [DEFAULT_SIZES[i % len(DEFAULT_SIZES)] for i in range(num_clients)]
    return TinyClients(sizes, test_size, num_features, num_classes, seed)


def tiny_mlp(num_features: int = 5, num_classes: int = 3, hidden: int = 8, seed: int = 0) -> nn.Module:
    """``Linear → Tanh → Linear``: small, but non-linear so that second-order terms matter. Its
    initialisation is a function of ``seed`` (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(num_features, hidden), nn.Tanh(), nn.Linear(hidden, num_classes))


def client_record(
    num_samples: int = 10, *, index: int = 0, weight: float = 1.0, seen: bool = False, is_new: bool = False
) -> ClientRecord:
    """One client's :class:`~lightning_fedmeta.ClientRecord` (0-d fields), as the loop passes it to
    ``client_update``, ``personalize`` and ``personal_start``: for calling them directly."""
    stacked = client_records([num_samples], weight=[weight], is_new=[is_new], seen=[seen], index=[index])
    return ClientRecord(*(t[0] for t in stacked))


def _half_squared_error(out: Tensor, y: Tensor) -> Tensor:
    return 0.5 * (out.squeeze(-1) - y) ** 2


@dataclass(frozen=True)
class QuadraticClient:
    """A client whose loss is the quadratic ``f(θ) = (1/2n) ‖Xθ − y‖² = ½ θᵀAθ − bᵀθ + c``
    (``A = XᵀX/n``, ``b = Xᵀy/n``), seen through a bias-free ``nn.Linear(d, 1)``.

    Attributes:
        ctx: the :class:`~lightning_fedmeta.ClientContext` to call algorithms with: the linear model,
            with the per-sample loss ``½ (h(x) − y)²`` in place of cross-entropy.
        params: a starting point ``{"weight": [1, d]}``.
        batches: the client's round of batches, ``[steps, 1, n, ...]``: the full batch at every step.
        record: the client's 0-d :class:`~lightning_fedmeta.ClientRecord` (index 0, ``n`` samples).
        x, y: the data, ``[n, d]`` and ``[n]``.
        hessian, b: ``A`` and ``b``.

    The methods give closed forms on parameter dicts shaped like ``params``.
    """

    ctx: ClientContext
    params: Params
    batches: Batch
    record: ClientRecord
    x: Tensor
    y: Tensor
    hessian: Tensor
    b: Tensor

    def _vec(self, params: Params) -> Tensor:
        return params["weight"].reshape(-1)

    def _params(self, v: Tensor) -> Params:
        return {"weight": v.reshape(1, -1)}

    def loss(self, params: Params) -> Tensor:
        """``f(θ)``."""
        r = self.x @ self._vec(params) - self.y
        return 0.5 * (r * r).mean()

    def grad(self, params: Params) -> Params:
        """``∇f(θ) = Aθ − b``."""
        return self._params(self.hessian @ self._vec(params) - self.b)

    def minimizer(self) -> Params:
        """``argmin f = A⁻¹ b`` (least squares when ``A`` is singular)."""
        return self._params(torch.linalg.lstsq(self.hessian, self.b.unsqueeze(1)).solution.squeeze(1))

    def prox(self, w: Params, lam: float) -> Params:
        """The proximal point ``argmin_θ f(θ) + λ/2 ‖θ − w‖² = (A + λI)⁻¹ (b + λw)``."""
        eye = torch.eye(self.hessian.shape[0], dtype=self.hessian.dtype)
        return self._params(torch.linalg.solve(self.hessian + lam * eye, self.b + lam * self._vec(w)))

    def gd(self, w: Params, lr: float, steps: int) -> Params:
        """``steps`` full-batch gradient steps ``θ ← θ − lr (Aθ − b)`` from ``w``."""
        v = self._vec(w)
        for _ in range(steps):
            v = v - lr * (self.hessian @ v - self.b)
        return self._params(v)


def quadratic_client(
    dim: int = 4,
    num_samples: int = 16,
    *,
    steps: int = 1,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    seen: bool = False,
) -> QuadraticClient:
    """A :class:`QuadraticClient` with ``num_samples`` random samples of dimension ``dim`` (float64 by
    default, so closed forms hold to ~1e-12) and a round of ``steps`` full batches."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, dim, generator=g, dtype=dtype)
    y = torch.randn(num_samples, generator=g, dtype=dtype)
    w = {"weight": torch.randn(1, dim, generator=g, dtype=dtype)}
    model = nn.Linear(dim, 1, bias=False).to(dtype)
    ctx = ClientContext(model, per_sample_loss=_half_squared_error)
    batches = Batch(
        x.expand(steps, 1, num_samples, dim).clone(),
        y.expand(steps, 1, num_samples).clone(),
        torch.ones(steps, 1, num_samples, dtype=dtype),
    )
    return QuadraticClient(
        ctx=ctx, params=w, batches=batches, record=client_record(num_samples, seen=seen), x=x, y=y,
        hessian=x.T @ x / num_samples, b=x.T @ y / num_samples,
    )


# ----------------------------------------------------------------------------------------------
# plumbing
# ----------------------------------------------------------------------------------------------
class _CheckFailure(AssertionError):
    """A failed check, its message already naming the algorithm and the check."""


class _AsDataset(FederatedDataset):
    """A :class:`FederatedData` as a dataset for ``FederatedDataModule``."""

    def __init__(self, data: FederatedData) -> None:
        self.data = data
        self.num_classes = data.num_classes
        self.client_names = list(data.client_names)

    def client_data(self) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
        return [(*self.data.client_train(i), *self.data.client_test(i)) for i in range(self.data.num_clients)]


@dataclass
class _Setup:
    label: str
    make_algorithm: Callable[[], Algorithm]
    make_model: Callable[[], nn.Module]
    dataset: FederatedDataset
    data: FederatedData
    clients_per_round: int
    holdout_clients: int
    seed: int
    atol: float
    rtol: float

    def module(self, **kwargs: Any) -> FederatedModule:
        return FederatedModule(
            model=self.make_model(), algorithm=self.make_algorithm(), clients_per_round=self.clients_per_round,
            holdout_clients=self.holdout_clients, seed=self.seed, **kwargs,
        )

    def datamodule(self, eval_every: int) -> FederatedDataModule:
        return FederatedDataModule(dataset=self.dataset, eval_every=eval_every)


def _algorithm_factory(spec: AlgorithmSpec) -> Callable[[], Algorithm]:
    if isinstance(spec, Algorithm):
        return lambda: copy.deepcopy(spec)
    if isinstance(spec, type) and issubclass(spec, Algorithm):
        return spec
    if isinstance(spec, str):  # the name alone: the defaults, or the class's example arguments
        return lambda: create_algorithm(spec, **load_algorithm(spec).example_arguments())
    if isinstance(spec, Mapping):
        args = dict(spec)
        name = args.pop("name", None)
        if not isinstance(name, str):
            raise ValueError(f"an algorithm given as a mapping needs a 'name' key, got keys {sorted(spec)}")
        return lambda: create_algorithm(name, **args)
    raise TypeError(
        "spec must be a registered name, a mapping with 'name', an Algorithm instance or an Algorithm subclass; "
        f"got {type(spec).__name__}"
    )


def _label(algorithm: Algorithm) -> str:
    cls = type(algorithm)
    return f"{cls.name!r} ({cls.__name__})" if cls.name else cls.__name__


def _setup(
    spec: AlgorithmSpec,
    model: nn.Module | Callable[[], nn.Module] | None,
    data: FederatedDataset | FederatedData | None,
    clients_per_round: int,
    holdout_clients: int,
    seed: int,
    atol: float,
    rtol: float,
) -> _Setup:
    make_algorithm = _algorithm_factory(spec)
    label = _label(make_algorithm())
    dataset: FederatedDataset = tiny_clients() if data is None else data  # type: ignore[assignment]
    if isinstance(data, FederatedData):
        dataset = _AsDataset(data)
        federated = data
    else:
        federated = from_client_tensors(dataset.client_data(), dataset.num_classes,
                                        getattr(dataset, "client_names", None))
    example = type(make_algorithm()).example_model(tuple(federated.input_shape), int(federated.num_classes or 1))
    if model is None and example is not None:
        model = example
    if model is None:
        if len(federated.input_shape) != 1:
            raise ValueError(f"pass a model for inputs of shape {federated.input_shape} (the default is an MLP)")
        template = tiny_mlp(federated.input_shape[0], federated.num_classes)
        make_model: Callable[[], nn.Module] = lambda: copy.deepcopy(template)  # noqa: E731
    elif isinstance(model, nn.Module):
        make_model = lambda: copy.deepcopy(model)  # noqa: E731
    else:
        make_model = model
    return _Setup(label, make_algorithm, make_model, dataset, federated, clients_per_round, holdout_clients, seed,
                  atol, rtol)


_QUIET_WARNINGS = (
    r".*does not have many workers.*",
    r".*isinstance\(treespec, LeafSpec\).*",
    r".*callbacks used to create the checkpoint need to be provided.*",
    r".*The number of training batches.*",
)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Lightning's info lines and its known harmless warnings off (the algorithm's own warnings stay), and one
    intra-op thread: on tensors this small, thread wake-ups cost more than they save (8x on a busy 2-core machine)."""
    loggers = [logging.getLogger(name) for name in ("lightning.pytorch", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    threads = torch.get_num_threads()
    with warnings.catch_warnings():
        for pattern in _QUIET_WARNINGS:
            warnings.filterwarnings("ignore", message=pattern)
        for lg in loggers:
            lg.setLevel(logging.WARNING)
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)


class _Check:
    """The running check: ``fail(...)`` raises its ``AssertionError``; any other error inside becomes one."""

    def __init__(self, setup: _Setup, name: str) -> None:
        self.setup = setup
        self.name = name

    def fail(self, message: str) -> None:
        raise _CheckFailure(f"{self.setup.label} failed {self.name}: {message}")


@contextlib.contextmanager
def _checking(setup: _Setup, name: str) -> Iterator[_Check]:
    check = _Check(setup, name)
    try:
        with _quiet():
            yield check
    except _CheckFailure:
        raise
    except Exception as exc:  # noqa: BLE001 - reported as the check's failure, chained
        raise _CheckFailure(f"{setup.label} failed {name}: {type(exc).__name__}: {exc}") from exc


def _trainer(max_steps: int, root: str, **kwargs: Any) -> L.Trainer:
    options: dict[str, Any] = {
        "max_steps": max_steps, "max_epochs": -1, "accelerator": "cpu", "devices": 1, "logger": False,
        "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
        "num_sanity_val_steps": 0, "default_root_dir": root,
    }
    options.update(kwargs)
    return L.Trainer(**options)


def _clone(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a (nested) dict of tensors."""
    return map_state(lambda v: v.detach().clone(), tree)


def _first_difference(a: Tensor, b: Tensor) -> str:
    if a.shape != b.shape:
        return f"shape {list(a.shape)} vs {list(b.shape)}"
    if a.dtype != b.dtype:
        return f"dtype {a.dtype} vs {b.dtype}"
    diff = (a.double() - b.double()).abs() if a.is_floating_point() else (a != b).double()
    diff = torch.nan_to_num(diff, nan=math.inf)
    flat = int(diff.reshape(-1).argmax()) if diff.numel() else 0
    pos = list(torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else []
    at = [int(p) for p in pos]
    x = a.reshape(-1)[flat].item() if a.numel() else None
    y = b.reshape(-1)[flat].item() if b.numel() else None
    return f"max |difference| {float(diff.max()) if diff.numel() else 0.0:.3g} at {at} ({x!r} vs {y!r})"


def _close(a: Tensor, b: Tensor, atol: float, rtol: float) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=False))
    return bool(torch.equal(a, b))


def _compare_trees(
    check: _Check, what: str, a: Any, b: Any, atol: float = 0.0, rtol: float = 0.0, exact: bool = False,
    names: tuple[str, str] = ("expected", "got"),
) -> None:
    left, right = dict(named_leaves(a)), dict(named_leaves(b))
    if left.keys() != right.keys():
        check.fail(f"{what}: the keys differ: {names[0]} {sorted(left)}, {names[1]} {sorted(right)}")
    for key, x in left.items():
        y = right[key]
        same = torch.equal(x, y) and x.dtype == y.dtype if exact else _close(x, y, atol, rtol)
        if not same:
            kind = "not bit-identical" if exact else f"differs beyond atol={atol:g}, rtol={rtol:g}"
            check.fail(f"{what}{key} {kind}: {_first_difference(x, y)} ({names[0]} vs {names[1]})")


def _server_optimizer(module: FederatedModule) -> torch.optim.Optimizer:
    """The default server optimizer ``SGD(lr=server_lr)`` (stateless: a fresh one each round is the same)."""
    assert module.model is not None
    return torch.optim.SGD([p for p in module.model.parameters() if p.requires_grad], lr=module.server_lr)


def _plain_round(module: FederatedModule, r: int) -> tuple[Tensor, ClientOutput, Params, dict[str, Tensor]]:
    """Round ``r`` through the engine's phases (compute, combine, server step, commit), without a Trainer."""
    result = module.engine.compute(r)
    assert result is not None, f"round {r}: no client answered"
    uploads = module.engine.combine(result)
    assert uploads is not None and uploads.update is not None
    apply_server_step(_server_optimizer(module), module.model, uploads.update.delta)
    module.engine.commit(result, uploads.update.server_state)
    return result.clients, result.output, uploads.update.delta, uploads.update.server_state


# ----------------------------------------------------------------------------------------------
# the checks
# ----------------------------------------------------------------------------------------------
def _check_round(setup: _Setup, rounds: int = 2) -> None:
    with _checking(setup, "check_round") as check:
        module = setup.module()
        module.attach_data(setup.data)  # validates init_client_states and init_server_state
        alg = module.algorithm
        k = setup.data.num_clients
        validate_init_client_states(alg, module.client_states.tensors, k)
        validate_init_server_state(alg, module.server_state)
        _check_new_client_state(check, setup, module)
        assert module.seen is not None
        for r in range(rounds):
            _check_one_round(check, module, r, k)


def _check_new_client_state(check: _Check, setup: _Setup, module: FederatedModule) -> None:
    """The fresh state of a client outside the federation has the federation's keys, ranks and dtypes."""
    alg = module.algorithm
    params = module._global_params()
    # the fresh state of a client outside the federation (FederatedModule.personalize((x, y)))
    outsider = ClientRecord(
        index=torch.tensor([-1]), weight=torch.zeros(1, dtype=torch.float64), is_new=torch.tensor([True]),
        seen=torch.tensor([False]), num_samples=torch.tensor([int(setup.data.train_counts[0])]),
    )
    fresh_tree = alg.init_client_states(params, outsider)
    validate_init_client_states(alg, fresh_tree, 1)
    fresh, stored = flatten_state(fresh_tree), flatten_state(module.client_states.tensors)
    if set(fresh) != set(stored):
        check.fail(f"init_client_states for one new client (index -1) gives keys {sorted(fresh)}, but for the "
                   f"federation {sorted(stored)}")
    for name, rows in stored.items():
        # sizes may depend on the clients described (e.g. one dual variable per sample); kinds may not
        if fresh[name].dim() != rows.dim() or fresh[name].dtype != rows.dtype:
            check.fail(
                f"init_client_states for one new client (index -1) gives state[{name!r}] of shape "
                f"{list(fresh[name].shape[1:])} and {fresh[name].dtype} per client, but for the federation "
                f"{list(rows.shape[1:])} and {rows.dtype}"
            )


def _check_one_round(check: _Check, module: FederatedModule, r: int, k: int) -> None:
    """Round ``r`` through the engine's phases, checking client_update, the sample, aggregate and the commit."""
    alg = module.algorithm
    assert module.seen is not None
    params = module._global_params()
    before = (_clone(params), _clone(module.server_state), _clone(module.client_states.tensors))
    seen_before = module.seen.clone()
    result = module.engine.compute(r)
    assert result is not None
    sampled, out, weights = result
    validate_client_output(alg, out, params, module.client_states.tensors, sampled.numel(),
                           strict_dtypes=True, check_finite=True)
    for what, old, now in zip(("the global parameters", "the server state", "the client state store"),
                              before, (params, module.server_state, module.client_states.tensors),
                              strict=True):
        _compare_trees(check, f"round {r}: client_update changed {what} in place: ", old, now, exact=True,
                       names=("before", "after"))
    _check_sample(check, module, sampled, r)
    uploads = module.engine.combine(result)
    assert uploads is not None and uploads.update is not None
    delta, server_state = uploads.update.delta, uploads.update.server_state
    validate_aggregate_output(alg, (delta, server_state), params, module.server_state, strict_dtypes=True,
                              check_finite=True)
    store_before = flatten_state(_clone(module.client_states.tensors))
    apply_server_step(_server_optimizer(module), module.model, delta)
    module.engine.commit(result, server_state)
    _check_write_back(check, module, out, sampled, store_before, r, k)
    expected_seen = seen_before.clone()
    expected_seen[sampled] = True
    if not torch.equal(module.seen, expected_seen):
        check.fail(f"round {r}: seen is {module.seen.tolist()}, expected {expected_seen.tolist()}")


def _check_sample(check: _Check, module: FederatedModule, sampled: Tensor, r: int) -> None:
    """Round ``r`` sampled ``num_sampled`` distinct clients, none of them held out."""
    ids = sampled.tolist()
    if len(set(ids)) != len(ids) or len(ids) != module.num_sampled:
        check.fail(f"round {r} sampled {ids}, expected {module.num_sampled} distinct clients")
    if bool(module.is_holdout[sampled].any()):
        check.fail(f"round {r} sampled a held-out client: {ids}")


def _check_write_back(
    check: _Check, module: FederatedModule, out: ClientOutput, sampled: Tensor, store_before: dict[str, Tensor],
    r: int, k: int,
) -> None:
    """The sampled clients' stored rows are the state client_update returned; the other rows are untouched."""
    returned = flatten_state(out.state)
    for name, rows in flatten_state(module.client_states.tensors).items():
        if not torch.equal(rows[sampled], returned[name].to(rows.dtype)):
            check.fail(f"round {r}: the stored rows of state[{name!r}] are not the state client_update "
                       "returned")
        others = torch.ones(k, dtype=torch.bool)
        others[sampled] = False
        if not torch.equal(rows[others], store_before[name][others]):
            check.fail(f"round {r}: state[{name!r}] of clients that were not sampled changed")


def _check_loop_equals_vmap(setup: _Setup, rounds: int = 2) -> None:
    with _checking(setup, "check_loop_equals_vmap") as check:
        probe = setup.module()
        if not type(probe.algorithm).batchable:
            return  # batchable = False: its clients always run looped
        assert probe.model is not None
        if choose_batching(probe.model, "auto")[0] == "loop":
            return  # e.g. dropout: the model forces the loop
        modules = {mode: setup.module(client_batching=mode) for mode in ("loop", "vmap")}
        for module in modules.values():
            module.attach_data(setup.data)
        tol = {"atol": setup.atol, "rtol": setup.rtol, "names": ("loop", "vmap")}
        for r in range(rounds):
            (s1, o1, d1, ss1), (s2, o2, d2, ss2) = (_plain_round(m, r) for m in modules.values())
            if not torch.equal(s1, s2):
                check.fail(f"round {r}: the loop sampled {s1.tolist()}, vmap {s2.tolist()}")
            for field in ClientOutput._fields:
                _compare_trees(check, f"round {r}: client_update's {field}", getattr(o1, field), getattr(o2, field),
                               **tol)
            _compare_trees(check, f"round {r}: aggregate's delta", d1, d2, **tol)
            _compare_trees(check, f"round {r}: aggregate's server_state", ss1, ss2, **tol)
        everyone = torch.arange(setup.data.num_clients)
        models = [_personalized_params(m, everyone, rounds) for m in modules.values()]
        _compare_trees(check, f"personalize after round {rounds}: ", *models, **tol)
        # accuracy counts are left out: argmax flips on ties (e.g. a model still at zero)
        evaluated = [m.evaluate_clients(everyone, rounds) for m in modules.values()]
        for what in ("total", "loss_sum"):
            _compare_trees(check, f"evaluation after round {rounds}: personalised {what}",
                           evaluated[0][what], evaluated[1][what], **tol)


def _personalized_params(module: FederatedModule, clients: Tensor, round_idx: int) -> Params:
    """Every listed client's personalised parameters, stacked, computed the way the evaluation computes them."""
    alg = module.algorithm
    adapt = module._batches("adapt", round_idx, clients, alg.eval_plan())
    seeds = [stable_seed(module.seed, "eval-dropout", round_idx, int(c)) for c in clients]

    def personalize(params: Params, server_state: dict[str, Tensor], batches: Batch, state: dict[str, Tensor],
                    record: ClientRecord) -> Params:
        return alg.personalize(module.ctx, params, batches, state, server_state, record)

    return run_clients(
        personalize, (module._global_params(), module.server_state),
        (adapt, module.client_states.gather(clients), module.records(clients)), clients.numel(), module.batching,
        None, seeds, label=f"{type(alg).__name__}.personalize",
    )


def _test_loss_and_accuracy(module: FederatedModule, model: nn.Module, i: int) -> tuple[float, float]:
    assert module.data is not None
    x, y = module.data.client_test(i)
    with torch.no_grad():
        logits = model_logits(model(x.to(module.device)))
        y = y.to(logits.device)
        accuracy = float((logits.argmax(-1) == y).double().mean())
        loss = float(module.ctx.per_sample_loss(logits, y).double().mean())
    return accuracy, loss


@dataclass
class _Run:
    """A finished ``Trainer.fit`` that wrote a checkpoint after round ``resume_at``."""

    module: FederatedModule
    checkpoint: Path
    rounds: int
    resume_at: int
    eval_every: int


def _fit_with_checkpoint(setup: _Setup, root: str, rounds: int, resume_at: int, eval_every: int) -> _Run:
    path = Path(root) / "mid.ckpt"
    module = setup.module()
    _trainer(rounds, root, callbacks=[_SaveAt(resume_at, path)]).fit(module, setup.datamodule(eval_every))
    return _Run(module, path, rounds, resume_at, eval_every)


def _check_personalize(setup: _Setup, rounds: int = 3, eval_every: int = 2, run: _Run | None = None) -> None:
    with _checking(setup, "check_personalize_matches_evaluation") as check, tempfile.TemporaryDirectory() as root:
        if run is None:
            module = setup.module()
            _trainer(rounds, root).fit(module, setup.datamodule(eval_every))
        else:
            module, rounds = run.module, run.rounds
        assert module.data is not None and module.seen is not None
        _check_personalize_scores(check, setup, module, rounds)
        never = (~module.seen).nonzero().flatten().tolist()
        if setup.holdout_clients and not never:
            check.fail("no client is left untrained (held-out clients must never train)")
        before = _check_personalize_is_pure(check, module, never)
        _check_untrained_ignore_state(check, module, never, before)


def _check_personalize_scores(check: _Check, setup: _Setup, module: FederatedModule, rounds: int) -> None:
    """``module.personalize(i)`` scores on client ``i``'s test data what the last evaluation logged for it."""
    assert module.data is not None and module.seen is not None
    logged = module.last_per_client
    module.train()  # as after Trainer.fit: personalize(i) must not depend on the module's mode
    for i in range(module.data.num_clients):
        group = "held-out" if bool(module.is_holdout[i]) else "training" if bool(module.seen[i]) else "unsampled"
        accuracy, loss = _test_loss_and_accuracy(module, module.personalize(i), i)
        if abs(accuracy - float(logged["acc"][i])) > 1e-6 or not math.isclose(
            loss, float(logged["loss"][i]), rel_tol=max(setup.rtol, 1e-5), abs_tol=max(setup.atol, 1e-5)
        ):
            check.fail(
                f"{group} client {i}: the evaluation after round {rounds} logged accuracy "
                f"{float(logged['accuracy'][i]):.6f} and loss {float(logged['loss'][i]):.6f}, but "
                f"module.personalize({i}) scores {accuracy:.6f} and {loss:.6f} on its test data: personalize "
                "must give the model the evaluation scores (no hidden state, nothing that depends on how it is "
                "called)"
            )


def _check_personalize_is_pure(
    check: _Check, module: FederatedModule, never: list[int]
) -> dict[int, dict[str, Tensor]]:
    """Each never-trained client's personalised model, the same when asked twice; returns their state dicts."""
    before = {i: {k: v.detach().clone() for k, v in module.personalize(i).state_dict().items()} for i in never}
    for i in never:  # a pure personalize gives the same model twice; only then can a change be blamed on state
        again = module.personalize(i).state_dict()
        for name, value in before[i].items():
            if not torch.equal(again[name], value):
                check.fail(
                    f"module.personalize({i}) gave a different model ({name}) when called a second time: "
                    "personalize must be a pure function of its arguments (no hidden Python state)"
                )
    return before


def _check_untrained_ignore_state(
    check: _Check, module: FederatedModule, never: list[int], before: dict[int, dict[str, Tensor]]
) -> None:
    """A never-trained client's personalised model does not change when its stored state is perturbed."""
    saved = _clone(module.client_states.tensors)
    g = torch.Generator().manual_seed(0)
    try:
        for v in flatten_state(module.client_states.tensors).values():  # the stored leaves, changed in place
            if v.is_floating_point() and never:
                rows = torch.tensor(never, device=v.device)
                noise = torch.randn(v[rows].shape, generator=g, dtype=v.dtype).to(v.device)
                v[rows] = v[rows] + 3.0 + noise
        for i in never:
            after = module.personalize(i).state_dict()
            for name, value in before[i].items():
                if not torch.equal(after[name], value):
                    group = "held-out" if bool(module.is_holdout[i]) else "unsampled"
                    check.fail(
                        f"{group} client {i} has never trained, yet its personalised model ({name}) changes with "
                        "its stored state: a client that never trained must start from the global (cluster, "
                        "mean) model, not read its initial state: pick with client.seen, e.g. "
                        "torch.where(client.seen, personal, global)"
                    )
    finally:
        module.client_states.tensors = saved


class _SaveAt(Callback):
    """Write a checkpoint right after round ``step`` (where ``ModelCheckpoint(every_n_train_steps)`` writes)."""

    def __init__(self, step: int, path: Path) -> None:
        self.step = step
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _check_resume(
    setup: _Setup, rounds: int = 3, resume_at: int = 2, eval_every: int = 2, run: _Run | None = None
) -> None:
    with _checking(setup, "check_resume_is_bit_exact") as check, tempfile.TemporaryDirectory() as root:
        if run is None:
            run = _fit_with_checkpoint(setup, root, rounds, resume_at, eval_every)
        straight, path, rounds, resume_at, eval_every = (run.module, run.checkpoint, run.rounds, run.resume_at,
                                                         run.eval_every)
        if not path.exists():
            check.fail(f"no checkpoint was written after round {resume_at}")
        resumed = setup.module()
        assert resumed.model is not None
        with torch.no_grad():  # other initial weights: the resumed run must take them from the checkpoint
            for p in resumed.model.parameters():
                p.add_(0.5)
        trainer = _trainer(rounds, root)
        trainer.fit(resumed, setup.datamodule(eval_every), ckpt_path=str(path))
        if trainer.global_step != rounds:
            check.fail(f"the resumed run stopped at round {trainer.global_step}, not {rounds}")
        names = ("uninterrupted", "resumed")
        assert straight.model is not None and resumed.model is not None
        _compare_trees(check, "model", straight.model.state_dict(), resumed.model.state_dict(), exact=True,
                       names=names)
        _compare_trees(check, "state", straight.client_states.tensors, resumed.client_states.tensors,
                       exact=True, names=names)
        _compare_trees(check, "server_state", straight.server_state, resumed.server_state, exact=True, names=names)
        _compare_trees(check, "seen", straight.seen, resumed.seen, exact=True, names=names)
        _compare_trees(check, f"per-client evaluation after round {rounds} ", straight.last_per_client,
                       resumed.last_per_client, exact=True, names=names)


def _check_bf16(setup: _Setup, rounds: int = 2) -> None:
    with _checking(setup, "check_bf16") as check, tempfile.TemporaryDirectory() as root:
        module = setup.module()
        trainer = _trainer(rounds, root, precision="bf16-mixed")
        trainer.fit(module, setup.datamodule(rounds))
        assert module.model is not None
        for name, p in module.model.named_parameters():
            if not bool(torch.isfinite(p).all()):
                check.fail(f"parameter {name} is not finite after {rounds} bf16-mixed rounds")
        for name, t in named_leaves(module.client_states.tensors, "state"):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                check.fail(f"client {name} is not finite after {rounds} bf16-mixed rounds")
        for name, t in named_leaves(module.server_state, "server_state"):
            if t.is_floating_point() and bool(torch.isnan(t).any()):
                check.fail(f"{name} holds NaN after {rounds} bf16-mixed rounds")
        for key in ("train/loss", "val/acc_weighted", "val/loss_weighted"):
            value = trainer.callback_metrics.get(key)
            if value is not None and not bool(torch.isfinite(value).all()):
                check.fail(f"{key} is {float(value)} after {rounds} bf16-mixed rounds")
        if "val/acc_weighted" not in trainer.callback_metrics:
            check.fail(f"no evaluation was logged after {rounds} bf16-mixed rounds")


# ----------------------------------------------------------------------------------------------
# public entry points
# ----------------------------------------------------------------------------------------------
def check_round(
    spec: AlgorithmSpec,
    *,
    model: nn.Module | Callable[[], nn.Module] | None = None,
    data: FederatedDataset | FederatedData | None = None,
    clients_per_round: int = 3,
    holdout_clients: int = 2,
    seed: int = 1,
    rounds: int = 2,
) -> None:
    """Real rounds with state write-back, every output checked (see the module docstring)."""
    _check_round(_setup(spec, model, data, clients_per_round, holdout_clients, seed, 0.0, 0.0), rounds)


def check_loop_equals_vmap(
    spec: AlgorithmSpec,
    *,
    model: nn.Module | Callable[[], nn.Module] | None = None,
    data: FederatedDataset | FederatedData | None = None,
    clients_per_round: int = 3,
    holdout_clients: int = 2,
    seed: int = 1,
    rounds: int = 2,
    atol: float = 1e-5,
    rtol: float = 1e-5,
) -> None:
    """Looped and ``vmap``-ed clients agree to ``atol``/``rtol`` on ``rounds`` rounds and the evaluation after
    them (integer and boolean tensors exactly). Does nothing for ``batchable = False`` algorithms or models
    that force the loop (dropout)."""
    _check_loop_equals_vmap(_setup(spec, model, data, clients_per_round, holdout_clients, seed, atol, rtol), rounds)


def check_personalize_matches_evaluation(
    spec: AlgorithmSpec,
    *,
    model: nn.Module | Callable[[], nn.Module] | None = None,
    data: FederatedDataset | FederatedData | None = None,
    clients_per_round: int = 3,
    holdout_clients: int = 2,
    seed: int = 1,
    rounds: int = 3,
    eval_every: int = 2,
) -> None:
    """After ``Trainer.fit`` for ``rounds`` rounds, every client's logged accuracy and loss are those of
    ``module.personalize(i)`` on its test data, and a never-trained client's model ignores its stored state."""
    _check_personalize(_setup(spec, model, data, clients_per_round, holdout_clients, seed, 1e-5, 1e-5), rounds,
                       eval_every)


def check_resume_is_bit_exact(
    spec: AlgorithmSpec,
    *,
    model: nn.Module | Callable[[], nn.Module] | None = None,
    data: FederatedDataset | FederatedData | None = None,
    clients_per_round: int = 3,
    holdout_clients: int = 2,
    seed: int = 1,
    rounds: int = 3,
    resume_at: int = 2,
    eval_every: int = 2,
) -> None:
    """A run resumed from the Lightning checkpoint written after round ``resume_at`` ends exactly like the
    uninterrupted run of ``rounds`` rounds (model, client and server state, ``seen``, per-client evaluation)."""
    _check_resume(_setup(spec, model, data, clients_per_round, holdout_clients, seed, 0.0, 0.0), rounds, resume_at,
                  eval_every)


def check_bf16(
    spec: AlgorithmSpec,
    *,
    model: nn.Module | Callable[[], nn.Module] | None = None,
    data: FederatedDataset | FederatedData | None = None,
    clients_per_round: int = 3,
    holdout_clients: int = 2,
    seed: int = 1,
    rounds: int = 2,
) -> None:
    """``rounds`` rounds and an evaluation under ``precision="bf16-mixed"`` on the CPU: everything finite."""
    _check_bf16(_setup(spec, model, data, clients_per_round, holdout_clients, seed, 0.0, 0.0), rounds)


def check_algorithm(
    spec: AlgorithmSpec,
    *,
    model: nn.Module | Callable[[], nn.Module] | None = None,
    data: FederatedDataset | FederatedData | None = None,
    clients_per_round: int = 3,
    holdout_clients: int = 2,
    seed: int = 1,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    skip: Sequence[str] = (),
) -> None:
    """Run every check of :data:`CHECKS` on an algorithm; raise ``AssertionError`` at the first failure.

    Args:
        spec: a registered name (``"pfedme"``), a mapping ``{"name": ..., <hyper-parameters>}``, an
            :class:`~lightning_fedmeta.Algorithm` instance (deep-copied for every run) or subclass.
        model: the network (deep-copied for every run), or a function building it. Default: the algorithm's
            :meth:`~lightning_fedmeta.Algorithm.example_model` if it declares one, else :func:`tiny_mlp`.
        data: a :class:`~lightning_fedmeta.FederatedDataset` or :class:`~lightning_fedmeta.FederatedData`.
            Default: :func:`tiny_clients` (8 clients of unequal sizes).
        clients_per_round: passed to :class:`~lightning_fedmeta.FederatedModule`.
        holdout_clients: passed to :class:`~lightning_fedmeta.FederatedModule`.
        seed: passed to :class:`~lightning_fedmeta.FederatedModule`.
        atol: absolute tolerance of :func:`check_loop_equals_vmap` (and of the logged loss in
            :func:`check_personalize_matches_evaluation`).
        rtol: relative tolerance of the same comparisons.
        skip: names of checks not to run (from :data:`CHECKS`).
    """
    unknown = sorted(set(skip) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown check(s) {unknown} in skip; choose from {list(CHECKS)}")
    setup = _setup(spec, model, data, clients_per_round, holdout_clients, seed, atol, rtol)
    if "check_round" not in skip:
        _check_round(setup)
    if "check_loop_equals_vmap" not in skip:
        _check_loop_equals_vmap(setup)
    trained = [name for name in CHECKS[2:4] if name not in skip]  # personalize and resume share one fit
    with tempfile.TemporaryDirectory() as root:
        run = None
        if trained:  # one fit (3 rounds, evaluations after rounds 2 and 3, a checkpoint after round 2) serves both
            with _checking(setup, trained[0]):
                run = _fit_with_checkpoint(setup, root, rounds=3, resume_at=2, eval_every=2)
        if "check_personalize_matches_evaluation" in trained:
            _check_personalize(setup, run=run)
        if "check_resume_is_bit_exact" in trained:
            _check_resume(setup, run=run)
    for name, check in (("check_bf16", _check_bf16), ("check_exchange", _check_exchange),
                        ("check_population_view", _check_population_view)):
        if name not in skip:
            check(setup)


# ----------------------------------------------------------------------------------------------
# check_exchange: download / upload declare what travels (docs/communication.md, docs/testing.md)
# ----------------------------------------------------------------------------------------------
def _corrupt(t: Tensor) -> Tensor:
    """A tensor no computation may read unnoticed: NaN for floating point, ``x + 1`` for integers, ``¬x`` for bool."""
    if t.is_floating_point() or t.is_complex():
        return torch.full_like(t, float("nan"))
    return ~t if t.dtype == torch.bool else t + 1


def _same_trees(a: Mapping[str, Any], b: Mapping[str, Any]) -> str | None:
    """``None`` when both (nested) dicts hold bit-equal tensors under the same keys, else the first difference."""
    left, right = flatten_state(a), flatten_state(b)
    if set(left) != set(right):
        return f"keys {sorted(set(left) ^ set(right))} differ"
    for k, v in left.items():
        if v.shape != right[k].shape or v.dtype != right[k].dtype or not torch.equal(v, right[k]):
            return f"{k!r} differs"
    return None


def _inputs_read(fn: Callable[[dict[str, Any]], Any], inputs: dict[str, Tensor]) -> set[str]:
    """The flat input keys whose corruption changes ``fn``'s result (or makes it raise)."""
    base = fn(inputs)
    read = set()
    for key in inputs:
        try:
            changed = _same_trees(base, fn({**inputs, key: _corrupt(inputs[key])})) is not None
        except Exception:  # noqa: BLE001 - a corrupted index that breaks the function is read by it
            changed = True
        if changed:
            read.add(key)
    return read


def _split_inputs(flat: dict[str, Tensor]) -> tuple[Params, dict[str, Any]]:
    """``{"params/<name>", "server/<key>"}`` back to ``(params, server_state)``."""
    params = {k[len("params/"):]: v for k, v in flat.items() if k.startswith("params/")}
    server = unflatten_state({k[len("server/"):]: v for k, v in flat.items() if k.startswith("server/")})
    return params, server


def _check_download(check: _Check, module: FederatedModule, clients: Tensor, r: int) -> None:
    """client_update reads nothing of the global parameters and server state that download does not depend on,
    and the download's size does not depend on the client."""
    alg, engine = module.algorithm, module.engine
    flat = {**{f"params/{k}": v for k, v in engine.global_params().items()},
            **{f"server/{k}": v for k, v in flatten_state(engine.server_state).items()}}
    records = engine.records(clients)
    one = ClientRecord(*(t[0] for t in records))
    declared = _inputs_read(lambda x: alg.download(*_split_inputs(x), one), flat)
    sizes = {payload_bytes(alg.download(*_split_inputs(flat), ClientRecord(*(t[i] for t in records))))
             for i in range(clients.numel())}
    if len(sizes) > 1:
        check.fail(f"download's size depends on the client ({sorted(sizes)} bytes); the engine counts one size for "
                   "every client: send the same tensors to each")
    batches = engine.gatherer.batches("train", r, clients[:1], alg.round_plan())
    batch = Batch(batches.x[0], batches.y[0], batches.mask[0])
    state = map_state(lambda v: v[0], engine.client_states.gather(clients[:1]))

    def run(x: dict[str, Tensor]) -> ClientOutput:
        params, server_state = _split_inputs(x)
        return alg.client_update(engine.ctx, params, batch, state, server_state, one)

    undeclared = [k for k in flat if k not in declared]
    corrupted = {**flat, **{k: _corrupt(flat[k]) for k in undeclared}}
    if _same_trees(run(flat)._asdict(), run(corrupted)._asdict()) is not None:
        culprits = sorted(_inputs_read(lambda x: run(x)._asdict(), {**corrupted, **{k: flat[k] for k in undeclared}})
                          & set(undeclared))
        check.fail(f"client_update reads {culprits}, which download() does not send (it depends only on "
                   f"{sorted(declared)}): add them to download so the bytes are counted")


def _check_upload(check: _Check, module: FederatedModule, r: int) -> None:
    """upload returns tensors of the client's own output, and aggregate reads no output tensor it leaves out."""
    alg, engine = module.algorithm, module.engine
    result = engine.compute(r)
    assert result is not None, f"round {r}: no client answered"
    output = result.output._asdict()
    stacked = flatten_state(output)
    row = {k: v[0] for k, v in stacked.items()}
    sent = flatten_state(alg.upload(upload_of_client(result.output, 0)))
    for key, t in sent.items():
        if key not in row or _same_trees({"t": t}, {"t": row[key]}) is not None:
            check.fail(f"upload() returns {key!r}, which is not the client output's tensor at that path (paths "
                       f"are delta/..., state/..., extras/..., metrics/...; found {sorted(row)})")
    params, server_state, records = engine.global_params(), engine.server_state, engine.records(result.clients)

    def aggregate(flat: dict[str, Tensor]) -> dict[str, Any]:
        out = ClientOutput(**{f: unflatten_state({k[len(f) + 1:]: v for k, v in flat.items()
                                                  if k.startswith(f + "/")}) for f in ClientOutput._fields})
        delta, new_state = alg.aggregate(params, out, result.weights, server_state, records)
        return {"delta": delta, "server_state": new_state}

    left_out = [k for k in stacked if k not in sent]
    corrupted = {**stacked, **{k: _corrupt(stacked[k]) for k in left_out}}
    if _same_trees(aggregate(stacked), aggregate(corrupted)) is not None:
        culprits = sorted(_inputs_read(aggregate, stacked) & set(left_out))
        check.fail(f"aggregate reads {culprits} of the clients' outputs, which upload() does not send: add them "
                   "to upload so the bytes are counted")


def _check_exchange(setup: _Setup) -> None:
    """What :meth:`~lightning_fedmeta.Algorithm.download` and :meth:`~lightning_fedmeta.Algorithm.upload`
    declare is what client_update and aggregate read (after one round, so server and client state are not
    fresh)."""
    with _checking(setup, "check_exchange") as check:
        module = setup.module()
        module.attach_data(setup.data)
        _plain_round(module, 0)
        _check_download(check, module, module.engine.federation.round_clients(1), 1)
        _check_upload(check, module, 1)
        _check_frozen_kept(check, module, module.engine.federation.round_clients(1), 1)


def _frozen_paths(tree: Mapping[str, Any], frozen: set[str]) -> list[str]:
    """The paths of ``tree`` (flattened, ``a/b/...``) one of whose parts is a frozen parameter's name."""
    return sorted(k for k in flatten_state(dict(tree)) if frozen & set(k.split("/")))


def _check_frozen_kept(check: _Check, module: FederatedModule, clients: Tensor, r: int) -> None:
    """Frozen parameters (``requires_grad=False``) never travel and are never stored: no tensor named after one is in
    ``download``, in a client's ``upload``, in the client state or in the server state (the engine's trees hold the
    trainable parameters only, :mod:`lightning_fedmeta.client.trainable`)."""
    engine = module.engine
    assert engine.trainable is not None
    frozen = set(engine.trainable.frozen)
    if not frozen:
        return
    record = ClientRecord(*(t[0] for t in engine.records(clients[:1])))
    result = engine.compute(r)
    assert result is not None, f"round {r}: no client answered"
    places = {
        "download": engine.algorithm.download(engine.global_params(), engine.server_state, record),
        "upload": engine.algorithm.upload(upload_of_client(result.output, 0)),
        "the client state": engine.client_states.tensors,
        "the server state": engine.server_state,
    }
    for where, tree in places.items():
        found = _frozen_paths(tree, frozen)
        if found:
            check.fail(f"{where} holds frozen parameters {found[:3]} (requires_grad=False): frozen parameters are "
                       "never sent or stored; build trees from the parameters the engine gives (global_params)")


def _check_population_view(setup: _Setup) -> None:
    """A client's own computations read only its own row of the population: an algorithm bound to the client's view
    (:func:`~lightning_fedmeta.flower.client.population_view`, all a Flower node is told: ``K``, the largest size,
    its own record and label histogram) gives the client's initial state, ``client_update`` (after a round)
    and ``personalize`` bit for bit as the algorithm bound to the whole population does, for a training client and
    a held-out one."""
    with _checking(setup, "check_population_view") as check:
        module = setup.module()
        module.attach_data(setup.data)
        _plain_round(module, 0)
        federation = module.engine.federation
        for c in [int(federation.round_clients(0)[0]), *federation.holdout.tolist()[:1]]:
            for what, (a, b) in _with_population_view(setup, module, c).items():
                diff = _same_trees({"x": a}, {"x": b})
                if diff is not None:
                    check.fail(f"client {c}'s {what} differs when bind_clients gets only the client's view of the "
                               f"population ({diff}): a client's computations must read only its own row (a Flower "
                               "node is not told the other clients' weights, held-out flags or label histograms)")


def _with_population_view(setup: _Setup, module: FederatedModule, c: int) -> dict[str, tuple[Any, Any]]:
    """Client ``c``'s initial state, round-1 ``client_update`` and ``personalize``, by the module's algorithm (bound to
    the whole population) and by a fresh one bound to ``c``'s view."""
    from lightning_fedmeta.flower.client import population_view

    engine, full = module.engine, module.algorithm
    assert engine.data is not None
    k = engine.data.num_clients
    at_bind = engine.records(torch.arange(k), device=torch.device("cpu"))._replace(
        seen=torch.zeros(k, dtype=torch.bool))  # attach_data binds before any round
    view, labels = population_view(ClientRecord(*(t[c] for t in at_bind)), k, int(at_bind.num_samples.max()),
                                   engine.data.label_counts[c].cpu())
    mine = setup.make_algorithm()
    mine.bind_clients(view, labels)
    params, server_state = engine.global_params(), engine.server_state
    batch, state, now, buffers = engine.personal_inputs(c, 1)
    ctx = engine.ctx.for_client(buffers) if buffers else engine.ctx
    train = engine.gatherer.batches("train", 1, torch.tensor([c]), full.round_plan())
    train = Batch(train.x[0], train.y[0], train.mask[0])
    pairs = {}
    pairs["init_client_states"] = tuple(map_state(lambda v: v[c], a.init_client_states(params, population))
                                        for a, population in ((full, at_bind), (mine, view)))
    pairs["client_update"] = tuple(a.client_update(ctx, params, train, state, server_state, now)._asdict()
                                   for a in (full, mine))
    pairs["personalize"] = tuple(a.personalize(ctx, params, batch, state, server_state, now) for a in (full, mine))
    return pairs


# ----------------------------------------------------------------------------------------------
# the other extension points: robust rules, datasets, partitioners (docs/plugins.md)
# ----------------------------------------------------------------------------------------------
def _plugin_failure(kind: str, name: str, check: str, problem: str) -> AssertionError:
    return AssertionError(f"{kind} {name!r} failed {check}: {problem}")


def _short_fit(data_module: FederatedDataModule, rounds: int = 2, **module_options: Any) -> FederatedModule:
    """A few rounds of FedAvg on ``data_module``; the model's parameters must stay finite."""
    torch.manual_seed(0)
    module = FederatedModule(**module_options)
    with tempfile.TemporaryDirectory() as root, _quiet():
        trainer = _trainer(rounds, root)
        trainer.fit(module, data_module)
    if trainer.global_step != rounds:
        raise AssertionError(f"the fit ran {trainer.global_step} rounds of {rounds}")
    bad = [k for k, v in module.model.state_dict().items() if v.is_floating_point() and not bool(v.isfinite().all())]
    if bad:
        raise AssertionError(f"after {rounds} rounds the model has non-finite {', '.join(bad)}")
    return module


def check_aggregator(spec: str | Mapping[str, Any], *, n: int = 9, d: int = 6, f: int = 1, seed: int = 0,
                     atol: float = 1e-6, fit: bool = True) -> None:
    """Check a robust aggregation rule (``lightning_fedmeta.aggregators``) keeps the contract the server relies on;
    raise ``AssertionError`` naming the rule, the check and what broke.

    ``spec`` is what a user writes as ``model.aggregator`` (a name, or ``{"name": ..., <options>}``). On ``n``
    random rows ``[n, d]`` (float32 and float64) with weights summing to 1 and ``f`` assumed Byzantine updates:

    * ``parse``: the name resolves and the options are accepted
    (:func:`~lightning_fedmeta.reliability.robust.parse_aggregator`);
    * ``shape``: ``rule(rows, weights, f=, steps=)`` returns a finite ``[d]`` tensor of the rows' dtype and leaves
      its inputs unchanged;
    * ``determinism``: a second call returns the same tensor, bit for bit;
    * ``permutation``: clients are exchangeable: permuting the rows (with their weights and steps) changes the
      result by at most ``atol`` (skipped for a rule that declares ``exchangeable = False``);
    * ``consensus``: when every client sends the same row ``v``, the result is ``v``;
    * ``absent``: a client of weight 0 (one that did not answer), even a huge outlier, does not change the result;
    * ``fit``: with ``fit=True``, three rounds of FedAvg with ``model.aggregator`` set to ``spec`` on 8 synthetic
      clients, by name, keep the model finite.
    """
    from lightning_fedmeta.reliability.robust import aggregate_rows, parse_aggregator

    label = spec if isinstance(spec, str) else dict(spec).get("name", "mean")
    try:
        parsed = parse_aggregator(spec)
    except (ValueError, ImportError, TypeError) as exc:
        raise _plugin_failure("aggregator", label, "parse", f"{type(exc).__name__}: {exc}") from exc
    g = torch.Generator().manual_seed(seed)
    steps = torch.randint(1, 6, (n,), generator=g)

    def run(rows: Tensor, weights: Tensor, st: Tensor = steps) -> Tensor:
        return aggregate_rows(parsed, rows, weights, f=f, steps=st)

    for dtype in (torch.float32, torch.float64):
        rows = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype)
        weights = torch.rand(n, generator=g, dtype=torch.float64).add(0.5).to(dtype)
        weights = weights / weights.sum()
        before = rows.clone(), weights.clone()
        try:
            out = run(rows, weights)
        except Exception as exc:
            raise _plugin_failure("aggregator", label, "shape", f"the rule raised {type(exc).__name__}: {exc} "
                                  f"on n={n} rows of dimension {d} (f={f})") from exc
        if not isinstance(out, Tensor) or tuple(out.shape) != (d,) or out.dtype != dtype:
            got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, Tensor) else type(out).__name__
            raise _plugin_failure("aggregator", label, "shape", f"expected a [{d}] {dtype} tensor, got {got}")
        if not bool(out.isfinite().all()):
            raise _plugin_failure("aggregator", label, "shape", "the result is not finite on finite rows")
        if not (torch.equal(rows, before[0]) and torch.equal(weights, before[1])):
            raise _plugin_failure("aggregator", label, "shape", "the rule changed its input rows or weights")
        if not torch.equal(run(rows, weights), out):
            raise _plugin_failure("aggregator", label, "determinism", "two calls on the same rows differ")
        perm = torch.randperm(n, generator=g)
        moved = run(rows[perm], weights[perm], steps[perm])
        exchangeable = getattr(parsed.rule_class, "exchangeable", True)
        if exchangeable and not torch.allclose(moved, out, atol=atol, rtol=0):
            raise _plugin_failure("aggregator", label, "permutation", "permuting the clients moved the result by "
                                  f"{float((moved - out).abs().max()):.3g} (> atol={atol})")
        same = rows[:1].expand(n, d).clone()
        agreed = run(same, weights, torch.full((n,), 3))
        if not torch.allclose(agreed, same[0], atol=atol, rtol=1e-5):
            raise _plugin_failure("aggregator", label, "consensus", "every client sent the same row v but the result "
                                  f"is {float((agreed - same[0]).abs().max()):.3g} away from v")
        outlier = torch.cat([rows, torch.full((1, d), 1e6, dtype=dtype)])
        zero = torch.cat([weights, torch.zeros(1, dtype=dtype)])
        with_absent = run(outlier, zero, torch.cat([steps, torch.tensor([1])]))
        if not torch.allclose(with_absent, out, atol=atol, rtol=1e-5):
            raise _plugin_failure("aggregator", label, "absent", "a client of weight 0 (an outlier at 1e6) moved "
                                  f"the result by {float((with_absent - out).abs().max()):.3g}")
    if fit:
        given = parsed.given()
        if parsed.needs_f and parsed.f is None:
            given["f"] = 1
        try:
            dm = FederatedDataModule(dataset="synthetic", num_clients=8, eval_every=3, data_seed=seed)
            _short_fit(dm, rounds=3, aggregator=given, clients_per_round=8, seed=seed,
                       algorithm={"name": "fedavg", "local_steps": 2, "batch_size": 8})
        except Exception as exc:
            raise _plugin_failure("aggregator", label, "fit", f"{type(exc).__name__}: {exc}") from exc


def _same_data(a: FederatedData, b: FederatedData) -> bool:
    return all(torch.equal(getattr(a, k), getattr(b, k)) for k in
               ("train_x", "train_y", "train_offsets", "test_x", "test_y", "test_offsets"))


def check_dataset(name: str, options: Mapping[str, Any] | None = None, *, num_clients: int = 4, seed: int = 0,
                  fit: bool = True, **data_options: Any) -> None:
    """Check a dataset registered as ``name`` (``lightning_fedmeta.datasets``) keeps the contract; raise
    ``AssertionError`` naming the dataset, the check and what broke.

    The dataset is built as ``data.dataset: name`` with ``data.dataset_options: options`` (and further
    :class:`~lightning_fedmeta.data.FederatedDataModule` settings in ``data_options``):

    * ``build``: the name resolves, the options are accepted, the call returns a ``FederatedData``, a
      ``FederatedDataset`` or a ``LabeledPool``;
    * ``shape``: ``num_clients`` clients, none empty; inputs and targets have as many rows as the offsets say,
      the inputs are finite and float; class labels are in ``[0, num_classes)``; a declared ``num_classes``
      attribute is the built data's;
    * ``determinism``: built again with the same seed it is bit for bit the same; with another seed it differs;
    * ``fit``: with ``fit=True``, two rounds of FedAvg on it, by name, keep the model finite.
    """
    from lightning_fedmeta.data.plugins import dataset_num_classes

    def build(data_seed: int) -> FederatedDataModule:
        dm = FederatedDataModule(dataset=name, dataset_options=dict(options or {}), num_clients=num_clients,
                                 data_seed=data_seed, eval_every=2, **data_options)
        with _quiet():
            dm.setup("fit")
        return dm

    try:
        dm = build(seed)
    except Exception as exc:
        raise _plugin_failure("dataset", name, "build", f"{type(exc).__name__}: {exc}") from exc
    data = dm.federated_data
    assert data is not None
    problems = []
    if data.num_clients != num_clients:
        problems.append(f"{data.num_clients} clients for num_clients={num_clients}")
    for split in ("train", "test"):
        x, y, offsets = (getattr(data, f"{split}_{k}") for k in ("x", "y", "offsets"))
        if int(offsets[-1]) != x.shape[0] or y.shape[0] != x.shape[0]:
            problems.append(f"{split}: {x.shape[0]} inputs, {y.shape[0]} targets, offsets end at {int(offsets[-1])}")
        if not x.is_floating_point() or not bool(x.isfinite().all()):
            problems.append(f"{split} inputs are not finite floats ({x.dtype})")
        if data.task == "classification" and y.numel() and (int(y.min()) < 0 or int(y.max()) >= data.num_classes):
            problems.append(f"{split} labels outside [0, {data.num_classes})")
    if int(data.train_counts.min()) < 1:
        problems.append("a client has no training rows")
    known, declared = dataset_num_classes(name)
    if known and declared != data.num_classes:
        problems.append(f"declares num_classes={declared} but builds {data.num_classes}")
    if problems:
        raise _plugin_failure("dataset", name, "shape", "; ".join(problems))
    again = build(seed).federated_data
    assert again is not None
    if not _same_data(data, again):
        raise _plugin_failure("dataset", name, "determinism", f"two builds with data_seed={seed} differ")
    other = build(seed + 1).federated_data
    assert other is not None
    if data.train_x.shape == other.train_x.shape and _same_data(data, other):
        raise _plugin_failure("dataset", name, "determinism", f"data_seed={seed} and {seed + 1} build the same "
                              "data: the dataset ignores its seed")
    if fit:
        try:
            _short_fit(build(seed), rounds=2, clients_per_round=min(3, num_clients), seed=seed,
                       algorithm={"name": "fedavg", "local_steps": 2, "batch_size": 8})
        except Exception as exc:
            raise _plugin_failure("dataset", name, "fit", f"{type(exc).__name__}: {exc}") from exc


def _labels(n: int, num_classes: int, seed: int) -> Tensor:
    """``n`` int64 labels, every class present, classes of unequal sizes."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, num_classes + 1, dtype=torch.float64)
    y = torch.multinomial(weights, n, replacement=True, generator=g)
    y[:num_classes] = torch.arange(num_classes)
    return y


def check_partitioner(name: str, options: Mapping[str, Any] | None = None, *, num_clients: int = 5,
                      num_classes: int = 4, n: int = 240, seed: int = 0, fit: bool = True,
                      **data_options: Any) -> None:
    """Check a partitioner registered as ``name`` (``lightning_fedmeta.partitioners``) keeps the contract; raise
    ``AssertionError`` naming the partitioner, the check and what broke.

    On ``n`` labels of ``num_classes`` unequal classes, called as ``data.partition: name`` with
    ``data.partition_options: options`` (and the data module's split settings in ``data_options``):

    * ``parts``: exactly ``num_clients`` parts of int64 indices in ``[0, n)``, no row given twice, no client empty;
    * ``determinism``: the same seed (and a fresh ``rng`` seeded alike) gives the same parts; ``labels`` is left
      unchanged;
    * ``fit``: with ``fit=True``, two rounds of FedAvg on a :class:`~lightning_fedmeta.data.plugins.LabeledPool`
      split by name keep the model finite.

    No permutation property is checked: the contract does not promise one (seeded draws follow the order of the
    rows and of the classes, as the built-in Dirichlet split's proportions do).
    """
    import numpy as np

    from lightning_fedmeta.data.plugins import LabeledPool, partition_labels

    defaults = _signature_defaults(FederatedDataModule)
    context = {
        "num_clients": num_clients, "seed": seed, "num_classes": num_classes,
        **{k: data_options.get(k, defaults.get(k)) for k in (
            "dirichlet_alpha", "classes_per_client", "samples_per_class", "max_samples_per_client", "balance",
            "min_client_samples", "max_retries", "partitioner")},
    }

    def parts_of(y: Tensor) -> list[Tensor]:
        return partition_labels(name, y, {**context, "rng": np.random.RandomState(seed)}, dict(options or {}))

    y = _labels(n, num_classes, seed)
    kept = y.clone()
    try:
        parts = parts_of(y)
    except Exception as exc:
        raise _plugin_failure("partitioner", name, "parts", f"{type(exc).__name__}: {exc}") from exc
    empty = [i for i, p in enumerate(parts) if p.numel() == 0]
    if empty:
        raise _plugin_failure("partitioner", name, "parts", f"client(s) {empty} get no rows of {n}")
    if not torch.equal(y, kept):
        raise _plugin_failure("partitioner", name, "determinism", "the partitioner changed the labels it was given")
    again = parts_of(y)
    if any(not torch.equal(a, b) for a, b in zip(parts, again, strict=True)):
        raise _plugin_failure("partitioner", name, "determinism", f"two calls with seed={seed} differ")
    if fit:
        g = torch.Generator().manual_seed(seed)
        centers = torch.randn(num_classes, 5, generator=g) * 2
        test_y = _labels(n // 2, num_classes, seed + 7)
        pool = LabeledPool(centers[y] + torch.randn(n, 5, generator=g), y,
                           centers[test_y] + torch.randn(test_y.numel(), 5, generator=g), test_y, num_classes)
        try:
            dm = FederatedDataModule(dataset=pool, partition=name, partition_options=dict(options or {}),
                                     num_clients=num_clients, data_seed=seed, eval_every=2, **data_options)
            _short_fit(dm, rounds=2, clients_per_round=min(3, num_clients), seed=seed,
                       algorithm={"name": "fedavg", "local_steps": 2, "batch_size": 8})
        except Exception as exc:
            raise _plugin_failure("partitioner", name, "fit", f"{type(exc).__name__}: {exc}") from exc


def _signature_defaults(cls: type) -> dict[str, Any]:
    """The default value of every parameter of ``cls.__init__`` that has one."""
    import inspect

    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()
            if p.default is not inspect.Parameter.empty}
