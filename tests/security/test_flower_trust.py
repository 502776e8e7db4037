"""A Flower deployment that one bad node, a stale checkpoint or a run config cannot subvert (issue 25).

Each test drives the in-process pieces (the ServerApp's round loop against the in-process grid of
tests/frontends/test_flower.py, the ClientApp's handlers, the config reader) with crafted replies, files and
configs, as an attacker who controls one SuperNode, the server's checkpoint file or the run config would.
docs/security.md, "Flower deployments".
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr", reason="flwr is not installed (pip install lightning-fedmeta[flower])")

from flwr.app import ConfigRecord, MetricRecord  # noqa: E402

from lightning_fedmeta.flower import ClientStateFile, load_config  # noqa: E402
from lightning_fedmeta.flower import client as client_module  # noqa: E402
from lightning_fedmeta.flower.records import record_to_tree, tree_to_record  # noqa: E402
from lightning_fedmeta.flower.server import DeploymentServer  # noqa: E402
from lightning_fedmeta.persistence.memory_store import flatten_state, unflatten_state  # noqa: E402
from tests.frontends.test_flower import (  # noqa: E402
    ALGORITHMS,
    NUM_CLIENTS,
    ROUNDS,
    InProcessGrid,
    task_identity,  # noqa: F401  (autouse: messages outside a Flower process need a task identity)
    write_config,
)


# ----------------------------------------------------------------------------------------------
# item 14: the module's option checks
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("extra", "message"), [
    ("  clients_per_round: 0", "clients_per_round must be an integer >= 1"),
    ("  fraction: 0.5", "give clients_per_round or fraction, not both"),
    ("  aggregation: bogus", "aggregation must be 'samples' or 'uniform'"),
    ("  metrics: {}", "metrics must be a non-empty mapping"),
    ("  aggregator: no_such_rule", "aggregator"),
])
def test_config_runs_the_modules_option_checks(extra: str, message: str, tmp_path: Path) -> None:
    """A config the in-process module refuses is refused when the deployment reads it, with the module's
    message (old code: clients_per_round 0 ran and -2 sampled 2 clients)."""
    with pytest.raises(ValueError, match=message):
        load_config(write_config(tmp_path, ALGORITHMS["fedavg"], extra=extra))


def test_config_refuses_negative_clients_per_round_and_exact_step_server_lr(tmp_path: Path) -> None:
    path = write_config(tmp_path, ALGORITHMS["fedavg"])
    path.write_text(path.read_text().replace("clients_per_round: 3", "clients_per_round: -2"))
    with pytest.raises(ValueError, match="clients_per_round must be an integer >= 1"):
        load_config(path)
    # MOCHA's server step is exact: the module refuses server_lr != 1 (options.check_server_optimizer)
    with pytest.raises(ValueError, match="updates its models outside the server optimizer"):
        load_config(write_config(tmp_path, "{name: mocha}", server_lr=0.7))


# ----------------------------------------------------------------------------------------------
# item 4: the ServerApp's checkpoint is data, never code
# ----------------------------------------------------------------------------------------------
class _RunsCode:
    """A pickled object that creates a folder when unpickled (stands in for ``os.system``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.marker),))


def new_server(cfg_path: Path, tmp: Path, grid: InProcessGrid | None = None, **kwargs: Any) -> DeploymentServer:
    grid = grid or InProcessGrid(cfg_path, tmp / "states")
    return DeploymentServer(load_config(cfg_path), grid, run_key="t", checkpoint=str(tmp / "ckpt.pt"),
                            node_timeout=1.0, **kwargs)


def test_server_checkpoint_with_a_pickle_payload_is_refused_not_run(tmp_path: Path) -> None:
    cfg_path = write_config(tmp_path, ALGORITHMS["fedavg"])
    marker = tmp_path / "payload-ran"
    torch.save({"round": 1, "payload": _RunsCode(marker)}, tmp_path / "ckpt.pt")
    server = new_server(cfg_path, tmp_path)
    server.discover()
    with pytest.raises(ValueError, match="holds more than tensors and plain values"):
        server.setup()
    assert not marker.exists()


def test_server_checkpoint_round_trips_as_plain_data_with_the_run_token(tmp_path: Path) -> None:
    """The checkpoint the server writes loads with weights_only=True and keeps the run's identity."""
    cfg_path = write_config(tmp_path, ALGORITHMS["scaffold"])
    first = new_server(cfg_path, tmp_path)
    first.run()
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert saved["run_token"] == first.run_token and len(first.run_token) == 32
    second = new_server(cfg_path, tmp_path)
    second.discover()
    second.setup()
    assert second.run_token == first.run_token and second.round == first.round


