"""What a SuperNode sends, checked before it enters discovery, aggregation or evaluation (docs/security.md).

A node is not trusted: whoever runs it controls every byte of its replies. A reply is accepted only when

    query     its partition-id is in [0, K), its num-partitions is K, its sizes are integers >= 0 (num-train equal
              to the pinned size: run config partition-sizes, else the size its partition reported first), its
              data description (task, classes, shapes, histogram length) equals the federation's
    train     delta / state / extras have exactly the keys, shapes and dtypes an honest client's output has
              (:func:`honest_output`: the algorithm's client_update run once by the server) and finite values,
              the delta holding the entries the algorithm uploads (the rest, a personal part, is zero and is
              filled in by the server: :func:`~lightning_fedmeta.flower.records.sent_delta`);
              under model.compression the delta record holds the compressed arrays an honest node sends
              (:func:`~lightning_fedmeta.flower.compressed.upload_layout`) with values an honest encoding gives
              (QSGD codes within the levels, norms >= 0, sparse indices distinct), decoded to a finite delta;
              the delta's norm fits in float32; its metrics are exactly the algorithm's, finite and within
              float32, and num-examples is the partition's known size; with BatchNorm, its running statistics
              have exactly the model's keys, shapes and dtypes, are finite, and variances and counters are >= 0
    evaluate  total is the partition's test size, every sum is finite and within what the metric allows (at
              most num-test float32 values: a federation's sum stays finite)

Anything else raises :class:`RejectedReply`: that client fails the round (logged, counted), never the run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from flwr.app import RecordDict
from torch import Tensor

from lightning_fedmeta.algorithms.base import ClientOutput, ClientRecord
from lightning_fedmeta.communication.compressors import Compressor
from lightning_fedmeta.persistence.memory_store import flatten_state, unflatten_state

__all__ = ["RejectedReply", "ReplySpec", "check_eval_reply", "check_query_reply", "check_statistics_reply",
           "check_train_reply", "honest_output"]

#: a flattened tree's keys with their shapes and dtypes
TreeSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]

#: the largest float32 number: what an honest node's values, norms and per-sample sums are made of
FLOAT32_MAX = float(torch.finfo(torch.float32).max)

#: the data description every partition must share (keys of a query reply's "data" record)
DESCRIPTION = ("task", "num-classes", "input-shape", "target-shape")


class RejectedReply(ValueError):
    """A reply that fails its client for this round (the reason says what was wrong)."""


def tree_spec(tree: Mapping[str, Any]) -> TreeSpec:
    return {k: (tuple(v.shape), v.dtype) for k, v in flatten_state(dict(tree)).items()}


@dataclass(frozen=True)
class ReplySpec:
    """The shape of an honest train reply (from :func:`honest_output`)."""

    delta: TreeSpec
    state: TreeSpec
    extras: TreeSpec
    metrics: frozenset[str]
    statistics: TreeSpec = field(default_factory=dict)  # the BatchNorm running statistics ({} without BatchNorm)
    #: the delta's flattened keys that travel (``None``: all of them)
    sent: frozenset[str] | None = None

    @classmethod
    def of(cls, out: ClientOutput, statistics: Mapping[str, Tensor] | None = None,
           sent: Mapping[str, Tensor] | None = None) -> ReplySpec:
        """The spec of ``out`` (an honest client's output); ``sent``: the part of its delta that travels
        (:func:`~lightning_fedmeta.flower.records.sent_delta`), ``None`` for the whole delta."""
        return cls(tree_spec(out.delta), tree_spec(out.state), tree_spec(out.extras), frozenset(out.metrics),
                   tree_spec(statistics or {}), None if sent is None else frozenset(sent))

    def sent_delta(self) -> TreeSpec:
        """The spec of the delta entries a reply carries."""
        return self.delta if self.sent is None else {k: v for k, v in self.delta.items() if k in self.sent}


def _tree(content: RecordDict, name: str, spec: TreeSpec) -> dict[str, Any]:
    """Record ``name`` as a tree, refused unless its keys, shapes and dtypes are ``spec``'s and it is finite."""
    if name not in content.array_records:
        raise RejectedReply(f"the reply has no {name!r} record")
    try:
        flat = {k: v.clone() for k, v in content.array_records[name].to_torch_state_dict().items()}
    except Exception as exc:  # noqa: BLE001 - anything a node can make the decoder raise
        raise RejectedReply(f"{name} is not a record of tensors ({type(exc).__name__}: {exc})") from exc
    if set(flat) != set(spec):
        raise RejectedReply(f"{name} has the keys {sorted(flat)}, expected {sorted(spec)}")
    for key, (shape, dtype) in spec.items():
        got = flat[key]
        if tuple(got.shape) != shape or got.dtype != dtype:
            raise RejectedReply(f"{name}/{key} is {got.dtype} {list(got.shape)}, expected {dtype} {list(shape)}")
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            raise RejectedReply(f"{name}/{key} is not finite")
    return unflatten_state(flat)


def _numbers(content: RecordDict, keys: set[str]) -> dict[str, float]:
    """The reply's ``metrics`` record: exactly ``keys``, each a finite number."""
    if "metrics" not in content.metric_records:
        raise RejectedReply("the reply has no 'metrics' record")
    values = dict(content.metric_records["metrics"])
    if set(values) != keys:
        raise RejectedReply(f"metrics has the keys {sorted(values)}, expected {sorted(keys)}")
    for key, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise RejectedReply(f"metric {key} = {v!r} is not a finite number")
    return {k: float(v) for k, v in values.items()}


def _compressed_delta(content: RecordDict, spec: TreeSpec, compressor: Compressor) -> dict[str, Any]:
    """The delta decoded from a compressed ``delta`` record (:mod:`lightning_fedmeta.flower.compressed`), in the
    shapes and dtypes of ``spec``; :class:`RejectedReply` when its arrays are not an honest node's or it decodes to
    a non-finite row."""
    from lightning_fedmeta.flower.compressed import decode_upload, upload_layout

    numel = sum(math.prod(shape) for shape, _ in spec.values())
    arrays = flatten_state(_tree(content, "delta", upload_layout(compressor, numel)))
    try:
        row = decode_upload(compressor, arrays, numel)
    except (ValueError, IndexError, RuntimeError) as exc:
        raise RejectedReply(f"delta is not a {compressor.describe()} upload of {numel} values ({exc})") from exc
    if not bool(torch.isfinite(row).all()):
        raise RejectedReply(f"delta ({compressor.describe()}) decodes to non-finite values")
    _check_norm(row)
    flat, start = {}, 0
    for key, (shape, dtype) in spec.items():
        size = math.prod(shape)
        flat[key] = row[start:start + size].reshape(shape).to(dtype)
        start += size
    return unflatten_state(flat)


def _with_zeros(delta: Mapping[str, Any], spec: TreeSpec) -> dict[str, Any]:
    """``delta`` with zeros (``spec``'s shapes and dtypes) for the entries of ``spec`` it does not carry: the personal
    part of a delta, which never travels."""
    flat = flatten_state(dict(delta))
    return unflatten_state({k: flat[k] if k in flat else torch.zeros(shape, dtype=dtype)
                            for k, (shape, dtype) in spec.items()})


def _check_norm(row: Tensor) -> None:
    """An honest delta is a float32 update whose L2 norm is a float32 number: a delta of finite coordinates whose
    norm is not (e.g. values of 3e38) would overflow the round's sum."""
    norm = float(torch.linalg.vector_norm(row.detach().to(torch.float64)))
    if not norm <= FLOAT32_MAX:
        raise RejectedReply(f"delta has norm {norm:.4g}, beyond float32 (no honest update)")


def check_train_reply(content: RecordDict, spec: ReplySpec, num_samples: int,
                      compressor: Compressor | None = None) -> ClientOutput:
    """The reply's :class:`ClientOutput`, or :class:`RejectedReply` (see the module docstring); with
    ``compressor`` (``model.compression.upload``) the delta is decoded from its compressed record."""
    sent = spec.sent_delta()
    if compressor is None:
        delta = _tree(content, "delta", sent)
        flat = [v.reshape(-1) for v in flatten_state(delta).values() if v.is_floating_point()]
        if flat:
            _check_norm(torch.cat([v.to(torch.float64) for v in flat]))
    else:
        delta = _compressed_delta(content, sent, compressor)
    delta = _with_zeros(delta, spec.delta)
    state = _tree(content, "state", spec.state)
    extras = _tree(content, "extras", spec.extras)
    metrics = _numbers(content, set(spec.metrics) | {"num-examples"})
    for key, value in metrics.items():
        if abs(value) > FLOAT32_MAX:
            raise RejectedReply(f"metric {key} = {value:g} does not fit in float32 (no honest client's metric)")
    if metrics["num-examples"] != num_samples:
        raise RejectedReply(f"it claims num-examples = {metrics['num-examples']:g}; this partition has "
                            f"{num_samples} training samples")
    return ClientOutput(delta, state, extras,
                        {k: torch.tensor(v, dtype=torch.float32) for k, v in metrics.items() if k != "num-examples"})


def check_statistics_reply(content: RecordDict, spec: ReplySpec) -> dict[str, Tensor]:
    """The client's BatchNorm running statistics after its round (record ``statistics``; ``{}`` when the model
    has none), or :class:`RejectedReply`: exactly the model's buffers (keys, shapes, dtypes), finite, and every
    ``running_var`` and ``num_batches_tracked`` ``>= 0`` (an honest client's statistics)."""
    if not spec.statistics:
        if "statistics" in content.array_records:
            raise RejectedReply("the reply has a 'statistics' record, but the model has no BatchNorm statistics")
        return {}
    flat = flatten_state(_tree(content, "statistics", spec.statistics))
    for key, value in flat.items():
        if (key.endswith("running_var") or key.endswith("num_batches_tracked")) and bool((value < 0).any()):
            raise RejectedReply(f"statistics/{key} has negative values")
    return flat


def check_eval_reply(content: RecordDict, metric_names: Mapping[str, str], num_test: int) -> dict[str, float]:
    """The evaluation sums (``total``, ``loss_sum``, ``<key>_sum`` for each configured built-in metric), or
    :class:`RejectedReply`: ``total`` must be the partition's test size, accuracy sums in ``[0, total]``,
    error sums ``>= 0``."""
    sums = _numbers(content, {"total", "loss_sum", "num-examples"} | {f"{k}_sum" for k in metric_names})
    if sums["total"] != num_test or sums["num-examples"] != num_test:
        raise RejectedReply(f"it claims total = {sums['total']:g} test samples; this partition has {num_test}")
    most = num_test * FLOAT32_MAX  # a sum of num_test float32 values: so the federation's sums stay finite
    if not abs(sums["loss_sum"]) <= most:
        raise RejectedReply(f"loss_sum = {sums['loss_sum']:g} is more than {num_test} float32 losses can add up to")
    for key, builtin in metric_names.items():
        value, high = sums[f"{key}_sum"], (num_test if builtin == "accuracy" else most)
        if not 0 <= value <= high:
            raise RejectedReply(f"{key}_sum = {value:g} is outside [0, {high:g}] for {num_test} samples")
    return sums


def _count(data: Mapping[str, Any], key: str) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RejectedReply(f"{key} = {value!r} is not an integer >= 0")
    return value


def check_query_reply(content: RecordDict, partitions: int | None, sizes: list[int] | None,
                      description: dict[str, Any] | None) -> dict[str, Any]:
    """The node's ``data`` record (with ``label_counts``), or :class:`RejectedReply`. ``partitions``, ``sizes``
    and ``description`` are what the server already knows (``None``: not yet: this reply sets them)."""
    if "data" not in content.config_records or "label-counts" not in content.array_records:
        raise RejectedReply("the query reply has no 'data' or 'label-counts' record")
    data = dict(content.config_records["data"])
    pid, num = _count(data, "partition-id"), _count(data, "num-partitions")
    _count(data, "num-test")
    expected = partitions if partitions is not None else num
    if num != expected or not 0 <= pid < expected:
        raise RejectedReply(f"it claims partition-id {pid} of num-partitions {num}; the federation has {expected}")
    if sizes is not None and _count(data, "num-train") != sizes[pid]:
        raise RejectedReply(f"it claims num-train = {data['num-train']} for partition {pid}, whose size is "
                            f"{sizes[pid]} (run config partition-sizes, or its first answer)")
    _check_description(data)
    counts = _label_counts(content)
    mine = {key: data.get(key) for key in DESCRIPTION} | {"label-classes": int(counts.numel())}
    if description is not None and mine != description:
        raise RejectedReply(f"its data ({mine}) differs from the federation's ({description})")
    _count(data, "num-train")
    return {**data, "label_counts": counts, "description": mine}


def _check_description(data: Mapping[str, Any]) -> None:
    """Task a string, classes an integer, shapes lists of integers >= 1 (the server builds its model from them)."""
    if not isinstance(data.get("task"), str) or isinstance(data.get("num-classes"), bool) or not isinstance(
            data.get("num-classes"), int):
        raise RejectedReply(f"task = {data.get('task')!r} / num-classes = {data.get('num-classes')!r} are not a "
                            "name and an integer")
    for key in ("input-shape", "target-shape"):
        shape = data.get(key)
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1
                                                  for d in shape):
            raise RejectedReply(f"{key} = {shape!r} is not a list of sizes >= 1")


