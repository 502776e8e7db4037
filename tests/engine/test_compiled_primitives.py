"""Compiled client primitives (``compile_clients``): the same numbers as the eager batched path.

Most tests compile with dynamo's ``"eager"`` backend: it exercises everything this library adds (leaving the
clients' vmap, the programs' keys and guards, static arguments, fallbacks) in a fraction of inductor's
compile time; ``tests/engine/test_compile_clients.py`` runs inductor itself.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.func import vmap

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.client.compiled import (
    AUTO_COMPILE_SECONDS,
    COMPILE_SAVING,
    PROGRAM_COMPILE_SECONDS,
    PrimitiveCompiler,
    describe_decision,
    worth_compiling,
)
from lightning_fedmeta.client.functional import Batch, ClientContext
from tests.conftest import run_plain_rounds
from tests.helpers import fit, tiny_data, tiny_datamodule, tiny_module

ALGORITHMS: list[dict[str, Any]] = [
    {"name": "fedavg", "local_lr": 0.1},
    {"name": "fedprox", "local_lr": 0.1, "mu": 0.5},
    {"name": "scaffold", "local_lr": 0.1},
    {"name": "perfedavg", "variant": "fo", "alpha": 0.1, "beta": 0.1},
    {"name": "perfedavg", "variant": "hf", "alpha": 0.1, "beta": 0.1, "delta": 0.01},
    {"name": "perfedavg", "variant": "exact", "alpha": 0.1, "beta": 0.1},
    {"name": "reptile", "alpha": 0.1},
    {"name": "fedmaml", "alpha": 0.1},
    {"name": "fedmaml", "alpha": 0.1, "second_order": True},
    {"name": "ditto", "local_lr": 0.1, "lam": 0.5},
    {"name": "mtl_mean", "local_lr": 0.1, "lam": 0.5},
]


def _module(spec: dict[str, Any], compile_clients: bool, backend: str = "eager") -> FederatedModule:
    torch.manual_seed(0)
    module = FederatedModule(
        model=nn.Sequential(nn.Linear(5, 8), nn.ELU(), nn.Linear(8, 3)),
        algorithm={**spec, "local_steps": 3, "batch_size": 4, "finetune_steps": 1},
        clients_per_round=4, compile_clients=compile_clients, holdout_clients=1,
    )
    module.compiler.backend = backend
    module.attach_data(tiny_data(num_clients=7))
    return module


def _three_rounds(module: FederatedModule) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    run_plain_rounds(module, 3)
    scores = module.evaluate_clients(torch.arange(7), 3)
    return {k: v.detach().clone() for k, v in module.model.named_parameters()}, scores["loss_sum"]


@pytest.mark.parametrize("spec", ALGORITHMS, ids=lambda s: "-".join(str(v) for v in s.values() if v is not True))
def test_compiled_primitives_give_the_eager_rounds_and_evaluation(spec: dict[str, Any]) -> None:
    """Unequal clients, a held-out client, partial participation; three rounds and a personalised evaluation."""
    eager_params, eager_loss = _three_rounds(_module(spec, False))
    compiled = _module(spec, True)
    compiled_params, compiled_loss = _three_rounds(compiled)
    for k in eager_params:
        torch.testing.assert_close(compiled_params[k], eager_params[k], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled_loss, eager_loss, atol=1e-5, rtol=1e-5)
    stats = compiled.compiler.stats
    assert stats.programs >= 1 and stats.compiled_calls > 0 and not stats.failures


@pytest.mark.spawns  # inductor runs the C++ compiler
def test_inductor_compiles_one_program_per_primitive_and_reuses_it_for_every_step() -> None:
    """Per-FedAvg HF: one program for the meta step, called τ times per round, for every round."""
    module = _module(ALGORITHMS[4], True, backend="inductor")
    module.attach_data(tiny_data(num_clients=7))
    run_plain_rounds(module, 2)
    stats = module.compiler.stats
    assert stats.programs == 1, stats
    assert stats.compiled_calls == 2 * 3  # 2 rounds × τ = 3 steps
    eager = _module(ALGORITHMS[4], False)
    run_plain_rounds(eager, 2)
    for (k, v), (_, ref) in zip(module.model.named_parameters(), eager.model.named_parameters(), strict=True):
        torch.testing.assert_close(v, ref, atol=1e-5, rtol=1e-5, msg=k)


def test_two_primitives_with_equal_shapes_never_share_a_program() -> None:
    """grad and loss_and_grad take the same tensors: each has its own compiled program (own code object)."""
    model = nn.Linear(3, 2)
    ctx = ClientContext(model, compiler=PrimitiveCompiler(enabled=True, backend="eager"))
    params = {k: v.detach() for k, v in model.named_parameters()}
    batch = Batch(torch.randn(4, 5, 3), torch.randint(0, 2, (4, 5)), torch.ones(4, 5))
    g, (loss, g2) = vmap(lambda b: (ctx.grad(params, b), ctx.loss_and_grad(params, b)))(batch)
    assert isinstance(g, dict) and isinstance(g2, dict) and loss.shape == (4,)
    for k in g:
        torch.testing.assert_close(g[k], g2[k])
    assert ctx.compiler is not None and ctx.compiler.stats.programs == 2


def test_a_changed_hyper_parameter_compiles_a_new_program_instead_of_reusing_a_stale_one() -> None:
    spec = ALGORITHMS[3]
    eager, compiled = _module(spec, False), _module(spec, True)
    for module in (eager, compiled):
        run_plain_rounds(module, 1)
        module.algorithm.beta = 0.02  # e.g. a callback decaying the meta step size
        run_plain_rounds(module, 1, first=1)
    for (k, v), (_, ref) in zip(compiled.model.named_parameters(), eager.model.named_parameters(), strict=True):
        torch.testing.assert_close(v, ref, atol=1e-6, rtol=1e-5, msg=k)
    assert compiled.compiler.stats.programs == 2


def test_a_primitive_that_cannot_compile_warns_once_and_runs_eagerly_batched() -> None:
    def failing_backend(gm: Any, example_inputs: Any) -> Any:
        raise RuntimeError("no C++ compiler on this machine")

    eager = _module(ALGORITHMS[0], False)
    compiled = _module(ALGORITHMS[0], True, backend=failing_backend)  # type: ignore[arg-type]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_plain_rounds(compiled, 2)
    messages = [str(w.message) for w in caught if "could not compile the client primitive" in str(w.message)]
    assert len(messages) == 1 and "no C++ compiler" in messages[0]
    run_plain_rounds(eager, 2)
    for (k, v), (_, ref) in zip(compiled.model.named_parameters(), eager.model.named_parameters(), strict=True):
        assert torch.equal(v, ref), k
    assert compiled.compiler.stats.failures and compiled.compiler.stats.programs == 0


def test_primitives_called_outside_the_clients_vmap_or_needing_a_gradient_run_eagerly() -> None:
    model = nn.Linear(3, 2)
    compiler = PrimitiveCompiler(enabled=True, backend="eager")
    ctx = ClientContext(model, compiler=compiler)
    params = {k: v.detach() for k, v in model.named_parameters()}
    batch = Batch(torch.randn(5, 3), torch.randint(0, 2, (5,)), torch.ones(5))
    ctx.grad(params, batch)  # no vmap: one client, eager
    train = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    loss = ctx.loss(train, batch)  # a caller's autograd graph through the primitive: eager
    loss.backward()
    assert all(p.grad is not None for p in train.values())
    assert compiler.stats.programs == 0 and compiler.stats.compiled_calls == 0


def test_train_and_eval_mode_are_different_programs() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.0), nn.Linear(4, 2))
    compiler = PrimitiveCompiler(enabled=True, backend="eager")
    ctx = ClientContext(model, compiler=compiler)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x = torch.randn(2, 5, 3)
    vmap(lambda x: ctx.predict(params, x))(x)
    model.eval()
    vmap(lambda x: ctx.predict(params, x))(x)
    assert compiler.stats.programs == 2


def test_auto_decision_rule() -> None:
    assert worth_compiling(1000, 0.25)  # 250 s of eager client time
    assert not worth_compiling(100, 0.05)  # 5 s
    assert not worth_compiling(10, AUTO_COMPILE_SECONDS / 10)  # 30 s eager saves ~10 s: less than one compile
    seconds = PROGRAM_COMPILE_SECONDS / COMPILE_SAVING  # eager time whose saving pays exactly one program
    assert worth_compiling(1, seconds) and not worth_compiling(1, seconds, programs=2)
    # issue 38: 3 rounds of PFLlib's Dir(0.1) column (~30 s eager, buckets 8 + 2 + 1): eager; 2000 rounds: compile
    assert not worth_compiling(1, 30.0, programs=3) and worth_compiling(1998, 30.0, programs=3)
    assert not worth_compiling(None, 10.0)  # unknown length: eager is never wrong
    assert "compiling" in describe_decision(True, 1000, 0.25) and "1000 rounds" in describe_decision(True, 1000, 0.25)
    assert "stay eager" in describe_decision(False, None, 0.25)


def _fit(tmp_path: Any, steps: int, ckpt: str | None = None, **kwargs: Any) -> FederatedModule:
    module = tiny_module({"name": "fedavg", "local_steps": 2, "batch_size": 4}, **kwargs)
    module.compiler.backend = "eager"
    return fit(module, tiny_datamodule(eval_every=100), steps, ckpt_path=ckpt, enable_checkpointing=True,
               default_root_dir=tmp_path)


def test_auto_stays_eager_for_a_short_run_and_the_decision_is_kept_in_the_checkpoint(tmp_path: Any) -> None:
    module = _fit(tmp_path, 3)
    assert module.compile_clients == "auto" and module.compile_decision is False
    assert module.compiler.stats.programs == 0
    ckpt = next((tmp_path / "checkpoints").glob("*.ckpt")) if (tmp_path / "checkpoints").exists() else None
    if ckpt is None:
        ckpt = tmp_path / "last.ckpt"
        module.trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)
    assert saved["fedmeta"]["engine"]["compile"]["compile_decision"] is False


def test_auto_compiles_a_run_long_enough_to_pay_for_it(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    always = lambda left, seconds, programs=1: left is not None  # noqa: E731
    monkeypatch.setattr("lightning_fedmeta.loop.compile_policy.worth_compiling", always)
    module = _fit(tmp_path, 4)
    assert module.compile_decision is True
    assert module.compiler.stats.compiled_calls == 2 * 2  # rounds 3 and 4 (after the two timed eager rounds), τ = 2


def test_a_resumed_auto_run_keeps_the_decision_of_its_checkpoint(tmp_path: Any) -> None:
    first = _fit(tmp_path, 2)
    first.compile_decision = True  # as if round 2 had decided to compile
    path = tmp_path / "decided.ckpt"
    first.trainer.save_checkpoint(path)
    resumed = _fit(tmp_path, 4, ckpt=str(path))
    assert resumed.compile_decision is True
    assert resumed.compiler.stats.compiled_calls == 2 * 2  # rounds 3 and 4 compiled at once, no new timing


def test_compile_clients_refuses_other_values() -> None:
    with pytest.raises(ValueError, match="compile_clients must be"):
        FederatedModule(model=nn.Linear(5, 3), compile_clients="yes")  # type: ignore[arg-type]


def test_a_program_never_serves_operands_that_alias_differently_from_those_it_was_compiled_for() -> None:
    """A prox step's model and centre are the same tensor in a round's first step and differ later: a program
    compiled for aliased inputs must not be reused for distinct ones (nor the reverse)."""
    model = nn.Linear(3, 2)
    ctx = ClientContext(model, compiler=PrimitiveCompiler(enabled=True, backend="aot_eager"))
    eager = ClientContext(model)

    def step(c: ClientContext, w: dict[str, torch.Tensor], u: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: 2.0 * w[k] - u[k] for k in w}

    stacked = {k: v.detach().expand(4, *v.shape) + torch.arange(4.0).reshape(-1, *[1] * v.dim()) for k, v in
               model.named_parameters()}
    for same in (True, False, True):
        def run(c: ClientContext, same: bool = same) -> dict[str, torch.Tensor]:
            return vmap(lambda w: c.step(step, w, w if same else {k: v * 3.0 for k, v in w.items()}))(stacked)

        got, want = run(ctx), run(eager)
        for k in got:
            torch.testing.assert_close(got[k], want[k])
    assert ctx.compiler is not None and ctx.compiler.stats.compiled_calls == 3
