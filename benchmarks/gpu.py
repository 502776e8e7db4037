"""The GPU benchmark (issue 29): one prepared script, about 8 minutes on one GPU, through the public API.

Sections (each failure is recorded with its traceback and the others still run; results are written after every
section, so a run stopped by its time limit still leaves what it finished):

1. ``equivalence``: loop == vmap on the device for FedAvg, Per-FedAvg HF and Ditto
   (:func:`benchmarks.gpu_check.check_equivalence`; flag: relative difference above 1e-5).
2. ``precision``: ``bf16-mixed`` and ``16-mixed`` against ``32-true`` for a meta-learning algorithm (Per-FedAvg HF)
   and a regularised one (Ditto): finite losses and parameters, final loss and validation accuracy.
3. ``speed``: FedAvg rounds per second and peak GPU memory for three workloads at 10, 100 and 1000 clients per
   round, the project's default batched path against a plain PyTorch per-client loop on the same device (a fresh
   ``nn.Module`` copy and ``torch.optim.SGD`` per client, data already in device memory: the best a hand-written
   loop does), with the GPU utilisation sampled by ``nvidia-smi`` during the timed rounds:

   * ``W``: MLP 784-80-60-10 (ELU), τ = 10 steps of batch 40 (benchmarks/speed.py's workload);
   * ``CNN``: PFLlib's FedAvgCNN on 1×28×28, τ = 20 steps of batch 10;
   * ``ResNet-18``: GroupNorm, 3×32×32 (torchvision stem), τ = 5 steps of batch 32.

   The plain loop is timed on at most ``--loop-clients`` clients per round and scaled linearly to the row's
   clients (it is a sequence of independent clients; the rows say when they are scaled).

    python3 -m pip install --no-deps --no-build-isolation --no-index -e .   # on the GPU machine: the entry points
    python benchmarks/gpu.py --out OUTDIR                       # on the GPU machine (writes gpu.json, gpu.md)
    python benchmarks/gpu.py --device cpu --quick --out /tmp/g   # the script itself on the CPU (tests)

On the CPU the CUDA-only parts (16-bit precisions, peak memory, utilisation) are skipped with the reason.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import multiprocessing
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_check import (  # noqa: E402
    RandomImages,
    check_equivalence,
    environment,
    error,
    fit,
    fmt,
    run_check,
    small_mlp,
    synthetic_dm,
    val_summary,
    w_mlp,
)
from lightning_fedmeta.data import FederatedDataModule  # noqa: E402
from lightning_fedmeta.models.reference import FedAvgCNN, ResNet18  # noqa: E402
from lightning_fedmeta.registry import list_algorithms  # noqa: E402


@dataclass(frozen=True)
class Workload:
    """A speed row's model and local work: ``steps`` SGD steps of ``batch`` samples per client per round."""

    build: Callable[[], nn.Module]
    shape: tuple[int, ...]
    classes: int
    steps: int
    batch: int
    lr: float


WORKLOADS: dict[str, Workload] = {
    "W": Workload(w_mlp, (1, 28, 28), 10, 10, 40, 0.001),
    "CNN": Workload(lambda: FedAvgCNN(1, 10, 28), (1, 28, 28), 10, 20, 10, 0.01),
    "ResNet-18": Workload(lambda: ResNet18(10, 3, norm="group"), (3, 32, 32), 10, 5, 32, 0.01),
}


def quick_workloads() -> dict[str, Workload]:
    """The same models on tiny work (one step of 4 samples; ResNet-18 on 16×16): a smoke run of the script."""
    out = {name: replace(w, steps=1, batch=4) for name, w in WORKLOADS.items()}
    out["ResNet-18"] = replace(out["ResNet-18"], shape=(3, 16, 16))
    return out

#: clients per vmap call, tried in order while the GPU runs out of memory (100 is FederatedModule's default)
CHUNK_SIZES = (100, 25)

PRECISION_ALGORITHMS = [
    ("Per-FedAvg HF", {"name": "perfedavg", "variant": "hf", "alpha": 0.01, "beta": 0.01}),
    ("Ditto", {"name": "ditto", "lam": 0.1}),
]


