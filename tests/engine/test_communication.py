"""Byte accounting (issue 28, docs/communication.md): each built-in algorithm's bytes per round against a hand
count on a small model, dropped clients, the cumulative sums across a resume, and check_algorithm's exchange
check against algorithms that declare too little."""

from __future__ import annotations

import warnings
from importlib.util import find_spec
from typing import Any

import pytest
import torch

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.base import ClientOutput
from lightning_fedmeta.algorithms.perfedmaml import PerFedMAML
from lightning_fedmeta.algorithms.scaffold import Scaffold
from lightning_fedmeta.communication.accounting import PlainCodec, RoundTraffic, payload_bytes
from lightning_fedmeta.data.federated import from_client_tensors
from lightning_fedmeta.registry import create_algorithm, list_algorithms
from lightning_fedmeta.testing import CHECKS, check_algorithm, tiny_clients, tiny_mlp

F, H, C = 5, 8, 3  # the kit's MLP: Linear(5, 8) -> Tanh -> Linear(8, 3)
D = (F * H + H) + (H * C + C)  # d = 75 floats
FLOAT, LONG = 4, 8  # float32 and int64 bytes
MOCHA_D = C * (F + 1)  # MOCHA's linear model: one row of F weights and a bias per class
BN_D = (F * H + H) + 2 * H + (H * C + C)  # FedBN's example model: Linear(5, 8) -> BatchNorm1d(8) -> Linear(8, 3)
LORA_A = 2 * F + 2 * H  # FedSA-LoRA's example model: the kit's MLP with rank-2 adapters; the A matrices (2 × d_in)
LORA_B = 2 * H + 2 * C  # the same model's B matrices (d_out × 2)

