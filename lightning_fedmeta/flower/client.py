"""One client of a deployment: its data, and the algorithm's functional round and evaluation on it.

What the in-process loop computes for client ``c`` in round ``r`` (the engine's client half, docs/design.md
contracts 1, 2 and 9) is computed here from the node's own data alone, by the same functions
(:mod:`lightning_fedmeta.loop.clients`, :class:`~lightning_fedmeta.loop.gather.BatchGatherer` on the partition):

    batches  = draw_batch_indices(seed, "train", r, c, plan = algorithm.round_plan())   pure in (seed, r, c)
    state    = the client's state after its last aggregated round (ClientStateFile), or the initial state
               algorithm.init_client_states(w0, population)[c] before its first one
    s_c      = its BatchNorm running statistics after that round (kept in the same file), or the model's
               published ones before its first round
    out, s_c = client_update(ctx with s_c, w, batches, state, σ, record_c)             (run_client_updates)

The record (index ``c`` = partition id, weight ``p_c`` over the training clients, held out, seen, ``n_c``) and the
client's view of the population (:func:`population_view`: ``K``, the largest training-set size and its own label
histogram; for ``bind_clients`` and the initial states) come from the server, which learned every client's size
and histogram at start-up and tells no client another's size, histogram, weight or held-out flag. Full-batch plans pad
to the largest client's size, as the in-process loop does. The evaluation is ``FederatedModule._eval_fn``'s:
``personalize`` on the ``"adapt"`` draws, then masked sums of the loss and of each built-in metric on the client's
test set.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fedmeta.algorithms.base import Algorithm, ClientOutput, ClientRecord
from lightning_fedmeta.client.batchnorm_stats import prepare_model
from lightning_fedmeta.client.execution import choose_batching
from lightning_fedmeta.client.functional import Batch, ClientContext, Params
from lightning_fedmeta.client.losses import LOSSES, resolve_loss
from lightning_fedmeta.data.federated import FederatedData, from_client_tensors
from lightning_fedmeta.evaluation.metrics import BUILTIN_METRICS, DEFAULT_METRICS
from lightning_fedmeta.evaluation.scoring import score_client
from lightning_fedmeta.flower.config import DeploymentConfig, import_object, load_config
from lightning_fedmeta.loop.clients import loop_seeds, run_client_updates
from lightning_fedmeta.loop.gather import BatchGatherer
from lightning_fedmeta.persistence.memory_store import map_state

__all__ = ["NODE_SETTINGS", "STATISTICS", "LocalClient", "client_for", "data_spec_of", "load_partition",
           "node_setting", "partition_of", "population_view"]

#: the key of the node's BatchNorm running statistics in its state file (next to the algorithm's state)
STATISTICS = "bn-statistics"

#: settings only the node's owner chooses (node config): where its data comes from and whether its personal state
#: leaves the node. A run config (written by whoever starts the run) naming them is ignored, with a warning.
NODE_SETTINGS = ("client-data", "upload-client-state")

logger = logging.getLogger("flwr")
_warned: set[str] = set()


def node_setting(node_config: dict[str, Any], run_config: dict[str, Any], key: str, default: Any) -> Any:
    """Node config ``key`` (``default`` when absent). The run config's value is never used: the node's data
    source and what leaves the node are the node owner's choice, not the run's (docs/security.md); it is
    ignored with a warning (once per process) saying where to set it instead."""
    if key in run_config and key not in _warned:
        _warned.add(key)
        logger.warning(f"[fedmeta] run config {key} = {run_config[key]!r} is ignored: {key} is the node owner's "
                       f"choice; set it in the SuperNode's node config (--node-config \"{key}=...\")")
    return node_config.get(key, default)


def partition_of(node_config: dict[str, Any]) -> tuple[int, int]:
    """``(partition-id, num-partitions)`` from a SuperNode's node config, checked."""
    pid, num = node_config.get("partition-id"), node_config.get("num-partitions")
    if pid is None:
        raise ValueError(
            "node config partition-id is missing: start the SuperNode with "
            "--node-config \"partition-id=<i> num-partitions=<K>\""
        )
    if num is None:
        raise ValueError("node config num-partitions is missing: start the SuperNode with "
                         "--node-config \"partition-id=<i> num-partitions=<K>\"")
    if isinstance(pid, bool) or not isinstance(pid, int) or isinstance(num, bool) or not isinstance(num, int):
        raise ValueError(f"node config partition-id and num-partitions must be integers, got {pid!r} and {num!r}")
    if num < 1:
        raise ValueError(f"node config num-partitions must be >= 1, got {num}")
    if not 0 <= pid < num:
        raise ValueError(f"node config partition-id = {pid} is out of range for num-partitions = {num} "
                         f"(0 <= partition-id < {num})")
    return pid, num


