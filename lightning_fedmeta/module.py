"""FederatedModule: the federated loop as a LightningModule (one training step = one round).

A thin facade over the Trainer-free round engine (:mod:`lightning_fedmeta.loop`, docs/design.md): Lightning
owns devices, precision, the optimizer, logging and checkpoints; the engine owns the round
(participants → gather → compute → combine → step → commit), the evaluator the personalised evaluation.

    S    = federation.round_clients(r)                        pure in (seed, r); dropout / over-selection
    out  = algorithm.client_update(w, batches[S], state[S], record[S])   functional; looped or vmap-ed
    Δ    = server pipeline (attacks, clipping, robust rule or algorithm.aggregate, DP noise) over out, p_S
    w   <- server optimizer step with pseudo-gradient −Δ       (SGD(lr=β): w + βΔ; Adam/Yogi: FedOpt)
    state[S], σ, seen[S] <- committed

Under ``ddp`` rank k computes the sampled clients at positions ≡ k (mod world size) and a zero-filled all-reduce
gives every rank the single-process tensors (:class:`~lightning_fedmeta.loop.ranks.RankSplit`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn

from lightning_fedmeta.algorithms.base import Algorithm
from lightning_fedmeta.callbacks import round_bar_instead_of_default
from lightning_fedmeta.checkpoint_state import restore_module_state, save_module_state
from lightning_fedmeta.checkpointing import (
    install_atomic_checkpoint_io,
    load_module_checkpoint,
)
from lightning_fedmeta.data.federated import FederatedData
from lightning_fedmeta.evaluation import Evaluator, format_summary
from lightning_fedmeta.execution import ClientBatching
from lightning_fedmeta.facade import Forward
from lightning_fedmeta.loop import CompilePolicy, Federation, RankSplit, RoundEngine, StoreLocation
from lightning_fedmeta.loop.schedule import ScheduleMode
from lightning_fedmeta.losses import DEFAULT_LOSS, PerSampleLoss, loss_name, resolve_loss
from lightning_fedmeta.metrics import DEFAULT_METRICS, ClientMetrics, MetricSpec
from lightning_fedmeta.options import (
    FederatedSetupError,
    build_algorithm,
    check_model_outputs,
    check_options,
    check_server_optimizer,
    default_model_for,
    resolve_loss_option,
    unsaved_arguments,
    warn_if_optimizer_ignored,
)
from lightning_fedmeta.personal_model import personal_model
from lightning_fedmeta.precision import drop_loss_scaler
from lightning_fedmeta.privacy_budget import PrivacyBudget
from lightning_fedmeta.private_fit import start_private_fit
from lightning_fedmeta.reliability import Reliability
from lightning_fedmeta.round_logging import log_round, log_summary, run_pending_evaluation

__all__ = ["FederatedModule", "FederatedSetupError", "format_summary"]


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
            ``None`` = all at once; ``"auto"`` (default) = 100, and for the training rounds of a model with
            convolutions on the CPU :data:`~lightning_fedmeta.execution.CPU_CONV_CHUNK` (10; faster: its activations
            stay in cache). A number you give is used as given. Timings: benchmarks/results/speed.md.
        compile_clients: ``torch.compile`` the client context's primitives (``sgd_step``, ``loss_and_grad``,
            ``grad``, ``hvp``, ``loss``, ``predict``), each once, batched over the clients and reused for every
            local step (:mod:`lightning_fedmeta.compiled`; vmap path only). ``"auto"`` (default) compiles the
            training steps when the run is long enough to pay for it: after the second round of a fit, if the
            remaining rounds would spend at least :data:`~lightning_fedmeta.compiled.AUTO_COMPILE_SECONDS` of
            eager client computation (the decision is logged, kept in checkpoints and taken by rank 0 for all
            ranks); evaluation stays eager. ``True`` compiles training and evaluation from the first round;
            ``False`` never compiles. Compiled and eager steps agree to rounding. Timings:
            benchmarks/results/speed.md.
        step_schedule: under ``local_epochs``, how clients with different step counts run
            (:mod:`lightning_fedmeta.loop.schedule`): ``"auto"`` (default) partitions the round into the groups
            of least time under a cost model measured on the model and device (a step's fixed latency against its
            per-client cost; one group on a GPU, groups of similar step counts on a CPU), ``"grouped"`` (groups
            with at most ~10 % padded steps), ``"lockstep"`` (one group, finished clients masked) or
            ``"compacted"`` (one group, each step computing only the clients that still have a batch). The same
            numbers under each, to rounding; the measured cost is checkpointed.
        cuda_graphs: capture each batched client primitive (a local step, a prediction) once per shape as a CUDA
            graph and replay it (:mod:`lightning_fedmeta.graphs`): a small model's step costs one launch instead of
            a chain of ~100. ``"auto"`` (default): on a CUDA device with batched clients; ``True`` also refuses a
            run that is not on a GPU; ``False`` never. Replays give the uncaptured call's numbers.
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
            ``step_budget`` only (every built-in algorithm but MOCHA).
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
        compression: compression of what the clients send and receive, done on the client before any server stage:
            an upload name or ``{upload: qsgd, bits: 8, bucket_size: 512, download: float16}``; uploads ``float16``,
            ``bfloat16``, ``qsgd`` (``bits`` 8/4/2), ``topk`` (``fraction``, error feedback: the residual is client
            state) and ``randomk`` (``fraction``); downloads ``float16``/``bfloat16``
            (:mod:`lightning_fedmeta.compression`, docs/communication.md).

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
        client_chunk_size: int | Literal["auto"] | None = "auto",
        compile_clients: bool | Literal["auto"] = "auto",
        step_schedule: ScheduleMode = "auto",
        cuda_graphs: bool | Literal["auto"] = "auto",
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
        compression: str | dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        #: the reliability options, parsed (each error names its model.* option; docs/reliability.md)
        self.reliability = Reliability.from_options(
            client_dropout, over_selection, local_steps_dist, aggregator, byzantine, dp, compression
        )
        self.automatic_optimization = False
        clients_per_round = check_options(
            clients_per_round=clients_per_round, fraction=fraction, aggregation=aggregation, server_lr=server_lr,
            factories={"server_optimizer": server_optimizer, "server_lr_scheduler": server_lr_scheduler},
            client_batching=client_batching, client_chunk_size=client_chunk_size, client_state=client_state,
            client_state_dir=client_state_dir, step_schedule=step_schedule,
        )
        loss = resolve_loss_option(loss)
        if metrics is not None:
            if not isinstance(metrics, Mapping) or not metrics:
                raise ValueError(f"metrics must be a non-empty mapping {{name: metric}}, got {metrics!r}")
            ClientMetrics(metrics, 1)  # names, built-ins and torchmetrics states checked now, before any data
        built = build_algorithm(algorithm)
        check_server_optimizer(built, server_lr, server_optimizer, server_lr_scheduler)
        self.save_hyperparameters(ignore=unsaved_arguments(algorithm, loss, metrics))
        self.model = model
        self.clients_per_round, self.fraction, self.aggregation = clients_per_round, fraction, aggregation
        self.server_lr, self.server_optimizer = server_lr, server_optimizer
        self.server_lr_scheduler = server_lr_scheduler
        self.client_batching, self.client_chunk_size, self.compile_clients = (client_batching, client_chunk_size,
                                                                              compile_clients)
        self.step_schedule, self.cuda_graphs = step_schedule, cuda_graphs
        self.holdout_clients, self.seed, self.loss = holdout_clients, seed, loss
        self.metrics = dict(metrics) if metrics is not None else None
        self.client_dropout, self.over_selection = client_dropout, over_selection
        self.local_steps_dist = local_steps_dist
        self.aggregator, self.byzantine, self.dp = aggregator, byzantine, dp
        self.client_state, self.compression = client_state, compression
        self.client_state_dir = None if client_state_dir is None else os.fspath(client_state_dir)
        federation = Federation(seed, clients_per_round, fraction, holdout_clients, aggregation, self.reliability)
        self.engine = RoundEngine(built, federation, client_batching, client_chunk_size,
                                  CompilePolicy(compile_clients, cuda_graphs),
                                  StoreLocation(client_state, self.client_state_dir), step_schedule)
        self.engine.model = model
        self.evaluator = Evaluator(self.engine)
        if self.reliability.dp is not None:  # the clipping norm C (adaptive clipping changes it): checkpointed
            self.register_buffer("dp_clip", torch.tensor(float(self.reliability.dp.clip), dtype=torch.float64))
        self.per_sample_loss: PerSampleLoss | None = None
        self._data_spec: dict[str, Any] | None = None
        self._placed_on: torch.device | None = None
        self._loaded_round = 0  # the round of a loaded checkpoint (test/validate do not restore global_step)
        self._budget: PrivacyBudget | None = None
        self._saved_privacy: dict[str, Any] | None = None  # a loaded checkpoint's privacy record

    # ------------------------------------------------------------------------------------------
    # setup
    # ------------------------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if self._trainer is not None:  # crash-safe checkpoint writes, unless the user chose a CheckpointIO
            install_atomic_checkpoint_io(self.trainer)
        data = getattr(getattr(self.trainer, "datamodule", None) if self._trainer is not None else None,
                       "federated_data", None)
        if data is None:
            raise ValueError("FederatedModule needs a datamodule with a 'federated_data' attribute "
                             "(lightning_fedmeta.FederatedDataModule or one of your own)")
        try:
            self.attach_data(data)
        except ValueError as exc:
            if type(exc) is not ValueError:  # a specific error (e.g. an algorithm's invalid output) keeps its type
                raise
            raise FederatedSetupError(str(exc)) from exc  # a setting that does not fit this data

    def attach_data(self, data: FederatedData) -> None:
        """Bind the federated data: build the model if needed, check it, choose clients, initialise state."""
        self._placed_on = None
        self._data_spec = {"input_shape": list(data.input_shape), "num_classes": data.num_classes,
                           "task": data.task, "target_shape": list(data.target_shape)}
        if self.model is None:
            self.model = default_model_for(self._data_spec)
        spec = self.loss
        if spec is None and callable(getattr(self.model, "federated_loss", None)):
            spec = self.model.federated_loss
        self.per_sample_loss = resolve_loss(spec, str(data.task))
        self._loss_name = loss_name(spec) if spec is not None else DEFAULT_LOSS[str(data.task)]
        metric_specs = dict(self.metrics) if self.metrics is not None else dict(DEFAULT_METRICS[str(data.task)])
        check_model_outputs(self.model, data, self.per_sample_loss, self._loss_name, metric_specs)
        warn_if_optimizer_ignored(self.model, self.algorithm)
        self._locate_store()
        reason = self.engine.bind(data, self.model, self.per_sample_loss, str(data.task))
        self.evaluator.bind(metric_specs, data.num_clients)
        k, n_eligible = data.num_clients, int(self.eligible.numel())
        rank_zero_info(f"[lightning_fedmeta] {self.algorithm!r}: {k} clients ({n_eligible} training, "
                       f"{k - n_eligible} held out), {self.num_sampled} per round; clients: {reason}")

    def _locate_store(self) -> None:
        """The disk store's rank and default folder (``<trainer.default_root_dir>/client_state``)."""
        self.engine.store.rank = int(self.trainer.global_rank) if self._trainer is not None else 0
        self.engine.store.default_root = self.trainer.default_root_dir if self._trainer is not None else None

    def _on_device(self) -> None:
        """Move data and client state to the module's device (once per device, or after a checkpoint loaded)."""
        self.engine.ranks = self._ranks()
        if self._placed_on == self.device:
            return
        self.engine.place(self.device)
        self.evaluator.metric = self.evaluator.metric.to(self.device)
        self._placed_on = self.device

    def _ranks(self) -> RankSplit:
        return RankSplit.of(self.trainer) if self._trainer is not None else RankSplit()

    def configure_callbacks(self) -> list[Any]:
        """A round-counting progress bar in place of Lightning's own (:func:`~lightning_fedmeta.callbacks.
        round_bar_instead_of_default`)."""
        return round_bar_instead_of_default(self.trainer) if self._trainer is not None else []

    def configure_optimizers(self) -> Any:
        assert self.model is not None, "setup() must run before configure_optimizers()"
        params = list(self.model.parameters())
        opt = self.server_optimizer(params) if self.server_optimizer else torch.optim.SGD(params, lr=self.server_lr)
        if self.server_lr_scheduler is None:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.server_lr_scheduler(opt), "interval": "step"}}

    # ------------------------------------------------------------------------------------------
    # one round
    # ------------------------------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self._on_device()
        r = int(self.global_step)
        broadcast = None
        if self._trainer is not None and self.trainer.world_size > 1:
            broadcast = lambda decision: self.trainer.strategy.broadcast(decision, src=0)  # noqa: E731
        report = self.engine.run_round(r, self.optimizers(), clip=getattr(self, "dp_clip", None),
                                       rounds_left=self._rounds_left(r + 1), broadcast=broadcast)
        sch = self.lr_schedulers()
        if sch is not None:
            sch.step()  # type: ignore[union-attr]
        log_round(self, report)
        return report.loss if report.loss is not None else torch.zeros((), device=self.device)

    def _rounds_left(self, next_round: int) -> int | None:
        """Rounds this fit still runs from ``next_round`` (None when the Trainer has no step limit)."""
        if self._trainer is None or self.trainer.max_steps is None or self.trainer.max_steps < 0:
            return None
        return max(0, self.trainer.max_steps - next_round)

    def _round(self) -> int:
        """Rounds trained so far: ``global_step``, or the loaded checkpoint's round under ``test``/``validate``."""
        return max(int(self.global_step), self._loaded_round)

    def compute_round(self, round_idx: int) -> Any:
        """The round's clients, outputs and weights (``(clients, None, None)`` when none answers)."""
        result = self.engine.compute(round_idx)
        return result if result is not None else (torch.zeros(0, dtype=torch.long), None, None)

    def round_steps(self, round_idx: int, clients: Tensor) -> Tensor:
        return self.engine.federation.round_steps(round_idx, clients, self.algorithm.round_plan().steps)

    # ------------------------------------------------------------------------------------------
    # differential privacy
    # ------------------------------------------------------------------------------------------
    def _privacy(self) -> PrivacyBudget:
        if self.reliability.dp is None:
            raise ValueError("model.dp is not set: no privacy is accounted")
        if self._budget is None:
            self._budget = PrivacyBudget(self.reliability.dp, self.num_sampled / int(self.eligible.numel()))
        return self._budget

    def on_train_start(self) -> None:
        """Under ``model.dp``: continue the model's privacy record and choose the noise source
        (:func:`~lightning_fedmeta.private_fit.start_private_fit`); after a resume, run the evaluation the
        checkpoint was written before. Under ``16-mixed`` the loss scaler is dropped
        (:mod:`~lightning_fedmeta.precision`)."""
        drop_loss_scaler(self.trainer)
        if self.reliability.dp is not None:
            self._budget = start_private_fit(self)
        run_pending_evaluation(self)

    def epsilon_spent(self, rounds: int) -> float:
        """ε after ``rounds`` rounds of this fit of ``model.dp`` at its ``delta``, the rounds of earlier fits of
        this model (warm starts) included (Opacus's RDP accountant, ``q = m / N``)."""
        return self._privacy().epsilon(rounds)

    def privacy_record(self) -> dict[str, Any] | None:
        """The checkpoint's privacy record: every ``(z, q, rounds)`` phase released and their count."""
        if self.reliability.dp is None:
            return None
        return self._privacy().record(int(self.global_step))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        """``model.dp.target_epsilon``: stop before the round that would spend more than the target."""
        if self.reliability.dp is None or self.reliability.dp.target_epsilon is None:
            return None
        reason = self._privacy().refusal(int(self.global_step))
        if reason is None:
            return None
        rank_zero_info(f"[lightning_fedmeta] {reason}")
        self.trainer.should_stop = True
        return -1

    # ------------------------------------------------------------------------------------------
    # personalised evaluation
    # ------------------------------------------------------------------------------------------
    def accuracy_of(self, scores: dict[str, Tensor], key: str = "acc") -> Tensor:
        """Per-client values of built-in metric ``key`` from :meth:`evaluate_clients`' sums."""
        col = list(self.metric.builtin).index(key)
        return scores["builtin"][:, col] / scores["total"].clamp_min(1)

    def _eval_sample_size(self) -> int | None:
        """``data.eval_clients`` of the attached datamodule (``None``: every client at every evaluation)."""
        if self._trainer is None:
            return None
        return getattr(getattr(self.trainer, "datamodule", None), "eval_clients", None)

    def _evaluate(self, stage: str, log: bool = True) -> dict[str, dict[str, Tensor]]:
        self._on_device()
        summary, evaluated, sampled = self.evaluator.run(stage, self._round(), self._eval_sample_size(), self._ranks())
        if log:
            log_summary(self, stage, summary, evaluated if sampled else None)
        return summary

    @property
    def last_per_client_accuracy(self) -> Tensor | None:
        """Deprecated alias: ``last_per_client[primary_metric]``."""
        return self.last_per_client.get(self.primary_metric) if self.last_per_client else None

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate("val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate("test")

    def on_fit_end(self) -> None:
        line = self.engine.compile.report()
        if line:
            rank_zero_info(line)
        if self._budget is not None and self._budget.stopped and self.last_summary_round != self._round():
            # a target_epsilon stop ends the fit between two evaluations: evaluate the final model (not logged:
            # Lightning forbids logging here; the table, last_summary and the CSVs have it)
            self._evaluate("val", log=False)
        if self.last_summary and self.trainer.is_global_zero:
            rank_zero_info(format_summary(self.last_summary, self.last_summary_round))
        if self._budget is not None:
            rank_zero_info(self._budget.summary(int(self.global_step)))

    def on_test_end(self) -> None:
        directory = self.trainer.log_dir or self.trainer.default_root_dir  # a collective under DDP: every rank
        if not (self.last_summary and self.trainer.is_global_zero):
            return
        rank_zero_info(format_summary(self.last_summary, self._round()))
        path = self.write_per_client_csv(directory)
        rank_zero_info(f"per-client test accuracy written to {path}")

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
        assert self.model is not None, "the module has no model yet"
        if isinstance(client, int) and self.data is not None:
            self._on_device()
        r = self._round() if round_idx is None else round_idx
        return personal_model(self.engine, self.model, client, r, self.device, attached=self.data is not None)

    # ------------------------------------------------------------------------------------------
    # checkpoints
    # ------------------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        save_module_state(self, checkpoint)

    @classmethod
    def load_from_checkpoint(  # type: ignore[override]
        cls, checkpoint_path: Any, map_location: Any = None, hparams_file: Any = None, strict: bool | None = None,
        weights_only: bool | None = None, **kwargs: Any,
    ) -> FederatedModule:
        """``LightningModule.load_from_checkpoint``, checked (docs/reliability.md, "Crashes and checkpoints"):
        a damaged file raises :class:`~lightning_fedmeta.checkpointing.CheckpointDamagedError` naming it, and a
        keyword argument that changes a setting of the checkpoint (other than the execution and evaluation
        settings that may change) raises :class:`~lightning_fedmeta.checkpointing.CheckpointSettingsError`.
        Pass ``model=`` again for a custom architecture."""
        return load_module_checkpoint(cls, checkpoint_path, map_location, hparams_file, strict, weights_only, **kwargs)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        restore_module_state(self, checkpoint)


#: the module's attribute -> (the part that owns it, its name there): state and phases under their historical names
_FORWARDED: dict[str, tuple[str, str]] = {
    **{n: ("engine", n) for n in ("algorithm", "data", "client_states", "server_state", "batching", "ctx", "records")},
    **{n: ("engine.federation", n) for n in ("seen", "holdout", "is_holdout", "eligible", "client_weight",
                                             "num_sampled", "num_candidates", "byzantine_clients", "round_clients")},
    **{n: ("evaluator", n) for n in ("metric", "metric_directions", "primary_metric", "last_summary",
                                     "last_summary_round", "last_per_client", "last_evaluated", "evaluate_clients",
                                     "evaluation_clients", "write_per_client_csv")},
    "compiler": ("engine.compile", "compiler"), "compile_decision": ("engine.compile", "decision"),
    "client_buffers": ("engine.running", "store"), "stat_names": ("engine.running", "names"),
    "commit_round": ("engine", "commit_output"), "_global_params": ("engine", "global_params"),
    "_batches": ("engine.gatherer", "batches"),
}
for _name, (_owner, _attr) in _FORWARDED.items():
    setattr(FederatedModule, _name, Forward(_owner, _attr))
