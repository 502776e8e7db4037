"""A Flower deployment that one bad node, a stale checkpoint or a run config cannot subvert (issue 25).

Each test drives the in-process pieces (the ServerApp's round loop against the in-process grid of
tests/frontends/test_flower.py, the ClientApp's handlers, the config reader) with crafted replies, files and
configs, as an attacker who controls one SuperNode, the server's checkpoint file or the run config would.
docs/security.md, "Flower deployments".
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="flwr is not installed (pip install lightning-fedmeta[flower])")

from lightning_fedmeta.flower import load_config  # noqa: E402
from tests.frontends.test_flower import ALGORITHMS, write_config  # noqa: E402


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