def _one_client(data: FederatedData, i: int) -> FederatedData:
    """Client ``i`` of ``data`` as a federation of one (its name and the dataset's classes kept)."""
    trx, try_ = data.client_train(i)
    tex, tey = data.client_test(i)
    return from_client_tensors([(trx, try_, tex, tey)], data.num_classes, [data.client_names[i]], data.task)


@functools.lru_cache(maxsize=4)
def _federation(config_path: str) -> FederatedData:
    cfg = load_config(config_path)
    dm = cfg.datamodule()
    dm.prepare_data()
    dm.setup("fit")
    assert dm.federated_data is not None
    return dm.federated_data


def load_partition(
    cfg: DeploymentConfig, partition_id: int, num_partitions: int, hook: str | None = None
) -> FederatedData:
    """The node's data as a federation of one client.

    Without ``hook``: client ``partition_id`` of the config's :class:`~lightning_fedmeta.FederatedDataModule`
    (``data.*``; its ``num_clients`` must equal ``num-partitions``). With ``hook`` (``package.module:function``
    or ``package.module.function``): ``function(partition_id, num_partitions)`` returning the node's
    ``(train_x, train_y, test_x, test_y)`` or a one-client :class:`~lightning_fedmeta.data.FederatedData`.
    """
    if hook:
        fn = import_object(hook, "client-data")
        if not callable(fn):
            raise ValueError(f"client-data = {hook!r} is not callable")
        got = fn(partition_id, num_partitions)
        if isinstance(got, FederatedData):
            if got.num_clients != 1:
                raise ValueError(f"client-data = {hook!r} returned {got.num_clients} clients; return this node's one")
            return got
        if not isinstance(got, tuple | list) or len(got) != 4:
            raise ValueError(f"client-data = {hook!r} must return (train_x, train_y, test_x, test_y) or a "
                             f"one-client FederatedData, got {type(got).__name__}")
        return from_client_tensors([tuple(got)], _num_classes_from(cfg))  # type: ignore[arg-type]
    data = _federation(cfg.path)
    if data.num_clients != num_partitions:
        raise ValueError(
            f"node config num-partitions = {num_partitions} but the config's data has {data.num_clients} clients "
            f"(data.num_clients in {cfg.path}); they must match"
        )
    return _one_client(data, partition_id)


def _num_classes_from(cfg: DeploymentConfig) -> int | None:
    """The classes of a hook's data: ``model.model.init_args.num_classes`` when the config names them."""
    spec = cfg.model_spec
    if isinstance(spec, dict):
        n = (spec.get("init_args") or {}).get("num_classes")
        if isinstance(n, int):
            return n
    return None


def data_spec_of(data: FederatedData) -> dict[str, Any]:
    """The data's shapes and task, as ``FederatedModule`` records them (``_data_spec``)."""
    return {
        "input_shape": list(data.input_shape), "num_classes": data.num_classes, "task": data.task,
        "target_shape": list(data.target_shape),
    }


