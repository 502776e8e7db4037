"""The module's options checked before any data is seen, the algorithm built from its spec, and the model,
loss and metrics checked against the data before round 1 (docs/design.md, contract 8)."""

from __future__ import annotations

import importlib
import inspect
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_fedmeta.algorithms.base import Algorithm
from lightning_fedmeta.client.functional import model_logits
from lightning_fedmeta.client.losses import DEFAULT_LOSS, LOSSES, PerSampleLoss, loss_name, resolve_loss
from lightning_fedmeta.data.federated import FederatedData
from lightning_fedmeta.evaluation.metrics import BUILTIN_METRICS, DEFAULT_METRICS, ClientMetrics, MetricSpec
from lightning_fedmeta.loop.schedule import SCHEDULES
from lightning_fedmeta.models.reference import default_model
from lightning_fedmeta.registry import create_algorithm, load_algorithm

__all__ = [
    "BoundModel", "FederatedSetupError", "bind_model", "build_algorithm", "check_model_outputs", "check_options",
    "check_server_optimizer", "default_model_for", "resolve_loss_option", "resolved_algorithm_spec",
    "server_optimizer_config", "unsaved_arguments", "warn_if_optimizer_ignored",
]


class FederatedSetupError(ValueError):
    """The module's options do not fit the data it is set up with (found in ``setup``, before round 1): e.g.
    more clients per round than training clients, a ``local_steps_dist`` list of the wrong length, a robust
    aggregator the round's size cannot support. The ``fedmeta`` command prints the message alone (status 2)."""


def build_algorithm(spec: str | dict[str, Any] | Algorithm) -> Algorithm:
    """An :class:`Algorithm` from a registered name, a mapping ``{name: ..., <hyper-parameters>}`` or itself."""
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


def resolved_algorithm_spec(spec: Any) -> Any:
    """``model.algorithm`` with every hyper-parameter of the registered algorithm filled in with its declared
    default, so a printed or saved configuration says what ran: ``"fedavg"`` → ``{name: fedavg, local_lr: 0.05,
    local_steps: 10, ..., finetune_lr: null}``. A default of ``None`` stays ``None`` (it means "derived", e.g.
    ``finetune_lr`` follows ``local_lr``), so editing the printed file behaves as editing the short one. Anything
    that is not a registered name or a ``{name: ...}`` mapping (an :class:`Algorithm`, a ``class_path``) is returned
    as it is, and so is a spec whose name is not registered (the module's own check names it)."""
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or "class_path" in spec:
        return spec
    try:
        cls = load_algorithm(spec["name"])
    except (KeyError, ValueError, ImportError):
        return spec
    params = inspect.signature(cls.__init__).parameters
    plain = {n: p.default for n, p in params.items()
             if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
             and (p.default is None or isinstance(p.default, (bool, int, float, str)))}
    return {"name": spec["name"], **plain, **{k: v for k, v in spec.items() if k != "name"}}


def warn_if_optimizer_ignored(model: nn.Module, algorithm: Algorithm) -> None:
    """A user's ``LightningModule`` as the model: its ``configure_optimizers`` and learning rate are not used (the
    clients' local optimizer is the algorithm's, the server's is ``model.server_optimizer``); say so once, naming
    the option that sets the local rate and its value."""
    from lightning.pytorch import LightningModule

    if not isinstance(model, LightningModule):
        return
    own = type(model).configure_optimizers is not LightningModule.configure_optimizers
    rate = _learning_rate_of(model)
    if not own and rate is None:
        return
    local = getattr(algorithm, "local_lr", None)
    used = (f"model.algorithm.local_lr = {local:g} ({type(algorithm).__name__}'s local rate)" if local is not None
            else f"the local step of {type(algorithm).__name__} (its hyper-parameters in model.algorithm)")
    what = " and ".join(x for x in ("configure_optimizers" if own else "", f"lr = {rate:g}" if rate else "") if x)
    rank_zero_warn(f"[lightning_fedmeta] {type(model).__name__}'s {what} are not used: each client trains with "
                   f"{used}; the server step is model.server_optimizer / model.server_lr", category=UserWarning)


def _learning_rate_of(model: nn.Module) -> float | None:
    """A LightningModule's learning rate: its ``lr`` / ``learning_rate`` attribute or hyper-parameter."""
    hparams = getattr(model, "hparams", None) or {}
    for value in [getattr(model, k, None) for k in ("lr", "learning_rate")] + [hparams.get(k) for k in
                                                                               ("lr", "learning_rate")]:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def default_model_for(spec: dict[str, Any]) -> nn.Module:
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
    module_name, _, attr = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"loss {path!r} is neither a built-in loss ({sorted(LOSSES)}) nor an importable "
                         f"callable: {exc}") from exc
    if not callable(obj):
        raise ValueError(f"loss {path!r} is not callable")
    return obj


