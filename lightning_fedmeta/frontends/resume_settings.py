"""Resume-settings checks: a checkpoint's settings compared with the module it is loaded into.

:func:`check_resume_settings` compares a checkpoint's hyper-parameters (the module's, the algorithm's and the
datamodule's) with the module it is loaded into: every setting must match, except those on the allow-lists
:data:`CHANGEABLE_MODEL_SETTINGS`, :data:`CHANGEABLE_DATA_SETTINGS` (and, for evaluation only,
:data:`EVALUATION_ONLY_SETTINGS`); trainer settings (:data:`REPORTED_TRAINER_SETTINGS`) always come from the new
run and are reported when they changed. :func:`load_module_checkpoint` loads a module's checkpoint under these
checks.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_fedmeta.data.federated import FederatedData
from lightning_fedmeta.persistence.checksums import CHECKSUM_KEY, VERIFIED_MARK, _qualname, verify_checkpoint
from lightning_fedmeta.persistence.safe_loading import (
    CheckpointSettingsError,
    code_or_path_message,
    code_or_path_settings,
    load_checkpoint_file,
    plain_value,
    signature_defaults,
)

__all__ = [
    "ResumeCandidate",
    "CHANGEABLE_DATA_SETTINGS",
    "CHANGEABLE_MODEL_SETTINGS",
    "canonical_setting",
    "canonical_settings",
    "EVALUATION_ONLY_SETTINGS",
    "REPORTED_TRAINER_SETTINGS",
    "RUN_RECORD_KEYS",
    "SettingDifference",
    "check_resume_settings",
    "compare_algorithms",
    "compare_settings",
    "describe_algorithm",
    "describe_server_optimizer",
    "fedmeta_run_record",
    "incomplete_record_message",
    "load_module_checkpoint",
    "loading_path",
    "run_settings",
    "settings_message",
]


#: module settings that may differ on resume, each with the reason: they change how the rounds are executed,
#: not what they compute (results agree to rounding; bit for bit only when unchanged)
CHANGEABLE_MODEL_SETTINGS: dict[str, str] = {
    "client_batching": "how clients are executed (vmap or loop)",
    "client_chunk_size": "how many clients one vmap call runs",
    "compile_clients": "whether the client steps are compiled",
    "step_schedule": "which clients run their local epochs together",
    "cuda_graphs": "whether the client steps are replayed from CUDA graphs",
    "client_state": "where the client state rows are kept (memory or disk; the same values)",
    "client_state_dir": "the folder of the disk-backed client state",
}


#: datamodule settings that may differ on resume
CHANGEABLE_DATA_SETTINGS: dict[str, str] = {
    "root": "where the data files are",
    "download": "whether missing files are fetched",
    "eval_every": "the evaluation schedule (training is the same)",
    "eval_clients": "which clients the validations score (training is the same)",
}


#: settings that may differ when a checkpoint is only evaluated (validate, test, load_from_checkpoint)
EVALUATION_ONLY_SETTINGS: dict[str, str] = {
    "metrics": "the metrics reported",
    "algorithm.finetune_steps": "the evaluation-time adaptation",
    "algorithm.finetune_lr": "the evaluation-time adaptation",
    "algorithm.finetune_batch_size": "the evaluation-time adaptation",
}


#: trainer settings recorded in ``checkpoint["fedmeta"]["record"]["trainer"]``: a resumed run uses its own and says so
REPORTED_TRAINER_SETTINGS: tuple[str, ...] = ("max_steps", "precision", "accelerator", "world_size")


#: the run record :func:`fedmeta_run_record` writes into ``checkpoint["fedmeta"]`` for the resume checks. Every
#: checkpoint with a checksum has all of them (the two came in the same release): one that lacks any is refused by
#: :func:`check_resume_settings`, naming it (without ``server_optimizer`` another optimizer would go unnoticed and
#: fail late in Lightning's optimizer restore, or run with the checkpoint's learning rate)
RUN_RECORD_KEYS: tuple[str, ...] = ("algorithm", "datamodule_class", "server_optimizer", "trainer")


#: module arguments compared by other means than their hyper-parameter value
_COMPARED_ELSEWHERE = {
    "algorithm": "class and hyper-parameters of the built algorithm (compare_algorithms)",
    "loss": "the resolved loss name (FederatedModule.on_load_checkpoint)",
}


def load_module_checkpoint(
    cls: type,
    checkpoint_path: Any,
    map_location: Any = None,
    hparams_file: Any = None,
    strict: bool | None = None,
    weights_only: bool | None = None,
    **kwargs: Any,
) -> Any:
    """``LightningModule.load_from_checkpoint`` (Lightning 2.x) with a damaged file named, the checksum verified
    on the raw file, and the hyper-parameters left as saved, so ``on_load_checkpoint`` compares the module built
    with ``kwargs`` against the checkpoint's settings (Lightning would overwrite them with ``kwargs`` first)."""
    from lightning.pytorch.core.saving import (
        _default_map_location,
        _load_state,
        load_hparams_from_tags_csv,
        load_hparams_from_yaml,
    )
    from lightning.pytorch.utilities.migration import pl_legacy_patch
    from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint
    from lightning.pytorch.utilities.rank_zero import rank_zero_warn

    path = checkpoint_path if isinstance(checkpoint_path, str | os.PathLike) else None
    with pl_legacy_patch():
        checkpoint = load_checkpoint_file(checkpoint_path, map_location or _default_map_location, weights_only)
    if "fedmeta" in checkpoint:
        verify_checkpoint(checkpoint, path)
        checkpoint[VERIFIED_MARK] = True
    checkpoint = _pl_migrate_checkpoint(checkpoint, checkpoint_path=path)
    if hparams_file is not None:
        extension = str(hparams_file).rsplit(".", 1)[-1].lower()
        if extension == "csv":
            checkpoint["hyper_parameters"] = load_hparams_from_tags_csv(hparams_file)
        elif extension in ("yml", "yaml"):
            checkpoint["hyper_parameters"] = load_hparams_from_yaml(hparams_file)
        else:
            raise ValueError(".csv, .yml or .yaml is required for `hparams_file`")
    else:
        _refuse_code_or_paths(cls, checkpoint, kwargs, checkpoint_path)
    checkpoint.setdefault("hyper_parameters", {})
    token = _LOADING_PATH.set(path)
    try:
        model = _load_state(cls, checkpoint, strict=strict, **kwargs)  # kwargs win over the saved values
    finally:
        _LOADING_PATH.reset(token)
    state_dict = checkpoint["state_dict"]
    if not state_dict:
        rank_zero_warn(f"The state dict in {checkpoint_path!r} contains no parameters.")
        return model
    device = next((t for t in state_dict.values() if isinstance(t, Tensor)), torch.tensor(0)).device
    return model.to(device)


