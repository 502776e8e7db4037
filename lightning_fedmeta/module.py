"""FederatedModule: the federated loop as a LightningModule (one training step = one round).

Round r (docs/design.md):
    S    = sample_clients(seed, r)                       pure function of (seed, r); under client_dropout /
                                                         over_selection the clients that answer (participation.py)
    out  = algorithm.client_update(w, batches[S], state[S], record[S])   functional; looped or vmap-ed
    Δ    = algorithm.aggregate(out, p_S, record[S])      p_i ∝ n_i ("samples") or 1/N ("uniform"), renormalised
                                                         over S; or a robust / private rule (reliability.py)
    w   <- server optimizer step with pseudo-gradient −Δ  (SGD(lr=β): w + βΔ; Adam/Yogi: FedOpt)
    seen[S] <- True

Every client is known by an explicit :class:`~lightning_fedmeta.algorithms.base.ClientRecord`
(index, weight p_i over the training clients, held out or not, trained before or not, size),
gathered like client state and passed to ``client_update``, ``aggregate`` and ``personalize``.

Under a multi-process strategy (``ddp``), rank k computes the sampled clients at positions
≡ k (mod world size); the per-client outputs are combined by an all-reduce of zero-filled
tensors (each entry is written by exactly one rank), so every rank aggregates exactly the tensors
the single-process run aggregates.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from lightning_fedmeta.algorithms.base import Algorithm, ClientOutput, ClientRecord, weighted_mean_metrics
from lightning_fedmeta.attacks import flip_labels
from lightning_fedmeta.checkpointing import (
    VERIFIED_MARK,
    check_resume_settings,
    fedmeta_run_record,
    install_atomic_checkpoint_io,
    load_module_checkpoint,
    loading_path,
    seal_checkpoint,
    verify_checkpoint,
)
from lightning_fedmeta.compiled import PrimitiveCompiler, describe_decision, worth_compiling
from lightning_fedmeta.data.federated import FederatedData, _as_inputs, _as_targets
from lightning_fedmeta.disk_state import DiskClientStateStore, is_disk_manifest
from lightning_fedmeta.execution import ClientBatching, choose_batching, run_clients
from lightning_fedmeta.functional import Batch, ClientContext, Params, weighted_sum
from lightning_fedmeta.losses import DEFAULT_LOSS, LOSSES, PerSampleLoss, loss_name, resolve_loss
from lightning_fedmeta.metrics import BUILTIN_METRICS, DEFAULT_METRICS, ClientMetrics, MetricSpec
from lightning_fedmeta.models import default_model
from lightning_fedmeta.participation import answering_clients, mask_missing_steps, num_candidates
from lightning_fedmeta.registry import create_algorithm
from lightning_fedmeta.reliability import Reliability
from lightning_fedmeta.running_stats import client_buffers, prepare_model
from lightning_fedmeta.sampling import (
    choose_holdout,
    draw_batch_indices,
    generator_for,
    sample_clients,
    stable_seed,
)
from lightning_fedmeta.state import ClientStateStore, flatten_state, map_state, unflatten_state
from lightning_fedmeta.validation import (
    validate_aggregate_output,
    validate_client_output,
    validate_init_client_states,
    validate_init_server_state,
)

__all__ = ["FederatedModule", "FederatedSetupError", "format_summary"]


class FederatedSetupError(ValueError):
    """The module's options do not fit the data it is set up with (found in ``setup``, before round 1): e.g.
    more clients per round than training clients, a ``local_steps_dist`` list of the wrong length, a robust
    aggregator the round's size cannot support. The ``fedmeta`` command prints the message alone (status 2)."""


def _build_algorithm(spec: str | dict[str, Any] | Algorithm) -> Algorithm:
    if isinstance(spec, Algorithm):
        return spec
    if isinstance(spec, str):
        return create_algorithm(spec)
    if isinstance(spec, dict):
        args = dict(spec)
        name = args.pop("name", None)
        if not isinstance(name, str):
            raise ValueError(f"an algorithm given as a mapping needs a 'name' key, got keys {sorted(spec)}")
        return create_algorithm(name, **args)
    raise TypeError(f"algorithm must be a name, a mapping with 'name', or an Algorithm; got {type(spec).__name__}")


def _default_model_for(spec: dict[str, Any]) -> nn.Module:
    """The default model of a data spec (``input_shape``, ``num_classes``, ``task``, ``target_shape``)."""
    task = spec.get("task") or "classification"
    num_classes = spec.get("num_classes")
    if task == "classification":
        return default_model(tuple(spec["input_shape"]), int(num_classes))  # type: ignore[arg-type]
    return default_model(
        tuple(spec["input_shape"]), num_classes, task=task, target_shape=tuple(spec.get("target_shape") or ()),
    )


def _import_callable(path: str) -> Callable[..., Any]:
    """The object at import path ``package.module.name`` (for ``loss`` given as a dotted string)."""
    import importlib

    module_name, _, attr = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"loss {path!r} is neither a built-in loss ({sorted(LOSSES)}) nor an importable "
                         f"callable: {exc}") from exc
    if not callable(obj):
        raise ValueError(f"loss {path!r} is not callable")
    return obj


#: the padded test sets of one evaluation are kept for the next one up to this size (bytes)
TEST_CACHE_BYTES = 512 * 2**20


def _rows(t: Tensor, index: Tensor, out: Tensor | None = None) -> Tensor:
    """``t[index]`` for an integer ``index`` of any shape, by ``index_select`` on the flattened index: the same
    values as advanced indexing, copied row by row (2–3× faster for image rows than ``aten::index``), into
    ``out`` (``[index.numel(), *t.shape[1:]]``) when given."""
    flat_index = index.reshape(-1).to(t.device)
    flat = t.index_select(0, flat_index) if out is None else torch.index_select(t, 0, flat_index, out=out)
    return flat.view(*index.shape, *t.shape[1:])


def _sums_finite(sums: list[Tensor]) -> bool:
    """Whether all these sums are finite, in one host sync: a NaN or an infinity anywhere in a tensor makes its
    sum non-finite, so a finite sum proves the tensor finite (one pass over the data instead of isfinite's
    several). A non-finite sum may also be an overflow of finite values: callers then check element-wise."""
    return bool(torch.isfinite(torch.cat([t.reshape(-1).float() for t in sums])).all())


def format_summary(summary: dict[str, dict[str, Tensor]], round_idx: int) -> str:
    """A small text table of every personalised metric (weighted mean, mean, worst decile) per client group."""
    groups = [g for g in summary if not g.startswith("_")]
    keys = [k[: -len("_weighted")] for k in summary[groups[0]] if k.endswith("_weighted")] if groups else []
    header = f"{'clients':<10}" + "".join(
        f" {k + ' (weighted)':>18} {k + ' (mean)':>14} {k + ' (worst 10%)':>18}" for k in keys
    )
    lines = [f"Personalized evaluation after round {round_idx}", header]
    for group in groups:
        s = summary[group]
        lines.append(f"{group:<10}" + "".join(
            f" {float(s[k + '_weighted']):>18.4f} {float(s[k + '_mean']):>14.4f} {float(s[k + '_worst10']):>18.4f}"
            for k in keys
        ))
    return "\n".join(lines)


