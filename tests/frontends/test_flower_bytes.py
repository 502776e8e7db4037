"""Bytes on Flower (issue 28, docs/communication.md "On Flower"): the ServerApp's history counts what the
simulation counts, those counts are the array payload of the Flower messages actually built, and under
``model.compression`` the ClientApp sends the compressed arrays (fewer bytes on the wire) that the server decodes
to the simulation's numbers. In process: the grid calls the ClientApp's handlers (tests/frontends/test_flower.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

flwr = pytest.importorskip("flwr", reason="flwr is not installed (pip install lightning-fedmeta[flower])")

from flwr.app import ArrayRecord, Message, RecordDict  # noqa: E402

from lightning_fedmeta.communication.compressors import QSGD, TopK, parse_compression  # noqa: E402
from lightning_fedmeta.flower.compressed import client_upload, payload_bytes_of, wire_bytes  # noqa: E402
from lightning_fedmeta.flower.replies import RejectedReply, ReplySpec, check_train_reply  # noqa: E402
from tests.frontends.test_flower import (  # noqa: E402
    ALGORITHMS,
    ROUNDS,
    InProcessGrid,
    deployed,
    in_process,
    max_diff,
    task_identity,  # noqa: F401 - the autouse fixture
    write_config,
)

D = 60 * 6 + 6 + 6 * 10 + 10  # the test config's MLP(60, [6], 10): d = 436 floats
#: measured: ArrayRecord's protobuf framing per array (the 128-byte .npy header, the key, dtype and shape fields)
FRAMING_PER_ARRAY = (128, 192)


class RecordingGrid(InProcessGrid):
    """The in-process grid, keeping every train message and its reply."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.train: list[tuple[Message, Message]] = []

    def push_messages(self, messages: Any) -> list[str]:
        messages = list(messages)
        ids = super().push_messages(messages)
        for msg, mid in zip(messages, ids, strict=True):
            if msg.metadata.message_type == "train":
                self.train.append((msg, self.replies[mid]))
        return ids


def _recorded(monkeypatch: pytest.MonkeyPatch, cfg: Path, tmp: Path, **kw: Any) -> tuple[Any, RecordingGrid]:
    import tests.frontends.test_flower as base

    monkeypatch.setattr(base, "InProcessGrid", RecordingGrid)
    return deployed(cfg, tmp, **kw)


def _arrays(record: ArrayRecord) -> int:
    return len(record.to_torch_state_dict())


