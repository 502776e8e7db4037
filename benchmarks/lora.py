"""Many clients' LoRA adapters over one frozen base: batched against a per-client loop (issue 40).

    python -m benchmarks.lora                          # CPU, size "cpu-small", 8 / 32 / 128 clients, every mode
    python -m benchmarks.lora --quick                  # smoke run: size "tiny", 4 / 8 clients, 1 timed round
    python -m benchmarks.lora --size gpt2-124m --device cuda --clients 8 32 128      # on a GPU

**Model.** A GPT-style :class:`~lightning_fedmeta.models.TinyTransformer` built from a size in :data:`SIZES` (no
weights are read: the base is its seeded initialisation, which costs what pretrained weights cost), with rank-8
adapters (``α = 16``) on every attention projection (``qkv``, ``proj``) and both MLP projections (``mlp.0``,
``mlp.2``) of every block (:func:`~lightning_fedmeta.models.add_lora`); everything else frozen. ``gpt2-124m`` is
GPT-2 small's shape (12 layers, d = 768, 12 heads, vocabulary 50,257, 1,024 positions; the head is not tied to the
embedding, so 163 M parameters, 1.3 M of them adapters).

**Round.** FedAvg over the adapters, ``clients`` clients per round, τ = 2 local SGD steps of ``batch`` sequences of
``seq_len`` tokens (random tokens: speed does not depend on the text). The modes, each in a fresh process per cell:

* ``batched``: the engine's default, clients batched with ``torch.func.vmap`` over the adapters only; the frozen
  base enters ``functional_call`` once, unbatched (``in_dims=None``), shared by every client
  (``client_batching="vmap"``, one chunk, eager: ``compile_clients=False``).
* ``loop``: the same engine with ``client_batching="loop"`` (one client after the other, the base still shared).
* ``torch_loop``: what a per-client framework runs: one model, and for each client ``load_state_dict`` of the global
  adapters, τ steps of ``torch.optim.SGD`` with ``loss.backward()``, the adapter delta added to a weighted sum;
  then the server step. Plain PyTorch, no library code in the timed part.
* ``batched_full``: full fine-tuning batched (no adapters, every parameter trained): what the batched round costs
  when the base is *not* frozen, the per-client copy of every weight that the frozen base avoids.

**Measured.** Seconds per round (median of ``--rounds`` after one warm-up round); peak memory (CUDA:
``torch.cuda.max_memory_allocated`` over the timed rounds, minus what was allocated before them; CPU: the peak
resident set over the timed rounds, ``VmHWM`` reset through ``/proc/self/clear_refs`` before them, minus the
resident set then: ``benchmarks.speed.reset_peak_rss``); bytes per round (the engine's byte
accounting, ``comm/down_bytes + comm/up_bytes``: adapters only; the hand count ``2 · clients · adapter bytes`` for
``torch_loop``). *Naive copies* is the arithmetic of a per-client framework that keeps one full model per client
(PFLlib's and Flower's simulation clients each hold a copy): ``clients × model bytes``, not allocated.

Records are appended to ``benchmarks/results/lora.jsonl`` as each cell finishes (keyed by size, device, clients
and mode; a re-run skips cells already there, ``--force`` re-runs them); the report is ``lora.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO, append_record, git_commit, records_by_key, thread_env, utc_now

__all__ = ["SIZES", "MODES", "build_model", "engine_module", "torch_loop", "measure", "main"]

RESULTS = REPO / "benchmarks" / "results"

#: model sizes: TinyTransformer arguments and the round's batch (sequences per step, tokens per sequence)
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"vocab_size": 64, "d_model": 32, "nhead": 2, "num_layers": 2, "max_len": 16, "batch": 2, "seq_len": 16},
    "cpu-small": {"vocab_size": 256, "d_model": 256, "nhead": 4, "num_layers": 4, "max_len": 64, "batch": 2,
                  "seq_len": 32},
    "gpt2-124m": {"vocab_size": 50257, "d_model": 768, "nhead": 12, "num_layers": 12, "max_len": 1024, "batch": 2,
                  "seq_len": 128},
}
MODES = ("batched", "loop", "torch_loop", "batched_full")
#: adapted modules of every block: attention and MLP projections
TARGETS = ["qkv", "proj", "mlp.0", "mlp.2"]
RANK, ALPHA, LOCAL_STEPS, LR = 8, 16.0, 2, 0.01


def build_model(size: str, adapters: bool) -> Any:
    """The size's TinyTransformer, seeded; with rank-8 adapters on :data:`TARGETS` (base frozen) if ``adapters``."""
    import torch

    from lightning_fedmeta.models import TinyTransformer, add_lora

    spec = {k: v for k, v in SIZES[size].items() if k not in ("batch", "seq_len")}
    torch.manual_seed(0)
    model = TinyTransformer(**spec)
    if adapters:
        add_lora(model, targets=TARGETS, rank=RANK, alpha=ALPHA)
    return model