def population_view(record: ClientRecord, num_clients: int, largest: int,
                    own_label_counts: Tensor) -> tuple[ClientRecord, Tensor]:
    """The population as client ``c = record.index`` is told it, for ``bind_clients`` and ``init_client_states``:
    ``K = num_clients`` rows; its own row holds its record and label histogram (``own_label_counts``, ``[C]`` or
    ``[1, C]``); every other row has weight 0, no held-out flag, a zero histogram and the size ``largest``, the
    largest training set (full-batch plans and MOCHA's dual variables are padded to it, so ``max`` of the sizes is
    the population's, the one statistic of other clients a client's computation may use).

    A client's own computations read only its own row and that maximum (``check_population_view`` of
    :mod:`lightning_fedmeta.testing` checks it for every registered algorithm), so the view gives the numbers the
    full population gives, and a message carries ``O(C)`` numbers, not ``O(K·C)``: a node learns no other client's
    size, weight, held-out flag or class distribution (docs/security.md)."""
    c = int(record.index)
    own = own_label_counts.reshape(-1)
    weight = torch.zeros(num_clients, dtype=record.weight.dtype)
    weight[c] = record.weight
    is_new = torch.zeros(num_clients, dtype=torch.bool)
    is_new[c] = record.is_new
    sizes = torch.full((num_clients,), int(largest), dtype=torch.long)
    sizes[c] = record.num_samples
    labels = torch.zeros((num_clients, own.numel()), dtype=own.dtype)
    labels[c] = own
    view = ClientRecord(index=torch.arange(num_clients), weight=weight, is_new=is_new,
                        seen=torch.zeros(num_clients, dtype=torch.bool), num_samples=sizes)
    return view, labels


