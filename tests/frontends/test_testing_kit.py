"""The plugin author's kit (lightning_fedmeta.testing) and the errors at the algorithm boundary.

Each deliberately broken algorithm below has one bug a plugin author could write; the kit must
fail on it with a message that names the algorithm, the check and the key or problem. The same
bugs met by a plain ``Trainer.fit`` must fail on the first round with a message naming the
algorithm, the function, the key, the expected and the actual value (lightning_fedmeta.loop.validation),
not with a raw PyTorch error deep inside the round.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_fedmeta import Algorithm, Batch, ClientContext, ClientOutput, ClientRecord, FederatedModule, Params
from lightning_fedmeta.client.execution import BatchingError, run_clients
from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.loop.validation import (
    AlgorithmContractError,
    validate_aggregate_output,
    validate_client_output,
    validate_init_client_states,
)
from lightning_fedmeta.testing import (
    CHECKS,
    check_algorithm,
    check_bf16,
    check_loop_equals_vmap,
    check_personalize_matches_evaluation,
    check_resume_is_bit_exact,
    check_round,
    client_record,
    quadratic_client,
    tiny_clients,
    tiny_mlp,
)
from tests.helpers import fit


# ----------------------------------------------------------------------------------------------
# a correct algorithm with personal state, and broken variants of it
# ----------------------------------------------------------------------------------------------
def _last(params: Params) -> str:
    return list(params)[-1]


class PersonalBias(Algorithm):
    """Local SGD; a client keeps the last-layer bias its local training reached and is evaluated with it
    once it has trained (before that, with the global bias)."""

    def __init__(self, local_steps: int = 2, local_lr: float = 0.1, batch_size: int | None = 8) -> None:
        super().__init__(local_steps, local_lr, batch_size)

    def init_client_state(self, params: Params) -> dict[str, Tensor]:
        return {"bias": torch.zeros_like(params[_last(params)])}

    def local_sgd(self, ctx: ClientContext, params: Params, batches: Batch) -> tuple[Params, Tensor]:
        w, losses = params, []
        for t in range(batches.x.shape[0]):
            w, loss = ctx.sgd_step(w, batches.at(t, 0), self.local_lr)
            losses.append(loss)
        return w, torch.stack(losses).mean()

    def client_update(self, ctx, params, batches, state, server_state, client) -> ClientOutput:  # noqa: ANN001
        w, loss = self.local_sgd(ctx, params, batches)
        delta = {k: w[k] - params[k] for k in params}
        return ClientOutput(delta, {"bias": w[_last(params)]}, {}, {"loss": loss})

    def personal_start(self, params, state, server_state, client) -> Params:  # noqa: ANN001
        key = _last(params)
        return {**params, key: torch.where(client.seen, state["bias"], params[key])}


class StateRowOfShapeOne(PersonalBias):
    """A step counter meant as a 0-d row, returned as shape [1]."""

    def init_client_state(self, params: Params) -> dict[str, Tensor]:
        return {**super().init_client_state(params), "steps": torch.zeros(())}

    def client_update(self, ctx, params, batches, state, server_state, client) -> ClientOutput:  # noqa: ANN001
        out = super().client_update(ctx, params, batches, state, server_state, client)
        return out._replace(state={**out.state, "steps": state["steps"].reshape(1) + 1})


class DeltaWithoutLastLayerBias(PersonalBias):
    def client_update(self, ctx, params, batches, state, server_state, client) -> ClientOutput:  # noqa: ANN001
        out = super().client_update(ctx, params, batches, state, server_state, client)
        return out._replace(delta={k: v for k, v in out.delta.items() if k != _last(params)})


class BranchesOnTheLoss(PersonalBias):
    """Halves its step when the loss is large: a Python ``if`` on a tensor's value."""

    def client_update(self, ctx, params, batches, state, server_state, client) -> ClientOutput:  # noqa: ANN001
        out = super().client_update(ctx, params, batches, state, server_state, client)
        if out.metrics["loss"] > 0.0:
            out = out._replace(delta={k: 0.5 * v for k, v in out.delta.items()})
        return out


class BranchesOnTheLossLooped(BranchesOnTheLoss):
    batchable = False


