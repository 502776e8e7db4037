"""Speed benchmark of lightning_fedmeta on workload W (the Per-FedAvg paper's configuration).

Workload W: MLP 784-80-60-10 with ELU (68,270 parameters), Fashion-MNIST split with the
``perfedavg_paper`` partition over K = 50 clients, |S| = 10 clients per round, τ = 10 local steps,
batch B = 40, on the CPU threads torch is given (``torch.get_num_threads()`` unless ``--threads``).

What one run measures (printed, and written to ``benchmarks/results/speed.md``):

* GEMM throughput of this machine at the model's shapes: the batched matmuls of one forward and
  backward pass of C clients at once, ``[C, B, n_in] × [C, n_in, n_out]`` (forward),
  ``[C, n_out, B] × [C, B, n_in]`` (weight gradient) and ``[C, B, n_out] × [C, n_out, n_in]`` (input
  gradient, not for the first layer), timed with ``torch.bmm``; GFLOP/s = Σ 2·m·n·k / Σ time.
* GEMM FLOPs of one round of each algorithm: ``torch.utils.flop_counter.FlopCounterMode`` around
  ``FederatedModule.compute_round`` (it counts matmul-like ops only, which is what the floor is about).
* The GEMM floor of a round: FLOPs / measured GEMM throughput; the table shows ms/round ÷ floor.
* Median ms per training round, looped and ``vmap``-ed clients. A round is timed WITHOUT the
  Trainer: :func:`run_round` does what ``FederatedModule.training_step`` does minus Lightning's
  logging — ``compute_round`` (sampling, batch gathering, client updates), the finiteness checks,
  ``algorithm.aggregate``, the pseudo-gradient step of ``torch.optim.SGD(lr=1)`` and the client
  state scatter. The first ``warmup`` rounds are not timed.
* Data share: median ms of the round's mini-batch gathering alone (``draw_batch_indices`` + index
  gather), i.e. the part of a round spent before any client computes.
* Median ms of one personalised evaluation of all 50 clients (``evaluate_clients`` with one
  adaptation step of batch 40, vmap path).
* Peak resident memory of each algorithm's measurement (Linux: ``VmHWM`` after resetting it
  through ``/proc/self/clear_refs``; elsewhere the process peak of ``resource.getrusage``).

Options add: ms/round versus clients per round (10, 50, 100, 500 on synthetic data of W's shapes,
1000 clients) for FedAvg and Per-FedAvg HF with a log-log PNG (``--scaling``); a τ sweep showing a
round's cost is linear in τ (``--tau 1 5 10 20``); peak RSS of Ditto with 1000 clients holding
personal models, 100 per round, in a fresh subprocess (``--ditto-rss``).

    python benchmarks/speed.py --quick                  # smoke run, < 60 s
    python benchmarks/speed.py --all                    # the full measurement (see benchmarks/README.md)

Algorithms whose entry point fails to load (or whose constructor rejects W's hyper-parameters)
are listed as skipped with the reason, and the others still run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import logging
import math
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu import WORKLOADS, Workload, plain_loop_round, quick_workloads  # noqa: E402
from lightning_fedmeta import FederatedModule  # noqa: E402
from lightning_fedmeta.algorithms.base import Algorithm  # noqa: E402
from lightning_fedmeta.data.federated import FederatedData  # noqa: E402
from lightning_fedmeta.models.reference import MLP  # noqa: E402
from lightning_fedmeta.registry import load_algorithm  # noqa: E402

__all__ = [
    "ALGORITHMS",
    "AlgorithmResult",
    "GemmResult",
    "build_algorithm",
    "gemm_throughput",
    "load_workload",
    "make_module",
    "measure_algorithm",
    "peak_rss_mb",
    "reset_peak_rss",
    "round_flops",
    "run_round",
    "synthetic_data",
    "time_rounds",
]

RESULTS = Path(__file__).resolve().parent / "results"
LAYERS = (784, 80, 60, 10)
BATCH = 40
TAU = 10
NUM_CLIENTS = 50
CLIENTS_PER_ROUND = 10
LR = 0.001

#: (label, algorithm spec) of workload W; W's shared hyper-parameters are added by build_algorithm.
ALGORITHMS: list[tuple[str, dict[str, Any]]] = [
    ("FedAvg", {"name": "fedavg", "local_lr": LR}),
    ("FedProx", {"name": "fedprox", "local_lr": LR, "mu": 0.01}),
    ("SCAFFOLD", {"name": "scaffold", "local_lr": LR}),
    ("Per-FedAvg FO", {"name": "perfedavg", "variant": "fo", "alpha": LR, "beta": LR}),
    ("Per-FedAvg HF", {"name": "perfedavg", "variant": "hf", "alpha": LR, "beta": LR}),
    ("Per-FedAvg exact", {"name": "perfedavg", "variant": "exact", "alpha": LR, "beta": LR}),
    ("Reptile", {"name": "reptile", "alpha": LR}),
    ("FedMAML", {"name": "fedmaml", "alpha": LR}),
    ("Ditto", {"name": "ditto", "local_lr": LR, "lam": 0.1}),
]

#: the targets of the speed issue on W: the default path within this factor of the GEMM floor for these
#: algorithms, with a first-round overhead under 10 s on a cold cache; evaluation of the 50 clients ≤ 15 ms
FLOOR_TARGET = 2.0
FLOOR_TARGET_ALGORITHMS = ("FedAvg", "Per-FedAvg FO", "Per-FedAvg HF")
EVAL_TARGET_MS = 15.0


# ------------------------------------------------------------------------------------------------
# memory
# ------------------------------------------------------------------------------------------------
def _vm_hwm_kb() -> int | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    match = re.search(r"VmHWM:\s+(\d+)\s+kB", text)
    return int(match.group(1)) if match else None


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux ≥ 4.0); False where impossible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_mb() -> float:
    """Peak resident set size since the last :func:`reset_peak_rss` (MiB); the process peak
    (``resource.getrusage``) where ``/proc`` is not available."""
    kb = _vm_hwm_kb()
    if kb is None:
        usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        kb = usage // 1024 if sys.platform == "darwin" else usage
    return kb / 1024.0


# ------------------------------------------------------------------------------------------------
# data and modules
# ------------------------------------------------------------------------------------------------
def load_workload(num_clients: int = NUM_CLIENTS) -> FederatedData:
    """Fashion-MNIST on the ``perfedavg_paper`` split (W's data)."""
    from lightning_fedmeta.data import FederatedDataModule

    dm = FederatedDataModule(dataset="fashion_mnist", partition="perfedavg_paper", num_clients=num_clients)
    dm.setup("fit")
    assert dm.federated_data is not None
    return dm.federated_data


def synthetic_data(
    num_clients: int, train_per_client: int = 60, test_per_client: int = 20, seed: int = 0
) -> FederatedData:
    """Random data with W's shapes (1×28×28 inputs, 10 classes), equal-sized clients.

    Speed depends on shapes only, so this stands in for Fashion-MNIST where W's 50-client split
    cannot provide the clients (500 per round needs K ≥ 500).
    """
    g = torch.Generator().manual_seed(seed)
    n, m = num_clients * train_per_client, num_clients * test_per_client
    return FederatedData(
        torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g),
        torch.arange(num_clients + 1) * train_per_client,
        torch.rand(m, 1, 28, 28, generator=g), torch.randint(0, 10, (m,), generator=g),
        torch.arange(num_clients + 1) * test_per_client, 10,
    )


def build_algorithm(spec: dict[str, Any], tau: int = TAU, batch_size: int = BATCH) -> Algorithm:
    """Instantiate ``spec`` with W's shared settings (τ, B, one adaptation step of batch B).

    Only the shared settings the algorithm's constructor accepts are passed, so an algorithm
    without e.g. ``finetune_batch_size`` still builds. Raises if the entry point fails to load.
    """
    args = dict(spec)
    cls = load_algorithm(args.pop("name"))
    accepted = set(inspect.signature(cls.__init__).parameters)
    shared = {"local_steps": tau, "batch_size": batch_size, "finetune_steps": 1, "finetune_batch_size": batch_size}
    args.update({k: v for k, v in shared.items() if k in accepted})
    return cls(**args)