class LocalClient:
    """The algorithm's client procedures on one node's data (``data``: a federation of one client)."""

    def __init__(self, cfg: DeploymentConfig, data: FederatedData, partition_id: int) -> None:
        self.cfg = cfg
        self.data = data
        self.partition_id = int(partition_id)
        self.algorithm: Algorithm = cfg.algorithm()
        self.model: nn.Module = cfg.build_model(data_spec_of(data))
        #: the BatchNorm running statistics (functional, per client: the node keeps its own, as the engine does)
        self.statistics_names = prepare_model(self.model)
        loss = cfg.module_options.get("loss")
        if loss is None and callable(getattr(self.model, "federated_loss", None)):
            loss = self.model.federated_loss
        if isinstance(loss, str) and loss not in LOSSES:
            loss = import_object(loss, "model.loss")
        self.per_sample_loss = resolve_loss(loss, str(data.task))
        self.batching, _ = choose_batching(self.model, cfg.module_options.get("client_batching", "auto"))
        if self.batching == "vmap" and not type(self.algorithm).batchable:
            self.batching = "loop"
        self.ctx = ClientContext(self.model, dict(self.model.named_buffers()), per_sample_loss=self.per_sample_loss)
        metrics = cfg.module_options.get("metrics") or DEFAULT_METRICS[str(data.task)]
        self.metric_names = {key: BUILTIN_METRICS[name] for key, name in dict(metrics).items()}
        self._bound: Any = None
        self.gatherer = BatchGatherer(data, cfg.seed, torch.device("cpu"), clients=torch.tensor([self.partition_id]))

    # -- the population --------------------------------------------------------------------------
    def bind(self, population: ClientRecord, label_counts: Tensor) -> None:
        """``algorithm.bind_clients`` with every client's record, as ``FederatedModule.attach_data`` calls it."""
        key = (tuple(population.num_samples.tolist()), tuple(population.weight.tolist()),
               tuple(population.is_new.tolist()), tuple(label_counts.reshape(-1).tolist()))
        if self._bound != key:
            self.algorithm.bind_clients(population, label_counts)
            self._bound = key

    def initial_state(self, init_params: Params, population: ClientRecord) -> dict[str, Any]:
        """This client's row of ``algorithm.init_client_states(w0, population)`` (the module's store at setup)."""
        states = self.algorithm.init_client_states(init_params, population)
        return map_state(lambda v: v[self.partition_id].clone(), states)

    # -- one round ---------------------------------------------------------------------------------
    def _seeds(self, tag: str, round_idx: int) -> list[int] | None:
        return loop_seeds(self.cfg.seed, self.batching, tag, round_idx, torch.tensor([self.partition_id]))

    def train(self, round_idx: int, params: Params, server_state: dict[str, Any], state: dict[str, Any],
              record: ClientRecord, width: int,
              statistics: dict[str, Tensor] | None = None) -> tuple[ClientOutput, dict[str, Tensor]]:
        """``client_update`` for round ``round_idx``, unstacked (one client), as the engine's client half runs it
        (:func:`~lightning_fedmeta.loop.clients.run_client_updates`), from the BatchNorm ``statistics`` the client
        starts from; returns its output and its statistics after the round (``{}`` without BatchNorm)."""
        self._check_record(record)
        statistics = self._statistics(statistics)
        clients = torch.tensor([self.partition_id])
        batches = self.gatherer.batches("train", round_idx, clients, self.algorithm.round_plan(), width)
        stacked, buffers = run_client_updates(
            self.algorithm, self.ctx, (params, server_state),
            (batches, map_state(lambda v: v.unsqueeze(0), state), ClientRecord(*(t.reshape(1) for t in record)),
             {k: v.unsqueeze(0) for k, v in statistics.items()}),
            1, self.batching, None, self._seeds("dropout", round_idx),
        )
        return (ClientOutput(*(map_state(lambda v: v[0], tree) for tree in stacked)),
                {k: v[0] for k, v in buffers.items()})

    def _statistics(self, statistics: dict[str, Tensor] | None) -> dict[str, Tensor]:
        """The statistics a round starts from, checked against the model's BatchNorm buffers."""
        statistics = dict(statistics or {})
        if sorted(statistics) != sorted(self.statistics_names):
            raise ValueError(f"the BatchNorm statistics given ({sorted(statistics)}) are not the model's running "
                             f"statistics ({sorted(self.statistics_names)})")
        return statistics

    def evaluate(self, round_idx: int, params: Params, server_state: dict[str, Any], state: dict[str, Any],
                 record: ClientRecord, width: int, statistics: dict[str, Tensor] | None = None) -> dict[str, float]:
        """The personalised evaluation (:func:`~lightning_fedmeta.evaluation.scoring.score_client`, as the
        simulator scores a client, with the client's BatchNorm ``statistics``): ``total``, ``loss_sum`` and
        ``<metric>_sum`` for each built-in metric."""
        self._check_record(record)
        statistics = self._statistics(statistics)
        clients = torch.tensor([self.partition_id])
        adapt = self.gatherer.batches("adapt", round_idx, clients, self.algorithm.eval_plan(), width)
        adapt = Batch(adapt.x[0], adapt.y[0], adapt.mask[0])
        ctx = self.ctx.for_client(statistics) if statistics else self.ctx
        was_training = self.model.training
        self.model.eval()
        try:
            seeds = self._seeds("eval-dropout", round_idx)
            with torch.random.fork_rng(devices=[]):
                if seeds is not None:
                    torch.manual_seed(seeds[0])
                test = Batch(self.data.test_x, self.data.test_y, torch.ones(self.data.test_y.shape[0]))
                functions = [metric.per_sample for metric in self.metric_names.values()]
                sums = score_client(ctx, self.algorithm, params, server_state, adapt, test, state, record,
                                    functions)
        finally:
            self.model.train(was_training)
        result = {"total": float(sums["total"]), "loss_sum": float(sums["loss_sum"])}
        for col, key in enumerate(self.metric_names):
            result[f"{key}_sum"] = float(sums["builtin"][col])
        return result

    def _check_record(self, record: ClientRecord) -> None:
        n = int(self.data.train_offsets[1])
        if int(record.index) != self.partition_id or int(record.num_samples) != n:
            raise ValueError(
                f"the server's record (index {int(record.index)}, {int(record.num_samples)} samples) is not this "
                f"node's partition-id {self.partition_id} with {n} training samples"
            )


def client_for(node_config: dict[str, Any], run_config: dict[str, Any]) -> LocalClient:
    """The :class:`LocalClient` of a node (cached per process: a SuperNode in ``process`` isolation reuses it)."""
    pid, num = partition_of(node_config)
    path = run_config.get("fedmeta-config")
    if not isinstance(path, str) or not path:
        raise ValueError("run config fedmeta-config (the path of the fedmeta YAML config) is missing")
    hook = node_setting(node_config, run_config, "client-data", None) or None
    return _client_for(path, pid, num, str(hook) if hook else None)


@functools.lru_cache(maxsize=8)
def _client_for(path: str, pid: int, num: int, hook: str | None) -> LocalClient:
    cfg = load_config(path)
    return LocalClient(cfg, load_partition(cfg, pid, num, hook), pid)