def _refuse_code_or_paths(cls: type, checkpoint: Mapping[str, Any], kwargs: Mapping[str, Any], path: Any) -> None:
    """Refuse hyper-parameters ``load_module_checkpoint`` would take from the checkpoint (not in ``kwargs``, other
    than ``cls``'s defaults) that name code or paths (:func:`code_or_path_settings`; ``_class_path`` included:
    Lightning imports it), naming the keyword arguments that give them."""
    saved = checkpoint.get("hyper_parameters") or {}
    if not isinstance(saved, Mapping):
        return
    defaults = signature_defaults(cls)
    taken = {k: v for k, v in saved.items() if k not in kwargs and not str(k).startswith("_")
             and not (k in defaults and plain_value(v) == plain_value(defaults[k]))}
    refused = code_or_path_settings("model", taken)
    if saved.get("_class_path") is not None:
        refused.append(f"_class_path={saved['_class_path']!r}")
    if refused:
        names = sorted({r.split("=", 1)[0].split(".")[1] for r in refused if r.startswith("model.")})
        how = ", ".join(f"{n}=..." for n in names) or "..."
        raise CheckpointSettingsError(code_or_path_message(
            path if isinstance(path, str | os.PathLike) else None, refused,
            f"If you trust them, pass them yourself: {cls.__name__}.load_from_checkpoint(path, {how})"))


