"""Personalised accuracy against cumulative upload megabytes, with and without compression (issue 28).

    python -m benchmarks.communication [--threads 1] [--rounds 300] [--seeds 0 1 2]
                                       [--algorithms fedavg_ft perfedavg_hf ditto]
                                       [--compressions none float16 qsgd8 qsgd4 topk1] [--quick] [--report-only]

FedAvg + 1 fine-tune step, Per-FedAvg (HF) and Ditto on the Per-FedAvg paper's Fashion-MNIST split
(:mod:`benchmarks.paper`: 50 users, 10 per round, batch 40, 5 held out; the MLP 784-80-60-10 ELU; the grid cell
τ = 10, α = 0.01, Per-FedAvg's β = 0.001), each upload sent uncompressed, in float16, as 8-bit and 4-bit QSGD
(buckets of 512, one float32 norm each) or as the 1 % largest coordinates with error feedback
(``model.compression``), three seeds. Upload bytes per client and round are the compressor's
:meth:`~lightning_fedmeta.communication.compressors.Compressor.encoded_bytes` of the model's ``d`` parameters (every
algorithm here uploads one delta of the model); the cumulative megabytes at round ``r`` are
``r × m × bytes / 10⁶``. Accuracy is ``val/acc_weighted`` (each client's model after its fine-tune or personal
model, on its test data), recorded every ``--eval-every`` rounds.

Every finished run is appended to ``benchmarks/results/communication.jsonl`` (one JSON line) and skipped on a
re-run. The report: ``benchmarks/results/communication.md`` (final accuracy mean ± std over seeds, total upload
MB, the cheapest configuration within one point of uncompressed, per algorithm) and ``communication.png``
(accuracy against cumulative MB, log-x). ``--quick`` (2 rounds, synthetic clients, one seed, results under
``--out``) is the smoke test of tests/benchmarks/test_communication_benchmark.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import append_record, limit_threads, quiet_trainer, records_by_key
from benchmarks.paper import BATCH, CLIENTS_PER_ROUND, HOLDOUT, NUM_CLIENTS

__all__ = ["ALGORITHMS", "COMPRESSIONS", "algorithm_spec", "main", "run_one", "summarise"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

ALGORITHMS: dict[str, str] = {"fedavg_ft": "FedAvg + FT", "perfedavg_hf": "Per-FedAvg (HF)", "ditto": "Ditto"}
#: label → ``model.compression``
COMPRESSIONS: dict[str, Any] = {
    "none": None,
    "float16": "float16",
    "qsgd8": {"upload": "qsgd", "bits": 8, "bucket_size": 512},
    "qsgd4": {"upload": "qsgd", "bits": 4, "bucket_size": 512},
    "topk1": {"upload": "topk", "fraction": 0.01},
}
TAU, ALPHA, BETA = 10, 0.01, 0.001


def algorithm_spec(name: str) -> dict[str, Any]:
    """The compared algorithm at the paper grid's cell τ = 10, α = 0.01 (one fine-tune step at α, batch 40)."""
    common = {"local_steps": TAU, "batch_size": BATCH, "finetune_steps": 1, "finetune_lr": ALPHA,
              "finetune_batch_size": BATCH}
    if name == "fedavg_ft":
        return {"name": "fedavg", "local_lr": ALPHA, **common}
    if name == "perfedavg_hf":
        return {"name": "perfedavg", "variant": "hf", "alpha": ALPHA, "beta": BETA, "delta": 0.001, **common}
    if name == "ditto":  # the personal model is evaluated; no fine-tune step on top of it
        return {"name": "ditto", "local_lr": ALPHA, "local_steps": TAU, "batch_size": BATCH}
    raise ValueError(f"unknown algorithm {name!r}; choose from {sorted(ALGORITHMS)}")