class NonFiniteUpdate(PersonalBias):
    def client_update(self, ctx, params, batches, state, server_state, client) -> ClientOutput:  # noqa: ANN001
        out = super().client_update(ctx, params, batches, state, server_state, client)
        key = _last(params)
        return out._replace(delta={**out.delta, key: out.delta[key] / 0.0})


class PersonalizeCountsItsCalls(PersonalBias):
    """Hidden Python state in ``personalize``: every call shifts the personal bias a little more, so the
    evaluation (one batched call for many clients) and ``module.personalize(i)`` (one call per client)
    score different models."""

    calls = 0

    def personalize(self, ctx, params, batches, state, server_state, client) -> Params:  # noqa: ANN001
        self.calls += 1
        w = super().personalize(ctx, params, batches, state, server_state, client)
        key = _last(params)
        return {**w, key: w[key] + 0.5 * self.calls}


class NeverTrainedReadsItsInitialState(PersonalBias):
    def personal_start(self, params, state, server_state, client) -> Params:  # noqa: ANN001
        return {**params, _last(params): state["bias"]}


class CountsCallsInPython(PersonalBias):
    """Hidden Python state: the step size shrinks with every call, so looped clients (one call each) and
    batched clients (one call per chunk) train differently."""

    calls = 0

    def client_update(self, ctx, params, batches, state, server_state, client) -> ClientOutput:  # noqa: ANN001
        self.calls += 1
        out = super().client_update(ctx, params, batches, state, server_state, client)
        return out._replace(delta={k: v / self.calls for k, v in out.delta.items()})


class ForgetsItsRoundOnResume(PersonalBias):
    """Keeps the round count in a Python attribute instead of the server state: a resumed run restarts it."""

    rounds_seen = 0

    def aggregate(self, params, outputs, weights, server_state, clients):  # noqa: ANN001, ANN201
        self.rounds_seen += 1
        delta, server_state = super().aggregate(params, outputs, weights, server_state, clients)
        return {k: v / self.rounds_seen for k, v in delta.items()}, server_state


def _fails(check: Any, algorithm: Algorithm | type[Algorithm], *patterns: str, **kwargs: Any) -> str:
    with pytest.raises(AssertionError) as info:
        check(algorithm, **kwargs)
    message = str(info.value)
    for pattern in patterns:
        assert pattern in message, f"{pattern!r} not in: {message}"
    return message


# ----------------------------------------------------------------------------------------------
# the kit passes a correct algorithm in every form of spec
# ----------------------------------------------------------------------------------------------
def test_a_correct_algorithm_passes_every_check() -> None:
    check_algorithm(PersonalBias())


@pytest.mark.parametrize("spec", ["fedavg", {"name": "fedavg", "local_steps": 2}, PersonalBias, PersonalBias()],
                         ids=["name", "mapping", "class", "instance"])
def test_every_form_of_spec_is_accepted(spec: Any) -> None:
    check_round(spec)


def test_each_check_is_callable_alone_and_skip_is_validated() -> None:
    for check in (check_round, check_loop_equals_vmap, check_personalize_matches_evaluation,
                  check_resume_is_bit_exact, check_bf16):
        check(PersonalBias(), model=tiny_mlp(), data=tiny_clients(6))
    check_algorithm(PersonalBias(), skip=CHECKS)
    with pytest.raises(ValueError, match=r"unknown check\(s\) \['check_speed'\]"):
        check_algorithm("fedavg", skip=["check_speed"])


@pytest.mark.spawns
def test_the_kit_imports_without_pytest() -> None:
    code = "import sys; sys.modules['pytest'] = None; import lightning_fedmeta.testing as t; print(len(t.CHECKS))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "7"  # check_exchange (issue 28) and check_population_view joined the five


def test_the_kit_leaves_the_thread_count_and_logging_as_it_found_them() -> None:
    import logging

    threads = torch.get_num_threads()
    level = logging.getLogger("lightning.pytorch").level
    check_round("fedavg")
    assert torch.get_num_threads() == threads
    assert logging.getLogger("lightning.pytorch").level == level


