"""The round engine: one federated round, written once, with no Trainer in it.

Round ``r`` as named phases, each a method, values passed from one to the next:

    1. participants   S = federation.round_clients(r)                          (Federation: sampling, dropout)
    2. gather         batches[S], state[S], record[S], BN statistics[S]        (BatchGatherer, client store)
    3. compute        RoundResult = run_clients(client_update, ...)            looped or vmap-ed; ranks combined
    4. combine        Uploads = ServerPipeline.run(RoundResult)                attacks, clipping, rule, noise
    5. step           apply_server_step(optimizer, model, Δ)                   p.grad = −Δ; optimizer.step()
    6. commit         state[S] ← new state, σ ← σ', seen[S] ← True, BN statistics

The round has two halves. The client half (phases 1–3, :meth:`RoundEngine.compute`, built from the functions
of :mod:`~lightning_fedmeta.loop.clients`) returns the frozen :class:`~lightning_fedmeta.loop.round.RoundResult`;
the server half (phases 4–6 and the report, :meth:`RoundEngine.serve`) takes one, including the DP round nobody
answered (noise only) and the skipped round. :meth:`RoundEngine.run_round` composes them; the Lightning module
(:class:`~lightning_fedmeta.FederatedModule`), the testing kit and benchmarks drive it with their optimizer. The
Flower ServerApp builds the same engine (:meth:`RoundEngine.bind_population`: no data on the server) and calls
:meth:`RoundEngine.serve` on the ``RoundResult`` it assembles from its nodes' checked replies; each ClientApp runs
the client half's functions on its own partition. Devices, logging and checkpoint files belong to the frontend;
each part here owns its ``state_dict``.

A non-finite client output or aggregate follows :attr:`RoundEngine.nonfinite`, one policy both frontends use:
``"raise"`` (the simulation's default: ``FloatingPointError`` naming the client, nothing changed) or ``"drop"``
(a Flower deployment's: a non-finite client fails the round as a rejected reply does, the others are aggregated
with renormalised weights, and a non-finite aggregate skips the round: an untrusted node must not stop the run).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from lightning_fedmeta.algorithms.base import Algorithm, BatchPlan, ClientOutput, ClientRecord, weighted_mean_metrics
from lightning_fedmeta.client.compiled import client_buckets
from lightning_fedmeta.client.execution import choose_batching, training_chunk_size
from lightning_fedmeta.client.functional import Batch, ClientContext, Params
from lightning_fedmeta.client.sampling import plan_steps
from lightning_fedmeta.client.trainable import TrainableSet, trainable_parameters
from lightning_fedmeta.communication.accounting import Codec, PlainCodec, RoundTraffic, TrafficCounter, round_traffic
from lightning_fedmeta.communication.compressors import CompressionSpec
from lightning_fedmeta.data.federated import FederatedData
from lightning_fedmeta.loop.client_storage import (
    AnyStore,
    RunningStatistics,
    StoreLocation,
    build_client_store,
    restore_client_store,
)
from lightning_fedmeta.loop.clients import client_step, loop_seeds, run_client_updates
from lightning_fedmeta.loop.compile_policy import CompilePolicy
from lightning_fedmeta.loop.compression_stage import CompressionStage
from lightning_fedmeta.loop.federation import Federation
from lightning_fedmeta.loop.gather import BatchGatherer, regroup
from lightning_fedmeta.loop.published_statistics import (
    publish_statistics,
    published_statistics_rows,
    published_statistics_size,
)
from lightning_fedmeta.loop.ranks import RankSplit
from lightning_fedmeta.loop.round import RoundReport, RoundResult, check_outputs_finite, finite_clients
from lightning_fedmeta.loop.schedule import ScheduleMode, StepCost, StepSchedule, measure_step_cost
from lightning_fedmeta.loop.server import (
    ServerPipeline,
    apply_server_step,
    check_update_finite,
    noise_only_uploads,
    skip_server_step,
)
from lightning_fedmeta.loop.stages import ServerContext, Uploads
from lightning_fedmeta.loop.streaming import DeltaSum, streams
from lightning_fedmeta.loop.validation import (
    validate_aggregate_output,
    validate_client_output,
    validate_init_server_state,
)
from lightning_fedmeta.persistence.memory_store import ClientStateStore, flatten_state, map_state, unflatten_state
from lightning_fedmeta.privacy.draws import DPDraws, SecretDraws
from lightning_fedmeta.reliability.attacks import flip_labels
from lightning_fedmeta.reliability.options import Reliability
from lightning_fedmeta.reliability.participation import mask_missing_steps

__all__ = ["NonFinite", "RoundEngine"]

#: what a round does with a non-finite client output or aggregate (module docstring)
NonFinite = Literal["raise", "drop"]


class RoundEngine:
    """The federated loop of one run: its clients, their state, the round's phases and the server pipeline.

    Args:
        algorithm: the algorithm (its three pure functions and state spec).
        federation: who takes part (:class:`~lightning_fedmeta.loop.federation.Federation`).
        client_batching: ``"auto"``, ``"vmap"`` or ``"loop"``.
        client_chunk_size: clients per ``vmap`` call (``None``: all at once; ``"auto"``:
            :func:`~lightning_fedmeta.client.execution.training_chunk_size`).
        compile_policy: when the client steps are compiled.
        store: where the client state rows live (``model.client_state``).
        step_schedule: how clients with different step counts run under ``local_epochs``
            (:mod:`~lightning_fedmeta.loop.schedule`): ``"auto"``, ``"grouped"``, ``"lockstep"`` or ``"compacted"``.
    """

    def __init__(self, algorithm: Algorithm, federation: Federation, client_batching: str = "auto",
                 client_chunk_size: int | str | None = "auto", compile_policy: CompilePolicy | None = None,
                 store: StoreLocation | None = None, step_schedule: ScheduleMode = "auto") -> None:
        self.algorithm = algorithm
        self.federation = federation
        self.reliability = federation.reliability
        self.pipeline = ServerPipeline.from_reliability(self.reliability)
        self.compression = CompressionStage(self.reliability.compression)  # model.compression (client side)
        self.client_batching = client_batching
        self.client_chunk_size = client_chunk_size
        self.compile = compile_policy or CompilePolicy(False)
        self.store = store or StoreLocation("memory", None)
        self.client_states: AnyStore = ClientStateStore()
        self.running = RunningStatistics()
        self.server_state: dict[str, Any] = {}
        self.ranks = RankSplit()
        self.device = torch.device("cpu")
        self.data: FederatedData | None = None
        self.model: nn.Module | None = None
        #: the model's trainable parameters, fixed at bind time (frozen ones are never trained, sent or stored)
        self.trainable: TrainableSet | None = None
        self._bound_model: nn.Module | None = None  # the model whose trainable set ``trainable`` holds
        self.batching = "loop"
        self.validated: set[str] = set()  # outputs validated on the first round with this data
        self._broadcast: Callable[[Any], Any] | None = None  # rank 0's value to every rank (set by run_round)
        self._round_programs = 1  # compiled programs per primitive the last round's calls would use
        self.draws: DPDraws | None = None  # DP's secret draws (model.dp.secure_mode), set when a fit starts
        self._last: RoundResult | None = None  # for the (clients, output, weights) form of compute / commit
        self.codec: Codec = PlainCodec()  # how the exchanged tensors are encoded (bytes counted per round)
        self.traffic = TrafficCounter()  # cumulative bytes, checkpointed
        #: under ``local_epochs``, which clients run together (:mod:`~lightning_fedmeta.loop.schedule`; the numbers
        #: are the same under every schedule, only the padding and the sequential steps differ)
        self.schedule = StepSchedule(step_schedule)
        #: stream the aggregate of rounds whose rule is the default weighted mean (:mod:`~lightning_fedmeta.loop.
        #: streaming`): each chunk's weighted updates are summed as it is computed (False: every update stacked)
        self.stream_aggregate = True
        #: a non-finite client output or aggregate: "raise" (simulation) or "drop" (a deployment; module docstring)
        self.nonfinite: NonFinite = "raise"
        #: whether the engine keeps every client's state rows (False on a Flower server: the nodes keep their own)
        self.holds_client_state = True
        #: the compression the clients apply themselves (a deployment's nodes), counted as the simulated one is
        self.upload_compression: CompressionSpec | None = None
        #: ``m̂`` for adaptive clipping when the frontend observes participation (a deployment: its answer rate so
        #: far); ``None``: :meth:`Federation.expected_answers <lightning_fedmeta.loop.federation.Federation.
        #: expected_answers>`
        self.answer_rate: Callable[[], float] | None = None

    @classmethod
    def from_options(cls, algorithm: Algorithm, reliability: Reliability, *, seed: int, clients_per_round: int | None,
                     fraction: float | None = None, holdout_clients: int | float = 0, aggregation: str = "samples",
                     **options: Any) -> RoundEngine:
        """The engine of the ``model.*`` options as ``FederatedModule`` reads them (``clients_per_round`` already
        resolved by :func:`~lightning_fedmeta.frontends.options.check_options`, which gives its default): the federation
        (:class:`~lightning_fedmeta.loop.federation.Federation`) and the server pipeline of ``reliability``;
        ``options`` are the constructor's execution options (batching, compile policy, store, schedule)."""
        federation = Federation(seed, clients_per_round, fraction, holdout_clients, aggregation, reliability)
        return cls(algorithm, federation, **options)

    @property
    def seed(self) -> int:
        return self.federation.seed

    # ------------------------------------------------------------------------------------------
    # setup
    # ------------------------------------------------------------------------------------------
    def bind(self, data: FederatedData, model: nn.Module, per_sample_loss: Any, task: str) -> str:
        """Bind the data and model: the population (:meth:`bind_population`), batching, the gatherer and the
        clients' context. Returns why the clients run looped or batched."""
        self.data, self.per_sample_loss = data, per_sample_loss
        self.bind_population(data.train_counts, data.label_counts, model, task)
        self.batching, reason = choose_batching(model, self.client_batching)
        if self.batching == "vmap" and not type(self.algorithm).batchable:
            name = type(self.algorithm).__name__
            if self.client_batching == "vmap":
                raise ValueError(f"client_batching='vmap' is impossible: {name} is not batchable")
            self.batching, reason = "loop", f"{name} runs its clients looped (batchable=False)"
        self.gatherer = BatchGatherer(data, self.seed, self.device)
        self.ctx = self.make_context()
        return reason

    def bind_population(self, train_counts: Tensor, label_counts: Tensor, model: nn.Module, task: str) -> None:
        """The setup every frontend shares, from the clients' sizes ``n_i`` and label histograms alone (a Flower
        server has no data): the federation (hold-outs, ``m``, ``p_i``), the model's BatchNorm statistics per
        client, ``algorithm.bind_clients`` with every client's record, the client state rows (unless
        :attr:`holds_client_state` is off), the compression residuals and the initial server state (each kept
        when a loaded checkpoint already filled it)."""
        self.model = model
        self.trainable = TrainableSet(model)
        self._bound_model = model
        k = int(train_counts.numel())
        self.algorithm.check_epoch_plans()
        self.federation.bind(train_counts, self.algorithm, task)
        self.running.prepare(model, k)
        params = self.global_params()
        everyone = self.records(torch.arange(k), device=torch.device("cpu"))
        self.algorithm.bind_clients(everyone, label_counts.cpu())
        if self.holds_client_state and not self.client_states.tensors:
            self.client_states = build_client_store(self.algorithm, params, everyone, self.store)
        self.compression.bind(params, k, self.store)
        if not self.server_state:
            server_state = self.algorithm.init_server_state(params)
            validate_init_server_state(self.algorithm, server_state)
            self.server_state = server_state
        self.validated = set()

    @property
    def training_chunk(self) -> int | None:
        """Clients per vmap call of a training round
        (:func:`~lightning_fedmeta.client.execution.training_chunk_size`)."""
        assert self.model is not None
        return training_chunk_size(self.model, self.device, self.client_chunk_size)

    def make_context(self) -> ClientContext:
        """The clients' functional view of the model (with the primitive compiler on the batched path)."""
        assert self.model is not None
        return ClientContext(self.model, dict(self.model.named_buffers()), per_sample_loss=self.per_sample_loss,
                             compiler=self.compile.compiler if self.batching == "vmap" else None)

    def measure_step_cost(self, clients: int, batch_size: int | None,
                          broadcast: Callable[[Any], Any] | None = None) -> StepCost | None:
        """The cost model of ``step_schedule="auto"`` on this model and device
        (:func:`~lightning_fedmeta.loop.schedule.measure_step_cost` on a batch of the training pool's first
        ``batch_size`` rows, up to ``min(clients, chunk)`` clients per call). Under several processes rank 0's
        measurement is used by every rank (``broadcast``). ``None`` (and "grouped" stays) when fewer than 2 clients
        run together."""
        assert self.model is not None and self.data is not None
        chunk = self.training_chunk
        most = clients if chunk is None else min(clients, chunk)
        cost = None
        if most >= 2:
            rows = min(int(self.data.train_x.shape[0]), batch_size or int(self.data.train_counts.max()))
            ctx = ClientContext(self.model, dict(self.model.named_buffers()), per_sample_loss=self.per_sample_loss)
            cost = measure_step_cost(ctx, self.global_params(), Batch(
                self.data.train_x[:rows], self.data.train_y[:rows], torch.ones(rows, device=self.device)), most)
        if broadcast is not None:
            state = broadcast(None if cost is None else cost.state())
            cost = StepCost.from_state(state)
        return cost

    def use_model(self, model: nn.Module | None) -> None:
        """The global model the rounds train (set again by :meth:`bind`; a frontend that restores a default model
        from a checkpoint before any data is bound passes it here)."""
        self.model = model

    def use_ranks(self, ranks: RankSplit) -> None:
        """Which of a round's clients this process computes (:class:`~lightning_fedmeta.loop.ranks.RankSplit`)."""
        self.ranks = ranks

    def locate_store(self, rank: int, default_root: str | None) -> None:
        """A disk store's rank (its folder ``rank-<r>``) and its default root (``<root>/client_state`` when
        ``client_state_dir`` is not given)."""
        self.store.rank = int(rank)
        self.store.default_root = default_root

    def use_pipeline(self, pipeline: ServerPipeline) -> None:
        """Run the server stages of ``pipeline`` instead of the ones the reliability options built (a custom
        stage order; :class:`~lightning_fedmeta.loop.server.ServerPipeline`)."""
        if not isinstance(pipeline, ServerPipeline):
            raise TypeError(f"use_pipeline needs a ServerPipeline, got {type(pipeline).__name__}")
        self.pipeline = pipeline

    def use_nonfinite(self, policy: NonFinite) -> None:
        """What a round does with a non-finite client output or aggregate (:attr:`nonfinite`, the module
        docstring): ``"raise"`` or ``"drop"``."""
        if policy not in ("raise", "drop"):
            raise ValueError(f"the non-finite policy is 'raise' or 'drop', got {policy!r}")
        self.nonfinite = policy

    def serve_remote_clients(self, upload_compression: CompressionSpec | None,
                             answer_rate: Callable[[], float]) -> None:
        """The engine of a frontend whose clients run elsewhere and are not trusted (a Flower deployment's nodes;
        call before :meth:`bind_population`): no client state rows here (the nodes keep theirs), the ``"drop"``
        policy for non-finite outputs and aggregates, the bytes of the compression the nodes apply counted as
        simulated, and adaptive clipping's ``m̂`` from the answer rate the frontend observes."""
        self.holds_client_state = False
        self.use_nonfinite("drop")
        self.upload_compression = upload_compression
        self.answer_rate = answer_rate

    def start_releases(self, offset: int, key: bytes | None, hide_cohort_size: bool) -> None:
        """The start of a fit under ``model.dp``: round ``r``'s DP draws use the release index ``offset + r``, from
        the secret ``key`` (``None``: from the seed); ``hide_cohort_size`` keeps byte counts, which would reveal a
        Poisson cohort's size, out of the logs."""
        if offset < 0:
            raise ValueError(f"a release offset is a count of earlier releases, got {offset}")
        self.federation.round_offset = int(offset)
        self.use_secret(key)
        self.traffic.hidden = bool(hide_cohort_size)

    def place(self, device: torch.device) -> None:
        """Move data and every client's state to ``device``; the context is rebuilt (a compiled step keeps its
        graph as long as the device does not change)."""
        assert self.data is not None
        if self.data.train_x.device != device:
            self.data = self.data.to(device)
        self.device = device
        self.client_states.to(device)
        self.running.store.to(device)
        self.compression.to(device)
        self.server_state = map_state(lambda v: v.to(device), self.server_state)
        self.gatherer.place(self.data, device)
        self.compile.place(device, self.batching)
        self.ctx = self.make_context()

    def global_params(self) -> Params:
        """The global model's trainable parameters ``θ`` (detached): what every algorithm trains, sends and stores.
        Frozen parameters (``requires_grad=False``) are left out (:mod:`lightning_fedmeta.client.trainable`); once
        the model is bound, a changed trainable set raises ``RuntimeError``."""
        assert self.model is not None
        if self.trainable is None or self.model is not self._bound_model:  # not bound yet
            return trainable_parameters(self.model)
        return self.trainable.params(self.model)

    def records(self, clients: Tensor, device: torch.device | None = None) -> ClientRecord:
        """The stacked :class:`ClientRecord` of the given clients (on the engine's device)."""
        return self.federation.records(clients, self.device if device is None else device)

    def loop_seeds(self, tag: str, round_idx: int, clients: Tensor) -> list[int] | None:
        """Per-client seeds of the global RNG for looped clients (dropout); the batched path draws nothing."""
        return loop_seeds(self.seed, self.batching, tag, round_idx, clients)

    def starting_buffers(self, clients: Tensor) -> dict[str, Tensor]:
        """The BatchNorm statistics each listed client starts from (its own once it trained)."""
        assert self.model is not None and self.federation.seen is not None
        return self.running.starting(clients, self.federation.seen, self.model, self.device)

    # ------------------------------------------------------------------------------------------
    # the round's phases
    # ------------------------------------------------------------------------------------------
    def _client_fn(self, params: Params, server_state: dict[str, Tensor], batches: Batch, state: dict[str, Tensor],
                   record: ClientRecord, buffers: dict[str, Tensor]) -> tuple[ClientOutput, dict[str, Tensor]]:
        """One client's local procedure, and its running statistics after it (:func:`~lightning_fedmeta.loop.
        clients.client_step`)."""
        return client_step(self.algorithm, self.ctx, params, server_state, batches, state, record, buffers)

    def _poison_labels(self, batches: Batch, local: Tensor) -> None:
        """Data poisoning (``byzantine.attack = label_flip``): the Byzantine clients' labels flipped in place."""
        attack = self.reliability.byzantine
        if attack is None or attack.attack != "label_flip":
            return
        flipped = self.federation.is_byzantine(local).to(batches.y.device)
        if bool(flipped.any()):
            assert self.data is not None and self.data.num_classes is not None
            batches.y[flipped] = flip_labels(batches.y[flipped], int(self.data.num_classes))

    def compute(self, round_idx: int, stream: bool = False) -> RoundResult | None:
        """Phases 1–3: the round's clients run their local procedures (all ranks combined); ``None`` when no
        sampled client answers. With ``stream`` (:meth:`streams_round`) the updates are summed chunk by chunk
        (:class:`~lightning_fedmeta.loop.streaming.DeltaSum`) and the result holds ``Σ w_i Δ_i`` as one row.

        Under ``local_epochs`` the clients take different numbers of steps ``s_c``: they run in the groups of
        :attr:`schedule` (:mod:`~lightning_fedmeta.loop.schedule`), each group's batches drawn with its longest
        ``s_c`` as the step axis, and the outputs are put back in the round's client order."""
        sampled = self.federation.round_clients(round_idx)
        if sampled.numel() == 0:
            return None
        positions = self.ranks.share(sampled.numel())
        local = sampled[positions] if positions.numel() else sampled[:1]
        plan = self.algorithm.round_plan()
        steps = self.round_steps(round_idx, sampled, plan)
        local_steps = steps[positions] if positions.numel() else steps[:1]
        if plan.epochs is None:
            groups = [torch.arange(local.numel())]
        else:
            if self.schedule.needs_cost(self.batching):
                self.schedule.cost = self.measure_step_cost(local.numel(), plan.batch_size, self._broadcast)
            groups = self.schedule.groups(local_steps, self.batching, self.training_chunk)
        usual = sampled.numel() if self.training_chunk is None else min(sampled.numel(), self.training_chunk)
        self.compile.for_training(compact=self.schedule.compacts and plan.epochs is not None, usual_clients=usual)
        if self.compile.deciding(self.batching):
            self._round_programs = self._programs_needed(groups)
        weights = self.federation.weights(sampled, self.device)
        summed = DeltaSum(weights, lambda at, chunk: self._check_chunk(round_idx, sampled[at], chunk)) \
            if stream else None
        parts = [self._run_group(round_idx, local[g], local_steps[g], plan,
                                 None if summed is None else summed.for_positions(g)) for g in groups]
        out, buffers = parts[0] if len(parts) == 1 else regroup(parts, groups)
        out, buffers = self.ranks.combine((out, buffers), positions, sampled.numel())
        if summed is not None:
            out = summed.output(out)
        elif "client_update" not in self.validated:  # once: later rounds cost nothing
            self._validate(out, sampled.numel())
        out, residual = self.compression.compress(out, sampled, self.seed, round_idx, self.batching)
        result = RoundResult(round_idx, sampled, out, weights, steps, buffers, residual, delta_summed=stream)
        self._last = result
        return result

    def _programs_needed(self, groups: list[Tensor]) -> int:
        """How many compiled programs per primitive this round's batched calls would use: the distinct bucket sizes
        (:func:`~lightning_fedmeta.client.compiled.client_buckets`) of its vmap calls (the "auto" compile decision's
        cost;
        under ``"compacted"`` the calls shrink as clients finish: every size up to the chunk counts)."""
        chunk = self.training_chunk
        sizes: set[int] = set()
        for g in groups:
            n = g.numel()
            calls = [n] if chunk is None else [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])
            for size in calls:
                sizes.update(range(1, size + 1) if self.schedule.compacts else [size])
        whole = self.compile.compiler.whole_sizes
        return len({piece for size in sizes for piece in client_buckets(size, whole)})

    def _validate(self, out: ClientOutput, num_clients: int) -> None:
        """The client-output contract, checked on the first output of a run (later rounds cost nothing)."""
        validate_client_output(self.algorithm, out, self.global_params(), self.client_states.tensors, num_clients,
                               strict_dtypes=not torch.is_autocast_enabled(self.device.type))
        self.validated.add("client_update")

    def _check_chunk(self, round_idx: int, clients: Tensor, out: ClientOutput) -> None:
        """A streamed chunk's outputs, before its updates are summed: the contract (first chunk of a run) and
        finiteness, naming the client, as the stacked path checks them."""
        if "client_update" not in self.validated:
            self._validate(out, clients.numel())
        assert self.data is not None
        check_outputs_finite(RoundResult(round_idx, clients, out, torch.zeros(0), torch.zeros(0)),
                             self.data.client_names, self.algorithm)

    def streams_round(self) -> bool:
        """Whether :meth:`run_round` streams the aggregate (:attr:`stream_aggregate` and
        :func:`~lightning_fedmeta.loop.streaming.streams`)."""
        return self.stream_aggregate and self.nonfinite == "raise" and streams(
            self.algorithm, self.pipeline, self.compression, self.ranks)

    def round_steps(self, round_idx: int, clients: Tensor, plan: BatchPlan) -> Tensor:
        """``s_c``, the local steps each listed client takes this round: ``E·⌈n_c/B⌉`` under ``local_epochs``
        (:func:`~lightning_fedmeta.client.sampling.plan_steps`), else its budget (``local_steps_dist``) or the
        plan's."""
        if plan.epochs is not None:
            counts = self.federation.counts[clients.cpu()]
            return plan_steps(counts, plan)
        return self.federation.round_steps(round_idx, clients, plan.steps)

    def _run_group(self, round_idx: int, clients: Tensor, steps: Tensor, plan: BatchPlan,
                   reduce: Callable[[Any, slice], Any] | None = None) -> Any:
        """``client_update`` of the listed clients, looped or batched (chunks of :attr:`client_chunk_size`):
        their batches (steps beyond a straggler's budget emptied), poisoned labels, states, records and BN
        statistics. Returns ``(outputs, buffers)`` stacked in the order of ``clients`` (each chunk's outputs
        passed through ``reduce`` first, when given)."""
        batches = self.gatherer.batches("train", round_idx, clients, plan)
        if self.reliability.budget is not None:  # stragglers: their steps beyond the budget see empty batches
            mask_missing_steps(batches.mask, steps)
        self._poison_labels(batches, clients)
        states = self.client_states.gather(clients)
        seeds = self.loop_seeds("dropout", round_idx, clients)
        return run_client_updates(
            self.algorithm, self.ctx, (self.compression.download(self.global_params()), self.server_state),
            (batches, states, self.records(clients), self.starting_buffers(clients)),
            clients.numel(), self.batching, self.training_chunk, seeds, reduce,
        )

    def use_secret(self, key: bytes | None) -> None:
        """Draw DP's noise and cohort from the secret ``key`` (``model.dp.secure_mode``; the same key on every
        rank), or from the seed again (``None``)."""
        self.draws = None if key is None else SecretDraws(key)
        self.federation.cohort_draws = self.draws

    def server_context(self, round_idx: int, clients: Tensor, steps: Tensor, clip: float = math.inf) -> ServerContext:
        """What the server stages may read about a round besides its uploads."""
        return ServerContext(
            algorithm=self.algorithm, params=self.global_params(), server_state=self.server_state,
            records=self.records(clients), seed=self.seed, round_idx=round_idx,
            byzantine=self.federation.is_byzantine(clients), steps=steps,
            cohort=self.federation.num_sampled, clip=clip,
            assumed_byzantine=self.reliability.assumed_byzantine(self.federation.num_sampled),
            draws=self.draws, release_idx=self.federation.round_offset + round_idx,
            expected_answers=None if self.reliability.dp is None else
            self.answer_rate() if self.answer_rate is not None else self.federation.expected_answers(),
        )

    def combine(self, result: RoundResult, clip: float = math.inf) -> Uploads | None:
        """Phase 4: the server pipeline on the round's uploads (``None``: a stage skipped the round)."""
        ctx = self.server_context(result.round_idx, result.clients, result.steps, clip)
        statistics = None
        if result.buffers and self.pipeline.statistics == "pipeline":
            assert self.model is not None
            statistics = published_statistics_rows(result.buffers, self.model)
        # a streamed round's output holds Σ w_i Δ_i as one row: the default aggregate of it with weight 1 is itself
        weights = torch.ones(1, device=result.weights.device) if result.delta_summed else result.weights
        uploads = self.pipeline.run(Uploads(result.output, weights, statistics=statistics), ctx)
        if uploads is not None and "aggregate" not in self.validated:  # once: later rounds cost nothing
            assert uploads.update is not None
            validate_aggregate_output(self.algorithm, (uploads.update.delta, uploads.update.server_state),
                                      ctx.params, self.server_state,
                                      strict_dtypes=not torch.is_autocast_enabled(self.device.type))
            self.validated.add("aggregate")
        return uploads

    def commit(self, result: RoundResult, server_state: dict[str, Any], statistics: Tensor | None = None) -> None:
        """Phase 6 (after the server step): the clients' new state, the server state, BN statistics, ``seen``.

        The clients keep their own BN statistics; the model's become their weighted mean, or ``s + statistics``
        when the server pipeline formed them (DP, robust rules), or stay as they are (``model.dp.batchnorm:
        local``)."""
        assert self.model is not None
        if self.holds_client_state:
            self.client_states.scatter(result.clients, result.output.state)
        self.compression.commit(result.clients, result.residual)
        self.server_state = server_state
        if result.buffers:
            if self.pipeline.statistics == "mean":
                self.running.commit(result.clients, result.buffers, result.weights, self.model)
            else:
                self.running.store.scatter(result.clients, result.buffers)
                if statistics is not None:
                    publish_statistics(self.model, list(result.buffers), statistics)
        self.federation.mark_seen(result.clients)

    def commit_output(self, clients: Tensor, output: ClientOutput, server_state: dict[str, Any]) -> None:
        """:meth:`commit` for the ``(clients, output)`` of the last :meth:`compute` (its BN statistics included
        when it is that round's)."""
        last = self._last
        same = last is not None and last.output is output and torch.equal(last.clients, clients)
        buffers = last.buffers if same and last is not None else {}
        weights = last.weights if same and last is not None else self.federation.weights(clients, self.device)
        self.commit(RoundResult(-1, clients, output, weights, torch.zeros(0), buffers), server_state)
        self._last = None

    def run_round(self, round_idx: int, optimizer: Any, *, clip: Tensor | None = None,
                  rounds_left: int | None = None, broadcast: Callable[[Any], Any] | None = None) -> RoundReport:
        """The whole round: the client half (:meth:`compute`, its outputs checked by :meth:`finite_result`), the
        traffic count, then the server half (:meth:`serve`). ``clip`` is the DP clipping norm (a tensor the
        adaptive rule updates in place); ``rounds_left`` and ``broadcast`` serve ``compile_clients="auto"``."""
        assert self.model is not None and self.data is not None
        self._broadcast = broadcast
        deciding = self.compile.deciding(self.batching)
        started = time.perf_counter()
        result = self.compute(round_idx, stream=self.streams_round())
        if result is not None and deciding:
            self.compile.observe(rounds_left, time.perf_counter() - started, broadcast, self._round_programs)
        if result is not None and not result.delta_summed:  # a streamed round checked each chunk before summing it
            result = self.finite_result(result)
        traffic = self.count_traffic(round_idx, result)
        report = replace(self.serve(round_idx, result, optimizer, clip=clip), traffic=traffic)
        if report.skipped is not None:
            rank_zero_info(f"[lightning_fedmeta] round {round_idx}: {report.skipped}; the model is unchanged")
        elif report.clients.numel() == 0:
            rank_zero_info(f"[lightning_fedmeta] round {round_idx}: no sampled client answered; the DP noise is "
                           "released all the same")
        return report

    def finite_result(self, result: RoundResult) -> RoundResult | None:
        """The round's outputs under :attr:`nonfinite`: unchanged when every client's loss, update, extras and state
        are finite; else ``"raise"``: ``FloatingPointError`` naming the first such client; ``"drop"``: the result
        without those clients, weights renormalised over the others (``None`` when none is left)."""
        assert self.data is not None
        if self.nonfinite == "raise":
            check_outputs_finite(result, self.data.client_names, self.algorithm)
            return result
        keep = finite_clients(result)
        if bool(keep.all()):
            return result
        dropped = result.clients[~keep.to(result.clients.device)].tolist()
        named = "some clients" if self.draws is not None else f"clients {dropped}"  # secure_mode: cohorts secret
        rank_zero_info(f"[lightning_fedmeta] round {result.round_idx}: {named} produced a non-finite loss or update "
                       "and are left out of the round (RoundEngine.nonfinite = 'drop')")
        if not bool(keep.any()):
            return None
        kept = self._kept(result, keep)
        self._last = kept
        return kept

    def _kept(self, result: RoundResult, keep: Tensor) -> RoundResult:
        """``result`` restricted to the clients where ``keep`` holds, their weights renormalised."""
        from torch.utils._pytree import tree_map

        def rows(t: Tensor) -> Tensor:
            return t[keep.to(t.device)]

        clients = rows(result.clients)
        return RoundResult(
            result.round_idx, clients, ClientOutput(*(tree_map(rows, tree) for tree in result.output)),
            self.federation.weights(clients, result.weights.device), rows(result.steps),
            {k: rows(v) for k, v in result.buffers.items()},
            None if result.residual is None else {k: rows(v) for k, v in result.residual.items()},
        )

    def serve(self, round_idx: int, result: RoundResult | None, optimizer: Any, *,
              clip: Tensor | None = None) -> RoundReport:
        """The server half of round ``round_idx`` on the clients' checked outputs (``None``: nobody answered):
        combine → step → commit → report. A DP round nobody answered still releases its noise
        (:meth:`_noise_only`); a round nobody answered without DP, one a stage skips (too few clients for a robust
        rule) and, under ``nonfinite = "drop"``, one whose aggregate is not finite change nothing
        (:meth:`_skip`; the report says why). ``clip`` is the DP clipping norm, updated in place by adaptive
        clipping."""
        assert self.model is not None
        if result is None and self.reliability.dp is not None:
            return self._noise_only(round_idx, optimizer, clip)
        if result is None:
            return self._skip(optimizer, round_idx, "no sampled client answered")
        uploads = self.combine(result, math.inf if clip is None else float(clip))
        if uploads is None:
            rule, f = self.reliability.aggregator, self.reliability.assumed_byzantine(self.federation.num_sampled)
            return self._skip(optimizer, round_idx, f"only {result.clients.numel()} clients answered, too few for "
                              f"model.aggregator {rule.name!r} with f={f}")
        assert uploads.update is not None
        try:
            check_update_finite(round_idx, uploads.update.delta)
        except FloatingPointError as exc:
            if self.nonfinite == "raise":
                raise
            return self._skip(optimizer, round_idx, str(exc))
        apply_server_step(optimizer, self.model, uploads.update.delta)
        self.commit(result, uploads.update.server_state, uploads.update.statistics)
        if clip is not None and uploads.privacy is not None and uploads.privacy.next_clip is not None:
            clip.fill_(uploads.privacy.next_clip)  # adaptive clipping: C for the next round
        return RoundReport(round_idx, result.clients, weighted_mean_metrics(result.output.metrics, result.weights),
                           uploads.privacy)

    def count_traffic(self, round_idx: int, result: RoundResult | None) -> RoundTraffic:
        """The round's bytes (docs/communication.md), added to the cumulative sums: every candidate of the round
        downloads :meth:`~lightning_fedmeta.algorithms.base.Algorithm.download`; the clients that answered (those
        in ``result``) upload :meth:`~lightning_fedmeta.algorithms.base.Algorithm.upload`, compressed as
        ``model.compression`` asks (:attr:`upload_compression` when the clients compress themselves). Call it
        before the server step (the download is the round's starting model)."""
        candidates = self.federation.round_candidates(round_idx)
        answered = torch.isin(candidates, result.clients.cpu()) if result is not None else \
            torch.zeros(candidates.numel(), dtype=torch.bool)
        first = ClientRecord(*(t[0] for t in self.records(candidates[:1]))) if candidates.numel() else None
        spec = self.compression.spec if self.compression.spec is not None else self.upload_compression
        traffic = round_traffic(self.algorithm, self.global_params(), self.server_state, first, candidates, answered,
                                None if result is None else result.output, self.codec, spec)
        self.traffic.add(traffic)
        return traffic

    def _noise_only(self, round_idx: int, optimizer: Any, clip: Tensor | None) -> RoundReport:
        """A DP round no client answered: the mechanism still releases its noise, ``Δ = (σC/m) ξ`` (an empty sum
        plus noise), and adaptive clipping still updates ``C``, so the published model is the mechanism's output
        whoever took part (skipping would reveal an empty cohort, which the accountant does not cover)."""
        assert self.model is not None
        nobody = torch.zeros(0, dtype=torch.long)
        ctx = self.server_context(round_idx, nobody, nobody, math.inf if clip is None else float(clip))
        published = self.pipeline.statistics == "pipeline"
        size = published_statistics_size(self.model, self.running.names) if published else 0
        noised = noise_only_uploads(self.pipeline, ctx, size)
        assert noised.update is not None
        apply_server_step(optimizer, self.model, noised.update.delta)
        if noised.update.statistics is not None:
            publish_statistics(self.model, self.running.names, noised.update.statistics)
        if clip is not None and noised.privacy is not None and noised.privacy.next_clip is not None:
            clip.fill_(noised.privacy.next_clip)
        return RoundReport(round_idx, torch.zeros(0, dtype=torch.long), privacy=noised.privacy)

    def _skip(self, optimizer: Any, round_idx: int, reason: str) -> RoundReport:
        """A round that changes nothing (no client marked as trained); the optimizer still steps (no gradients)."""
        assert self.model is not None
        skip_server_step(optimizer, self.model)
        return RoundReport(round_idx, torch.zeros(0, dtype=torch.long), skipped=reason)

    # ------------------------------------------------------------------------------------------
    # one client's personalised model
    # ------------------------------------------------------------------------------------------
    def personal_inputs(self, client: int, round_idx: int) -> tuple[Batch, dict[str, Tensor], ClientRecord,
                                                                    dict[str, Tensor]]:
        """A federation client's adaptation batches, state, record and BN statistics (unstacked), as the
        evaluation at ``round_idx`` uses them."""
        clients = torch.tensor([client])
        adapt = self.gatherer.batches("adapt", round_idx, clients, self.algorithm.eval_plan())
        states = self.client_states.gather(clients)
        record = self.records(clients)
        buffers = {k: v[0] for k, v in self.starting_buffers(clients).items()}
        return (Batch(adapt.x[0], adapt.y[0], adapt.mask[0]), map_state(lambda v: v[0], states),
                ClientRecord(*(t[0] for t in record)), buffers)

    # ------------------------------------------------------------------------------------------
    # state
    # ------------------------------------------------------------------------------------------
    def state_dict(self, round_idx: int) -> dict[str, Any]:
        """Each part's state under its own key: the client state (a disk store writes the rows changed since its last
        checkpoint as a segment and returns a manifest), BN statistics, server state, the federation's ``seen``, the
        compile decision, the step schedule's cost, top-k residuals (when kept) and the byte counts."""
        state = {
            "client_state": self.client_states.checkpoint_state(round_idx),
            "client_buffers": self.running.store.state_dict(),
            "server_state": {k: v.detach().cpu().clone() for k, v in flatten_state(self.server_state).items()},
            "federation": self.federation.state_dict(),
            "compile": self.compile.state_dict(),
            "schedule": self.schedule.state_dict(),
            "traffic": self.traffic.state_dict(),
        }
        if self.compression.keeps_residual:
            state["compression_residual"] = self.compression.checkpoint_state(round_idx)
        return state

    def _run_clients(self, saved: dict[str, Any]) -> int | None:
        """The run's own number of clients, which a disk store's manifest must name: the data's when it is bound
        (the resume checks refuse a checkpoint whose ``seen`` flags differ), else the checkpoint's ``seen`` flags
        (a tensor the file holds, so its size bounds the count); ``None`` for a checkpoint with neither."""
        if self.data is not None:
            return int(self.data.num_clients)
        seen = (saved.get("federation") or {}).get("seen")
        return int(seen.numel()) if isinstance(seen, Tensor) else None

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s parts, each from its own key (the flat layout of earlier releases is
        migrated before: :func:`~lightning_fedmeta.frontends.checkpoint_layout.per_part_layout`)."""
        clients = self._run_clients(saved)
        self.client_states = restore_client_store(saved["client_state"], self.store, self.client_states, clients)
        self.running.store.load_state_dict(saved.get("client_buffers") or {})
        self.server_state = unflatten_state({k: v.clone() for k, v in saved["server_state"].items()})
        federation = saved.get("federation") or {}
        if federation.get("seen") is None:  # a checkpoint from before client records: who trained is not known
            rank_zero_warn(
                "this checkpoint predates client records (no 'seen' flags): every client is treated as not "
                "trained yet, so personal models are read as the global model until a client trains again"
            )
        self.federation.load_state_dict(federation)
        self.compile.load_state_dict(saved.get("compile") or {})
        self.schedule.load_state_dict(saved.get("schedule") or {})
        self.compression.load_state_dict(saved.get("compression_residual"), self.store, clients)
        self.traffic.load_state_dict(saved.get("traffic"))
        if self.data is not None:
            self.gatherer.reset()