class FederatedModule(LightningModule):
    """Personalized federated learning with any registered algorithm.

    Args:
        model: the network: any ``nn.Module`` (a ``LightningModule`` too: its ``forward`` is used) mapping a
            batch of inputs to outputs the loss accepts. ``None`` builds
            :func:`~lightning_fedmeta.models.default_model` from the data's shapes and task.
        algorithm: a registered name (``"fedavg"``), a mapping ``{name: ..., <hyper-parameters>}``,
            or an :class:`~lightning_fedmeta.Algorithm` instance.
        clients_per_round: clients sampled each round (mutually exclusive with ``fraction``; 10 when
            neither is given).
        fraction: fraction of the training clients sampled each round (rounded up).
        aggregation: client weights ``p_i``: ``"samples"`` (∝ training samples) or ``"uniform"``.
        server_lr: β, the learning rate of the default server optimizer ``SGD(lr=β)``.
        server_optimizer: any ``torch.optim`` optimizer factory (e.g. Adam for FedAdam); overrides
            ``server_lr``. Algorithms that update their models outside the server optimizer (IFCA,
            CFL, MOCHA, the ``mtl_*`` family, Per-FedMAML: ``server_optimizer_applies = False``)
            refuse it, and any ``server_lr`` other than 1, at construction.
        server_lr_scheduler: optional scheduler factory for the server optimizer, stepped every round.
        client_batching: ``"auto"`` (batched unless the model forbids it), ``"vmap"`` or ``"loop"``.
        client_chunk_size: clients per ``vmap`` call (bounds memory, and keeps large rounds fast);
            ``None`` = all at once. Timings: benchmarks/results/speed.md.
        compile_clients: ``torch.compile`` the client context's primitives (``sgd_step``, ``loss_and_grad``,
            ``grad``, ``hvp``, ``loss``, ``predict``), each once, batched over the clients and reused for every
            local step (:mod:`lightning_fedmeta.compiled`; vmap path only). ``"auto"`` (default) compiles the
            training steps when the run is long enough to pay for it: after the second round of a fit, if the
            remaining rounds would spend at least :data:`~lightning_fedmeta.compiled.AUTO_COMPILE_SECONDS` of
            eager client computation (the decision is logged, kept in checkpoints and taken by rank 0 for all
            ranks); evaluation stays eager. ``True`` compiles training and evaluation from the first round;
            ``False`` never compiles. Compiled and eager steps agree to rounding. Timings:
            benchmarks/results/speed.md.
        holdout_clients: clients never sampled in training (count, or fraction in [0, 1)); they
            are evaluated separately as new clients.
        seed: seed of client sampling and mini-batch draws (independent of the data seed).
        loss: the per-sample loss every algorithm's local steps, adaptation and evaluation use: a name
            (:data:`~lightning_fedmeta.losses.LOSSES`: ``cross_entropy``, ``mse``, ``bce_with_logits``, ...),
            an import path of a function (``mypackage.losses.focal``), a ``torch.nn`` loss module (used with
            ``reduction="none"``) or a callable ``(outputs, targets) -> [B]``. ``None``: the model's
            ``federated_loss(outputs, targets)`` method if it has one, else the task's default
            (cross-entropy for classes and tokens, MSE for regression, BCE with logits for multi-label).
        metrics: the personalised metrics, ``{name: spec}``: a built-in name
            (:data:`~lightning_fedmeta.metrics.BUILTIN_METRICS`: ``accuracy``, ``mse``, ``mae``, ``rmse``,
            ``perplexity``) or any torchmetrics ``Metric``, kept per client. Each is logged as
            ``{stage}/{name}_weighted``, ``_mean`` and ``_worst10`` (worst by its direction), next to the
            loss. ``None``: ``{"acc": "accuracy"}`` for classes and tokens, ``{"mae": "mae"}`` for regression.
        client_dropout: ``p``: each sampled client fails with probability ``p`` (a pure function of seed, round
            and client); the round aggregates over the clients that answer, with renormalised weights; a failed
            client's state is untouched; a round nobody answers leaves the model unchanged (and is logged).
        over_selection: ``f``: sample ``⌈(1 + f)·m⌉`` clients and keep the first ``m`` that answer.
        local_steps_dist: per-client budgets of local steps (stragglers do fewer; their missing steps are masked,
            clients still run batched): a list with one budget per client, or ``{distribution: uniform, low, high}``
            or ``{distribution: choice, values, probs}`` drawn per round and client. Algorithms that declare
            ``step_budget`` only (fedavg, fedprox, reptile, scaffold, perfedavg).
        aggregator: the server's rule for uploads that are parameter deltas: ``mean`` (default: the algorithm's
            own aggregate), ``median``, ``trimmed_mean`` (``beta``), ``krum`` / ``multi_krum`` (``f``, ``m``),
            ``bulyan`` (``f``), ``geometric_median``, ``fednova``; ``clip`` bounds every update's norm first.
            A name or a mapping ``{name: trimmed_mean, beta: 0.2}``.
        byzantine: simulated Byzantine clients, ``{fraction: 0.2, attack: sign_flip}`` (attacks ``sign_flip``,
            ``scaled``, ``gaussian``, ``alie``, ``ipm`` replace the upload; ``label_flip`` poisons the data).
        dp: client-level differential privacy (DP-FedAvg), ``{clip: 1.0, noise_multiplier: 1.0, delta: 1e-5,
            target_epsilon: 8, adaptive_clip: true}``: every update clipped to norm ``C``, Gaussian noise
            ``σ·C`` on the sum, weights ``1/m``; ε (Opacus's RDP accountant) logged every round; training stops
            before ``target_epsilon`` would be exceeded. Needs ``aggregation="uniform"``.
        client_state: where the clients' state rows (personal models, control variates, ...) live: ``"memory"``
            (one ``[K, ...]`` tensor per entry), ``"disk"`` (memory-mapped files, only the round's rows in
            memory, checkpoints reference immutable checksummed segments:
            :class:`~lightning_fedmeta.disk_state.DiskClientStateStore`) or ``"auto"`` (default): disk when
            ``K × row bytes`` exceeds :data:`~lightning_fedmeta.disk_state.DISK_STATE_THRESHOLD_BYTES` (2 GiB);
            the choice is logged. Results are the same bit for bit. docs/scale.md.
        client_state_dir: the folder of the disk-backed state (each process uses ``rank-<r>`` in it; keep it
            with the checkpoints, which reference its segments). ``None``: ``<trainer.default_root_dir>/client_state``.

    The reliability options (the last six) and the combinations refused at setup: docs/reliability.md.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        algorithm: str | dict[str, Any] | Algorithm = "fedavg",
        clients_per_round: int | None = None,
        fraction: float | None = None,
        aggregation: Literal["samples", "uniform"] = "samples",
        server_lr: float = 1.0,
        server_optimizer: OptimizerCallable | None = None,
        server_lr_scheduler: LRSchedulerCallable | None = None,
        client_batching: ClientBatching = "auto",
        client_chunk_size: int | None = 100,
        compile_clients: bool | Literal["auto"] = "auto",
        holdout_clients: int | float = 0,
        seed: int = 0,
        loss: str | nn.Module | Callable[[Tensor, Tensor], Tensor] | None = None,
        metrics: Mapping[str, MetricSpec] | None = None,
        client_dropout: float = 0.0,
        over_selection: float = 0.0,
        local_steps_dist: list[int] | dict[str, Any] | None = None,
        aggregator: str | dict[str, Any] | None = None,
        byzantine: dict[str, Any] | None = None,
        dp: dict[str, Any] | None = None,
        client_state: Literal["auto", "memory", "disk"] = "auto",
        client_state_dir: str | None = None,
    ) -> None:
        super().__init__()
        #: the reliability options, parsed (each error names its model.* option; docs/reliability.md)
        self.reliability = Reliability.from_options(
            client_dropout, over_selection, local_steps_dist, aggregator, byzantine, dp
        )
        self.automatic_optimization = False
        if fraction is not None and clients_per_round is not None:
            raise ValueError(
                f"give clients_per_round or fraction, not both (got clients_per_round={clients_per_round!r}, "
                f"fraction={fraction!r})"
            )
        if fraction is not None:
            if not 0 < fraction <= 1:
                raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
        else:
            clients_per_round = 10 if clients_per_round is None else clients_per_round
            if isinstance(clients_per_round, bool) or not isinstance(clients_per_round, int) or clients_per_round < 1:
                raise ValueError(
                    f"clients_per_round must be an integer >= 1 (or set fraction), got {clients_per_round!r}"
                )
        if aggregation not in ("samples", "uniform"):
            raise ValueError(f"aggregation must be 'samples' or 'uniform', got {aggregation!r}")
        if not server_lr >= 0 or server_lr == math.inf:
            raise ValueError(f"server_lr must be a finite number >= 0, got {server_lr!r}")
        for label, factory in (("server_optimizer", server_optimizer), ("server_lr_scheduler", server_lr_scheduler)):
            if factory is not None and not callable(factory):
                raise ValueError(f"{label} must be a callable (a torch.optim factory), got {factory!r}")
        if client_batching not in ("auto", "vmap", "loop"):
            raise ValueError(f"client_batching must be 'auto', 'vmap' or 'loop', got {client_batching!r}")
        if client_chunk_size is not None and client_chunk_size < 1:
            raise ValueError(f"client_chunk_size must be >= 1, got {client_chunk_size!r}")
        if isinstance(loss, str) and loss not in LOSSES and "." not in loss:
            raise ValueError(
                f"unknown loss {loss!r}; choose one of {sorted(LOSSES)}, an import path (package.module.function), "
                "a torch.nn loss module or a callable"
            )
        if isinstance(loss, str) and loss not in LOSSES:
            loss = _import_callable(loss)
        if metrics is not None:
            if not isinstance(metrics, Mapping) or not metrics:
                raise ValueError(f"metrics must be a non-empty mapping {{name: metric}}, got {metrics!r}")
            ClientMetrics(metrics, 1)  # names, built-ins and torchmetrics states checked now, before any data
        self.algorithm = _build_algorithm(algorithm)
        if not type(self.algorithm).server_optimizer_applies and (
            server_optimizer is not None or server_lr != 1.0 or server_lr_scheduler is not None
        ):
            name = type(self.algorithm).name or type(self.algorithm).__name__
            raise ValueError(
                f"{name} updates its models outside the server optimizer (its server step is exact, e.g. a "
                "cluster or mean update), so a server_optimizer, a server_lr_scheduler or a server_lr other "
                f"than 1 would silently do nothing to them; remove them for {name} (got server_lr={server_lr!r}, "
                f"server_optimizer={'set' if server_optimizer is not None else None}, "
                f"server_lr_scheduler={'set' if server_lr_scheduler is not None else None})"
            )
        # Only plain values go into the checkpoint's hyper-parameters: an nn.Module or Algorithm instance
        # there makes the file unloadable with torch.load(weights_only=True), the default of
        # Trainer.fit(ckpt_path=...). A custom model is passed again to load_from_checkpoint(path, model=...);
        # model=None is rebuilt from the checkpoint's data spec.
        ignore = ["model", "server_optimizer", "server_lr_scheduler"]
        if isinstance(algorithm, Algorithm):
            ignore.append("algorithm")
        if loss is not None and not isinstance(loss, str):
            ignore.append("loss")
        if metrics is not None and not all(isinstance(v, str) for v in metrics.values()):
            ignore.append("metrics")
        self.save_hyperparameters(ignore=ignore)
        self.model = model
        self.clients_per_round = clients_per_round
        self.fraction = fraction
        self.aggregation = aggregation
        self.server_lr = server_lr
        self.server_optimizer = server_optimizer
        self.server_lr_scheduler = server_lr_scheduler
        self.client_batching = client_batching
        self.client_chunk_size = client_chunk_size
        if compile_clients not in (True, False, "auto"):
            raise ValueError(f"compile_clients must be true, false or 'auto', got {compile_clients!r}")
        self.compile_clients = compile_clients
        #: compiles the client primitives; switched on for training by ``True`` or by the "auto" decision
        self.compiler = PrimitiveCompiler(enabled=compile_clients is True)
        #: "auto": whether this run compiles its training steps (None until decided; checkpointed)
        self.compile_decision: bool | None = None if compile_clients == "auto" else bool(compile_clients)
        self._eager_rounds_timed = 0
        self._test_cache: dict[Any, Batch] | None = None  # padded test gathers per chunk (see _test_batches)
        self._gather_buffers: dict[Any, Tensor] = {}  # reused destinations of the mini-batch gathers (_batches)
        self.holdout_clients = holdout_clients
        self.seed = seed
        self.loss = loss
        self.metrics = dict(metrics) if metrics is not None else None
        self.per_sample_loss: PerSampleLoss | None = None
        self.metric_directions: dict[str, bool] = {}
        self.primary_metric = "loss"
        self._pending_metric_state: dict[str, Tensor] | None = None
        self.client_dropout = client_dropout
        self.over_selection = over_selection
        self.local_steps_dist = local_steps_dist
        self.aggregator = aggregator
        self.byzantine = byzantine
        self.dp = dp
        if self.reliability.dp is not None:  # the clipping norm C (adaptive clipping changes it): checkpointed
            self.register_buffer("dp_clip", torch.tensor(float(self.reliability.dp.clip), dtype=torch.float64))
        self._accountant: Any = None  # the PrivacyAccountant of model.dp (built on the first round)
        self.byzantine_clients = torch.zeros(0, dtype=torch.long)
        self._round_steps: Tensor | None = None

        if client_state not in ("auto", "memory", "disk"):
            raise ValueError(f"model.client_state must be 'auto', 'memory' or 'disk', got {client_state!r}")
        if client_state_dir is not None and not isinstance(client_state_dir, str | os.PathLike):
            raise ValueError(f"model.client_state_dir must be a folder path, got {client_state_dir!r}")
        self.client_state = client_state
        self.client_state_dir = None if client_state_dir is None else os.fspath(client_state_dir)
        self.client_states: ClientStateStore | DiskClientStateStore = ClientStateStore()
        self.client_buffers = ClientStateStore()  # per-client BatchNorm running statistics ([K, ...] per buffer)
        self.stat_names: list[str] = []
        self._round_buffers: tuple[Tensor, dict[str, Tensor], Tensor] | None = None
        self.server_state: dict[str, Any] = {}  # a (nested) dict of tensors
        self.seen: Tensor | None = None  # [K] bool: the client took part in a completed round (checkpointed)
        self.data: FederatedData | None = None
        self.last_summary: dict[str, dict[str, Tensor]] = {}
        self.last_summary_round = -1  # the round last_summary was measured after
        self._stopped_by_privacy_budget = False
        self.last_per_client: dict[str, Tensor] = {}
        self.last_evaluated: Tensor | None = None  # the clients the last evaluation scored (data.eval_clients)
        self._data_spec: dict[str, Any] | None = None
        self._validated: set[str] = set()  # algorithm functions whose outputs passed validation (first round)
        self._placed_on: torch.device | None = None
        self._loaded_round = 0  # the round of a loaded checkpoint (test/validate do not restore global_step)

    # ------------------------------------------------------------------------------------------
    # setup
    # ------------------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if self._trainer is not None:  # crash-safe checkpoint writes, unless the user chose a CheckpointIO
            install_atomic_checkpoint_io(self.trainer)
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        data = getattr(datamodule, "federated_data", None)
        if data is None:
            raise ValueError(
                "FederatedModule needs a datamodule with a 'federated_data' attribute "
                "(lightning_fedmeta.FederatedDataModule or one of your own)"
            )
        try:
            self.attach_data(data)
        except ValueError as exc:
            if type(exc) is not ValueError:  # a specific error (e.g. an algorithm's invalid output) keeps its type
                raise
            raise FederatedSetupError(str(exc)) from exc  # a setting that does not fit this data

    def attach_data(self, data: FederatedData) -> None:
        """Bind the federated data: build the model if needed, choose clients, initialise state."""
        self.data = data
        self._placed_on = None
        self._test_cache = None
        self._gather_buffers = {}
        self._data_spec = {
            "input_shape": list(data.input_shape), "num_classes": data.num_classes, "task": data.task,
            "target_shape": list(data.target_shape),
        }
        if self.model is None:
            self.model = _default_model_for(self._data_spec)
        self._bind_task(data)
        self._check_outputs(data)
        k = data.num_clients
        self.holdout = choose_holdout(self.seed, k, self.holdout_clients)
        is_holdout = torch.zeros(k, dtype=torch.bool)
        is_holdout[self.holdout] = True
        self.is_holdout = is_holdout
        self.eligible = (~is_holdout).nonzero().flatten()
        n_eligible = self.eligible.numel()
        if self.fraction is not None:
            self.num_sampled = max(1, math.ceil(self.fraction * n_eligible))
        else:
            self.num_sampled = int(self.clients_per_round)  # type: ignore[arg-type]
            if self.num_sampled > n_eligible:
                raise ValueError(
                    f"clients_per_round={self.num_sampled} exceeds the {n_eligible} training clients "
                    f"({k} clients, {k - n_eligible} held out)"
                )
        self.reliability.check(
            self.algorithm, num_clients=k, num_sampled=self.num_sampled, aggregation=self.aggregation,
            task=str(data.task),
        )
        self.num_candidates = num_candidates(self.num_sampled, self.reliability.over_selection, n_eligible)
        self.byzantine_clients = self.reliability.byzantine_clients(self.seed, self.eligible)
        self._keep_running_statistics_per_client(k)
        self.batching, reason = choose_batching(self.model, self.client_batching)
        if self.batching == "vmap" and not type(self.algorithm).batchable:
            if self.client_batching == "vmap":
                name = type(self.algorithm).__name__
                raise ValueError(f"client_batching='vmap' is impossible: {name} is not batchable")
            self.batching, reason = "loop", f"{type(self.algorithm).__name__} runs its clients looped (batchable=False)"
        params = self._global_params()
        counts = data.train_counts.cpu().to(torch.float64)
        share = counts if self.aggregation == "samples" else torch.ones_like(counts)
        share = share * (~is_holdout).to(torch.float64)
        self.client_weight = share / share.sum()  # p_i over the training clients, 0 when held out
        if self.seen is None or self.seen.numel() != k:
            self.seen = torch.zeros(k, dtype=torch.bool)
        everyone = self.records(torch.arange(k), device=torch.device("cpu"))
        self.algorithm.bind_clients(everyone, data.label_counts.cpu())
        if not self.client_states.tensors:
            self.client_states = self._init_client_states(params, everyone)
        if not self.server_state:
            server_state = self.algorithm.init_server_state(params)
            validate_init_server_state(self.algorithm, server_state)
            self.server_state = server_state
        self._validated = set()  # client_update and aggregate are validated on the first round with this data
        self.metric = ClientMetrics(self._metric_specs(data), k)
        self.metric_directions = dict(self.metric.directions)
        self.primary_metric = next(iter(self.metric_directions))
        if self._pending_metric_state is not None:  # a checkpoint loaded before the data was attached
            self._restore_metric_state(self._pending_metric_state)
            self._pending_metric_state = None
        self.ctx = self._make_context()
        self._test_width = int(data.test_counts.max())
        self._train_width = int(data.train_counts.max())
        rank_zero_info(
            f"[lightning_fedmeta] {self.algorithm!r}: {k} clients ({n_eligible} training, "
            f"{k - n_eligible} held out), {self.num_sampled} per round; clients: {reason}"
        )

    def _store_rank(self) -> int:
        return int(self.trainer.global_rank) if self._trainer is not None else 0

    def _store_root(self) -> str:
        """``model.client_state_dir``, else ``<trainer.default_root_dir>/client_state``, else a temporary folder."""
        if self.client_state_dir is not None:
            return self.client_state_dir
        if self._trainer is not None:
            return os.path.join(self.trainer.default_root_dir, "client_state")
        import tempfile

        return tempfile.mkdtemp(prefix="fedmeta_client_state_")

    def _init_client_states(self, params: Params, everyone: ClientRecord) -> ClientStateStore | DiskClientStateStore:
        """The clients' initial state, in memory or on disk (``client_state``; "auto": disk above
        :data:`~lightning_fedmeta.disk_state.DISK_STATE_THRESHOLD_BYTES` of ``K × row bytes``).

        On disk, an algorithm that keeps :meth:`Algorithm.init_client_states`'s default (every client starts from
        ``init_client_state(w0)``) is initialised lazily: the files start empty and a row never written reads as
        that template, exactly the values of the eager initialisation. One that overrides it is initialised in
        blocks of clients (``init_client_states(w0, records[block])``), never all ``K`` rows in memory at once."""
        from lightning_fedmeta import disk_state  # the threshold is read at call time (tests lower it)

        k = int(everyone.index.numel())
        per_client = type(self.algorithm).init_client_states is not Algorithm.init_client_states
        if self.client_state == "memory":
            states = self.algorithm.init_client_states(params, everyone)
            validate_init_client_states(self.algorithm, states, k)
            return ClientStateStore(states)
        one = ClientRecord(*(t[:1] for t in everyone))
        template = None if per_client else self.algorithm.init_client_state(params)
        try:  # the size of one row; a malformed state is reported below, by the validation of the path taken
            sample = self.algorithm.init_client_states(params, one) if per_client else map_state(
                lambda t: t.unsqueeze(0), template)
            row_bytes = sum(v.numel() * v.element_size() for v in flatten_state(sample).values())
        except (AttributeError, TypeError, ValueError):
            sample, row_bytes = None, 0
        total = k * row_bytes
        disk = self.client_state == "disk" or total > disk_state.DISK_STATE_THRESHOLD_BYTES
        if self.client_state == "disk" and row_bytes == 0:  # nothing to keep, but a bad folder is still an error
            disk_state.check_directory(self._store_root(), self._store_rank())
        if not disk or row_bytes == 0:
            states = self.algorithm.init_client_states(params, everyone)
            validate_init_client_states(self.algorithm, states, k)
            store: ClientStateStore | DiskClientStateStore = ClientStateStore(states)
        elif per_client:
            validate_init_client_states(self.algorithm, sample, 1)
            store = DiskClientStateStore.from_rows(
                self._store_root(), k,
                lambda c: self.algorithm.init_client_states(params, ClientRecord(*(t[c] for t in everyone))),
                rank=self._store_rank(), who=f"{type(self.algorithm).__name__}.init_client_states",
            )
        else:
            validate_init_client_states(self.algorithm, sample, 1)
            store = DiskClientStateStore.lazy(self._store_root(), k, template, rank=self._store_rank())
        rank_zero_info(
            f"[lightning_fedmeta] model.client_state={self.client_state}: {disk_state.describe(store)}; "
            f"{k} clients x {row_bytes} bytes per client (disk above "
            f"{disk_state.DISK_STATE_THRESHOLD_BYTES / 2**30:g} GiB)"
        )
        return store

    def _restore_client_states(self, entry: Mapping[str, Any]) -> None:
        """The client state of a checkpoint: a disk store's manifest (rebuilt from its segments) or flat tensors;
        converted when ``client_state`` asks for the other kind."""
        old = self.client_states
        if is_disk_manifest(entry):
            store: ClientStateStore | DiskClientStateStore = DiskClientStateStore.restore(
                entry, self.client_state_dir, rank=self._store_rank()
            )
            if self.client_state == "memory":
                memory = ClientStateStore(unflatten_state(store.state_dict()))
                store.close()
                store = memory
        elif self.client_state == "disk" and entry:
            store = DiskClientStateStore.from_tensors(self._store_root(), unflatten_state(dict(entry)),
                                                      rank=self._store_rank())
        else:
            store = ClientStateStore()
            store.load_state_dict(entry)
        if isinstance(old, DiskClientStateStore):
            old.close()
        self.client_states = store

    def records(self, clients: Tensor, device: torch.device | None = None) -> ClientRecord:
        """The stacked :class:`ClientRecord` of the given client indices (on the module's device)."""
        assert self.data is not None and self.seen is not None
        idx = clients.cpu().long()
        device = self.device if device is None else device
        return ClientRecord(
            index=idx.to(device),
            weight=self.client_weight[idx].to(device),
            is_new=self.is_holdout[idx].to(device),
            seen=self.seen[idx].to(device),
            num_samples=self.data.train_counts.cpu()[idx].long().to(device),
        )

    def _bind_task(self, data: FederatedData) -> None:
        """Resolve the loss for this data's task: the ``loss`` argument, else the model's ``federated_loss``
        method, else the task's default."""
        spec = self.loss
        if spec is None and callable(getattr(self.model, "federated_loss", None)):
            spec = self.model.federated_loss  # type: ignore[union-attr]
        self.per_sample_loss = resolve_loss(spec, str(data.task))
        self._loss_name = loss_name(spec) if spec is not None else DEFAULT_LOSS[str(data.task)]

    def _metric_specs(self, data: FederatedData) -> dict[str, MetricSpec]:
        if self.metrics is not None:
            return dict(self.metrics)
        return dict(DEFAULT_METRICS[str(data.task)])

    def _check_outputs(self, data: FederatedData) -> None:
        """The model must take the data's inputs, and the loss and built-in metrics its outputs with the
        data's targets, giving one finite value per sample (checked once, on 2 samples, before training)."""
        assert self.model is not None and self.per_sample_loss is not None
        first = next(self.model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
        x, y = data.train_x[:2].to(device), data.train_y[:2].to(device)
        was_training = self.model.training
        try:
            self.model.eval()
            with torch.no_grad():
                out = self.model(x)
        except Exception as exc:  # noqa: BLE001 - reported with the shapes
            raise ValueError(
                f"the model cannot take this data's inputs: a batch of shape {tuple(x.shape)} ({x.dtype}) raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        finally:
            self.model.train(was_training)
        shape = tuple(getattr(out, "shape", ()))
        if not isinstance(out, Tensor) or out.dim() == 0 or out.shape[0] != x.shape[0]:
            raise ValueError(
                f"the model's output must be a tensor with one row per sample; got {type(out).__name__} of shape "
                f"{shape} for a batch of {x.shape[0]}"
            )
        if data.task == "classification" and (out.dim() != 2 or out.shape[-1] != data.num_classes):
            raise ValueError(
                f"the model's output has shape {shape} for a batch of {x.shape[0]}, but the data has "
                f"{data.num_classes} classes: its last layer must output {data.num_classes} logits per sample"
            )
        try:
            with torch.no_grad():
                values = self.per_sample_loss(out, y)
        except Exception as exc:  # noqa: BLE001 - reported with the shapes
            raise ValueError(
                f"the loss {self._loss_name!r} cannot take the model's outputs {shape} with the data's {data.task} "
                f"targets {tuple(y.shape)} ({y.dtype}): {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(values, Tensor) or tuple(values.shape) != (x.shape[0],):
            raise ValueError(
                f"the loss {self._loss_name!r} must give one value per sample (shape [{x.shape[0]}]), got "
                f"{tuple(getattr(values, 'shape', ()))}; a torch.nn loss needs reduction='none'"
            )
        specs = self._metric_specs(data)
        builtin = {key: BUILTIN_METRICS[spec] for key, spec in specs.items() if isinstance(spec, str)}
        for key, metric in builtin.items():
            try:
                v = metric.per_sample(out, y)
            except Exception as exc:  # noqa: BLE001 - reported with the shapes
                raise ValueError(
                    f"metric {key!r} cannot take the model's outputs {shape} with targets {tuple(y.shape)} "
                    f"({y.dtype}): {type(exc).__name__}: {exc}"
                ) from exc
            if tuple(v.shape) != (x.shape[0],):
                raise ValueError(f"metric {key!r} gives shape {tuple(v.shape)} for {x.shape[0]} samples")

    def _round(self) -> int:
        """Rounds trained so far: ``global_step``, or the loaded checkpoint's round under ``test``/``validate``."""
        return max(int(self.global_step), self._loaded_round)

    def _keep_running_statistics_per_client(self, num_clients: int) -> None:
        """BatchNorm layers with running statistics keep them **per client** (client state).

        :func:`~lightning_fedmeta.running_stats.prepare_model` makes the layers functional: a client's
        step advances its own running mean and variance (PyTorch's update rule, over the batch's real
        samples) and returns them. A client that trained keeps its statistics and is evaluated with them
        (as FedBN keeps BatchNorm local, Li et al., ICLR 2021); the module's own buffers are the
        sample-weighted mean of the statistics the last round's clients returned (FedAvg of the
        buffers), and every client that never trained starts from and is evaluated with those.
        """
        assert self.model is not None
        self.stat_names = prepare_model(self.model)
        if not self.stat_names:
            self.client_buffers = ClientStateStore()
            return
        stored = self.client_buffers.state_dict()
        if sorted(stored) != sorted(self.stat_names) or next(iter(stored.values())).shape[0] != num_clients:
            self.client_buffers = ClientStateStore(client_buffers(self.model, num_clients, self.stat_names))
        layers = sorted({n.rsplit(".", 1)[0] for n in self.stat_names})
        rank_zero_info(
            f"[lightning_fedmeta] BatchNorm running statistics (layers {', '.join(layers[:3])}"
            f"{', ...' if len(layers) > 3 else ''}) are kept per client: each client trains and is evaluated "
            "with its own; clients that never trained use the average of the last round's"
        )

    def _buffers_of(self, clients: Tensor) -> dict[str, Tensor]:
        """The running statistics each listed client starts from: its own once it trained, else the module's."""
        if not self.stat_names:
            return {}
        assert self.model is not None and self.seen is not None
        rows = self.client_buffers.gather(clients)
        seen = self.seen[clients.cpu()].to(self.device)
        own = dict(self.model.named_buffers())
        return {
            name: torch.where(seen.reshape(-1, *([1] * (v.dim() - 1))), v, own[name].to(v.dtype).expand_as(v))
            for name, v in rows.items()
        }

    def _global_params(self) -> Params:
        assert self.model is not None
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def _on_device(self) -> None:
        """Move data and per-client state to the module's device (once per device, or after a
        checkpoint was loaded); the client context is rebuilt only then, so a compiled client
        step keeps its graph."""
        assert self.data is not None
        if self._placed_on == self.device:
            return
        if self.data.train_x.device != self.device:
            self.data = self.data.to(self.device)
        self.client_states.to(self.device)
        self.client_buffers.to(self.device)
        self.server_state = map_state(lambda v: v.to(self.device), self.server_state)
        self.ctx = self._make_context()
        self.metric = self.metric.to(self.device)
        self._placed_on = self.device

    def _make_context(self) -> ClientContext:
        """The clients' functional view of the model (with the primitive compiler on the batched path)."""
        assert self.model is not None
        return ClientContext(
            self.model, dict(self.model.named_buffers()), per_sample_loss=self.per_sample_loss,  # type: ignore[arg-type]
            compiler=self.compiler if self.batching == "vmap" else None,
        )

    def configure_optimizers(self) -> Any:
        assert self.model is not None, "setup() must run before configure_optimizers()"
        params = list(self.model.parameters())
        opt = self.server_optimizer(params) if self.server_optimizer else torch.optim.SGD(params, lr=self.server_lr)
        if self.server_lr_scheduler is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.server_lr_scheduler(opt), "interval": "step"}}

    # ------------------------------------------------------------------------------------------
    # data gathering
    # ------------------------------------------------------------------------------------------
    def _batches(self, tag: str, round_idx: int, clients: Tensor, plan: Any) -> Batch:
        """Every mini-batch the clients draw in this call, ``[C, steps, per_step, B, ...]``.

        The samples are copied into buffers kept for the next call of the same shape: a fresh tensor of tens of
        MB costs more in page faults than the copy itself (Per-FedAvg HF on W: 20 ms against 4 ms). The batches
        live for one call (client functions are pure: they return new tensors, never views of their batches)."""
        assert self.data is not None
        idx, mask = draw_batch_indices(
            self.seed, tag, round_idx, clients, self.data.train_offsets.cpu(), plan, self._train_width
        )
        x = _rows(self.data.train_x, idx, self._gather_buffer("x", idx, self.data.train_x))
        y = _rows(self.data.train_y, idx, self._gather_buffer("y", idx, self.data.train_y))
        return Batch(x, y, mask.to(self.device))

    def _gather_buffer(self, name: str, index: Tensor, source: Tensor) -> Tensor:
        """The reusable destination of gathering ``source[index]`` (see :meth:`_batches`): one buffer per tensor
        name, replaced when the shape changes (training and evaluation batches never hold two at once)."""
        shape = (index.numel(), *source.shape[1:])
        buffer = self._gather_buffers.get(name)
        if buffer is None or buffer.shape != shape or buffer.dtype != source.dtype or buffer.device != source.device:
            self._gather_buffers.pop(name, None)  # freed before the new one is allocated
            buffer = self._gather_buffers[name] = torch.empty(shape, dtype=source.dtype, device=source.device)
        return buffer

    def _test_batches(self, clients: Tensor) -> Batch:
        """The listed clients' padded test sets ``[C, width, ...]``. They never change, so gathers are kept, one
        per chunk of clients, while they add up to at most :data:`TEST_CACHE_BYTES` (the first chunks of a
        streamed evaluation; ``attach_data`` and checkpoint loading reset the cache to ``None``), and an
        evaluation of the same chunks does not copy them again."""
        assert self.data is not None
        key = (self.device, tuple(clients.tolist()))
        cache: dict[Any, Batch] = self._test_cache if self._test_cache is not None else {}
        self._test_cache = cache
        if key in cache:
            return cache[key]
        offsets = self.data.test_offsets.cpu()
        counts = offsets[clients + 1] - offsets[clients]  # O(C), not O(K): one chunk of a streamed evaluation
        pos = torch.arange(self._test_width)
        mask = (pos.unsqueeze(0) < counts.unsqueeze(1)).to(torch.float32)
        idx = (offsets[clients].unsqueeze(1) + pos.unsqueeze(0)) * mask.long()
        batch = Batch(_rows(self.data.test_x, idx), _rows(self.data.test_y, idx), mask.to(self.device))
        size = sum(t.numel() * t.element_size() for t in batch)
        held = sum(t.numel() * t.element_size() for b in cache.values() for t in b)
        if held + size <= TEST_CACHE_BYTES:
            cache[key] = batch
        return batch

    def _rank_share(self, num: int) -> Tensor:
        """Positions ``0..num-1`` this process computes (≡ rank mod world size)."""
        world = self.trainer.world_size if self._trainer is not None else 1
        rank = self.trainer.global_rank if self._trainer is not None else 0
        return torch.arange(rank, num, world)

    def _combine_ranks(self, local_out: Any, positions: Tensor, total: int) -> Any:
        """Zero-filled all-reduce: every rank ends with all ``total`` rows, bit for bit."""
        world = self.trainer.world_size if self._trainer is not None else 1
        if world == 1:
            return local_out

        def fill(t: Tensor) -> Tensor:
            full = torch.zeros((total, *t.shape[1:]), dtype=t.dtype, device=t.device)
            if positions.numel():
                full[positions.to(t.device)] = t[: positions.numel()]
            return self.trainer.strategy.reduce(full, reduce_op="sum")

        return torch.utils._pytree.tree_map(fill, local_out)

    def _weights(self, clients: Tensor) -> Tensor:
        assert self.data is not None
        if self.aggregation == "uniform":
            w = torch.ones(clients.numel(), dtype=torch.float32)
        else:
            w = self.data.train_counts.cpu()[clients].to(torch.float32)
        return (w / w.sum()).to(self.device)

    # ------------------------------------------------------------------------------------------
    # one round
    # ------------------------------------------------------------------------------------------
    def _client_fn(
        self,
        params: Params,
        server_state: dict[str, Tensor],
        batches: Batch,
        state: dict[str, Tensor],
        record: ClientRecord,
        buffers: dict[str, Tensor],
    ) -> tuple[ClientOutput, dict[str, Tensor]]:
        """One client's local procedure, and its running statistics after it (``{}`` without BatchNorm)."""
        ctx = self.ctx.for_client(buffers) if buffers else self.ctx
        out = self.algorithm.client_update(ctx, params, batches, state, server_state, record)
        return out, ctx.updated_buffers()

    def _loop_seeds(self, tag: str, round_idx: int, clients: Tensor) -> list[int] | None:
        """Per-client seeds of the global RNG for looped clients (dropout); the batched path draws nothing."""
        if self.batching != "loop":
            return None
        return [stable_seed(self.seed, tag, round_idx, int(c)) for c in clients]

    def round_clients(self, round_idx: int) -> Tensor:
        """The clients that take part in round ``round_idx`` (sorted): the sampled ones, or under ``client_dropout``
        / ``over_selection`` the first ``m`` of ``⌈(1 + f)·m⌉`` candidates that answer (possibly none)."""
        candidates = sample_clients(self.seed, round_idx, self.eligible, self.num_candidates)
        return answering_clients(self.seed, round_idx, candidates, self.reliability.dropout, self.num_sampled)

    def round_steps(self, round_idx: int, clients: Tensor) -> Tensor:
        """The local steps each client takes in round ``round_idx``: its budget (``local_steps_dist``) or the
        algorithm's round plan."""
        budget = self.reliability.budget
        if budget is None:
            return torch.full((clients.numel(),), self.algorithm.round_plan().steps, dtype=torch.long)
        return budget.draw(self.seed, round_idx, clients)

    def compute_round(self, round_idx: int) -> tuple[Tensor, ClientOutput | None, Tensor | None]:
        """Sample the round's clients and run their local procedures (all ranks combined). ``(clients, None,
        None)`` when no client answers."""
        sampled = self.round_clients(round_idx)
        if sampled.numel() == 0:
            return sampled, None, None
        positions = self._rank_share(sampled.numel())
        local = sampled[positions] if positions.numel() else sampled[:1]
        batches = self._batches("train", round_idx, local, self.algorithm.round_plan())
        self._round_steps = self.round_steps(round_idx, sampled)
        if self.reliability.budget is not None:  # stragglers: their steps beyond the budget see empty batches
            local_steps = self._round_steps[positions] if positions.numel() else self._round_steps[:1]
            mask_missing_steps(batches.mask, local_steps)
        attack = self.reliability.byzantine
        if attack is not None and attack.attack == "label_flip":  # data poisoning: Byzantine clients flip labels
            flipped = torch.isin(local, self.byzantine_clients).to(batches.y.device)
            if bool(flipped.any()):
                assert self.data is not None and self.data.num_classes is not None
                batches.y[flipped] = flip_labels(batches.y[flipped], int(self.data.num_classes))
        states = self.client_states.gather(local)
        seeds = self._loop_seeds("dropout", round_idx, local)
        self.compiler.enabled = bool(self.compile_decision)
        self.compiler.new_call()
        out, buffers = run_clients(
            self._client_fn, (self._global_params(), self.server_state),
            (batches, states, self.records(local), self._buffers_of(local)),
            local.numel(), self.batching, self.client_chunk_size, seeds,
            label=f"{type(self.algorithm).__name__}.client_update",
        )
        out, buffers = self._combine_ranks((out, buffers), positions, sampled.numel())
        weights = self._weights(sampled)
        self._round_buffers = (sampled, buffers, weights) if buffers else None
        if "client_update" not in self._validated:  # once: later rounds cost nothing
            validate_client_output(self.algorithm, out, self._global_params(), self.client_states.tensors,
                                   sampled.numel(), strict_dtypes=not torch.is_autocast_enabled(self.device.type))
            self._validated.add("client_update")
        return sampled, out, weights

    def commit_round(self, sampled: Tensor, out: ClientOutput, server_state: dict[str, Tensor]) -> None:
        """Write a finished round back: the sampled clients' states, the server state, and their records'
        ``seen`` flags (called after the server optimizer's step)."""
        assert self.seen is not None
        self.client_states.scatter(sampled, out.state)
        self.server_state = server_state
        if self._round_buffers is not None and torch.equal(self._round_buffers[0], sampled):
            self._commit_running_statistics(*self._round_buffers)
        self._round_buffers = None
        self.seen[sampled.cpu()] = True

    def _commit_running_statistics(self, sampled: Tensor, buffers: dict[str, Tensor], weights: Tensor) -> None:
        """Store the round's clients' running statistics, and set the module's to their weighted mean."""
        assert self.model is not None
        self.client_buffers.scatter(sampled, buffers)
        own = dict(self.model.named_buffers())
        with torch.no_grad():
            for name, stacked in buffers.items():
                if stacked.is_floating_point():
                    own[name].copy_(weighted_sum(weights, stacked))
                else:  # num_batches_tracked: the weighted mean, rounded
                    own[name].copy_(weighted_sum(weights.double(), stacked.double()).round().to(own[name].dtype))

    def _check_finite(self, round_idx: int, sampled: Tensor, out: ClientOutput) -> None:
        assert self.data is not None
        leaves = list(out.delta.values()) + list(out.metrics.values()) + list(flatten_state(out.extras).values())
        leaves += [t for t in flatten_state(out.state).values() if t.is_floating_point()]
        if _sums_finite([t.reshape(t.shape[0], -1).sum(1) for t in leaves]):
            return
        ok = torch.stack([torch.isfinite(t.reshape(t.shape[0], -1)).all(1) for t in leaves]).all(0)
        if not bool(ok.all()):
            bad = int(sampled[(~ok).nonzero()[0, 0]])
            raise FloatingPointError(
                f"round {round_idx}: client {self.data.client_names[bad]} (index {bad}) produced a "
                f"non-finite loss or update with {self.algorithm!r}; lower the learning rates. "
                "The global model was not updated and saved checkpoints are untouched."
            )

    def _rounds_left(self, next_round: int) -> int | None:
        """Rounds this fit still runs from ``next_round`` (None when the Trainer has no step limit)."""
        if self._trainer is None or self.trainer.max_steps is None or self.trainer.max_steps < 0:
            return None
        return max(0, self.trainer.max_steps - next_round)

    def _decide_compile(self, round_idx: int, eager_seconds: float) -> None:
        """``compile_clients="auto"``: after the second round of a fit, compile the client steps if the rounds
        left would spend at least ``AUTO_COMPILE_SECONDS`` in eager client computation (rank 0 decides)."""
        self._eager_rounds_timed += 1
        if self._eager_rounds_timed < 2:  # the fit's first round carries one-time costs: time the second
            return
        left = self._rounds_left(round_idx + 1)
        decision = worth_compiling(left, eager_seconds)
        if self._trainer is not None and self.trainer.world_size > 1:
            decision = bool(self.trainer.strategy.broadcast(decision, src=0))
        self.compile_decision = decision
        rank_zero_info(
            f"[lightning_fedmeta] compile_clients='auto': {describe_decision(decision, left, eager_seconds)}"
        )

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self._on_device()
        r = int(self.global_step)
        deciding = self.compile_decision is None and self.batching == "vmap"
        started = time.perf_counter()
        sampled, out, weights = self.compute_round(r)
        if out is None or weights is None:
            return self._skip_round(r, "no sampled client answered (client_dropout)")
        if deciding:
            self._decide_compile(r, time.perf_counter() - started)
        self._check_finite(r, sampled, out)
        params = self._global_params()
        combined = self.reliability.combine(
            self.algorithm, params, out, weights, self.server_state, self.records(sampled), seed=self.seed,
            round_idx=r, byzantine=torch.isin(sampled, self.byzantine_clients),
            steps=self._round_steps if self._round_steps is not None else self.round_steps(r, sampled),
            cohort=self.num_sampled, clip=float(self.dp_clip) if self.reliability.dp is not None else math.inf,
        )
        if combined is None:
            rule = self.reliability.aggregator
            return self._skip_round(
                r, f"only {sampled.numel()} clients answered, too few for model.aggregator {rule.name!r} with "
                f"f={self.reliability.assumed_byzantine(self.num_sampled)}"
            )
        result, reliability_info = combined
        if "aggregate" not in self._validated:  # once: later rounds cost nothing
            validate_aggregate_output(self.algorithm, result, params, self.server_state,
                                      strict_dtypes=not torch.is_autocast_enabled(self.device.type))
            self._validated.add("aggregate")
        delta, new_server_state = result
        if not _sums_finite([v.sum() for v in delta.values()]) and not all(
            bool(torch.isfinite(v).all()) for v in delta.values()
        ):
            raise FloatingPointError(f"round {r}: the aggregated update is not finite; lower the learning rates")
        opt = self.optimizers()
        opt.zero_grad()
        assert self.model is not None
        for name, p in self.model.named_parameters():
            p.grad = (-delta[name]).to(p.dtype)
        opt.step()
        sch = self.lr_schedulers()
        if sch is not None:
            sch.step()  # type: ignore[union-attr]
        self.commit_round(sampled, out, new_server_state)
        if "dp_next_clip" in reliability_info:  # adaptive clipping: C for the next round
            self.dp_clip.fill_(reliability_info["dp_next_clip"])
        metrics = weighted_mean_metrics(out.metrics, weights)
        if self._logs_round(r):
            for k, v in metrics.items():
                self.log(f"train/{k}", v, prog_bar=(k == "loss"), on_step=True, on_epoch=False, batch_size=1)
            self.log("clients", float(sampled.numel()), prog_bar=True, on_step=True, on_epoch=False, batch_size=1)
            self.log("round", float(r + 1), on_step=True, on_epoch=False, batch_size=1)
            for k, v in reliability_info.items():
                if k != "dp_next_clip":
                    self.log(f"dp/{k[3:]}", float(v), on_step=True, on_epoch=False, batch_size=1)
        if self.reliability.dp is not None:
            self.log("privacy/epsilon", self.epsilon_spent(r + 1), prog_bar=True, on_step=True, on_epoch=False,
                     batch_size=1)
        return metrics.get("loss", torch.zeros((), device=self.device))

    def _skip_round(self, round_idx: int, reason: str) -> Tensor:
        """A round that changes nothing: the model, the server state and every client's state stay as they were
        (no client is marked as trained); the optimizer steps without gradients (parameters and optimizer state
        untouched) so the round still counts (``global_step``)."""
        rank_zero_info(f"[lightning_fedmeta] round {round_idx}: {reason}; the model is unchanged")
        opt = self.optimizers()
        opt.zero_grad(set_to_none=True)
        assert self.model is not None
        for p in self.model.parameters():
            p.grad = None
        opt.step()
        sch = self.lr_schedulers()
        if sch is not None:
            sch.step()  # type: ignore[union-attr]
        self._round_buffers = None
        self.log("clients", 0.0, prog_bar=True, on_step=True, on_epoch=False, batch_size=1)
        self.log("round", float(round_idx + 1), on_step=True, on_epoch=False, batch_size=1)
        return torch.zeros((), device=self.device)

    # ------------------------------------------------------------------------------------------
    # differential privacy
    # ------------------------------------------------------------------------------------------
    def epsilon_spent(self, rounds: int) -> float:
        """ε after ``rounds`` rounds of ``model.dp`` at its ``delta`` (Opacus's RDP accountant for the subsampled
        Gaussian mechanism, sample rate ``q = m / N_train``, one step per round)."""
        accountant = self._privacy_accountant()
        if accountant.rounds != rounds:
            if accountant.rounds > rounds:
                accountant = self._privacy_accountant(fresh=True)
            accountant.step(rounds - accountant.rounds)
        assert self.reliability.dp is not None
        return accountant.epsilon(self.reliability.dp.delta)

    def _privacy_accountant(self, fresh: bool = False) -> Any:
        from lightning_fedmeta.privacy import PrivacyAccountant

        dp = self.reliability.dp
        if dp is None:
            raise ValueError("model.dp is not set: no privacy is accounted")
        if self._accountant is None or fresh:
            sample_rate = self.num_sampled / int(self.eligible.numel())
            self._accountant = PrivacyAccountant(dp.noise_multiplier, sample_rate)
        return self._accountant

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        """``model.dp.target_epsilon``: stop before the round that would spend more than the target."""
        dp = self.reliability.dp
        if dp is None or dp.target_epsilon is None:
            return None
        r = int(self.global_step)
        self.epsilon_spent(r)
        after = self._accountant.epsilon_after(1, dp.delta)
        if after > dp.target_epsilon:
            rank_zero_info(
                f"[lightning_fedmeta] stopping before round {r}: it would raise the privacy spent to ε = {after:.4g} "
                f"> model.dp.target_epsilon = {dp.target_epsilon:g} (δ = {dp.delta:g}); ε after {r} rounds: "
                f"{self._accountant.epsilon(dp.delta):.4g}"
            )
            self.trainer.should_stop = True
            self._stopped_by_privacy_budget = True
            return -1
        return None

    def _logs_round(self, round_idx: int) -> bool:
        """Whether round ``round_idx`` logs its training metrics: the rounds a logger can write with
        ``log_every_n_steps = n`` (round ≡ 0 or n − 1 mod n, whichever way the step is counted) and the last
        round. Each ``self.log`` costs about 0.5 ms, a few percent of a compiled round."""
        if self._trainer is None:
            return True
        n = max(1, int(self.trainer.log_every_n_steps or 1))
        last = self.trainer.max_steps is not None and 0 < self.trainer.max_steps <= round_idx + 1
        return n == 1 or last or round_idx % n == 0 or (round_idx + 1) % n == 0

    # ------------------------------------------------------------------------------------------
    # personalised evaluation
    # ------------------------------------------------------------------------------------------
    def _eval_fn(
        self,
        params: Params,
        server_state: dict[str, Tensor],
        adapt: Batch,
        test: Batch,
        state: dict[str, Tensor],
        record: ClientRecord,
        buffers: dict[str, Tensor],
    ) -> dict[str, Tensor]:
        """One client's personalised model scored on its padded test set: masked sums of the loss and of
        each built-in metric's per-sample values, the number of real samples, and (when torchmetrics
        metrics are kept) the outputs themselves. BatchNorm layers use the client's running statistics."""
        ctx = self.ctx.for_client(buffers) if buffers else self.ctx
        w = self.algorithm.personalize(ctx, params, adapt, state, server_state, record)
        outputs = ctx.predict(w, test.x)
        losses = ctx.per_sample_loss(outputs, test.y)
        mask = test.mask.to(losses.dtype)
        result = {"total": mask.sum(), "loss_sum": (losses * mask).sum()}
        functions = self.metric.builtin_functions()
        if functions:
            result["builtin"] = torch.stack([(f(outputs, test.y).to(mask.dtype) * mask).sum() for f in functions])
        if self.metric.needs_outputs:
            result["outputs"] = outputs
        return result

    def evaluate_clients(self, clients: Tensor, round_idx: int) -> dict[str, Tensor]:
        """Each listed client's personalised model scored on its test set, stacked over the clients:
        ``total`` (test samples), ``loss_sum``, ``builtin`` (``[C, B]`` sums of the built-in metrics, in
        the order of ``metric.builtin``) and, with torchmetrics metrics, ``outputs``, ``targets``, ``mask``.

        The clients run in chunks of :meth:`_eval_chunk_size` (:meth:`_evaluate_chunk`); the validation and
        test steps stream the chunks into the metric instead of stacking them (bounded memory for any K)."""
        parts = [self._evaluate_chunk(part, round_idx) for part in self._eval_chunks(clients)]
        if len(parts) == 1:
            return parts[0]
        return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}

    def _eval_chunk_size(self) -> int:
        """Clients per evaluation chunk: ``client_chunk_size``, or ``max(clients per round, 100)`` when that is
        ``None`` (training may run all sampled clients at once; evaluation touches many more, so it chunks)."""
        return self.client_chunk_size or max(self.num_sampled, 100)

    def _eval_chunks(self, clients: Tensor) -> list[Tensor]:
        """``clients`` cut into consecutive chunks of :meth:`_eval_chunk_size` (the chunks ``run_clients`` forms
        for the whole list, so a streamed evaluation vmaps exactly the same client sets: bit-identical)."""
        size = self._eval_chunk_size()
        return [clients[start:start + size] for start in range(0, clients.numel(), size)]

    def _evaluate_chunk(self, clients: Tensor, round_idx: int) -> dict[str, Tensor]:
        """:meth:`evaluate_clients` for one chunk: only this chunk's adaptation batches, test sets, client states,
        records and running statistics are gathered (freed when the caller drops the result)."""
        assert self.data is not None
        params = self._global_params()
        adapt = self._batches("adapt", round_idx, clients, self.algorithm.eval_plan())
        test = self._test_batches(clients)
        states = self.client_states.gather(clients)
        seeds = self._loop_seeds("eval-dropout", round_idx, clients)
        self.compiler.enabled = self.compile_clients is True  # "auto" compiles training only (see __init__)
        self.compiler.new_call()
        with torch.inference_mode(False), torch.enable_grad():
            out = run_clients(
                self._eval_fn, (params, self.server_state),
                (adapt, test, states, self.records(clients), self._buffers_of(clients)),
                clients.numel(), self.batching, self._eval_chunk_size(), seeds,
                label=f"{type(self.algorithm).__name__}.personalize",
            )
        if "outputs" in out:
            out = {**out, "targets": test.y, "mask": test.mask}
        return out

    def evaluation_clients(self, stage: str, sample_size: int | None = None) -> Tensor:
        """The clients an evaluation scores, sorted: every client at ``test`` or without ``sample_size``
        (``data.eval_clients``); at ``val`` with ``N = sample_size < K``, a fixed sample of ``N`` clients.

        The sample is stratified proportionally over the two groups: ``N_new = round(N·|H|/K)`` of the held-out
        clients ``H`` (at least 1 when ``H`` is not empty and ``N >= 2``, leaving at least one training client),
        ``N_train = N − N_new`` of the training clients ``E`` (moved to the other group when a group is too small),
        each the first of a permutation drawn by ``generator_for(seed, "eval-clients", "train" | "new")`` (the
        module's ``seed``): a pure function of the seed, the same clients at every validation and on every rank
        (:func:`~lightning_fedmeta.sampling.generator_for`)."""
        assert self.data is not None
        k = self.data.num_clients
        if stage == "test" or sample_size is None or sample_size >= k:
            return torch.arange(k)
        eligible, holdout = self.eligible.cpu(), self.holdout.cpu()
        n = int(sample_size)
        n_new = math.floor(n * holdout.numel() / k + 0.5)
        if holdout.numel() and n >= 2:
            n_new = max(1, n_new)
        if eligible.numel() and n >= 2:
            n_new = min(n_new, n - 1)
        n_new = min(n_new, holdout.numel())
        n_train = min(n - n_new, eligible.numel())
        n_new = n - n_train
        picks = [
            group[torch.randperm(group.numel(), generator=generator_for(self.seed, "eval-clients", tag))[:m]]
            for group, tag, m in ((eligible, "train", n_train), (holdout, "new", n_new))
        ]
        return torch.cat(picks).sort().values

    def _eval_sample_size(self) -> int | None:
        """``data.eval_clients`` of the attached datamodule (``None``: every client at every evaluation)."""
        if self._trainer is None:
            return None
        return getattr(getattr(self.trainer, "datamodule", None), "eval_clients", None)

    def _log_eval_sample(self, evaluated: Tensor) -> None:
        """Say once per module which clients the validations score (``data.eval_clients``)."""
        if getattr(self, "_eval_sample_logged", False):
            return
        self._eval_sample_logged = True
        n_new = int(self.is_holdout[evaluated].sum())
        rank_zero_info(
            f"[lightning_fedmeta] data.eval_clients={evaluated.numel()}: every validation scores the same "
            f"{evaluated.numel()} of {self.is_holdout.numel()} clients ({evaluated.numel() - n_new} training, "
            f"{n_new} held out; drawn once per group in proportion to its size from model.seed={self.seed}, tag "
            "'eval-clients'); test scores every client"
        )

    def accuracy_of(self, scores: dict[str, Tensor], key: str = "acc") -> Tensor:
        """Per-client values of built-in metric ``key`` from :meth:`evaluate_clients`' sums."""
        col = list(self.metric.builtin).index(key)
        return scores["builtin"][:, col] / scores["total"].clamp_min(1)

    def _summary_groups(self, evaluated: Tensor | None) -> dict[str, Tensor]:
        """The client groups summarised: training (``clients``), held out (``new``) and, under ``model.byzantine``,
        honest training clients; restricted to ``evaluated`` (``None``: every client was evaluated)."""
        groups = {"clients": self.eligible, "new": self.holdout}
        if self.byzantine_clients.numel():  # model.byzantine: also the training clients that are honest
            groups["honest"] = self.eligible[~torch.isin(self.eligible, self.byzantine_clients)]
        if evaluated is None:
            return groups
        return {name: idx[torch.isin(idx, evaluated.to(idx.device))] for name, idx in groups.items()}

    @staticmethod
    def _blank_unevaluated(per_client: dict[str, Tensor], evaluated: Tensor | None) -> dict[str, Tensor]:
        """Per-client values on the CPU with NaN for every metric of a client not evaluated (``total`` stays 0), so
        the plots and summaries that drop NaN never read an unscored client as a zero."""
        out = {k: v.cpu() for k, v in per_client.items()}
        if evaluated is None:
            return out
        missing = torch.ones(out["total"].numel(), dtype=torch.bool)
        missing[evaluated.cpu()] = False
        return {k: v if k == "total" else v.masked_fill(missing, math.nan) for k, v in out.items()}

    def _evaluate(self, stage: str, log: bool = True) -> dict[str, dict[str, Tensor]]:
        self._on_device()
        assert self.data is not None
        r = self._round()
        was_training = self.model.training  # type: ignore[union-attr]
        self.model.eval()  # type: ignore[union-attr]
        k = self.data.num_clients
        evaluated = self.evaluation_clients(stage, self._eval_sample_size())
        sampled = evaluated.numel() < k
        if sampled:
            self._log_eval_sample(evaluated)
        clients = evaluated[self._rank_share(evaluated.numel())]
        self.metric = self.metric.to(self.device)
        self.metric.reset()
        for part in self._eval_chunks(clients):  # streamed: one chunk's batches, states and outputs at a time
            scores = self._evaluate_chunk(part, r)
            self.metric.update(part, scores)
            if "outputs" in scores:
                self.metric.update_outputs(part, scores["outputs"], scores["targets"], scores["mask"])
            del scores
        self.model.train(was_training)  # type: ignore[union-attr]
        world = self.trainer.world_size if self._trainer is not None else 1
        self.metric.sync(clients, None if world == 1 else lambda t: self.trainer.strategy.reduce(t, reduce_op="sum"))
        summary = self.metric.summaries(self._summary_groups(evaluated if sampled else None))
        for group, values in summary.items():
            if group.startswith("_") or not log:
                continue
            prefix = f"{stage}/" if group == "clients" else f"{stage}/{group}/"
            for name, v in values.items():
                bar = group == "clients" and name == f"{self.primary_metric}_weighted"
                self.log(prefix + name, v.float(), prog_bar=bar, batch_size=1, sync_dist=False)
        if sampled and log:
            self.log(f"{stage}/evaluated_clients", float(evaluated.numel()), batch_size=1, sync_dist=False)
        self.last_summary = summary
        self.last_summary_round = r
        self.last_evaluated = evaluated
        self.last_per_client = self._blank_unevaluated(summary["_per_client"], evaluated if sampled else None)
        return summary

    @property
    def last_per_client_accuracy(self) -> Tensor | None:
        """Deprecated alias: the primary metric's per-client values of the last evaluation
        (``last_per_client[primary_metric]``)."""
        return self.last_per_client.get(self.primary_metric) if self.last_per_client else None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate("val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate("test")

    def on_fit_end(self) -> None:
        stats = self.compiler.stats
        if stats.programs or stats.failures:
            rank_zero_info(
                f"[lightning_fedmeta] compiled client steps: {stats.programs} program(s), "
                f"{stats.compile_seconds:.1f} s compiling, {stats.compiled_calls} compiled calls"
                + (f"; could not compile: {'; '.join(stats.failures)}" if stats.failures else "")
            )
        if self._stopped_by_privacy_budget and self.last_summary_round != self._round():
            # a model.dp.target_epsilon stop ends the fit between two evaluations: evaluate the final model
            # (not logged: Lightning forbids logging here; the table, last_summary and the CSVs have it)
            self._evaluate("val", log=False)
        if self.last_summary and self.trainer.is_global_zero:
            rank_zero_info(format_summary(self.last_summary, self.last_summary_round))

    def on_test_end(self) -> None:
        directory = self.trainer.log_dir or self.trainer.default_root_dir  # a collective under DDP: every rank
        if not (self.last_summary and self.trainer.is_global_zero):
            return
        rank_zero_info(format_summary(self.last_summary, self._round()))
        path = self.write_per_client_csv(directory)
        rank_zero_info(f"per-client test accuracy written to {path}")

    def _restore_metric_state(self, state: dict[str, Tensor]) -> None:
        """Load saved per-client metric states and the summaries they give (as after that evaluation)."""
        self.metric.load_state_dict(state)
        if float(self.metric.total.sum()) > 0:
            scored = (self.metric.total.cpu() > 0).nonzero().flatten()  # a data.eval_clients sample: those only
            evaluated = None if scored.numel() == self.metric.total.numel() else scored
            groups = {"clients": self.eligible, "new": self.holdout}
            if evaluated is not None:
                groups = {name: idx[torch.isin(idx, evaluated)] for name, idx in groups.items()}
            summary = self.metric.summaries(groups)
            self.last_summary = summary
            self.last_evaluated = scored
            self.last_per_client = self._blank_unevaluated(summary["_per_client"], evaluated)

    def write_per_client_csv(self, directory: str) -> str:
        """Write ``test_per_client.csv`` (client, index, held_out, n_test, one column per metric, loss) into
        ``directory``: one row per client the last evaluation scored (every client after ``test``; the
        ``data.eval_clients`` sample after a sampled validation)."""
        import csv
        import os

        assert self.data is not None
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "test_per_client.csv")
        pc = self.last_per_client
        with open(path, "w", newline="") as fh:
            writer = csv.writer(fh)
            keys = list(self.metric_directions)  # the metrics, then the loss
            writer.writerow(["client", "index", "held_out", "n_test", *keys])
            evaluated = self.last_evaluated
            rows = range(len(self.data.client_names)) if evaluated is None else evaluated.tolist()
            for i in rows:
                writer.writerow([
                    self.data.client_names[i], i, int(self.is_holdout[i]), int(pc["total"][i]),
                    *(f"{float(pc[k][i]):.6f}" for k in keys),
                ])
        return path

    # ------------------------------------------------------------------------------------------
    # inference API
    # ------------------------------------------------------------------------------------------
    def personalize(self, client: int | tuple[Tensor, Tensor], round_idx: int | None = None) -> nn.Module:
        """A standalone ``nn.Module`` (in eval mode) holding a client's personalised model.

        Args:
            client: the index of a client of the attached federation (its stored state and training
                data are used, so the model is the one the evaluation at ``round_idx`` scored), or
                the training data ``(x, y)`` of a new client: it adapts from the global model exactly
                as a held-out client does (fresh client state, the algorithm's evaluation-time
                adaptation on batches drawn from ``(x, y)``). The new-client form works right after
                ``load_from_checkpoint`` without any federation data.
            round_idx: the round whose draws are used (default: the current or loaded round).
        """
        import copy

        assert self.model is not None, "the module has no model yet"
        r = self._round() if round_idx is None else round_idx
        params = self._global_params()
        if isinstance(client, int):
            if self.data is None:
                raise RuntimeError("attach data first: module.attach_data(datamodule.federated_data)")
            self._on_device()
            clients = torch.tensor([client])
            adapt = self._batches("adapt", r, clients, self.algorithm.eval_plan())
            states = self.client_states.gather(clients)
            record = self.records(clients)
            batches = Batch(adapt.x[0], adapt.y[0], adapt.mask[0])
            buffers = {k: v[0] for k, v in self._buffers_of(clients).items()}
        else:
            batches, states, record = self._new_client_batches(client, r, params)
            buffers = {}  # a new client: the module's own running statistics
        ctx = self.ctx if self.data is not None else ClientContext(self.model)
        if buffers:
            ctx = ctx.for_client(buffers)
        server_state = map_state(lambda v: v.to(self.device), self.server_state)
        was_training = self.model.training
        self.model.eval()  # adapt exactly as the evaluation does (dropout off, batch statistics as scored)
        try:
            with torch.inference_mode(False), torch.enable_grad():
                w = self.algorithm.personalize(
                    ctx, params, batches, map_state(lambda v: v[0], states), server_state,
                    ClientRecord(*(t[0] for t in record)),
                )
        finally:
            self.model.train(was_training)
        personal = copy.deepcopy(self.model)
        with torch.no_grad():
            for name, p in personal.named_parameters():
                p.copy_(w[name])
            own = dict(personal.named_buffers())
            for name, v in buffers.items():  # the client's running statistics
                own[name].copy_(v)
        return personal.eval()

    def _new_client_batches(
        self, data: tuple[Tensor, Tensor], round_idx: int, params: Params
    ) -> tuple[Batch, dict[str, Tensor], ClientRecord]:
        """Evaluation-time adaptation batches, a fresh state and a record (index −1, new, never trained,
        weight 0) for a client known only by its data."""
        x = _as_inputs(data[0]).to(self.device)
        y = _as_targets(data[1]).to(self.device)
        if y.dim() == 0 or y.shape[0] == 0 or x.shape[0] != y.shape[0]:
            raise ValueError(
                f"a new client's data needs as many targets as inputs (> 0), got {x.shape[0]} and "
                f"{y.shape[0] if y.dim() else 0}"
            )
        counts = torch.tensor([y.shape[0]])
        idx, mask = draw_batch_indices(
            self.seed, "adapt-new", round_idx, torch.tensor([0]), torch.tensor([0, y.shape[0]]),
            self.algorithm.eval_plan(), y.shape[0],
        )
        idx = idx[0].to(self.device)
        record = ClientRecord(
            index=torch.tensor([-1]), weight=torch.zeros(1, dtype=torch.float64), is_new=torch.tensor([True]),
            seen=torch.tensor([False]), num_samples=counts,
        )
        states = self.algorithm.init_client_states(params, record)
        record = ClientRecord(*(t.to(self.device) for t in record))
        return (
            Batch(x[idx], y[idx], mask[0].to(self.device)),
            map_state(lambda v: v.to(self.device), states),
            record,
        )

    # ------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["fedmeta"] = {
            # a disk store writes the rows changed since its last checkpoint as a segment and returns a manifest
            "client_state": self.client_states.checkpoint_state(int(self.global_step)),
            "client_buffers": self.client_buffers.state_dict(),
            "server_state": {k: v.detach().cpu().clone() for k, v in flatten_state(self.server_state).items()},
            "data_spec": self._data_spec,
            "round": int(self.global_step),
            "seen": None if self.seen is None else self.seen.clone(),
            # the last evaluation's per-client metric states (a resumed run reports the same per-client values)
            "metric_state": self.metric.state_dict() if hasattr(self, "metric") else None,
            "loss": getattr(self, "_loss_name", None),
            # checkpoints load with weights_only=True, so the architecture is named, not pickled
            "model_class": f"{type(self.model).__module__}.{type(self.model).__qualname__}",
            # compile_clients="auto": a resumed run keeps the decision, so its steps round as before
            "compile_decision": self.compile_decision,
            # the algorithm (class, hyper-parameters), datamodule class and trainer settings, for resume checks
            **fedmeta_run_record(self),
        }
        seal_checkpoint(checkpoint)  # last: Lightning's dump_checkpoint calls this hook after filling the rest

    @classmethod
    def load_from_checkpoint(  # type: ignore[override]
        cls,
        checkpoint_path: Any,
        map_location: Any = None,
        hparams_file: Any = None,
        strict: bool | None = None,
        weights_only: bool | None = None,
        **kwargs: Any,
    ) -> FederatedModule:
        """``LightningModule.load_from_checkpoint``, checked (docs/reliability.md, "Crashes and checkpoints"):
        a damaged file raises :class:`~lightning_fedmeta.checkpointing.CheckpointDamagedError` naming it, and a
        keyword argument that changes a setting of the checkpoint (other than the execution and evaluation
        settings that may change) raises :class:`~lightning_fedmeta.checkpointing.CheckpointSettingsError`.
        Pass ``model=`` again for a custom architecture."""
        return load_module_checkpoint(cls, checkpoint_path, map_location, hparams_file, strict, weights_only, **kwargs)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("fedmeta")
        if saved is None:
            raise ValueError("this checkpoint was not written by lightning_fedmeta.FederatedModule")
        path = loading_path(self)
        if not checkpoint.pop(VERIFIED_MARK, False):  # not verified on the raw file already
            verify_checkpoint(checkpoint, path)
        changed = check_resume_settings(self, checkpoint, path)  # refuses settings that must match
        if changed:
            rank_zero_info(
                "[lightning_fedmeta] settings changed since the checkpoint (allowed): "
                + "; ".join(d.describe() for d in changed)
            )
        self._restore_client_states(saved["client_state"])
        self.client_buffers.load_state_dict(saved.get("client_buffers") or {})
        self._placed_on = None
        self._test_cache = None
        self._gather_buffers = {}
        self.server_state = unflatten_state({k: v.clone() for k, v in saved["server_state"].items()})
        self._data_spec = saved.get("data_spec")
        seen = saved.get("seen")
        if seen is not None:
            self.seen = seen.clone().to(torch.bool)
        else:  # a checkpoint from before client records: who trained is not known
            rank_zero_warn(
                "this checkpoint predates client records (no 'seen' flags): every client is treated as not "
                "trained yet, so personal models are read as the global model until a client trains again"
            )
            if self.seen is not None:
                self.seen.zero_()
        self._loaded_round = int(checkpoint.get("global_step", 0))
        if self.compile_clients == "auto" and saved.get("compile_decision") is not None:
            self.compile_decision = bool(saved["compile_decision"])
        metric_state = saved.get("metric_state")
        if any(d.name == "model.metrics" for d in changed):  # evaluating with other metrics: their states differ
            metric_state = None
        if metric_state is not None:
            if hasattr(self, "metric") and self.data is not None:
                self._restore_metric_state(metric_state)
            else:
                self._pending_metric_state = metric_state
        trained_loss = saved.get("loss")
        current = getattr(self, "_loss_name", None)
        if trained_loss is not None and current is not None and trained_loss != current:
            raise ValueError(
                f"this checkpoint was trained with loss {trained_loss!r}, this module uses {current!r}; pass "
                "the same loss again (FederatedModule.load_from_checkpoint(path, loss=...))"
            )
        if self.model is None and self._data_spec is not None:
            model = _default_model_for(self._data_spec)
            trained = saved.get("model_class")
            built = f"{type(model).__module__}.{type(model).__qualname__}"
            if trained is not None and trained != built:
                raise ValueError(
                    f"this checkpoint was trained with model {trained}; pass the architecture again: "
                    f"FederatedModule.load_from_checkpoint(path, model={trained.rsplit('.', 1)[-1]}(...))"
                )
            self.model = model