# ----------------------------------------------------------------------------------------------
# the kit catches broken algorithms, naming the check and the key
# ----------------------------------------------------------------------------------------------
def test_a_state_row_of_shape_one_where_a_scalar_was_meant() -> None:
    _fails(check_algorithm, StateRowOfShapeOne(), "StateRowOfShapeOne failed check_round",
           "StateRowOfShapeOne.client_update returned state['steps'] with shape [1] per client",
           "its stored row (from init_client_state) has shape []")


def test_a_delta_with_a_missing_key() -> None:
    _fails(check_algorithm, DeltaWithoutLastLayerBias(), "failed check_round",
           "DeltaWithoutLastLayerBias.client_update returned delta without delta['2.bias']")


def test_data_dependent_python_control_flow_under_vmap() -> None:
    message = _fails(check_algorithm, BranchesOnTheLoss(), "BranchesOnTheLoss failed check_round", "BatchingError",
                     "BranchesOnTheLoss.client_update uses a tensor's value in Python control flow",
                     "torch.where", "batchable = False", 'client_batching="loop"')
    assert "data-dependent control flow" in message  # PyTorch's own words are kept
    check_algorithm(BranchesOnTheLossLooped())  # the same code, declared not batchable, is fine


def test_a_non_finite_update() -> None:
    _fails(check_algorithm, NonFiniteUpdate(), "NonFiniteUpdate failed check_round",
           "NonFiniteUpdate.client_update returned delta['2.bias'] holding a non-finite value")


def test_personalize_with_hidden_state_that_differs_from_the_evaluation() -> None:
    _fails(check_personalize_matches_evaluation, PersonalizeCountsItsCalls(),
           "failed check_personalize_matches_evaluation", "module.personalize(")


def test_a_never_trained_client_that_reads_its_initial_state() -> None:
    _fails(check_personalize_matches_evaluation, NeverTrainedReadsItsInitialState(),
           "failed check_personalize_matches_evaluation", "has never trained, yet its personalised model (2.bias) "
           "changes with its stored state")


def test_hidden_python_state_makes_loop_and_vmap_differ() -> None:
    check_round(CountsCallsInPython())  # nothing wrong with a single run's shapes
    _fails(check_algorithm, CountsCallsInPython(), "failed check_loop_equals_vmap", "round 0: client_update's delta",
           "(loop vs vmap)")


def test_state_outside_the_checkpoint_breaks_bit_exact_resume() -> None:
    _fails(check_algorithm, ForgetsItsRoundOnResume(), "failed check_resume_is_bit_exact", "not bit-identical",
           "(uninterrupted vs resumed)")


def test_a_failing_model_or_hyper_parameter_is_reported_as_the_checks_failure() -> None:
    message = _fails(check_round, PersonalBias(), "failed check_round", "the model's output has shape",
                     model=nn.Linear(5, 2))
    assert message.startswith("PersonalBias failed check_round: ValueError:")


# ----------------------------------------------------------------------------------------------
# fixtures
# ----------------------------------------------------------------------------------------------
def test_tiny_clients_are_unequal_deterministic_and_a_federated_dataset() -> None:
    from lightning_fedmeta import FederatedDataset

    data = tiny_clients()
    assert isinstance(data, FederatedDataset)
    assert data.num_classes == 3 and data.num_clients == 8
    clients = data.client_data()
    assert [len(c[1]) for c in clients] == [6, 20, 9, 14, 5, 30, 8, 11]
    assert all(len(c[3]) == 6 for c in clients)
    again = tiny_clients().client_data()
    assert all(torch.equal(a, b) for c1, c2 in zip(clients, again, strict=True) for a, b in zip(c1, c2, strict=True))
    assert [len(c[1]) for c in tiny_clients(3, sizes=[4, 5, 6], num_features=2).client_data()] == [4, 5, 6]
    assert tiny_clients(10).federated_data().num_clients == 10


