"""A fedmeta YAML config (the file ``fedmeta fit --config`` reads) read for a Flower deployment.

The ServerApp and every ClientApp read the same file (run config ``fedmeta-config``), so a simulation
config becomes a deployment in one step (docs/deploy.md). The file is parsed the way the ``fedmeta``
command reads it, for the keys a deployment uses:

    seed_everything         torch.manual_seed before the model is built (the initial global model)
    trainer.max_steps       R, the number of rounds
    model.algorithm         a registered name or {name, <hyper-parameters>} (built-in or plugin)
    model.model             {class_path, init_args}, or absent: default_model from the data's shapes
    model.*                 clients_per_round | fraction, aggregation, server_lr, server_optimizer,
                            holdout_clients, seed, loss, metrics (built-in names)
    data.*                  FederatedDataModule arguments (the partition a node trains on: partition-id)

The server runs the simulator's server pipeline (:mod:`lightning_fedmeta.loop.server`), so ``model.aggregator``
(robust rules) and ``model.dp`` (DP-FedAvg: clipping, noise, adaptive clipping) deploy unchanged. The options
that *simulate* unreliable or Byzantine clients are refused: on Flower the failures are real (docs/deploy.md).
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_fedmeta.algorithms.base import Algorithm

__all__ = ["DeploymentConfig", "load_config", "import_object", "UNSUPPORTED_OPTIONS"]

#: model options a deployment refuses, each with the reason (docs/deploy.md, "What is not deployed")
UNSUPPORTED_OPTIONS: dict[str, str] = {
    "client_dropout": "it simulates failures; on Flower failed replies are real and are tolerated",
    "over_selection": "it simulates over-selection of clients that may fail",
    "local_steps_dist": "it simulates stragglers",
    "byzantine": "it simulates attacks",
    "server_lr_scheduler": "a server learning-rate scheduler is not deployed yet",
}

#: model options that only choose how a simulation computes (ignored by a deployment)
EXECUTION_OPTIONS = ("client_batching", "client_chunk_size", "compile_clients", "step_schedule", "cuda_graphs")

_MODULE_OPTIONS = (
    "clients_per_round", "fraction", "aggregation", "server_lr", "holdout_clients", "seed", "loss", "metrics",
    "aggregator", "dp", "compression",
)


def deployed_dp(dp: Any) -> Any:
    """``model.dp`` as a deployment runs it: ``secure_mode`` on unless the config says ``false`` (a deployment's
    model is published, so its noise must not be reproducible from ``model.seed``; docs/security.md)."""
    if isinstance(dp, Mapping) and dp.get("secure_mode") is None:
        return {**dp, "secure_mode": True}
    return dp


def import_object(path: str, option: str) -> Any:
    """The object at ``package.module.name`` or ``package.module:name`` (``option`` names the setting)."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"{option} = {path!r} is not an importable object: {exc}") from exc


def _class_spec(spec: Any, option: str) -> tuple[Callable[..., Any], dict[str, Any]]:
    if isinstance(spec, str):
        return import_object(spec, option), {}
    if not isinstance(spec, dict) or "class_path" not in spec:
        raise ValueError(f"{option} must be {{class_path: ..., init_args: {{...}}}}, got {spec!r}")
    return import_object(spec["class_path"], f"{option}.class_path"), dict(spec.get("init_args") or {})


def _nested_objects(args: dict[str, Any], option: str) -> dict[str, Any]:
    """``args`` with every ``{class_path, init_args}`` value built (recursively), as the command line's parser
    builds them (e.g. the base model inside :class:`~lightning_fedmeta.models.lora.LoRAModel`)."""
    built = {}
    for key, value in args.items():
        if isinstance(value, dict) and "class_path" in value:
            cls, inner = _class_spec(value, f"{option}.{key}")
            value = cls(**_nested_objects(inner, f"{option}.{key}.init_args"))
        built[key] = value
    return built


