"""Peak memory of a round with the aggregate streamed and stacked (issue 29: 1000 ResNet-18 clients per round did not
fit an 80 GB GPU because every client's update was stacked before the weighted mean).

    python -m benchmarks.streaming_memory [--clients 50 200 400] [--chunk 20] [--width 1024] [--quick]

Each configuration runs in a fresh process: FedAvg on an MLP ``784 → width → width → 10`` (``width`` 1024: 1.86 M
parameters, 7.5 MB an update), ``clients`` clients per round on synthetic rows, ``client_chunk_size`` = ``chunk``,
one local step of batch 10, vmap, one thread. The process measures its peak resident memory (``ru_maxrss``)
before and after one round; the row shows the increase, the size of the stacked updates ``clients × 4·d`` bytes
for comparison, and the round's seconds. Both modes' parameters after the round are compared (max |difference|:
float reassociation only). Records are appended to ``benchmarks/results/streaming_memory.jsonl`` as each finishes
(a re-run skips those done); the report is ``streaming_memory.md`` and ``streaming_memory.png``. ``--quick``
(width 64, 12 and 24 clients, chunk 4) is a smoke run.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO, append_record, records_by_key, thread_env, utc_now

__all__ = ["main", "measure_round", "run_pair"]

RESULTS = REPO / "benchmarks" / "results"


def measure_round(clients: int, chunk: int, width: int, stream: bool, params_out: str) -> dict[str, Any]:
    """One FedAvg round of ``clients`` clients in this process: the peak-RSS increase in MiB, the seconds, and the
    parameters after the round saved to ``params_out``."""
    import torch
    from torch import nn

    from lightning_fedmeta import FederatedModule
    from lightning_fedmeta.data.federated import from_client_tensors

    torch.manual_seed(0)
    rows = 10
    data = [(torch.randn(rows, 784), torch.randint(0, 10, (rows,)), torch.randn(2, 784), torch.randint(0, 10, (2,)))
            for _ in range(clients)]
    model = nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    m = FederatedModule(model=model, algorithm={"name": "fedavg", "local_steps": 1, "batch_size": rows},
                        clients_per_round=clients, client_batching="vmap", client_chunk_size=chunk,
                        compile_clients=False, seed=0)
    m.attach_data(from_client_tensors(data, 10))
    m.engine.stream_aggregate = stream
    optimizer = torch.optim.SGD(m.model.parameters(), lr=1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    m.engine.run_round(0, optimizer)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.save({k: v.clone() for k, v in m.engine.global_params().items()}, params_out)
    numel = sum(p.numel() for p in model.parameters())
    return {"peak_increase_mib": (after - before) / 1024, "seconds": seconds, "parameters": numel,
            "stacked_mib": clients * numel * 4 / 2**20}


def _run_child(clients: int, chunk: int, width: int, stream: bool, params_out: str) -> dict[str, Any]:
    """:func:`measure_round` in a fresh one-thread process (a fresh peak)."""
    code = ("import json, sys; from benchmarks.streaming_memory import measure_round; "
            f"print(json.dumps(measure_round({clients}, {chunk}, {width}, {stream}, {params_out!r})))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          env=thread_env(1))
    if proc.returncode != 0:
        raise RuntimeError(f"the measurement failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_pair(clients: int, chunk: int, width: int) -> dict[str, Any]:
    """Both modes for one cohort size, and the largest parameter difference between them."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        rows = {mode: _run_child(clients, chunk, width, mode == "streamed", f"{tmp}/{mode}.pt")
                for mode in ("streamed", "stacked")}
        a, b = torch.load(f"{tmp}/streamed.pt"), torch.load(f"{tmp}/stacked.pt")
        diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    return {"key": f"{width}/{clients}/{chunk}", "clients": clients, "chunk": chunk, "width": width,
            "streamed": rows["streamed"],
            "stacked": rows["stacked"], "max_param_diff": diff, "finished": utc_now()}


def report(records: list[dict[str, Any]], command: str) -> str:
    lines = [
        "# Peak memory of one round: the aggregate streamed and stacked", "",
        f"Command: `{command}` (benchmarks/streaming_memory.py; records: `streaming_memory.jsonl`).", "",
        "![peak memory against clients per round](streaming_memory.png)", "",
        "FedAvg, an MLP 784 → width → width → 10, one local step of batch 10, vmap in chunks, one thread, CPU. "
        "Peak RSS increase over the round, in a fresh process per cell. *Stacked updates* is what holding every "
        "client's update costs (clients × 4·d bytes).", "",
        "| clients | chunk | parameters | stacked updates (MiB) | peak increase, stacked (MiB) | "
        "peak increase, streamed (MiB) | seconds stacked / streamed | max param diff |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(records, key=lambda r: (r["width"], r["clients"])):
        s, t = r["streamed"], r["stacked"]
        lines.append(f"| {r['clients']} | {r['chunk']} | {s['parameters']:,} | {s['stacked_mib']:.0f} | "
                     f"{t['peak_increase_mib']:.0f} | {s['peak_increase_mib']:.0f} | "
                     f"{t['seconds']:.2f} / {s['seconds']:.2f} | {r['max_param_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def plot(records: list[dict[str, Any]], out: Path) -> None:
    """Peak-RSS increase of the round against clients per round, stacked and streamed (one line per width)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for width in sorted({r["width"] for r in records}):
        rows = sorted((r for r in records if r["width"] == width), key=lambda r: r["clients"])
        clients = [r["clients"] for r in rows]
        for mode, style in (("stacked", "o-"), ("streamed", "s-")):
            ax.plot(clients, [r[mode]["peak_increase_mib"] for r in rows], style,
                    label=f"{mode} (width {width}, {rows[0]['streamed']['parameters']:,} parameters)")
        ax.plot(clients, [r["streamed"]["stacked_mib"] for r in rows], ":", color="grey",
                label="every client's update (clients × 4·d bytes)")
    ax.set_xlabel("clients per round")
    ax.set_ylabel("peak RSS increase over the round (MiB)")
    ax.set_title("One FedAvg round (CPU): aggregate stacked or streamed", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[50, 200, 400])
    parser.add_argument("--chunk", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="width 64, 12 and 24 clients, chunk 4 (smoke test)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.chunk, args.width = [12, 24], 4, 64
    args.results.mkdir(parents=True, exist_ok=True)
    path = args.results / "streaming_memory.jsonl"
    done = records_by_key(path)
    for clients in args.clients:
        if f"{args.width}/{clients}/{args.chunk}" in done:
            continue
        record = run_pair(clients, args.chunk, args.width)
        append_record(path, record)
        done[record['key']] = record
        print(f"[streaming_memory] {clients} clients: stacked +{record['stacked']['peak_increase_mib']:.0f} MiB, "
              f"streamed +{record['streamed']['peak_increase_mib']:.0f} MiB", flush=True)
    command = "python -m benchmarks.streaming_memory " + " ".join(argv if argv is not None else sys.argv[1:])
    (args.results / "streaming_memory.md").write_text(report(list(done.values()), command.strip()))
    plot(list(done.values()), args.results / "streaming_memory.png")


if __name__ == "__main__":
    main()
