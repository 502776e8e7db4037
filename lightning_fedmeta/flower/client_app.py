"""The ClientApp: a node's answers to the server's query, train and evaluate messages.

Messages (built by :mod:`lightning_fedmeta.flower.server`; records in :mod:`~lightning_fedmeta.flower.records`):

* ``query``: reply with the node's ``partition-id``, its number of training and test samples, its data's shapes
  and task, and its label histogram (the server needs every client's size for the weights ``p_i``).
* ``train``: restore the client's state (the file of round ``state-round``, or the initial state), run the
  algorithm's ``client_update`` for the round and reply with ``delta``, ``state``, ``extras`` (``ArrayRecord``)
  and ``metrics`` (``MetricRecord`` with ``num-examples``); the new state is written to the state file first.
  With BatchNorm the reply's ``statistics`` record holds the client's running statistics after the round (the
  server forms the model's from them, as the engine does); the node keeps its own in its state file and starts
  from them once it was aggregated (before that, from the model's, sent as ``statistics``).
  Under ``model.compression`` the ``delta`` record holds the compressed upload
  (:func:`~lightning_fedmeta.flower.compressed.client_upload`: fewer bytes on the wire), top-k's residual is
  kept in the node's state file next to the algorithm's state, and a 16-bit ``params`` record is cast back.
* ``evaluate``: the personalised evaluation's sums (``MetricRecord``).

The node's data is chosen by node config ``partition-id`` / ``num-partitions`` (and optionally ``client-data``, a
hook); its state lives under node config ``state-dir`` (default :func:`~lightning_fedmeta.flower.state_file.
default_state_dir`); node config ``upload-client-state = false`` keeps its personal state on the node. These are
the node owner's choices: a run config naming ``client-data`` or ``upload-client-state`` is ignored (warning).
"""

from __future__ import annotations

from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from lightning_fedmeta.flower.client import (
    STATISTICS,
    LocalClient,
    client_for,
    data_spec_of,
    node_setting,
    population_view,
)
from lightning_fedmeta.flower.compressed import RESIDUAL, client_upload
from lightning_fedmeta.flower.records import (
    completed_params,
    record_to_client_record,
    record_to_tree,
    sent_delta,
    tree_to_record,
)
from lightning_fedmeta.flower.state_file import ClientStateFile, default_state_dir
from lightning_fedmeta.persistence.memory_store import map_state, unflatten_state

__all__ = ["app", "handle_query", "handle_train", "handle_evaluate"]

app = ClientApp()


def _state_file(client: LocalClient, context: Context, config: ConfigRecord) -> ClientStateFile:
    root = context.node_config.get("state-dir") or default_state_dir()
    token = config.get("run-token")
    return ClientStateFile(str(root), str(config["run-key"]), client.partition_id, str(token) if token else None)


def _inputs(client: LocalClient, msg: Message, context: Context) -> tuple[Any, ...]:
    """The round's inputs: config, global parameters, server state, this client's state and record, the padding
    width of full-batch plans (the largest client's training set), its state file and the BatchNorm statistics it
    starts from (its own once aggregated, else the model's; ``{}`` without BatchNorm)."""
    content = msg.content
    config = content.config_records["config"]
    params = record_to_tree(content.array_records["params"])
    if "params-dtype" in config:  # a 16-bit download (model.compression.download): float32(half(w)) as simulated
        dtype = getattr(torch, str(config["params-dtype"]))
        params = {n: p.to(dtype) if p.is_floating_point() else p for n, p in params.items()}
    init = record_to_tree(content.array_records["init-params"]) if "init-params" in content.array_records else None
    params = completed_params(params, client.model, init)  # a personal part the server left out
    server_state = record_to_tree(content.array_records["server-state"])
    record = record_to_client_record(content.array_records["record"])
    pop = record_to_tree(content.array_records["population"])
    largest = int(config["largest-train-size"])
    population, label_counts = population_view(record, int(config["num-clients"]), largest, pop["label_counts"])
    client.bind(population, label_counts)
    state_round = int(config["state-round"])
    files = _state_file(client, context, config)
    statistics: dict[str, Any] = {}
    if state_round < 0:  # never aggregated: the algorithm's initial state (from the initial global model)
        assert init is not None, "the server sends the initial model with a never-aggregated client's message"
        state = client.initial_state(init, population)
    else:
        state = files.load(state_round)
        statistics = state.pop(STATISTICS, {})
    if not statistics and "statistics" in content.array_records:  # not trained yet: the published statistics
        statistics = record_to_tree(content.array_records["statistics"])
    state.pop(RESIDUAL, None)  # the top-k residual (read by _residual), not the algorithm's state
    width = largest
    return config, params, server_state, state, record, width, files, statistics