# ----------------------------------------------------------------------------------------------
# resume settings
# ----------------------------------------------------------------------------------------------
#: the file ``load_module_checkpoint`` is reading (for messages of ``on_load_checkpoint``, which gets a dict)
_LOADING_PATH: contextvars.ContextVar[Any] = contextvars.ContextVar("fedmeta_loading_path", default=None)


def loading_path(trainer: Trainer | None) -> Any:
    """The file a checkpoint being loaded comes from: ``trainer.ckpt_path``, else the file
    :func:`load_module_checkpoint` is reading (``None`` when not known)."""
    if trainer is not None and getattr(trainer, "ckpt_path", None):
        return trainer.ckpt_path
    return _LOADING_PATH.get()


@dataclass(frozen=True)
class SettingDifference:
    """One setting whose value in a checkpoint differs from the run that loads it."""

    name: str  # e.g. "model.seed", "data.num_clients", "model.algorithm.local_lr"
    saved: Any
    given: Any
    changeable: bool
    reason: str = ""

    def describe(self) -> str:
        return f"{self.name}: checkpoint {self.saved!r}, given {self.given!r}"


def describe_algorithm(spec: Any) -> dict[str, Any] | None:
    """``{"class": import path, "name": registry name, "hparams": Algorithm.hparams()}`` of an algorithm
    instance, name or ``{name: ..., <hyper-parameters>}`` mapping (built to fill in the defaults, so
    ``"scaffold"`` and ``{"name": "scaffold", "local_steps": 10}`` describe the same algorithm);
    ``None`` when the spec cannot be built."""
    from lightning_fedmeta.algorithms.base import Algorithm

    algorithm = spec
    if not isinstance(spec, Algorithm):
        plain = plain_value(spec)
        if isinstance(plain, str):
            name, args = plain, {}
        elif isinstance(plain, dict) and isinstance(plain.get("name"), str):
            args = dict(plain)
            name = args.pop("name")
        else:
            return None
        from lightning_fedmeta.registry import create_algorithm

        try:
            algorithm = create_algorithm(name, **args)
        except Exception:  # noqa: BLE001 - an invalid spec is reported by the constructor, not here
            return None
    cls = type(algorithm)
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "name": cls.name or cls.__name__,
        "hparams": {k: plain_value(v) for k, v in algorithm.hparams().items()},
    }


def compare_algorithms(
    saved: Mapping[str, Any], given: Mapping[str, Any], changeable: Mapping[str, str], prefix: str = "model.algorithm"
) -> list[SettingDifference]:
    """Differences of two :func:`describe_algorithm` descriptions: another class, or a hyper-parameter both
    have with another value (``changeable`` keys: ``"algorithm.<name>"``)."""
    if saved.get("class") != given.get("class"):
        return [SettingDifference(f"{prefix}.name", saved.get("name"), given.get("name"), False)]
    out = []
    saved_hp, given_hp = saved.get("hparams") or {}, given.get("hparams") or {}
    for key in sorted(set(saved_hp) & set(given_hp)):
        if plain_value(saved_hp[key]) != plain_value(given_hp[key]):
            reason = changeable.get(f"algorithm.{key}", "")
            out.append(SettingDifference(f"{prefix}.{key}", saved_hp[key], given_hp[key], bool(reason), reason))
    return out


def compare_settings(
    prefix: str,
    saved: Mapping[str, Any],
    given: Mapping[str, Any],
    changeable: Mapping[str, str],
    defaults: Mapping[str, Any] | None = None,
    skip: Iterable[str] = (),
) -> list[SettingDifference]:
    """Every key of ``given`` whose value differs from ``saved`` (a key the checkpoint lacks counts as its
    default in ``defaults``, the signature's: the option did not exist, so the run had its default), except
    private (``_``) keys and ``skip``. Keys only in ``saved`` are not compared (``given`` leaves them out, e.g.
    an argument that was an object). A key in ``changeable`` is marked changeable, with the reason. The
    settings a plugin's options live in are compared in their canonical form (:func:`canonical_setting`: the
    plugin's defaults filled in); a difference reports the values as written."""
    skipped = set(skip)
    out = []
    for key in sorted(given):
        if key.startswith("_") or key in skipped:
            continue
        if key in saved:
            before = saved[key]
        elif defaults is not None and key in defaults:
            before = defaults[key]
        else:
            continue
        saved_side = {**(defaults or {}), **saved}
        a = canonical_setting(prefix, key, before, saved_side)
        b = canonical_setting(prefix, key, given[key], {**saved_side, **given})
        if plain_value(a) != plain_value(b):
            reason = changeable.get(key, "")
            out.append(SettingDifference(f"{prefix}.{key}", before, given[key], bool(reason), reason))
    return out