@pytest.mark.parametrize("name", ["fedavg", "scaffold"])
def test_history_counts_the_payload_of_the_messages_built(name: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    server, grid = _recorded(monkeypatch, write_config(tmp_path, ALGORITHMS[name]), tmp_path)
    per_round: dict[int, list[tuple[Message, Message]]] = {}
    for msg, reply in grid.train:
        per_round.setdefault(int(msg.content.config_records["config"]["round"]), []).append((msg, reply))
    up_total = down_total = 0
    for entry in server.history:
        pairs, comm = per_round[entry["round"]], entry["comm"]
        # download(): w (and SCAFFOLD's c, the whole server state); upload(): Δ (and SCAFFOLD's Δc, the extras)
        down = sum(payload_bytes_of(m.content.array_records["params"])
                   + payload_bytes_of(m.content.array_records["server-state"]) for m, _ in pairs)
        up = sum(payload_bytes_of(r.content.array_records["delta"])
                 + payload_bytes_of(r.content.array_records["extras"]) for _, r in pairs)
        assert (comm["comm/down_bytes"], comm["comm/up_bytes"]) == (down, up)
        assert comm["comm/up_bytes"] == len(pairs) * 4 * D * (2 if name == "scaffold" else 1)
        up_total, down_total = up_total + up, down_total + down
        assert comm["comm/up_bytes_cumulative"] == up_total and comm["comm/down_bytes_cumulative"] == down_total
        assert comm["comm/wire_up_bytes"] == sum(wire_bytes(r.content) for _, r in pairs)
        assert comm["comm/wire_down_bytes"] == sum(wire_bytes(m.content) for m, _ in pairs)
    # the serialised counted records exceed their payload by the framing alone: 128..192 bytes per array
    for msg, reply in grid.train:
        for record in (msg.content.array_records["params"], reply.content.array_records["delta"]):
            framing = wire_bytes(RecordDict({"r": record})) - payload_bytes_of(record)
            low, high = FRAMING_PER_ARRAY
            assert low * _arrays(record) <= framing <= high * _arrays(record), framing
    print(f"\n{name}: framing of the params record {framing} bytes for {_arrays(record)} arrays; whole messages "
          f"(config, client record, population, init-params, client state) {server.history[0]['comm']}")


PARTIAL = {  # algorithm -> its config; both download and upload a part of the parameters
    "lg_fedavg": "{name: lg_fedavg, local_lr: 0.05, local_steps: 2, batch_size: 8}",
    "fedbabu": "{name: fedbabu, local_lr: 0.05, local_steps: 2, batch_size: 8}",
}


@pytest.mark.parametrize("name", sorted(PARTIAL))
def test_a_personal_part_never_travels_and_the_counted_bytes_are_the_messages(
        name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LG-FedAvg keeps its local layers on the client (as FedSA-LoRA keeps ``B`` and FedBN the normalisation layers):
    the train message's parameters and the reply's delta hold the global layers' entries only (the node completes
    the parameters, the server the delta's zeros); so does FedBABU's head, whose initial value the client keeps in
    its state. The counted bytes are exactly the records' payload, and the rounds equal the in-process run."""
    from lightning_fedmeta.algorithms.base import ClientRecord
    from tests.frontends.test_flower import in_process, max_diff

    cfg = write_config(tmp_path, PARTIAL[name])
    server, grid = _recorded(monkeypatch, cfg, tmp_path, node_config={"upload-client-state": False})
    record = ClientRecord(*(t[0] for t in server.records(torch.tensor([0]))))
    downloaded = set(server.algorithm.download(server.init_params, server.server_state, record))
    assert downloaded < set(server.init_params)  # a part only
    for msg, reply in grid.train:
        assert set(reply.content.array_records["delta"].to_torch_state_dict()) == downloaded
        assert set(msg.content.array_records["params"].to_torch_state_dict()) == downloaded
    down: dict[int, int] = {}
    up: dict[int, int] = {}
    for msg, reply in grid.train:
        r = int(msg.content.config_records["config"]["round"])
        down[r] = down.get(r, 0) + payload_bytes_of(msg.content.array_records["params"]) + \
            payload_bytes_of(msg.content.array_records["server-state"])
        up[r] = up.get(r, 0) + payload_bytes_of(reply.content.array_records["delta"]) + \
            payload_bytes_of(reply.content.array_records["extras"])
    for entry in server.history:
        assert entry["comm"]["comm/up_bytes"] == up[entry["round"]]
        assert entry["comm"]["comm/down_bytes"] == down[entry["round"]]
    reference = in_process(cfg)
    assert max_diff({n: p.detach() for n, p in reference.model.named_parameters()}, server.params()) < 1e-5


COMPRESSIONS = {
    "qsgd4_download16": ("{upload: qsgd, bits: 4, bucket_size: 64, download: float16}",
                         4 * math.ceil(D / 64) + math.ceil(D * 4 / 8)),
    "topk": ("{upload: topk, fraction: 0.05}", 22 * 4 + min(4 * 22, math.ceil(D / 8))),  # k = ⌈21.8⌉ = 22
    "bfloat16": ("bfloat16", 2 * D),
}


@pytest.mark.parametrize("label", sorted(COMPRESSIONS))
def test_compressed_uploads_shrink_on_the_wire_and_equal_the_simulation(label: str, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    option, up_one = COMPRESSIONS[label]
    cfg = write_config(tmp_path, ALGORITHMS["fedavg"], extra=f"  compression: {option}")
    reference = in_process(cfg)
    server, grid = _recorded(monkeypatch, cfg, tmp_path)
    for msg, reply in grid.train:
        assert payload_bytes_of(reply.content.array_records["delta"]) == up_one < 4 * D
        if "download" in option:
            assert payload_bytes_of(msg.content.array_records["params"]) == 2 * D
    for entry in server.history:
        assert entry["comm"]["comm/up_bytes"] == len(entry["answered"]) * up_one
    ref = {n: p.detach() for n, p in reference.model.named_parameters()}
    assert max_diff(ref, server.init_params) > 1e-3
    assert max_diff(ref, server.params()) < 1e-5
    assert reference.engine.traffic.cumulative()["comm/up_bytes_cumulative"] == \
        server.history[-1]["comm"]["comm/up_bytes_cumulative"]
    assert len(server.history) == ROUNDS


def _spec() -> ReplySpec:
    delta = {"w": torch.zeros(4, 5), "b": torch.zeros(5)}
    return ReplySpec({k: (tuple(v.shape), v.dtype) for k, v in delta.items()}, {}, {}, frozenset({"loss"}))


def _reply(delta: ArrayRecord) -> RecordDict:
    from flwr.app import MetricRecord

    return RecordDict({"delta": delta, "state": ArrayRecord(), "extras": ArrayRecord(),
                       "metrics": MetricRecord({"loss": 0.5, "num-examples": 7})})


def test_the_server_decodes_the_compressed_delta_and_refuses_a_forged_one() -> None:
    delta = {"w": torch.randn(4, 5, generator=torch.Generator().manual_seed(0)), "b": torch.arange(5.0)}
    row = torch.cat([delta["w"].reshape(-1), delta["b"]])
    topk = TopK(0.2)  # k = 5 of 25
    record, residual = client_upload(topk, delta, None, 0, 0, 3)
    out = check_train_reply(_reply(record), _spec(), 7, topk)
    sent = torch.cat([out.delta["w"].reshape(-1), out.delta["b"]])
    assert torch.equal(sent, topk.roundtrip(row)) and torch.equal(residual, row - sent)
    _, again = client_upload(topk, delta, residual, 0, 1, 3)  # error feedback: the residual joins the next row
    assert torch.equal(again, (row + residual) - topk.roundtrip(row + residual))
    qsgd = QSGD(8, 16)
    record, _ = client_upload(qsgd, delta, None, 5, 2, 3)
    assert payload_bytes_of(record) == qsgd.encoded_bytes(25) == 4 * 2 + 25
    with pytest.raises(RejectedReply, match="delta has the keys"):
        check_train_reply(_reply(record), _spec(), 7, topk)  # QSGD arrays where top-k's are expected
    # a ⌈25/8⌉ = 4-byte bitmap (cheaper than 5 int32 indices) marking 8 coordinates for 5 values
    forged = ArrayRecord(torch_state_dict={"values": torch.ones(5),
                                           "bitmap": torch.tensor([255, 0, 0, 0], dtype=torch.uint8)})
    with pytest.raises(RejectedReply, match="is not a topk"):
        check_train_reply(_reply(forged), _spec(), 7, topk)
    assert parse_compression({"upload": "topk", "fraction": 0.2}).upload == topk