def test_quadratic_client_closed_forms_match_the_client_context() -> None:
    q = quadratic_client(dim=3, num_samples=12, steps=4)
    assert q.batches.x.shape == (4, 1, 12, 3)
    torch.testing.assert_close(q.ctx.loss(q.params, q.batches.at(0, 0)), q.loss(q.params))
    torch.testing.assert_close(q.ctx.grad(q.params, q.batches.at(0, 0)), q.grad(q.params))
    w = q.params
    for t in range(4):
        w, _ = q.ctx.sgd_step(w, q.batches.at(t, 0), 0.1)
    torch.testing.assert_close(w, q.gd(q.params, 0.1, 4))
    best = q.minimizer()
    assert float(q.grad(best)["weight"].abs().max()) < 1e-10
    prox = q.prox(q.params, 2.0)  # ∇f(θ) + λ(θ − w) = 0
    optimality = q.grad(prox)["weight"] + 2.0 * (prox["weight"] - q.params["weight"])
    assert float(optimality.abs().max()) < 1e-10
    assert q.record.num_samples == 12 and not bool(q.record.seen) and q.record.index.dim() == 0


def test_client_record_is_one_clients_unstacked_record() -> None:
    rec = client_record(7, index=3, weight=0.25, seen=True)
    assert isinstance(rec, ClientRecord)
    assert (int(rec.index), float(rec.weight), bool(rec.seen), bool(rec.is_new), int(rec.num_samples)) == (
        3, 0.25, True, False, 7)
    assert all(t.dim() == 0 for t in rec)


# ----------------------------------------------------------------------------------------------
# errors at the boundary, met by a plain Trainer.fit
# ----------------------------------------------------------------------------------------------
def _fit(algorithm: Algorithm, rounds: int = 1, **kwargs: Any) -> FederatedModule:
    module = FederatedModule(model=tiny_mlp(), algorithm=algorithm, clients_per_round=3, holdout_clients=2,
                             **kwargs)
    return fit(module, FederatedDataModule(dataset=tiny_clients(), eval_every=rounds), rounds)


@pytest.mark.parametrize("batching", ["vmap", "loop"])
def test_a_state_row_of_the_wrong_shape_fails_on_the_first_round_with_names_and_shapes(batching: str) -> None:
    """Before validation this was ``IndexError: index_copy_(): ... Source dimensionality (2), destination
    dimensionality (1)`` from inside the state scatter."""
    with pytest.raises(AlgorithmContractError) as info:
        _fit(StateRowOfShapeOne(), client_batching=batching)
    assert str(info.value) == (
        "StateRowOfShapeOne.client_update returned state['steps'] with shape [1] per client, but its stored row "
        "(from init_client_state) has shape []; client_update must return every state entry with the shape and "
        "dtype of its row"
    )


class _Configurable(PersonalBias):
    """Returns whatever a test puts in its hooks."""

    def __init__(self, **hooks: Any) -> None:
        super().__init__()
        self.hooks = hooks

    def init_client_states(self, params: Params, clients: ClientRecord) -> dict[str, Tensor]:
        states = super().init_client_states(params, clients)
        return self.hooks.get("init_client_states", lambda s, p, c: s)(states, params, clients)

    def init_server_state(self, params: Params) -> dict[str, Tensor]:
        return self.hooks.get("init_server_state", lambda p: {"count": torch.zeros(())})(params)

    def client_update(self, ctx, params, batches, state, server_state, client) -> ClientOutput:  # noqa: ANN001
        out = super().client_update(ctx, params, batches, state, server_state, client)
        return self.hooks.get("client_update", lambda o: o)(out)

    def aggregate(self, params, outputs, weights, server_state, clients):  # noqa: ANN001, ANN201
        delta, _ = super().aggregate(params, outputs, weights, server_state, clients)
        result = (delta, {"count": server_state["count"] + 1})
        return self.hooks.get("aggregate", lambda r: r)(result)


