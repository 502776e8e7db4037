"""BatchNorm probe: what per-client running statistics are worth on Fashion-MNIST.

The same MLP 784-80-60-10 (ELU) with ``BatchNorm1d`` after each hidden layer, trained by FedAvg with
one fine-tune step (Per-FedAvg paper split: 50 clients, 10 per round, τ = 10, batch 40, lr 0.01),
evaluated per client with its personalised model, three ways:

* ``per-client running stats``: the default since issue 10; each client trains and is evaluated with
  its own running statistics (clients that never trained: the average of the last round's);
* ``batch statistics``: the old behaviour (``torch.func.replace_all_batch_norm_modules_``: every
  forward, evaluation included, normalises with the batch's own statistics);
* ``no BatchNorm``: the same MLP without the layers (the reference).

Each run is one ``fedmeta``-free Trainer fit; its final-round numbers are appended to
``runs/batchnorm/results.jsonl`` as it finishes (a re-run skips finished (variant, seed) pairs), and
the table is written to ``benchmarks/results/batchnorm.md``::

    python -m benchmarks.batchnorm --rounds 100 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

from benchmarks.harness import append_record, quiet_trainer, read_records
from lightning_fedmeta import FederatedModule
from lightning_fedmeta.data import FederatedDataModule

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("per-client running stats", "batch statistics", "no BatchNorm")


def mlp(batch_norm: bool) -> nn.Module:
    layers: list[nn.Module] = [nn.Flatten()]
    width = 784
    for h in (80, 60):
        layers += [nn.Linear(width, h)] + ([nn.BatchNorm1d(h)] if batch_norm else []) + [nn.ELU()]
        width = h
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def run(variant: str, seed: int, rounds: int) -> dict[str, float | str | int]:
    torch.manual_seed(seed)
    model = mlp(variant != "no BatchNorm")
    if variant == "batch statistics":
        torch.func.replace_all_batch_norm_modules_(model)
    module = FederatedModule(
        model,
        {"name": "fedavg", "local_steps": 10, "local_lr": 0.01, "batch_size": 40, "finetune_steps": 1,
         "finetune_lr": 0.01, "finetune_batch_size": 40},
        clients_per_round=10, seed=seed,
    )
    data = FederatedDataModule("fashion_mnist", partition="perfedavg_paper", num_clients=50, eval_every=rounds,
                               data_seed=seed)
    trainer = quiet_trainer(rounds)
    start = time.perf_counter()
    trainer.fit(module, data)
    summary = module.last_summary["clients"]
    return {"variant": variant, "seed": seed, "rounds": rounds, "seconds": round(time.perf_counter() - start, 1),
            "acc_weighted": float(summary["acc_weighted"]), "acc_worst10": float(summary["acc_worst10"])}


def table(results: list[dict]) -> str:
    lines = ["| variant | seeds | final acc (weighted) | final acc (worst 10%) |", "|---|---:|---:|---:|"]
    for variant in VARIANTS:
        rows = [r for r in results if r["variant"] == variant]
        if not rows:
            continue
        acc = torch.tensor([r["acc_weighted"] for r in rows], dtype=torch.float64)
        worst = torch.tensor([r["acc_worst10"] for r in rows], dtype=torch.float64)

        def fmt(t: torch.Tensor) -> str:
            return f"{float(t.mean()):.4f} ± {float(t.std()):.4f}" if t.numel() > 1 else f"{float(t):.4f}"

        lines.append(f"| {variant} | {len(rows)} | {fmt(acc)} | {fmt(worst)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--store", type=Path, default=ROOT / "runs" / "batchnorm" / "results.jsonl")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "batchnorm.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    done = read_records(args.store)
    total = len(VARIANTS) * len(args.seeds)
    for seed in args.seeds:
        for variant in VARIANTS:
            if any(r["variant"] == variant and r["seed"] == seed and r["rounds"] == args.rounds for r in done):
                continue
            print(f"[{len(done) + 1}/{total}] {variant}, seed {seed}, {args.rounds} rounds", flush=True)
            result = run(variant, seed, args.rounds)
            done.append(result)
            append_record(args.store, result)
            print(f"    acc {result['acc_weighted']:.4f}, worst 10% {result['acc_worst10']:.4f}, "
                  f"{result['seconds']} s", flush=True)
    results = [r for r in done if r["rounds"] == args.rounds and r["seed"] in args.seeds]
    args.out.write_text(
        "# BatchNorm: per-client running statistics\n\n"
        f"`python -m benchmarks.batchnorm --rounds {args.rounds} --seeds {' '.join(map(str, args.seeds))}`: "
        "MLP 784-80-60-10 ELU with BatchNorm1d after each hidden layer, FedAvg + 1 fine-tune step, Fashion-MNIST "
        "Per-FedAvg paper split (50 clients, 10 per round, τ = 10, batch 40, lr 0.01), final-round personalised "
        "test accuracy (mean ± std over seeds; a seed changes the split, the initialisation and the sampling).\n\n"
        + table(results) + "\n"
    )
    print(table(results))


if __name__ == "__main__":
    main()
