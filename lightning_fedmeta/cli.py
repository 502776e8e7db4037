"""The ``fedmeta`` command: LightningCLI for federated runs, plus helper sub-commands.

    fedmeta fit      --config configs/quickstart.yaml      # train (Trainer flags as usual)
    fedmeta validate --config ... --ckpt_path ...           # personalised evaluation of a checkpoint
    fedmeta test     --config ... --ckpt_path ...           # (or --untrained true: the initial model)
    fedmeta fit --config configs/quickstart.yaml --print_config
    fedmeta algorithms                                      # every registered algorithm
    fedmeta compare LOGDIR [LOGDIR ...] [--metric NAME]     # plot and tabulate several runs

The algorithm is chosen by name under ``model.algorithm`` with its hyper-parameters beside it
(``algorithm: {name: scaffold, local_lr: 0.05}``); ``distribution:name`` picks between two
plugins that claim the same name.

A configuration error found before anything runs (an unknown algorithm, a hyper-parameter out of
range, ``test`` without a checkpoint) raises :class:`FedMetaConfigError` (a ``ValueError``) from
:func:`run`; the ``fedmeta`` console script (:func:`main`) prints its message alone and exits with
status 2.

With ``--ckpt_path`` (docs/reliability.md, "Crashes and checkpoints"):

    fedmeta fit --config run.yaml --ckpt_path last          # resume a killed run, in a new process

``last`` is the newest ``last*.ckpt`` of the configuration's checkpoint folders, earlier ``version_N``
folders of the logger included (:func:`find_last_checkpoint`; none: the run starts at round 0). A damaged
checkpoint, or one written with other settings than the ones given (other than the execution-only
settings that may change), is refused before anything is built; settings not given take the
checkpoint's values.
"""

from __future__ import annotations

import glob
import inspect
import logging
import os
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table

from lightning_fedmeta.data.datamodule import FederatedDataModule
from lightning_fedmeta.frontends.options import resolved_algorithm_spec
from lightning_fedmeta.frontends.resume_settings import (
    CHANGEABLE_DATA_SETTINGS,
    CHANGEABLE_MODEL_SETTINGS,
    EVALUATION_ONLY_SETTINGS,
    SettingDifference,
    compare_algorithms,
    compare_settings,
    describe_algorithm,
    settings_message,
)
from lightning_fedmeta.module import FederatedModule, FederatedSetupError
from lightning_fedmeta.persistence.checkpoint_files import remove_stale_partials
from lightning_fedmeta.persistence.checksums import CheckpointDamagedError, verify_checkpoint
from lightning_fedmeta.persistence.safe_loading import (
    CheckpointSettingsError,
    UnsafeCheckpointLoadError,
    code_or_path_message,
    code_or_path_settings,
    load_checkpoint_file,
    plain_value,
)

__all__ = [
    "FedMetaCLI", "FedMetaConfigError", "checkpoint_dirs", "find_last_checkpoint", "main", "run", "print_algorithms",
]

HELPER_COMMANDS = ("algorithms", "compare")
EVALUATION_COMMANDS = ("validate", "test")


class FedMetaConfigError(ValueError):
    """A configuration refused before anything runs; ``fedmeta`` prints the message alone (exit status 2)."""


# Trainer keywords that name a checkpoint of an earlier ``fit`` by the same Trainer: a fresh
# ``fedmeta validate/test`` process has none ("last" silently loads nothing, "best" fails late)
_SAME_PROCESS_CKPT_KEYWORDS = ("last", "best")


def _check_evaluation_checkpoint(subcommand: str, ckpt_path: Any, untrained: bool) -> None:
    """Refuse ``validate``/``test`` runs that would evaluate the initial model by accident."""
    how = (
        "pass a checkpoint file written by `fedmeta fit`: --ckpt_path PATH/TO/FILE.ckpt (fit saves them "
        "under <trainer.default_root_dir>/lightning_logs/version_N/checkpoints/)"
    )
    if not ckpt_path:
        if untrained:
            return
        raise FedMetaConfigError(
            f"fedmeta {subcommand} needs a trained model: {how}, or add --untrained true to evaluate the "
            "initial model (round 0) on purpose"
        )
    if str(ckpt_path) in _SAME_PROCESS_CKPT_KEYWORDS:
        raise FedMetaConfigError(
            f"--ckpt_path {ckpt_path} names a checkpoint of a fit run by the same Trainer, and "
            f"`fedmeta {subcommand}` starts a new one; {how}"
        )