@dataclass
class DeploymentConfig:
    """What a deployment needs from a fedmeta config (see the module docstring)."""

    path: str
    rounds: int
    seed_everything: int | None
    algorithm_spec: Any
    module_options: dict[str, Any]
    model_spec: Any = None
    server_optimizer_spec: Any = None
    data_options: dict[str, Any] = field(default_factory=dict)
    eval_every: int = 10
    #: ``m``, resolved as ``FederatedModule`` resolves it (:func:`~lightning_fedmeta.frontends.options.check_options`:
    # its
    #: default when neither ``clients_per_round`` nor ``fraction`` is set; ``None`` with ``fraction``)
    clients_per_round: int | None = None

    # -- the pieces ---------------------------------------------------------------------------
    def algorithm(self) -> Algorithm:
        """A fresh instance of the configured algorithm (``model.algorithm``; unknown names raise)."""
        from lightning_fedmeta.registry import create_algorithm

        spec = copy.deepcopy(self.algorithm_spec)
        try:
            if isinstance(spec, str):
                return create_algorithm(spec)
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise ValueError(f"must be a registered name or a mapping with a 'name' key, got {spec!r}")
            name = spec.pop("name")
            return create_algorithm(name, **spec)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"model.algorithm in {self.path}: {exc}") from exc

    @property
    def seed(self) -> int:
        """The module's seed of every draw (``model.seed``)."""
        return int(self.module_options.get("seed", 0))

    def compression(self) -> Any:
        """``model.compression`` parsed (:func:`~lightning_fedmeta.communication.compressors.parse_compression`;
        ``None``: off)."""
        from lightning_fedmeta.communication.compressors import parse_compression

        return parse_compression(self.module_options.get("compression"))

    def build_model(self, data_spec: dict[str, Any]) -> nn.Module:
        """The network, initialised after ``torch.manual_seed(seed_everything)`` (the initial global model).

        ``model.model`` when given, else :func:`~lightning_fedmeta.models.reference.default_model` for ``data_spec``
        (``input_shape``, ``num_classes``, ``task``, ``target_shape``)."""
        from lightning_fedmeta.models.reference import default_model

        if self.seed_everything is not None:
            torch.manual_seed(int(self.seed_everything))
        if self.model_spec is None:  # as FederatedModule._default_model_for
            task = data_spec.get("task") or "classification"
            if task == "classification":
                return default_model(tuple(data_spec["input_shape"]), int(data_spec["num_classes"]))
            return default_model(tuple(data_spec["input_shape"]), data_spec.get("num_classes"), task=task,
                                 target_shape=tuple(data_spec.get("target_shape") or ()))
        cls, args = _class_spec(self.model_spec, "model.model")
        model = cls(**_nested_objects(args, "model.model.init_args"))
        if not isinstance(model, nn.Module):
            raise ValueError(f"model.model must build an nn.Module, got {type(model).__name__}")
        return model

    def server_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        """The server optimizer, as ``FederatedModule.configure_optimizers`` builds it: ``SGD(lr=server_lr)`` or
        ``model.server_optimizer`` (``{class_path: torch.optim.Adam, init_args: {...}}``)."""
        if self.server_optimizer_spec is None:
            return torch.optim.SGD(params, lr=float(self.module_options.get("server_lr", 1.0)))
        cls, args = _class_spec(self.server_optimizer_spec, "model.server_optimizer")
        return cls(params, **args)

    def server_optimizer_factory(self) -> Callable[[Any], torch.optim.Optimizer] | None:
        """``model.server_optimizer`` as the factory ``FederatedModule(server_optimizer=...)`` takes."""
        if self.server_optimizer_spec is None:
            return None
        cls, args = _class_spec(self.server_optimizer_spec, "model.server_optimizer")
        return lambda params: cls(params, **args)

    def datamodule(self) -> Any:
        """The simulation's :class:`~lightning_fedmeta.FederatedDataModule` (``data.*``)."""
        from lightning_fedmeta.data import FederatedDataModule

        return FederatedDataModule(**self.data_options)

    def reference_module(self, model: nn.Module, **overrides: Any) -> Any:
        """The in-process :class:`~lightning_fedmeta.FederatedModule` this deployment equals (for tests);
        ``overrides`` are further module options (e.g. a simulated ``client_dropout``)."""
        from lightning_fedmeta.module import FederatedModule

        return FederatedModule(
            model=model, algorithm=copy.deepcopy(self.algorithm_spec),
            server_optimizer=self.server_optimizer_factory(), **{**self.module_options, **overrides},
        )