def make_module(
    algorithm: Algorithm, data: FederatedData, clients_per_round: int, batching: str = "vmap",
    chunk_size: int | None = 100, compile_clients: bool = False, model: torch.nn.Module | None = None,
) -> tuple[FederatedModule, torch.optim.Optimizer]:
    """A FederatedModule on ``data`` with ``model`` (default W's MLP) and the server optimizer ``SGD(lr=server_lr)``.

    ``server_lr`` is 1 (model averaging) except for FedMAML, whose clients upload meta-gradients:
    its server rate is β = ``LR``.
    """
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = FederatedModule(
            model=model if model is not None else MLP(LAYERS[0], list(LAYERS[1:-1]), LAYERS[-1], "elu"),
            algorithm=algorithm,
            clients_per_round=clients_per_round, client_batching=batching,  # type: ignore[arg-type]
            client_chunk_size=chunk_size, server_lr=LR if algorithm.name == "fedmaml" else 1.0,
            compile_clients=compile_clients,
        )
    module.attach_data(data)
    assert module.model is not None
    return module, torch.optim.SGD(module.model.parameters(), lr=module.server_lr)


def run_round(module: FederatedModule, opt: torch.optim.Optimizer, round_idx: int) -> None:
    """One training round as ``FederatedModule.training_step`` runs it (the round engine), without the Trainer."""
    module.engine.run_round(round_idx, opt)


#: the clock of every timing: wall time (``time.perf_counter``) by default; ``--clock cpu`` switches to
#: this process's CPU time (``time.process_time``), which other processes' load barely disturbs
#: (use it with ``--threads 1`` on a shared machine: with n threads it sums their CPU time).
CLOCK: Callable[[], float] = time.perf_counter


def _median_ms(fn: Callable[[int], Any], warmup: int, repeats: int, start: int = 0) -> float:
    for i in range(warmup):
        fn(start + i)
    times = []
    for i in range(repeats):
        t0 = CLOCK()
        fn(start + warmup + i)
        times.append(CLOCK() - t0)
    return 1e3 * statistics.median(times)


def time_rounds(module: FederatedModule, opt: torch.optim.Optimizer, warmup: int, repeats: int) -> float:
    """Median ms per :func:`run_round` after ``warmup`` untimed rounds."""
    return _median_ms(lambda r: run_round(module, opt, r), warmup, repeats)


def time_data(module: FederatedModule, warmup: int, repeats: int) -> float:
    """Median ms of a round's mini-batch gathering alone (sampling + draw_batch_indices + index gather)."""
    from lightning_fedmeta.client.sampling import sample_clients

    plan = module.algorithm.round_plan()

    def gather(r: int) -> None:
        sampled = sample_clients(module.seed, r, module.eligible, module.num_sampled)
        module._batches("train", r, sampled, plan)

    return _median_ms(gather, warmup, repeats)


def time_evaluation(module: FederatedModule, warmup: int, repeats: int) -> float:
    """Median ms of the personalised evaluation of every client."""
    assert module.data is not None
    clients = torch.arange(module.data.num_clients)
    was_training = module.model.training  # type: ignore[union-attr]
    module.model.eval()  # type: ignore[union-attr]
    try:
        return _median_ms(lambda r: module.evaluate_clients(clients, r), warmup, repeats)
    finally:
        module.model.train(was_training)  # type: ignore[union-attr]


def round_flops(module: FederatedModule, round_idx: int = 0) -> int:
    """GEMM FLOPs (matmul-like ops: mm, addmm, bmm) of one ``compute_round``."""
    with FlopCounterMode(display=False) as counter:
        module.compute_round(round_idx)
    return int(counter.get_total_flops())


# ------------------------------------------------------------------------------------------------
# GEMM floor
# ------------------------------------------------------------------------------------------------
@dataclass
class GemmResult:
    """Measured fp32 GEMM throughput at the model's shapes for ``clients`` clients at once."""

    clients: int
    per_shape: list[tuple[str, float]] = field(default_factory=list)  # (shape, GFLOP/s)
    gflops: float = 0.0  # Σ FLOPs / Σ time over one forward+backward step


def _gemm_shapes(clients: int, batch: int) -> list[tuple[str, tuple[int, int, int]]]:
    """(label, (m, k, n)) of every matmul of one forward+backward pass of the MLP on ``batch`` rows."""
    shapes = []
    for i, (n_in, n_out) in enumerate(zip(LAYERS[:-1], LAYERS[1:], strict=True)):
        shapes.append((f"fwd  [{clients}x{batch},{n_in}]x[{n_in},{n_out}]", (batch, n_in, n_out)))
        shapes.append((f"dW   [{clients}x{n_out},{batch}]x[{batch},{n_in}]", (n_out, batch, n_in)))
        if i > 0:
            shapes.append((f"dX   [{clients}x{batch},{n_out}]x[{n_out},{n_in}]", (batch, n_out, n_in)))
    return shapes


def gemm_throughput(clients: int, batch: int = BATCH, min_time: float = 0.2) -> GemmResult:
    """Time ``torch.bmm`` at every matmul shape of one client step (``clients`` clients batched)."""
    result = GemmResult(clients)
    total_flops, total_time = 0.0, 0.0
    for label, (m, k, n) in _gemm_shapes(clients, batch):
        a, b = torch.randn(clients, m, k), torch.randn(clients, k, n)
        for _ in range(5):
            torch.bmm(a, b)
        reps, elapsed = 0, 0.0
        samples = []
        while elapsed < min_time or reps < 20:
            t0 = CLOCK()
            for _ in range(10):
                torch.bmm(a, b)
            dt = (CLOCK() - t0) / 10
            samples.append(dt)
            elapsed += dt * 10
            reps += 1
        per_call = statistics.median(samples)
        flops = 2.0 * clients * m * k * n
        result.per_shape.append((label, flops / per_call / 1e9))
        total_flops += flops
        total_time += per_call
    result.gflops = total_flops / total_time / 1e9
    return result


# ------------------------------------------------------------------------------------------------
# per-algorithm measurement
# ------------------------------------------------------------------------------------------------
@dataclass
class AlgorithmResult:
    label: str
    skipped: str = ""
    loop_ms: float = math.nan
    vmap_ms: float = math.nan
    default_ms: float = math.nan  # compile_clients as "auto" decides for a long run: compiled
    data_ms: float = math.nan
    eval_ms: float = math.nan
    eval_compiled_ms: float = math.nan
    #: the 10-client GEMM throughput measured right after this algorithm's default rounds (the machine's speed
    #: drifts over minutes, so each ratio uses the throughput of its own minute)
    floor_gflops: float = math.nan
    gflop: float = math.nan
    peak_mb: float = math.nan

    def floor_ms(self, gflops: float) -> float:
        """The GEMM floor of a round at this algorithm's own measured throughput (else ``gflops``)."""
        own = self.floor_gflops if not math.isnan(self.floor_gflops) else gflops
        return self.gflop / own * 1e3