def _read_checkpoint(ckpt_path: str, weights_only: Any) -> dict[str, Any]:
    """The checkpoint ``--ckpt_path`` names, local or a URL, read with ``weights_only=True`` and its checksum
    verified, before anything is built (a remote file is read again by the Trainer, also with
    ``weights_only=True``: the settings are checked again when it is restored)."""
    if "://" not in ckpt_path and not Path(ckpt_path).is_file():
        raise FedMetaConfigError(f"--ckpt_path {ckpt_path}: no such file")
    try:
        checkpoint = load_checkpoint_file(ckpt_path, map_location="cpu", weights_only=weights_only)
        if "fedmeta" in checkpoint:
            verify_checkpoint(checkpoint, ckpt_path)
    except FileNotFoundError:
        raise FedMetaConfigError(f"--ckpt_path {ckpt_path}: no such file") from None
    except (CheckpointDamagedError, UnsafeCheckpointLoadError) as exc:
        raise FedMetaConfigError(str(exc)) from None
    if not isinstance(checkpoint, dict):
        raise FedMetaConfigError(f"--ckpt_path {ckpt_path}: not a checkpoint (a {type(checkpoint).__name__}, "
                                 "where torch.save of a checkpoint dict was expected)")
    return checkpoint


def _get(obj: Any, key: str, default: Any = None) -> Any:
    """``obj[key]`` of a config node (a jsonargparse Namespace, a dict), ``default`` when absent."""
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(key, default)
    getter = getattr(obj, "get", None)
    return getter(key, default) if callable(getter) else getattr(obj, key, default)


def checkpoint_dirs(trainer_cfg: Any) -> list[str]:
    """The folders where the Trainer of this configuration writes its ModelCheckpoint files: each configured
    ``ModelCheckpoint``'s ``dirpath``, and the default ``<save_dir>/<name>/<version>/checkpoints`` of the first
    logger for every version already there (``<default_root_dir>/checkpoints`` without a logger)."""
    root = str(_get(trainer_cfg, "default_root_dir") or os.getcwd())
    dirs: list[str] = []
    callbacks = _get(trainer_cfg, "callbacks") or []
    for callback in callbacks if isinstance(callbacks, list) else [callbacks]:
        if str(_get(callback, "class_path", "") or "").endswith("ModelCheckpoint"):
            dirpath = _get(_get(callback, "init_args"), "dirpath")
            if dirpath:
                dirs.append(str(dirpath))
    logger = _get(trainer_cfg, "logger")
    first = (logger or [None])[0] if isinstance(logger, list) else logger
    if first is False:
        dirs.append(os.path.join(root, "checkpoints"))
    else:
        init = _get(first, "init_args") if first not in (None, True) else None
        save_dir = str(_get(init, "save_dir") or root)
        name = str(_get(init, "name", "lightning_logs") or "")
        dirs.extend(sorted(glob.glob(os.path.join(glob.escape(save_dir), glob.escape(name), "*", "checkpoints"))))
    return dirs


def find_last_checkpoint(trainer_cfg: Any) -> tuple[str | None, list[str]]:
    """``--ckpt_path last`` for a new process: the newest ``last*.ckpt`` (by modification time, as Lightning
    picks among its candidates) in :func:`checkpoint_dirs`; ``None`` when there is none. Also returns the
    folders searched.

    Lightning resolves ``last`` through the new Trainer's own checkpoint folder, which under the default
    logger is a new ``version_N+1`` folder: without this, a resumed ``fedmeta fit`` would start from round 0.
    """
    dirs = checkpoint_dirs(trainer_cfg)
    found = []
    for directory in dirs:
        if os.path.isdir(directory):
            for entry in os.scandir(directory):
                if entry.is_file() and entry.name.startswith("last") and entry.name.endswith(".ckpt"):
                    found.append((entry.stat().st_mtime_ns, entry.path))
    return (max(found)[1] if found else None), dirs


