"""The disk-backed client state store (lightning_fedmeta/persistence/disk_store.py, docs/scale.md): the same values as
the
in-memory store bit for bit, resident memory independent of K, lazy initialisation, checkpoints that reference
immutable checksummed segments (bit-exact resume from the last and from an earlier checkpoint) and clear errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.base import ClientRecord
from lightning_fedmeta.algorithms.fedavg import FedAvg
from lightning_fedmeta.client.functional import Params
from lightning_fedmeta.persistence import disk_store as disk_state
from lightning_fedmeta.persistence.checksums import CheckpointDamagedError
from lightning_fedmeta.persistence.disk_store import DiskClientStateStore, read_segment
from lightning_fedmeta.persistence.memory_store import ClientStateStore, flatten_state
from tests.conftest import run_plain_rounds
from tests.helpers import make_trainer, tiny_data, tiny_datamodule

DITTO = {"name": "ditto", "lam": 0.1, "local_steps": 2, "local_lr": 0.1, "batch_size": 4, "finetune_steps": 1}
SCAFFOLD = {"name": "scaffold", "local_lr": 0.2, "local_steps": 2, "batch_size": 4}


def _module(algorithm: dict, client_state: str, directory: Path | None = None, init_seed: int = 0,
            clients_per_round: int = 3) -> FederatedModule:
    torch.manual_seed(init_seed)
    return FederatedModule(
        model=nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)), algorithm=algorithm,
        clients_per_round=clients_per_round, seed=3, client_state=client_state,
        client_state_dir=None if directory is None else str(directory),
        server_optimizer=lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9),
    )


def _assert_same(a: FederatedModule, b: FederatedModule) -> None:
    for k, v in a.model.state_dict().items():
        assert torch.equal(b.model.state_dict()[k], v), k
    left, right = a.client_states.state_dict(), b.client_states.state_dict()
    assert set(left) == set(right)
    for k, v in left.items():
        assert torch.equal(right[k], v), k
    for k, v in flatten_state(a.server_state).items():
        assert torch.equal(flatten_state(b.server_state)[k], v), k


@pytest.mark.parametrize("algorithm", [DITTO, SCAFFOLD], ids=["ditto", "scaffold"])
def test_disk_store_gives_the_memory_store_results_bit_for_bit(tmp_path: Path, algorithm: dict) -> None:
    """4 rounds, 3 of 10 clients of unequal sizes per round: personal models / control variates identical, for the
    clients that trained and for those that never did (their rows read as the initial value)."""
    runs = {}
    for kind in ("memory", "disk"):
        module = _module(algorithm, kind, tmp_path)
        module.attach_data(tiny_data(10))
        sampled = run_plain_rounds(module, 4)
        runs[kind] = module
    assert isinstance(runs["disk"].client_states, DiskClientStateStore)
    assert isinstance(runs["memory"].client_states, ClientStateStore)
    _assert_same(runs["memory"], runs["disk"])
    # the rounds really changed some rows and not others (partial participation)
    touched = torch.unique(torch.cat(sampled))
    state = runs["disk"].client_states.state_dict()
    name = next(iter(state))
    initial = runs["disk"].client_states.template[name]
    changed = torch.tensor([not torch.equal(state[name][i], initial) for i in range(10)])
    assert 0 < changed.sum() == touched.numel() < 10
    # the evaluation reads the same rows too
    clients = torch.arange(10)
    left = runs["memory"].evaluate_clients(clients, 4)
    right = runs["disk"].evaluate_clients(clients, 4)
    for k in ("loss_sum", "total"):
        assert torch.equal(left[k], right[k]), k


def test_resident_memory_of_the_store_does_not_grow_with_the_population(tmp_path: Path) -> None:
    """Ditto's row for the 784-80-60-10 MLP (68,270 float32 parameters = 273,080 bytes): at K = 100 and K = 100,000
    the store holds the template row and 2 bytes of bookkeeping per client; the files hold only written rows."""
    model = nn.Sequential(nn.Linear(784, 80), nn.ReLU(), nn.Linear(80, 60), nn.ReLU(), nn.Linear(60, 10))
    params = {k: v.detach() for k, v in model.named_parameters()}
    template = {"personal": params}
    row = 68_270 * 4
    for k in (100, 100_000):
        store = DiskClientStateStore.lazy(tmp_path / f"k{k}", k, template)
        assert store.nbytes() == k * row
        clients = torch.tensor([3, 17, 42, 99])
        rows = store.gather(clients)
        store.scatter(clients, {"personal": {n: v + 1 for n, v in rows["personal"].items()}})
        assert store.resident_bytes() == row + 2 * k  # not k * row
        allocated = sum(os.stat(os.path.join(store.work, f)).st_blocks * 512 for f in os.listdir(store.work))
        assert allocated < 8 * row + 5 * 2**20  # sparse files: the 4 written rows (+ page rounding), not k rows
        back = store.gather(torch.tensor([17, 5]))["personal"]["0.weight"]
        assert torch.equal(back[0], params["0.weight"] + 1) and torch.equal(back[1], params["0.weight"])
        assert store.rows_gathered == 6 and store.rows_scattered == 4
        store.close()
        assert not os.path.exists(store.work)  # the working files go; the segments stay


@pytest.mark.skipif(os.name == "nt", reason="the working files' owner lock is POSIX flock")
def test_working_files_of_a_killed_process_are_removed(tmp_path: Path) -> None:
    """A killed store's files (its owner file written on this kernel, its lock released by the kernel) are removed;
    those of a store that still holds its lock stay (a pid proves nothing across PID namespaces: issue 41)."""
    import fcntl

    rank = tmp_path / "rank-0"
    (rank / "segments").mkdir(parents=True)

    def leftover(owner: str) -> tuple[Path, Path]:
        work = rank / f"work-{owner}"
        work.mkdir()
        (work / "0.rows").write_bytes(b"x" * 100)
        partial = rank / "segments" / f".seg-{owner}-1-0badc0de.partial"
        partial.write_bytes(b"half a segment")
        (rank / f"work-{owner}.lock").write_text(json.dumps({"kernel": disk_state._kernel_id()}))
        return work, partial

    stale, live = leftover("999999999-0badc0de"), leftover("999999998-00ff00ff")
    held = os.open(rank / "work-999999998-00ff00ff.lock", os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live store's lock: kept
    try:
        store = DiskClientStateStore.lazy(tmp_path, 4, {"c": torch.zeros(3)})
        assert not stale[0].exists() and not stale[1].exists() and not (rank / "work-999999999-0badc0de.lock").exists()
        assert live[0].is_dir() and live[1].exists() and os.path.isdir(store.work)
        store.close()
    finally:
        os.close(held)


class _PerClient(FedAvg):
    """State that depends on the client's record: ``[n_i, 2·index]`` per client (overrides init_client_states)."""

    def init_client_states(self, params: Params, clients: ClientRecord) -> dict[str, torch.Tensor]:
        return {"v": torch.stack([clients.num_samples.double(), 2.0 * clients.index.double()], 1)}


