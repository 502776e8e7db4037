"""The second security review (issue 41), items 1, 2, 4, 5, 8 and 9: discovery, the secret cohort, the compressed
and evaluation reply checks, ε on Flower, logged cohort sizes and what the population view reveals.

Each test drives the in-process pieces as tests/security/test_flower_trust.py does (the ServerApp's round loop
against the in-process grid, with crafted replies, checkpoints and configs). docs/security.md, "Flower
deployments" and "Differential privacy".
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr", reason="flwr is not installed (pip install lightning-fedmeta[flower])")

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict  # noqa: E402

from lightning_fedmeta.communication.compressors import parse_compression  # noqa: E402
from lightning_fedmeta.flower import load_config  # noqa: E402
from lightning_fedmeta.flower.compressed import encode_upload  # noqa: E402
from lightning_fedmeta.flower.records import tree_to_record  # noqa: E402
from lightning_fedmeta.flower.replies import RejectedReply, ReplySpec, check_eval_reply, check_train_reply  # noqa: E402
from lightning_fedmeta.flower.server import DeploymentServer  # noqa: E402
from tests.frontends.test_flower import (  # noqa: E402
    ALGORITHMS,
    NUM_CLIENTS,
    ROUNDS,
    InProcessGrid,
    task_identity,  # noqa: F401  (autouse: messages outside a Flower process need a task identity)
    write_config,
)
from tests.security.test_flower_trust import BAD, TamperingGrid, new_server  # noqa: E402


def _edit_data(**values: Any) -> Any:
    def edit(content: Any) -> None:
        content["data"] = ConfigRecord({**dict(content.config_records["data"]), **values})
    return edit


class NodeTamperingGrid(InProcessGrid):
    """The in-process grid with the query replies of some node ids rewritten (a node that lies about its data)."""

    def __init__(self, *args: Any, tamper: dict[int, Any], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tamper = tamper

    def push_messages(self, messages: Any) -> list[str]:
        messages = list(messages)
        ids = super().push_messages(messages)
        for msg, mid in zip(messages, ids, strict=True):
            fn = self.tamper.get(msg.metadata.dst_node_id)
            if fn is not None and msg.metadata.message_type == "query" and not self.replies[mid].has_error():
                fn(self.replies[mid].content)
        return ids


# ----------------------------------------------------------------------------------------------
# item 1: discovery trusts the first node no more than the others
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("claim", [{"num-partitions": 10**6}, {"num-partitions": 10**9},
                                   {"input-shape": [61]}, {"num-partitions": 2}])
def test_a_first_node_with_another_federation_fails_itself_not_the_run(claim: dict[str, Any],
                                                                        tmp_path: Path) -> None:
    """An extra node (id 5: it answers the query before every honest node) claims partition 0 of a federation of
    10⁹ partitions (the old server built set(range(10⁹)): 24 GB), or another input shape, or 2 partitions: the
    run trains on the five honest nodes; the liar is refused, logged, and holds nothing."""
    cfg_path = write_config(tmp_path, ALGORITHMS["fedavg"])
    grid = NodeTamperingGrid(cfg_path, tmp_path / "states", tamper={5: _edit_data(**claim)})
    grid.node_of = {5: 0, **grid.node_of}
    lines: list[str] = []
    server = new_server(cfg_path, tmp_path, grid, log=lines.append, evaluate=False)
    server.run()
    assert server.round == ROUNDS and server.num_clients == NUM_CLIENTS
    assert server.node_of == {p: 1000 + p for p in range(NUM_CLIENTS)}
    assert any("node 5 refused" in line for line in lines)


def test_with_pinned_sizes_a_node_with_another_shape_refuses_only_itself(tmp_path: Path) -> None:
    """partition-sizes pinned, and partition 0's own node (the first to answer) claims another input shape: the
    four honest nodes are accepted (the old server fixed the first answer's shape and refused all of them), the
    liar is refused, and once partition 0's node answers honestly (a restart) the run starts."""
    cfg_path = write_config(tmp_path, ALGORITHMS["fedavg"])
    honest = new_server(cfg_path, tmp_path)
    honest.discover()
    sizes = list(honest.sizes)
    grid = TamperingGrid(cfg_path, tmp_path / "states", tamper={("query", BAD): _edit_data(**{"input-shape": [61]})})
    lines: list[str] = []
    pinned = new_server(cfg_path, tmp_path, grid, partition_sizes=sizes, log=lines.append)
    with pytest.raises(TimeoutError, match=r"only partitions \[1, 2, 3, 4\] of 5"):
        pinned.discover()
    assert BAD not in pinned.node_of and any("node 1000 refused" in line for line in lines)
    grid.tamper.clear()
    del grid.node_of[1000]
    grid.node_of[3000] = BAD  # the node restarted, honest now
    pinned.discover()
    assert pinned.node_of[BAD] == 3000 and pinned.sizes == sizes


# ----------------------------------------------------------------------------------------------
# item 2: under secure_mode the cohort is written nowhere the server publishes
# ----------------------------------------------------------------------------------------------
def dp(options: str = "") -> str:
    """The config lines of model.dp (clip 0.5, z 0.8, and ``options``) with uniform aggregation."""
    more = ", " + options if options else ""
    return "  aggregation: uniform\n          dp: {clip: 0.5, noise_multiplier: 0.8" + more + "}"


DP = dp()


def _dp_run(tmp: Path, extra: str = DP, rounds: int = ROUNDS, **kwargs: Any) -> tuple[DeploymentServer, list[str]]:
    cfg_path = write_config(tmp, ALGORITHMS["fedavg"], extra=extra)
    cfg_path.write_text(cfg_path.read_text().replace(f"max_steps: {ROUNDS}", f"max_steps: {rounds}"))
    lines: list[str] = []
    grid = kwargs.pop("grid", None) or InProcessGrid(cfg_path, tmp / "states", kwargs.pop("fail", set()))
    server = DeploymentServer(load_config(cfg_path), grid, run_key="t", checkpoint=str(tmp / "ckpt.pt"),
                              output_dir=str(tmp / "out"), node_timeout=1.0, log=lines.append, **kwargs)
    server.run()
    return server, lines


def test_secure_mode_writes_no_cohort_to_history_checkpoint_or_log(tmp_path: Path) -> None:
    """A deployment under model.dp (secure_mode, the default): history.json, the checkpoint and the log name no
    round's cohort, no per-client round count and no failed sampled client (every client fails round 1); a
    resumed ServerApp still continues (its private resume file holds them)."""
    fail = {("train", 1, p) for p in range(NUM_CLIENTS)}
    server, lines = _dp_run(tmp_path, fail=fail)
    assert {f["partition"] for f in server.failures if f["kind"] == "train"} == set(server.sampled(1).tolist())
    published = (tmp_path / "out" / "history.json").read_text()
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    for text in (published, json.dumps(saved["history"]), json.dumps(saved["failures"]), "\n".join(lines)):
        for word in ("sampled", "answered", "of partition", '"partition"'):
            assert word not in text
    assert not {"seen", "state_round"} & set(saved)
    assert not any("rejected_replies" in e for e in json.loads(published)["history"])  # the evaluation's stay
    assert all(e["dp"]["secure_mode"] for e in server.history)
    # the private resume file is the one that holds participation, next to the checkpoint, readable by the owner
    private = Path(str(tmp_path / "ckpt.pt") + ".private")
    assert private.is_file() and (private.stat().st_mode & 0o077) == 0
    resumed, _ = _dp_run(tmp_path, rounds=ROUNDS + 1)
    assert resumed.round == ROUNDS + 1
    assert torch.equal(resumed.seen, server.seen | resumed.seen) and bool(resumed.seen.any())


def test_without_secure_mode_the_history_keeps_the_cohorts(tmp_path: Path) -> None:
    server, _ = _dp_run(tmp_path, extra=dp("secure_mode: false"))
    assert [e["sampled"] for e in server.history] == [server.sampled(r).tolist() for r in range(ROUNDS)]


def test_a_secure_checkpoint_without_its_private_file_is_refused_in_one_line(tmp_path: Path) -> None:
    _dp_run(tmp_path)
    Path(str(tmp_path / "ckpt.pt") + ".private").unlink()
    with pytest.raises(ValueError, match=r"ckpt\.pt\.private"):
        _dp_run(tmp_path, rounds=ROUNDS + 1)


# ----------------------------------------------------------------------------------------------
# item 4: every field of a compressed or evaluation reply is one an honest node can send
# ----------------------------------------------------------------------------------------------
D = 400


def _reply(delta: ArrayRecord) -> RecordDict:
    return RecordDict({"delta": delta, "state": tree_to_record({}), "extras": tree_to_record({}),
                       "metrics": MetricRecord({"num-examples": 10})})


def _check(compression: Any, arrays: dict[str, torch.Tensor]) -> Any:
    spec = ReplySpec({"w": ((D,), torch.float32)}, {}, {}, frozenset())
    return check_train_reply(_reply(ArrayRecord(torch_state_dict=arrays)), spec, 10,
                             parse_compression(compression).upload)


def _honest(compression: Any) -> dict[str, torch.Tensor]:
    row = torch.linspace(-1, 1, D)
    noise = torch.rand(D, generator=torch.Generator().manual_seed(0))
    return dict(encode_upload(parse_compression(compression).upload, row, noise).to_torch_state_dict())


def _set_code(packed: torch.Tensor, bits: int, index: int, code: int) -> torch.Tensor:
    per = 8 // bits
    out = packed.clone().to(torch.int32)
    byte, shift = index // per, (index % per) * bits
    out[byte] = (out[byte] & ~(((1 << bits) - 1) << shift)) | (code << shift)
    return out.to(torch.uint8)


QSGD = {8: {"upload": "qsgd", "bits": 8, "bucket_size": 16}, 4: {"upload": "qsgd", "bits": 4, "bucket_size": 16},
        2: {"upload": "qsgd", "bits": 2, "bucket_size": 16}}


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_qsgd_codes_above_the_top_level_are_refused(bits: int) -> None:
    """8-bit code 255 decoded to level −128 (wrapping), 4- and 2-bit top codes to 8/7 and 2 times the norm."""
    arrays = _honest(QSGD[bits])
    _check(QSGD[bits], arrays)  # the honest reply passes
    top = (1 << bits) - 1
    with pytest.raises(RejectedReply, match="code"):
        _check(QSGD[bits], {**arrays, "codes": _set_code(arrays["codes"], bits, 3, top)})


@pytest.mark.parametrize("norm", [-1.0, 3e38])
def test_qsgd_norms_no_honest_node_sends_are_refused(norm: float) -> None:
    """A negative norm; a norm of 3e38 whose bucket has levels 0 and one 1 (each value 3e38/127 is finite, the
    old check passed it; an honest bucket of norm > 0 has levels of norm at least s − √b)."""
    arrays = _honest(QSGD[8])
    norms = arrays["norms"].clone()
    norms[0] = norm
    codes = arrays["codes"].clone()
    codes[:16] = 127  # level 0 (codes are level + s)
    codes[0] = 128
    with pytest.raises(RejectedReply):
        _check(QSGD[8], {**arrays, "norms": norms, "codes": codes})


def test_qsgd_levels_in_a_bucket_of_norm_zero_are_refused() -> None:
    arrays = _honest(QSGD[8])
    norms = arrays["norms"].clone()
    norms[0] = 0.0
    with pytest.raises(RejectedReply, match="norm 0"):
        _check(QSGD[8], {**arrays, "norms": norms})


@pytest.mark.parametrize("fraction", [0.25, 0.01])
def test_sparse_uploads_with_repeated_or_negative_indices_are_refused(fraction: float) -> None:
    compression = {"upload": "topk", "fraction": fraction}
    arrays = _honest(compression)
    _check(compression, arrays)
    if "indices" not in arrays:  # the bitmap form: one bit per coordinate, so no repeat is possible
        bitmap = arrays["bitmap"].clone()
        bitmap[25] = 0xFF  # more kept coordinates than values (d/2: the smallest, not kept)
        with pytest.raises(RejectedReply):
            _check(compression, {**arrays, "bitmap": bitmap})
        return
    index = arrays["indices"].clone()
    repeated = index.clone()
    repeated[1] = repeated[0]
    with pytest.raises(RejectedReply, match="indices"):
        _check(compression, {**arrays, "indices": repeated})
    negative = index.clone()
    negative[0] = -1
    with pytest.raises(RejectedReply):
        _check(compression, {**arrays, "indices": negative})


def test_a_delta_whose_norm_overflows_is_refused() -> None:
    """Finite coordinates of 3e38 (float16 uploads of 6e4 are finite too) whose squared sum is not: no honest
    node's update, and two of them would overflow the round's sum."""
    with pytest.raises(RejectedReply, match="norm"):
        _check({"upload": "topk", "fraction": 0.01},
               {"values": torch.full((4,), 3e38), "indices": torch.arange(4, dtype=torch.int32)})


@pytest.mark.parametrize("loss_sum", [-1.7e308, 1.7e308])
def test_evaluation_sums_beyond_what_float32_losses_can_add_up_to_are_refused(loss_sum: float) -> None:
    """Two nodes each claiming loss_sum = −1.7e308 made the round's loss −inf; an honest sum of n float32
    losses is at most n · 3.4e38 in size."""
    content = RecordDict({"metrics": MetricRecord({"total": 10, "num-examples": 10, "loss_sum": loss_sum,
                                                   "acc_sum": 5.0})})
    with pytest.raises(RejectedReply, match="loss_sum"):
        check_eval_reply(content, {"acc": "accuracy"}, 10)
    ok = RecordDict({"metrics": MetricRecord({"total": 10, "num-examples": 10, "loss_sum": 3.5, "acc_sum": 5.0})})
    assert check_eval_reply(ok, {"acc": "accuracy"}, 10)["loss_sum"] == 3.5


def test_train_metrics_beyond_float32_are_refused() -> None:
    spec = ReplySpec({"w": ((D,), torch.float32)}, {}, {}, frozenset({"loss"}))
    content = RecordDict({"delta": tree_to_record({"w": torch.zeros(D)}), "state": tree_to_record({}),
                          "extras": tree_to_record({}), "metrics": MetricRecord({"num-examples": 10, "loss": 1e300})})
    with pytest.raises(RejectedReply, match="loss"):
        check_train_reply(content, spec, 10)


# ----------------------------------------------------------------------------------------------
# item 5: ε on Flower is the module's
# ----------------------------------------------------------------------------------------------
def _epsilon(phases: list[tuple[float, float, int]]) -> float:
    from lightning_fedmeta.privacy.mechanism import PrivacyAccountant

    accountant = PrivacyAccountant(phases[0][0], phases[0][1])
    accountant.history = list(phases)
    return accountant.epsilon(1e-5)


def test_a_restart_with_another_noise_multiplier_continues_epsilon(tmp_path: Path) -> None:
    pytest.importorskip("opacus.accountants")
    first, _ = _dp_run(tmp_path, extra=DP, rounds=2)
    before = first.history[-1]["dp"]["epsilon"]
    resumed, _ = _dp_run(tmp_path, extra=DP.replace("0.8", "4.0"), rounds=3)
    after = resumed.history[-1]["dp"]["epsilon"]
    q = 3 / NUM_CLIENTS
    assert after > before
    assert after == pytest.approx(_epsilon([(0.8, q, 2), (4.0, q, 1)]), rel=1e-9)
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert saved["privacy"] == {"history": [[0.8, q, 2], [4.0, q, 1]], "released": 3}


def test_a_dp_resume_after_rounds_without_dp_runs_and_says_what_epsilon_counts(tmp_path: Path) -> None:
    pytest.importorskip("opacus.accountants")
    _dp_run(tmp_path, extra="", rounds=2)
    resumed, lines = _dp_run(tmp_path, rounds=3)  # was: ValueError (dp_clip = inf restored)
    assert resumed.round == 3 and resumed.history[-1]["dp"]["epsilon"] == pytest.approx(
        _epsilon([(0.8, 3 / NUM_CLIENTS, 1)]), rel=1e-9)
    assert any("trained without model.dp" in line for line in lines)


def test_target_epsilon_stops_the_deployment_before_the_round_that_exceeds_it(tmp_path: Path) -> None:
    pytest.importorskip("opacus.accountants")
    server, lines = _dp_run(tmp_path, extra=dp("target_epsilon: 1.0"))
    assert server.round == 0 and server.history == []
    assert any("stopping before round 0" in line and "target_epsilon" in line for line in lines)
    assert json.loads((tmp_path / "out" / "history.json").read_text())["stopped"]


# ----------------------------------------------------------------------------------------------
# item 8: Poisson cohort sizes are not published through byte counts
# ----------------------------------------------------------------------------------------------
POISSON = dp("sampling: poisson")


def test_flower_logs_no_byte_counts_that_reveal_a_poisson_cohort(tmp_path: Path) -> None:
    server, _ = _dp_run(tmp_path, extra=POISSON)
    published = (tmp_path / "out" / "history.json").read_text()
    assert "comm/" not in published
    assert "traffic" not in torch.load(tmp_path / "ckpt.pt", weights_only=True)
    (tmp_path / "fixed").mkdir()
    fixed, _ = _dp_run(tmp_path / "fixed")
    assert all("comm/up_bytes" in e["comm"] for e in fixed.history)  # a fixed cohort's size is public (m)


def test_the_simulation_logs_no_byte_counts_that_reveal_a_poisson_cohort() -> None:
    from lightning.pytorch.loggers import Logger

    from tests.helpers import fit, tiny_datamodule, tiny_module

    class Recording(Logger):
        name, version = "rec", 0
        metrics: list[str] = []

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.metrics.extend(metrics)

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

    def logged(sampling: str) -> list[str]:
        module = tiny_module({"name": "fedavg", "local_lr": 0.3, "local_steps": 1, "batch_size": 4},
                             clients_per_round=3, seed=7, aggregation="uniform", compile_clients=False,
                             dp={"clip": 0.5, "noise_multiplier": 1.0, "secure_mode": True, "sampling": sampling})
        recording = Recording()
        recording.metrics = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit(module, tiny_datamodule(eval_every=100), 2, logger=recording, log_every_n_steps=1)
        return recording.metrics

    poisson = logged("poisson")
    assert not [k for k in poisson if k.startswith("comm/") or k == "clients"] and "privacy/epsilon" in poisson
    fixed = logged("fixed")
    assert "comm/up_bytes" in fixed and "clients" in fixed


# ----------------------------------------------------------------------------------------------
# item 9: what the population view gives away, exactly
# ----------------------------------------------------------------------------------------------
def test_a_node_learns_the_federation_total_and_no_other_size(tmp_path: Path) -> None:
    """What docs/security.md states: a node's own weight p_c = n_c / Σ n_j gives it Σ n_j (under aggregation
    'samples'), and largest-train-size the largest n_j; the train message carries nothing else of another
    client (so with K <= 3 every size follows, as the docs say)."""
    cfg_path = write_config(tmp_path, ALGORITHMS["fedavg"])
    server = new_server(cfg_path, tmp_path)
    server.discover()
    server.setup()
    content = server._content(0, 1, "train")
    config = dict(content.config_records["config"])
    record = content.array_records["record"].to_torch_state_dict()
    assert set(config) == {"round", "partition-id", "run-key", "run-token", "state-round", "num-clients",
                           "largest-train-size"}
    total = float(record["num_samples"]) / float(record["weight"])
    assert total == pytest.approx(float(server.counts.sum()), rel=1e-5)
    assert config["largest-train-size"] == int(server.counts.max())
    text = Path("docs/security.md").read_text()
    assert "n_c / Σ_j n_j" in text and "K ≤ 3" in text
