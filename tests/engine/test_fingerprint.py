"""Fingerprints of whole runs: "nothing changed" measured, not hoped.

For every registered algorithm (the built-ins and installed plugins such as pFedMe), batched and looped, and for
runs with client dropout and over-selection, stragglers, robust rules, simulated attacks, DP (fixed and adaptive
clipping), per-client BatchNorm statistics and a FedOpt server optimizer, a short fit on tiny unequal clients
(two held out) is reduced to SHA-256 hashes of its exact numbers: the global parameters and buffers, the server
optimizer's state, every client's state and running statistics, the server state, the ``seen`` flags, the
per-client metric states and the logged summaries (training and validation). The file
``tests/engine/fingerprints.json`` stores them; a refactoring that claims to change no number must leave every hash as
it is.

Last bits differ between CPUs for the same torch release, so the file keeps one set per machine kind, keyed by a
hash of a small computation through the same kernels (:func:`kernel_canary`); on a machine whose kernels were never
fingerprinted the test skips and says how to take them (on the commit *before* a change, so the change is checked
against its parent's numbers). The set taken before canaries existed (its machine unknown) was dropped on
2026-11-29: the CI machine of that day (AVX-512 with AMX) reproduced none of its runs.

The numbers are read only through public interfaces (a checkpoint written by ``trainer.save_checkpoint`` and
``trainer.callback_metrics``), so the test needs no change when the code behind them moves.

Regenerate (only for a change that is meant to change numbers, and say so in the commit):
``FEDMETA_WRITE_FINGERPRINTS=1 python -m pytest tests/engine/test_fingerprint.py``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch import Tensor, nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.registry import list_algorithms

FINGERPRINTS = Path(__file__).with_name("fingerprints.json")
WRITE = os.environ.get("FEDMETA_WRITE_FINGERPRINTS") == "1"
ROUNDS = 4
NUM_CLIENTS = 8
FEATURES = 5
CLASSES = 3

#: hyper-parameters that make each algorithm do something on this tiny problem within a few rounds
ALGORITHMS: dict[str, dict[str, Any]] = {
    "fedavg": {},
    "fedprox": {"mu": 0.1},
    "scaffold": {},
    "reptile": {},
    "perfedavg": {"variant": "hf"},
    "perfedavg_fo": {"name": "perfedavg", "variant": "fo"},
    "perfedavg_exact": {"name": "perfedavg", "variant": "exact"},
    "fedmaml": {"alpha": 0.1},
    "perfedmaml": {},
    "mtl_mean": {},
    "ditto": {},
    "mtl_pairwise": {},
    "mtl_graph": {"knn": 2},
    "fedrep": {},
    "fedper": {},
    "mocha": {"local_iters": 20, "omega_every": 2},
    "ifca": {},
    "cfl": {"warmup_rounds": 0, "eps1": 10.0, "eps2": 0.0},
    "pfedme": {},
}
LINEAR_ONLY = {"mocha"}

#: runs with the reliability options, the BatchNorm path and a FedOpt server optimizer (module keyword arguments)
RELIABILITY: dict[str, dict[str, Any]] = {
    "dropout": {"client_dropout": 0.4, "over_selection": 0.5},
    "stragglers": {"local_steps_dist": {"distribution": "uniform", "low": 1, "high": 5}},
    "trimmed_mean": {"aggregator": {"name": "trimmed_mean", "beta": 0.2}, "clients_per_round": 5},
    "krum_sign_flip": {"aggregator": "krum", "byzantine": {"fraction": 0.2, "attack": "sign_flip"},
                       "clients_per_round": 5},
    "median_label_flip": {"aggregator": {"name": "median", "clip": 1.0},
                          "byzantine": {"fraction": 0.2, "attack": "label_flip"}, "clients_per_round": 5},
    "fednova_stragglers": {"aggregator": "fednova", "local_steps_dist": [1, 2, 3, 4, 5, 1, 2, 3]},
    "dp": {"dp": {"clip": 0.5, "noise_multiplier": 0.8, "delta": 1e-5, "adaptive_clip": False},
           "aggregation": "uniform"},
    "dp_adaptive": {"dp": {"clip": 0.5, "noise_multiplier": 0.3, "delta": 1e-5, "adaptive_clip": True},
                    "aggregation": "uniform", "clients_per_round": 4},
}


class _TinyClients:
    """Eight clients of a 3-class, 5-feature problem with unequal sizes (5 to 23 rows) and shifted features."""

    num_classes = CLASSES
    num_clients = NUM_CLIENTS

    def client_data(self) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
        g = torch.Generator().manual_seed(2024)
        w_true = torch.randn(FEATURES, CLASSES, generator=g)
        clients = []
        for i in range(NUM_CLIENTS):
            n, m = 5 + 6 * (i % 4) - (i % 3), 4 + (i % 2)
            shift = torch.randn(FEATURES, generator=g) * 0.5 * (i % 3)
            x = torch.randn(n + m, FEATURES, generator=g) + shift
            y = (x @ w_true + 0.3 * torch.randn(n + m, CLASSES, generator=g)).argmax(1)
            clients.append((x[:n], y[:n], x[n:], y[n:]))
        return clients


def _model(kind: str) -> nn.Module:
    torch.manual_seed(7)
    if kind == "linear":
        return nn.Linear(FEATURES, CLASSES)
    if kind == "batchnorm":
        return nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, CLASSES))
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, CLASSES))


def _installed() -> set[str]:
    return {entry.name for entry in list_algorithms()}


def _cases() -> list[tuple[str, dict[str, Any], dict[str, Any], str]]:
    """``(case id, algorithm spec, module keyword arguments, model kind)`` of every fingerprinted run."""
    cases = []
    for label, options in ALGORITHMS.items():
        spec = {"name": label, **options} if "name" not in options else dict(options)
        kind = "linear" if spec["name"] in LINEAR_ONLY else "mlp"
        for batching in ("vmap", "loop"):
            cases.append((f"{label}-{batching}", spec, {"client_batching": batching}, kind))
    for label, options in RELIABILITY.items():
        for batching in ("vmap", "loop"):
            cases.append((f"fedavg-{label}-{batching}", {"name": "fedavg"}, {"client_batching": batching, **options},
                          "mlp"))
    cases.append(("fedavg-batchnorm-loop", {"name": "fedavg"}, {"client_batching": "loop"}, "batchnorm"))
    cases.append(("ditto-batchnorm-loop", {"name": "ditto"}, {"client_batching": "loop"}, "batchnorm"))
    cases.append(("fedavg-fedadam-vmap", {"name": "fedavg"}, {"client_batching": "vmap", "server_optimizer":
                  lambda p: torch.optim.Adam(p, lr=0.05)}, "mlp"))
    cases.append(("scaffold-sgd-momentum-vmap", {"name": "scaffold"}, {"client_batching": "vmap", "server_optimizer":
                  lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9)}, "mlp"))
    return cases


def _hash_tensors(tree: Any) -> str:
    """SHA-256 of every tensor and number in a nested structure, with its path, dtype and shape."""
    digest = hashlib.sha256()

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(f"{prefix}/{key}", value[key])
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                walk(f"{prefix}/{i}", item)
        elif isinstance(value, Tensor):
            t = value.detach().cpu().contiguous().reshape(-1)
            digest.update(f"{prefix}:{t.dtype}:{tuple(t.shape)}".encode())
            digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(value, bool | int | float | str) or value is None:
            digest.update(f"{prefix}={value.hex() if isinstance(value, float) else value!r}".encode())

    walk("", tree)
    return digest.hexdigest()[:24]


def _fingerprint(spec: dict[str, Any], options: dict[str, Any], kind: str, root: Path) -> dict[str, str]:
    module = FederatedModule(
        model=_model(kind), algorithm=spec, clients_per_round=options.pop("clients_per_round", 3),
        holdout_clients=2, seed=11, compile_clients=False, client_state="memory", **options,
    )
    datamodule = FederatedDataModule(dataset=_TinyClients(), eval_every=2)
    trainer = L.Trainer(
        max_steps=ROUNDS, max_epochs=-1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
    )
    trainer.fit(module, datamodule)
    trainer.save_checkpoint(root / "end.ckpt")
    checkpoint = torch.load(root / "end.ckpt", weights_only=True, map_location="cpu")
    parts = checkpoint["fedmeta"]  # one key per part (frontends/checkpoint_layout.py); the values are those of old
    saved = {**parts["engine"], **parts["engine"]["federation"], **parts["evaluator"]}
    summaries = {key: float(value) for key, value in trainer.callback_metrics.items()}
    return {
        "model": _hash_tensors(checkpoint["state_dict"]),
        "optimizer": _hash_tensors([s["state"] for s in checkpoint["optimizer_states"]]),
        "client_state": _hash_tensors(saved["client_state"]),
        "client_buffers": _hash_tensors(saved["client_buffers"]),
        "server_state": _hash_tensors(saved["server_state"]),
        "seen": _hash_tensors(saved["seen"]),
        "metric_state": _hash_tensors(saved["metric_state"]),
        "summaries": _hash_tensors(summaries),
    }


def kernel_canary() -> str:
    """A hash of a small computation through the kernels these runs use (an MLP's loss and gradient, looped and
    under ``vmap``, one thread): the same torch release gives other last bits on other CPUs (this project's machines
    differ in their vector units and BLAS paths), so fingerprints are kept per canary, and a machine whose kernels
    were never fingerprinted is told so instead of failing every run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(5)
        w1, w2 = torch.randn(FEATURES, 8, generator=g), torch.randn(8, CLASSES, generator=g)
        x, y = torch.randn(4, 11, FEATURES, generator=g), torch.randint(0, CLASSES, (4, 11), generator=g)

        def loss(a: Tensor, b: Tensor, xs: Tensor, ys: Tensor) -> Tensor:
            return torch.nn.functional.cross_entropy(torch.relu(xs @ a) @ b, ys)

        batched = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(None, None, 0, 0))(w1, w2, x, y)
        looped = [torch.func.grad(loss, argnums=(0, 1))(w1, w2, x[i], y[i]) for i in range(4)]
        return _hash_tensors({"batched": list(batched), "looped": looped, "adam": _adam_canary()})
    finally:
        torch.set_num_threads(threads)