# ----------------------------------------------------------------------------------------------
# item 7: the run's identity travels with the node state; node-side settings come from node config only
# ----------------------------------------------------------------------------------------------
def test_second_deployment_with_the_same_run_key_is_refused_not_overwriting(tmp_path: Path) -> None:
    state = {"personal": torch.arange(3.0)}
    mine = ClientStateFile(tmp_path, "shared-key", 2, run_token="a" * 32)
    mine.save(0, state)
    theirs = ClientStateFile(tmp_path, "shared-key", 2, run_token="b" * 32)
    with pytest.raises(ValueError, match="belongs to another deployment .* same run-key 'shared-key'"):
        theirs.save(0, {"personal": torch.zeros(3)})
    with pytest.raises(ValueError, match="belongs to another deployment"):
        theirs.load(0)
    assert torch.equal(mine.load(0)["personal"], state["personal"])  # untouched


def test_two_servers_with_the_same_run_key_do_not_mix_node_state(tmp_path: Path) -> None:
    """Two deployments on the same nodes and run-key: the second one's train messages fail on every node (a
    clear error per client, logged by the server), the first one's personal state is left as it was."""
    cfg_path = write_config(tmp_path, ALGORITHMS["ditto"])
    first = new_server(cfg_path, tmp_path)
    first.run()
    files = {p: ClientStateFile(tmp_path / "states", "t", p) for p in range(NUM_CLIENTS)}
    before = {p: {r: f.path(r).read_bytes() for r in f.rounds()} for p, f in files.items()}
    (tmp_path / "other").mkdir()
    other = DeploymentServer(load_config(cfg_path), InProcessGrid(cfg_path, tmp_path / "states"), run_key="t",
                             checkpoint=str(tmp_path / "other" / "ckpt.pt"), node_timeout=1.0, evaluate=False)
    other.run()
    assert other.failures and all("belongs to another deployment" in f["reason"] for f in other.failures)
    assert {p: {r: f.path(r).read_bytes() for r in f.rounds()} for p, f in files.items()} == before


def train_reply_state(tmp: Path, run_config: dict[str, Any], node_config: dict[str, Any]) -> dict[str, Any]:
    """The ``state`` a Ditto node uploads in round 0, with these run and node configs."""
    cfg_path = write_config(tmp, ALGORITHMS["ditto"])
    grid = InProcessGrid(cfg_path, tmp / "states")
    grid.run_config.update(run_config)
    grid.node_extra.update(node_config)
    server = new_server(cfg_path, tmp, grid)
    server.discover()
    server.setup()
    replies = server.exchange("train", 0, [0])
    return record_to_tree(replies[0].content.array_records["state"])


