"""The Flower ServerApp reports the spread of the per-client values (fairness: std and quantiles over clients) as
the Lightning module's evaluator does, from the same function (``fairness.summaries_with_spread``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr", reason="flwr is not installed (pip install lightning-fedmeta[flower])")

from lightning_fedmeta.evaluation.fairness import QUANTILES, spread  # noqa: E402
from tests.frontends.test_flower import (  # noqa: E402, F401  (task_identity: the module's autouse fixture)
    ALGORITHMS,
    NUM_CLIENTS,
    ROUNDS,
    deployed,
    in_process,
    task_identity,
    write_config,
)


def test_the_deployment_reports_the_per_client_spread(tmp_path: Path) -> None:
    """After the last round the ServerApp's evaluation holds ``acc_std`` and ``acc_q10`` ... ``acc_q90`` over the
    training clients, equal to the spread of the in-process module's per-client accuracies."""
    cfg_path = write_config(tmp_path, ALGORITHMS["ditto"])
    reference = in_process(cfg_path)
    server, _ = deployed(cfg_path, tmp_path, node_config={"upload-client-state": False})
    scores = reference.evaluate_clients(torch.arange(NUM_CLIENTS), ROUNDS)
    col = list(reference.metric.builtin).index("acc")
    per_client = scores["builtin"][:, col] / scores["total"]
    training = server.federation.summary_groups()["clients"]
    expected = spread(per_client[training])
    assert float(expected["std"]) > 0  # the clients differ, so the spread is not trivially zero
    evaluated = server.history[-1]["evaluate"]
    assert evaluated["acc_std"] == pytest.approx(float(expected["std"]), abs=1e-6)
    for name, _ in QUANTILES:
        assert evaluated[f"acc_{name}"] == pytest.approx(float(expected[name]), abs=1e-6)