@pytest.mark.parametrize(
    ("hooks", "message"),
    [
        ({"init_client_states": lambda s, p, c: {"bias": s["bias"][:3]}},
         "_Configurable.init_client_states returned state['bias'] with shape [3, 3], but it must stack one row per "
         "client along axis 0: expected a leading axis of 8 (the number of clients), got [3]"),
        ({"init_client_states": lambda s, p, c: {"bias": s["bias"] * float("nan")}},
         "_Configurable.init_client_states returned state['bias'] holding a non-finite value (NaN or inf)"),
        ({"init_client_states": lambda s, p, c: {"bias": 0.5}},
         "_Configurable.init_client_states returned state['bias'] as a float (0.5); every entry must be a tensor"),
        ({"init_server_state": lambda p: {"count": torch.tensor(float("nan"))}},
         "_Configurable.init_server_state returned server_state['count'] holding NaN"),
        ({"init_server_state": lambda p: [torch.zeros(())]},
         "_Configurable.init_server_state returned the server state as a list; it must be a dict of tensors"),
        ({"client_update": lambda o: o._replace(state={"bias": o.state["bias"].long()})},
         "_Configurable.client_update returned state['bias'] as torch.int64, but its stored row (from "
         "init_client_states) is torch.float32"),
        ({"client_update": lambda o: o._replace(state={**o.state, "extra": o.state["bias"]})},
         "_Configurable.client_update returned state with unexpected state['extra']: state must have exactly the "
         "keys of the client state from _Configurable.init_client_states (state['bias'])"),
        ({"client_update": lambda o: o._replace(metrics={"loss": o.metrics["loss"].expand(4)})},
         "_Configurable.client_update returned metrics['loss'] with shape [4] per client; a metric must be one "
         "scalar (0-d tensor) per client"),
        ({"client_update": lambda o: dict(o._asdict())},
         "_Configurable.client_update returned a dict; it must return ClientOutput(delta, state, extras, metrics)"),
        ({"client_update": lambda o: o._replace(delta={k: v.double() for k, v in o.delta.items()})},
         "_Configurable.client_update returned delta['0.weight'] as torch.float64, but the parameter is "
         "torch.float32"),
        ({"aggregate": lambda r: (r[0], {"count": r[1]["count"].reshape(1)})},
         "_Configurable.aggregate returned server_state['count'] with shape [1], but the server state it received "
         "has shape []"),
        ({"aggregate": lambda r: (r[0], {})},
         "_Configurable.aggregate returned server_state without server_state['count']"),
        ({"aggregate": lambda r: r[0]},
         "_Configurable.aggregate returned a dict; it must return a pair (delta, server_state)"),
        ({"aggregate": lambda r: ({k: v[None] for k, v in r[0].items()}, r[1])},
         "_Configurable.aggregate returned delta['0.weight'] with shape [1, 8, 5], but the parameter has shape "
         "[8, 5]"),
    ],
    ids=["init-rows", "init-nan", "init-not-a-tensor", "server-nan", "server-not-a-dict", "state-dtype",
         "state-extra-key", "metric-not-scalar", "not-a-client-output", "delta-dtype", "server-shape",
         "server-missing-key", "aggregate-not-a-pair", "aggregate-delta-shape"],
)
def test_what_an_algorithm_returns_is_checked_at_the_boundary(hooks: dict, message: str) -> None:
    with pytest.raises(AlgorithmContractError) as info:
        _fit(_Configurable(**hooks))
    assert message in str(info.value)


def test_the_boundary_checks_run_once_then_cost_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_fedmeta.loop.client_storage as client_state_py
    import lightning_fedmeta.loop.engine as engine_py

    calls: dict[str, int] = {}

    def counting(where: Any, name: str) -> Any:
        real = getattr(where, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)

        return wrapper

    for where, name in ((engine_py, "validate_client_output"), (engine_py, "validate_aggregate_output"),
                        (client_state_py, "validate_init_client_states"), (engine_py, "validate_init_server_state")):
        monkeypatch.setattr(where, name, counting(where, name))
    _fit(PersonalBias(), rounds=4)
    assert calls == {"validate_init_client_states": 1, "validate_init_server_state": 1,
                     "validate_client_output": 1, "validate_aggregate_output": 1}


def test_bf16_autocast_accepts_a_lower_floating_precision_but_not_another_kind() -> None:
    params = {"w": torch.zeros(2, 3)}
    stored = {"s": torch.zeros(8, 3), "c": torch.zeros(8, dtype=torch.long)}
    alg = PersonalBias()
    out = ClientOutput({"w": torch.zeros(4, 2, 3, dtype=torch.bfloat16)},
                       {"s": torch.zeros(4, 3, dtype=torch.bfloat16), "c": torch.zeros(4, dtype=torch.long)}, {},
                       {"loss": torch.zeros(4)})
    validate_client_output(alg, out, params, stored, 4, strict_dtypes=False)
    with pytest.raises(AlgorithmContractError, match=r"delta\['w'\] as torch.bfloat16, but the parameter is"):
        validate_client_output(alg, out, params, stored, 4, strict_dtypes=True)
    wrong_kind = out._replace(state={**out.state, "c": torch.zeros(4)})
    with pytest.raises(AlgorithmContractError, match=r"state\['c'\] as torch.float32, but its stored row"):
        validate_client_output(alg, wrong_kind, params, stored, 4, strict_dtypes=False)


