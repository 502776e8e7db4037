"""The Flower deployment (issue 15) computes what the in-process loop computes, without a network.

The ServerApp's round loop runs against an in-process grid that calls the ClientApp's handlers with
constructed Messages and Contexts (one Context per node, its ``partition-id`` in the node config, its state
on disk). Each test runs the same fedmeta YAML config through ``FederatedModule`` + ``Trainer`` and through
the deployment and compares the global model (and the clients' and the server's state) to 1e-5.
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install lightning-fedmeta[flower])")

from flwr.app import Context, Error, Message, Metadata, RecordDict  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from lightning_fedmeta.client.sampling import sample_clients  # noqa: E402
from lightning_fedmeta.flower import ClientStateFile, load_config, write_app  # noqa: E402
from lightning_fedmeta.flower.client import LocalClient, data_spec_of, load_partition, partition_of  # noqa: E402
from lightning_fedmeta.flower.client_app import app as client_app  # noqa: E402
from lightning_fedmeta.flower.server import DeploymentServer  # noqa: E402
from lightning_fedmeta.reliability.participation import answering_clients  # noqa: E402
from tests.helpers import make_trainer  # noqa: E402

NUM_CLIENTS = 5
ROUNDS = 3
PER_ROUND = 3

ALGORITHMS = {
    "fedavg": "{name: fedavg, local_lr: 0.05, local_steps: 2, batch_size: 8}",
    "perfedavg_hf": "{name: perfedavg, variant: hf, alpha: 0.02, beta: 0.05, delta: 0.001, local_steps: 2, "
                    "batch_size: 8}",
    "ditto": "{name: ditto, lam: 0.1, local_lr: 0.05, local_steps: 2, batch_size: 8}",
    "scaffold": "{name: scaffold, local_lr: 0.05, local_steps: 2, batch_size: 8}",
}


def write_config(tmp: Path, algorithm: str, server_lr: float = 0.7, extra: str = "") -> Path:
    path = tmp / "fedmeta.yaml"
    path.write_text(textwrap.dedent(f"""\
        seed_everything: 3
        trainer: {{max_steps: {ROUNDS}}}
        model:
          algorithm: {algorithm}
          clients_per_round: {PER_ROUND}
          server_lr: {server_lr}
          seed: 11
          model:
            class_path: lightning_fedmeta.models.reference.MLP
            init_args: {{in_features: 60, hidden: [6], num_classes: 10}}
        {extra}
        data: {{dataset: synthetic, num_clients: {NUM_CLIENTS}, eval_every: 100, synthetic_alpha: 0.5,
               synthetic_beta: 0.5}}
        """))
    return path


@pytest.fixture(autouse=True)
def task_identity() -> Any:
    """Messages outside a Flower process need a task identity (the SuperLink sets it in a deployment)."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