def test_upload_client_state_is_the_node_owners_choice(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A run config cannot make a node upload the personal state its owner keeps (node config
    upload-client-state = false), and is ignored with a warning naming the node config."""
    client_module._warned.clear()
    kept = train_reply_state(tmp_path, {"upload-client-state": True}, {"upload-client-state": False})
    assert all(float(v.abs().sum()) == 0 for v in flatten_state(kept).values())
    (tmp_path / "b").mkdir()
    uploaded = train_reply_state(tmp_path / "b", {"upload-client-state": False}, {})
    assert any(float(v.abs().sum()) > 0 for v in flatten_state(uploaded).values())  # the node's default: upload
    assert "run config upload-client-state = True is ignored" in caplog.text


def test_run_config_cannot_choose_the_nodes_data_hook(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A run config's client-data (code the node would import and run) is ignored: the node trains on its
    configured partition; the node config's hook is used."""
    client_module._warned.clear()
    hook = "tests.frontends.test_flower:client_tensors"
    cfg = write_config(tmp_path, ALGORITHMS["fedavg"])
    node = {"partition-id": 2, "num-partitions": NUM_CLIENTS}
    from_run = client_module.client_for(node, {"fedmeta-config": str(cfg), "client-data": hook})
    assert int(from_run.data.train_offsets[1]) != 7  # not the hook's 7 rows: the config's partition 2
    assert "run config client-data" in caplog.text and "node config" in caplog.text
    from_node = client_module.client_for({**node, "client-data": hook}, {"fedmeta-config": str(cfg)})
    assert int(from_node.data.train_offsets[1]) == 7


# ----------------------------------------------------------------------------------------------
# item 6: one bad SuperNode fails itself for the round, never the run
# ----------------------------------------------------------------------------------------------
class TamperingGrid(InProcessGrid):
    """The in-process grid, with the replies of some (message type, partition) rewritten by ``tamper`` after the
    honest ClientApp answered: what a node whose owner controls its replies sends."""

    def __init__(self, *args: Any, tamper: dict[tuple[str, int], Callable[[Any], None]] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tamper = dict(tamper or {})

    def push_messages(self, messages: Any) -> list[str]:
        messages = list(messages)
        ids = super().push_messages(messages)
        for msg, mid in zip(messages, ids, strict=True):
            fn = self.tamper.get((msg.metadata.message_type, self.node_of[msg.metadata.dst_node_id]))
            if fn is not None and not self.replies[mid].has_error():
                fn(self.replies[mid].content)
        return ids


def _edit_delta(content: Any, edit: Callable[[torch.Tensor], torch.Tensor]) -> None:
    flat = flatten_state(record_to_tree(content.array_records["delta"]))
    first = sorted(flat)[0]
    flat[first] = edit(flat[first])
    content["delta"] = tree_to_record(unflatten_state(flat))


def _edit_metrics(**values: float) -> Callable[[Any], None]:
    def edit(content: Any) -> None:
        content["metrics"] = MetricRecord({**dict(content.metric_records["metrics"]), **values})
    return edit


ATTACKS: dict[str, Callable[[Any], None]] = {
    "nan_delta": lambda c: _edit_delta(c, lambda t: torch.full_like(t, math.nan)),
    "wrong_shape": lambda c: _edit_delta(c, lambda t: torch.zeros(3)),
    "wrong_dtype": lambda c: _edit_delta(c, lambda t: t.double()),
    "huge_num_examples": _edit_metrics(**{"num-examples": 10**12}),
    "missing_record": lambda c: c.array_records.pop("extras"),
}

BAD = 0  # partition 0 is sampled in every round of the test config


def run_with(cfg_path: Path, tmp: Path, grid: InProcessGrid, **kwargs: Any) -> DeploymentServer:
    server = DeploymentServer(load_config(cfg_path), grid, run_key="t", checkpoint=str(tmp / "ckpt.pt"),
                              node_timeout=1.0, **kwargs)
    server.run()
    return server


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_bad_train_reply_fails_that_client_not_the_run(attack: str, tmp_path: Path) -> None:
    """NaN, a wrong shape or dtype, a missing record or a claimed num-examples of 1e12: the run completes; each
    round aggregates the other clients exactly as if the bad one had failed (an error reply: the engine's
    dropout re-weighting); the rejection is logged with node and reason and counted as rejected_replies."""
    cfg_path = write_config(tmp_path, ALGORITHMS["scaffold"])
    (tmp_path / "bad").mkdir()
    bad = run_with(cfg_path, tmp_path / "bad",
                   TamperingGrid(cfg_path, tmp_path / "bad" / "states", tamper={("train", BAD): ATTACKS[attack]}))
    (tmp_path / "failed").mkdir()
    fail = {("train", r, BAD) for r in range(ROUNDS)}
    failed = run_with(cfg_path, tmp_path / "failed", InProcessGrid(cfg_path, tmp_path / "failed" / "states", fail))
    assert [e["rejected_replies"] for e in bad.history] == [1] * ROUNDS
    assert [e["answered"] for e in bad.history] == [e["answered"] for e in failed.history]
    assert all(BAD not in e["answered"] for e in bad.history) and bad.round == ROUNDS
    assert all(f["partition"] == BAD and f["node"] == 1000 + BAD and "reply rejected" in f["reason"]
               for f in bad.failures) and len(bad.failures) == ROUNDS
    assert all(torch.equal(bad.params()[k], failed.params()[k]) for k in bad.params())
    assert torch.isfinite(torch.cat([p.flatten() for p in bad.params().values()])).all()


@pytest.mark.parametrize("claim", [{"total": 0.0, "num-examples": 0}, {"acc_sum": 1e9}, {"loss_sum": math.inf}])
def test_bad_evaluation_reply_fails_that_client_not_the_run(claim: dict[str, float], tmp_path: Path) -> None:
    """total = 0 (was a ZeroDivisionError), an accuracy sum above the test size or an infinite loss: the
    evaluation summarises the other clients, as if the bad one's evaluation had failed."""
    cfg_path = write_config(tmp_path, ALGORITHMS["fedavg"])
    (tmp_path / "bad").mkdir()
    bad = run_with(cfg_path, tmp_path / "bad", TamperingGrid(cfg_path, tmp_path / "bad" / "states",
                                                             tamper={("evaluate", BAD): _edit_metrics(**claim)}))
    (tmp_path / "failed").mkdir()
    failed = run_with(cfg_path, tmp_path / "failed",
                      InProcessGrid(cfg_path, tmp_path / "failed" / "states", {("evaluate", ROUNDS, BAD)}))
    got, want = bad.history[-1]["evaluate"], failed.history[-1]["evaluate"]
    assert got.pop("rejected_replies") == 1.0 and want.pop("rejected_replies") == 0.0
    assert got == want and got["clients"] == NUM_CLIENTS - 1


def test_second_node_claiming_a_held_partition_is_refused_at_once(tmp_path: Path) -> None:
    """An extra node claiming partition 0, which a live node holds, gets nothing (no train message, no weight)
    and the run completes; if the holder goes away, the claim is asked again (a restarted node)."""
    cfg_path = write_config(tmp_path, ALGORITHMS["fedavg"])
    grid = InProcessGrid(cfg_path, tmp_path / "states")
    grid.node_of[2000] = 0  # a second SuperNode with node config partition-id = 0
    server = run_with(cfg_path, tmp_path, grid)
    assert server.round == ROUNDS and server.waiting == {2000: 0}
    train_to = [m for m in grid.sent if m[0] == "train"]
    assert train_to and server.node_of[0] == 1000
    del grid.node_of[1000]  # the holder stops: the waiting node is the partition's node now
    server.refresh_nodes(timeout=0.0)
    assert server.node_of[0] == 2000 and server.waiting == {}


def test_hijacking_node_gets_no_message(tmp_path: Path) -> None:
    cfg_path = write_config(tmp_path, ALGORITHMS["fedavg"])
    grid = InProcessGrid(cfg_path, tmp_path / "states")
    grid.node_of[2000] = 0
    sent_to: list[int] = []
    push = grid.push_messages

    def recording(messages: Any) -> list[str]:
        messages = list(messages)
        sent_to.extend(m.metadata.dst_node_id for m in messages if m.metadata.message_type == "train")
        return push(messages)

    grid.push_messages = recording  # type: ignore[method-assign]
    run_with(cfg_path, tmp_path, grid)
    assert sent_to and 2000 not in sent_to


def test_claimed_size_must_match_the_pinned_partition_sizes(tmp_path: Path) -> None:
    """With run config partition-sizes, a node claiming num-train = 1e12 (all the aggregation weight, and a
    padding width every client would allocate) is refused; without it, its first answer fixes its size and a
    later answer (a restarted node) claiming another is refused."""
    cfg_path = write_config(tmp_path, ALGORITHMS["fedavg"])
    honest = new_server(cfg_path, tmp_path)
    honest.discover()
    sizes = list(honest.sizes)

    def inflate(content: Any) -> None:
        data = dict(content.config_records["data"])
        content["data"] = ConfigRecord({**data, "num-train": 10**12})

    grid = TamperingGrid(cfg_path, tmp_path / "states", tamper={("query", BAD): inflate})
    pinned = new_server(cfg_path, tmp_path, grid, partition_sizes=sizes)
    with pytest.raises(TimeoutError, match=r"only partitions \[1, 2, 3, 4\] of 5"):
        pinned.discover()
    assert BAD not in pinned.node_of
    # trust on first use: the restarted node 3000 for partition 0 claims another size and is refused
    grid.tamper.clear()
    first_use = new_server(cfg_path, tmp_path, grid)
    first_use.discover()
    assert first_use.sizes == sizes
    grid.tamper[("query", BAD)] = inflate
    del grid.node_of[1000]
    grid.node_of[3000] = BAD
    first_use.refresh_nodes(timeout=0.0)
    assert BAD not in first_use.node_of


def test_parse_partition_sizes() -> None:
    from lightning_fedmeta.flower.server_app import parse_sizes

    assert parse_sizes("") is None and parse_sizes("3, 4,5") == [3, 4, 5]
    with pytest.raises(ValueError, match="partition-sizes = 'a,b' must be comma-separated sample counts"):
        parse_sizes("a,b")