# (algorithm, arguments) -> (bytes down, bytes up) per client and round, counted by hand from the exchange
HAND_COUNTS: dict[str, tuple[dict[str, Any], int, int]] = {
    "fedavg": ({}, FLOAT * D, FLOAT * D),
    "fedprox": ({"mu": 0.1}, FLOAT * D, FLOAT * D),
    "reptile": ({}, FLOAT * D, FLOAT * D),
    "perfedavg": ({"variant": "hf"}, FLOAT * D, FLOAT * D),
    "fedmaml": ({"alpha": 0.1}, FLOAT * D, FLOAT * D),
    "ditto": ({}, FLOAT * D, FLOAT * D),
    "fedrep": ({}, FLOAT * D, FLOAT * D),
    "fedper": ({}, FLOAT * D, FLOAT * D),
    "mtl_mean": ({}, FLOAT * D, FLOAT * D),
    # w and c down; Δy and Δc up
    "scaffold": ({}, FLOAT * 2 * D, FLOAT * 2 * D),
    # w and k = 2 cluster models and the round counter down; Δ, one-hot choice, w_i and the lowest loss up
    "ifca": ({"num_clusters": 2}, FLOAT * (D + 2 * D) + LONG, FLOAT * (2 * D + 2 + 1)),
    "ifca_perturb": ({"name": "ifca", "num_clusters": 3, "init": "perturb"}, FLOAT * (D + 3 * D),
                     FLOAT * (2 * D + 3 + 1)),
    # w, the own cluster's model and its id down; Δ, the one-hot cluster (max_clusters = 4) and the update up
    "cfl": ({"max_clusters": 4}, FLOAT * 2 * D + LONG, FLOAT * (2 * D + 4)),
    # w down; the change of S (d) and of P (1) up
    "perfedmaml": ({}, FLOAT * D, FLOAT * (D + 1)),
    # w̄, the centre u_k and c_k down; Δ_k and the personal model up
    "mtl_pairwise": ({}, FLOAT * (2 * D + 1), FLOAT * 2 * D),
    "mtl_graph": ({"knn": 2}, FLOAT * (2 * D + 1), FLOAT * 2 * D),
    # the task model, the SDCA scale and the round counter down; Δv and the local gap up
    "mocha": ({}, FLOAT * (MOCHA_D + 1) + LONG, FLOAT * (MOCHA_D + 1)),
    # w̄, the attention-weighted cloud model u_k and c_k = λ/α down; Δ_k and the personal model up
    "fedamp": ({}, FLOAT * (2 * D + 1), FLOAT * 2 * D),
    # M = 3 components down (θ_0 = w, θ_1, θ_2); Δθ_0 and the trained θ_1, θ_2 up
    "fedem": ({"num_components": 3}, FLOAT * 3 * D, FLOAT * 3 * D),
    # the generated model h(v_i; φ) down (the hypernetwork stays on the server); Δθ_i up
    "pfedhn": ({}, FLOAT * D, FLOAT * D),
    # the shared part only, both ways: LG-FedAvg's global last layer (H·C + C), FedBN's all but the normalisation
    # layer (BN_D − 2H = d), FedBABU's body (F·H + H); the personal part / the frozen head never travels
    "lg_fedavg": ({}, FLOAT * (H * C + C), FLOAT * (H * C + C)),
    "fedbn": ({}, FLOAT * (BN_D - 2 * H), FLOAT * (BN_D - 2 * H)),
    "fedbabu": ({}, FLOAT * (F * H + H), FLOAT * (F * H + H)),
    # FedSA-LoRA: the LoRA A matrices both ways; the B matrices stay on the client, the frozen base never travels
    "fedsa_lora": ({}, FLOAT * LORA_A, FLOAT * LORA_A),
    # FDLoRA: the global adapter both ways (A and B); the personal adapter and the fusion weights stay on the client
    "fdlora": ({}, FLOAT * (LORA_A + LORA_B), FLOAT * (LORA_A + LORA_B)),
    # HetLoRA: the rank-r_max adapters down, the zero-padded delta and ‖ΔW_i‖_F up (sizes at r_max for every client)
    "hetlora": ({"rank_choices": [1, 2]}, FLOAT * (LORA_A + LORA_B), FLOAT * (LORA_A + LORA_B + 1)),
    # FedProto: the C × H global prototypes and their C known flags down; the local prototypes and C holds flags up
    "fedproto": ({}, FLOAT * (C * H + C), FLOAT * (C * H + C)),
    # FedDBE: w, the global mean ḡ (H) and its ready flag down; Δ and the running mean (H) up
    "feddbe": ({}, FLOAT * (D + H + 1), FLOAT * (D + H)),
    # FedFomo (M = 2): the two selected stored models down (their indices are not sent: the server recomputes the
    # selection from P); the trained θ_i and its M = 2 weights up
    "fedfomo": ({"models_per_client": 2}, FLOAT * 2 * D, FLOAT * (D + 2)),
    # w down, Δw up: APFL's v and α, FedALA's element-wise weights and FedRoD's personal head stay on the client
    "apfl": ({}, FLOAT * D, FLOAT * D),
    "fedala": ({}, FLOAT * D, FLOAT * D),
    "fedrod": ({}, FLOAT * D, FLOAT * D),
    # FedAS: w down; Δ and the Fisher information up: its trace (1, default), per parameter (d), or nothing ("off")
    "fedas": ({}, FLOAT * D, FLOAT * (D + 1)),
    "fedas_parameter": ({"name": "fedas", "fisher": "parameter"}, FLOAT * D, FLOAT * 2 * D),
    "fedas_off": ({"name": "fedas", "fisher": "off"}, FLOAT * D, FLOAT * D),
    # FedPAC: w, the C × H prototypes and C known flags, the client's combined head (H·C + C) down; Δ, the C × H
    # feature moments H_i, the C × H prototypes, their C class counts and the variance V_i up
    "fedpac": ({}, FLOAT * (D + 2 * C * H + 2 * C), FLOAT * (D + 2 * C * H + C + 1)),
}


def _data() -> Any:
    ds = tiny_clients()
    return from_client_tensors(ds.client_data(), ds.num_classes)


def _module(name: str, args: dict[str, Any], **options: Any) -> FederatedModule:
    data = _data()
    algorithm = create_algorithm(name, **args)
    model = type(algorithm).example_model(tuple(data.input_shape), int(data.num_classes)) or tiny_mlp(F, C, H)
    module = FederatedModule(model=model, algorithm=algorithm, seed=0, **{"clients_per_round": 3, **options})
    module.attach_data(data)
    return module


def _rounds(module: FederatedModule, first: int, last: int) -> list[RoundTraffic]:
    optimizer = torch.optim.SGD(module.model.parameters(), lr=1.0)
    out = []
    for r in range(first, last):
        traffic = module.engine.run_round(r, optimizer).traffic
        assert traffic is not None
        out.append(traffic)
    return out


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _builtins() -> set[str]:
    """The registered algorithms of this package whose module exists (entry points may precede their code)."""
    names = set()
    for entry in list_algorithms():
        if entry.distribution == "lightning-fedmeta" and find_spec(entry.value.split(":")[0]) is not None:
            names.add(entry.name)
    return names