@app.query()
def handle_query(msg: Message, context: Context) -> Message:
    """The node's partition and data description."""
    client = client_for(context.node_config, context.run_config)
    data = client.data
    spec = data_spec_of(data)
    config = ConfigRecord({
        "partition-id": client.partition_id,
        "num-partitions": int(context.node_config["num-partitions"]),
        "num-train": int(data.train_offsets[1]),
        "num-test": int(data.test_offsets[1]),
        "task": str(spec["task"]),
        "num-classes": -1 if spec["num_classes"] is None else int(spec["num_classes"]),
        "input-shape": [int(d) for d in spec["input_shape"]],
        "target-shape": [int(d) for d in spec["target_shape"]],
    })
    counts = ArrayRecord(torch_state_dict={"label_counts": data.label_counts[0].clone()})
    return Message(RecordDict({"data": config, "label-counts": counts}), reply_to=msg)


def _delta_record(client: LocalClient, delta: dict[str, Any], config: ConfigRecord,
                  files: ClientStateFile) -> tuple[ArrayRecord, dict[str, Any]]:
    """The reply's ``delta`` record (compressed under ``model.compression.upload``) and what the state file keeps
    besides the algorithm's state (top-k's new residual ``e'``: the residual of round ``state-round``, zero before
    the first aggregated round, so a round the server did not aggregate leaves no trace, as in simulation)."""
    spec = client.cfg.compression()
    compressor = None if spec is None else spec.upload
    if compressor is None:
        return tree_to_record(delta), {}
    state_round = int(config["state-round"])
    residual = files.load(state_round).get(RESIDUAL) if compressor.error_feedback and state_round >= 0 else None
    record, kept = client_upload(compressor, delta, residual, client.cfg.seed, int(config["round"]),
                                 client.partition_id)
    return record, ({RESIDUAL: kept} if compressor.error_feedback else {})


@app.train()
def handle_train(msg: Message, context: Context) -> Message:
    """One round of the algorithm's ``client_update``; the new state is saved before the reply."""
    client = client_for(context.node_config, context.run_config)
    config, params, server_state, state, record, width, files, statistics = _inputs(client, msg, context)
    round_idx = int(config["round"])
    out, statistics = client.train(round_idx, params, server_state, state, record, width, statistics)
    # the delta's entries the algorithm uploads (a personal part's zeros stay here; the server fills them in)
    delta_record, kept = _delta_record(client, unflatten_state(sent_delta(client.algorithm, out)), config, files)
    files.save(round_idx, {**out.state, **kept, **({STATISTICS: statistics} if statistics else {})})
    files.prune({int(config["state-round"]), round_idx})
    upload_state = bool(node_setting(context.node_config, context.run_config, "upload-client-state", True))
    state_out = out.state if upload_state else map_state(torch.zeros_like, out.state)
    metrics = {k: float(v) for k, v in out.metrics.items()}
    metrics["num-examples"] = int(record.num_samples)
    reply = RecordDict({
        "delta": delta_record,
        "state": tree_to_record(state_out),
        "extras": tree_to_record(out.extras),
        "metrics": MetricRecord(metrics),
        "reply": ConfigRecord({"partition-id": client.partition_id, "round": round_idx}),
    })
    if statistics:
        reply["statistics"] = tree_to_record(statistics)
    return Message(reply, reply_to=msg)


@app.evaluate()
def handle_evaluate(msg: Message, context: Context) -> Message:
    """The personalised evaluation's sums on the node's test set."""
    client = client_for(context.node_config, context.run_config)
    config, params, server_state, state, record, width, _, statistics = _inputs(client, msg, context)
    sums = client.evaluate(int(config["round"]), params, server_state, state, record, width, statistics)
    sums["num-examples"] = int(sums["total"])
    reply = RecordDict({
        "metrics": MetricRecord(sums),
        "reply": ConfigRecord({"partition-id": client.partition_id, "round": int(config["round"])}),
    })
    return Message(reply, reply_to=msg)