class _Ragged(FedAvg):
    """A row shape that depends on which clients are initialised together (as MOCHA's padded duals)."""

    def init_client_states(self, params: Params, clients: ClientRecord) -> dict[str, torch.Tensor]:
        return {"a": torch.zeros(clients.index.numel(), int(clients.num_samples.max()))}


def test_lazy_and_block_initialisation_equal_the_eager_one(tmp_path: Path) -> None:
    eager = _module(DITTO, "memory")
    eager.attach_data(tiny_data())
    lazy = _module(DITTO, "disk", tmp_path)
    lazy.attach_data(tiny_data())
    assert lazy.client_states.written.sum() == 0  # nothing initialised in the files
    for k, v in eager.client_states.state_dict().items():
        assert torch.equal(lazy.client_states.state_dict()[k], v), k
    # an algorithm whose rows depend on the client: initialised in blocks, the same values
    data = tiny_data()
    memory = FederatedModule(model=nn.Linear(5, 3), algorithm=_PerClient(), clients_per_round=2,
                             client_state="memory")
    memory.attach_data(data)
    expected = memory.client_states.state_dict()["v"]
    assert torch.equal(expected[:, 1], 2.0 * torch.arange(6).double())
    everyone = memory.records(torch.arange(6), device=torch.device("cpu"))
    blocks = DiskClientStateStore.from_rows(
        tmp_path / "blocks", 6, lambda c: _PerClient().init_client_states({}, ClientRecord(*(t[c] for t in everyone))),
        chunk=4,
    )
    assert torch.equal(blocks.state_dict()["v"], expected)
    disk = FederatedModule(model=nn.Linear(5, 3), algorithm=_PerClient(), clients_per_round=2, client_state="disk",
                           client_state_dir=str(tmp_path / "m"))
    disk.attach_data(data)
    assert torch.equal(disk.client_states.state_dict()["v"], expected)
    with pytest.raises(ValueError, match="must not depend on which other clients"):
        DiskClientStateStore.from_rows(
            tmp_path / "ragged", 6,
            lambda c: _Ragged().init_client_states({}, ClientRecord(*(t[c] for t in everyone))), chunk=2,
        )


def test_auto_chooses_disk_above_the_threshold_and_logs_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    module = _module(DITTO, "auto", tmp_path)
    module.attach_data(tiny_data())
    assert isinstance(module.client_states, ClientStateStore)  # 6 clients × 156 bytes: memory
    monkeypatch.setattr(disk_state, "DISK_STATE_THRESHOLD_BYTES", 6 * (5 * 4 + 4 + 4 * 3 + 3) * 4 - 1)
    module = _module(DITTO, "auto", tmp_path)
    with caplog.at_level("INFO"):
        module.attach_data(tiny_data())
    assert isinstance(module.client_states, DiskClientStateStore)
    assert "model.client_state=auto: client state on disk" in caplog.text


