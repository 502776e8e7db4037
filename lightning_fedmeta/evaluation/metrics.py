"""Personalised evaluation metrics: any metric per client, summarised three ways.

Each client ``c`` is evaluated with its own model on its own test set of ``n_c`` samples, giving
one value ``m_c`` per metric. Reported for every metric and for the loss (docs/design.md,
contract 6):

* ``{m}_weighted`` = ``Σ_c n_c m_c / Σ_c n_c``   (sample-weighted mean; for accuracy this is
  ``Σ_c correct_c / Σ_c n_c``, the accuracy over all test samples)
* ``{m}_mean``     = ``(1/K) Σ_c m_c``            (every client counts once)
* ``{m}_worst10``  = the mean of the worst ⌈K/10⌉ clients' values (worst decile), where worst
  follows the metric's direction (``higher_is_better``): the lowest accuracies, the highest errors.

A metric is either

* a **built-in** name (:data:`BUILTIN_METRICS`: ``accuracy``, ``mse``, ``mae``, ``rmse``,
  ``perplexity``): a per-sample value computed inside the batched evaluation (no per-client
  Python work), kept per client as a masked sum, then ``m_c = finalize(sum_c / n_c)``; or
* any **torchmetrics** ``Metric`` (e.g. ``MulticlassF1Score(num_classes=10)``): one copy per
  client, updated with that client's real (unpadded) outputs and targets. Its state must be
  fixed-size tensors (a metric that stores every prediction in a list, such as ``AUROC`` without
  ``thresholds``, is refused: give it ``thresholds``). Outputs with positions (``[n, T, C]``
  scores for ``[n, T]`` tokens) are flattened to one row per position first. A classification metric
  (torchmetrics.classification, e.g. ``MultilabelAUROC``) gets whole-number float targets (multi-label
  0/1 rows) as ``long``, the dtype it needs; other metrics get the targets as they are.

Processes of a multi-process run each evaluate a disjoint set of clients; every per-client state
row is written by exactly one process, so a zero-filled all-reduce (a sum) gives every process
every client's state exactly, whatever the metric's own reduction is.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_fedmeta.client.losses import aligned, cross_entropy, per_sample

__all__ = [
    "BUILTIN_METRICS",
    "DEFAULT_METRICS",
    "BuiltinMetric",
    "ClientMetrics",
    "MetricSpec",
    "summarize",
    "summarize_clients",
]

MetricSpec = str | Metric


@dataclass(frozen=True)
class BuiltinMetric:
    """A metric whose per-client value is ``finalize(Σ_j m_j v_j / Σ_j m_j)`` of per-sample values ``v_j``."""

    per_sample: Callable[[Tensor, Tensor], Tensor]
    higher_is_better: bool
    finalize: Callable[[Tensor], Tensor] | None = None  # None: the value is the mean itself (additive)
    description: str = ""


def _accuracy(outputs: Tensor, targets: Tensor) -> Tensor:
    """Class ids: ``1[argmax z = y]`` (the mean over positions for sequences); multi-label (float
    0/1 targets): the fraction of labels with ``1[z > 0] = y``."""
    if targets.is_floating_point():
        return per_sample(((aligned(outputs, targets) > 0) == (targets > 0.5)).to(torch.float32))
    return per_sample((outputs.argmax(-1) == targets).to(torch.float32))


def _squared_error(outputs: Tensor, targets: Tensor) -> Tensor:
    return per_sample((aligned(outputs, targets).float() - targets.float()) ** 2)


def _absolute_error(outputs: Tensor, targets: Tensor) -> Tensor:
    return per_sample((aligned(outputs, targets).float() - targets.float()).abs())


BUILTIN_METRICS: dict[str, BuiltinMetric] = {
    "accuracy": BuiltinMetric(_accuracy, True, description="fraction correct (argmax; multi-label: per label)"),
    "mse": BuiltinMetric(_squared_error, False, description="mean squared error"),
    "mae": BuiltinMetric(_absolute_error, False, description="mean absolute error"),
    "rmse": BuiltinMetric(_squared_error, False, torch.sqrt, "root of the client's mean squared error"),
    "perplexity": BuiltinMetric(cross_entropy, False, torch.exp, "exp of the client's mean cross-entropy"),
}

#: The metrics reported when none are given, by task (``FederatedData.task``).
DEFAULT_METRICS: dict[str, dict[str, str]] = {
    "classification": {"acc": "accuracy"},
    "next_token": {"acc": "accuracy"},
    "multilabel": {"acc": "accuracy"},
    "regression": {"mae": "mae"},
}


def summarize(
    values: Tensor, counts: Tensor, higher_is_better: bool, sums: Tensor | None = None
) -> dict[str, Tensor]:
    """``weighted`` (by ``counts``), ``mean`` and ``worst10`` (worst decile by direction) of per-client values.

    For a mean metric (``values = sums / counts``) pass ``sums``: the weighted mean is then computed as
    ``Σ sums / Σ counts``, the same number without the round trip through the per-client ratios.
    Clients whose value is undefined (NaN: a metric that is 0/0 on their test set) are left out of all
    three; all NaN gives NaN.
    """
    if values.numel() == 0:
        raise ValueError("no client to summarize")
    v = values.to(torch.float64)
    n = counts.to(torch.float64)
    defined = ~torch.isnan(v)
    if not bool(defined.all()):  # e.g. a kappa or F1 that is 0/0 on a client: left out of all three summaries
        if not bool(defined.any()):
            nan = torch.tensor(math.nan, dtype=torch.float64, device=v.device)
            return {"weighted": nan, "mean": nan, "worst10": nan.clone()}
        v, n = v[defined], n[defined]
        sums = None if sums is None else sums[defined]
    worst = max(1, math.ceil(v.numel() / 10))
    ordered = v.sort(descending=not higher_is_better).values
    pooled = (n * v).sum() if sums is None else sums.to(torch.float64).sum()
    return {
        "weighted": pooled / n.sum().clamp_min(1),
        "mean": v.mean(),
        "worst10": ordered[:worst].mean(),
    }


def summarize_clients(correct: Tensor, total: Tensor, loss_sum: Tensor) -> dict[str, Tensor]:
    """The weighted mean, unweighted mean and worst decile of per-client accuracy and loss from sums
    (``acc_*`` and ``loss_*``), as :class:`ClientMetrics` reports them for the default metrics."""
    n = total.to(torch.float64)
    out: dict[str, Tensor] = {}
    for name, sums, higher in (("acc", correct, True), ("loss", loss_sum, False)):
        for key, value in summarize(sums.to(torch.float64) / n.clamp_min(1), n, higher, sums).items():
            out[f"{name}_{key}"] = value
    return out


def _flatten_positions(outputs: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """``[n, *pos, C]`` scores with ``[n, *pos]`` class ids -> one row per position (torchmetrics' layout)."""
    if not targets.is_floating_point() and targets.dim() >= 2 and outputs.dim() == targets.dim() + 1:
        return outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1)
    if outputs.shape != targets.shape and outputs.numel() == targets.numel():
        return outputs.reshape(targets.shape), targets
    return outputs, targets