def resolve_loss_option(loss: Any) -> Any:
    """``loss`` as given, with an import path replaced by the callable it names (a built-in name stays a name)."""
    if isinstance(loss, str) and loss not in LOSSES and "." not in loss:
        raise ValueError(
            f"unknown loss {loss!r}; choose one of {sorted(LOSSES)}, an import path (package.module.function), "
            "a torch.nn loss module or a callable"
        )
    if isinstance(loss, str) and loss not in LOSSES:
        return _import_callable(loss)
    return loss


def check_options(*, clients_per_round: int | None, fraction: float | None, aggregation: str, server_lr: float,
                  factories: Mapping[str, Any], client_batching: str, client_chunk_size: int | str | None,
                  client_state: str, client_state_dir: Any, step_schedule: str = "auto",
                  metrics: Any = None) -> int | None:
    """Refuse impossible module options; returns ``clients_per_round`` (10 when neither it nor ``fraction``).
    ``metrics`` (names, built-ins and torchmetrics states) are checked now, before any data."""
    if fraction is not None and clients_per_round is not None:
        raise ValueError(f"give clients_per_round or fraction, not both (got clients_per_round={clients_per_round!r}, "
                         f"fraction={fraction!r})")
    if fraction is not None:
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
    else:
        clients_per_round = 10 if clients_per_round is None else clients_per_round
        if isinstance(clients_per_round, bool) or not isinstance(clients_per_round, int) or clients_per_round < 1:
            raise ValueError(f"clients_per_round must be an integer >= 1 (or set fraction), got {clients_per_round!r}")
    if aggregation not in ("samples", "uniform"):
        raise ValueError(f"aggregation must be 'samples' or 'uniform', got {aggregation!r}")
    if not server_lr >= 0 or server_lr == math.inf:
        raise ValueError(f"server_lr must be a finite number >= 0, got {server_lr!r}")
    for label, factory in factories.items():
        if factory is not None and not callable(factory):
            raise ValueError(f"{label} must be a callable (a torch.optim factory), got {factory!r}")
    if client_batching not in ("auto", "vmap", "loop"):
        raise ValueError(f"client_batching must be 'auto', 'vmap' or 'loop', got {client_batching!r}")
    if client_chunk_size is not None and client_chunk_size != "auto" and (
            isinstance(client_chunk_size, bool) or not isinstance(client_chunk_size, int) or client_chunk_size < 1):
        raise ValueError(f"client_chunk_size must be an integer >= 1, 'auto' or null, got {client_chunk_size!r}")
    if step_schedule not in SCHEDULES:
        raise ValueError(f"step_schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {step_schedule!r}")
    if client_state not in ("auto", "memory", "disk"):
        raise ValueError(f"model.client_state must be 'auto', 'memory' or 'disk', got {client_state!r}")
    if client_state_dir is not None and not isinstance(client_state_dir, str | os.PathLike):
        raise ValueError(f"model.client_state_dir must be a folder path, got {client_state_dir!r}")
    if metrics is not None:
        if not isinstance(metrics, Mapping) or not metrics:
            raise ValueError(f"metrics must be a non-empty mapping {{name: metric}}, got {metrics!r}")
        ClientMetrics(metrics, 1)
    return clients_per_round


def check_server_optimizer(algorithm: Algorithm, server_lr: float, server_optimizer: Any, scheduler: Any) -> None:
    """Refuse a server optimizer, scheduler or ``server_lr != 1`` for an algorithm whose server step is exact."""
    if type(algorithm).server_optimizer_applies or (server_optimizer is None and server_lr == 1.0
                                                     and scheduler is None):
        return
    name = type(algorithm).name or type(algorithm).__name__
    raise ValueError(
        f"{name} updates its models outside the server optimizer (its server step is exact, e.g. a cluster or mean "
        "update), so a server_optimizer, a server_lr_scheduler or a server_lr other than 1 would silently do "
        f"nothing to them; remove them for {name} (got server_lr={server_lr!r}, "
        f"server_optimizer={'set' if server_optimizer is not None else None}, "
        f"server_lr_scheduler={'set' if scheduler is not None else None})"
    )


def unsaved_arguments(algorithm: Any, loss: Any, metrics: Mapping[str, Any] | None) -> list[str]:
    """The arguments left out of the checkpoint's hyper-parameters: only plain values go there, so the file loads
    with ``torch.load(weights_only=True)``. A custom model is passed again to ``load_from_checkpoint(path,
    model=...)``; ``model=None`` is rebuilt from the checkpoint's data spec."""
    ignore = ["model", "server_optimizer", "server_lr_scheduler"]
    ignore += ["algorithm"] if isinstance(algorithm, Algorithm) else []
    ignore += ["loss"] if loss is not None and not isinstance(loss, str) else []
    ignore += ["metrics"] if metrics is not None and not all(isinstance(v, str) for v in metrics.values()) else []
    return ignore


