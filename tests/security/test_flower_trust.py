"""A Flower deployment that one bad node, a stale checkpoint or a run config cannot subvert (issue 25).

Each test drives the in-process pieces (the ServerApp's round loop against the in-process grid of
tests/frontends/test_flower.py, the ClientApp's handlers, the config reader) with crafted replies, files and
configs, as an attacker who controls one SuperNode, the server's checkpoint file or the run config would.
docs/security.md, "Flower deployments".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr", reason="flwr is not installed (pip install lightning-fedmeta[flower])")

from lightning_fedmeta.flower import ClientStateFile, load_config  # noqa: E402
from lightning_fedmeta.flower import client as client_module  # noqa: E402
from lightning_fedmeta.flower.records import record_to_tree  # noqa: E402
from lightning_fedmeta.flower.server import DeploymentServer  # noqa: E402
from lightning_fedmeta.state import flatten_state  # noqa: E402
from tests.frontends.test_flower import (  # noqa: E402
    ALGORITHMS,
    NUM_CLIENTS,
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
