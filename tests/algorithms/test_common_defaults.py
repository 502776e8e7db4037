"""``Algorithm.common_defaults`` and what the CLI sees of every algorithm's common arguments.

An algorithm gives a common argument its own default without naming it in ``__init__`` by listing it in
``common_defaults``: the signature (so ``create_algorithm``, ``--print_config`` and jsonargparse) shows that default,
a caller who leaves the argument out gets it, and a caller who passes it replaces it. The meta-learners (Reptile,
FedMAML, Per-FedAvg, PerFedMAML) declare theirs this way; what they accept and default to is unchanged.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest

from lightning_fedmeta import Algorithm, ClientOutput, create_algorithm
from lightning_fedmeta.algorithms import FedMAML, PerFedAvg, PerFedMAML, Reptile
from lightning_fedmeta.algorithms.base import COMMON_ARGS
from lightning_fedmeta.cli import run
from lightning_fedmeta.frontends.options import resolved_algorithm_spec


class MetaLike(Algorithm):
    """Declares its own argument and two defaults of common ones."""

    step_budget = True
    common_defaults = {"local_steps": 2, "finetune_batch_size": None}

    def __init__(self, gamma: float = 0.5) -> None:
        super().__init__(local_steps=7)  # replaced by common_defaults (or the caller's value), as a caller's would
        self.gamma = gamma

    def client_update(self, ctx, params, batches, state, server_state, client):  # type: ignore[no-untyped-def]
        return ClientOutput({k: v * 0 for k, v in params.items()}, state, {}, {})


class NamesIt(FedMAML):
    """A subclass of a class with common_defaults that names one of them itself."""

    def __init__(self, alpha: float = 0.01, local_steps: int = 4) -> None:
        super().__init__(alpha=alpha, local_steps=local_steps)


def test_common_defaults_are_the_signature_defaults_and_what_a_caller_gets() -> None:
    params = inspect.signature(MetaLike.__init__).parameters
    assert list(params) == ["self", "gamma", *COMMON_ARGS]
    assert params["local_steps"].default == 2 and params["finetune_batch_size"].default is None
    assert params["local_steps"].kind is inspect.Parameter.KEYWORD_ONLY
    assert params["batch_size"].default == 32  # not declared: Algorithm's
    alg = MetaLike()
    assert (alg.local_steps, alg.finetune_batch_size, alg.batch_size) == (2, None, 32)
    assert MetaLike(local_steps=5).local_steps == 5 and MetaLike(finetune_batch_size=3).finetune_batch_size == 3
    assert "_caller_common_args" not in vars(alg)  # the hand-off to Algorithm.__init__ does not linger


def test_an_inherited_default_gives_way_to_a_subclass_that_names_the_argument() -> None:
    assert NamesIt().local_steps == 4 and NamesIt(local_steps=6).local_steps == 6
    assert NamesIt().finetune_steps == 1  # still FedMAML's declared default
    assert inspect.signature(NamesIt.__init__).parameters["local_steps"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD


def test_common_defaults_naming_something_else_is_refused() -> None:
    with pytest.raises(TypeError, match=r"common_defaults names \['mu'\], which are not common arguments"):
        type("Bad", (MetaLike,), {"common_defaults": {"mu": 1}})
    with pytest.raises(TypeError, match=r"common_defaults names \['local_steps'\]"):
        type("Bad", (MetaLike,), {"common_defaults": {"local_steps": 1},
                                  "__init__": lambda self, local_steps=1: None})
    with pytest.raises(TypeError, match=r"common_defaults names \['local_lr'\]"):  # refused ones take no default
        type("Bad", (FedMAML,), {"common_defaults": {"local_lr": 0.1}})


@pytest.mark.parametrize(("cls", "expected"), [
    (Reptile, {"local_steps": 10, "batch_size": 32, "finetune_steps": 1, "finetune_batch_size": None}),
    (FedMAML, {"local_steps": 1, "batch_size": 32, "finetune_steps": 1, "finetune_batch_size": None}),
    (PerFedAvg, {"local_steps": 10, "batch_size": 40, "finetune_steps": 1, "finetune_batch_size": None}),
    (PerFedMAML, {"local_steps": 1, "batch_size": 32, "finetune_steps": 1, "finetune_batch_size": None}),
])
def test_the_meta_learners_keep_their_defaults(cls: type[Algorithm], expected: dict[str, Any]) -> None:
    alg = cls(alpha=0.3)
    assert {k: getattr(alg, k) for k in expected} == expected
    assert alg.finetune_lr == 0.3  # evaluated after the adaptation step it was meta-trained for
    assert cls(alpha=0.3, finetune_lr=None).finetune_lr == 0.3 and cls(alpha=0.3, finetune_lr=0.2).finetune_lr == 0.2
    assert {k: resolved_algorithm_spec(cls.name)[k] for k in expected} == expected  # what --print_config writes
    with pytest.raises(ValueError, match="alpha must be >= 0"):
        cls(alpha=-1.0)
    with pytest.raises(ValueError, match="does not use 'local_lr'"):
        create_algorithm(cls.name, local_lr=0.1)


def _help_options(class_path: str, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """``fedmeta fit --model.algorithm.help CLASS``: the options it lists, with their printed defaults."""
    with pytest.raises(SystemExit) as info:
        run(["fit", "--model.algorithm.help", class_path])
    assert info.value.code in (0, None)
    shown = re.sub(r"\s+", " ", capsys.readouterr().out)
    return dict(re.findall(r"--model\.algorithm\.(\w+) \S+ .*?default: ([^)]*)\)", shown))


@pytest.mark.parametrize("class_path", [
    "lightning_fedmeta.algorithms.fedmaml.FedMAML",
    "lightning_fedmeta.algorithms.perfedavg.PerFedAvg",
    "lightning_fedmeta.algorithms.fedavg.FedAvg",
    "tests.algorithms.test_common_defaults.MetaLike",
])
def test_the_cli_help_shows_every_argument_with_its_default(
    class_path: str, capsys: pytest.CaptureFixture[str]
) -> None:
    module, _, name = class_path.rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    params = {n: p for n, p in inspect.signature(cls.__init__).parameters.items() if n != "self"}
    shown = _help_options(class_path, capsys)
    assert set(shown) == set(params), f"{name}: --help shows {sorted(shown)}, the signature {sorted(params)}"
    assert not set(shown) & set(cls.unused_args)
    for n, p in params.items():
        printed = "null" if p.default is None else str(p.default)
        assert shown[n] == printed, f"{name}.{n}: --help says {shown[n]}, the signature {printed}"


class Forwards(Algorithm):
    """An ``__init__`` with ``**kwargs`` that hands them on itself."""

    common_defaults = {"local_steps": 3}

    def __init__(self, delta: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.delta = delta

    def client_update(self, ctx, params, batches, state, server_state, client):  # type: ignore[no-untyped-def]
        return ClientOutput({k: v * 0 for k, v in params.items()}, state, {}, {})


def test_a_forwarding_init_gets_the_declared_default_and_the_callers_value() -> None:
    assert Forwards().local_steps == 3 and Forwards(local_steps=5).local_steps == 5
    assert Forwards(batch_size=4).batch_size == 4
    params = inspect.signature(Forwards.__init__).parameters
    assert params["local_steps"].default == 3 and list(params)[-1] == "kwargs"