def test_hand_counts_cover_every_builtin_algorithm() -> None:
    counted = {spec.get("name", label) for label, (spec, _, _) in HAND_COUNTS.items()}
    assert _builtins() - counted == set(), "add a hand count (docs/communication.md's table) for these"


@pytest.mark.parametrize("label", sorted(HAND_COUNTS))
def test_bytes_per_round_equal_the_hand_count(label: str) -> None:
    spec, down, up = HAND_COUNTS[label]
    args = dict(spec)
    name = args.pop("name", label)
    module = _module(name, args)
    for traffic in _rounds(module, 0, 2):  # round 0 and a round from trained state
        assert traffic.down_bytes.dtype == torch.int64
        assert traffic.down_bytes.tolist() == [down] * 3
        assert traffic.up_bytes.tolist() == [up] * 3
        assert traffic.totals() == {"comm/up_bytes": 3 * up, "comm/down_bytes": 3 * down}
    assert module.engine.traffic.cumulative() == {"comm/up_bytes_cumulative": 6 * up,
                                                  "comm/down_bytes_cumulative": 6 * down}


def test_dropped_clients_download_but_do_not_upload() -> None:
    module = _module("fedavg", {}, client_dropout=0.5, over_selection=0.5, clients_per_round=2)
    federation = module.engine.federation
    dropped_somewhere = False
    for r, traffic in enumerate(_rounds(module, 0, 6)):
        candidates, answered = federation.round_candidates(r), federation.round_clients(r)
        dropped_somewhere |= answered.numel() < candidates.numel()
        assert traffic.down_bytes.tolist() == [FLOAT * D] * candidates.numel()  # ⌈1.5 · 2⌉ = 3 candidates
        assert traffic.up_bytes.tolist() == [FLOAT * D * int(c in answered.tolist()) for c in candidates.tolist()]
    assert dropped_somewhere


def test_cumulative_bytes_survive_a_resume() -> None:
    straight = _module("scaffold", {})
    _rounds(straight, 0, 4)
    first = _module("scaffold", {})
    _rounds(first, 0, 2)
    saved = first.engine.state_dict(2)
    assert saved["traffic"] == {"up_bytes": 2 * 3 * FLOAT * 2 * D, "down_bytes": 2 * 3 * FLOAT * 2 * D}
    resumed = _module("scaffold", {})
    resumed.engine.load_state_dict(saved)
    _rounds(resumed, 2, 4)
    assert resumed.engine.traffic.cumulative() == straight.engine.traffic.cumulative()
    assert straight.engine.traffic.cumulative()["comm/up_bytes_cumulative"] == 4 * 3 * FLOAT * 2 * D
    resumed.engine.load_state_dict({**saved, "traffic": None})  # a checkpoint from before byte accounting
    assert resumed.engine.traffic.cumulative()["comm/up_bytes_cumulative"] == 0


def test_payload_bytes_by_dtype_and_per_client() -> None:
    tensors = {"a": torch.zeros(3, 4, dtype=torch.float16), "b": {"c": torch.zeros(3, 2, dtype=torch.int64)},
               "d": torch.zeros(3, dtype=torch.bool)}
    assert payload_bytes(tensors) == 12 * 2 + 6 * 8 + 3 * 1
    assert payload_bytes(tensors, PlainCodec(), per_client=True).tolist() == [4 * 2 + 2 * 8 + 1] * 3
    with pytest.raises(ValueError, match="same clients"):
        payload_bytes({"a": torch.zeros(2, 1), "b": torch.zeros(3, 1)}, per_client=True)


class _ScaffoldWithoutC(Scaffold):
    """Declares the default download (w alone) but its client_update reads c."""

    def download(self, params: Any, server_state: Any, client: Any) -> dict[str, Any]:
        return dict(params)


class _PerFedMAMLSendingDelta(PerFedMAML):
    """Declares the default upload (Δ) but its aggregate reads the extras (the change of S and P)."""

    def upload(self, output: ClientOutput) -> dict[str, Any]:
        return {"delta": output.delta}