def load_config(path: str | Path) -> DeploymentConfig:
    """Read a fedmeta YAML config for a deployment (``ValueError`` naming the option for what it cannot use)."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"fedmeta-config = {str(path)!r}: no such file (give the YAML of `fedmeta fit --config`)")
    raw = yaml.safe_load(p.read_text()) or {}
    if not isinstance(raw, dict):
        raise ValueError(f"fedmeta-config {str(path)!r} must hold a mapping, got {type(raw).__name__}")
    model = dict(raw.get("model") or {})
    trainer = dict(raw.get("trainer") or {})
    data = dict(raw.get("data") or {})
    for name, reason in UNSUPPORTED_OPTIONS.items():
        value = model.get(name)
        if value not in (None, 0, 0.0, "mean", {}):
            raise ValueError(f"model.{name} = {value!r} cannot be deployed on Flower: {reason}; remove it")
    unknown = sorted(set(model) - set(_MODULE_OPTIONS) - set(EXECUTION_OPTIONS) - set(UNSUPPORTED_OPTIONS)
                     - {"algorithm", "model", "server_optimizer"})
    if unknown:
        raise ValueError(f"unknown model options {unknown} in {str(path)!r} for a Flower deployment")
    metrics = model.get("metrics")
    if isinstance(metrics, dict) and not all(isinstance(v, str) for v in metrics.values()):
        raise ValueError(f"model.metrics must be built-in metric names on Flower, got {metrics!r}")
    rounds = trainer.get("max_steps")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"trainer.max_steps (the number of rounds) must be an integer >= 1, got {rounds!r}")
    if "algorithm" not in model:
        raise ValueError(f"model.algorithm is missing in {str(path)!r}")
    seed_everything = raw.get("seed_everything")
    if seed_everything is not None and (isinstance(seed_everything, bool) or not isinstance(seed_everything, int)):
        raise ValueError(f"seed_everything must be an integer, got {seed_everything!r}")
    cfg = DeploymentConfig(
        path=str(p.resolve()),
        rounds=rounds,
        seed_everything=seed_everything,
        algorithm_spec=model["algorithm"],
        module_options={k: model[k] for k in _MODULE_OPTIONS if k in model},
        model_spec=model.get("model"),
        server_optimizer_spec=model.get("server_optimizer"),
        data_options=data,
        eval_every=int(data.get("eval_every", 10)),
    )
    cfg.clients_per_round = check_module_options(cfg, model)
    return cfg


def check_module_options(cfg: DeploymentConfig, model: dict[str, Any]) -> int | None:
    """Run the checks ``FederatedModule.__init__`` runs on the same options, with the same messages
    (:func:`~lightning_fedmeta.frontends.options.check_options`,
    :func:`~lightning_fedmeta.frontends.options.check_server_optimizer`,
    the metrics and the reliability options), so a config the simulator refuses is refused here too, before any
    node is contacted (``clients_per_round: 0`` or ``-2`` would otherwise run). Returns ``clients_per_round`` as
    the module resolves it (its default when neither it nor ``fraction`` is set)."""
    from lightning_fedmeta.evaluation.metrics import ClientMetrics
    from lightning_fedmeta.frontends.options import check_options, check_server_optimizer
    from lightning_fedmeta.reliability.options import Reliability

    server_lr = model.get("server_lr", 1.0)
    if isinstance(server_lr, bool) or not isinstance(server_lr, int | float):
        raise ValueError(f"server_lr must be a finite number >= 0, got {server_lr!r}")
    clients_per_round = check_options(
        clients_per_round=model.get("clients_per_round"), fraction=model.get("fraction"),
        aggregation=model.get("aggregation", "samples"), server_lr=server_lr, factories={},
        client_batching=model.get("client_batching", "auto"), client_chunk_size=model.get("client_chunk_size", "auto"),
        step_schedule=model.get("step_schedule", "auto"),
        client_state="auto", client_state_dir=None,
    )
    metrics = model.get("metrics")
    if metrics is not None:
        if not isinstance(metrics, dict) or not metrics:
            raise ValueError(f"metrics must be a non-empty mapping {{name: metric}}, got {metrics!r}")
        ClientMetrics(metrics, 1)
    algorithm = cfg.algorithm()  # an unknown algorithm or hyper-parameter fails here, naming model.algorithm
    check_server_optimizer(algorithm, server_lr, cfg.server_optimizer_spec, None)
    Reliability.from_options(aggregator=model.get("aggregator"), dp=model.get("dp"),
                             compression=model.get("compression"))
    return clients_per_round