def canonical_setting(prefix: str, key: str, value: Any, settings: Mapping[str, Any]) -> Any:
    """``value`` of setting ``prefix.key`` in the form its meaning is compared in, generically (no option of a
    plugin is listed here): ``model.aggregator`` as the rule's full option mapping
    (:func:`~lightning_fedmeta.reliability.robust.canonical_aggregator`), ``data.dataset_options`` /
    ``data.partition_options``
    with the signature defaults of the dataset / partitioner named in ``settings`` filled in
    (:func:`~lightning_fedmeta.data.plugins.canonical_options`); any other value as it is."""
    if prefix == "model" and key == "aggregator":
        from lightning_fedmeta.reliability.robust import canonical_aggregator

        return canonical_aggregator(value)
    if prefix == "data" and key in ("dataset_options", "partition_options"):
        from lightning_fedmeta.data.plugins import canonical_options

        kind = "dataset" if key == "dataset_options" else "partition"
        return canonical_options(kind, settings.get(kind), value)
    return value


def canonical_settings(prefix: str, settings: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Every setting of ``settings`` (a key it lacks read as its default in ``defaults``) in its canonical form
    (:func:`canonical_setting`)."""
    merged = {**defaults, **settings}
    return {k: canonical_setting(prefix, k, v, merged) for k, v in merged.items()}


def settings_message(path: Any, refused: list[SettingDifference], evaluating: bool = False) -> str:
    """The refusal: every setting that differs, checkpoint value against given value, and the allow-list."""
    where = f"checkpoint {os.fspath(path)}" if isinstance(path, str | os.PathLike) else "this checkpoint"
    lines = "\n".join(f"  {d.describe()}" for d in refused)
    allowed = [f"model.{k}" for k in CHANGEABLE_MODEL_SETTINGS] + [f"data.{k}" for k in CHANGEABLE_DATA_SETTINGS]
    if evaluating:
        allowed += [f"model.{k}" for k in EVALUATION_ONLY_SETTINGS]
    action = "evaluating" if evaluating else "resuming"
    return (
        f"{where} was written with other settings than this run's; {action} it would mix two experiments:\n{lines}\n"
        f"Use the checkpoint's values (the configuration of the run that wrote it), or start a new run without "
        f"the checkpoint. Settings that may change: {', '.join(allowed)} and the trainer's"
    )


def incomplete_record_message(path: Any, missing: list[str]) -> str:
    """The refusal of a checksummed checkpoint whose run record lacks the entries ``missing``."""
    where = f"checkpoint {os.fspath(path)}" if isinstance(path, str | os.PathLike) else "this checkpoint"
    names = ", ".join(repr(k) for k in missing)
    return (
        f"{where} has no record of {names} in checkpoint['fedmeta']['record'] (every checkpoint FederatedModule "
        f"writes with a checksum records {', '.join(repr(k) for k in RUN_RECORD_KEYS)}): the settings it was "
        "written with cannot be compared with this run's, so it is not used. Resume from a checkpoint "
        "FederatedModule wrote, or start a new run without it"
    )


def run_settings(trainer: Any) -> dict[str, Any]:
    """The trainer settings recorded in a checkpoint (:data:`REPORTED_TRAINER_SETTINGS`)."""
    if trainer is None:
        return {}
    return {
        "max_steps": trainer.max_steps,
        "precision": str(getattr(trainer, "precision", None)),
        "accelerator": type(trainer.accelerator).__name__,
        "world_size": int(trainer.world_size),
    }


@dataclass(frozen=True)
class ResumeCandidate:
    """What the resume checks compare a checkpoint with: the module that loads it, as plain values.

    ``hparams`` are the module's saved hyper-parameters, ``module_class`` its class (whose signature gives the
    defaults), ``data_spec`` the bound data's spec (``None``: none bound), ``configure_optimizers`` builds a
    throwaway server optimizer to compare with the saved one."""

    module_class: type
    hparams: Mapping[str, Any]
    algorithm: Any
    trainer: Trainer | None
    data: FederatedData | None
    data_spec: Mapping[str, Any] | None
    configure_optimizers: Callable[[], Any]


def _saved_clients(engine: Mapping[str, Any]) -> int | None:
    """The number of clients a checkpoint's engine part describes (rows of its client state, or ``seen``)."""
    for value in (engine.get("client_state") or {}).values():
        if isinstance(value, Tensor) and value.dim() > 0:
            return int(value.shape[0])
    seen = (engine.get("federation") or {}).get("seen")
    return int(seen.numel()) if isinstance(seen, Tensor) else None