def _model_output(model: nn.Module, x: Tensor) -> Tensor:
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            return model_logits(model(x))
    except Exception as exc:  # noqa: BLE001 - reported with the shapes
        raise ValueError(f"the model cannot take this data's inputs: a batch of shape {tuple(x.shape)} ({x.dtype}) "
                         f"raised {type(exc).__name__}: {exc}") from exc
    finally:
        model.train(was_training)


def check_model_outputs(model: nn.Module, data: FederatedData, loss: PerSampleLoss, loss_label: str,
                        specs: Mapping[str, MetricSpec]) -> None:
    """The model must take the data's inputs, and the loss and built-in metrics its outputs with the data's
    targets, giving one finite value per sample (checked once, on 2 samples, before training)."""
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    x, y = data.train_x[:2].to(device), data.train_y[:2].to(device)
    out = _model_output(model, x)
    shape = tuple(getattr(out, "shape", ()))
    if not isinstance(out, Tensor) or out.dim() == 0 or out.shape[0] != x.shape[0]:
        raise ValueError(f"the model's output must be a tensor with one row per sample; got {type(out).__name__} of "
                         f"shape {shape} for a batch of {x.shape[0]}")
    if data.task == "classification" and (out.dim() != 2 or out.shape[-1] != data.num_classes):
        raise ValueError(f"the model's output has shape {shape} for a batch of {x.shape[0]}, but the data has "
                         f"{data.num_classes} classes: its last layer must output {data.num_classes} logits per sample")
    try:
        with torch.no_grad():
            values = loss(out, y)
    except Exception as exc:  # noqa: BLE001 - reported with the shapes
        raise ValueError(f"the loss {loss_label!r} cannot take the model's outputs {shape} with the data's "
                         f"{data.task} targets {tuple(y.shape)} ({y.dtype}): {type(exc).__name__}: {exc}") from exc
    if not isinstance(values, Tensor) or tuple(values.shape) != (x.shape[0],):
        raise ValueError(f"the loss {loss_label!r} must give one value per sample (shape [{x.shape[0]}]), got "
                         f"{tuple(getattr(values, 'shape', ()))}; a torch.nn loss needs reduction='none'")
    for key, spec in specs.items():
        if not isinstance(spec, str):
            continue
        try:
            v = BUILTIN_METRICS[spec].per_sample(out, y)
        except Exception as exc:  # noqa: BLE001 - reported with the shapes
            raise ValueError(f"metric {key!r} cannot take the model's outputs {shape} with targets {tuple(y.shape)} "
                             f"({y.dtype}): {type(exc).__name__}: {exc}") from exc
        if tuple(v.shape) != (x.shape[0],):
            raise ValueError(f"metric {key!r} gives shape {tuple(v.shape)} for {x.shape[0]} samples")


@dataclass(frozen=True)
class BoundModel:
    """The model, loss and metrics a module trains with on one federation (:func:`bind_model`)."""

    model: nn.Module
    per_sample_loss: PerSampleLoss
    loss_name: str
    metric_specs: dict[str, MetricSpec]


def bind_model(model: nn.Module | None, loss: Any, metrics: Mapping[str, MetricSpec] | None, data: FederatedData,
               algorithm: Algorithm) -> BoundModel:
    """The module's model, loss and metrics on ``data``, checked before round 1: ``model`` (``None``: the default
    of the data's spec), the loss option (``None``: the model's ``federated_loss``, else the task's default loss),
    the metrics (``None``: the task's defaults); the model's outputs are checked against loss and metrics, and a
    learning rate the model carries that the algorithm ignores is warned about."""
    task = str(data.task)
    if model is None:
        model = default_model_for({"input_shape": list(data.input_shape), "num_classes": data.num_classes,
                                   "task": data.task, "target_shape": list(data.target_shape)})
    if loss is None and callable(getattr(model, "federated_loss", None)):
        loss = model.federated_loss
    per_sample_loss = resolve_loss(loss, task)
    name = loss_name(loss) if loss is not None else DEFAULT_LOSS[task]
    specs = dict(metrics) if metrics is not None else dict(DEFAULT_METRICS[task])
    check_model_outputs(model, data, per_sample_loss, name, specs)
    warn_if_optimizer_ignored(model, algorithm)
    return BoundModel(model, per_sample_loss, name, specs)


def server_optimizer_config(model: nn.Module, server_lr: float, server_optimizer: Any, scheduler: Any) -> Any:
    """``configure_optimizers``' value: ``server_optimizer(params)`` or ``SGD(params, lr=server_lr)``, with the
    scheduler stepped every round when one is given. ``params`` are the trainable parameters (``requires_grad``):
    frozen ones are never stepped and hold no optimizer state."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = server_optimizer(params) if server_optimizer else torch.optim.SGD(params, lr=server_lr)
    if scheduler is None:
        return optimizer
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler(optimizer), "interval": "step"}}