def test_nested_state_is_named_by_its_path() -> None:
    alg = PersonalBias()
    stored = {"personal": {"head": {"bias": torch.zeros(8, 3)}}}
    validate_init_client_states(alg, stored, 8)
    with pytest.raises(AlgorithmContractError, match=r"state\['personal'\]\['head'\]\['bias'\] with shape \[3\]"):
        validate_init_client_states(alg, {"personal": {"head": {"bias": torch.zeros(3)}}}, 8)
    out = ClientOutput({"w": torch.zeros(4, 2)}, {"personal": {"head": {"bias": torch.zeros(4, 1, 3)}}}, {},
                       {"loss": torch.zeros(4)})
    with pytest.raises(AlgorithmContractError) as info:
        validate_client_output(alg, out, {"w": torch.zeros(2)}, stored, 4)
    assert "state['personal']['head']['bias'] with shape [1, 3] per client, but its stored row" in str(info.value)
    with pytest.raises(AlgorithmContractError, match=r"server_state\['a'\]\[1\] holding NaN"):
        validate_aggregate_output(alg, ({"w": torch.zeros(2)}, {"a": [torch.zeros(()), torch.tensor(float("nan"))]}),
                                  {"w": torch.zeros(2)}, {"a": [torch.zeros(()), torch.zeros(())]})


def test_infinity_is_a_legal_server_state_sentinel() -> None:
    """MOCHA starts its duality gap at +inf; NaN is refused, inf is not."""
    alg = PersonalBias()
    validate_aggregate_output(alg, ({"w": torch.zeros(2)}, {"gap": torch.tensor(float("inf"))}),
                              {"w": torch.zeros(2)}, {"gap": torch.tensor(1.0)})


# ----------------------------------------------------------------------------------------------
# vmap: PyTorch's raw errors become one clear error naming the fix
# ----------------------------------------------------------------------------------------------
def test_data_dependent_control_flow_under_vmap_names_the_fix_and_keeps_the_original() -> None:
    with pytest.raises(BatchingError) as info:
        _fit(BranchesOnTheLoss(), client_batching="vmap")
    message = str(info.value)
    assert message.startswith("BranchesOnTheLoss.client_update uses a tensor's value in Python control flow")
    for fix in ("torch.where(cond, a, b)", "`batchable = False` on the algorithm class", 'client_batching="loop"'):
        assert fix in message
    assert isinstance(info.value, RuntimeError)
    assert isinstance(info.value.__cause__, RuntimeError) and "data-dependent control flow" in str(info.value.__cause__)
    _fit(BranchesOnTheLoss(), client_batching="loop")  # looped, the same code runs


@pytest.mark.parametrize(
    ("fn", "pattern"),
    [
        (lambda x: x * x.sum().item(), "uses a tensor's value in Python control flow"),
        (lambda x: x * int(x.argmax()), "uses a tensor's value in Python control flow"),
        (lambda x: x + torch.randn_like(x), "draws random numbers"),
    ],
    ids=["item", "int", "random"],
)
def test_run_clients_explains_vmap_errors(fn: Any, pattern: str) -> None:
    with pytest.raises(BatchingError, match=rf"^MyAlgo.client_update {pattern}"):
        run_clients(fn, (), (torch.randn(3, 4),), 3, "vmap", label="MyAlgo.client_update")
    run_clients(fn, (), (torch.randn(3, 4),), 3, "loop")  # fine in the loop


def test_other_errors_under_vmap_pass_through_unchanged() -> None:
    def broken(x: Tensor) -> Tensor:
        raise RuntimeError("something else")

    with pytest.raises(RuntimeError, match="^something else$") as info:
        run_clients(broken, (), (torch.randn(3, 4),), 3, "vmap")
    assert not isinstance(info.value, BatchingError)
