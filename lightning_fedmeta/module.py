"""FederatedModule: the federated loop as a LightningModule (one training step = one round).

A thin facade over the Trainer-free round engine (:mod:`lightning_fedmeta.loop`; the round's formulas:
docs/design.md): Lightning owns devices, precision, the optimizer, logging and checkpoints; the engine owns the round
(participants → gather → compute → combine → step → commit), the evaluator the personalised evaluation, the module's
own state lives in :class:`~lightning_fedmeta.frontends.fit_state.FitState` and DP's budget in
:class:`~lightning_fedmeta.frontends.private_fit.PrivateFit`.
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
from lightning_fedmeta.client.execution import ClientBatching
from lightning_fedmeta.client.losses import PerSampleLoss
from lightning_fedmeta.data.federated import FederatedData
from lightning_fedmeta.evaluation import Evaluator, format_summary
from lightning_fedmeta.evaluation.metrics import MetricSpec
from lightning_fedmeta.frontends.callbacks import round_bar_instead_of_default
from lightning_fedmeta.frontends.checkpoint_state import restore_module_state, save_module_state
from lightning_fedmeta.frontends.facade import MODULE_FORWARDS, forward_attributes
from lightning_fedmeta.frontends.fit_state import FitState
from lightning_fedmeta.frontends.options import (
    FederatedSetupError,
    bind_model,
    build_algorithm,
    check_options,
    check_server_optimizer,
    resolve_loss_option,
    server_optimizer_config,
    unsaved_arguments,
)
from lightning_fedmeta.frontends.personal_model import personal_model
from lightning_fedmeta.frontends.precision import drop_loss_scaler
from lightning_fedmeta.frontends.private_fit import PrivateFit
from lightning_fedmeta.frontends.resume_settings import (
    ResumeCandidate,
    fedmeta_run_record,
    load_module_checkpoint,
    loading_path,
)
from lightning_fedmeta.frontends.round_logging import (
    log_round,
    log_summary,
    pending_evaluation_round,
    record_outside_validation,
)
from lightning_fedmeta.loop import CompilePolicy, RankSplit, RoundEngine, StoreLocation
from lightning_fedmeta.loop.schedule import ScheduleMode
from lightning_fedmeta.persistence.checkpoint_files import install_atomic_checkpoint_io
from lightning_fedmeta.reliability.options import Reliability

__all__ = ["FederatedModule", "FederatedSetupError", "format_summary"]


class FederatedModule(LightningModule):
    """Personalized federated learning with any registered algorithm (docs/concepts.md; every option: docs/cli.md).

    Args:
        model: any ``nn.Module`` (a ``LightningModule``'s ``forward`` too) mapping inputs to what the loss accepts;
            ``None`` builds :func:`~lightning_fedmeta.models.reference.default_model` from the data's shapes and task.
        algorithm: a registered name (``"fedavg"``), a mapping ``{name: ..., <hyper-parameters>}`` or an
            :class:`~lightning_fedmeta.Algorithm` instance.
        clients_per_round: clients sampled each round (exclusive with ``fraction``; 10 when neither is given).
        fraction: fraction of the training clients sampled each round (rounded up).
        aggregation: client weights ``p_i``: ``"samples"`` (∝ training samples) or ``"uniform"``.
        server_lr: β of the default server optimizer ``SGD(lr=β)``: ``w ← w + βΔ``.
        server_optimizer: any ``torch.optim`` factory (Adam: FedAdam); overrides ``server_lr``. Algorithms with
            ``server_optimizer_applies = False`` (IFCA, CFL, MOCHA, ``mtl_*``, Per-FedMAML) refuse it.
        server_lr_scheduler: a scheduler factory for the server optimizer, stepped every round.
        client_batching: ``"auto"`` (batched unless the model forbids it), ``"vmap"`` or ``"loop"``.
        client_chunk_size: clients per ``vmap`` call; ``None``: all; ``"auto"``: 100, and
            :data:`~lightning_fedmeta.client.execution.CPU_CONV_CHUNK` for convolutions trained on the CPU.
        compile_clients: ``torch.compile`` the batched client primitives (:mod:`lightning_fedmeta.client.compiled`):
            ``"auto"`` when the remaining rounds pay for the programs (decided after round 2, checkpointed),
            ``True`` always, ``False`` never. docs/performance.md.
        step_schedule: under ``local_epochs``, how clients with different step counts run
            (:mod:`lightning_fedmeta.loop.schedule`): ``"auto"`` (least time under a measured cost model),
            ``"grouped"``, ``"lockstep"`` or ``"compacted"``; the same numbers under each, to rounding.
        cuda_graphs: replay each batched primitive as a CUDA graph (:mod:`lightning_fedmeta.client.graphs`): ``"auto"``
            on a CUDA device, ``True`` (refused off a GPU) or ``False``.
        holdout_clients: clients never sampled in training (count, or fraction in [0, 1)), evaluated as new ones.
        seed: seed of client sampling and mini-batch draws (independent of the data seed).
        loss: the per-sample loss: a name (:data:`~lightning_fedmeta.client.losses.LOSSES`), an import path, a
            ``torch.nn`` loss module or a callable ``(outputs, targets) -> [B]``; ``None``: the model's
            ``federated_loss`` if it has one, else the task's default.
        metrics: the personalised metrics ``{name: spec}`` (a built-in name of
            :data:`~lightning_fedmeta.evaluation.metrics.BUILTIN_METRICS` or a torchmetrics ``Metric``), logged as
            ``{stage}/{name}_weighted``, ``_mean`` and ``_worst10``; ``None``: accuracy, or MAE for regression.
        client_dropout: ``p``: each sampled client fails with probability ``p``; the round aggregates the others.
        over_selection: ``f``: sample ``⌈(1 + f)·m⌉`` clients and keep the first ``m`` that answer.
        local_steps_dist: per-client budgets of local steps (stragglers): a list, or
            ``{distribution: uniform, low, high}`` / ``{distribution: choice, values, probs}``.
        aggregator: the server's rule for delta uploads: ``mean`` (default), ``median``, ``trimmed_mean``,
            ``krum``, ``multi_krum``, ``bulyan``, ``geometric_median``, ``fednova``, or a registered plugin's;
            a name or ``{name: ..., <options>}``.
        byzantine: simulated Byzantine clients, ``{fraction: 0.2, attack: sign_flip}``.
        dp: client-level differential privacy (DP-FedAvg), ``{clip, noise_multiplier, delta, target_epsilon,
            adaptive_clip, secure_mode}``; ε logged every round; needs ``aggregation="uniform"``.
        client_state: where the clients' state rows live: ``"memory"``, ``"disk"`` (memory-mapped,
            :class:`~lightning_fedmeta.persistence.disk_store.DiskClientStateStore`) or ``"auto"`` (disk above 2 GiB).
        client_state_dir: the disk store's folder (``None``: ``<trainer.default_root_dir>/client_state``).
        compression: of uploads and downloads, on the client (:mod:`lightning_fedmeta.communication.compressors`): an
        upload name
            or ``{upload: qsgd, bits: 8, download: float16}``. docs/communication.md.

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
            client_state_dir=client_state_dir, step_schedule=step_schedule, metrics=metrics,
        )
        loss, built = resolve_loss_option(loss), build_algorithm(algorithm)
        check_server_optimizer(built, server_lr, server_optimizer, server_lr_scheduler)
        self.save_hyperparameters(ignore=unsaved_arguments(algorithm, loss, metrics))
        self.model, self.loss, self.metrics = model, loss, dict(metrics) if metrics is not None else None
        self.client_state_dir = None if client_state_dir is None else os.fspath(client_state_dir)
        options = dict(locals())  # every other option kept under its own name (read by the CLI, plots and tests)
        for name in _KEPT_OPTIONS:
            setattr(self, name, options[name])
        self.engine = RoundEngine.from_options(
            built, self.reliability, seed=seed, clients_per_round=clients_per_round, fraction=fraction,
            holdout_clients=holdout_clients, aggregation=aggregation, client_batching=client_batching,
            client_chunk_size=client_chunk_size, compile_policy=CompilePolicy(compile_clients, cuda_graphs),
            store=StoreLocation(client_state, self.client_state_dir), step_schedule=step_schedule)
        self.engine.use_model(model)
        self.evaluator = Evaluator(self.engine)
        if self.reliability.dp is not None:  # the clipping norm C (adaptive clipping changes it): checkpointed
            self.register_buffer("dp_clip", torch.tensor(float(self.reliability.dp.clip), dtype=torch.float64))
        self.per_sample_loss: PerSampleLoss | None = None
        #: the run's own state (data spec, loss name, device, a loaded checkpoint's round and privacy record)
        self.fit_state = FitState()
        self.private_fit = PrivateFit(self.reliability.dp, self._sample_rate)  # model.dp's budget of this fit

    # -- setup -------------------------------------------------------------------------------------
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
        self.fit_state.bind(data)
        bound = bind_model(self.model, self.loss, self.metrics, data, self.algorithm)
        self.model, self.per_sample_loss = bound.model, bound.per_sample_loss
        self.fit_state.use_loss(bound.loss_name)
        self._locate_store()
        reason = self.engine.bind(data, self.model, self.per_sample_loss, str(data.task))
        self.evaluator.bind(bound.metric_specs, data.num_clients)
        k, n_eligible = data.num_clients, int(self.eligible.numel())
        rank_zero_info(f"[lightning_fedmeta] {self.algorithm!r}: {k} clients ({n_eligible} training, "
                       f"{k - n_eligible} held out), {self.num_sampled} per round; clients: {reason}")

    def _locate_store(self) -> None:
        """The disk store's rank and default folder (``<trainer.default_root_dir>/client_state``)."""
        attached = self._trainer is not None
        self.engine.locate_store(int(self.trainer.global_rank) if attached else 0,
                                 self.trainer.default_root_dir if attached else None)

    def _on_device(self) -> None:
        """Move data and client state to the module's device (once per device, or after a checkpoint loaded)."""
        self.engine.use_ranks(self._ranks())
        if self.fit_state.is_placed_on(self.device):
            return
        self.engine.place(self.device)
        self.evaluator.place(self.device)
        self.fit_state.placed(self.device)

    def _ranks(self) -> RankSplit:
        return RankSplit.of(self.trainer) if self._trainer is not None else RankSplit()

    def configure_callbacks(self) -> list[Any]:
        """A round-counting progress bar in place of Lightning's own (:func:`~lightning_fedmeta.frontends.callbacks.
        round_bar_instead_of_default`)."""
        return round_bar_instead_of_default(self.trainer) if self._trainer is not None else []

    def configure_optimizers(self) -> Any:
        assert self.model is not None, "setup() must run before configure_optimizers()"
        return server_optimizer_config(self.model, self.server_lr, self.server_optimizer, self.server_lr_scheduler)

    # -- one round ---------------------------------------------------------------------------------
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
        log_round(self.log, self._trainer, report, self.reliability.dp, self.engine.traffic, self.epsilon_spent)
        return report.loss if report.loss is not None else torch.zeros((), device=self.device)

    def _rounds_left(self, next_round: int) -> int | None:
        """Rounds this fit still runs from ``next_round`` (None when the Trainer has no step limit)."""
        if self._trainer is None or self.trainer.max_steps is None or self.trainer.max_steps < 0:
            return None
        return max(0, self.trainer.max_steps - next_round)

    def trained_rounds(self) -> int:
        """Rounds trained so far: ``global_step``, or the loaded checkpoint's round under ``test``/``validate``."""
        return max(int(self.global_step), self.fit_state.loaded_round)

    def compute_round(self, round_idx: int) -> Any:
        """The round's clients, outputs and weights (``(clients, None, None)`` when none answers)."""
        result = self.engine.compute(round_idx)
        return result if result is not None else (torch.zeros(0, dtype=torch.long), None, None)

    def round_steps(self, round_idx: int, clients: Tensor) -> Tensor:
        return self.engine.federation.round_steps(round_idx, clients, self.algorithm.round_plan().steps)

    # -- differential privacy (lightning_fedmeta.frontends.private_fit.PrivateFit) ---------------------------
    def _sample_rate(self) -> float:
        return self.num_sampled / int(self.eligible.numel())

    def on_train_start(self) -> None:
        """Under ``model.dp``: continue the model's privacy record and choose the noise source
        (:func:`~lightning_fedmeta.frontends.private_fit.start_private_fit`); after a resume, run the evaluation the
        checkpoint was written before. Under ``16-mixed`` the loss scaler is dropped
        (:mod:`~lightning_fedmeta.frontends.precision`)."""
        drop_loss_scaler(self.trainer)
        broadcast = None
        if self.trainer.world_size > 1:
            broadcast = lambda key: self.trainer.strategy.broadcast(key, src=0)  # noqa: E731
        self.private_fit.start(self.engine, step=int(self.global_step), saved_privacy=self.fit_state.saved_privacy,
                               loaded_round=self.fit_state.loaded_round, broadcast=broadcast)
        pending = pending_evaluation_round(self.trainer, self.fit_state, int(self.global_step))
        if pending is not None:
            record_outside_validation(self.trainer, self, self._evaluate("val", log=False), pending)

    def epsilon_spent(self, rounds: int) -> float:
        """ε after ``rounds`` rounds of this fit of ``model.dp`` at its ``delta``, the rounds of earlier fits of
        this model (warm starts) included (Opacus's RDP accountant, ``q = m / N``)."""
        return self.private_fit.budget().epsilon(rounds)

    def privacy_record(self) -> dict[str, Any] | None:
        """The checkpoint's privacy record: every ``(z, q, rounds)`` phase released and their count."""
        return self.private_fit.record(int(self.global_step))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        """``model.dp.target_epsilon``: stop before the round that would spend more than the target."""
        reason = self.private_fit.refusal(int(self.global_step))
        if reason is None:
            return None
        rank_zero_info(f"[lightning_fedmeta] {reason}")
        self.trainer.should_stop = True
        return -1

    # -- personalised evaluation -------------------------------------------------------------------
    def _eval_sample_size(self) -> int | None:
        """``data.eval_clients`` of the attached datamodule (``None``: every client at every evaluation)."""
        datamodule = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        return getattr(datamodule, "eval_clients", None)

    def _evaluate(self, stage: str, log: bool = True) -> dict[str, dict[str, Tensor]]:
        """One evaluation of the clients (:meth:`_eval_sample_size` of them when the datamodule samples)."""
        self._on_device()
        summary, evaluated, sampled = self.evaluator.run(stage, self.trained_rounds(), self._eval_sample_size(),
                                                         self._ranks())
        if log:
            log_summary(self.log, self._trainer, stage, summary, evaluated if sampled else None, self.primary_metric)
        return summary

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate("val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate("test")

    def on_fit_end(self) -> None:
        line = self.engine.compile.report()
        if line:
            rank_zero_info(line)
        budget = self.private_fit.started
        if budget is not None and budget.stopped and self.last_summary_round != self.trained_rounds():
            # a target_epsilon stop ends the fit between two evaluations: evaluate the final model (not logged:
            # Lightning forbids logging here; the table, last_summary and the CSVs have it)
            self._evaluate("val", log=False)
        if self.last_summary and self.trainer.is_global_zero:
            rank_zero_info(format_summary(self.last_summary, self.last_summary_round))
        if budget is not None:
            rank_zero_info(budget.summary(int(self.global_step)))

    def on_test_end(self) -> None:
        directory = self.trainer.log_dir or self.trainer.default_root_dir  # a collective under DDP: every rank
        if self.trainer.is_global_zero:
            self.evaluator.report_test(directory, self.trained_rounds())

    # -- inference API -----------------------------------------------------------------------------
    def personalize(self, client: int | tuple[Tensor, Tensor], round_idx: int | None = None) -> nn.Module:
        """A standalone ``nn.Module`` (in eval mode) holding a client's personalised model.

        Args:
            client: the index of a client of the attached federation (its stored state and training data are
                used: the model the evaluation at ``round_idx`` scored), or the training data ``(x, y)`` of a new
                client, which adapts from the global model as a held-out client does (fresh state, the algorithm's
                evaluation-time adaptation on ``(x, y)``); this form works right after ``load_from_checkpoint``.
            round_idx: the round whose draws are used (default: the current or loaded round).
        """
        assert self.model is not None, "the module has no model yet"
        if isinstance(client, int) and self.data is not None:
            self._on_device()
        r = self.trained_rounds() if round_idx is None else round_idx
        return personal_model(self.engine, self.model, client, r, self.device, attached=self.data is not None)

    # -- checkpoints -------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        save_module_state(checkpoint, engine=self.engine, evaluator=self.evaluator, fit=self.fit_state,
                          model=self.model, round_idx=int(self.global_step), privacy=self.privacy_record(),
                          record=fedmeta_run_record(self.algorithm, self._trainer))

    @classmethod
    def load_from_checkpoint(  # type: ignore[override]
        cls, checkpoint_path: Any, map_location: Any = None, hparams_file: Any = None, strict: bool | None = None,
        weights_only: bool | None = None, **kwargs: Any,
    ) -> FederatedModule:
        """``LightningModule.load_from_checkpoint``, checked (docs/reliability.md, "Crashes and checkpoints"):
        a damaged file raises :class:`~lightning_fedmeta.persistence.checksums.CheckpointDamagedError` naming it, and a
        keyword argument that changes a setting of the checkpoint (other than the execution and evaluation
        settings that may change) raises :class:`~lightning_fedmeta.persistence.safe_loading.CheckpointSettingsError`.
        Pass ``model=`` again for a custom architecture."""
        return load_module_checkpoint(cls, checkpoint_path, map_location, hparams_file, strict, weights_only, **kwargs)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._locate_store()
        candidate = ResumeCandidate(type(self), dict(self.hparams), self.algorithm, self._trainer, self.data,
                                    self.fit_state.data_spec, self.configure_optimizers)
        self.model = restore_module_state(checkpoint, loading_path(self._trainer), candidate=candidate,
                                          engine=self.engine, evaluator=self.evaluator, fit=self.fit_state,
                                          model=self.model)


#: the constructor's options the module keeps as attributes of the same name besides model, loss and metrics
_KEPT_OPTIONS = ("clients_per_round", "fraction", "aggregation", "server_lr", "server_optimizer", "server_lr_scheduler",
                 "client_batching", "client_chunk_size", "compile_clients", "step_schedule", "cuda_graphs",
                 "holdout_clients", "seed", "client_dropout", "over_selection", "local_steps_dist", "aggregator",
                 "byzantine", "dp", "client_state", "compression")
forward_attributes(FederatedModule, MODULE_FORWARDS)