class InProcessGrid:
    """A grid whose nodes are ClientApp calls in this process; ``fail`` = {(message type, round, partition)}
    answered with an error reply (a client that crashed), as Flower reports it."""

    def __init__(self, config: Path, state_dir: Path, fail: set[tuple[str, int, int]] = frozenset()) -> None:
        self.node_of = {1000 + p: p for p in range(NUM_CLIENTS)}
        self.run_config = {"fedmeta-config": str(config)}
        self.state_dir = state_dir
        self.fail = set(fail)
        self.node_extra: dict[str, Any] = {}  # further node config of every node (e.g. upload-client-state)
        self.sent: list[tuple[str, int, int]] = []
        self.replies: dict[str, Message] = {}

    def get_node_ids(self) -> list[int]:
        return list(self.node_of)

    def push_messages(self, messages: Any) -> list[str]:
        ids = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            pid = self.node_of[node]
            context = Context(
                run_id=7, node_id=node, state=RecordDict(), run_config=dict(self.run_config),
                node_config={"partition-id": pid, "num-partitions": NUM_CLIENTS, "state-dir": str(self.state_dir),
                             **self.node_extra},
            )
            kind = msg.metadata.message_type
            round_idx = int(msg.content.config_records["config"]["round"]) if kind != "query" else -1
            self.sent.append((kind, round_idx, pid))
            if (kind, round_idx, pid) in self.fail:
                reply = Message(Error(code=2, reason="ClientApp raised an exception (test)"), reply_to=msg)
            else:
                try:
                    reply = client_app(msg, context)
                except Exception as exc:  # as a SuperNode reports a ClientApp that raised
                    reply = Message(Error(code=2, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)
            mid = f"m{len(self.sent)}"
            m = reply.metadata  # as the SuperLink delivers it: from the node the message went to
            metadata = Metadata(m.run_id, f"r{mid}", node, m.dst_node_id, mid, m.group_id, m.created_at, m.ttl,
                                m.message_type)
            self.replies[mid] = Message(reply.error if reply.has_error() else reply.content, metadata=metadata)
            ids.append(mid)
        return ids

    def pull_messages(self, message_ids: Any) -> list[Message]:
        return [self.replies.pop(mid) for mid in list(message_ids) if mid in self.replies]

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        return self.pull_messages(self.push_messages(messages))


def in_process(cfg_path: Path, **module_kwargs: Any) -> Any:
    """The in-process run of the config (FederatedModule + Trainer, validation off)."""
    cfg = load_config(cfg_path)
    dm = cfg.datamodule()
    dm.setup("fit")
    module = cfg.reference_module(cfg.build_model(data_spec_of(dm.federated_data)), **module_kwargs)
    make_trainer(ROUNDS, limit_val_batches=0).fit(module, datamodule=dm)
    return module


def deployed(cfg_path: Path, tmp: Path, fail: set[tuple[str, int, int]] = frozenset(),
             node_config: dict[str, Any] | None = None, **run_config: Any) -> tuple[Any, InProcessGrid]:
    grid = InProcessGrid(cfg_path, tmp / "states", fail)
    grid.run_config.update(run_config)
    grid.node_extra.update(node_config or {})
    server = DeploymentServer(load_config(cfg_path), grid, run_key="t", checkpoint=str(tmp / "ckpt.pt"),
                              output_dir=str(tmp / "out"), node_timeout=1.0)
    server.run()
    return server, grid


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def client_state(tmp: Path, server: DeploymentServer, pid: int) -> dict[str, Any]:
    return ClientStateFile(tmp / "states", "t", pid).load(int(server.state_round[pid]))


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_deployment_equals_in_process(name: str, tmp_path: Path) -> None:
    cfg_path = write_config(tmp_path, ALGORITHMS[name])
    reference = in_process(cfg_path)
    # Ditto's aggregate reads no client state: its personal models can stay on the nodes (the node's choice)
    server, grid = deployed(cfg_path, tmp_path, node_config={"upload-client-state": False} if name == "ditto" else {})
    sizes = server.counts.tolist()
    assert len(set(sizes)) > 1, sizes  # unequal clients: the weights matter
    sampled = [sample_clients(11, r, torch.arange(NUM_CLIENTS), PER_ROUND).tolist() for r in range(ROUNDS)]
    assert [e["answered"] for e in server.history] == sampled
    assert len(set().union(*map(set, sampled))) < NUM_CLIENTS or any(len(s) < NUM_CLIENTS for s in sampled)
    ref_params = {n: p.detach() for n, p in reference.model.named_parameters()}
    moved = max_diff(ref_params, server.init_params)
    assert moved > 1e-3  # the rounds changed the model, so equality below is not trivial
    diff = max_diff(ref_params, server.params())
    print(f"\n{name}: max |w_flower - w_in_process| = {diff:.3g} (moved {moved:.3g})")
    assert diff < 1e-5
    final = torch.load(tmp_path / "out" / "final_params.pt", weights_only=True)
    assert max_diff(final, ref_params) < 1e-5
    assert torch.equal(server.seen, reference.seen)
    # the personalised evaluation after the last round: the module's per-client sums, pooled
    scores = reference.evaluate_clients(torch.arange(NUM_CLIENTS), ROUNDS)
    total = float(scores["total"].sum())
    evaluated = server.history[-1]["evaluate"]
    assert evaluated["loss_weighted"] == pytest.approx(float(scores["loss_sum"].sum()) / total, abs=1e-5)
    col = list(reference.metric.builtin).index("acc")
    assert evaluated["acc_weighted"] == pytest.approx(float(scores["builtin"][:, col].sum()) / total, abs=1e-6)
    if name == "scaffold":  # server state (c) and client state (c_i)
        from lightning_fedmeta.persistence.memory_store import flatten_state

        assert max_diff(flatten_state(server.server_state), flatten_state(reference.server_state)) < 1e-5
    if name in ("ditto", "scaffold"):
        from lightning_fedmeta.persistence.memory_store import flatten_state

        for pid in server.seen.nonzero().flatten().tolist():
            ref_row = {k: v[pid] for k, v in flatten_state(reference.client_states.tensors).items()}
            assert max_diff(flatten_state(client_state(tmp_path, server, pid)), ref_row) < 1e-5


SERVER_STAGES = {
    "median": "  aggregator: median",
    # secure_mode off: the deployment's noise is then the in-process run's, so the two can be compared
    "dp_adaptive": "  aggregation: uniform\n          dp: {clip: 0.05, noise_multiplier: 0.2, adaptive_clip: true, "
                   "secure_mode: false}",
}


@pytest.mark.parametrize("stage", list(SERVER_STAGES))
def test_deployment_with_robust_rule_or_dp_equals_in_process(stage: str, tmp_path: Path) -> None:
    """model.aggregator and model.dp deploy: the ServerApp runs the simulator's server pipeline, so the global
    model (DP noise and adaptive clipping included) and the summaries (worst decile included) are the
    in-process run's."""
    cfg_path = write_config(tmp_path, ALGORITHMS["fedavg"], extra=SERVER_STAGES[stage])
    reference = in_process(cfg_path)
    server, _ = deployed(cfg_path, tmp_path)
    ref_params = {n: p.detach() for n, p in reference.model.named_parameters()}
    assert max_diff(ref_params, server.init_params) > 1e-3
    assert max_diff(ref_params, server.params()) < 1e-5
    if stage == "dp_adaptive":
        assert all("dp" in entry for entry in server.history)
        last = [entry["dp"] for entry in server.history if "dp" in entry][-1]  # ε as the module accounts it
        assert last["epsilon"] == pytest.approx(reference.epsilon_spent(ROUNDS), rel=1e-12)
        assert last["secure_mode"] is False
        assert server.dp_clip != 0.05 and server.dp_clip == pytest.approx(float(reference.dp_clip), rel=1e-6)
        (tmp_path / "plain").mkdir()
        noiseless, _ = deployed(write_config(tmp_path / "plain", ALGORITHMS["fedavg"], extra=SERVER_STAGES[stage]
                                             .replace("noise_multiplier: 0.2", "noise_multiplier: 0.0")),
                                tmp_path / "plain")
        assert max_diff(noiseless.params(), server.params()) > 1e-4  # the noise moved the model
    evaluated = server.history[-1]["evaluate"]
    reference.evaluator.metric.reset()
    reference.evaluator.metric.update(torch.arange(NUM_CLIENTS),
                                      reference.evaluate_clients(torch.arange(NUM_CLIENTS), ROUNDS))
    summary = reference.evaluator.metric.summaries(reference.engine.federation.summary_groups())
    for key in ("acc_weighted", "acc_mean", "acc_worst10", "loss_worst10"):
        assert evaluated[key] == pytest.approx(float(summary["clients"][key]), abs=1e-5), key


def test_deployed_dp_draws_its_noise_from_a_secret_by_default(tmp_path: Path) -> None:
    """A deployment turns model.dp.secure_mode on unless the config turns it off: the same config deployed
    twice gives two different models (the noise is not reproducible from model.seed), and neither is the
    in-process (seeded) run's."""
    extra = "  aggregation: uniform\n          dp: {clip: 0.05, noise_multiplier: 0.2}"
    cfg_path = write_config(tmp_path, ALGORITHMS["fedavg"], extra=extra)
    reference = {n: p.detach() for n, p in in_process(cfg_path).model.named_parameters()}
    runs = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        server, _ = deployed(write_config(tmp_path / name, ALGORITHMS["fedavg"], extra=extra), tmp_path / name)
        assert server.federation.reliability.dp.secure_mode and server.draws is not None
        runs.append(server.params())
    assert max_diff(runs[0], runs[1]) > 1e-4 and max_diff(runs[0], reference) > 1e-4


def test_a_dp_round_nobody_answered_releases_the_noise(tmp_path: Path) -> None:
    """Every sampled client of round 1 fails: under model.dp the round still releases Δ = (σC/m)·ξ (skipping it
    would publish that nobody took part), and adaptive clipping's denominator is the answer rate seen so far."""
    extra = "  aggregation: uniform\n          dp: {clip: 0.05, noise_multiplier: 0.2, secure_mode: false}"
    cfg_path = write_config(tmp_path, ALGORITHMS["fedavg"], extra=extra)
    fail = {("train", 1, c) for c in range(NUM_CLIENTS)}
    server, _ = deployed(cfg_path, tmp_path, fail)
    silent = server.history[1]
    assert silent["answered"] == [] and "dp" in silent  # released: its privacy report is logged
    answered = sum(len(e["answered"]) for e in server.history if "sampled" in e)
    sampled = sum(len(e["sampled"]) for e in server.history if "sampled" in e)
    assert server.expected_answers() == pytest.approx(PER_ROUND * answered / sampled)
    assert server.expected_answers() < PER_ROUND


def test_failed_reply_aggregates_survivors(tmp_path: Path) -> None:
    """A client whose reply is an error is left out: the round aggregates the others with renormalised weights
    and the failed client's personal state is untouched, as client_dropout does in process."""
    p = 0.35
    cfg_path = write_config(tmp_path, ALGORITHMS["ditto"])
    reference = in_process(cfg_path, client_dropout=p)
    fail = set()
    for r in range(ROUNDS):
        sampled = sample_clients(11, r, torch.arange(NUM_CLIENTS), PER_ROUND)
        answered = set(answering_clients(11, r, sampled, p, PER_ROUND).tolist())
        fail |= {("train", r, c) for c in sampled.tolist() if c not in answered}
    assert fail, "the seed must make at least one client fail"
    server, _ = deployed(cfg_path, tmp_path, fail)
    assert [(f["round"], f["partition"]) for f in server.failures] == sorted((r, c) for _, r, c in fail)
    diff = max_diff({n: p.detach() for n, p in reference.model.named_parameters()}, server.params())
    print(f"\nditto with failed replies {sorted(fail)}: max diff {diff:.3g}")
    assert diff < 1e-5
    assert torch.equal(server.seen, reference.seen)


def test_state_file_survives_a_new_process_and_is_atomic(tmp_path: Path) -> None:
    files = ClientStateFile(tmp_path, "run 1", 3)
    state = {"personal": {"w": torch.arange(6.0).reshape(2, 3)}, "c": torch.tensor(2.5, dtype=torch.float64)}
    files.save(4, state)
    again = ClientStateFile(tmp_path, "run 1", 3).load(4)  # a new object: a restarted node
    assert torch.equal(again["personal"]["w"], state["personal"]["w"]) and again["c"].dtype == torch.float64
    assert [p.name for p in files.directory.iterdir()] == ["round-4.pt"]  # no temporary file left behind
    files.save(6, state)
    files.save(7, state)
    files.prune({6, 7})
    assert files.rounds() == [6, 7]
    with pytest.raises(ValueError, match="partition-id 3 after round 5 is missing"):
        files.load(5)


def test_bad_node_and_run_config_name_the_option(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="partition-id is missing"):
        partition_of({"num-partitions": 2})
    with pytest.raises(ValueError, match="partition-id = 2 is out of range for num-partitions = 2"):
        partition_of({"partition-id": 2, "num-partitions": 2})
    with pytest.raises(ValueError, match="model.algorithm"):
        load_config(write_config(tmp_path, "{name: no_such_algorithm}"))
    with pytest.raises(ValueError, match="model.client_dropout"):
        load_config(write_config(tmp_path, "fedavg", extra="  client_dropout: 0.2"))
    cfg = load_config(write_config(tmp_path, "fedavg"))
    with pytest.raises(ValueError, match="num-partitions = 4 but the config's data has 5 clients"):
        load_partition(cfg, 0, 4)
    app = write_app(tmp_path / "app", tmp_path / "fedmeta.yaml", output_dir="/x", max_retries=1)
    text = (app / "pyproject.toml").read_text()
    assert f'fedmeta-config = "{(tmp_path / "fedmeta.yaml").resolve()}"' in text and "max-retries = 1" in text


def test_local_client_draws_the_simulators_batches(tmp_path: Path) -> None:
    """The node's mini-batches are the rows the in-process loop draws for that client (its own rows only)."""
    cfg = load_config(write_config(tmp_path, ALGORITHMS["fedavg"]))
    dm = cfg.datamodule()
    dm.setup("fit")
    module = cfg.reference_module(cfg.build_model(data_spec_of(dm.federated_data)))
    module.attach_data(dm.federated_data)
    c = 3
    client = LocalClient(cfg, load_partition(cfg, c, NUM_CLIENTS), c)
    width = int(dm.federated_data.train_counts.max())
    mine = client.gatherer.batches("train", 2, torch.tensor([c]), cfg.algorithm().round_plan(), width)
    theirs = module._batches("train", 2, torch.tensor([c]), module.algorithm.round_plan())
    assert torch.equal(mine.x, theirs.x.cpu()) and torch.equal(mine.y, theirs.y.cpu())
    assert torch.equal(mine.mask, theirs.mask.cpu())
    assert not math.isnan(float(mine.x.sum()))


def test_restarted_server_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """A ServerApp that dies after round 1 resumes from its checkpoint at round 2 with the clients' state files
    (state key from the checkpoint), and ends with the uninterrupted in-process model."""
    cfg_path = write_config(tmp_path, ALGORITHMS["scaffold"])
    reference = in_process(cfg_path)
    grid = InProcessGrid(cfg_path, tmp_path / "states")
    first = DeploymentServer(load_config(cfg_path), grid, run_key="t", checkpoint=str(tmp_path / "ckpt.pt"),
                             node_timeout=1.0)
    calls = []

    def crash_at_round_2(r: int) -> Any:
        if r == 2:
            raise RuntimeError("ServerApp killed")
        calls.append(r)
        return DeploymentServer.train_round(first, r)

    first.train_round = crash_at_round_2  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="killed"):
        first.run()
    assert calls == [0, 1] and int(torch.load(tmp_path / "ckpt.pt", weights_only=False)["round"]) == 2
    second = DeploymentServer(load_config(cfg_path), grid, run_key="another-run", checkpoint=str(tmp_path / "ckpt.pt"),
                              node_timeout=1.0)
    second.run()
    assert second.run_key == "t" and [e["round"] for e in second.history] == [0, 1, 2]
    diff = max_diff({n: p.detach() for n, p in reference.model.named_parameters()}, second.params())
    assert diff < 1e-5


