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
"""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_fedmeta.data.datamodule import FederatedDataModule
from lightning_fedmeta.module import FederatedModule

__all__ = ["FedMetaCLI", "FedMetaConfigError", "main", "run", "print_algorithms"]

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


def _requested_subcommand(args: Any, names: Sequence[str]) -> str | None:
    """The subcommand a command line starts with (``fit ...``), or ``None`` when it does not start with one
    (options first, ``--help``, a dict or Namespace of arguments)."""
    if args is None:
        args = sys.argv[1:]
    if isinstance(args, list | tuple) and args and isinstance(args[0], str) and args[0] in names:
        return args[0]
    return None


class FedMetaCLI(LightningCLI):
    """LightningCLI with federated defaults: an epoch is ``data.eval_every`` rounds, ``max_steps`` counts rounds.

    When the command line starts with its subcommand (``fedmeta fit ...``), only that subcommand's parser
    gets the Trainer, model and data arguments; the others are registered with a bare parser, which is
    never used (LightningCLI would build all four from the signatures, most of the start-up's parsing time).
    Any other command line (options before the subcommand, ``fedmeta --help``) builds all four, as usual.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = inspect.signature(LightningCLI.__init__).bind(self, *args, **kwargs)
        self._only_subcommand = _requested_subcommand(bound.arguments.get("args"), tuple(self.subcommands()))
        super().__init__(*args, **kwargs)

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

        from lightning_fedmeta.callbacks import PlotCallback, RoundProgressBar

        trainer_cfg = self._get(self.config_init, "trainer", default={}) or {}
        callbacks = kwargs.get("callbacks", trainer_cfg.get("callbacks"))
        callbacks = list(callbacks) if isinstance(callbacks, list | tuple) else ([callbacks] if callbacks else [])
        if getattr(self, "_want_plots", False) and not any(isinstance(c, PlotCallback) for c in callbacks):
            callbacks.append(PlotCallback())
        wants_bar = trainer_cfg.get("enable_progress_bar") is not False
        if wants_bar and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(RoundProgressBar())
        kwargs["callbacks"] = callbacks
        return super().instantiate_trainer(**kwargs)


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
    traceback, and exits with status 2 (as argument errors do).
    """
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
        from lightning_fedmeta.compare import CompareError, compare_main

        try:
            compare_main(args[1:])
        except (CompareError, FileNotFoundError) as exc:  # a request to fix, not a bug: message alone, status 2
            raise FedMetaConfigError(str(exc)) from exc
        return None
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