def measure_algorithm(
    label: str, spec: dict[str, Any], data: FederatedData, warmup: int, repeats: int, loop: bool = True,
    tau: int = TAU, default: bool = True,
) -> AlgorithmResult:
    """Every per-algorithm figure of the table (see the module docstring)."""
    res = AlgorithmResult(label)
    try:
        algorithm = build_algorithm(spec, tau=tau)
    except Exception as exc:  # a missing or broken entry point must not stop the benchmark
        res.skipped = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return res
    reset_peak_rss()
    module, opt = make_module(algorithm, data, CLIENTS_PER_ROUND, "vmap")
    res.gflop = round_flops(module) / 1e9
    res.vmap_ms = time_rounds(module, opt, warmup, repeats)
    res.data_ms = time_data(module, warmup, repeats)
    res.eval_ms = time_evaluation(module, max(1, warmup // 2), max(2, repeats // 2))
    if default:
        module, opt = make_module(build_algorithm(spec, tau=tau), data, CLIENTS_PER_ROUND, "vmap", compile_clients=True)
        res.default_ms = time_rounds(module, opt, warmup, repeats)  # the warm-up rounds pay the compilation
        res.floor_gflops = gemm_throughput(CLIENTS_PER_ROUND, min_time=0.1).gflops
        res.eval_compiled_ms = time_evaluation(module, max(1, warmup // 2), max(2, repeats // 2))
    if loop:
        module, opt = make_module(build_algorithm(spec, tau=tau), data, CLIENTS_PER_ROUND, "loop")
        res.loop_ms = time_rounds(module, opt, max(1, warmup // 2), max(2, repeats // 2))
    res.peak_mb = peak_rss_mb()
    return res


def _fmt(x: float, digits: int = 1) -> str:
    return "—" if math.isnan(x) else f"{x:.{digits}f}"


def algorithm_table(results: list[AlgorithmResult], gflops: float) -> str:
    head = (
        "| algorithm | ms/round loop | ms/round eager vmap | ms/round default (compiled) | GFLOP/round | GEMM GFLOP/s "
        "| GEMM floor ms | eager ÷ floor | **default ÷ floor** | data ms | eval ms eager | eval ms compiled "
        "| peak RSS MiB |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in results:
        if r.skipped:
            lines.append(f"| {r.label} | skipped: {r.skipped} |" + " |" * 11)
            continue
        floor = r.floor_ms(gflops)
        throughput = r.floor_gflops if not math.isnan(r.floor_gflops) else gflops
        lines.append(
            f"| {r.label} | {_fmt(r.loop_ms)} | {_fmt(r.vmap_ms)} | {_fmt(r.default_ms)} | {_fmt(r.gflop, 3)} "
            f"| {_fmt(throughput, 0)} | {_fmt(floor)} | {_fmt(r.vmap_ms / floor, 2)}× "
            f"| **{_fmt(r.default_ms / floor, 2)}×** "
            f"| {_fmt(r.data_ms)} | {_fmt(r.eval_ms)} | {_fmt(r.eval_compiled_ms)} | {_fmt(r.peak_mb, 0)} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# sweeps
# ------------------------------------------------------------------------------------------------
def scaling_sweep(
    labels: list[str], sizes: list[int], warmup: int, repeats: int, num_clients: int = 1000,
) -> dict[str, list[tuple[int, float]]]:
    """ms/round (vmap) versus clients per round on synthetic data of W's shapes."""
    data = synthetic_data(max(num_clients, max(sizes)))
    specs = dict(ALGORITHMS)
    curves: dict[str, list[tuple[int, float]]] = {}
    for label in labels:
        try:
            build_algorithm(specs[label])
        except Exception as exc:
            print(f"  scaling: {label} skipped ({type(exc).__name__}: {exc})")
            continue
        points = []
        for size in sizes:
            module, opt = make_module(build_algorithm(specs[label]), data, size, "vmap")
            reps = max(2, repeats * 10 // max(size, 10)) if size > 10 else repeats
            ms = time_rounds(module, opt, max(1, warmup if size <= 50 else 1), reps)
            points.append((size, ms))
            print(f"  scaling: {label:<16} {size:>4} clients/round  {ms:9.1f} ms/round")
        curves[label] = points
    return curves


def plot_scaling(curves: dict[str, list[tuple[int, float]]], path: Path) -> None:
    """Log-log ms/round versus clients per round, with linear references through the first point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for label, points in curves.items():
        xs, ys = zip(*points, strict=True)
        (line,) = ax.plot(xs, ys, "o-", label=label)
        ax.plot(xs, [ys[0] * x / xs[0] for x in xs], ":", color=line.get_color(), label=f"{label}: linear in |S|")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("clients per round |S|")
    ax.set_ylabel("ms per round (vmap)")
    threads = torch.get_num_threads()
    ax.set_title(f"ms/round vs clients per round (MLP 784-80-60-10, τ={TAU}, B={BATCH}, {threads} threads)", fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def tau_sweep(data: FederatedData, taus: list[int], labels: list[str], warmup: int, repeats: int) -> list[str]:
    """ms/round (vmap) for each τ: the per-step cost (ms/round ÷ τ) should be flat."""
    specs = dict(ALGORITHMS)
    lines = ["| algorithm | τ | ms/round | ms per local step |", "|---|---|---|---|"]
    for label in labels:
        for tau in taus:
            try:
                module, opt = make_module(build_algorithm(specs[label], tau=tau), data, CLIENTS_PER_ROUND, "vmap")
            except Exception as exc:
                lines.append(f"| {label} | {tau} | skipped: {type(exc).__name__} | |")
                break
            ms = time_rounds(module, opt, warmup, repeats)
            lines.append(f"| {label} | {tau} | {ms:.1f} | {ms / tau:.2f} |")
            print(f"  tau: {label:<16} τ={tau:<3} {ms:8.1f} ms/round  {ms / tau:6.2f} ms/step")
    return lines


def ditto_rss_child(num_clients: int, per_round: int, rounds: int, chunk_size: int) -> None:
    """(Run in a fresh process.) Peak RSS of Ditto with ``num_clients`` personal models.

    Prints the RSS after importing torch/lightning, the peak over ``rounds`` training rounds and
    the peak of one evaluation of all clients (``chunk_size`` clients per vmap call; 0 = all).
    """
    after_import = peak_rss_mb()
    data = synthetic_data(num_clients)
    chunk = chunk_size or None
    module, opt = make_module(build_algorithm(dict(ALGORITHMS)["Ditto"]), data, per_round, "vmap", chunk)
    reset_peak_rss()
    for r in range(rounds):
        run_round(module, opt, r)
    train_peak = peak_rss_mb()
    module.model.eval()  # type: ignore[union-attr]
    module.evaluate_clients(torch.arange(num_clients), rounds)
    state_mb = module.client_states.nbytes() / 2**20
    print(f"DITTO_RSS peak_mb={max(train_peak, peak_rss_mb()):.0f} train_peak_mb={train_peak:.0f} "
          f"eval_peak_mb={peak_rss_mb():.0f} after_import_mb={after_import:.0f} client_state_mb={state_mb:.0f}")


def ditto_rss(num_clients: int = 1000, per_round: int = 100, rounds: int = 3, chunk_size: int = 0) -> str:
    """Run :func:`ditto_rss_child` in a subprocess (so earlier measurements do not inflate the peak)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_ditto-child", str(num_clients), str(per_round),
           str(rounds), str(chunk_size), "--threads", str(torch.get_num_threads())]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    match = re.search(r"DITTO_RSS (.*)", proc.stdout)
    if proc.returncode != 0 or match is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return f"Ditto RSS run failed (exit {proc.returncode}): {tail[0]}"
    chunk = "all clients in one vmap call" if not chunk_size else f"client_chunk_size={chunk_size}"
    return (f"Ditto, {num_clients} clients with personal models, {per_round} per round, {rounds} round(s) + "
            f"evaluation of all clients ({chunk}): {match.group(1)} (target peak ≤ 2048 MiB)")


# ------------------------------------------------------------------------------------------------
# convolutional workloads (issue 29): the project, a plain PyTorch loop and the conv/GEMM floor, interleaved
# ------------------------------------------------------------------------------------------------
#: (label, algorithm spec) of the CNN rows; τ, B and the learning rate come from the workload (benchmarks/gpu.py)
CNN_ALGORITHMS: list[tuple[str, dict[str, Any]]] = [
    ("FedAvg", {"name": "fedavg"}),
    ("Per-FedAvg HF", {"name": "perfedavg", "variant": "hf"}),
    ("Ditto", {"name": "ditto", "lam": 0.1}),
]
#: the issue's targets on the CNN rows: project ≤ 1.5× its floor, the plain loop ≥ 2× slower than the project
CNN_FLOOR_TARGET, CNN_LOOP_TARGET = 1.5, 2.0
#: a ResNet-18 row at 100 clients per round runs only if its 10-client FedAvg round predicts under this (s)
RESNET_100_LIMIT_S = 60.0


def cnn_spec(spec: dict[str, Any], lr: float) -> dict[str, Any]:
    """``spec`` with the workload's learning rate in the algorithm's own argument names."""
    rates = {"perfedavg": {"alpha": lr, "beta": lr}}.get(spec["name"], {"local_lr": lr})
    return {**spec, **rates}


def image_data(num_clients: int, shape: tuple[int, ...], classes: int, train: int, seed: int = 0) -> FederatedData:
    """Random images of ``shape`` (speed depends on shapes only), ``train`` samples and 4 test samples per client."""
    g = torch.Generator().manual_seed(seed)
    n, m = num_clients * train, num_clients * 4
    return FederatedData(
        torch.rand(n, *shape, generator=g), torch.randint(0, classes, (n,), generator=g),
        torch.arange(num_clients + 1) * train, torch.rand(m, *shape, generator=g),
        torch.randint(0, classes, (m,), generator=g), torch.arange(num_clients + 1) * 4, classes,
    )


@dataclass(frozen=True)
class LayerCall:
    """One convolution or linear layer of a client step: its module and the input shape it sees."""

    name: str
    module: torch.nn.Module
    input_shape: tuple[int, ...]
    first: bool  # the model's input layer: no input gradient in the backward pass


def layer_calls(model: torch.nn.Module, shape: tuple[int, ...], batch: int) -> list[LayerCall]:
    """Every ``Conv2d``/``Linear`` call of one forward pass of ``batch`` inputs of ``shape``, in call order."""
    calls: list[LayerCall] = []
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Conv2d | torch.nn.Linear):
            hooks.append(mod.register_forward_hook(
                lambda m, args, out, name=name: calls.append(LayerCall(name, m, tuple(args[0].shape), not calls))))
    try:
        with torch.no_grad():
            model(torch.zeros(batch, *shape))
    finally:
        for h in hooks:
            h.remove()
    return calls


def _layer_step(call: LayerCall) -> Callable[[], None]:
    """Forward + backward of one layer alone (weight, bias and, except the first layer, input gradients)."""
    mod = call.module
    x = torch.randn(call.input_shape, requires_grad=not call.first)
    w = mod.weight.detach().clone().requires_grad_(True)
    b = None if mod.bias is None else mod.bias.detach().clone().requires_grad_(True)
    if isinstance(mod, torch.nn.Conv2d):
        def fwd() -> torch.Tensor:
            return torch.nn.functional.conv2d(x, w, b, mod.stride, mod.padding, mod.dilation, mod.groups)
    else:
        def fwd() -> torch.Tensor:
            return torch.nn.functional.linear(x, w, b)
    grad_out = torch.ones_like(fwd())

    def step() -> None:
        fwd().backward(grad_out)
        w.grad = None
        if b is not None:
            b.grad = None
        x.grad = None
    return step


def layer_flops(call: LayerCall) -> int:
    """FLOPs of one layer's forward + backward, as ``torch.utils.flop_counter`` counts them."""
    step = _layer_step(call)
    with FlopCounterMode(display=False) as counter:
        step()
    return int(counter.get_total_flops())


@dataclass
class ConvFloor:
    """The model's conv/linear forward+backward of one client step, each layer timed alone (unbatched)."""

    calls: list[LayerCall]
    flops: list[int]
    steps: list[Callable[[], None]]
    seconds: list[list[float]] = field(default_factory=list)  # per repeat: per layer median seconds

    @classmethod
    def of(cls, model: torch.nn.Module, shape: tuple[int, ...], batch: int) -> ConvFloor:
        calls = layer_calls(model, shape, batch)
        return cls(calls, [layer_flops(c) for c in calls], [_layer_step(c) for c in calls])

    def measure(self, reps: int = 5) -> float:
        """Time every layer ``reps`` times (median each); returns this repeat's GFLOP/s = Σ FLOPs / Σ time."""
        times = []
        for step in self.steps:
            step()
            samples = []
            for _ in range(reps):
                t0 = CLOCK()
                step()
                samples.append(CLOCK() - t0)
            times.append(statistics.median(samples))
        self.seconds.append(times)
        return sum(self.flops) / sum(times) / 1e9

    def gflops(self) -> float:
        """Throughput over the repeats: Σ FLOPs ÷ Σ (median over repeats of each layer's time)."""
        per_layer = [statistics.median(col) for col in zip(*self.seconds, strict=True)]
        return sum(self.flops) / sum(per_layer) / 1e9


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(model(x), y)


def _draw(xs: torch.Tensor, ys: torch.Tensor, c: int, batch: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    idx = torch.randperm(xs.shape[1], generator=g)[:batch]
    return xs[c % xs.shape[0], idx], ys[c % xs.shape[0], idx]


def _grad_at(model: torch.nn.Module, params: list[torch.Tensor], point: list[torch.Tensor],
             data: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """∇f(point; data) of ``model`` (whose ``params`` are overwritten with ``point``)."""
    with torch.no_grad():
        for p, q in zip(params, point, strict=True):
            p.copy_(q)
    return torch.autograd.grad(_loss(model, *data), params)


def plain_perfedavg_hf_round(model: torch.nn.Module, xs: torch.Tensor, ys: torch.Tensor, clients: int, steps: int,
                             batch: int, lr: float, generator: torch.Generator, delta: float = 1e-3) -> None:
    """Per-FedAvg (HF) written by hand (Fallah et al. 2020, eq. (9)), α = β = ``lr``: per client a fresh copy;
    each step ``w̃ = w − α∇f(w; D)``, ``v = ∇f(w̃; D′)``, ``d = [∇f(w + δv; D″) − ∇f(w − δv; D″)] / 2δ``,
    ``w ← w − β(v − α d)``; then the mean of the models."""
    total = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    for c in range(clients):
        local = copy.deepcopy(model)
        params = list(local.parameters())

        def grad_at(point: list[torch.Tensor], data: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            return _grad_at(local, params, point, data)  # noqa: B023 - used within this client's iteration

        for _ in range(steps):
            d1, d2, d3 = (_draw(xs, ys, c, batch, generator) for _ in range(3))
            w = [p.detach().clone() for p in params]
            g = grad_at(w, d1)
            v = grad_at([wi - lr * gi for wi, gi in zip(w, g, strict=True)], d2)
            g_plus = grad_at([wi + delta * vi for wi, vi in zip(w, v, strict=True)], d3)
            g_minus = grad_at([wi - delta * vi for wi, vi in zip(w, v, strict=True)], d3)
            with torch.no_grad():
                for p, wi, vi, gp, gm in zip(params, w, v, g_plus, g_minus, strict=True):
                    p.copy_(wi - lr * (vi - lr * (gp - gm) / (2 * delta)))
        for k, val in local.state_dict().items():
            total[k] += val
    model.load_state_dict({k: val / clients for k, val in total.items()})


def plain_ditto_round(model: torch.nn.Module, personal: dict[int, dict[str, torch.Tensor]], xs: torch.Tensor,
                      ys: torch.Tensor, clients: int, steps: int, batch: int, lr: float, generator: torch.Generator,
                      lam: float = 0.1) -> None:
    """Ditto written by hand (Li et al. 2021, Algorithm 1): per client ``steps`` SGD steps of a fresh copy of the
    global model, then ``steps`` steps of its stored personal model ``v ← v − η(∇f(v; D) + λ(v − wᵗ))`` (kept in
    ``personal``); the global model becomes the mean of the clients' global copies."""
    total = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    centre = [p.detach().clone() for p in model.parameters()]
    for c in range(clients):
        local = copy.deepcopy(model)
        opt = torch.optim.SGD(local.parameters(), lr=lr)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            _loss(local, *_draw(xs, ys, c, batch, generator)).backward()
            opt.step()
        for k, val in local.state_dict().items():
            total[k] += val
        mine = copy.deepcopy(model)
        if c in personal:
            mine.load_state_dict(personal[c])
        opt = torch.optim.SGD(mine.parameters(), lr=lr)
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            _loss(mine, *_draw(xs, ys, c, batch, generator)).backward()
            with torch.no_grad():
                for p, w in zip(mine.parameters(), centre, strict=True):
                    p.grad.add_(p - w, alpha=lam)
            opt.step()
        personal[c] = mine.state_dict()
    model.load_state_dict({k: val / clients for k, val in total.items()})


def plain_round_fn(label: str, work: Workload) -> Callable[..., None]:
    """The plain per-client loop of ``label`` as ``fn(model, xs, ys, clients, generator)``."""
    steps, batch, lr = work.steps, work.batch, work.lr
    if label == "FedAvg":
        return lambda m, xs, ys, c, g: plain_loop_round(m, xs, ys, c, steps, batch, lr, g)
    if label == "Per-FedAvg HF":
        return lambda m, xs, ys, c, g: plain_perfedavg_hf_round(m, xs, ys, c, steps, batch, lr, g)
    personal: dict[int, dict[str, torch.Tensor]] = {}
    return lambda m, xs, ys, c, g: plain_ditto_round(m, personal, xs, ys, c, steps, batch, lr, g)


@dataclass
class CnnRow:
    """One CNN row: medians of the interleaved repeats (seconds per round) and the floor of the same minutes."""

    workload: str
    clients: int
    label: str
    project_s: float = math.nan
    loop_s: float = math.nan  # scaled from ``loop_clients`` clients to ``clients``
    loop_clients: int = 0
    gflop: float = math.nan
    floor_gflops: float = math.nan

    @property
    def floor_s(self) -> float:
        return self.gflop / self.floor_gflops

    @property
    def over_floor(self) -> float:
        return self.project_s / self.floor_s

    @property
    def loop_over_project(self) -> float:
        return self.loop_s / self.project_s


def _timed(fn: Callable[[], Any]) -> float:
    t0 = CLOCK()
    fn()
    return CLOCK() - t0


def cnn_round_flops(spec: dict[str, Any], work: Workload, data: FederatedData, clients: int) -> int:
    """FLOPs of a round of ``clients`` clients: ``FlopCounterMode`` around one LOOPED client's ``compute_round``,
    times ``clients`` (equal clients do equal work).

    Not the vmap-ed round: torch 2.14's counter ignores ``groups`` in the weight gradient of
    ``convolution_backward``, and vmap lowers a per-client convolution to one grouped convolution over the clients,
    so the batched round's weight-gradient FLOPs would be counted ``clients`` times over.
    """
    algorithm = build_algorithm(cnn_spec(spec, work.lr), tau=work.steps, batch_size=work.batch)
    torch.manual_seed(0)
    module, _ = make_module(algorithm, data, 1, "loop", model=work.build())
    return round_flops(module) * clients


def measure_cnn_row(workload: str, work: Workload, data: FederatedData, clients: int, label: str, spec: dict[str, Any],
                    repeats: int, loop_clients: int, floor: ConvFloor) -> CnnRow:
    """Project round (eager vmap, default chunk), plain loop round and floor kernels, alternately, ``repeats`` times
    after one untimed round of each."""
    row = CnnRow(workload, clients, label, loop_clients=min(clients, loop_clients))
    algorithm = build_algorithm(cnn_spec(spec, work.lr), tau=work.steps, batch_size=work.batch)
    torch.manual_seed(0)
    module, opt = make_module(algorithm, data, clients, "vmap", model=work.build())
    row.gflop = cnn_round_flops(spec, work, data, clients) / 1e9
    run_round(module, opt, 0)
    per_client = data.train_x.shape[0] // data.num_clients
    xs = data.train_x[: row.loop_clients * per_client].view(row.loop_clients, per_client, *work.shape)
    ys = data.train_y[: row.loop_clients * per_client].view(row.loop_clients, per_client)
    torch.manual_seed(0)
    model, plain, g = work.build(), plain_round_fn(label, work), torch.Generator().manual_seed(0)
    plain(model, xs, ys, row.loop_clients, g)
    project, loop, rates = [], [], []
    for r in range(repeats):
        project.append(_timed(lambda r=r: run_round(module, opt, r + 1)))
        loop.append(_timed(lambda: plain(model, xs, ys, row.loop_clients, g)) * clients / row.loop_clients)
        rates.append(floor.measure())
    row.project_s, row.loop_s = statistics.median(project), statistics.median(loop)
    row.floor_gflops = floor.gflops()
    return row


def cnn_table(rows: list[CnnRow]) -> list[str]:
    lines = ["| workload | clients/round | algorithm | project s/round | plain loop s/round | GFLOP/round "
             "| floor GFLOP/s | floor s/round | **project ÷ floor** | **plain loop ÷ project** |", "|" + "---|" * 10]
    for r in rows:
        scaled = "" if r.loop_clients == r.clients else f" (×{r.clients // r.loop_clients} of {r.loop_clients})"
        lines.append(f"| {r.workload} | {r.clients} | {r.label} | {r.project_s:.3f} | {r.loop_s:.3f}{scaled} "
                     f"| {r.gflop:.1f} | {r.floor_gflops:.1f} | {r.floor_s:.3f} | **{r.over_floor:.2f}×** "
                     f"| **{r.loop_over_project:.2f}×** |")
    return lines


def floor_table(name: str, floor: ConvFloor) -> list[str]:
    """Per-layer FLOPs and GFLOP/s of the floor kernels (median over the repeats)."""
    lines = [f"| {name} layer | input shape | MFLOP fwd+bwd | GFLOP/s |", "|---|---|---|---|"]
    for call, flops, col in zip(floor.calls, floor.flops, zip(*floor.seconds, strict=True), strict=True):
        lines.append(f"| {call.name} | {list(call.input_shape)} | {flops / 1e6:.1f} "
                     f"| {flops / statistics.median(col) / 1e9:.1f} |")
    lines.append(f"| **one client step** | | **{sum(floor.flops) / 1e6:.1f}** | **{floor.gflops():.1f}** |")
    return lines


CNN_WORKLOADS = ("CNN", "ResNet-18")


def _cnn_plan(quick: bool, steps: list[int] | None = None,
              names: list[str] | None = None) -> list[tuple[str, Workload, list[int]]]:
    """(workload, its work, clients-per-round list): PFLlib's CNN at 10 and 100, ResNet-18 at 10 (100 if cheap);
    ``steps``: τ of the CNN and of ResNet-18 instead of the workloads' own; ``names``: a subset of the two."""
    workloads = quick_workloads() if quick else WORKLOADS
    sizes = [2] if quick else [10, 100]
    taus = dict(zip(CNN_WORKLOADS, steps, strict=True)) if steps else {}
    return [(name, replace(workloads[name], steps=taus.get(name, workloads[name].steps)), sizes)
            for name in CNN_WORKLOADS if names is None or name in names]


def _too_slow(rows: list[CnnRow], workload: str, label: str, clients: int) -> str | None:
    """Why a ResNet-18 row beyond its first clients-per-round is not run: that algorithm's round, predicted linearly
    from its measured row at fewer clients, would take ≥ :data:`RESNET_100_LIMIT_S`; ``None`` when it runs."""
    done = [r for r in rows if r.workload == workload == "ResNet-18" and r.label == label and r.clients < clients]
    if not done:
        return None
    predicted = done[0].project_s * clients / done[0].clients
    if predicted < RESNET_100_LIMIT_S:
        return None
    return (f"ResNet-18 {label} at {clients} clients per round not run: its round would take about {predicted:.0f} s "
            f"here (≥ {RESNET_100_LIMIT_S:.0f} s; {done[0].project_s:.1f} s at {done[0].clients} clients).")


def cnn_section(quick: bool, repeats: int, loop_clients: int, steps: list[int] | None = None,
                names: list[str] | None = None) -> list[str]:
    """The CNN rows (see the module docstring) and the floor kernels behind them, as markdown lines."""
    rows: list[CnnRow] = []
    notes, floors = [], []
    load_before = os.getloadavg()
    for name, work, sizes in _cnn_plan(quick, steps, names):
        floor = ConvFloor.of(work.build(), work.shape, work.batch)
        for clients in sizes:
            data = image_data(clients, work.shape, work.classes, train=work.steps * work.batch)
            for label, spec in CNN_ALGORITHMS:
                skip = _too_slow(rows, name, label, clients) if not quick else None
                if skip:
                    notes.append(skip)
                    print(f"   {skip}", flush=True)
                    continue
                row = measure_cnn_row(name, work, data, clients, label, spec, repeats, loop_clients, floor)
                rows.append(row)
                print(f"   {name:<9} {clients:>3} clients {label:<14} project {row.project_s:7.3f} s  "
                      f"loop {row.loop_s:7.3f} s  floor {row.floor_s:7.3f} s ({row.floor_gflops:.1f} GFLOP/s)  "
                      f"÷floor {row.over_floor:.2f}  loop÷project {row.loop_over_project:.2f}", flush=True)
        floors.append((name, floor))
    load = ", ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(load_before, os.getloadavg(), strict=True))
    lines = [*cnn_table(rows), "", *notes, ""] if notes else [*cnn_table(rows), ""]
    for name, floor in floors:
        lines += [*floor_table(name, floor), ""]
    lines.append(f"Load average (1, 5, 15 min) at the start / end of this section: {load}.")
    return lines


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------
def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 rounds, 3 algorithms, small sweeps, writes *_quick files (< 60 s quiet)")
    p.add_argument("--all", action="store_true", help="everything: table, --scaling, --tau 1 5 10 20, --ditto-rss")
    p.add_argument("--algorithms", nargs="*", default=None, help="labels to run (default: all of W's list)")
    p.add_argument("--no-loop", action="store_true", help="skip the looped-client timings")
    p.add_argument("--no-default", action="store_true", help="skip the default (compiled) timings")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds before timing (default 3; quick 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 20; quick 3)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: as the machine gives)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="wall: time.perf_counter (default); cpu: process CPU time (shared machine, --threads 1)")
    p.add_argument("--first-round", action="store_true",
                   help="first-round overhead of the compiled default on a cold and a warm inductor cache")
    p.add_argument("--cli", action="store_true",
                   help="time `fedmeta fit` for 1000 rounds of Per-FedAvg HF on a cold cache against its prediction")
    p.add_argument("--scaling", action="store_true", help="ms/round vs clients per round (10, 50, 100, 500) + PNG")
    p.add_argument("--tau", type=int, nargs="*", default=None, help="τ sweep, e.g. --tau 1 5 10 20")
    p.add_argument("--ditto-rss", action="store_true", help="peak RSS of Ditto with 1000 clients, 100 per round")
    p.add_argument("--cnn", action="store_true",
                   help="only the convolutional rows (PFLlib's CNN, ResNet-18): merged into speed.md's CNN section")
    p.add_argument("--cnn-steps", type=int, nargs=2, default=None, metavar=("CNN", "RESNET"),
                   help="CNN rows: τ of the CNN and of ResNet-18 (default: benchmarks/gpu.py's 20 and 5)")
    p.add_argument("--cnn-workloads", nargs="+", choices=CNN_WORKLOADS, default=None,
                   help="CNN rows: which workloads (default both)")
    p.add_argument("--loop-clients", type=int, default=10,
                   help="CNN rows: the plain loop runs this many clients and is scaled to the row's (default 10)")
    p.add_argument("--out", type=Path, default=RESULTS, help="results folder (speed.md, speed_vs_clients.png)")
    p.add_argument("--_ditto-child", nargs=4, type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--_first-round-child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _environment() -> str:
    clock = "process CPU time" if CLOCK is time.process_time else "wall time"
    return (
        f"{clock}; torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
        f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )


@contextlib.contextmanager
def _section(title: str) -> Iterator[None]:
    t0 = time.perf_counter()
    print(f"== {title}", flush=True)
    yield
    print(f"   ({time.perf_counter() - t0:.1f} s)", flush=True)


def first_round_child(label: str) -> None:
    """(Run in a fresh process, maybe with a fresh inductor cache.) Times of one algorithm's first rounds.

    Prints the median eager round (``compile_clients=False``), the first compiled round (compilation
    included) and the median compiled round after it; the first-round overhead is first − compiled median.
    """
    data = load_workload()
    spec = dict(ALGORITHMS)[label]
    module, opt = make_module(build_algorithm(spec), data, CLIENTS_PER_ROUND, "vmap")
    eager = time_rounds(module, opt, 1, 5)
    module, opt = make_module(build_algorithm(spec), data, CLIENTS_PER_ROUND, "vmap", compile_clients=True)
    start = time.perf_counter()
    run_round(module, opt, 0)
    first = time.perf_counter() - start
    compiled = _median_ms(lambda r: run_round(module, opt, r), 1, 10, start=1)
    stats = module.compiler.stats
    print(f"FIRST_ROUND eager_ms={eager:.2f} first_s={first:.3f} compiled_ms={compiled:.2f} "
          f"programs={stats.programs} compile_s={stats.compile_seconds:.2f}")


def first_round_overhead(label: str, cache_dir: Path) -> dict[str, float]:
    """:func:`first_round_child` in a subprocess whose inductor cache is ``cache_dir``."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_first-round-child", label,
           "--threads", str(torch.get_num_threads())]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    match = re.search(r"FIRST_ROUND (.*)", proc.stdout)
    if proc.returncode != 0 or match is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"first-round run of {label} failed (exit {proc.returncode}): {tail[0]}")
    values = {k: float(v) for k, v in (item.split("=") for item in match.group(1).split())}
    values["overhead_s"] = values["first_s"] - values["compiled_ms"] / 1e3
    return values


def first_round_table(labels: list[str]) -> list[str]:
    """Cold (a fresh, empty inductor cache) and warm (the same cache again) first-round overheads."""
    import tempfile

    lines = ["| algorithm | eager ms/round | compiled ms/round | programs | cold: first round s | cold: overhead s "
             "| warm: overhead s | target |", "|---|---|---|---|---|---|---|---|"]
    for label in labels:
        with tempfile.TemporaryDirectory(prefix="fedmeta-inductor-") as tmp:
            cold = first_round_overhead(label, Path(tmp))
            warm = first_round_overhead(label, Path(tmp))
        print(f"   {label:<18} eager {cold['eager_ms']:6.1f} ms  compiled {cold['compiled_ms']:6.1f} ms  "
              f"cold overhead {cold['overhead_s']:5.1f} s  warm overhead {warm['overhead_s']:5.1f} s", flush=True)
        lines.append(f"| {label} | {cold['eager_ms']:.1f} | {cold['compiled_ms']:.1f} | {cold['programs']:.0f} "
                     f"| {cold['first_s']:.1f} | {cold['overhead_s']:.1f} | {warm['overhead_s']:.1f} | < 10 s |")
    return lines


# ------------------------------------------------------------------------------------------------
# the CLI end to end
# ------------------------------------------------------------------------------------------------
CLI_CONFIG = Path(__file__).resolve().parent / "perfedavg_hf_1000.yaml"


def time_cli(extra: list[str], cache_dir: Path) -> tuple[float, str]:
    """Wall seconds of ``fedmeta fit --config perfedavg_hf_1000.yaml --plots false EXTRA`` and its output."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
           "OMP_NUM_THREADS": str(torch.get_num_threads())}
    cmd = [sys.executable, "-m", "lightning_fedmeta.cli", "fit", "--config", str(CLI_CONFIG), "--plots", "false",
           *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"fedmeta fit failed (exit {proc.returncode}): {' | '.join(tail)}")
    return seconds, proc.stdout + proc.stderr


def cli_section(data: FederatedData) -> list[str]:
    """The 1000-round Per-FedAvg HF run from the CLI on a cold inductor cache, against its prediction.

    prediction = start-up and two eager rounds (the same command with ``--trainer.max_steps 2``, which also
    evaluates once) + compilation (the run's own log line) + 998 × the compiled round + 99 × the eager
    personalised evaluation (every 10 rounds, the last one counted above). The round and evaluation times are
    measured by :func:`run_round` / ``evaluate_clients`` on a compiled module in this process right before and
    right after the CLI runs (mean of the two medians), so the machine's drift over minutes cancels.
    """
    import tempfile

    module, opt = make_module(build_algorithm(dict(ALGORITHMS)["Per-FedAvg HF"]), data, CLIENTS_PER_ROUND, "vmap",
                              compile_clients=True)
    eager_eval = make_module(build_algorithm(dict(ALGORITHMS)["Per-FedAvg HF"]), data, CLIENTS_PER_ROUND, "vmap")[0]
    offset = [0]

    def bare() -> tuple[float, float]:
        ms = _median_ms(lambda r: run_round(module, opt, r), 3, 30, start=offset[0])
        offset[0] += 33
        return ms, time_evaluation(eager_eval, 1, 5)

    before = bare()
    with tempfile.TemporaryDirectory(prefix="fedmeta-inductor-") as tmp:
        short, _ = time_cli(["--trainer.max_steps", "2"], Path(tmp))
    with tempfile.TemporaryDirectory(prefix="fedmeta-inductor-") as tmp:
        full, log = time_cli([], Path(tmp))
    after = bare()
    round_ms, eval_ms = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
    match = re.search(r"compiled client steps: (\d+) program\(s\), ([\d.]+) s compiling", log)
    compile_s = float(match.group(2)) if match else math.nan
    decision = re.search(r"compile_clients='auto': ([^\n]*)", log)
    predicted = short + (0.0 if math.isnan(compile_s) else compile_s) + 998 * round_ms / 1e3 + 99 * eval_ms / 1e3
    accuracy = re.search(r"clients\s+([\d.]+)", log.split("Personalized evaluation after round 1000")[-1])
    print(f"   start-up + 2 rounds {short:.1f} s; 1000 rounds cold {full:.1f} s; compile {compile_s:.1f} s; "
          f"round {before[0]:.1f} / {after[0]:.1f} ms; predicted {predicted:.1f} s; ratio {full / predicted:.3f}",
          flush=True)
    return [
        "| measured | seconds |", "|---|---|",
        f"| `fedmeta fit ... --trainer.max_steps 2` (start-up, 2 eager rounds, 1 evaluation) | {short:.1f} |",
        f"| compilation inside the 1000-round run (its log line) | {compile_s:.1f} |",
        f"| **`fedmeta fit` 1000 rounds, evaluation every 10, cold inductor cache** (target ≤ 90 s) | **{full:.1f}** |",
        f"| compiled round before / after the CLI runs (ms) | {before[0]:.1f} / {after[0]:.1f} |",
        f"| eager evaluation before / after (ms) | {before[1]:.1f} / {after[1]:.1f} |",
        f"| predicted: start-up + compile + 998 × {round_ms:.1f} ms + 99 × {eval_ms:.1f} ms | {predicted:.1f} |",
        f"| **CLI ÷ predicted** (target ≤ 1.05) | **{full / predicted:.3f}** |",
        "",
        f"Decision logged by the run: `{decision.group(1).strip() if decision else 'none found'}`. "
        f"Final weighted personalised accuracy: {accuracy.group(1) if accuracy else 'n/a'}.",
    ]


CNN_HEADING = "# Convolutional workloads (issue 29)"


def merge_section(md: Path, heading: str, lines: list[str]) -> None:
    """Write ``heading`` + ``lines`` into ``md``: in place of the section under that heading line (up to the next
    top-level heading) if there is one, else at the end; the rest of the file is kept."""
    text = md.read_text() if md.exists() else ""
    section = "\n".join([heading, "", *lines]).rstrip() + "\n"
    match = re.search(rf"^{re.escape(heading)}\n.*?(?=^# |\Z)", text, flags=re.S | re.M)
    if match:
        text = text[:match.start()] + section + ("\n" if match.end() < len(text) else "") + text[match.end():]
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "") + section
    md.write_text(text)


def cnn_main(args: argparse.Namespace, argv: list[str] | None) -> int:
    """``--cnn``: the CNN rows alone, merged into ``speed.md`` (``speed_quick.md`` with ``--quick``)."""
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    started = time.perf_counter()
    print(_environment())
    with _section("convolutional workloads"):
        lines = cnn_section(args.quick, repeats, args.loop_clients, args.cnn_steps, args.cnn_workloads)
    print("\n".join(lines))
    intro = [
        f"Command: `python benchmarks/speed.py {' '.join(argv if argv is not None else sys.argv[1:])}`  ",
        f"Machine: {_environment()}  ",
        "Work per client and round (benchmarks/gpu.py's `WORKLOADS`): PFLlib's FedAvgCNN on 1×28×28, batch 10; "
        "ResNet-18 (GroupNorm, torchvision stem) on 3×32×32, batch 32; "
        + (f"τ = {args.cnn_steps[0]} and {args.cnn_steps[1]} steps (`--cnn-steps`; a round's cost is linear in τ, "
           "the ratios do not depend on it); " if args.cnn_steps else "τ = 20 and 5 steps; ")
        + "learning rate "
        "0.01 (Per-FedAvg HF: α = β = 0.01, δ = 0.001; Ditto: λ = 0.1, personal steps = τ). Random data of those "
        "shapes.",
        "",
        "- **project**: `run_round` of a FederatedModule, `client_batching=\"vmap\"`, eager, default "
        "`client_chunk_size` (100; on the CPU a convolutional model trains 10 clients per vmap call, "
        "`execution.CPU_CONV_CHUNK`).",
        "- **plain loop**: the same work written by hand (a fresh `nn.Module` copy and `torch.optim.SGD` per client, "
        "data in memory; FedAvg is benchmarks/gpu.py's `plain_loop_round`, Per-FedAvg HF and Ditto their hand-written "
        f"counterparts here), timed on {args.loop_clients} clients and scaled linearly to the row's clients.",
        "- **floor**: FLOPs of the round (`FlopCounterMode` around one looped client's `compute_round` × clients: "
        "convolutions and matmuls) ÷ the "
        "throughput of the model's own conv/linear layers, forward + backward, unbatched for one client, each layer "
        "timed alone at its shape (table below).",
        f"- The machine is shared with other engineers' tests and benchmarks: project, plain loop and floor kernels "
        f"run alternately, {repeats} time(s) each after an untimed round, and each column is the median, so the "
        "ratios within a row come from the same minutes. Targets: project ÷ floor ≤ "
        f"{CNN_FLOOR_TARGET:g}×, plain loop ÷ project ≥ {CNN_LOOP_TARGET:g}×.",
        "",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    md = args.out / f"speed{'_quick' if args.quick else ''}.md"
    heading = f"{CNN_HEADING}: {', '.join(args.cnn_workloads or CNN_WORKLOADS)}"
    merge_section(md, heading, [*intro, *lines, "", f"Section time: {time.perf_counter() - started:.0f} s."])
    print(f"wrote {md}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.getLogger("lightning").setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    if args._ditto_child:
        ditto_rss_child(*args._ditto_child)
        return 0
    if args._first_round_child:
        first_round_child(args._first_round_child)
        return 0
    if args.cnn:
        return cnn_main(args, argv)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 20)
    labels = args.algorithms or (["FedAvg", "Per-FedAvg HF", "Ditto"] if args.quick else [a for a, _ in ALGORITHMS])
    specs = dict(ALGORITHMS)
    unknown = [x for x in labels if x not in specs]
    if unknown:
        raise SystemExit(f"unknown algorithm label(s) {unknown}; choose from {list(specs)}")
    if args.all:
        args.scaling, args.ditto_rss, args.first_round, args.cli = True, True, True, True
        args.tau = args.tau or [1, 5, 10, 20]
    if args.quick:
        args.scaling, args.ditto_rss = True, True
        args.tau = args.tau or [1, 10]
    suffix = "_quick" if args.quick else ""  # a smoke run never overwrites the full results
    started = time.perf_counter()
    print(_environment())
    report = [
        "# Speed on workload W",
        "",
        f"Command: `python benchmarks/speed.py {' '.join(argv if argv is not None else sys.argv[1:])}`  ",
        f"Machine: {_environment()}  ",
        f"Workload W: MLP 784-80-60-10 ELU (68,270 parameters), Fashion-MNIST `perfedavg_paper` split, "
        f"K={NUM_CLIENTS}, |S|={CLIENTS_PER_ROUND}, τ={TAU}, B={BATCH}; median of {repeats} rounds after {warmup} "
        "warm-up rounds. A round = `run_round` (compute_round + finiteness checks + aggregate + SGD server step + "
        "state scatter; no Trainer, no logging).",
        "",
    ]

    with _section("GEMM throughput at the model's shapes"):
        gemm = {c: gemm_throughput(c, min_time=0.05 if args.quick else 0.3) for c in (1, CLIENTS_PER_ROUND)}
        for c, g in gemm.items():
            print(f"   {c:>3} client(s) batched: {g.gflops:7.1f} GFLOP/s over one forward+backward step")
    report += ["## fp32 GEMM throughput (torch.bmm at the MLP's forward/backward shapes)", "",
               "| shape (clients × m, k) × (k, n) | GFLOP/s |", "|---|---|"]
    for g in gemm.values():
        report += [f"| {label} | {v:.1f} |" for label, v in g.per_shape]
        report.append(f"| **one fwd+bwd step, {g.clients} client(s)** | **{g.gflops:.1f}** |")
    floor_gflops = gemm[CLIENTS_PER_ROUND].gflops
    report += ["", f"GEMM floor of a round = GEMM FLOPs of the round ÷ the {CLIENTS_PER_ROUND}-client batched "
               f"throughput ({floor_gflops:.1f} GFLOP/s here; the per-algorithm table re-measures it right after "
               "each algorithm's default rounds, since this machine's speed drifts over minutes).", ""]

    with _section("Workload W data"):
        data = load_workload()
    results = []
    with _section("per-algorithm rounds"):
        for label in labels:
            loop = not args.no_loop and (not args.quick or label == "FedAvg")
            res = measure_algorithm(label, specs[label], data, warmup, repeats, loop=loop,
                                    default=not args.no_default)
            results.append(res)
            if res.skipped:
                print(f"   {label:<18} skipped: {res.skipped}")
            else:
                print(f"   {label:<18} loop {_fmt(res.loop_ms):>8} ms  vmap {_fmt(res.vmap_ms):>8} ms  "
                      f"default {_fmt(res.default_ms):>8} ms  "
                      f"data {_fmt(res.data_ms):>6} ms  eval {_fmt(res.eval_ms):>7} ms  {res.gflop:.3f} GFLOP  "
                      f"floor {res.floor_ms(floor_gflops):.1f} ms  peak {res.peak_mb:.0f} MiB", flush=True)
    table = algorithm_table(results, floor_gflops)
    print(table)
    report += ["## ms per round, evaluation and memory", "", table, "",
               f"Default = `compile_clients=\"auto\"` as it decides for a long run (compiled client primitives, "
               f"timed after the warm-up rounds that compile); target: default ÷ floor ≤ {FLOOR_TARGET:g}× for "
               f"{', '.join(FLOOR_TARGET_ALGORITHMS)}. "
               f"Evaluation: `evaluate_clients` of all {NUM_CLIENTS} clients, one adaptation step of batch {BATCH} "
               f"(target ≤ {EVAL_TARGET_MS:g} ms); \"auto\" evaluates eagerly, `compile_clients=True` compiles it. "
               "Data ms: sampling + `draw_batch_indices` + index gather of a "
               "round's mini-batches, measured alone. Peak RSS: VmHWM reset before each algorithm.", ""]

    if args.first_round:
        first_labels = [x for x in FLOOR_TARGET_ALGORITHMS if x in labels]
        with _section(f"first-round overhead, cold and warm inductor cache {first_labels}"):
            lines = first_round_table(first_labels)
        report += ["## First-round overhead of the default (compiled) path", "", *lines, "",
                   "Each row runs in two fresh processes sharing a new, empty `TORCHINDUCTOR_CACHE_DIR`: the first "
                   "(cold) compiles everything, the second (warm) finds the compiled programs in that cache. "
                   "Overhead = first compiled round − the median compiled round.", ""]

    if args.cli:
        with _section("fedmeta fit: 1000 rounds of Per-FedAvg HF, cold inductor cache"):
            lines = cli_section(data)
        report += ["## The CLI end to end (`benchmarks/perfedavg_hf_1000.yaml`)", "", *lines, ""]

    if args.tau:
        with _section(f"τ sweep {args.tau}"):
            tau_labels = ["FedAvg"] if args.quick else [x for x in ("FedAvg", "Per-FedAvg HF") if x in labels]
            lines = tau_sweep(data, args.tau, tau_labels, warmup, repeats)
        report += ["## Cost versus τ (vmap)", "", *lines, ""]

    if args.scaling:
        sizes = [10, 20] if args.quick else [10, 50, 100, 500]
        with _section(f"clients-per-round sweep {sizes}"):
            curves = scaling_sweep(["FedAvg"] if args.quick else ["FedAvg", "Per-FedAvg HF"], sizes, warmup, repeats,
                                   num_clients=500 if args.quick else 1000)
        png = args.out / f"speed_vs_clients{suffix}.png"
        if curves:
            plot_scaling(curves, png)
        report += ["## ms/round versus clients per round (synthetic data of W's shapes, 1000 clients, vmap)", "",
                   "| algorithm | clients/round | ms/round | ms per client |", "|---|---|---|---|"]
        for label, points in curves.items():
            report += [f"| {label} | {s} | {ms:.1f} | {ms / s:.2f} |" for s, ms in points]
        report += ["", f"![ms/round vs clients per round]({png.name})", ""]

    if args.ditto_rss:
        runs = [(200, 20, 1, 0)] if args.quick else [(1000, 100, 3, 0), (1000, 100, 3, 100)]
        with _section(f"Ditto peak RSS, {runs[0][0]} clients"):
            lines = [ditto_rss(*run) for run in runs]
            print("\n".join("   " + line for line in lines))
        report += ["## Memory at scale (fresh subprocess each)", "", *[f"- {line}" for line in lines], ""]

    total = time.perf_counter() - started
    report.append(f"Total benchmark time: {total:.0f} s.")
    args.out.mkdir(parents=True, exist_ok=True)
    md = args.out / f"speed{suffix}.md"
    md.write_text("\n".join(report) + "\n")
    print(f"wrote {md} ({total:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