def client_tensors(partition_id: int, num_partitions: int) -> tuple[torch.Tensor, ...]:
    """A user hook (node config ``client-data = "tests.frontends.test_flower:client_tensors"``): this node's own
    tensors."""
    g = torch.Generator().manual_seed(partition_id)
    x, y = torch.randn(9 + partition_id, 60, generator=g), torch.randint(0, 10, (9 + partition_id,), generator=g)
    return x[:7], y[:7], x[7:], y[7:]


def test_user_hook_supplies_the_node_data(tmp_path: Path) -> None:
    cfg = load_config(write_config(tmp_path, ALGORITHMS["fedavg"]))
    data = load_partition(cfg, 2, NUM_CLIENTS, "tests.frontends.test_flower:client_tensors")
    x, y, tx, ty = client_tensors(2, NUM_CLIENTS)
    assert data.num_clients == 1 and torch.equal(data.train_x, x) and torch.equal(data.test_y, ty)
    assert data.num_classes == 10  # from model.model.init_args.num_classes
    with pytest.raises(ValueError, match="client-data = 'tests.frontends.test_flower:nothing'"):
        load_partition(cfg, 2, NUM_CLIENTS, "tests.frontends.test_flower:nothing")


def test_deployment_of_a_lora_model_sends_the_adapters_only_and_equals_in_process(tmp_path: Path) -> None:
    """A model with frozen parameters (LoRA adapters on an MLP): the nodes receive and return the adapters alone,
    each builds the same frozen base from the config's seed, and the run equals the in-process one."""
    cfg_path = write_config(tmp_path, ALGORITHMS["fedavg"])
    text = cfg_path.read_text().replace(
        "class_path: lightning_fedmeta.models.reference.MLP\n    init_args: {in_features: 60, hidden: [6], "
        "num_classes: 10}",
        "class_path: lightning_fedmeta.models.LoRAModel\n    init_args:\n      model: {class_path: "
        "lightning_fedmeta.models.reference.MLP, init_args: {in_features: 60, hidden: [6], num_classes: 10}}\n"
        "      rank: 2\n      alpha: 4.0")
    assert "LoRAModel" in text
    cfg_path.write_text(text)
    reference = in_process(cfg_path)
    server, _grid = deployed(cfg_path, tmp_path)
    adapters = {n: p.detach() for n, p in reference.model.named_parameters() if p.requires_grad}
    assert adapters and all(n.endswith(("lora_A", "lora_B")) for n in adapters)
    assert sorted(server.params()) == sorted(adapters) == sorted(server.init_params)
    assert max_diff(adapters, server.init_params) > 1e-4  # the adapters trained
    assert max_diff(adapters, server.params()) < 1e-5
    base = {n: p.detach() for n, p in reference.model.named_parameters() if not p.requires_grad}
    assert max_diff(base, {n: p.detach() for n, p in server.model.named_parameters() if not p.requires_grad}) == 0
