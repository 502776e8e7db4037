"""A Flower deployment and the simulation run one engine (issue 39, item 1): over a few rounds of unequal clients
the deployed global model (parameters and BatchNorm statistics) equals the in-process ``FederatedModule`` run of
the same config to rounding, also where the two used to differ:

(a) a client whose output is not finite: the deployment rejects its reply, the simulation under the same policy
    (``RoundEngine.nonfinite = "drop"``) leaves it out, and both aggregate the others with renormalised weights;
(b) a model with BatchNorm running statistics: the nodes upload theirs and keep their own, the server forms the
    model's as the engine does (the weighted mean), and the personalised evaluation uses each client's own;
(c) ``model.dp`` (secure_mode off, so the noise is drawn from the seed in both) with BatchNorm: the statistics go
    through the DP pipeline (clipped, noised) on both sides.

The deployment runs in this process (the ClientApp's handlers called by the in-process grid of
``tests/frontends/test_flower.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr", reason="flwr is not installed (pip install lightning-fedmeta[flower])")

from lightning_fedmeta.client.sampling import sample_clients  # noqa: E402
from lightning_fedmeta.flower import ClientStateFile, load_config  # noqa: E402
from lightning_fedmeta.flower.client import STATISTICS, _federation, data_spec_of  # noqa: E402
from lightning_fedmeta.flower.server import DeploymentServer  # noqa: E402
from tests.frontends.test_flower import (  # noqa: E402
    ALGORITHMS,
    NUM_CLIENTS,
    PER_ROUND,
    ROUNDS,
    InProcessGrid,
    max_diff,
    task_identity,  # noqa: F401 - the autouse fixture that lets Messages be built outside a Flower process
    write_config,
)
from tests.helpers import make_trainer  # noqa: E402

BATCHNORM_MLP = ("          model:\n            class_path: lightning_fedmeta.models.reference.MLP\n"
                 "            init_args: {in_features: 60, hidden: [6], num_classes: 10, norm: batch}")
DP = "  aggregation: uniform\n          dp: {clip: 0.05, noise_multiplier: 0.2, secure_mode: false}"


def batchnorm_config(tmp: Path, extra: str = "") -> Path:
    """The test config with a BatchNorm MLP in place of the plain one."""
    path = write_config(tmp, ALGORITHMS["fedavg"], extra=extra)
    text = path.read_text()
    plain = "init_args: {in_features: 60, hidden: [6], num_classes: 10}"
    assert plain in text
    path.write_text(text.replace(plain, "init_args: {in_features: 60, hidden: [6], num_classes: 10, norm: batch}"))
    return path


def simulated(cfg_path: Path, nonfinite: str = "raise") -> Any:
    """The in-process run on the federation the deployment's nodes load (the same FederatedData object)."""
    cfg = load_config(cfg_path)
    dm = cfg.datamodule()
    dm.federated_data = _federation(cfg.path)
    module = cfg.reference_module(cfg.build_model(data_spec_of(dm.federated_data)))
    module.engine.use_nonfinite(nonfinite)
    make_trainer(ROUNDS, limit_val_batches=0).fit(module, datamodule=dm)
    return module


def deployed(cfg_path: Path, tmp: Path) -> DeploymentServer:
    server = DeploymentServer(load_config(cfg_path), InProcessGrid(cfg_path, tmp / "states"), run_key="t",
                              node_timeout=1.0)
    server.run()
    return server


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and floating-point buffers (the BatchNorm running statistics)."""
    state = {n: p.detach() for n, p in model.named_parameters()}
    state.update({n: b.detach() for n, b in model.named_buffers() if b.is_floating_point()})
    return state


def check_same_model(reference: Any, server: DeploymentServer) -> float:
    ref = model_state(reference.model)
    moved = max_diff({n: p.detach() for n, p in reference.model.named_parameters()}, server.init_params)
    assert moved > 1e-3, moved  # the rounds changed the model, so the equality is not trivial
    diff = max_diff(ref, model_state(server.model))
    assert diff < 1e-5, diff
    assert torch.equal(server.seen, reference.seen)
    assert len(set(server.counts.tolist())) > 1  # unequal clients: the weights matter
    return diff


def test_a_non_finite_client_is_left_out_on_both_sides(tmp_path: Path) -> None:
    cfg_path = write_config(tmp_path, ALGORITHMS["fedavg"])
    bad = int(sample_clients(11, 0, torch.arange(NUM_CLIENTS), PER_ROUND)[0])  # sampled in round 0
    data = _federation(load_config(cfg_path).path)
    start, end = int(data.train_offsets[bad]), int(data.train_offsets[bad + 1])
    data.train_x[start:end] = 3e38  # finite inputs whose forward pass overflows: a non-finite loss and update
    with pytest.raises(FloatingPointError, match=f"index {bad}"):  # the simulation's default: stop, naming it
        simulated(cfg_path)
    reference = simulated(cfg_path, nonfinite="drop")
    server = deployed(cfg_path, tmp_path)
    assert server.engine is not None and server.engine.nonfinite == "drop"
    rounds_with_bad = [e for e in server.history if bad in e["sampled"]]
    assert rounds_with_bad and all(bad not in e["answered"] and e["rejected_replies"] == 1 for e in rounds_with_bad)
    assert not bool(reference.seen[bad]) and not bool(server.seen[bad])
    check_same_model(reference, server)


def test_batchnorm_statistics_deploy(tmp_path: Path) -> None:
    cfg_path = batchnorm_config(tmp_path)
    reference = simulated(cfg_path)
    server = deployed(cfg_path, tmp_path)
    assert server.engine is not None and server.engine.running.names  # the model has running statistics
    means = [v for n, v in server.statistics().items() if n.endswith("running_mean")]
    assert means and max(float(v.abs().max()) for v in means) > 1e-3  # the published statistics moved from 0
    check_same_model(reference, server)
    # every node kept its own statistics: the engine's row of that client
    for pid in server.seen.nonzero().flatten().tolist():
        kept = ClientStateFile(tmp_path / "states", "t", pid).load(int(server.state_round[pid]))[STATISTICS]
        ref_row = {k: v[pid] for k, v in reference.engine.running.store.state_dict().items()}
        assert max_diff(kept, ref_row) < 1e-5
    # the personalised evaluation after the last round (each client with its own statistics): the module's sums
    reference.eval()  # as Lightning's validation runs it (BatchNorm reads its running statistics)
    scores = reference.evaluate_clients(torch.arange(NUM_CLIENTS), ROUNDS)
    total = float(scores["total"].sum())
    assert server.history[-1]["evaluate"]["loss_weighted"] == pytest.approx(
        float(scores["loss_sum"].sum()) / total, abs=1e-5)


def test_dp_with_batchnorm_statistics_deploys(tmp_path: Path) -> None:
    cfg_path = batchnorm_config(tmp_path, extra=DP)
    reference = simulated(cfg_path)
    server = deployed(cfg_path, tmp_path)
    assert server.pipeline.statistics == "pipeline"  # the statistics are clipped and noised with the updates
    assert all("dp" in entry for entry in server.history)
    check_same_model(reference, server)