class _ScaffoldInventingATensor(Scaffold):
    """Uploads a tensor that is not in its output."""

    def upload(self, output: ClientOutput) -> dict[str, Any]:
        return {"delta": output.delta, "extras": {"dc": {k: v + 1 for k, v in output.extras["dc"].items()}}}


ONLY_EXCHANGE = [c for c in CHECKS if c != "check_exchange"]


@pytest.mark.parametrize(("cls", "message"), [
    (_ScaffoldWithoutC, r"client_update reads \['server/c/"),
    (_PerFedMAMLSendingDelta, r"aggregate reads \['extras/"),
    (_ScaffoldInventingATensor, r"upload\(\) returns 'extras/dc/"),
])
def test_check_exchange_refuses_an_algorithm_that_under_declares(cls: type, message: str) -> None:
    with pytest.raises(AssertionError, match=f"check_exchange: {message}"):
        check_algorithm(cls, skip=ONLY_EXCHANGE)


@pytest.mark.parametrize("name", ["scaffold", "cfl", "mocha", "fedamp", "fedem", "pfedhn", "lg_fedavg", "fedbn",
                                  "fedbabu", "apfl", "fedala", "fedrod", "fedproto", "feddbe", "fedfomo",
                                  "fedas", "fedpac"])
def test_check_exchange_passes_the_builtins_it_covers(name: str) -> None:
    check_algorithm(name, skip=ONLY_EXCHANGE)


def test_engine_bytes_follow_the_codec() -> None:
    class HalfCodec:
        name = "half"

        def encoded_bytes(self, numel: int, dtype: torch.dtype) -> int:
            return 2 * numel

    module = _module("fedavg", {})
    module.engine.codec = HalfCodec()
    (traffic,) = _rounds(module, 0, 1)
    assert traffic.up_bytes.tolist() == [2 * D] * 3 and traffic.down_bytes.tolist() == [2 * D] * 3


# model.compression -> (bytes down, bytes up) per fedavg client, by hand on the flat row of d = 75 values
COMPRESSED_COUNTS: dict[str, tuple[Any, int, int]] = {
    "float16": ("float16", FLOAT * D, 2 * D),
    "bfloat16_both": ({"upload": "bfloat16", "download": "bfloat16"}, 2 * D, 2 * D),
    # one bucket: one float32 norm, 75 one-byte levels
    "qsgd8": ({"upload": "qsgd", "bits": 8}, FLOAT * D, 4 * 1 + 75),
    # ⌈75/32⌉ = 3 buckets on the flat row (not per tensor: 4 tensors would make 4 + 1 + 1 + 1 = 7): 3 norms, ⌈300/8⌉
    "qsgd4_buckets": ({"upload": "qsgd", "bits": 4, "bucket_size": 32}, FLOAT * D, 4 * 3 + 38),
    # k = ⌈7.5⌉ = 8 float32 values and the cheaper of 8 int32 indices (32) and a ⌈75/8⌉ = 10-byte bitmap
    "topk": ({"upload": "topk", "fraction": 0.1, "download": "float16"}, 2 * D, 8 * 4 + 10),
    # k = ⌈37.5⌉ = 38 values and a 10-byte bitmap
    "randomk": ({"upload": "randomk", "fraction": 0.5}, FLOAT * D, 38 * 4 + 10),
}


@pytest.mark.parametrize("label", sorted(COMPRESSED_COUNTS))
def test_bytes_follow_the_configured_compressors(label: str) -> None:
    option, down, up = COMPRESSED_COUNTS[label]
    module = _module("fedavg", {}, compression=option)
    spec = module.engine.compression.spec
    for traffic in _rounds(module, 0, 2):
        assert traffic.totals() == {"comm/up_bytes": 3 * up, "comm/down_bytes": 3 * down}
    if spec.upload is not None:  # what the compressor itself says it sends for the flat upload
        assert up == spec.upload.encoded_bytes(D)


def test_a_16_bit_download_halves_only_what_comes_from_the_model() -> None:
    module = _module("scaffold", {}, compression={"download": "float16"})
    (traffic,) = _rounds(module, 0, 1)
    assert traffic.down_bytes.tolist() == [2 * D + FLOAT * D] * 3  # w in 16 bits, SCAFFOLD's c in float32
    assert traffic.up_bytes.tolist() == [FLOAT * 2 * D] * 3