def _refuse_missing_last(searched: Sequence[str]) -> None:
    """Refuse ``--ckpt_path last`` when earlier runs left checkpoints but no ``last*.ckpt`` (e.g. written by a
    ``ModelCheckpoint(save_last=False)``): starting again at round 0 beside them would silently lose their rounds.
    Folders without any checkpoint (the first start of a job) pass."""
    others = sorted((entry.stat().st_mtime_ns, entry.path) for directory in searched if os.path.isdir(directory)
                    for entry in os.scandir(directory) if entry.is_file() and entry.name.endswith(".ckpt"))
    if others:
        newest = others[-1][1]
        raise FedMetaConfigError(
            f"--ckpt_path last: no last*.ckpt in {list(searched)}, but {len(others)} other checkpoint(s) there; "
            f"resume from one by its path (the newest: --ckpt_path {newest}), or leave out --ckpt_path to start a "
            "new run at round 0"
        )


@rank_zero_only
def _remove_stale_partials(dirs: Sequence[str]) -> None:
    """Remove the temporary files of killed saves from the earlier runs' checkpoint folders ``--ckpt_path last``
    searched: the resumed run writes into a new ``version_N`` folder, so its own saves never clean those."""
    removed = [path for directory in dirs if os.path.isdir(directory) for path in remove_stale_partials(directory)]
    if removed:
        rank_zero_info(f"--ckpt_path last: removed {len(removed)} temporary file(s) of interrupted saves: "
                       + ", ".join(removed))


def _requested_subcommand(args: Any, names: Sequence[str]) -> str | None:
    """The subcommand a command line starts with (``fit ...``), or ``None`` when it does not start with one
    (options first, ``--help``, a dict or Namespace of arguments)."""
    if args is None:
        args = sys.argv[1:]
    if isinstance(args, list | tuple) and args and isinstance(args[0], str) and args[0] in names:
        return args[0]
    return None


# the helper commands `run` handles before any parser is built; listed in `fedmeta --help` with these lines
HELPER_DESCRIPTIONS = {
    "algorithms": "List every registered algorithm (built-in and plugins) with its distribution and summary.",
    "compare": "Plot and tabulate several runs' personalised metrics (fedmeta compare --help).",
}

_CLASS_PATH_PROBLEM = re.compile(r"Problem with given class_path '([^']+)':\s*\n\s*(\S[^\n]*)")
_PARSER_KEY = re.compile(r'key "([^"]+)"')


