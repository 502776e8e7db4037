"""Bytes of LoRA adapters on the wire (issue 40, docs/communication.md "LoRA adapters"): on a LoRA'd
TinyTransformer the accounted bytes per round are the hand count of the adapter tensors that travel, down and up,
for plain LoRA under fedavg, FedSA-LoRA (``fedsa_lora``) and FFA-LoRA (``freeze_a=True`` under fedavg); never a
byte of the frozen base; and under ``model.compression`` the compressed size of the adapter row alone."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.communication.compressors import QSGD, TopK
from lightning_fedmeta.data.synthetic_tasks import make_synthetic_next_token
from lightning_fedmeta.models.lora import add_lora
from lightning_fedmeta.models.reference import TinyTransformer

VOCAB, T, WIDTH, RANK = 8, 6, 16, 2
FLOAT, HALF = 4, 2
# the hand count: rank-2 adapters on qkv (16 → 48), proj (16 → 16) and head (16 → 8); A is r × d_in, B is d_out × r
D_A = RANK * WIDTH + RANK * WIDTH + RANK * WIDTH  # 96 floats
D_B = 3 * WIDTH * RANK + WIDTH * RANK + VOCAB * RANK  # 96 + 32 + 16 = 144 floats
CLIENTS_PER_ROUND = 3

#: label -> (algorithm, freeze_a, floats down per client, floats up per client)
CASES: dict[str, tuple[dict[str, Any], bool, int, int]] = {
    "lora_fedavg": ({"name": "fedavg"}, False, D_A + D_B, D_A + D_B),  # both factors, each way
    "fedsa_lora": ({"name": "fedsa_lora"}, False, D_A, D_A),  # A each way; B stays on the client
    "ffa_lora": ({"name": "fedavg"}, True, D_B, D_B),  # B each way; A frozen at its initialisation
}


def lora_lm(freeze_a: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return add_lora(TinyTransformer(VOCAB, d_model=WIDTH, nhead=2, num_layers=1, max_len=T), ["qkv", "proj", "head"],
                    rank=RANK, alpha=4.0, freeze_a=freeze_a)


@pytest.fixture(scope="module")
def data() -> Any:
    return make_synthetic_next_token(num_clients=7, vocab_size=VOCAB, seq_len=T, seed=0)


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def bound(data: Any, label: str, **options: Any) -> FederatedModule:
    algorithm, freeze_a, _, _ = CASES[label]
    module = FederatedModule(model=lora_lm(freeze_a), algorithm={**algorithm, "local_steps": 2, "local_lr": 0.3},
                             clients_per_round=CLIENTS_PER_ROUND, seed=1, compile_clients=False, **options)
    module.attach_data(data)
    return module


def two_rounds(module: FederatedModule) -> list[Any]:
    optimizer = torch.optim.SGD([p for p in module.model.parameters() if p.requires_grad], lr=1.0)
    out = []
    for r in range(2):  # round 0 and a round from trained state
        traffic = module.engine.run_round(r, optimizer).traffic
        assert traffic is not None
        out.append(traffic)
    return out


def test_the_hand_count_is_the_models_adapter_count() -> None:
    """The constants above are the LoRA'd model's own numbers, and the base is far larger than the adapters."""
    model = lora_lm()
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    assert sum(v for n, v in sizes.items() if n.endswith("lora_A")) == D_A
    assert sum(v for n, v in sizes.items() if n.endswith("lora_B")) == D_B
    base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert base == 3672 > 10 * (D_A + D_B)  # docs/communication.md, "LoRA adapters"
    frozen_a = lora_lm(freeze_a=True)
    assert sum(p.numel() for p in frozen_a.parameters() if p.requires_grad) == D_B


@pytest.mark.parametrize("label", sorted(CASES))
def test_bytes_per_round_are_the_adapters_that_travel(label: str, data: Any) -> None:
    _, _, down, up = CASES[label]
    module = bound(data, label)
    for traffic in two_rounds(module):
        assert traffic.down_bytes.tolist() == [FLOAT * down] * CLIENTS_PER_ROUND
        assert traffic.up_bytes.tolist() == [FLOAT * up] * CLIENTS_PER_ROUND
    assert module.engine.traffic.cumulative() == {
        "comm/up_bytes_cumulative": 2 * CLIENTS_PER_ROUND * FLOAT * up,
        "comm/down_bytes_cumulative": 2 * CLIENTS_PER_ROUND * FLOAT * down,
    }


@pytest.mark.parametrize("label", ["lora_fedavg", "ffa_lora"])
@pytest.mark.parametrize("compression", [{"upload": "topk", "fraction": 0.1},
                                         {"upload": "qsgd", "bits": 4, "bucket_size": 64, "download": "float16"}],
                         ids=["topk", "qsgd4_half_down"])
def test_compressed_bytes_are_those_of_the_adapter_row(label: str, compression: dict[str, Any], data: Any) -> None:
    """The upload is one flat row of the d adapter floats: top-k sends k = ⌈0.1·d⌉ values and k int32 indices (or a
    ⌈d/8⌉-byte bitmap, whichever is smaller); 4-bit QSGD ⌈4d/8⌉ level bytes and ⌈d/64⌉ float32 norms; a float16
    download 2 bytes per adapter value."""
    _, _, down, up = CASES[label]
    module = bound(data, label, compression=compression)
    if compression["upload"] == "topk":
        k = math.ceil(0.1 * up)
        up_bytes = 4 * k + min(4 * k, math.ceil(up / 8))
        assert up_bytes == TopK(0.1).encoded_bytes(up)
        down_bytes = FLOAT * down
    else:
        up_bytes = math.ceil(up * 4 / 8) + 4 * math.ceil(up / 64)
        assert up_bytes == QSGD(4, bucket_size=64).encoded_bytes(up)
        down_bytes = HALF * down
    for traffic in two_rounds(module):
        assert traffic.up_bytes.tolist() == [up_bytes] * CLIENTS_PER_ROUND
        assert traffic.down_bytes.tolist() == [down_bytes] * CLIENTS_PER_ROUND


def test_fedsa_lora_may_download_in_16_bits(data: Any) -> None:
    """FedSA-LoRA refuses upload compression (its aggregate averages A only) but not a 16-bit download: 2 bytes per
    value of A down, A's 4-byte ΔA up."""
    module = bound(data, "fedsa_lora", compression={"download": "float16"})
    for traffic in two_rounds(module):
        assert traffic.down_bytes.tolist() == [HALF * D_A] * CLIENTS_PER_ROUND
        assert traffic.up_bytes.tolist() == [FLOAT * D_A] * CLIENTS_PER_ROUND