def _wants_class_ids(metric: Metric) -> bool:
    """Whether ``metric`` is one of torchmetrics' classification metrics (or a subclass of one): they take integer
    targets, and the binned curves and AUROC refuse float ones."""
    return any(cls.__module__.startswith("torchmetrics.classification") for cls in type(metric).__mro__)


def _class_ids(target: Tensor) -> Tensor:
    """Float targets holding whole numbers (multi-label 0/1 rows, kept as float for the loss) as ``long``; any
    other target as it is (soft labels stay float, for torchmetrics to accept or refuse)."""
    if target.is_floating_point() and bool(torch.equal(target, target.round())):
        return target.long()
    return target


class ClientMetrics:
    """Per-client metric states for ``num_clients`` clients, with checkpointable stacked state.

    Args:
        metrics: ``{key: spec}``: a built-in name (:data:`BUILTIN_METRICS`) or a torchmetrics ``Metric``
            (copied once per client). Keys name the logged values (``{stage}/{key}_weighted``...).
        num_clients: ``K``.

    State: ``total [K]`` (test samples), ``loss_sum [K]``, ``builtin [K, B]`` (masked sums of the
    built-in metrics' per-sample values) and, per torchmetrics metric, its states stacked ``[K, ...]``.
    """

    def __init__(self, metrics: Mapping[str, MetricSpec], num_clients: int) -> None:
        if num_clients < 1:
            raise ValueError(f"num_clients must be >= 1, got {num_clients}")
        self.num_clients = num_clients
        self.builtin: dict[str, BuiltinMetric] = {}
        self.torchmetrics: dict[str, list[Metric]] = {}
        self.directions: dict[str, bool] = {}
        for key, spec in metrics.items():
            if not isinstance(key, str) or not key or "/" in key or key == "loss":
                raise ValueError(f"metric names must be non-empty strings without '/' and not 'loss', got {key!r}")
            if isinstance(spec, str):
                if spec not in BUILTIN_METRICS:
                    raise ValueError(
                        f"metric {key!r}: unknown built-in metric {spec!r}; choose one of {sorted(BUILTIN_METRICS)} "
                        "or give a torchmetrics Metric"
                    )
                self.builtin[key] = BUILTIN_METRICS[spec]
                self.directions[key] = BUILTIN_METRICS[spec].higher_is_better
            elif isinstance(spec, Metric):
                self._check_torchmetric(key, spec)
                self.torchmetrics[key] = [self._client_copy(spec) for _ in range(num_clients)]
                self.directions[key] = bool(spec.higher_is_better)
            else:
                raise ValueError(
                    f"metric {key!r} must be a built-in name or a torchmetrics Metric, got {type(spec).__name__}"
                )
        self.directions["loss"] = False
        self.device = torch.device("cpu")
        self.reset()

    @staticmethod
    def _check_torchmetric(key: str, metric: Metric) -> None:
        lists = [name for name, default in metric._defaults.items() if not isinstance(default, Tensor)]
        if lists:
            raise ValueError(
                f"metric {key!r} ({type(metric).__name__}) keeps its state in a growing list ({', '.join(lists)}: "
                "it stores every prediction), which cannot be kept per client and checkpointed as a tensor; use a "
                "binned form (e.g. `thresholds=100` for curves and AUROC) or a metric with tensor states"
            )
        if metric.higher_is_better is None:
            raise ValueError(
                f"metric {key!r} ({type(metric).__name__}) does not say whether higher is better "
                "(`higher_is_better` is None), so its worst decile is undefined; subclass it and set "
                "`higher_is_better = True` or `False`"
            )

    @staticmethod
    def _client_copy(metric: Metric) -> Metric:
        clone = copy.deepcopy(metric)
        clone.reset()
        clone.sync_on_compute = False  # states are combined across processes by ClientMetrics.sync
        clone.dist_sync_on_step = False
        return clone

    # -- state --------------------------------------------------------------------------------------
    @property
    def needs_outputs(self) -> bool:
        """Whether the evaluation must return the clients' outputs (torchmetrics metrics are updated on the host)."""
        return bool(self.torchmetrics)

    def builtin_functions(self) -> list[Callable[[Tensor, Tensor], Tensor]]:
        """The per-sample functions of the built-in metrics, in the column order of the ``builtin`` state."""
        return [m.per_sample for m in self.builtin.values()]

    def reset(self) -> None:
        k = self.num_clients
        self.total = torch.zeros(k, dtype=torch.float64, device=self.device)
        self.loss_sum = torch.zeros(k, dtype=torch.float64, device=self.device)
        self.builtin_sums = torch.zeros(k, len(self.builtin), dtype=torch.float64, device=self.device)
        for clones in self.torchmetrics.values():
            for m in clones:
                m.reset()

    def to(self, device: torch.device | str) -> ClientMetrics:
        self.device = torch.device(device)
        self.total = self.total.to(self.device)
        self.loss_sum = self.loss_sum.to(self.device)
        self.builtin_sums = self.builtin_sums.to(self.device)
        for key, clones in self.torchmetrics.items():
            self.torchmetrics[key] = [m.to(self.device) for m in clones]
        return self

    def update(self, clients: Tensor, sums: Mapping[str, Tensor]) -> None:
        """Add the in-graph sums of the listed clients: ``total``, ``loss_sum`` and ``builtin [C, B]``."""
        idx = clients.to(self.device)
        self.total.index_add_(0, idx, sums["total"].to(self.total))
        self.loss_sum.index_add_(0, idx, sums["loss_sum"].to(self.loss_sum))
        if self.builtin:
            self.builtin_sums.index_add_(0, idx, sums["builtin"].to(self.builtin_sums))

    def update_outputs(self, clients: Tensor, outputs: Tensor, targets: Tensor, mask: Tensor) -> None:
        """Update each listed client's torchmetrics copies with its real rows of ``outputs``/``targets``
        (``[C, W, ...]``, ``mask [C, W]``)."""
        for row, client in enumerate(clients.tolist()):
            real = mask[row] > 0
            preds, target = _flatten_positions(outputs[row][real].float(), targets[row][real])
            as_ids = _class_ids(target)
            for clones in self.torchmetrics.values():
                metric = clones[client]
                metric.update(preds, as_ids if _wants_class_ids(metric) else target)

    def state_dict(self) -> dict[str, Tensor]:
        """Every per-client state, stacked over clients (one ``[K, ...]`` tensor per entry)."""
        out = {"total": self.total, "loss_sum": self.loss_sum, "builtin": self.builtin_sums}
        for key, clones in self.torchmetrics.items():
            for name in clones[0]._defaults:
                out[f"torchmetrics/{key}/{name}"] = torch.stack([getattr(m, name) for m in clones])
        return {k: v.detach().clone() for k, v in out.items()}

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        """Restore :meth:`state_dict`'s tensors (the metric keys and ``K`` must match)."""
        expected = set(self.state_dict())
        if set(state) != expected or state["total"].numel() != self.num_clients:
            raise ValueError(
                f"the saved evaluation metrics ({sorted(state)}, {state['total'].numel()} clients) do not match this "
                f"module's ({sorted(expected)}, {self.num_clients} clients): evaluate with the same metrics"
            )
        self.total = state["total"].to(self.device, torch.float64).clone()
        self.loss_sum = state["loss_sum"].to(self.device, torch.float64).clone()
        self.builtin_sums = state["builtin"].to(self.device, torch.float64).clone()
        for key, clones in self.torchmetrics.items():
            for name in clones[0]._defaults:
                stacked = state[f"torchmetrics/{key}/{name}"].to(self.device)
                for c, m in enumerate(clones):
                    setattr(m, name, stacked[c].clone())
                    m._update_count = int(self.total[c] > 0)  # compute() warns on a metric never updated
                    m._computed = None

    def sync(self, owned: Tensor, all_reduce: Callable[[Tensor], Tensor] | None) -> None:
        """Give every process every client's state: rows not in ``owned`` are zeroed, then summed across
        processes (each row is owned by exactly one process). ``all_reduce=None``: one process, nothing to do."""
        if all_reduce is None:
            return
        keep = torch.zeros(self.num_clients, dtype=torch.bool, device=self.device)
        keep[owned.to(self.device)] = True
        reduced = {}
        for key, value in self.state_dict().items():
            mask = keep.reshape(-1, *([1] * (value.dim() - 1)))
            reduced[key] = all_reduce(torch.where(mask, value, torch.zeros_like(value)))
        self.load_state_dict(reduced)

    # -- values ------------------------------------------------------------------------------------
    def per_client(self) -> dict[str, Tensor]:
        """``{key: [K] float64}`` for every metric, plus ``loss`` and ``total`` (NaN for a client without samples)."""
        n = self.total
        safe = n.clamp_min(1)
        out: dict[str, Tensor] = {}
        for col, (key, metric) in enumerate(self.builtin.items()):
            mean = self.builtin_sums[:, col] / safe
            out[key] = mean if metric.finalize is None else metric.finalize(mean)
        for key, clones in self.torchmetrics.items():
            values = torch.full((self.num_clients,), math.nan, dtype=torch.float64, device=self.device)
            for c, m in enumerate(clones):
                if n[c] > 0:
                    values[c] = float(m.compute())
            out[key] = values
        out["loss"] = self.loss_sum / safe
        out["total"] = n.clone()
        return out

    def summaries(self, groups: Mapping[str, Tensor]) -> dict[str, dict[str, Any]]:
        """``{group: {"{key}_weighted": ..., "{key}_mean": ..., "{key}_worst10": ...}}`` for each non-empty
        named group of client indices, plus ``"_per_client"``: :meth:`per_client`."""
        per_client = self.per_client()
        additive = {key: self.builtin_sums[:, col] for col, (key, m) in enumerate(self.builtin.items())
                    if m.finalize is None}
        additive["loss"] = self.loss_sum
        out: dict[str, dict[str, Any]] = {}
        for group, idx in groups.items():
            if idx.numel() == 0:
                continue
            i = idx.to(self.device)
            values: dict[str, Tensor] = {}
            for key, higher in self.directions.items():
                sums = additive[key][i] if key in additive else None
                for stat, v in summarize(per_client[key][i], self.total[i], higher, sums).items():
                    values[f"{key}_{stat}"] = v
            out[group] = values
        out["_per_client"] = per_client
        return out