def _data(size: str, clients: int) -> Any:
    import torch

    from lightning_fedmeta.data.federated import from_client_tensors

    s = SIZES[size]
    n = s["batch"] * LOCAL_STEPS
    g = torch.Generator().manual_seed(1)

    def tokens(rows: int) -> Any:
        return torch.randint(0, s["vocab_size"], (rows, s["seq_len"] + 1), generator=g)

    parts = []
    for _ in range(clients):
        train, test = tokens(n), tokens(1)
        parts.append((train[:, :-1], train[:, 1:], test[:, :-1], test[:, 1:]))
    return from_client_tensors(parts, s["vocab_size"], task="next_token")


class _Meter:
    """Peak memory over a stretch of work: CUDA's allocator peak, or the process's peak resident set on a CPU."""

    def __init__(self, device: Any) -> None:
        import torch

        from benchmarks.speed import peak_rss_mb, reset_peak_rss

        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
        else:
            reset_peak_rss()
            self.base = peak_rss_mb() * 2**20
        self.device = device

    def peak_increase(self) -> int:
        import torch

        from benchmarks.speed import peak_rss_mb

        if self.cuda:
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device) - self.base)
        return int(peak_rss_mb() * 2**20 - self.base)


def engine_module(size: str, clients: int, mode: str, device: Any) -> Any:
    """The FederatedModule of an engine mode (``batched``, ``loop``, ``batched_full``), data attached, on ``device``."""
    from lightning_fedmeta import FederatedModule

    s = SIZES[size]
    model = build_model(size, adapters=mode != "batched_full").to(device)
    m = FederatedModule(model=model, algorithm={"name": "fedavg", "local_steps": LOCAL_STEPS, "local_lr": LR,
                                                 "batch_size": s["batch"]},
                        loss="cross_entropy", clients_per_round=clients,
                        client_batching="loop" if mode == "loop" else "vmap", client_chunk_size=None,
                        compile_clients=False, seed=0)
    m.attach_data(_data(size, clients))
    m.to(device)
    m.engine.place(device)  # the data and client state on the device, as fit's first step does
    return m


def _engine_round(size: str, clients: int, mode: str, device: Any, rounds: int) -> dict[str, Any]:
    import torch

    m = engine_module(size, clients, mode, device)
    optimizer = torch.optim.SGD([p for p in m.model.parameters() if p.requires_grad], lr=1.0)
    report = m.engine.run_round(0, optimizer)  # warm-up
    meter = _Meter(device)
    times = []
    for r in range(1, rounds + 1):
        _sync(device)
        t0 = time.perf_counter()
        report = m.engine.run_round(r, optimizer)
        _sync(device)
        times.append(time.perf_counter() - t0)
    totals = report.traffic.totals()
    return {"seconds": statistics.median(times), "peak_bytes": meter.peak_increase(),
            "round_bytes": totals["comm/up_bytes"] + totals["comm/down_bytes"]}


def torch_loop(size: str, clients: int, device: Any) -> tuple[Any, Any]:
    """A per-client framework's round in plain PyTorch (module docstring, ``torch_loop``): ``(model, one_round)``,
    the LoRA'd model and a function running one round on it in place."""
    import torch
    import torch.nn.functional as F

    s = SIZES[size]
    model = build_model(size, adapters=True).to(device)
    data = _data(size, clients)
    trainable = {k: p for k, p in model.named_parameters() if p.requires_grad}
    offsets = data.train_offsets.tolist()
    xs, ys = data.train_x.to(device), data.train_y.to(device)
    weights = torch.tensor([offsets[i + 1] - offsets[i] for i in range(clients)], dtype=torch.float64)
    weights = (weights / weights.sum()).tolist()

    def one_round() -> None:
        start = {k: p.detach().clone() for k, p in trainable.items()}
        total = {k: torch.zeros_like(p) for k, p in start.items()}
        for i in range(clients):
            with torch.no_grad():
                for k, p in trainable.items():
                    p.copy_(start[k])
            opt = torch.optim.SGD(trainable.values(), lr=LR)
            for t in range(LOCAL_STEPS):
                lo = offsets[i] + t * s["batch"]
                x, y = xs[lo:lo + s["batch"]], ys[lo:lo + s["batch"]]
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
                opt.step()
            with torch.no_grad():
                for k, p in trainable.items():
                    total[k].add_(p - start[k], alpha=weights[i])
        with torch.no_grad():
            for k, p in trainable.items():
                p.copy_(start[k] + total[k])

    return model, one_round