class FedMetaArgumentParser(LightningArgumentParser):
    """LightningCLI's parser; a ``class_path`` that cannot be imported is reported in one line (which option,
    which path, what failed to import), not after the usage text."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        problem = _CLASS_PATH_PROBLEM.search(message)
        if problem is None or not self.exit_on_error:
            super().error(message, ex)
        key = _PARSER_KEY.search(message)
        where = f"{key.group(1)}: " if key else ""
        raise FedMetaConfigError(
            f"{where}class_path {problem.group(1)!r} cannot be imported: {problem.group(2).strip()} (module paths "
            f"resolve from the working directory {os.getcwd()} and PYTHONPATH; run fedmeta from the folder that "
            "holds your module, or add that folder to PYTHONPATH)"
        )


class FedMetaCLI(LightningCLI):
    """LightningCLI with federated defaults: an epoch is ``data.eval_every`` rounds, ``max_steps`` counts rounds.

    When the command line starts with its subcommand (``fedmeta fit ...``), only that subcommand's parser
    gets the Trainer, model and data arguments; the others are registered with a bare parser, which is
    never used (LightningCLI would build all four from the signatures, most of the start-up's parsing time).
    Any other command line (options before the subcommand, ``fedmeta --help``) builds all four, as usual.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_class", FedMetaArgumentParser)
        bound = inspect.signature(LightningCLI.__init__).bind(self, *args, **kwargs)
        self._only_subcommand = _requested_subcommand(bound.arguments.get("args"), tuple(self.subcommands()))
        super().__init__(*args, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """LightningCLI's subcommands without ``predict``: a federated module has no single model to predict with
        (each client has its own, personalised one: ``module.personalize(i)``)."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name != "predict"}

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        """LightningCLI's subcommands, and the helper commands listed beside them in ``fedmeta --help`` (their
        parsers are never used: :func:`run` handles them before the CLI is built)."""
        super()._add_subcommands(parser, **kwargs)
        for name, description in HELPER_DESCRIPTIONS.items():
            parser._subcommands_action.add_subcommand(name, self.init_parser(description=description),
                                                      help=description)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse as LightningCLI does; with a ``ckpt_path``, also note which settings the user gave (a config
        file or the command line, without the defaults): only those are compared with the checkpoint's.
        ``--print_config`` prints the configuration with the algorithm's hyper-parameters resolved."""
        argv = None if isinstance(args, dict) or type(args).__name__ == "Namespace" else list(
            sys.argv[1:] if args is None else args)
        if argv is not None and any(a.split("=", 1)[0] == "--print_config" for a in argv):
            _print_resolved_config(parser, argv)
        super().parse_arguments(parser, args)
        self._given: Any = None
        sub = self.config.get("subcommand")
        if not sub or not _get(self.config[sub], "ckpt_path"):
            return
        try:
            if isinstance(args, dict) or type(args).__name__ == "Namespace":
                self._given = parser.parse_object(args, defaults=False)
            else:
                self._given = parser.parse_args(sys.argv[1:] if args is None else args, defaults=False)
        except (Exception, SystemExit):  # noqa: BLE001 - without it every setting counts as given
            self._given = None

    def _given_keys(self, sub: str, group: str, effective: dict[str, Any]) -> set[str]:
        given = _get(_get(self._given, sub), group) if self._given is not None else None
        if self._given is None:
            return set(effective)  # unknown: every setting counts as given (compared)
        if given is None:
            return set()
        return set(given.as_dict() if hasattr(given, "as_dict") else dict(given))

    def _parse_ckpt_path(self) -> None:
        """Resolve ``fit --ckpt_path last``, refuse a damaged checkpoint, and compare the checkpoint's settings
        with the user's (docs/reliability.md, "Crashes and checkpoints").

        A setting the user gave (config file or command line) must equal the checkpoint's unless it is on the
        allow-list (:data:`~lightning_fedmeta.frontends.resume_settings.CHANGEABLE_MODEL_SETTINGS`, ...; then the given
        value is used); a setting left at its default takes the checkpoint's value, model and data alike
        (LightningCLI replaces only the model's, and all of them)."""
        sub = self.config.get("subcommand")
        if not sub:
            return
        cfg = self.config[sub]
        ckpt_path = _get(cfg, "ckpt_path")
        if not ckpt_path:
            return
        if sub == "fit" and str(ckpt_path) == "last":
            found, searched = find_last_checkpoint(_get(cfg, "trainer"))
            if found is None:
                _refuse_missing_last(searched)
                rank_zero_warn(
                    f"--ckpt_path last: no last*.ckpt in {searched or 'any checkpoint folder'}; this run starts "
                    "at round 0 (the first start of a job that passes --ckpt_path last on every start)"
                )
                cfg.ckpt_path = None
                return
            rank_zero_info(f"--ckpt_path last: resuming from {found}")
            _remove_stale_partials(searched)
            cfg.ckpt_path = ckpt_path = found
        if str(ckpt_path) in ("last", "best", "hpc"):
            return  # keywords (refused for validate/test in before_instantiate_classes)
        checkpoint = _read_checkpoint(str(ckpt_path), _get(cfg, "weights_only"))
        model_saved = {k: v for k, v in (checkpoint.get("hyper_parameters") or {}).items() if not k.startswith("_")}
        class_path = (checkpoint.get("hyper_parameters") or {}).get("_class_path")
        if class_path is not None:  # LightningCLI would import and build the class the file names
            raise FedMetaConfigError(code_or_path_message(
                ckpt_path, [f"model class_path={class_path!r}"],
                "fedmeta builds lightning_fedmeta.FederatedModule; load a checkpoint of a model class of your own "
                "with your own LightningCLI (subclass_mode_model=True) or its load_from_checkpoint"))
        data_saved = {
            k: v for k, v in (checkpoint.get("datamodule_hyper_parameters") or {}).items() if not k.startswith("_")
        }
        self._apply_checkpoint_settings(sub, str(ckpt_path), model_saved, data_saved)

    def _apply_checkpoint_settings(
        self, sub: str, path: str, model_saved: dict[str, Any], data_saved: dict[str, Any]
    ) -> None:
        cfg = self.config[sub]
        evaluating = sub in EVALUATION_COMMANDS
        model_allowed = dict(CHANGEABLE_MODEL_SETTINGS, **(EVALUATION_ONLY_SETTINGS if evaluating else {}))
        model_now = _as_dict(_get(cfg, "model"))
        data_now = _as_dict(_get(cfg, "data"))
        model_given = self._given_keys(sub, "model", model_now) & set(model_saved)
        data_given = self._given_keys(sub, "data", data_now) & set(data_saved)
        diffs: list[SettingDifference] = []
        if "algorithm" in model_given:
            saved_algorithm, given_algorithm = (describe_algorithm(v) for v in (model_saved["algorithm"],
                                                                               model_now.get("algorithm")))
            if saved_algorithm is not None and given_algorithm is not None:
                diffs += compare_algorithms(saved_algorithm, given_algorithm, model_allowed)
            else:
                diffs += compare_settings("model", model_saved, {"algorithm": model_now.get("algorithm")}, {})
        diffs += compare_settings(
            "model", model_saved, {k: model_now.get(k) for k in model_given if k != "algorithm"}, model_allowed
        )
        diffs += compare_settings("data", data_saved, {k: data_now.get(k) for k in data_given},
                                  CHANGEABLE_DATA_SETTINGS)
        refused = [d for d in diffs if not d.changeable]
        if refused:
            raise FedMetaConfigError(settings_message(path, refused, evaluating=evaluating))
        # the allowed differences keep the given values; FederatedModule.on_load_checkpoint reports them
        fill_model = {k: v for k, v in model_saved.items() if k not in model_given and k in model_now}
        fill_data = {k: v for k, v in data_saved.items() if k not in data_given and k in data_now}
        _refuse_code_or_paths(path, fill_model, model_now, fill_data, data_now)
        taken = [f"model.{k}" for k, v in fill_model.items() if plain_value(v) != plain_value(model_now.get(k))]
        taken += [f"data.{k}" for k, v in fill_data.items() if plain_value(v) != plain_value(data_now.get(k))]
        if fill_model or fill_data:
            update: dict[str, Any] = {}
            if fill_model:
                update["model"] = fill_model
            if fill_data:
                update["data"] = fill_data
            try:
                self.config = self.parser.parse_object({sub: update}, self.config)
            except SystemExit:
                sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
                raise
        if taken:
            rank_zero_info(f"--ckpt_path: settings not given, taken from the checkpoint: {', '.join(sorted(taken))}")

    def _run_subcommand(self, subcommand: str) -> None:
        """Run it; a damaged checkpoint or one with other settings, found when the Trainer loads it, and options
        that do not fit the data (:class:`~lightning_fedmeta.module.FederatedSetupError`, found at setup) are a
        :class:`FedMetaConfigError` (message alone, exit status 2), as when the CLI finds them first."""
        try:
            super()._run_subcommand(subcommand)
        except (CheckpointDamagedError, CheckpointSettingsError, FederatedSetupError,
                UnsafeCheckpointLoadError) as exc:
            raise FedMetaConfigError(str(exc)) from exc

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.set_defaults(
            {
                "trainer.max_epochs": -1,
                "trainer.max_steps": 100,
                "trainer.num_sanity_val_steps": 0,
                "trainer.log_every_n_steps": 10,
            }
        )
        parser.add_argument(
            "--plots",
            type=bool,
            default=True,
            help="write accuracy-vs-round and per-client histogram PNGs into the log dir at fit/test end",
        )

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        if self._only_subcommand is not None and subcommand != self._only_subcommand:
            self._subcommand_method_arguments[subcommand] = []
            return self.init_parser(**kwargs)  # listed in the subcommands, never parsed in this run
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if subcommand in EVALUATION_COMMANDS:
            parser.add_argument(
                "--untrained",
                type=bool,
                default=False,
                help="evaluate the model as built from the configuration, before any round (round 0), "
                "when no --ckpt_path is given; without it, a missing --ckpt_path is an error",
            )
        return parser

    def before_instantiate_classes(self) -> None:
        cfg = self.config.get(self.subcommand) if self.subcommand else self.config
        _resolve_algorithm(cfg)  # the saved config.yaml and hparams.yaml say every hyper-parameter that ran
        self._want_plots = bool(cfg.get("plots", True))
        if self.subcommand in EVALUATION_COMMANDS:
            _check_evaluation_checkpoint(self.subcommand, cfg.get("ckpt_path"), bool(cfg.get("untrained", False)))

    def instantiate_classes(self) -> None:
        """Instantiate model, data and trainer; a ``ValueError`` of a constructor (the argument checks
        of the algorithm, the module, the data) becomes a :class:`FedMetaConfigError`."""
        try:
            super().instantiate_classes()
        except FedMetaConfigError:
            raise
        except ValueError as exc:
            raise FedMetaConfigError(str(exc)) from exc

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """Add the plot callback (unless ``--plots false``) and a progress bar over rounds,
        keeping every callback the user configured (a user's own progress bar wins)."""
        from lightning.pytorch.callbacks import ProgressBar

        from lightning_fedmeta.frontends.callbacks import PlotCallback, RoundProgressBar

        trainer_cfg = self._get(self.config_init, "trainer", default={}) or {}
        callbacks = kwargs.get("callbacks", trainer_cfg.get("callbacks"))
        callbacks = list(callbacks) if isinstance(callbacks, list | tuple) else ([callbacks] if callbacks else [])
        if getattr(self, "_want_plots", False) and not any(isinstance(c, PlotCallback) for c in callbacks):
            callbacks.append(PlotCallback())
        if trainer_cfg.get("enable_checkpointing") is not False:
            _save_last_checkpoint(callbacks)
        if trainer_cfg.get("enable_model_summary") is not False and not any(isinstance(c, ModelSummary)
                                                                            for c in callbacks):
            callbacks.append(_ModelSummaryWithoutFlops())
        wants_bar = trainer_cfg.get("enable_progress_bar") is not False
        if wants_bar and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(RoundProgressBar())
        kwargs["callbacks"] = callbacks
        return super().instantiate_trainer(**kwargs)


def _save_last_checkpoint(callbacks: list[Any]) -> None:
    """Make ``fedmeta fit`` write ``last.ckpt``, which ``--ckpt_path last`` resumes from: add a
    ``ModelCheckpoint(save_last=True)`` (Lightning's default checkpoint, plus ``last.ckpt``) when the user configured
    none, else turn on ``save_last`` of the first of theirs, unless one already sets it (``save_last: false`` given
    by the user is kept)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    checkpoints = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
    if not checkpoints:
        callbacks.append(ModelCheckpoint(save_last=True))
    elif all(c.save_last is None for c in checkpoints):
        checkpoints[0].save_last = True


def _refuse_code_or_paths(path: str, fill_model: dict[str, Any], model_now: dict[str, Any],
                          fill_data: dict[str, Any], data_now: dict[str, Any]) -> None:
    """Refuse settings about to be taken from the checkpoint (the user did not give them; their value differs from
    this run's) that name code or file-system paths
    (:func:`~lightning_fedmeta.persistence.safe_loading.code_or_path_settings`):
    a checkpoint of plain values naming ``data.root`` would make the run read files there, ``model.loss: pkg.mod.f``
    import a module."""
    refused = code_or_path_settings(
        "model", {k: v for k, v in fill_model.items() if plain_value(v) != plain_value(model_now.get(k))})
    refused += code_or_path_settings(
        "data", {k: v for k, v in fill_data.items() if plain_value(v) != plain_value(data_now.get(k))})
    if refused:
        flags = " ".join(f"--{r.split('=', 1)[0]} VALUE" for r in refused)
        raise FedMetaConfigError(code_or_path_message(
            path, refused, f"If you trust them, give them yourself ({flags}, or in the --config file); otherwise "
            "give your own values"))


def _resolve_algorithm(cfg: Any) -> None:
    """``model.algorithm`` of a parsed subcommand config with every default filled in (in place)."""
    model = _get(cfg, "model")
    if model is not None and _get(model, "algorithm") is not None:
        model["algorithm"] = resolved_algorithm_spec(_get(model, "algorithm"))


def _print_resolved_config(parser: LightningArgumentParser, argv: list[str]) -> NoReturn:
    """``--print_config``: the subcommand's configuration as jsonargparse prints it, with ``model.algorithm``
    resolved (:func:`~lightning_fedmeta.frontends.options.resolved_algorithm_spec`); then exit."""
    rest = [a for a in argv if a.split("=", 1)[0] != "--print_config"]
    config = parser.parse_args(rest)
    sub = config.get("subcommand")
    sub_parser = parser._subcommands_action._name_parser_map[sub]
    _resolve_algorithm(config[sub])
    print(sub_parser.dump(config[sub], skip_none=False), end="")
    sys.exit(0)


def _as_dict(node: Any) -> dict[str, Any]:
    if node is None:
        return {}
    if hasattr(node, "as_dict"):
        return dict(node.as_dict())
    return dict(node)


# third-party console lines that say nothing about a federated run (docs/cli.md, "A quiet console"): Lightning's
# advertisements, availability lines of accelerators that are absent, the note that fedmeta's model summary replaced
# Lightning's, and torch's CUDA_HOME notice when a CPU run compiles
_NOISE_PREFIXES = ("💡 Tip:", "GPU available: False", "TPU available: False", "HPU available: False",
                   "Trainer already configured with model summary callbacks")
_NOISE_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                  "torch.utils.cpp_extension")


class _NoiseFilter(logging.Filter):
    """Drops the log records of :data:`_NOISE_PREFIXES` (and torch's "No CUDA runtime is found")."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith(_NOISE_PREFIXES) or message.startswith("No CUDA runtime is found"))


def quiet_console() -> None:
    """Silence the third-party lines of :data:`_NOISE_PREFIXES` and Lightning's deprecation warnings about torch
    internals (``LeafSpec``), once per process; fedmeta's own lines, errors and warnings stay."""
    for name in _NOISE_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, _NoiseFilter) for f in log.filters):
            log.addFilter(_NoiseFilter())
    warnings.filterwarnings("ignore", message=r".*LeafSpec.*is deprecated")
    # `--ckpt_path last` resumes into a new version_N folder on purpose; Lightning warns that the folder changed
    warnings.filterwarnings("ignore", message=r"The dirpath has changed from")
    # a round's checkpoint holds the model after the round's server step, which is what a federated resume needs
    warnings.filterwarnings("ignore", message=r"Using ModelCheckpoint with manual optimization")


class _ModelSummaryWithoutFlops(ModelSummary):
    """Lightning's text model summary, without the FLOPs column and total when they are 0 (Lightning counts FLOPs
    only for a module with an ``example_input_array``; a 0 reads as a broken model). Text, not a rich table, so a
    log file holds plain lines."""

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        if total_flops:
            ModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                   total_training_modes, total_flops, **summarize_kwargs)
            return
        columns = [column for column in summary_data if column[0] != "FLOPs"]
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes,
                                      total_flops, *columns)
        logging.getLogger(ModelSummary.__module__).info("\n" + table.rsplit("\n", 1)[0])  # without "Total Flops"