def _key(algorithm: str, compression: str, seed: int, settings: dict[str, Any]) -> str:
    text = json.dumps({"a": algorithm, "c": compression, "s": seed, "settings": settings}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def upload_bytes(compression: str, numel: int) -> int:
    """One client's upload of ``numel`` float32 values under the named compression."""
    from lightning_fedmeta.communication.compressors import parse_compression

    spec = parse_compression(COMPRESSIONS[compression])
    return 4 * numel if spec is None or spec.upload is None else spec.upload.encoded_bytes(numel)


def run_one(datamodule: Any, algorithm: str, compression: str, seed: int, settings: dict[str, Any],
            model: Any) -> dict[str, Any]:
    """One run: the accuracy after every evaluation, and the upload megabytes up to it."""
    import torch
    from lightning.pytorch.callbacks import Callback

    from lightning_fedmeta import FederatedModule

    curve: list[tuple[int, float]] = []

    class Record(Callback):
        def on_validation_end(self, trainer: Any, module: Any) -> None:
            acc = trainer.callback_metrics.get("val/acc_weighted")
            if acc is not None:
                curve.append((int(trainer.global_step), float(acc)))

    torch.manual_seed(seed)
    net = model()
    numel = sum(p.numel() for p in net.parameters())
    module = FederatedModule(model=net, algorithm=algorithm_spec(algorithm), clients_per_round=settings["cohort"],
                             aggregation="uniform", holdout_clients=settings["holdout"], seed=seed,
                             compression=COMPRESSIONS[compression], compile_clients=False)
    trainer = quiet_trainer(settings["rounds"], callbacks=[Record()])
    started = time.perf_counter()
    trainer.fit(module, datamodule)
    per_round = settings["cohort"] * upload_bytes(compression, numel)
    return {"acc": curve[-1][1] if curve else float("nan"), "curve": [[r, per_round * r / 1e6, a] for r, a in curve],
            "upload_mb": per_round * settings["rounds"] / 1e6, "bytes_per_client_round": per_round
            // settings["cohort"], "params": numel, "seconds": time.perf_counter() - started}


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean ± std over seeds per (algorithm, compression), and each algorithm's cheapest configuration within one
    point of its uncompressed accuracy."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["algorithm"], r["compression"]), []).append(r)
    rows = []
    for (algorithm, compression), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], list(COMPRESSIONS)
                                                                                .index(kv[0][1]))):
        accs = [r["acc"] for r in rs]
        rows.append({"algorithm": algorithm, "compression": compression, "seeds": len(rs),
                     "acc": statistics.fmean(accs), "std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                     "upload_mb": rs[0]["upload_mb"], "within_1pt": False})
    for algorithm in {r["algorithm"] for r in rows}:
        mine = [r for r in rows if r["algorithm"] == algorithm]
        base = next((r for r in mine if r["compression"] == "none"), None)
        if base is None:
            continue
        ok = [r for r in mine if r["acc"] >= base["acc"] - 0.01]
        for r in ok:
            r["within_1pt"] = True
        min(ok, key=lambda r: r["upload_mb"])["cheapest"] = True
    return rows


def write_report(rows: list[dict[str, Any]], settings: dict[str, Any], out: Path, command: str) -> None:
    lines = ["# Accuracy against upload bytes, with compression (issue 28)", "",
             f"Command: `{command}`", "",
             f"Settings: {json.dumps(settings, sort_keys=True)}; accuracy = `val/acc_weighted` after the last round "
             "(mean ± std over seeds); upload MB = rounds × clients per round × one client's encoded upload.", "",
             "| algorithm | compression | seeds | accuracy | upload MB | within 1 pt of none |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        mark = "**cheapest**" if r.get("cheapest") else ("yes" if r["within_1pt"] else "no")
        lines.append(f"| {ALGORITHMS[r['algorithm']]} | {r['compression']} | {r['seeds']} | "
                     f"{100 * r['acc']:.2f} ± {100 * r['std']:.2f} | {r['upload_mb']:.2f} | {mark} |")
    lines += ["", "Cheapest configuration within one point of the uncompressed accuracy:", ""]
    for r in rows:
        if r.get("cheapest"):
            lines.append(f"- {ALGORITHMS[r['algorithm']]}: {r['compression']} ({r['upload_mb']:.2f} MB, "
                         f"{100 * r['acc']:.2f} %)")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def plot(records: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["algorithm"] for r in records})
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, algorithm in zip(axes[0], names, strict=True):
        for compression in COMPRESSIONS:
            runs = [r for r in records if r["algorithm"] == algorithm and r["compression"] == compression]
            if not runs or not runs[0]["curve"]:
                continue
            length = min(len(r["curve"]) for r in runs)
            mb = [runs[0]["curve"][i][1] for i in range(length)]
            acc = [100 * statistics.fmean(r["curve"][i][2] for r in runs) for i in range(length)]
            ax.plot(mb, acc, marker=".", label=compression)
        ax.set_xscale("log")
        ax.set_title(ALGORITHMS[algorithm])
        ax.set_xlabel("cumulative upload (MB)")
        ax.set_ylabel("personalised accuracy (%)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)


def _data(args: argparse.Namespace) -> tuple[Any, Any]:
    from lightning_fedmeta.data import FederatedDataModule
    from lightning_fedmeta.models.reference import MLP

    if args.quick:
        from lightning_fedmeta.testing import tiny_clients, tiny_mlp

        return FederatedDataModule(dataset=tiny_clients(8), eval_every=1), lambda: tiny_mlp()
    datamodule = FederatedDataModule(dataset="fashion_mnist", partition="perfedavg_paper", num_clients=NUM_CLIENTS,
                                     eval_every=args.eval_every, data_seed=0)
    return datamodule, lambda: MLP(784, [80, 60], 10, "elu")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (1 on a shared machine)")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    parser.add_argument("--compressions", nargs="+", default=list(COMPRESSIONS), choices=list(COMPRESSIONS))
    parser.add_argument("--out", type=Path, default=RESULTS / "communication")
    parser.add_argument("--quick", action="store_true", help="smoke test: 2 rounds on tiny clients, one seed")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seeds = 2, args.seeds[:1]
    limit_threads(args.threads)
    import logging
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
    settings = {"rounds": args.rounds, "cohort": 3 if args.quick else CLIENTS_PER_ROUND, "quick": args.quick,
                "holdout": 1 if args.quick else HOLDOUT, "tau": TAU, "alpha": ALPHA, "beta": BETA,
                "eval_every": 1 if args.quick else args.eval_every}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = args.out.with_suffix(".jsonl")
    stored = records_by_key(results)
    plan = [(a, c, s) for a in args.algorithms for c in args.compressions for s in args.seeds]
    todo = [p for p in plan if _key(*p, settings) not in stored]
    print(f"[communication] {len(plan)} runs, {len(plan) - len(todo)} stored in {results}, {len(todo)} to run",
          flush=True)
    if todo and not args.report_only:
        datamodule, model = _data(args)
        for algorithm, compression, seed in todo:
            result = run_one(datamodule, algorithm, compression, seed, settings, model)
            record = {"key": _key(algorithm, compression, seed, settings), "algorithm": algorithm,
                      "compression": compression, "seed": seed, "settings": settings, **result}
            append_record(results, record)
            stored[record["key"]] = record
            print(f"[communication] {algorithm} {compression} seed {seed}: acc {100 * result['acc']:.2f} %, "
                  f"{result['upload_mb']:.2f} MB, {result['seconds']:.0f} s", flush=True)
    records = [stored[k] for k in (_key(*p, settings) for p in plan) if k in stored]
    if records:
        rows = summarise(records)
        shown = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--report-only"]
        command = "python -m benchmarks.communication " + " ".join(shown)
        write_report(rows, settings, args.out, command.strip())
        plot(records, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