class UtilisationSampler:
    """``nvidia-smi`` sampled every 100 ms in a thread; each sample stamped with ``time.perf_counter()`` on arrival."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []  # (time, utilisation %, memory used MiB)
        self.proc: subprocess.Popen[str] | None = None
        self.thread: threading.Thread | None = None

    def __enter__(self) -> UtilisationSampler:
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                 "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return self
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = [p.strip() for p in line.split(",")]
            try:
                self.samples.append((time.perf_counter(), float(parts[0]), float(parts[1])))
            except (ValueError, IndexError):
                continue

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=5)

    def mean_between(self, start: float, end: float) -> float | None:
        """Mean utilisation (%) of the samples taken in ``[start, end]``; ``None`` without samples."""
        inside = [u for t, u, _ in self.samples if start <= t <= end]
        return statistics.fmean(inside) if inside else None


# ------------------------------------------------------------------------------------------------
# the plain loop: what a hand-written PyTorch round does
# ------------------------------------------------------------------------------------------------
def plain_loop_round(model: nn.Module, xs: torch.Tensor, ys: torch.Tensor, clients: int, steps: int,
                     batch: int, lr: float, generator: torch.Generator) -> None:
    """One FedAvg round written by hand: per client a fresh copy and ``torch.optim.SGD``, ``steps`` mini-batches
    drawn without replacement from its rows (``xs [K, n, ...]`` on the device), then the mean of the models."""
    total = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    for c in range(clients):
        local = copy.deepcopy(model)
        opt = torch.optim.SGD(local.parameters(), lr=lr)
        for _ in range(steps):
            idx = torch.randperm(xs.shape[1], generator=generator)[:batch].to(xs.device)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(local(xs[c % xs.shape[0], idx]), ys[c % xs.shape[0], idx]).backward()
            opt.step()
        for k, v in local.state_dict().items():
            total[k] += v
    model.load_state_dict({k: v / clients for k, v in total.items()})


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_plain_loop(device: str, work: Workload, clients: int, loop_clients: int, rounds: int,
                    data: RandomImages) -> dict[str, Any]:
    """Median seconds per round of :func:`plain_loop_round` on ``min(clients, loop_clients)`` clients, scaled."""
    build, steps, batch, lr = work.build, work.steps, work.batch, work.lr
    timed_clients = min(clients, loop_clients)
    xs = torch.stack([c[0] for c in data.clients[:timed_clients]]).to(device)
    ys = torch.stack([c[1] for c in data.clients[:timed_clients]]).to(device)
    torch.manual_seed(0)
    model = build().to(device)
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        plain_loop_round(model, xs, ys, timed_clients, steps, batch, lr, g)
        _sync(device)
        times.append(time.perf_counter() - t0)
    per_round = statistics.median(times[1:] if len(times) > 1 else times) * clients / timed_clients
    return {"s_per_round": per_round, "timed_clients": timed_clients, "scaled": timed_clients != clients}


def time_project(device: str, work: Workload, clients: int, rounds: int, data: RandomImages,
                 chunk: int) -> dict[str, Any]:
    """The project's default path (FederatedModule, vmap, eager, ``chunk`` clients per vmap call) on the workload:
    median s/round after one warm-up round, peak memory, utilisation during the timed rounds."""
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    L.seed_everything(0, verbose=False)
    dm = FederatedDataModule(dataset=data, num_clients=len(data.clients), eval_every=10**6)
    algorithm = {"name": "fedavg", "local_steps": work.steps, "batch_size": work.batch, "local_lr": work.lr}
    with UtilisationSampler() as sampler:
        _, _, timer = fit(device, work.build(), algorithm, dm, rounds, clients, "vmap", validate=False,
                          client_chunk_size=chunk)
    timed = timer.times[1:] if len(timer.times) > 1 else timer.times
    row: dict[str, Any] = {"s_per_round": statistics.median(timed), "first_round_s": timer.times[0],
                           "client_chunk_size": chunk, "final_loss": timer.losses[-1] if timer.losses else None}
    if device == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if len(timer.starts) > 1:
            row["gpu_utilisation"] = sampler.mean_between(timer.starts[1], timer.starts[-1] + timer.times[-1])
    return row


def _isolated_project_row(device: str, workload: str, quick: bool, clients: int, rounds: int, train: int,
                          chunk: int) -> dict[str, Any]:
    """:func:`time_project` in a fresh process (its own data, same seed): a row that runs out of GPU memory leaves
    nothing behind for the next attempt or row."""
    warnings.filterwarnings("ignore")
    work = (quick_workloads() if quick else WORKLOADS)[workload]
    data = RandomImages(clients, work.shape, work.classes, train=train)
    return time_project(device, work, clients, rounds, data, chunk)


def project_row(device: str, workload: str, quick: bool, clients: int, rounds: int, data: RandomImages,
                isolate: bool) -> dict[str, Any]:
    """The project's row at the default chunk of clients, then at smaller ones while the GPU runs out of memory
    (:data:`CHUNK_SIZES`); on CUDA each attempt runs in a fresh process (``isolate``)."""
    train = data.clients[0][0].shape[0]
    for chunk in CHUNK_SIZES:
        try:
            if not isolate:
                work = (quick_workloads() if quick else WORKLOADS)[workload]
                return time_project(device, work, clients, rounds, data, chunk)
            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
                return pool.submit(_isolated_project_row, device, workload, quick, clients, rounds, train,
                                   chunk).result()
        except torch.OutOfMemoryError:
            if chunk == CHUNK_SIZES[-1]:
                raise
    raise AssertionError("unreachable: the last chunk size returns or raises")


def check_speed(device: str, names: list[str], quick: bool, clients_list: list[int], rounds: int, loop_clients: int,
                deadline: float, train: int) -> list[dict[str, Any]]:
    rows = []
    workloads = quick_workloads() if quick else WORKLOADS
    for workload in names:
        work = workloads[workload]
        data = RandomImages(max(clients_list), work.shape, work.classes, train=train)
        for clients in clients_list:
            row: dict[str, Any] = {"workload": workload, "clients_per_round": clients, "device": device}
            if time.perf_counter() > deadline:
                row["skipped"] = "time budget of the run spent"
                rows.append(row)
                continue
            try:
                row["project"] = project_row(device, workload, quick, clients, rounds, data, isolate=device == "cuda")
                row["plain_loop"] = time_plain_loop(device, work, clients, loop_clients, min(rounds, 3), data)
                row["loop_over_project"] = row["plain_loop"]["s_per_round"] / row["project"]["s_per_round"]
            except Exception as exc:  # noqa: BLE001 - recorded, the other rows go on
                row.update(error(exc))
            print(f"[speed] {json.dumps({k: v for k, v in row.items() if k != 'traceback'})}", flush=True)
            rows.append(row)
    return rows


def _precision_row(row: dict[str, Any], device: str, spec: dict[str, Any], precision: str, rounds: int,
                   num_clients: int, per_round: int) -> None:
    """One algorithm at one precision: its final loss, whether everything stayed finite, and its accuracy."""
    L.seed_everything(0, verbose=False)
    module, t, timer = fit(device, small_mlp(), spec, synthetic_dm(num_clients, rounds), rounds,
                           per_round, "vmap", precision=precision)
    assert module.model is not None
    val = val_summary(t)
    key = next((k for k in val if k.endswith("acc_weighted")), None)
    row.update(final_loss=timer.losses[-1] if timer.losses else None,
               finite=bool(timer.losses) and all(math.isfinite(x) for x in timer.losses)
               and all(bool(torch.isfinite(p).all()) for p in module.model.parameters()),
               accuracy=val.get(key) if key else None)


def check_precisions(device: str, rounds: int, num_clients: int, per_round: int) -> list[dict[str, Any]]:
    """Each algorithm of :data:`PRECISION_ALGORITHMS` at 32-true, bf16-mixed and 16-mixed (the last two on CUDA)."""
    rows = []
    precisions = ["32-true", "bf16-mixed", "16-mixed"] if device == "cuda" else ["32-true"]
    for label, spec in PRECISION_ALGORITHMS:
        for precision in precisions:
            row: dict[str, Any] = {"algorithm": label, "precision": precision, "rounds": rounds}
            fill = functools.partial(_precision_row, device=device, spec=spec, precision=precision, rounds=rounds,
                                     num_clients=num_clients, per_round=per_round)
            rows.append(run_check("[precision]", row, fill, flag_errors=False))
    if device != "cuda":
        rows.append({"skipped": "bf16-mixed and 16-mixed are CUDA checks: skipped on the CPU"})
    return rows


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def _speed_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| workload | clients/round | chunk | project s/round | rounds/s | peak GiB | GPU util % "
             "| plain loop s/round | plain ÷ project |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['workload']} | {r['clients_per_round']} |"
        if "skipped" in r or "error" in r:
            lines.append(f"{head} {r.get('skipped') or 'ERROR: ' + r['error'][:150]} | | | | | | |")
            continue
        p, q = r["project"], r["plain_loop"]
        scaled = f" (scaled from {q['timed_clients']})" if q["scaled"] else ""
        lines.append(f"{head} {p.get('client_chunk_size')} | {p['s_per_round']:.4f} | {1 / p['s_per_round']:.2f} | "
                     f"{fmt(p.get('peak_memory_gib'))} | {fmt(p.get('gpu_utilisation'))} | "
                     f"{q['s_per_round']:.3f}{scaled} | "
                     f"{r['loop_over_project']:.1f}× |")
    return lines


def _precision_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| algorithm | precision | final loss | finite | val accuracy (weighted) | s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['skipped']} | | | | | |")
        elif "error" in r:
            lines.append(f"| {r['algorithm']} | {r['precision']} | ERROR: {r['error'][:150]} | | | |")
        else:
            lines.append(f"| {r['algorithm']} | {r['precision']} | {fmt(r['final_loss'], '.4f')} | {r['finite']} | "
                         f"{fmt(r['accuracy'], '.4f')} | {r['seconds']} |")
    return lines


def markdown(res: dict[str, Any]) -> str:
    env = res["environment"]
    lines = ["# GPU benchmark (benchmarks/gpu.py)", "", f"Command: `{res['command']}`  ",
             f"Total: {res['total_seconds']:.1f} s  ",
             f"Device: {env.get('gpu') or 'CPU'} ({env.get('gpu_memory_gib')} GiB), torch {env['torch']} "
             f"(CUDA {env['torch_cuda']}), lightning {env['lightning']}, {env['cpu_threads']} CPU threads", ""]
    if "equivalence" in res:
        lines += ["## 1. loop == vmap (eager, same seed; flag: relative difference > 1e-5)", "",
                  "| algorithm | params rel | val rel | flag |", "|---|---|---|---|"]
        for r in res["equivalence"]:
            if "error" in r:
                lines.append(f"| {r['algorithm']} | ERROR: {r['error'][:150]} | | FLAG |")
            else:
                lines.append(f"| {r['algorithm']} | {r['params']['rel']:.2e} | {r['val']['rel']:.2e} | "
                             f"{'FLAG' if r['flag'] else 'ok'} |")
        lines.append("")
    if "precision" in res:
        lines += ["## 2. Mixed precision (synthetic data, small MLP)", ""] + _precision_lines(res["precision"]) + [""]
    if "speed" in res:
        lines += ["## 3. Speed: FedAvg, the default batched path (vmap, eager) vs a plain per-client PyTorch loop",
                  "", "W: MLP 784-80-60-10, τ = 10, B = 40. CNN: FedAvgCNN 1×28×28, τ = 20, B = 10. ResNet-18: "
                  "GroupNorm, 3×32×32, τ = 5, B = 32. Median of the timed rounds after one warm-up round; "
                  "utilisation: mean of nvidia-smi samples during the timed rounds.", ""]
        lines += _speed_lines(res["speed"]) + [""]
    failures = res.get("failures", [])
    return "\n".join(lines + ["## Flags", ""] + ([f"- {f}" for f in failures] or ["- none"]) + [""])


def collect_failures(res: dict[str, Any]) -> list[str]:
    out = [f"equivalence {r['algorithm']}: {r.get('error') or 'relative difference above 1e-5'}"
           for r in res.get("equivalence", []) if r.get("flag")]
    out += [f"precision {r['algorithm']} {r['precision']}: {r.get('error') or 'not finite'}"
            for r in res.get("precision", []) if "algorithm" in r and ("error" in r or not r.get("finite"))]
    out += [f"speed {r['workload']} {r['clients_per_round']}: {r['error']}" for r in res.get("speed", [])
            if "error" in r]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of the script itself")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds after which speed rows are skipped")
    parser.add_argument("--loop-clients", type=int, default=50, help="most clients the plain loop is timed on")
    parser.add_argument("--sections", nargs="+", default=["equivalence", "precision", "speed"],
                        choices=["equivalence", "precision", "speed"], help="the sections to run")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS),
                        help="the speed section's workloads")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; use --device cpu for a smoke run")
    if not any(entry.name == "fedavg" for entry in list_algorithms()):
        parser.error("no algorithm is registered: the entry points come from the installed package; run "
                     "`python3 -m pip install --no-deps --no-build-isolation --no-index -e .` first")
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"command": " ".join(["benchmarks/gpu.py", *(argv if argv is not None else sys.argv[1:])]),
                           "environment": environment(args.device), "device": args.device}
    quick = args.quick
    sections = [
        ("equivalence", lambda: check_equivalence(args.device, 2 if quick else 3, 6 if quick else 30,
                                                  3 if quick else 10)),
        ("precision", lambda: check_precisions(args.device, 1 if quick else 20, 6 if quick else 30,
                                               3 if quick else 10)),
        ("speed", lambda: check_speed(args.device, args.workloads, quick,
                                      [2, 3] if quick else [10, 100, 1000], 2 if quick else 4,
                                      2 if quick else args.loop_clients, start + args.budget, 12 if quick else 64)),
    ]
    for name, run in sections:
        if name not in args.sections:
            continue
        try:
            res[name] = run()
        except Exception as exc:  # noqa: BLE001 - recorded; the report is still written
            res[name + "_error"] = error(exc)
        res["total_seconds"] = time.perf_counter() - start
        res["failures"] = collect_failures(res)
        (args.out / "gpu.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
        (args.out / "gpu.md").write_text(markdown(res))
    return res


if __name__ == "__main__":
    main()
