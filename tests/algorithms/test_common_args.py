"""The common arguments (``local_steps``, ``local_lr``, ``batch_size``, ``finetune_*``) are common.

Every algorithm, built-in or plugin, takes them through :class:`Algorithm`, even when its
``__init__`` does not name them, or refuses the ones it lists in ``unused_args`` with the reason;
``repr``/``hparams()`` show only the arguments the algorithm uses.
"""

from __future__ import annotations

import importlib.util
import inspect
from typing import Any

import pytest
import torch
from torch import nn

import lightning_fedmeta.registry as registry
from lightning_fedmeta import Algorithm, Batch, ClientContext, ClientOutput, create_algorithm, list_algorithms
from lightning_fedmeta.algorithms.base import COMMON_ARGS, BatchPlan
from tests.helpers import REPO, one_client

VALUES: dict[str, Any] = {
    "local_steps": 3, "local_lr": 0.05, "batch_size": 7, "finetune_steps": 2, "finetune_lr": 0.02,
    "finetune_batch_size": 5, "local_epochs": 2, "finetune_epochs": 1, "drop_last": True,
}
assert set(VALUES) == set(COMMON_ARGS)

#: arguments some built-ins need to be constructed at all
REQUIRED: dict[str, dict[str, Any]] = {"mtl_graph": {"edges": [[0, 1]]}}


class PluginLike(Algorithm):
    """Built like the pFedMe example: declares its own argument only."""

    step_budget = True  # its update ignores the batches: an empty step is no step (it may count epochs)

    def __init__(self, foo: float = 1.0) -> None:
        super().__init__(local_steps=20)  # its own default for a common argument it does not name
        self.foo = foo

    def client_update(self, ctx, params, batches, state, server_state, client):  # type: ignore[no-untyped-def]
        return ClientOutput({k: v * 0 for k, v in params.items()}, state, {}, {})


class NoFinetune(PluginLike):
    """Declares the fine-tuning arguments unused."""

    unused_args = {"finetune_steps": "it is evaluated with its own model", "finetune_lr": "no fine-tuning"}


def _use(monkeypatch: pytest.MonkeyPatch, cls: type[Algorithm]) -> None:
    monkeypatch.setattr(registry, "load_algorithm", lambda name: cls)


def test_a_plugin_that_declares_only_its_own_arguments_takes_every_common_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _use(monkeypatch, PluginLike)
    alg = create_algorithm("plugin_like", foo=2.0, **VALUES)
    assert [getattr(alg, k) for k in COMMON_ARGS] == [VALUES[k] for k in COMMON_ARGS]
    assert alg.foo == 2.0
    assert alg.round_plan() == BatchPlan(steps=0, per_step=1, batch_size=7, epochs=2, drop_last=True)
    assert alg.eval_plan() == BatchPlan(steps=0, per_step=1, batch_size=5, epochs=1, drop_last=True)
    assert PluginLike(local_steps=3).round_plan() == BatchPlan(steps=3, per_step=1, batch_size=32)
    # the subclass's own value is its default; the caller's replaces it; finetune_lr follows local_lr
    assert PluginLike().local_steps == 20 and PluginLike(local_steps=4).local_steps == 4
    assert PluginLike(local_lr=0.3).finetune_lr == 0.3
    params = inspect.signature(PluginLike.__init__).parameters
    assert list(params) == ["self", "foo", *COMMON_ARGS]
    assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY for k in COMMON_ARGS)
    assert repr(alg) == (
        "PluginLike(local_steps=3, local_lr=0.05, batch_size=7, finetune_steps=2, finetune_lr=0.02, "
        "finetune_batch_size=5, local_epochs=2, finetune_epochs=1, drop_last=True, foo=2.0)"
    )
    with pytest.raises(ValueError, match="finetune_steps must be an integer >= 0, got -1"):
        PluginLike(finetune_steps=-1)
    with pytest.raises(ValueError, match=r"no hyper-parameter\(s\) 'bar'; accepted: foo, local_steps"):
        create_algorithm("plugin_like", bar=1)


