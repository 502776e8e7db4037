"""Scale benchmark: ms per round and peak RSS against the number of clients K, and evaluation time against N.

Workload S (the scale version of workload W): the ``synthetic_scale`` population
(:mod:`lightning_fedmeta.data.synthetic_scale`: Synthetic(1, 1), power-law sizes ``n_min = 10``,
``gamma = 2``, cap 500, d = 60, 10 classes, about 19 samples per client), and an ELU MLP 60-196-272-10 with
**68,270 parameters, the parameter count of W's 784-80-60-10 MLP** (W's 784 inputs at K = 10^5 would be
6 GB of features; the client state, a round's FLOPs per sample and the state bytes per client are W's).
τ = 10 local steps of batch 40, learning rate 0.001, one adaptation step at evaluation (W's settings,
``speed.build_algorithm``); eager ``vmap`` clients in chunks of 100 (``compile_clients=False``).

Each measurement runs in its own subprocess (a fresh interpreter, so no measurement inflates another's peak):

* ``round``: ms per round (median of ``--rounds`` rounds after 2 warm-up rounds; ``speed.run_round``: what
  ``training_step`` does minus Lightning's logging) for FedAvg and Ditto, ``K ∈ {10^3, 10^4, 10^5}``,
  10 and 100 clients per round; also the data generation time and the peak RSS of the whole process.
* ``eval``: seconds of one validation (``FederatedModule._evaluate("val")``, streamed in chunks of 100) of a
  ``data.eval_clients = N`` sample, ``N ∈ {10^2, 10^3, 10^4}``, at ``K = 10^5`` after one training round.
* ``generate``: the generator alone at each K: seconds, bytes of the tensors, peak RSS.

Peak RSS: the child's ``ru_maxrss`` from ``os.wait4`` (its own ``VmHWM`` is recorded too). Results are appended
to ``benchmarks/results/scale.jsonl`` as they finish (one JSON object per line, keyed by the measurement), so
a re-run skips what is there; ``scale.md`` (table, targets) and ``scale/*.png`` (log-log) are rebuilt from it.

Client state: ``--store memory`` (default) keeps Ditto's personal models in RAM (``model.client_state:
memory``): at K = 10^5 that is 27 GB, so those runs are skipped when they would not fit in half the machine's
memory. ``--store disk`` passes ``client_state="disk"`` (``model.client_state: disk``, rows on disk, only the
round's in memory) with ``--state-dir`` (default: a fresh temporary folder per run, removed after it).

    python -m benchmarks.scale --quick                 # K = 300, 1000; a few rounds: a smoke run (< 2 min)
    python -m benchmarks.scale                         # the full grid, memory store
    python -m benchmarks.scale --store disk            # the full grid with the disk-backed store

Adapters (``--adapters``, issue 40; docs/scale.md "Adapters at scale"): FedSA-LoRA on a LoRA'd TinyTransformer
(:data:`ADAPTER_LM`: vocabulary 64, width 64, 2 blocks, 16 positions; rank-4 adapters on ``qkv``, ``proj`` and
``head``), each client keeping its own ``lora_B`` matrices (2,304 float32 = 9,216 bytes a client) in the memory and
in the disk store, at ``K ∈ {10^3, 10^4}`` (``--ks`` for more), 10 clients per round, on
:func:`adapter_population` (4 training windows and 1 test window of 16 random tokens per client, generated in one
draw). Measured per run, in its own subprocess as above: ms per round, peak RSS, the state's bytes
(``K × 9,216``), the store's resident bytes (the disk store: the template row and 2 bytes a client), the rows
written and the round's bytes on the wire. Results: ``results/scale_adapters.jsonl`` and ``scale_adapters.md``.

    python -m benchmarks.scale --adapters --quick      # K = 300, 1000: a smoke run
    python -m benchmarks.scale --adapters              # K = 1,000 and 10,000, memory and disk store
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO, append_record, records_by_key

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN = (196, 272)  # 60-196-272-10: 68,270 parameters, as W's 784-80-60-10
DIM, CLASSES = 60, 10
ALGORITHMS = {"FedAvg": {"name": "fedavg", "local_lr": 0.001}, "Ditto": {"name": "ditto", "local_lr": 0.001,
                                                                         "lam": 0.1}}
#: the adapters case (``--adapters``): the LoRA'd TinyTransformer and its data
ADAPTER_LM = {"vocab_size": 64, "d_model": 64, "nhead": 4, "num_layers": 2, "max_len": 16}
ADAPTER_LORA = {"targets": ["qkv", "proj", "head"], "rank": 4, "alpha": 8.0}
ADAPTER_WINDOWS = 4  # training windows per client (and one test window)
ADAPTER_ALGORITHM = {"name": "fedsa_lora", "local_steps": 4, "local_lr": 0.1, "batch_size": 4}
#: the targets of the scale issue (checked in scale.md, never in tests)
DITTO_RSS_TARGET_MB = 3000.0  # 3 GB = 3e9 bytes ≈ 2861 MiB; the table shows MB = 10^6 bytes
DITTO_TIME_RATIO = 1.5
FEDAVG_TIME_RATIO = 1.2


# ------------------------------------------------------------------------------------------------
# the child: one measurement
# ------------------------------------------------------------------------------------------------
def _vm_hwm_mb() -> float | None:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        return None
    return None


def _module(algorithm: str, data: Any, per_round: int, store: str, state_dir: str | None) -> tuple[Any, Any]:
    import torch

    from benchmarks.speed import build_algorithm  # W's shared settings: τ = 10, B = 40, one adaptation step
    from lightning_fedmeta import FederatedModule
    from lightning_fedmeta.models.reference import MLP

    torch.manual_seed(0)
    extra: dict[str, Any] = {"client_state": store}
    if store == "disk":
        extra["client_state_dir"] = state_dir
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = FederatedModule(
            model=MLP(DIM, list(HIDDEN), CLASSES, "elu"), algorithm=build_algorithm(ALGORITHMS[algorithm]),
            clients_per_round=per_round, client_chunk_size=100, compile_clients=False, **extra,
        )
    module.attach_data(data)
    assert sum(p.numel() for p in module.model.parameters()) == 68_270
    return module, torch.optim.SGD(module.model.parameters(), lr=1.0)


def adapter_population(num_clients: int, seed: int = 0) -> Any:
    """``num_clients`` next-token clients of :data:`ADAPTER_WINDOWS` training windows and one test window of
    ``max_len`` random tokens each (``FederatedData``, task ``next_token``), drawn in one vectorised call: the data
    cost ``5 × 16 × 2 × 8 = 1,280`` bytes a client and no Python object per client."""
    import torch

    from lightning_fedmeta.data import FederatedData

    vocab, t = ADAPTER_LM["vocab_size"], ADAPTER_LM["max_len"]
    g = torch.Generator().manual_seed(seed)
    train = torch.randint(0, vocab, (num_clients * ADAPTER_WINDOWS, t + 1), generator=g)
    test = torch.randint(0, vocab, (num_clients, t + 1), generator=g)
    return FederatedData(train[:, :-1], train[:, 1:], torch.arange(num_clients + 1) * ADAPTER_WINDOWS,
                         test[:, :-1], test[:, 1:], torch.arange(num_clients + 1), vocab, task="next_token")


def adapter_module(data: Any, per_round: int, store: str, state_dir: str | None) -> Any:
    """FedSA-LoRA (:data:`ADAPTER_ALGORITHM`) on the LoRA'd TinyTransformer, ``model.client_state = store``."""
    import torch

    from lightning_fedmeta import FederatedModule
    from lightning_fedmeta.models.lora import add_lora
    from lightning_fedmeta.models.reference import TinyTransformer

    torch.manual_seed(0)
    model = add_lora(TinyTransformer(**ADAPTER_LM), **ADAPTER_LORA)
    extra: dict[str, Any] = {"client_state": store}
    if store == "disk":
        extra["client_state_dir"] = state_dir
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = FederatedModule(model=model, algorithm=dict(ADAPTER_ALGORITHM), clients_per_round=per_round,
                                 client_chunk_size=100, compile_clients=False, **extra)
    module.attach_data(data)
    return module