def check_resume_settings(candidate: ResumeCandidate, checkpoint: Mapping[str, Any],
                          path: Any = None) -> list[SettingDifference]:
    """Compare ``checkpoint``'s settings (its ``fedmeta`` entry in the per-part layout,
    :mod:`~lightning_fedmeta.frontends.checkpoint_layout`) with the loading module and its Trainer's datamodule.

    Every hyper-parameter must match (a key the checkpoint lacks counts as the signature's default) except
    those of :data:`CHANGEABLE_MODEL_SETTINGS` / :data:`CHANGEABLE_DATA_SETTINGS` (and, unless the Trainer is
    fitting, :data:`EVALUATION_ONLY_SETTINGS`); the algorithm is compared by class and hyper-parameters; the
    data must have the checkpoint's number of clients and shapes. Returns the allowed differences (the
    changeable settings and, when fitting, the trainer's :data:`REPORTED_TRAINER_SETTINGS`).

    Raises:
        CheckpointSettingsError: naming every setting that differs, checkpoint value against given value; or
            naming every entry of :data:`RUN_RECORD_KEYS` a checkpoint with a checksum lacks (its settings could
            not be compared). A checkpoint without a checksum predates the record: what it has is compared.
    """
    trainer = candidate.trainer
    fitting = trainer is not None and getattr(trainer.state, "fn", None) == "fit"
    model_allowed = dict(CHANGEABLE_MODEL_SETTINGS)
    if not fitting:
        model_allowed.update(EVALUATION_ONLY_SETTINGS)
    fedmeta = checkpoint.get("fedmeta") or {}
    saved, engine, run = (fedmeta.get(part) or {} for part in ("record", "engine", "run"))
    missing = [key for key in RUN_RECORD_KEYS if key not in saved] if CHECKSUM_KEY in checkpoint else []
    if missing:
        raise CheckpointSettingsError(incomplete_record_message(path, missing))
    saved_hp = dict(checkpoint.get("hyper_parameters") or {})
    diffs = compare_settings(
        "model", saved_hp, dict(candidate.hparams), model_allowed, signature_defaults(candidate.module_class),
        _COMPARED_ELSEWHERE
    )
    saved_algorithm = saved.get("algorithm") or describe_algorithm(saved_hp.get("algorithm"))
    given_algorithm = describe_algorithm(candidate.algorithm)
    if saved_algorithm is not None and given_algorithm is not None:
        diffs += compare_algorithms(saved_algorithm, given_algorithm, model_allowed)
    datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
    saved_dm = checkpoint.get("datamodule_hyper_parameters")
    same_class = saved.get("datamodule_class") in (None, _class_path(datamodule))
    if datamodule is not None and saved_dm is not None and same_class and getattr(datamodule, "hparams", None):
        diffs += compare_settings(
            "data", saved_dm, dict(datamodule.hparams), CHANGEABLE_DATA_SETTINGS, signature_defaults(type(datamodule))
        )
    data = candidate.data
    rows = _saved_clients(engine)
    if data is not None and rows is not None and rows != data.num_clients:
        diffs.append(SettingDifference("number of clients in the data", rows, int(data.num_clients), False))
    saved_spec, spec = run.get("data_spec"), candidate.data_spec
    if data is not None and saved_spec and spec:
        for key in ("input_shape", "num_classes", "task", "target_shape"):
            if key in saved_spec and key in spec and plain_value(saved_spec[key]) != plain_value(spec[key]):
                diffs.append(SettingDifference(f"data: {key}", saved_spec[key], spec[key], False))
    if fitting and saved.get("server_optimizer"):
        given_optimizer = _configured_optimizer(candidate.configure_optimizers)
        if given_optimizer is not None:
            diffs += _compare_optimizers(saved["server_optimizer"], given_optimizer)
    refused = [d for d in diffs if not d.changeable]
    if refused:
        raise CheckpointSettingsError(settings_message(path, refused, evaluating=not fitting))
    allowed = [d for d in diffs if d.changeable]
    if fitting:
        before, now = saved.get("trainer") or {}, run_settings(trainer)
        for key in REPORTED_TRAINER_SETTINGS:
            if key in before and key in now and plain_value(before[key]) != plain_value(now[key]):
                allowed.append(SettingDifference(f"trainer.{key}", before[key], now[key], True, "a trainer setting"))
    return allowed