def print_algorithms(stream: Any = None) -> None:
    """Print every registered algorithm with its distribution and one-line summary."""
    from lightning_fedmeta.registry import describe_algorithms

    out = stream or sys.stdout
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = describe_algorithms()
    width_n = max([len(r["name"]) for r in rows] + [9])
    width_d = max([len(r["distribution"]) for r in rows] + [12])
    print(f"{'algorithm':<{width_n}}  {'distribution':<{width_d}}  summary", file=out)
    for r in rows:
        mark = "" if r["status"] == "ok" else "[failed to load] "
        print(f"{r['name']:<{width_n}}  {r['distribution']:<{width_d}}  {mark}{r['summary']}", file=out)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``fedmeta`` console script (returns nothing, so the exit status is 0).

    A :class:`FedMetaConfigError` is printed as ``fedmeta: error: <message>`` on stderr, without a
    traceback, and exits with status 2 (as argument errors do). The working directory goes first on ``sys.path``,
    as under ``python -m``, so a ``class_path`` to the user's own module there imports without ``PYTHONPATH=.``.
    """
    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` does: the user's own modules import
        sys.path.insert(0, os.getcwd())
    try:
        run(argv)
    except FedMetaConfigError as exc:
        print(f"fedmeta: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def run(argv: Sequence[str] | None = None) -> Any:
    """Run a ``fedmeta`` command and return the CLI object (``None`` for helper sub-commands).

    Raises:
        FedMetaConfigError: a configuration refused before anything ran (also a ``ValueError``).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "algorithms":
        print_algorithms()
        return None
    if args and args[0] == "compare":
        from lightning_fedmeta.frontends.compare import CompareError, compare_main

        try:
            compare_main(args[1:])
        except (CompareError, FileNotFoundError) as exc:  # a request to fix, not a bug: message alone, status 2
            raise FedMetaConfigError(str(exc)) from exc
        return None
    quiet_console()
    return FedMetaCLI(
        FederatedModule,
        FederatedDataModule,
        args=None if argv is None else args,
        auto_configure_optimizers=False,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": "Personalized federated learning with PyTorch Lightning"},
    )


if __name__ == "__main__":
    main()