def _torch_loop_round(size: str, clients: int, device: Any, rounds: int) -> dict[str, Any]:
    model, one_round = torch_loop(size, clients, device)
    one_round()  # warm-up
    meter = _Meter(device)
    times = []
    for _ in range(rounds):
        _sync(device)
        t0 = time.perf_counter()
        one_round()
        _sync(device)
        times.append(time.perf_counter() - t0)
    adapter_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return {"seconds": statistics.median(times), "peak_bytes": meter.peak_increase(),
            "round_bytes": 2 * clients * adapter_bytes}


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(size: str, clients: int, mode: str, device: str, rounds: int) -> dict[str, Any]:
    """One cell in this process: seconds per round, peak memory increase, bytes per round, parameter counts."""
    import torch

    from lightning_fedmeta.models import lora_parameter_count

    dev = torch.device(device)
    if mode == "torch_loop":
        row = _torch_loop_round(size, clients, dev, rounds)
    else:
        row = _engine_round(size, clients, mode, dev, rounds)
    model = build_model(size, adapters=True)
    total = sum(p.numel() for p in model.parameters())
    row.update({"parameters": total, "adapter_parameters": lora_parameter_count(model)[0],
                "model_bytes": 4 * total, "torch": torch.__version__,
                "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor()})
    return row


def _run_child(size: str, clients: int, mode: str, device: str, rounds: int, threads: int | None) -> dict[str, Any]:
    code = ("import json; from benchmarks.lora import measure; "
            f"print(json.dumps(measure({size!r}, {clients}, {mode!r}, {device!r}, {rounds})))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env=thread_env(threads))
    if proc.returncode != 0:
        tail = proc.stderr[-3000:]
        if "out of memory" in tail.lower():
            return {"error": "out of memory"}
        raise RuntimeError(f"the cell {size}/{clients}/{mode} failed:\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def report(records: list[dict[str, Any]], command: str) -> str:
    lines = ["# LoRA adapters over a frozen base: batched against a per-client loop", "",
             f"Command: `{command}` (benchmarks/lora.py; records: `lora.jsonl`). FedAvg over rank-8 adapters on the "
             "attention and MLP projections, τ = 2 SGD steps per client; seconds: median per round after a warm-up "
             "round; peak: the increase over the timed rounds (CUDA allocator peak, or CPU peak resident set); "
             "bytes: down + up per round (adapters only). *Naive copies*: one full fp32 model per client, "
             "`clients × model bytes` (arithmetic, not allocated). Each cell in a fresh process.", ""]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["size"], r["device"]), []).append(r)
    for (size, device), rows in sorted(groups.items()):
        first = next((r for r in rows if "parameters" in r), None)
        head = f"## `{size}` on {device}"
        if first is not None:
            head += (f" ({first['device_name'] or device}; {first['parameters']:,} parameters, "
                     f"{first['adapter_parameters']:,} of them adapters; torch {first['torch']})")
        lines += [head, "",
                  "| clients | mode | s / round | vs batched | peak MiB | naive copies MiB | MB / round |",
                  "|---|---|---|---|---|---|---|"]
        by = {(r["clients"], r["mode"]): r for r in rows}
        for clients in sorted({r["clients"] for r in rows}):
            base = by.get((clients, "batched"))
            for mode in MODES:
                r = by.get((clients, mode))
                if r is None:
                    continue
                if "error" in r:
                    lines.append(f"| {clients} | {mode} | {r['error']} | | | | |")
                    continue
                ratio = f"{r['seconds'] / base['seconds']:.2f}×" if base and "seconds" in base else ""
                naive = _mib(clients * r["model_bytes"]) if mode == "torch_loop" else ""
                lines.append(f"| {clients} | {mode} | {r['seconds']:.3f} | {ratio} | {_mib(r['peak_bytes'])} | "
                             f"{naive} | {r['round_bytes'] / 1e6:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu-small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clients", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per cell (after one warm-up round)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads of each cell (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="size tiny, 4 and 8 clients, 1 timed round")
    parser.add_argument("--force", action="store_true", help="re-run cells already recorded")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder of lora.jsonl and lora.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.clients, args.rounds = "tiny", [4, 8], 1
    stem = "lora_quick" if args.quick else "lora"
    path = args.out / f"{stem}.jsonl"
    done = records_by_key(path)
    for clients in args.clients:
        for mode in args.modes:
            key = f"{args.size}/{args.device}/{clients}/{mode}"
            if key in done and not args.force:
                continue
            print(f"[lora] {key} ...", flush=True)
            row = _run_child(args.size, clients, mode, args.device, args.rounds, args.threads)
            record = {"key": key, "size": args.size, "device": args.device, "clients": clients, "mode": mode,
                      "rounds": args.rounds, **row, "commit": git_commit(), "finished": utc_now()}
            append_record(path, record)
            done[key] = record
            print(f"[lora] {key}: {row}", flush=True)
    command = "python -m benchmarks.lora " + " ".join(argv if argv is not None else sys.argv[1:])
    (args.out / f"{stem}.md").write_text(report(list(records_by_key(path).values()), command.strip()),
                                         encoding="utf-8")
    print(f"[lora] report: {args.out / f'{stem}.md'}")


if __name__ == "__main__":
    main()