def _class_path(obj: Any) -> str | None:
    return None if obj is None else _qualname(obj)


def describe_server_optimizer(optimizer: Any, scheduler: Any = None) -> dict[str, Any] | None:
    """``{"class": ..., "defaults": its constructor's hyper-parameters, "scheduler": class or None}`` of a
    server optimizer. Lightning restores the optimizer's state, learning rates included, from a checkpoint: a
    resumed run with other optimizer arguments would silently keep the old ones, another class would fail late."""
    if optimizer is None or not hasattr(optimizer, "defaults"):
        return None
    return {
        "class": _qualname(optimizer),
        "defaults": {str(k): plain_value(v) for k, v in dict(optimizer.defaults).items()},
        "scheduler": _class_path(scheduler),
    }


def _configured_optimizer(configure_optimizers: Callable[[], Any]) -> dict[str, Any] | None:
    """The description of the server optimizer ``configure_optimizers()`` builds (a throwaway one)."""
    try:
        config = configure_optimizers()
    except Exception:  # noqa: BLE001 - no model yet, or an optimizer that needs the Trainer: not compared
        return None
    scheduler = None
    if isinstance(config, list | tuple) and config:
        config = config[0]
    if isinstance(config, Mapping):
        scheduler = config.get("lr_scheduler")
        scheduler = scheduler.get("scheduler") if isinstance(scheduler, Mapping) else scheduler
        config = config.get("optimizer")
    return describe_server_optimizer(config, scheduler)


def _compare_optimizers(saved: Mapping[str, Any], given: Mapping[str, Any]) -> list[SettingDifference]:
    if saved.get("class") != given.get("class"):
        return [SettingDifference("model.server_optimizer", saved.get("class"), given.get("class"), False)]
    out = []
    before, now = saved.get("defaults") or {}, given.get("defaults") or {}
    for key in sorted(set(before) & set(now)):
        if plain_value(before[key]) != plain_value(now[key]):
            out.append(SettingDifference(f"model.server_optimizer.{key}", before[key], now[key], False))
    if saved.get("scheduler") != given.get("scheduler"):
        out.append(
            SettingDifference("model.server_lr_scheduler", saved.get("scheduler"), given.get("scheduler"), False)
        )
    return out


def fedmeta_run_record(algorithm: Any, trainer: Trainer | None) -> dict[str, Any]:
    """The ``record`` part ``on_save_checkpoint`` writes into ``checkpoint["fedmeta"]`` for these checks
    (:data:`RUN_RECORD_KEYS`): the algorithm's description, the datamodule's class, the server optimizer's
    description and the trainer settings."""
    datamodule = getattr(trainer, "datamodule", None) if trainer is not None else None
    optimizer = None
    if trainer is not None and getattr(trainer, "optimizers", None):
        schedulers = getattr(trainer, "lr_scheduler_configs", None) or []
        optimizer = describe_server_optimizer(trainer.optimizers[0], schedulers[0].scheduler if schedulers else None)
    return {
        "algorithm": describe_algorithm(algorithm),
        "datamodule_class": _class_path(datamodule),
        "server_optimizer": optimizer,
        "trainer": run_settings(trainer),
    }
