"""The server of a deployment: a hand-written round loop over Flower's ``Grid`` (docs/deploy.md).

Round ``r`` (the in-process ``FederatedModule.training_step``, docs/design.md contracts 1, 3, 9 and 13):

    S       = sample_clients(seed, r, eligible, m)               pure in (seed, r): the simulator's draw
    nodes   = the SuperNodes whose node config says partition-id ∈ S (learned by a query message; a restarted
              node has a new node id and is found again)
    replies = train messages to those nodes (global w, server state σ, record_c, the state round to start from)
    A       = the clients whose reply arrived without error; a node found unavailable (restarted) gets the
              message again, on its new node id, up to max-retries times; other failures are logged and dropped
    p_A     = the aggregation weights renormalised over A (as under client_dropout, participation.py)
    result  = RoundResult(r, A, stacked outputs of A, p_A, steps, BN statistics of A)
    RoundEngine.serve(result): server pipeline (DP, robust rule or algorithm.aggregate) → server optimizer step →
              commit (σ <- σ', seen[A] <- True, the model's BN statistics as the simulation forms them)
    state-round[A] <- r; checkpoint (atomic) so a restarted ServerApp resumes at r + 1

The server half is the simulation's own (:class:`~lightning_fedmeta.loop.engine.RoundEngine`, set up by
:meth:`~lightning_fedmeta.loop.engine.RoundEngine.bind_population` from the partitions' sizes and histograms), with
``nonfinite = "drop"``: a node's non-finite reply is rejected (replies.py) and a non-finite aggregate skips the
round, so an untrusted node never stops the run. A round nobody answers changes nothing and still counts (under
``model.dp`` it releases the noise). The personalised evaluation (every ``eval_every`` rounds and after the last)
sends evaluate messages to every client and reports Σ sums / Σ test samples.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import pickle
import secrets
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
from flwr.app import ConfigRecord, Message, RecordDict
from torch import Tensor

from lightning_fedmeta.algorithms.base import ClientOutput, ClientRecord
from lightning_fedmeta.client.functional import Params
from lightning_fedmeta.client.trainable import trainable_parameters
from lightning_fedmeta.communication.accounting import TrafficCounter, sent_model
from lightning_fedmeta.communication.compressors import check_composition
from lightning_fedmeta.evaluation.fairness import flat_spread, summaries_with_spread
from lightning_fedmeta.evaluation.metrics import DEFAULT_METRICS, ClientMetrics
from lightning_fedmeta.flower.compressed import wire_bytes
from lightning_fedmeta.flower.config import DeploymentConfig, deployed_dp
from lightning_fedmeta.flower.records import client_record_to_record, sent_delta, sent_params, tree_to_record
from lightning_fedmeta.flower.replies import (
    RejectedReply,
    ReplySpec,
    check_eval_reply,
    check_query_reply,
    check_statistics_reply,
    check_train_reply,
    honest_output,
)
from lightning_fedmeta.flower.state_file import atomic_torch_save as atomic_save
from lightning_fedmeta.frontends.private_fit import continue_privacy_record
from lightning_fedmeta.loop.engine import RoundEngine
from lightning_fedmeta.loop.federation import Federation
from lightning_fedmeta.loop.round import RoundResult
from lightning_fedmeta.loop.server import ServerPipeline
from lightning_fedmeta.persistence.atomic_io import atomic_write
from lightning_fedmeta.persistence.memory_store import flatten_state, unflatten_state
from lightning_fedmeta.privacy.budget import PrivacyBudget
from lightning_fedmeta.privacy.draws import KEY_BYTES, DPDraws
from lightning_fedmeta.privacy.mechanism import hides_cohort_size
from lightning_fedmeta.reliability.options import Reliability, uploads_delta

__all__ = ["DeploymentServer", "GridLike", "NODE_UNAVAILABLE", "RETRYABLE"]

#: Flower's error code of a reply the SuperLink writes when the destination node stopped sending heartbeats
NODE_UNAVAILABLE = 5
#: the keys of a round's log entry that name or count its cohort (kept out of what is published under secure_mode;
#: a skipped round's reason may count the clients that answered)
COHORT_KEYS = ("sampled", "answered", "rejected_replies", "skipped")

#: error codes after which a message is sent again (to the partition's node, possibly a new one): the message or
#: its reply was lost (3, 4), the node went away (5), the ClientApp process died with its node (8). A ClientApp
#: that raised (2) is not retried: the client fails the round.
RETRYABLE = frozenset({3, 4, NODE_UNAVAILABLE, 8})

logger = logging.getLogger("flwr")


class GridLike(Protocol):
    """The part of ``flwr.serverapp.Grid`` the loop uses."""

    def get_node_ids(self) -> Iterable[int]: ...

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]: ...

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]: ...

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]: ...


class DeploymentServer:
    """The round loop of one deployment.

    Args:
        cfg: the fedmeta config (:func:`~lightning_fedmeta.flower.config.load_config`).
        grid: Flower's grid (or anything with ``get_node_ids`` and ``send_and_receive``).
        run_key: the key of the clients' state files (a resumed server keeps the one of its checkpoint).
        checkpoint: file written after every round (atomically); when it exists at start, the run resumes from it.
        output_dir: where ``final_params.pt`` and ``history.json`` are written after the last round.
        reply_timeout: seconds to wait for the replies of one round (``None``: until all arrive or fail).
        node_timeout: seconds to wait for every partition's node to be connected (start-up, retries).
        max_retries: how many times a message to a node found unavailable is sent again to its partition's new node.
        pull_interval: seconds between two pulls of the replies.
        poll_interval: seconds between two checks for restarted nodes while replies are awaited.
        evaluate: run the personalised evaluation (every ``data.eval_every`` rounds and after the last).
        log: where progress lines go.
        partition_sizes: every partition's number of training samples, when the operator knows them (run config
            ``partition-sizes``): a node claiming another size is refused. ``None``: each partition's first answer
            fixes its size. ``num-partitions`` (unless pinned) and the data description are what a majority of
            the nodes claim (:meth:`_decide`), never the first answer alone.
    """

    def __init__(
        self,
        cfg: DeploymentConfig,
        grid: GridLike,
        run_key: str,
        checkpoint: str | None = None,
        output_dir: str | None = None,
        reply_timeout: float | None = None,
        node_timeout: float = 300.0,
        max_retries: int = 2,
        log: Callable[[str], None] | None = None,
        pull_interval: float = 1.0,
        poll_interval: float = 5.0,
        evaluate: bool = True,
        partition_sizes: list[int] | None = None,
    ) -> None:
        self.cfg = cfg
        self.grid = grid
        self.run_key = str(run_key)
        #: this deployment's identity, kept with every client's state (state_file.py) and in the checkpoint
        self.run_token = secrets.token_hex(16)
        self.checkpoint = checkpoint
        self.output_dir = output_dir
        self.reply_timeout = reply_timeout
        self.node_timeout = float(node_timeout)
        self.max_retries = int(max_retries)
        self.pull_interval = float(pull_interval)
        self.poll_interval = float(poll_interval)
        self.evaluate_clients = bool(evaluate)
        self.log = log or (lambda text: logger.info(text))
        self.algorithm = cfg.algorithm()
        self.node_of: dict[int, int] = {}  # partition id -> node id (the newest node that reported it)
        self.known_nodes: set[int] = set()
        self.info: dict[int, dict[str, Any]] = {}  # partition id -> what its node reported
        self.sizes = None if partition_sizes is None else [int(n) for n in partition_sizes]
        self.partitions: int | None = None if self.sizes is None else len(self.sizes)  # K, once known
        self.description: dict[str, Any] | None = None  # the data description every partition shares
        self.claims: dict[int, dict[str, Any]] = {}  # node id -> its query reply, while the federation is undecided
        self.waiting: dict[int, int] = {}  # node id -> the partition it claimed while another live node held it
        self.reply_spec: ReplySpec | None = None
        self.history: list[dict[str, Any]] = []
        self.exchanged: dict[int, Message] = {}  # the last exchange's replies, before their check
        self.failures: list[dict[str, Any]] = []
        self.round = 0
        self.compression = cfg.compression()  # model.compression: the nodes compress, the server decodes
        self.engine: RoundEngine | None = None  # the simulation's server half (setup)
        self.wire = {"up": 0, "down": 0}  # the round's serialised train messages and replies
        #: under model.dp.secure_mode the cohorts are secret: no file or log line the server publishes names them
        self.secret_cohorts = False
        self.budget: PrivacyBudget | None = None  # ε of this run, continuing the checkpoint's privacy record
        self.start_round = 0  # the round this ServerApp started (or resumed) at
        self.saved_privacy: dict[str, Any] | None = None  # a resumed checkpoint's privacy record
        self.stopped: str | None = None  # why the run stopped before its last round (model.dp.target_epsilon)

    # ------------------------------------------------------------------------------------------
    # nodes
    # ------------------------------------------------------------------------------------------
    def _query(self, node_ids: list[int], live: set[int]) -> None:
        """Ask new nodes which partition they hold (a node that restarted reports its partition again). A reply
        that fails :func:`~lightning_fedmeta.flower.replies.check_query_reply` is refused and logged."""
        if not node_ids:
            return
        messages = [Message(RecordDict({"query": ConfigRecord({"what": "partition"})}), dst_node_id=n,
                            message_type="query") for n in node_ids]
        for reply in self.grid.send_and_receive(messages, timeout=self.reply_timeout):
            node = int(reply.metadata.src_node_id)
            self.known_nodes.add(node)
            if reply.has_error():
                self.log(f"[fedmeta] node {node} did not answer the query: {reply.error.reason}")
                continue
            try:
                data = check_query_reply(reply.content, self.partitions, self.sizes, self.description)
            except RejectedReply as exc:
                self.log(f"[fedmeta] node {node} refused: {exc}")
                continue
            if self.description is None:  # the federation is not decided yet: one claim among the others
                self.claims[node] = data
            else:
                self._register(node, data, live)

    def _decide(self, live: set[int]) -> None:
        """Fix ``num-partitions`` and the data description once one claim of them holds a strict majority of the
        partitions it names (distinct partition ids) and of the live nodes that answered; then register the
        nodes that agree and refuse, each by itself, those that do not. No answer decides by being first, and a
        claimed ``num-partitions`` is never allocated: a decided one is below twice the number of nodes."""
        self.claims = {n: d for n, d in self.claims.items() if n in live}
        groups: dict[str, list[int]] = {}
        for node, data in sorted(self.claims.items()):
            key = json.dumps([int(data["num-partitions"]), data["description"]], sort_keys=True, default=str)
            groups.setdefault(key, []).append(node)
        for nodes in groups.values():
            first = self.claims[nodes[0]]
            covered = {int(self.claims[n]["partition-id"]) for n in nodes}
            if 2 * len(covered) > int(first["num-partitions"]) and 2 * len(nodes) > len(self.claims):
                self.partitions, self.description = int(first["num-partitions"]), first["description"]
                break
        else:
            return
        claims, self.claims = self.claims, {}
        for node, data in sorted(claims.items()):
            if int(data["num-partitions"]) == self.partitions and data["description"] == self.description:
                self._register(node, data, live)
            else:
                self.log(f"[fedmeta] node {node} refused: it claims num-partitions {data['num-partitions']} and data "
                         f"{data['description']}; the majority of the nodes claim {self.partitions} and "
                         f"{self.description}")

    def _register(self, node: int, data: dict[str, Any], live: set[int]) -> None:
        """Give ``node`` its claimed partition, unless another live node holds it: the claim is then refused (not
        waited on) and asked again only if that node goes away (a restarted node seen before its old id ended)."""
        pid = int(data["partition-id"])
        holder = self.node_of.get(pid)
        if holder is not None and holder != node and holder in live:
            self.waiting[node] = pid
            self.log(f"[fedmeta] node {node} claims partition {pid}, which node {holder} holds: refused")
            return
        self.waiting.pop(node, None)
        self.node_of[pid] = node
        self.info[pid] = {k: v for k, v in data.items() if k != "description"}
        if holder is not None and holder != node:
            self.log(f"[fedmeta] partition {pid} is now on node {node} (was {holder}: restarted)")

    def refresh_nodes(self, wait_for: Iterable[int] = (), timeout: float | None = None) -> set[int]:
        """Query the nodes not seen before; wait (at most ``timeout`` s) until every partition in ``wait_for``
        has a live node. Returns the partitions still without one."""
        wanted = set(wait_for)
        deadline = time.monotonic() + (self.node_timeout if timeout is None else timeout)
        while True:
            live = {int(n) for n in self.grid.get_node_ids()}
            self.known_nodes &= live
            for pid in [p for p, n in self.node_of.items() if n not in live]:
                del self.node_of[pid]
            self.waiting = {n: p for n, p in self.waiting.items() if n in live}
            self.known_nodes -= {n for n, p in self.waiting.items() if p not in self.node_of}  # ask again
            self._query(sorted(live - self.known_nodes), live)
            if self.description is None:  # the claims so far (of the nodes still live) may now agree
                self._decide(live)
            missing = wanted - set(self.node_of)
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.5)

    def discover(self) -> None:
        """Wait until all ``num-partitions`` partitions are connected, and learn their sizes."""
        self.refresh_nodes()
        deadline = time.monotonic() + self.node_timeout
        while self.partitions is None or len(self.info) < self.partitions:
            if time.monotonic() >= deadline:
                undecided = "" if self.description is not None else (
                    f"; no num-partitions and data description is claimed yet by a majority of the {len(self.claims)} "
                    "nodes that answered and of the partitions it names")
                raise TimeoutError(
                    f"only partitions {sorted(self.info)} of {self.partitions or '?'} connected within "
                    f"{self.node_timeout:.0f} s (start a SuperNode for each partition-id){undecided}"
                )
            self.refresh_nodes(range(self.partitions or 1), timeout=min(5.0, self.node_timeout))
        self.num_clients = self.partitions
        if self.sizes is None:  # trusted on first answer: later claims must match
            self.sizes = [int(self.info[p]["num-train"]) for p in range(self.num_clients)]
        self.log(f"[fedmeta] {self.num_clients} partitions connected: "
                 + ", ".join(f"{p}->node {self.node_of[p]} ({self.info[p]['num-train']} samples)"
                             for p in sorted(self.node_of)))

    # ------------------------------------------------------------------------------------------
    # setup and checkpoints
    # ------------------------------------------------------------------------------------------
    def setup(self) -> None:
        """Build the global model, the optimizer, the population's records and the algorithm's states (the
        in-process ``FederatedModule.attach_data`` and ``configure_optimizers``), then resume a checkpoint."""
        cfg, k = self.cfg, self.num_clients
        first = self.info[0]
        spec = {
            "input_shape": list(first["input-shape"]), "task": first["task"],
            "num_classes": None if int(first["num-classes"]) < 0 else int(first["num-classes"]),
            "target_shape": list(first["target-shape"]),
        }
        self.model = cfg.build_model(spec)
        # the trainable parameters only: frozen ones (requires_grad=False) are never sent or stepped; every node
        # builds the same frozen base from the config and seed (lightning_fedmeta.client.trainable)
        self.init_params = {n: p.clone() for n, p in trainable_parameters(self.model).items()}
        self.optimizer = cfg.server_optimizer([p for p in self.model.parameters() if p.requires_grad])
        options = cfg.module_options
        self.counts = torch.tensor([int(self.info[p]["num-train"]) for p in range(k)], dtype=torch.long)
        self.label_counts = torch.stack([self.info[p]["label_counts"] for p in range(k)])
        # the in-process module's federation and server pipeline (participation is real here: nothing simulated)
        reliability = Reliability.from_options(aggregator=options.get("aggregator"), dp=deployed_dp(options.get("dp")))
        engine = self.engine = RoundEngine.from_options(
            self.algorithm, reliability, seed=cfg.seed, clients_per_round=cfg.clients_per_round,
            fraction=options.get("fraction"), holdout_clients=options.get("holdout_clients", 0),
            aggregation=options.get("aggregation", "samples"))
        # the nodes keep their state (state_file.py) and compress their uploads; a non-finite reply or aggregate
        # never stops the run (module docstring); m̂ is the answer rate observed so far
        engine.serve_remote_clients(self.compression, self.expected_answers)
        if self.compression is not None:
            check_composition(self.compression, algorithm_name=self.algorithm.name or type(self.algorithm).__name__,
                              uploads_delta=uploads_delta(self.algorithm), aggregator=reliability.aggregator.name)
        self.dp_clip = math.inf if reliability.dp is None else float(reliability.dp.clip)
        # secure_mode (on by default in a deployment): noise and cohorts from a key no file holds; Poisson cohort
        # sizes: no byte counts published
        secure = reliability.dp is not None and reliability.dp.secure_mode
        engine.start_releases(0, os.urandom(KEY_BYTES) if secure else None, hides_cohort_size(reliability.dp))
        self.secret_cohorts = engine.draws is not None
        self.state_round = torch.full((k,), -1, dtype=torch.long)  # the last round each client was aggregated in
        engine.bind_population(self.counts, self.label_counts, self.model, str(spec["task"]))
        honest, honest_statistics = honest_output(cfg, first, self.records(torch.arange(k)), self.label_counts,
                                                  self.init_params, self.server_state, self.statistics())
        self.reply_spec = ReplySpec.of(honest, honest_statistics, sent_delta(self.algorithm, honest))
        self.round = 0
        if self.checkpoint and os.path.isfile(self.checkpoint):
            self.load(self.checkpoint)
        self.start_round = self.round
        if reliability.dp is not None:  # ε continues the checkpoint's record (privacy_budget.py, as a warm start)
            self.budget = continue_privacy_record(
                reliability.dp, self.num_sampled / int(self.eligible.numel()), self.saved_privacy, self.round,
                lambda text: self.log(f"[fedmeta] {text}"))
        if self.secret_cohorts:
            self.log("[fedmeta] model.dp.secure_mode: the cohorts are secret, so history.json, the checkpoint and "
                     "this log name no round's cohort (its clients, nor which of them replied or failed)"
                     + (f" (a resume needs {self._private_path()}, which holds them: never publish it)"
                        if self.checkpoint else ""))

    # the engine's parts, by the names the server always had
    @property
    def federation(self) -> Federation:
        assert self.engine is not None, "setup() has not run"
        return self.engine.federation

    @property
    def pipeline(self) -> ServerPipeline:
        assert self.engine is not None, "setup() has not run"
        return self.engine.pipeline

    @property
    def traffic(self) -> TrafficCounter:
        assert self.engine is not None, "setup() has not run"
        return self.engine.traffic

    @property
    def draws(self) -> DPDraws | None:
        return None if self.engine is None else self.engine.draws

    @property
    def seed(self) -> int:
        return self.cfg.seed

    @property
    def server_state(self) -> dict[str, Any]:
        assert self.engine is not None, "setup() has not run"
        return self.engine.server_state

    @server_state.setter
    def server_state(self, value: dict[str, Any]) -> None:
        assert self.engine is not None, "setup() has not run"
        self.engine.server_state = value

    @property
    def num_sampled(self) -> int:
        return self.federation.num_sampled

    @property
    def eligible(self) -> Tensor:
        return self.federation.eligible

    @property
    def seen(self) -> Tensor:
        assert self.federation.seen is not None
        return self.federation.seen

    def params(self) -> Params:
        """The global model's trainable parameters (what the nodes receive; frozen ones stay on each node)."""
        return trainable_parameters(self.model)

    def statistics(self) -> dict[str, Tensor]:
        """The model's BatchNorm running statistics (``{}`` without them): what a client that never trained
        starts from, as the engine's :meth:`~lightning_fedmeta.loop.client_storage.RunningStatistics.starting`."""
        assert self.engine is not None
        own = dict(self.model.named_buffers())
        return {n: own[n].detach() for n in self.engine.running.names}

    def records(self, clients: Tensor) -> ClientRecord:
        """The stacked records of the given clients (the simulator's :class:`Federation` records)."""
        return self.federation.records(clients)

    def published_history(self) -> list[dict[str, Any]]:
        """The round entries as they are written (history.json, the checkpoint): under secure_mode without the
        keys that name or count a cohort (:data:`COHORT_KEYS`)."""
        if not self.secret_cohorts:
            return self.history
        return [{k: v for k, v in e.items() if k not in COHORT_KEYS} for e in self.history]

    def published_failures(self) -> list[dict[str, Any]]:
        """The failures as they are written: under secure_mode without the train failures (sampled clients)."""
        return [f for f in self.failures if not (self.secret_cohorts and f["kind"] == "train")]

    def cohort_state(self) -> dict[str, Any]:
        """What names the cohorts: which clients were ever aggregated, each one's last round, the full history and
        failures (under secure_mode only in the private resume file, :meth:`save`)."""
        return {"round": self.round, "seen": self.federation.seen.clone(), "state_round": self.state_round.clone(),
                "history": self.history, "failures": self.failures}

    def state_dict(self) -> dict[str, Any]:
        state = {
            "round": self.round, "run_key": self.run_key, "run_token": self.run_token,
            "params": {k: v.clone() for k, v in self.params().items()},
            "init_params": self.init_params, "optimizer": self.optimizer.state_dict(),
            "server_state": flatten_state(self.server_state), "dp_clip": self.dp_clip,
            "history": self.published_history(), "failures": self.published_failures(),
            "num_clients": self.num_clients, "counts": self.counts.clone(),
            "statistics": {k: v.clone() for k, v in self.statistics().items()},
        }
        if not self.traffic.hidden:
            state["traffic"] = self.traffic.state_dict()
        privacy = self.saved_privacy if self.budget is None else self.budget.record(self.round - self.start_round)
        if privacy is not None:
            state["privacy"] = privacy
        if not self.secret_cohorts:
            state.update(seen=self.federation.seen.clone(), state_round=self.state_round.clone())
        return state

    def _private_path(self, path: str | None = None) -> str:
        return f"{path or self.checkpoint}.private"

    def save(self, path: str) -> None:
        """The checkpoint; under secure_mode the cohorts go to ``<path>.private`` instead (owner-only, written
        first), the one file that names them, which a resume needs and which must never be published."""
        if self.secret_cohorts:
            private = self.cohort_state()

            def write(fh: Any) -> None:
                os.fchmod(fh.fileno(), 0o600)
                torch.save(private, fh)

            atomic_write(self._private_path(path), write)
        atomic_save(self.state_dict(), path)

    def load(self, path: str) -> None:
        """Resume from a checkpoint (the same partitions must be connected). The file is read as data only
        (``weights_only=True``: tensors and plain values; a pickled object in it is refused, never run)."""
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise ValueError(f"checkpoint {path} holds more than tensors and plain values, so it was not loaded "
                             f"(it may run code): {exc}. Delete it to start the run afresh") from exc
        if int(saved["num_clients"]) != self.num_clients or not torch.equal(saved["counts"], self.counts):
            raise ValueError(f"checkpoint {path} was written for other partitions (sizes {saved['counts'].tolist()}, "
                             f"connected {self.counts.tolist()})")
        with torch.no_grad():
            for name, p in trainable_parameters(self.model).items():
                p.copy_(saved["params"][name])
        with torch.no_grad():
            for name, value in saved.get("statistics", {}).items():
                dict(self.model.named_buffers())[name].copy_(value)
        self.init_params = saved["init_params"]
        self.optimizer.load_state_dict(saved["optimizer"])
        self.server_state = unflatten_state(saved["server_state"])
        cohorts = saved if "seen" in saved else self._load_private(path, int(saved["round"]))
        self.federation.seen = cohorts["seen"].clone()
        clip = float(saved.get("dp_clip", math.inf))
        if self.federation.reliability.dp is not None and math.isfinite(clip):  # inf: the rounds ran without DP
            self.dp_clip = clip
        self.state_round = cohorts["state_round"].clone()
        self.history = list(cohorts["history"])
        self.failures = list(cohorts["failures"])
        self.round = int(saved["round"])
        self.traffic.load_state_dict(None if self.traffic.hidden else saved.get("traffic"))
        self.saved_privacy = saved.get("privacy")
        self.run_key = str(saved["run_key"])
        self.run_token = str(saved.get("run_token") or self.run_token)
        self.log(f"[fedmeta] resumed from {path} at round {self.round} (state key {self.run_key})")

    def _load_private(self, path: str, round_idx: int) -> dict[str, Any]:
        """The cohorts of a checkpoint written under secure_mode, from its private resume file."""
        private = self._private_path(path)
        try:
            cohorts = torch.load(private, map_location="cpu", weights_only=True)
        except (OSError, pickle.UnpicklingError) as exc:
            raise ValueError(f"checkpoint {path} was written under model.dp.secure_mode, so its cohorts are in "
                             f"{private}, which cannot be read ({type(exc).__name__}: {exc}); restore it, or delete "
                             "the checkpoint to start the run afresh") from exc
        if int(cohorts.get("round", -1)) != round_idx:
            raise ValueError(f"{private} is of round {cohorts.get('round')}, checkpoint {path} of round {round_idx}: "
                             "they were not written together; delete both to start the run afresh")
        return cohorts

    def _cohort_log(self, kind: str, text: str) -> None:
        """A log line that names a client of a train exchange: not logged under secure_mode (the failure itself
        is kept in the private resume file)."""
        if not (self.secret_cohorts and kind == "train"):
            self.log(text)

    # ------------------------------------------------------------------------------------------
    # messages
    # ------------------------------------------------------------------------------------------
    def _content(self, round_idx: int, pid: int, kind: str) -> RecordDict:
        config = ConfigRecord({"round": round_idx, "partition-id": pid, "run-key": self.run_key,
                               "run-token": self.run_token, "state-round": int(self.state_round[pid]),
                               "num-clients": self.num_clients, "largest-train-size": int(self.counts.max())})
        if self.compression is not None and self.compression.download is not None:
            config["params-dtype"] = str(next(iter(self.params().values())).dtype).removeprefix("torch.")
        record = ClientRecord(*(t[0] for t in self.records(torch.tensor([pid]))))
        # train: the parameters the algorithm downloads (a personal part stays out: the node completes it);
        # evaluate: all of them (a client that never trained is scored with the global personal part)
        assert self.reply_spec is not None
        params = sent_params(self.algorithm, self.params(), self.server_state, record, self.reply_spec.state) \
            if kind == "train" else self.params()
        content = RecordDict({
            "config": config,
            "params": tree_to_record(sent_model(params, self.compression)),
            "server-state": tree_to_record(self.server_state),
            "record": client_record_to_record(record),
            # with config's num-clients and largest-train-size, the client's view of the population
            # (flower.client.population_view): its own label histogram, nothing of another client
            "population": tree_to_record({"label_counts": self.label_counts[pid]}),
        })
        if int(self.state_round[pid]) < 0:  # the client starts from the initial state, made from w0
            content["init-params"] = tree_to_record(self.init_params)
        if self.statistics():  # the published BatchNorm statistics: a client that never trained starts from them
            content["statistics"] = tree_to_record(self.statistics())
        return content

    def exchange(self, kind: str, round_idx: int, partitions: list[int]) -> dict[int, Message]:
        """Send ``kind`` messages to the partitions' nodes; the good replies by partition.

        A message whose node went away (an error reply saying so, or the partition reported by a new node while
        the reply is awaited: a restarted SuperNode) is sent again to the partition's new node, up to
        ``max_retries`` times; any other error, or no reply within ``reply_timeout``, fails the client."""
        pending, replies = set(partitions), {}
        for attempt in range(self.max_retries + 1):
            missing = self.refresh_nodes(pending)
            for pid in sorted(missing):
                self._failed(kind, round_idx, pid, "no node holds this partition-id")
            targets = {p: self.node_of[p] for p in sorted(pending - missing)}
            if not targets:
                break
            got, retry = self._send_and_wait(kind, round_idx, targets, last=attempt == self.max_retries)
            replies.update(got)
            pending = retry
            if not pending:
                break
        return replies

    def _send_and_wait(
        self, kind: str, round_idx: int, targets: dict[int, int], last: bool
    ) -> tuple[dict[int, Message], set[int]]:
        """Push one message per partition, then pull the replies until all are in, the reply timeout, or a
        partition's node is replaced. Returns the good replies and the partitions to send again."""
        messages = [Message(self._content(round_idx, p, kind), dst_node_id=n, message_type=kind)
                    for p, n in targets.items()]
        if kind == "train":
            self.wire["down"] += sum(wire_bytes(m.content) for m in messages)
        ids = list(self.grid.push_messages(messages))
        outstanding = {mid: pid for mid, pid in zip(ids, targets, strict=True) if mid}
        for pid in sorted(set(targets) - set(outstanding.values())):
            self._failed(kind, round_idx, pid, "the SuperLink refused the message")
        replies: dict[int, Message] = {}
        retry: set[int] = set()
        deadline = None if self.reply_timeout is None else time.monotonic() + self.reply_timeout
        next_check = time.monotonic() + self.poll_interval
        while outstanding:
            for reply in self.grid.pull_messages(list(outstanding)):
                pid = outstanding.pop(reply.metadata.reply_to_message_id, None)
                if pid is None:
                    continue
                if not reply.has_error():
                    replies[pid] = reply
                    self.wire["up"] += wire_bytes(reply.content) if kind == "train" else 0
                elif reply.error.code in RETRYABLE and not last:
                    self._cohort_log(kind, f"[fedmeta] round {round_idx}: node {targets[pid]} (partition {pid}) is "
                                     f"unavailable (error {reply.error.code}); sending again to its partition's node")
                    self.known_nodes.discard(targets[pid])
                    self.node_of.pop(pid, None)
                    retry.add(pid)
                else:
                    self._failed(kind, round_idx, pid, f"error {reply.error.code}: {reply.error.reason}")
            if not outstanding:
                break
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                for pid in sorted(outstanding.values()):
                    self._failed(kind, round_idx, pid, f"no reply within {self.reply_timeout} s")
                break
            if now >= next_check and not last:  # a restarted node: its partition is now on a new node id
                self.refresh_nodes(timeout=0.0)
                for mid, pid in list(outstanding.items()):
                    if self.node_of.get(pid) not in (None, targets[pid]):
                        self._cohort_log(kind, f"[fedmeta] round {round_idx}: partition {pid} moved from node "
                                         f"{targets[pid]} to node {self.node_of[pid]} while its reply was awaited; "
                                         "sending again")
                        del outstanding[mid]
                        retry.add(pid)
                next_check = now + self.poll_interval
            time.sleep(self.pull_interval)
        return replies, retry

    def _failed(self, kind: str, round_idx: int, pid: int, reason: str, node: int | None = None) -> None:
        node = self.node_of.get(pid) if node is None else int(node)
        self.failures.append({"round": round_idx, "partition": pid, "node": node, "kind": kind, "reason": reason})
        self._cohort_log(kind, f"[fedmeta] round {round_idx}: {kind} of partition {pid} (node {node}) failed "
                               f"({reason}); aggregating over the clients that answered")

    # ------------------------------------------------------------------------------------------
    # rounds
    # ------------------------------------------------------------------------------------------
    def sampled(self, round_idx: int) -> Tensor:
        """The round's clients: the simulator's draw (sorted)."""
        return self.federation.round_clients(round_idx)

    def train_round(self, round_idx: int) -> dict[str, Any]:
        """One round (see the module docstring); returns its log entry (``rejected_replies``: replies that failed
        :func:`~lightning_fedmeta.flower.replies.check_train_reply`, each logged with its node and reason)."""
        assert self.engine is not None
        sampled = self.sampled(round_idx)
        self.wire = {"up": 0, "down": 0}
        replies = self._checked("train", round_idx, self.exchange("train", round_idx, sampled.tolist()))
        answered = torch.tensor(sorted(replies), dtype=torch.long)
        entry: dict[str, Any] = {"round": round_idx, "sampled": sampled.tolist(), "answered": answered.tolist(),
                                 "rejected_replies": len(self.exchanged) - len(replies)}
        result = self.round_result(round_idx, answered, [replies[int(p)] for p in answered])
        traffic = self.engine.count_traffic(round_idx, result)
        if not self.traffic.hidden:  # |cohort| × one client's bytes would publish a Poisson cohort's size
            entry["comm"] = {**self.traffic.logged(traffic), "comm/wire_up_bytes": self.wire["up"],
                             "comm/wire_down_bytes": self.wire["down"]}
        dp = self.federation.reliability.dp is not None
        clip = torch.tensor(self.dp_clip, dtype=torch.float64) if dp else None
        report = self.engine.serve(round_idx, result, self.optimizer, clip=clip)
        if clip is not None:
            self.dp_clip = float(clip)
        if report.privacy is not None:
            entry["dp"] = {**report.privacy.logged(), **self._privacy_spent(round_idx + 1)}
        if report.skipped is not None:
            entry["skipped"] = report.skipped
            self._cohort_log("train", f"[fedmeta] round {round_idx}: {report.skipped}; the model is unchanged")
            return entry
        if report.clients.numel() == 0:  # a DP round nobody answered: the noise is released
            self.log(f"[fedmeta] round {round_idx}: aggregated" if self.secret_cohorts else
                     f"[fedmeta] round {round_idx}: no sampled client answered; the DP noise is released all the same")
            return entry
        self.state_round[report.clients] = round_idx
        metrics = {k: float(v) for k, v in report.metrics.items()}
        entry["train"] = metrics
        cohort = "" if self.secret_cohorts else f" clients {answered.tolist()} of {sampled.tolist()}"
        self.log(f"[fedmeta] round {round_idx}:{cohort} aggregated; "
                 + ", ".join(f"train/{k} = {v:.5f}" for k, v in metrics.items()))
        return entry

    def round_result(self, round_idx: int, answered: Tensor,
                     replies: list[tuple[ClientOutput, dict[str, Tensor]]]) -> RoundResult | None:
        """The engine's :class:`~lightning_fedmeta.loop.round.RoundResult` of the accepted replies (``None``
        when there is none): their outputs and BN statistics stacked in partition order, the participation
        weights renormalised over them, their local steps."""
        assert self.engine is not None
        if not replies:
            return None
        outs = [out for out, _ in replies]
        out = ClientOutput(*(torch.utils._pytree.tree_map(lambda *xs: torch.stack(xs), *[o[i] for o in outs])
                             if outs[0][i] else {} for i in range(4)))
        buffers = {name: torch.stack([b[name] for _, b in replies]) for name in replies[0][1]}
        steps = self.engine.round_steps(round_idx, answered, self.algorithm.round_plan())
        return RoundResult(round_idx, answered, out, self.federation.weights(answered), steps, buffers)

    def _privacy_spent(self, rounds: int) -> dict[str, Any]:
        """``epsilon`` after ``rounds`` rounds (the module's accountant, q = m / N, continuing the checkpoint's
        privacy record: rounds released before a restart keep their noise multiplier) and ``secure_mode``
        (whether ε holds against a reader of the seed); only ``secure_mode`` when Opacus is not installed."""
        dp = self.federation.reliability.dp
        assert dp is not None
        spent: dict[str, Any] = {"secure_mode": bool(dp.secure_mode)}
        try:
            assert self.budget is not None
            spent["epsilon"] = self.budget.epsilon(rounds - self.start_round)
        except ImportError as exc:  # the privacy extra is not installed on the server
            if not getattr(self, "_warned_no_accountant", False):
                self.log(f"[fedmeta] ε is not accounted: {exc}")
                self._warned_no_accountant = True
        return spent

    def _checked(self, kind: str, round_idx: int, replies: dict[int, Message]) -> dict[int, Any]:
        """The replies that pass their check (train: a :class:`ClientOutput`; evaluate: the sums); every other
        one fails its client for the round, logged with its node and the reason."""
        self.exchanged = replies
        accepted: dict[int, Any] = {}
        names = self._metric_names()
        for pid, reply in sorted(replies.items()):
            try:
                if kind == "train":
                    assert self.reply_spec is not None
                    accepted[pid] = (
                        check_train_reply(reply.content, self.reply_spec, int(self.counts[pid]),
                                          None if self.compression is None else self.compression.upload),
                        check_statistics_reply(reply.content, self.reply_spec))
                else:
                    accepted[pid] = check_eval_reply(reply.content, names, int(self.info[pid]["num-test"]))
            except RejectedReply as exc:
                self._failed(kind, round_idx, pid, f"reply rejected: {exc}", node=reply.metadata.src_node_id)
        return accepted

    def expected_answers(self) -> float:
        """``m̂`` for adaptive clipping: ``m`` times the fraction of sampled clients that answered in the rounds so
        far (participation only, never a client's data; ``m`` before the first round). A deployment's dropout is
        real, not a known probability as in simulation."""
        sampled = sum(len(e.get("sampled", [])) for e in self.history if "sampled" in e)
        answered = sum(len(e.get("answered", [])) for e in self.history if "sampled" in e)
        return float(self.num_sampled) if sampled == 0 or answered == 0 else self.num_sampled * answered / sampled

    def evaluate(self, round_idx: int) -> dict[str, float]:
        """The personalised evaluation of every client, summarised as the simulator summarises it
        (:func:`~lightning_fedmeta.evaluation.fairness.summaries_with_spread`: ``{metric}_weighted``, ``_mean``,
        ``_worst10`` and the spread over clients ``{metric}_std``, ``_q10`` ... ``_q90`` for the training clients,
        and ``new/...`` for the held-out ones)."""
        k = self.num_clients
        testable = [p for p in range(k) if int(self.info[p]["num-test"]) > 0]  # nothing to score otherwise
        per_client = self._checked("evaluate", round_idx, self.exchange("evaluate", round_idx, testable))
        result: dict[str, float] = {"clients": float(len(per_client)),
                                    "rejected_replies": float(len(self.exchanged) - len(per_client))}
        if not per_client:
            return result
        names = list(self._metric_names())
        metrics = ClientMetrics(self._metric_names(), k)
        clients = torch.tensor(sorted(per_client), dtype=torch.long)
        metrics.update(clients, {
            "total": torch.tensor([per_client[int(c)]["total"] for c in clients], dtype=torch.float64),
            "loss_sum": torch.tensor([per_client[int(c)]["loss_sum"] for c in clients], dtype=torch.float64),
            "builtin": torch.tensor([[per_client[int(c)][f"{n}_sum"] for n in names] for c in clients],
                                    dtype=torch.float64).reshape(len(clients), len(names)),
        })
        partial = clients.numel() < k
        summary = summaries_with_spread(metrics, self.federation.summary_groups(clients if partial else None))
        for group, values in summary.items():
            if group.startswith("_"):
                continue
            prefix = "" if group == "clients" else f"{group}/"
            result.update({prefix + key: float(v) for key, v in values.items()})
        result.update(flat_spread(summary))
        self.log(f"[fedmeta] personalised evaluation after round {round_idx}: "
                 + ", ".join(f"{k} = {v:.4f}" for k, v in result.items() if k not in ("clients", "rejected_replies")))
        return result

    def _metric_names(self) -> dict[str, str]:
        """``{evaluation key: built-in metric}``: the config's ``model.metrics``, else the task's default."""
        return dict(self.cfg.module_options.get("metrics") or DEFAULT_METRICS[str(self.info[0]["task"])])

    def run(self) -> dict[str, Any]:
        """Discover the nodes, set up (or resume), train the remaining rounds, evaluate, write the outputs."""
        self.discover()
        self.setup()
        rounds = self.cfg.rounds
        self.log(f"[fedmeta] {self.algorithm!r}: rounds {self.round}..{rounds - 1}, {self.num_sampled} of "
                 f"{int(self.eligible.numel())} training clients per round, state key {self.run_key}")
        while self.round < rounds:
            r = self.round
            if self.budget is not None and self.budget.dp.target_epsilon is not None:
                self.stopped = self.budget.refusal(r - self.start_round)
                if self.stopped is not None:
                    self.log(f"[fedmeta] round {r}: {self.stopped}")
                    break
            started = time.monotonic()
            entry = self.train_round(r)
            self.round = r + 1
            if self.evaluate_clients and (self.round % self.cfg.eval_every == 0 or self.round == rounds):
                entry["evaluate"] = self.evaluate(self.round)
            entry["seconds"] = round(time.monotonic() - started, 2)
            self.history.append(entry)
            if self.checkpoint:
                self.save(self.checkpoint)
        result: dict[str, Any] = {"round": self.round, "history": self.published_history(),
                                  "failures": self.published_failures()}
        if self.stopped is not None:
            result["stopped"] = self.stopped
        if self.output_dir:
            out = Path(self.output_dir)
            out.mkdir(parents=True, exist_ok=True)
            atomic_save({k: v.clone() for k, v in self.params().items()}, out / "final_params.pt")
            atomic_save({"server_state": copy.deepcopy(flatten_state(self.server_state))}, out / "server_state.pt")
            (out / "history.json").write_text(json.dumps(result, indent=1))
        return result