def _adam_canary() -> Tensor:
    p = torch.nn.Parameter(torch.linspace(-1, 1, 7))
    opt = torch.optim.Adam([p], lr=0.05)
    for _ in range(3):
        p.grad = torch.sin(p.detach() * 3)
        opt.step()
    return p.detach()


def _stored() -> dict[str, Any]:
    return json.loads(FINGERPRINTS.read_text()) if FINGERPRINTS.exists() else {"environments": {}}


def _environment(stored: dict[str, Any], canary: str) -> dict[str, Any]:
    return stored.setdefault("environments", {}).setdefault(canary, {"runs": {}})


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c[0])
def test_run_fingerprint_is_unchanged(case: tuple[str, dict[str, Any], dict[str, Any], str], tmp_path: Path) -> None:
    label, spec, options, kind = case
    if spec["name"] not in _installed():
        pytest.skip(f"algorithm {spec['name']!r} is not installed (pip install ./plugins/fedmeta-pfedme)")
    stored = _stored()
    canary = kernel_canary()
    env = stored.get("environments", {}).get(canary)
    if not WRITE and env is None:
        pytest.skip(f"no fingerprints were taken on a machine with this one's kernels (canary {canary}, torch "
                    f"{torch.__version__}, {platform.machine()}, {torch.backends.cpu.get_cpu_capability()}): take them "
                    "on the commit before a change (see the module docstring), then check the change against them")
    if not WRITE and env.get("torch") != torch.__version__:
        pytest.skip(f"fingerprints were taken with torch {env.get('torch')}, this is {torch.__version__}: "
                    "kernels differ between releases")
    threads, lightning_log = torch.get_num_threads(), logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    torch.set_num_threads(1)  # one intra-op thread: reductions in one fixed order
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lightning_log.setLevel(logging.WARNING)
            got = _fingerprint(dict(spec), dict(options), kind, tmp_path)
    finally:
        torch.set_num_threads(threads)
        lightning_log.setLevel(level)  # other tests read Lightning's info lines
    if WRITE:
        stored = _stored()
        env = _environment(stored, canary)
        env.update({"torch": torch.__version__, "machine": platform.machine(),
                    "cpu": torch.backends.cpu.get_cpu_capability()})
        env["runs"][label] = got
        env["runs"] = dict(sorted(env["runs"].items()))
        stored["regenerate"] = "FEDMETA_WRITE_FINGERPRINTS=1 python -m pytest tests/engine/test_fingerprint.py"
        FINGERPRINTS.write_text(json.dumps(stored, indent=1) + "\n")
        return
    assert label in env["runs"], f"no stored fingerprint for {label}: regenerate (see the module docstring)"
    want = env["runs"][label]
    changed = sorted(part for part in want if want[part] != got.get(part))
    assert not changed, f"{label}: these numbers changed: {changed}"
