"""Per-client LoRA adapters in the disk store (issue 40, docs/scale.md "Adapters at scale"): FedSA-LoRA's personal
``lora_B`` matrices on a LoRA'd TinyTransformer with ``client_state="disk"``. The store holds the personal adapter
tensors only (no base tensor, no ``lora_A``), a client's row is exactly their bytes, a segment costs those bytes
plus the documented 8-byte client index per row (and fixed header and padding per segment), rows are allocated
lazily (a client never sampled is never written), the store's memory is the template row plus 2 bytes per client,
and a resume from a checkpoint is bit-exact; at 10,000 clients too."""

from __future__ import annotations

import os
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.data import FederatedData, FederatedDataModule
from lightning_fedmeta.data.synthetic_tasks import make_synthetic_next_token
from lightning_fedmeta.models.lora import add_lora
from lightning_fedmeta.models.reference import TinyTransformer
from lightning_fedmeta.persistence import disk_store as disk_state
from lightning_fedmeta.persistence.disk_store import DiskClientStateStore, read_segment
from lightning_fedmeta.persistence.memory_store import ClientStateStore
from lightning_fedmeta.testing import _AsDataset
from tests.conftest import run_plain_rounds
from tests.helpers import make_trainer

VOCAB, T, WIDTH, RANK = 8, 6, 16, 2
#: FedSA-LoRA's personal part, by hand: B is d_out × r on qkv (48 × 2), proj (16 × 2) and head (8 × 2), float32
B_SHAPES = {"blocks.0.attn.qkv.lora_B": (3 * WIDTH, RANK), "blocks.0.attn.proj.lora_B": (WIDTH, RANK),
            "head.lora_B": (VOCAB, RANK)}
ROW_BYTES = 4 * (3 * WIDTH * RANK + WIDTH * RANK + VOCAB * RANK)  # 576 bytes per client
INDEX_BYTES = 8  # a segment stores each row's client index as int64
FEDSA = {"name": "fedsa_lora", "local_steps": 2, "local_lr": 0.3}


def lora_lm() -> nn.Module:
    torch.manual_seed(0)
    return add_lora(TinyTransformer(VOCAB, d_model=WIDTH, nhead=2, num_layers=1, max_len=T), ["qkv", "proj", "head"],
                    rank=RANK, alpha=4.0)


def module_of(store: str, directory: Path | None, clients_per_round: int = 3, init_seed: int = 0) -> FederatedModule:
    model = lora_lm()
    if init_seed:  # other initial adapters: a resumed run must take them from the checkpoint
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.5)
    return FederatedModule(model=model, algorithm=dict(FEDSA), clients_per_round=clients_per_round, seed=1,
                           holdout_clients=1, compile_clients=False, client_state=store,
                           client_state_dir=None if directory is None else str(directory))


@pytest.fixture(scope="module")
def data() -> Any:
    return make_synthetic_next_token(num_clients=7, vocab_size=VOCAB, seq_len=T, seed=0)


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def tiny_token_clients(num_clients: int, seed: int = 0) -> FederatedData:
    """``num_clients`` next-token clients of 2, 3 or 4 random training windows and one test window each, built in
    one vectorised draw (a Markov-chain generator per client would cost seconds at 10,000 clients)."""
    g = torch.Generator().manual_seed(seed)
    sizes = 2 + torch.arange(num_clients) % 3
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
    train = torch.randint(0, VOCAB, (int(offsets[-1]), T + 1), generator=g)
    test = torch.randint(0, VOCAB, (num_clients, T + 1), generator=g)
    return FederatedData(train[:, :-1], train[:, 1:], offsets, test[:, :-1], test[:, 1:],
                         torch.arange(num_clients + 1), VOCAB, task="next_token")


def header_bytes(path: str) -> int:
    """A segment's magic, header length and JSON header (``16 + length`` bytes)."""
    with open(path, "rb") as fh:
        (head,) = struct.unpack("<Q", fh.read(16)[8:])
    return 16 + int(head)