def test_a_plugin_honours_finetune_steps_it_does_not_name() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ctx = ClientContext(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(2, 1, 4, 3), torch.randint(0, 2, (2, 1, 4))
    batches = Batch(x, y, torch.ones(2, 1, 4))
    alg = PluginLike(finetune_steps=2, finetune_lr=0.5)
    got = alg.personalize(ctx, params, batches, {}, {}, one_client())
    expected = params
    for t in range(2):
        expected, _ = ctx.sgd_step(expected, batches.at(t, 0), 0.5)
    for k in params:
        assert torch.equal(got[k], expected[k])
        assert not torch.equal(got[k], params[k])


def test_unused_common_arguments_are_refused_with_the_reason_and_not_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    _use(monkeypatch, NoFinetune)
    message = r"'NoFinetune' does not use 'finetune_steps' \('finetune_steps': it is evaluated with its own model\)"
    with pytest.raises(ValueError, match=message):
        create_algorithm("no_finetune", finetune_steps=1)
    with pytest.raises(ValueError, match=message):
        NoFinetune(finetune_steps=1)
    alg = create_algorithm("no_finetune", finetune_batch_size=3, local_lr=0.2)
    assert alg.finetune_batch_size == 3 and alg.local_lr == 0.2
    assert "finetune_steps" not in alg.hparams() and "finetune_lr" not in alg.hparams()
    assert "finetune_steps" not in repr(alg) and "finetune_lr" not in repr(alg)
    assert "finetune_batch_size=3" in repr(alg)
    params = inspect.signature(NoFinetune.__init__).parameters
    assert "finetune_steps" not in params and "finetune_lr" not in params and "finetune_batch_size" in params


def test_a_subclass_cannot_take_an_argument_it_declares_unused_or_declare_a_non_common_one() -> None:
    with pytest.raises(TypeError, match="takes \\['finetune_steps'\\], which its unused_args says"):
        type("Bad", (PluginLike,), {
            "unused_args": {"finetune_steps": "x"},
            "__init__": lambda self, finetune_steps=0: None,
        })
    with pytest.raises(TypeError, match="unused_args names \\['mu'\\], which are not common arguments"):
        type("Bad", (PluginLike,), {"unused_args": {"mu": "x"}})


BUILTINS = sorted(e.name for e in list_algorithms() if e.builtin)


@pytest.mark.parametrize("name", BUILTINS)
@pytest.mark.parametrize("arg", COMMON_ARGS)
def test_every_builtin_takes_each_common_argument_or_refuses_it_with_a_reason(name: str, arg: str) -> None:
    cls = registry.load_algorithm(name)
    required = REQUIRED.get(name, {})
    if arg in cls.unused_args:
        reason = cls.unused_args[arg]
        assert len(reason) > 20, f"{name}: say why it does not use {arg}"
        with pytest.raises(ValueError, match=f"does not use '{arg}'") as info:
            create_algorithm(name, **required, **{arg: VALUES[arg]})
        assert reason in str(info.value)
        alg = create_algorithm(name, **required)
        assert arg not in alg.hparams() and f"{arg}=" not in repr(alg)
        assert arg not in inspect.signature(cls.__init__).parameters
    elif arg == "local_epochs" and not cls.step_budget:  # padded empty steps would move it (test_local_epochs.py)
        with pytest.raises(ValueError, match="cannot count its local work in epochs"):
            create_algorithm(name, **required, **{arg: VALUES[arg]})
    else:
        alg = create_algorithm(name, **required, **{arg: VALUES[arg]})
        assert getattr(alg, arg) == VALUES[arg]
        assert alg.hparams()[arg] == VALUES[arg] and f"{arg}={VALUES[arg]!r}" in repr(alg)


def test_the_builtins_that_refuse_common_arguments_are_these() -> None:
    refused = {name: sorted(registry.load_algorithm(name).unused_args) for name in BUILTINS}
    assert {k: v for k, v in refused.items() if v} == {
        "fdlora": ["finetune_epochs", "finetune_lr", "finetune_steps"],  # its evaluation-time work is AdaFusion's
        "fedmaml": ["local_lr"],
        "mocha": sorted(COMMON_ARGS),
        "perfedavg": ["local_lr"],
        "perfedmaml": ["local_lr"],
        "reptile": ["local_lr"],
    }


def _pfedme_from_source() -> type[Algorithm]:
    """The example plugin's class from the repository's source (whatever copy is installed)."""
    path = REPO / "plugins" / "fedmeta-pfedme" / "src" / "fedmeta_pfedme" / "pfedme.py"
    spec = importlib.util.spec_from_file_location("_pfedme_source_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PFedMe


def test_the_pfedme_example_says_which_common_arguments_it_does_not_use() -> None:
    pfedme = _pfedme_from_source()
    with pytest.raises(ValueError, match="does not use 'finetune_steps'.*prox solve"):
        pfedme(finetune_steps=1)
    alg = pfedme(local_steps=4, local_lr=0.001, batch_size=8)
    assert (alg.local_steps, alg.local_lr, alg.batch_size) == (4, 0.001, 8)
    assert "finetune" not in repr(alg)
    assert repr(alg).startswith("PFedMe(local_steps=4, local_lr=0.001, batch_size=8, ")


def test_hparams_keep_none_values() -> None:
    alg = create_algorithm("fedavg", batch_size=None)
    assert alg.hparams()["batch_size"] is None and "batch_size=None" in repr(alg)