def adapter_child(spec: dict[str, Any]) -> dict[str, Any]:
    """The adapters measurement (module docstring): ``spec`` has ``K``, ``per_round``, ``store``, ``rounds``."""
    import statistics

    import torch

    from benchmarks.speed import run_round

    started = time.perf_counter()
    data = adapter_population(spec["K"])
    result: dict[str, Any] = {"generate_s": time.perf_counter() - started}
    tensors = (data.train_x, data.train_y, data.test_x, data.test_y, data.train_offsets, data.test_offsets)
    result["data_mb"] = sum(t.numel() * t.element_size() for t in tensors) / 1e6
    state_dir = spec.get("state_dir") or (tempfile.mkdtemp(prefix="fedmeta_adapters_") if spec["store"] == "disk"
                                           else None)
    try:
        started = time.perf_counter()
        module = adapter_module(data, spec["per_round"], spec["store"], state_dir)
        result["setup_s"] = time.perf_counter() - started
        store = module.client_states
        params = list(module.model.named_parameters())
        result["base_params"] = sum(p.numel() for _, p in params if not p.requires_grad)
        result["adapter_params"] = sum(p.numel() for _, p in params if p.requires_grad)
        result["store"] = type(store).__name__
        result["state_mb"] = store.nbytes() / 1e6
        result["row_bytes"] = store.nbytes() // spec["K"]
        optimizer = torch.optim.SGD([p for _, p in params if p.requires_grad], lr=1.0)
        times, cpu = [], []
        for r in range(2 + spec["rounds"]):
            t0, c0 = time.perf_counter(), time.process_time()
            run_round(module, optimizer, r)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        result["ms_per_round"] = 1e3 * statistics.median(times[2:])
        result["cpu_ms_per_round"] = 1e3 * statistics.median(cpu[2:])
        resident = getattr(store, "resident_bytes", store.nbytes)
        result["store_resident_mb"] = resident() / 1e6
        written = getattr(store, "written", None)
        result["rows_written"] = None if written is None else int(written.sum())
        traffic = module.engine.traffic.last
        if traffic is not None:
            totals = traffic.totals()
            result["up_bytes_per_round"] = totals["comm/up_bytes"]
            result["down_bytes_per_round"] = totals["comm/down_bytes"]
    finally:
        if state_dir and not spec.get("state_dir"):
            shutil.rmtree(state_dir, ignore_errors=True)
    result["vm_hwm_mb"] = _vm_hwm_mb()
    return result


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one measurement (in this fresh process) and return its figures."""
    import statistics

    import torch

    from benchmarks.speed import run_round
    from lightning_fedmeta.data.synthetic_scale import make_synthetic_scale

    torch.set_num_threads(spec["threads"])
    if spec["kind"] == "adapters":
        return adapter_child(spec)
    started = time.perf_counter()
    data = make_synthetic_scale(1.0, 1.0, num_clients=spec["K"], dim=DIM, num_classes=CLASSES, seed=0)
    result: dict[str, Any] = {"generate_s": time.perf_counter() - started}
    tensors = (data.train_x, data.train_y, data.test_x, data.test_y, data.train_offsets, data.test_offsets)
    result["data_mb"] = sum(t.numel() * t.element_size() for t in tensors) / 1e6
    result["samples"] = int(data.train_offsets[-1] + data.test_offsets[-1])
    if spec["kind"] == "generate":
        result["vm_hwm_mb"] = _vm_hwm_mb()
        return result
    state_dir = spec.get("state_dir") or (tempfile.mkdtemp(prefix="fedmeta_scale_") if spec["store"] == "disk"
                                           else None)
    try:
        started = time.perf_counter()
        module, opt = _module(spec["algorithm"], data, spec["per_round"], spec["store"], state_dir)
        result["setup_s"] = time.perf_counter() - started
        result["state_mb"] = module.client_states.nbytes() / 1e6
        result["store"] = type(module.client_states).__name__
        if spec["kind"] == "round":
            times, cpu = [], []
            for r in range(2 + spec["rounds"]):
                t0, c0 = time.perf_counter(), time.process_time()
                run_round(module, opt, r)
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            result["ms_per_round"] = 1e3 * statistics.median(times[2:])
            result["cpu_ms_per_round"] = 1e3 * statistics.median(cpu[2:])  # this process's CPU time: load-proof
            result["ms_rounds"] = [round(1e3 * t, 2) for t in times]
        else:
            run_round(module, opt, 0)
            n = spec["N"]
            module._eval_sample_size = lambda: n  # what data.eval_clients = N gives under a Trainer
            module.model.eval()
            t0, c0 = time.perf_counter(), time.process_time()
            summary = module._evaluate("val", log=False)
            result["eval_s"] = time.perf_counter() - t0
            result["eval_cpu_s"] = time.process_time() - c0
            result["evaluated"] = int(module.last_evaluated.numel())
            result["acc_weighted"] = float(summary["clients"]["acc_weighted"])
    finally:
        if state_dir and not spec.get("state_dir"):
            shutil.rmtree(state_dir, ignore_errors=True)
    result["vm_hwm_mb"] = _vm_hwm_mb()
    return result


# ------------------------------------------------------------------------------------------------
# the parent: the grid, resumable
# ------------------------------------------------------------------------------------------------
def _key(spec: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in sorted(spec.items()) if k not in ("state_dir",)}, sort_keys=True)


def grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.adapters:
        return [{"kind": "adapters", "algorithm": "FedSA-LoRA", "K": k, "per_round": m, "store": store,
                 "rounds": args.rounds, "threads": args.threads}
                for store in args.adapter_stores for m in args.per_round for k in args.ks if m <= k]
    base = {"threads": args.threads, "store": args.store, "rounds": args.rounds}
    specs: list[dict[str, Any]] = [{"kind": "generate", "K": k, "threads": args.threads} for k in args.ks]
    for k in args.ks:
        for algorithm in args.algorithms:
            for m in args.per_round:
                if m <= k:
                    specs.append({**base, "kind": "round", "algorithm": algorithm, "K": k, "per_round": m})
    for algorithm in args.algorithms:
        for n in args.eval_n:
            if n <= args.eval_k:
                specs.append({**base, "kind": "eval", "algorithm": algorithm, "K": args.eval_k, "per_round": 10,
                              "N": n, "rounds": 1})
    return specs


def _memory_mb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e6
    except (ValueError, OSError):
        return float("inf")


def skip_reason(spec: dict[str, Any]) -> str | None:
    """Why a measurement cannot run here (the memory store of Ditto at large K), else None."""
    if spec["kind"] in ("generate", "adapters") or spec.get("store") != "memory" or spec["algorithm"] != "Ditto":
        return None
    need = spec["K"] * 68_270 * 4 / 1e6
    if need > 0.5 * _memory_mb():
        return f"memory store: {need / 1e3:.1f} GB of personal models > half of this machine's memory; use --store disk"
    return None


def run_child(spec: dict[str, Any], state_dir: str | None, timeout: float) -> dict[str, Any]:
    """Run :func:`child` in a subprocess (``python -m benchmarks.scale --child`` in the repository root); its peak
    RSS from ``os.wait4`` (this child's alone)."""
    payload = json.dumps({**spec, "state_dir": None if state_dir is None else os.path.abspath(state_dir)})
    with tempfile.TemporaryFile("w+") as errors:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.scale", "--child", payload], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=errors, text=True)
        started = time.perf_counter()
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        try:
            out = proc.stdout.read()  # type: ignore[union-attr]
        finally:
            _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (Popen.wait would discard it)
            proc.returncode = os.waitstatus_to_exitcode(status)
            killer.cancel()
        errors.seek(0)
        err = errors.read()
    wall = time.perf_counter() - started
    code = proc.returncode
    lines = [line for line in out.splitlines() if line.startswith("SCALE_RESULT ")]
    if code != 0 or not lines:
        tail = (err or out).strip().splitlines()[-3:]
        return {"error": f"exit {code}: {' | '.join(tail)}", "wall_s": wall}
    result = json.loads(lines[-1][len("SCALE_RESULT "):])
    kb = usage.ru_maxrss // 1024 if sys.platform == "darwin" else usage.ru_maxrss
    result["peak_rss_mb"] = kb * 1024 / 1e6
    result["wall_s"] = wall
    return result


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def _fmt(x: Any, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def report(records: list[dict[str, Any]], path_md: Path, plot_dir: Path) -> str:
    """``scale.md`` (tables and the targets) and the log-log PNGs, from the stored records."""
    records = _latest(records)
    rounds = [r for r in records if r["spec"]["kind"] == "round"]
    evals = [r for r in records if r["spec"]["kind"] == "eval"]
    gens = [r for r in records if r["spec"]["kind"] == "generate"]
    adapters = [r for r in records if r["spec"]["kind"] == "adapters"]
    commands = sorted({r.get("command", "python benchmarks/scale.py") for r in records})
    lines = ["# Scale benchmark (`benchmarks/scale.py`)", "", "Commands (each adds its rows to the JSON-lines file "
             "next to this table):", ""] + [f"    {c}" for c in commands] + [""]
    machines = sorted({r["machine"] for r in records})
    lines += [f"Machine: {m}" for m in machines] + [""]
    if adapters:
        lines += adapter_report(adapters)
    if not (rounds or evals or gens):
        text = "\n".join(lines) + "\n"
        path_md.write_text(text)
        return text
    lines += ["Workload S: `synthetic_scale` (Synthetic(1, 1), power-law sizes n_min = 10, γ = 2, cap 500, d = 60), "
              "ELU MLP 60-196-272-10 (68,270 parameters, as W's), τ = 10, B = 40, eager vmap in chunks of 100. "
              "Each row is its own subprocess; peak RSS is the child's `ru_maxrss` (MB = 10^6 bytes, the "
              "interpreter with torch and Lightning included).", ""]
    if gens:
        lines += ["## Generation", "", "| K | samples | tensors MB | seconds | peak RSS MB |",
                  "|---:|---:|---:|---:|---:|"]
        for r in sorted(gens, key=lambda r: r["spec"]["K"]):
            res = r["result"]
            lines.append(f"| {r['spec']['K']:,} | {res.get('samples', 0):,} | {_fmt(res.get('data_mb'))} | "
                         f"{_fmt(res.get('generate_s'), 2)} | {_fmt(res.get('peak_rss_mb'), 0)} |")
        lines.append("")
    if rounds:
        lines += ["## Rounds", "", "ms/round: median wall time; CPU ms/round: the child's CPU time (one torch thread: "
                  "what the round costs, nearly free of other processes' load on a shared machine).", "",
                  "| algorithm | store | K | clients/round | ms/round | CPU ms/round | peak RSS MB | state MB | "
                  "data MB | setup s |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in sorted(rounds, key=lambda r: (r["spec"]["algorithm"], r["spec"]["store"], r["spec"]["per_round"],
                                               r["spec"]["K"])):
            s, res = r["spec"], r["result"]
            if "error" in res or "skipped" in res:
                lines.append(f"| {s['algorithm']} | {s['store']} | {s['K']:,} | {s['per_round']} | "
                             f"{res.get('error') or res.get('skipped')} | | | | | |")
                continue
            lines.append(f"| {s['algorithm']} | {s['store']} | {s['K']:,} | {s['per_round']} | "
                         f"{_fmt(res['ms_per_round'])} | {_fmt(res.get('cpu_ms_per_round'))} | "
                         f"{_fmt(res.get('peak_rss_mb'), 0)} | "
                         f"{_fmt(res.get('state_mb'), 0)} | {_fmt(res.get('data_mb'), 0)} | "
                         f"{_fmt(res.get('setup_s'))} |")
        lines += ["", "### Targets", ""] + targets(rounds) + [""]
    if evals:
        lines += ["## Evaluation vs N (`data.eval_clients`)", "", "One validation (`_evaluate(\"val\")`, streamed in "
                  "chunks of 100 clients, one adaptation step each) after one training round.", "",
                  "| algorithm | store | K | N | seconds | CPU s | ms per client | peak RSS MB |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in sorted(evals, key=lambda r: (r["spec"]["algorithm"], r["spec"]["N"])):
            s, res = r["spec"], r["result"]
            if "error" in res or "skipped" in res:
                lines.append(f"| {s['algorithm']} | {s['store']} | {s['K']:,} | {s['N']:,} | "
                             f"{res.get('error') or res.get('skipped')} | | | |")
                continue
            lines.append(f"| {s['algorithm']} | {s['store']} | {s['K']:,} | {s['N']:,} | {_fmt(res['eval_s'], 2)} | "
                         f"{_fmt(res.get('eval_cpu_s'), 2)} | "
                         f"{_fmt(1e3 * res['eval_s'] / s['N'], 2)} | {_fmt(res.get('peak_rss_mb'), 0)} |")
        lines.append("")
    plot(rounds, evals, plot_dir)
    root = RESULTS.parent.parent
    for png in sorted(plot_dir.glob("*.png")):
        lines.append(f"Plot: `{png.relative_to(root) if png.is_relative_to(root) else png}`  ")
    text = "\n".join(lines) + "\n"
    path_md.write_text(text)
    return text


def adapter_report(records: list[dict[str, Any]]) -> list[str]:
    """The adapters section of the report: one row per (store, K, clients per round), and the growth of the peak
    RSS from the smallest to the largest K of each store against the growth of the state and of the data."""
    lines = ["## Adapters: FedSA-LoRA's personal B matrices per client", "",
             "LoRA'd TinyTransformer (vocabulary 64, width 64, 2 blocks, 16 positions; rank 4 on qkv, proj, head); "
             "each client keeps its own lora_B; 4 + 1 windows of 16 random tokens per client. State MB: "
             "K × adapter bytes per client; store MB: what the store holds in process memory (the disk store: "
             "the template row and 2 bytes a client).", "",
             "| store | K | clients/round | adapter bytes/client | ms/round | CPU ms/round | peak RSS MB | state MB | "
             "store MB | data MB | rows written | up bytes/round |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ordered = sorted(records, key=lambda r: (r["spec"]["store"], r["spec"]["per_round"], r["spec"]["K"]))
    for r in ordered:
        s, res = r["spec"], r["result"]
        if "error" in res or "skipped" in res:
            lines.append(f"| {s['store']} | {s['K']:,} | {s['per_round']} | {res.get('error') or res.get('skipped')} "
                         "| | | | | | | | |")
            continue
        lines.append(f"| {s['store']} | {s['K']:,} | {s['per_round']} | {res['row_bytes']:,} | "
                     f"{_fmt(res['ms_per_round'])} | {_fmt(res.get('cpu_ms_per_round'))} | "
                     f"{_fmt(res.get('peak_rss_mb'), 0)} | {_fmt(res.get('state_mb'), 1)} | "
                     f"{_fmt(res.get('store_resident_mb'), 2)} | {_fmt(res.get('data_mb'), 1)} | "
                     f"{res.get('rows_written') if res.get('rows_written') is not None else '–'} | "
                     f"{res.get('up_bytes_per_round', 0):,} |")
    lines += ["", "### Memory against K", ""]
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in ordered:
        if _ok(r) and r["result"].get("peak_rss_mb"):
            groups.setdefault((r["spec"]["store"], r["spec"]["per_round"]), []).append(r)
    for (store, m), rows in sorted(groups.items()):
        if len(rows) < 2:
            continue
        lo, hi = rows[0], rows[-1]
        grew = hi["result"]["peak_rss_mb"] - lo["result"]["peak_rss_mb"]
        state = hi["result"]["state_mb"] - lo["result"]["state_mb"]
        data = hi["result"]["data_mb"] - lo["result"]["data_mb"]
        lines.append(f"* {store} store, {m}/round: K = {lo['spec']['K']:,} → {hi['spec']['K']:,}: peak RSS "
                     f"{grew:+,.0f} MB, against {state:+,.1f} MB of adapter state and {data:+,.1f} MB of data")
    if lines[-1] == "":
        lines.append("* (needs two values of K of the same store)")
    return lines + [""]


def _latest(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per configuration: the one with the most timed rounds (a re-measurement with ``--rounds``), the
    latest of equals (a ``--fresh`` re-run appends; the file is in measurement order)."""
    best: dict[str, dict[str, Any]] = {}
    for r in records:
        conf = json.dumps({k: v for k, v in sorted(r["spec"].items()) if k != "rounds"}, sort_keys=True)
        if conf not in best or r["spec"].get("rounds", 0) >= best[conf]["spec"].get("rounds", 0):
            best[conf] = r
    return list(best.values())


def _ok(r: dict[str, Any]) -> bool:
    return "error" not in r["result"] and "skipped" not in r["result"]


def targets(rounds: list[dict[str, Any]]) -> list[str]:
    """The issue's targets against the measured rows (largest K against K = 1,000, same store and m)."""
    out = []
    by = {(r["spec"]["algorithm"], r["spec"]["store"], r["spec"]["per_round"], r["spec"]["K"]): r["result"]
          for r in rounds if _ok(r)}
    for (algorithm, store, m, k), res in sorted(by.items()):
        base = by.get((algorithm, store, m, 1000))
        if k != max(kk for (a, s, mm, kk) in by if (a, s, mm) == (algorithm, store, m)) or k == 1000 or base is None:
            continue
        wall = res["ms_per_round"] / base["ms_per_round"]
        ratio = res.get("cpu_ms_per_round", res["ms_per_round"]) / base.get("cpu_ms_per_round", base["ms_per_round"])
        limit = FEDAVG_TIME_RATIO if algorithm == "FedAvg" else DITTO_TIME_RATIO
        line = (f"* {algorithm} ({store} store), {m}/round: CPU ms/round at K = {k:,} ÷ K = 1,000 = {ratio:.2f} "
                f"(target ≤ {limit}: {'met' if ratio <= limit else 'NOT met'}; wall-time ratio {wall:.2f})")
        if algorithm == "Ditto" and m == 10:
            rss = res.get("peak_rss_mb") or 0.0
            verdict = "met" if rss <= DITTO_RSS_TARGET_MB else "NOT met"
            if k != 100_000:
                verdict = f"not measured at K = 100,000 (largest here {k:,})"
            line += f"; peak RSS {rss:,.0f} MB (target ≤ {DITTO_RSS_TARGET_MB:,.0f} MB at K = 100,000: {verdict})"
        out.append(line)
    return out or ["* (needs K = 1,000 and a larger K of the same configuration)"]


def plot(rounds: list[dict[str, Any]], evals: list[dict[str, Any]], plot_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir.mkdir(parents=True, exist_ok=True)
    if rounds:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
        series: dict[str, list[tuple[int, float, float]]] = {}
        for r in rounds:
            if _ok(r):
                s = r["spec"]
                label = f"{s['algorithm']}, {s['per_round']}/round ({s['store']})"
                ms = r["result"].get("cpu_ms_per_round", r["result"]["ms_per_round"])
                series.setdefault(label, []).append((s["K"], ms,
                                                     r["result"].get("peak_rss_mb") or float("nan")))
        for label, points in sorted(series.items()):
            points.sort()
            ks = [p[0] for p in points]
            ax1.plot(ks, [p[1] for p in points], "o-", label=label)
            ax2.plot(ks, [p[2] for p in points], "o-", label=label)
        for ax, title, unit in ((ax1, "CPU ms per round (1 thread)", "ms"), (ax2, "peak RSS", "MB")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("clients K")
            ax.set_ylabel(unit)
            ax.set_title(title)
            ax.grid(True, which="both", alpha=0.3)
        ax2.axhline(DITTO_RSS_TARGET_MB, color="grey", ls="--", lw=1, label="Ditto target (3 GB)")
        ax1.legend(fontsize=7)
        ax2.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plot_dir / "round_vs_clients.png", dpi=110)
        plt.close(fig)
    if evals:
        fig, ax = plt.subplots(figsize=(5.5, 4.2))
        series2: dict[str, list[tuple[int, float]]] = {}
        for r in evals:
            if _ok(r):
                s = r["spec"]
                series2.setdefault(f"{s['algorithm']} ({s['store']}), K = {s['K']:,}", []).append(
                    (s["N"], r["result"].get("eval_cpu_s", r["result"]["eval_s"])))
        for label, points in sorted(series2.items()):
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("clients evaluated N (data.eval_clients)")
        ax.set_ylabel("CPU seconds per validation (1 thread)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plot_dir / "eval_vs_n.png", dpi=110)
        plt.close(fig)


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------
def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="K = 300, 1000; 3 rounds; N up to 300 (smoke run)")
    p.add_argument("--ks", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    p.add_argument("--per-round", type=int, nargs="+", default=[10, 100])
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    p.add_argument("--eval-k", type=int, default=100_000, help="K of the evaluation-vs-N runs")
    p.add_argument("--eval-n", type=int, nargs="*", default=[100, 1_000, 10_000], help="none: no evaluation runs")
    p.add_argument("--rounds", type=int, default=10, help="timed rounds (after 2 warm-up rounds)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each child (1: stable on a shared box)")
    p.add_argument("--store", choices=["memory", "disk", "auto"], default="memory",
                   help="model.client_state of every run (disk: rows on disk, see docs/scale.md)")
    p.add_argument("--state-dir", default=None, help="folder of the disk store (default: a temporary one per run)")
    p.add_argument("--out", type=Path, default=None, help="JSON-lines file (default results/scale.jsonl, "
                   "results/scale_quick.jsonl with --quick)")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--fresh", action="store_true", help="ignore stored results (re-measure everything)")
    p.add_argument("--adapters", action="store_true", help="the adapters case instead of workload S: FedSA-LoRA's "
                   "personal lora_B per client on a LoRA'd TinyTransformer (K = 1,000 and 10,000 unless --ks; "
                   "10 clients per round unless --per-round)")
    p.add_argument("--adapter-stores", nargs="+", choices=["memory", "disk"], default=["disk", "memory"],
                   help="model.client_state of the adapters runs")
    args = p.parse_args(argv)
    given = set(argv if argv is not None else sys.argv[1:])
    if args.adapters:
        if "--ks" not in given:
            args.ks = [1_000, 10_000]
        if "--per-round" not in given:
            args.per_round = [10]
    if args.quick:
        args.ks, args.per_round, args.eval_k, args.eval_n, args.rounds = [300, 1000], [10, 100], 1000, [30, 300], 3
        if args.adapters:
            args.per_round = [10]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.child is not None:
        print("SCALE_RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    suffix = ("_adapters" if args.adapters else "") + ("_quick" if args.quick else "")
    out = args.out or RESULTS / f"scale{suffix}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {} if args.fresh else records_by_key(out)
    machine = f"{platform.node() or 'host'}: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, " \
              f"{_memory_mb() / 1e3:.0f} GB RAM, Python {platform.python_version()}"
    command = " ".join(["python -m benchmarks.scale", *(argv if argv is not None else sys.argv[1:])])
    for spec in grid(args):
        key = _key(spec)
        if key in done:
            continue
        reason = skip_reason(spec)
        result = {"skipped": reason} if reason else run_child(spec, args.state_dir, args.timeout)
        record = {"key": key, "spec": spec, "result": result, "machine": machine, "command": command,
                  "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        append_record(out, record)
        done[key] = record
        print(json.dumps({k: spec[k] for k in spec if k != "threads"}), "->",
              json.dumps({k: v for k, v in result.items() if k != "ms_rounds"}), flush=True)
    text = report(list(done.values()), out.with_suffix(".md"), out.parent / out.stem)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