def segment_size(path: str, rows: int, entries: dict[str, int]) -> int:
    """The layout of :func:`~lightning_fedmeta.persistence.disk_store.write_segment`: the header, padded to 64
    bytes; the ``rows`` int64 client indices; each entry's ``rows × row bytes``; every block padded to 64 bytes."""
    pad = lambda n: -(-n // 64) * 64  # noqa: E731
    return pad(header_bytes(path)) + pad(INDEX_BYTES * rows) + sum(pad(rows * b) for b in entries.values())


def allocated_bytes(store: DiskClientStateStore) -> int:
    return sum(os.stat(os.path.join(store.work, f)).st_blocks * 512 for f in os.listdir(store.work))


def test_the_store_holds_the_personal_adapters_only_at_their_exact_bytes(data: Any, tmp_path: Path) -> None:
    module = module_of("disk", tmp_path)
    module.attach_data(data)
    store = module.client_states
    assert isinstance(store, DiskClientStateStore)
    k = data.num_clients
    frozen = {n for n, p in module.model.named_parameters() if not p.requires_grad}
    expected = {f"personal/{n}": (shape, torch.float32) for n, shape in B_SHAPES.items()}
    assert store.entries == expected  # no base tensor, no lora_A: the personal adapters only
    assert not {part for name in store.entries for part in name.split("/")} & frozen
    assert store.row_bytes() == ROW_BYTES == sum(4 * module.model.get_parameter(n).numel() for n in B_SHAPES)
    assert store.nbytes() == k * ROW_BYTES
    assert store.resident_bytes() == ROW_BYTES + 2 * k  # the template row and two [K] byte masks
    sizes = {f: os.path.getsize(os.path.join(store.work, f)) for f in os.listdir(store.work)}
    assert sorted(sizes.values()) == sorted(k * 4 * r * c for r, c in B_SHAPES.values())  # K rows, sparse
    assert store.written.sum() == 0  # lazy: nothing written at setup

    sampled = torch.unique(torch.cat(run_plain_rounds(module, 3)))
    assert store.written.nonzero().flatten().tolist() == sampled.tolist()  # only the sampled clients' rows
    assert 0 < sampled.numel() < k - 1
    manifest = store.checkpoint_state(3)
    assert set(manifest["entries"]) == set(expected)
    assert all(torch.equal(v, torch.zeros(B_SHAPES[n.split("/", 1)[1]])) for n, v in manifest["template"].items())
    (record,) = manifest["segments"]
    path = os.path.join(store.segment_directory, record["file"])
    n = record["rows"]
    assert n == sampled.numel()
    per_entry = {name: 4 * r * c for name, (r, c) in zip(expected, B_SHAPES.values(), strict=True)}
    assert os.path.getsize(path) == segment_size(path, n, per_entry)
    # per client (8-byte index + adapter bytes); per segment the header and under 64 bytes of padding per block
    overhead = os.path.getsize(path) - n * (INDEX_BYTES + ROW_BYTES)
    assert header_bytes(path) <= overhead < header_bytes(path) + 64 * (2 + len(expected))
    clients, values = read_segment(path, record["sha256"])
    assert clients.tolist() == sampled.tolist()
    rows = store.gather(clients)["personal"]
    for name, shape in B_SHAPES.items():
        assert values[f"personal/{name}"].shape == (n, *shape)
        assert torch.equal(values[f"personal/{name}"], rows[name])
        assert float(rows[name].abs().sum()) > 0  # trained: B moved from B⁰ = 0


def _fit(module: FederatedModule, data: Any, rounds: int, checkpoints: Path | None = None,
         ckpt_path: Path | None = None) -> FederatedModule:
    callbacks = [] if checkpoints is None else [
        ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=2, save_top_k=-1, filename="{step}")]
    trainer = make_trainer(rounds, enable_checkpointing=checkpoints is not None, callbacks=callbacks)
    trainer.fit(module, FederatedDataModule(dataset=_AsDataset(data), eval_every=2),
                ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return module


def test_resume_with_the_disk_store_is_bit_exact(data: Any, tmp_path: Path) -> None:
    """4 rounds straight (memory store) against 2 rounds with the disk store, a checkpoint, and 2 more rounds resumed
    from it into another folder (other initial adapters): model, every client's B, ``seen`` and the per-client
    evaluation equal bit for bit; the checkpoint's client state is the manifest of the B rows."""
    straight = _fit(module_of("memory", None), data, 4)
    assert isinstance(straight.client_states, ClientStateStore)
    _fit(module_of("disk", tmp_path / "first"), data, 2, checkpoints=tmp_path / "ckpt")
    checkpoint = tmp_path / "ckpt" / "step=2.ckpt"
    manifest = torch.load(checkpoint, weights_only=True)["fedmeta"]["engine"]["client_state"]
    assert manifest["format"] == disk_state.MANIFEST_FORMAT
    assert set(manifest["entries"]) == {f"personal/{n}" for n in B_SHAPES}
    resumed = _fit(module_of("disk", tmp_path / "resumed", init_seed=5), data, 4, ckpt_path=checkpoint)
    assert isinstance(resumed.client_states, DiskClientStateStore)
    for name, value in straight.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name
    left, right = straight.client_states.state_dict(), resumed.client_states.state_dict()
    assert set(left) == set(right) == {f"personal/{n}" for n in B_SHAPES}
    for name, value in left.items():
        assert torch.equal(right[name], value), name
    assert torch.equal(straight.seen, resumed.seen) and 0 < int(straight.seen.sum()) < data.num_clients
    for name, value in straight.last_per_client.items():
        assert torch.equal(resumed.last_per_client[name], value), name


def test_ten_thousand_clients_write_only_the_sampled_adapters(tmp_path: Path) -> None:
    """K = 10,000: setup writes nothing, 3 rounds of 10 clients write their rows only (sparse files: disk blocks
    for the written rows, not K), the store's memory is the template plus 2 bytes a client, a checkpoint's segment
    holds the sampled rows only, and a client never sampled reads B⁰ = 0 (its personalised model is the base)."""
    k = 10_000
    data = tiny_token_clients(k)
    module = module_of("disk", tmp_path, clients_per_round=10)
    module.attach_data(data)
    store = module.client_states
    assert isinstance(store, DiskClientStateStore)
    assert store.nbytes() == k * ROW_BYTES and store.written.sum() == 0
    sampled = torch.unique(torch.cat(run_plain_rounds(module, 3)))
    assert store.written.nonzero().flatten().tolist() == sampled.tolist()
    assert store.resident_bytes() == ROW_BYTES + 2 * k  # flat in K but for 2 bytes of bookkeeping per client
    # sparse files: about one 4 KiB page per written row and entry (1 MiB of slack for the file system's own
    # allocation policy), far below the K rows' 5.76 MB
    assert allocated_bytes(store) <= sampled.numel() * len(B_SHAPES) * 4096 + 2**20 < k * ROW_BYTES // 2
    (record,) = store.checkpoint_state(3)["segments"]
    assert record["rows"] == sampled.numel()
    never = next(i for i in range(k) if i not in set(sampled.tolist()) and not bool(module.is_holdout[i]))
    personal = module.personalize(never)
    for name in B_SHAPES:
        assert torch.equal(personal.get_parameter(name), torch.zeros(B_SHAPES[name]))