def _fit_with_checkpoints(state: Path, checkpoints: Path, rounds: int, ckpt_every: int, init_seed: int = 0,
                          ckpt_path: Path | None = None) -> FederatedModule:
    module = _module(DITTO, "disk", state, init_seed=init_seed)
    callbacks = [ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=ckpt_every, save_top_k=-1,
                                 filename="{step}")]
    trainer = make_trainer(rounds, enable_checkpointing=True, callbacks=callbacks)
    trainer.fit(module, tiny_datamodule(eval_every=2), ckpt_path=None if ckpt_path is None else str(ckpt_path))
    return module


def test_resume_from_the_last_and_from_an_earlier_checkpoint_is_bit_exact(tmp_path: Path) -> None:
    straight = _module(DITTO, "memory")
    make_trainer(6).fit(straight, tiny_datamodule(eval_every=2))

    first = _fit_with_checkpoints(tmp_path / "state", tmp_path / "ckpt", 4, 2)  # checkpoints after rounds 2, 4
    earlier, last = tmp_path / "ckpt" / "step=2.ckpt", tmp_path / "ckpt" / "step=4.ckpt"
    manifest = torch.load(last, weights_only=True)["fedmeta"]["engine"]["client_state"]
    assert manifest["format"] == disk_state.MANIFEST_FORMAT and len(manifest["segments"]) == 2
    assert sum(s["rows"] for s in manifest["segments"]) <= 2 * 2 * 3  # rows written since each checkpoint only
    assert not torch.equal(first.model[0].weight, straight.model[0].weight)

    # the earlier resume continues in the same folder (new segments); the last checkpoint must stay valid after it;
    # the third resumes into another folder (the segments it needs are linked or copied there)
    for i, (path, state) in enumerate([(last, "state"), (earlier, "state"), (last, "moved")]):
        resumed = _fit_with_checkpoints(tmp_path / state, tmp_path / f"ckpt{i}", 6, 2, init_seed=9, ckpt_path=path)
        assert isinstance(resumed.client_states, DiskClientStateStore)
        _assert_same(straight, resumed)
    own = torch.load(tmp_path / "ckpt2" / "step=6.ckpt", weights_only=True)["fedmeta"]["engine"]["client_state"]
    moved = tmp_path / "moved" / "rank-0" / "segments"
    assert all((moved / s["file"]).is_file() for s in own["segments"])
    assert own["segments"][:2] == manifest["segments"]


def test_a_checkpoint_of_either_store_resumes_into_the_other(tmp_path: Path) -> None:
    """``client_state`` may change on resume: a memory checkpoint continues on disk and the reverse, bit for bit."""
    straight = _module(DITTO, "memory")
    make_trainer(4).fit(straight, tiny_datamodule(eval_every=2))
    for saved, resumed_as in (("memory", "disk"), ("disk", "memory")):
        first = _module(DITTO, saved, tmp_path / saved)
        trainer = make_trainer(2)
        trainer.fit(first, tiny_datamodule(eval_every=2))
        trainer.save_checkpoint(tmp_path / f"{saved}.ckpt")
        resumed = _module(DITTO, resumed_as, tmp_path / f"{saved}_to_{resumed_as}", init_seed=5)
        make_trainer(4).fit(resumed, tiny_datamodule(eval_every=2), ckpt_path=str(tmp_path / f"{saved}.ckpt"))
        assert isinstance(resumed.client_states, DiskClientStateStore if resumed_as == "disk" else ClientStateStore)
        _assert_same(straight, resumed)


def test_damaged_or_missing_segments_are_refused(tmp_path: Path) -> None:
    module = _module(SCAFFOLD, "disk", tmp_path / "state")
    module.attach_data(tiny_data())
    run_plain_rounds(module, 2)
    manifest = module.client_states.checkpoint_state(2)
    segment = Path(module.client_states.segment_directory) / manifest["segments"][0]["file"]
    clients, values = read_segment(str(segment), manifest["segments"][0]["sha256"])
    assert clients.tolist() == sorted(clients.tolist()) and clients.numel() == manifest["segments"][0]["rows"]
    assert torch.equal(values["c_i/0.weight"], module.client_states.gather(clients)["c_i"]["0.weight"])
    data = bytearray(segment.read_bytes())
    data[-1] ^= 0xFF
    segment.write_bytes(bytes(data))
    with pytest.raises(CheckpointDamagedError, match="is damaged: its SHA-256 is"):
        DiskClientStateStore.restore(manifest, tmp_path / "state")
    segment.unlink()
    with pytest.raises(CheckpointDamagedError, match="that this checkpoint references is missing"):
        DiskClientStateStore.restore(manifest, tmp_path / "state")


def test_bad_client_state_options_are_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model.client_state must be 'auto', 'memory' or 'disk', got 'ssd'"):
        FederatedModule(client_state="ssd")  # type: ignore[arg-type]
    a_file = tmp_path / "not_a_folder"
    a_file.write_text("x")
    module = _module(DITTO, "disk", a_file)
    with pytest.raises(ValueError, match="model.client_state_dir must be a folder, got .*which is a file"):
        module.attach_data(tiny_data())
    module = _module(DITTO, "disk", a_file / "below_a_file")
    with pytest.raises(ValueError, match="model.client_state_dir=.*below_a_file' is not a writable folder"):
        module.attach_data(tiny_data())