def _label_counts(content: RecordDict) -> Tensor:
    try:
        counts = content.array_records["label-counts"].to_torch_state_dict()["label_counts"]
    except Exception as exc:  # noqa: BLE001 - anything a node can make the decoder raise
        raise RejectedReply(f"label-counts is not a record with label_counts ({type(exc).__name__})") from exc
    if counts.dim() != 1 or counts.dtype != torch.long or bool((counts < 0).any()):
        raise RejectedReply(f"label_counts must be a 1-d int64 histogram >= 0, got {counts.dtype} "
                            f"{list(counts.shape)}")
    return counts.clone()


def honest_output(cfg: Any, info: Mapping[str, Any], records: ClientRecord, label_counts: Tensor,
                  init_params: dict[str, Tensor], server_state: dict[str, Any],
                  statistics: Mapping[str, Tensor] | None = None) -> tuple[ClientOutput, dict[str, Tensor]]:
    """What an honest client of this federation returns, and its BatchNorm statistics (``{}`` without them): the
    algorithm's ``client_update`` for the largest partition, run once on inputs of zeros with that partition's
    shapes from the model's ``statistics`` (only the output's structure is used: keys, shapes, dtypes, metric
    names). Global random state is left as it was."""
    from lightning_fedmeta.data.federated import from_client_tensors
    from lightning_fedmeta.flower.client import LocalClient

    pid = int(records.num_samples.argmax())
    n, task = int(records.num_samples[pid]), str(info["task"])
    tokens = task == "next_token"
    x = torch.zeros(n, *info["input-shape"], dtype=torch.long if tokens else torch.float32)
    y = torch.zeros(n, *info["target-shape"],
                    dtype=torch.long if task in ("classification", "next_token") else torch.float32)
    classes = None if int(info["num-classes"]) < 0 else int(info["num-classes"])
    with torch.random.fork_rng(devices=[]):
        client = LocalClient(cfg, from_client_tensors([(x, y, x[:1], y[:1])], classes, task=task), pid)
        client.bind(records, label_counts)
        state = client.initial_state(init_params, records)
        return client.train(0, init_params, server_state, state, ClientRecord(*(t[pid] for t in records)), n,
                            dict(statistics or {}))
