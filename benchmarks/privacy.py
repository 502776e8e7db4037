"""Accuracy against privacy: client-level DP-FedAvg (``FederatedModule(dp=...)``) on Fashion-MNIST.

    python -m benchmarks.privacy [--threads 1] [--rounds 200] [--clients 1000] [--cohort 20] [--clip 0.3]
                                 [--sigmas 0 0.3 0.5 0.7 1 1.5 2 3] [--seeds 0 1]
                                 [--algorithms fedavg_ft perfedavg_fo] [--adaptive-clip]
                                 [--root runs/privacy] [--out benchmarks/results/privacy] [--force] [--report-only]

For every algorithm, noise multiplier σ (z) and seed, one run of ``--rounds`` rounds with
``dp = {clip: C, noise_multiplier: σ, delta: δ}`` (a fixed clip, by default C = 0.3, about the median update
norm of the non-private runs; ``--adaptive-clip`` uses Andrew et al.'s adaptive clip from C instead, whose
default count noise σ_b = m/20 refuses σ ≥ m/10), personalised accuracy after the final round (one fine-tune
step of each client from the global model, on its own test data), and ε at δ from the module's accountant
(q = cohort / clients, one step per round; Opacus's RDP analysis). σ = 0 (clipping, no noise, ε = ∞) is the
non-private reference; the untrained model (0 rounds, the same fine-tune step) is the floor. The data: the
Per-FedAvg paper's split (``perfedavg_paper``) with more, smaller clients than the paper's 50: client-level DP
needs a large population for a small ε (ε falls with the sample rate q).

Every finished run is appended, as one JSON object per line, to ``<root>/results.jsonl`` the moment it ends;
a re-run skips a run whose (algorithm, σ, seed, settings) already has a record there and reuses it, so an
interrupted benchmark resumes where it stopped (``--force`` runs everything again). Progress lines give the
run's result, its time and the ETA of the rest. The report is written to ``<out>.md`` (table and settings),
``<out>.csv`` (one row per run) and ``<out>.png`` (accuracy against ε, log-x, one line per algorithm, mean ±
std over seeds; σ = 0 as a dashed line), and the figure is copied to ``docs/images/privacy.png``.

Run it in the background on a shared machine, one thread per run::

    nohup python -m benchmarks.privacy --threads 1 > runs/privacy.log 2>&1 &
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import append_record, limit_threads, quiet_trainer, records_by_key

__all__ = ["ALGORITHMS", "algorithm_spec", "run_one", "main"]

ROOT = Path(__file__).resolve().parents[1]

#: label and hyper-parameters of each compared algorithm (the Per-FedAvg paper's MLP, τ local steps, batch B;
#: both evaluated after one fine-tune step at the same rate on a batch of B)
ALGORITHMS: dict[str, str] = {
    "fedavg_ft": "FedAvg + 1 fine-tune step",
    "perfedavg_fo": "Per-FedAvg (FO)",
}


def algorithm_spec(name: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The ``FederatedModule(algorithm=...)`` mapping of a compared algorithm."""
    common = {"local_steps": settings["local_steps"], "batch_size": settings["batch_size"], "finetune_steps": 1,
              "finetune_lr": settings["finetune_lr"], "finetune_batch_size": settings["batch_size"]}
    if name == "fedavg_ft":
        return {"name": "fedavg", "local_lr": settings["local_lr"], **common}
    if name == "perfedavg_fo":
        return {"name": "perfedavg", "variant": "fo", "alpha": settings["finetune_lr"], "beta": settings["local_lr"],
                **common}
    raise ValueError(f"unknown algorithm {name!r}; choose from {sorted(ALGORITHMS)}")


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "clients": args.clients, "cohort": args.cohort, "rounds": args.rounds,
        "samples_per_class": args.samples_per_class,
        "hidden": list(args.hidden), "local_steps": args.local_steps, "batch_size": args.batch_size,
        "local_lr": args.local_lr, "finetune_lr": args.finetune_lr, "server_lr": args.server_lr,
        "clip": args.clip, "adaptive_clip": args.adaptive_clip, "delta": args.delta, "data_seed": 0,
    }


def _key(algorithm: str, sigma: float | None, seed: int, settings: dict[str, Any]) -> str:
    text = json.dumps({"algorithm": algorithm, "sigma": sigma, "seed": seed, "settings": settings}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_one(
    datamodule: Any, algorithm: str, sigma: float | None, seed: int, settings: dict[str, Any]
) -> dict[str, Any]:
    """One training run; its final personalised accuracy, ε and clipping statistics. ``sigma=None``: the
    untrained model (its initial weights, evaluated after the same fine-tune step; nothing released, ε = 0)."""
    import torch

    from lightning_fedmeta import FederatedModule
    from lightning_fedmeta.models.reference import MLP

    torch.manual_seed(seed)
    model = MLP(784, settings["hidden"], 10, "elu")
    dp = None if sigma is None else {"clip": settings["clip"], "noise_multiplier": sigma, "delta": settings["delta"],
                                     "adaptive_clip": settings["adaptive_clip"]}
    module = FederatedModule(
        model=model, algorithm=algorithm_spec(algorithm, settings), clients_per_round=settings["cohort"],
        aggregation="uniform", server_lr=settings["server_lr"], seed=seed, dp=dp,
        compile_clients=False,  # eager: every run the same code path, no compile time in a run's seconds
    )
    trainer = quiet_trainer(settings["rounds"], log_every_n_steps=1)
    started = time.perf_counter()
    if sigma is None:
        trainer.validate(module, datamodule, verbose=False)
    else:
        trainer.fit(module, datamodule)
    seconds = time.perf_counter() - started
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if sigma is None:
        return {"acc_weighted": metrics["val/acc_weighted"], "acc_mean": metrics["val/acc_mean"],
                "acc_worst10": metrics["val/acc_worst10"], "epsilon": 0.0, "rounds_trained": 0,
                "final_clip": math.nan, "clipped_fraction_last": math.nan, "seconds": seconds}
    return {
        "acc_weighted": metrics["val/acc_weighted"], "acc_mean": metrics["val/acc_mean"],
        "acc_worst10": metrics["val/acc_worst10"],
        "epsilon": module.epsilon_spent(int(trainer.global_step)) if sigma > 0 else math.inf,
        "rounds_trained": int(trainer.global_step), "final_clip": float(module.dp_clip),
        "clipped_fraction_last": metrics.get("dp/clipped_fraction", math.nan), "seconds": seconds,
    }


def _clipped(records: list[dict[str, Any]], algorithm: str, sigma: float) -> str:
    values = [r["clipped_fraction_last"] for r in records if r["algorithm"] == algorithm and r["sigma"] == sigma]
    return f"{statistics.fmean(values):.2f}" if values else ""


def _sigma_order(sigma: float | None) -> float:
    return -1.0 if sigma is None else sigma


def _fmt_sigma(sigma: float | None) -> str:
    return "untrained (0 rounds)" if sigma is None else f"{sigma:g}"


def _fmt_eps(eps: float) -> str:
    return "∞" if math.isinf(eps) else f"{eps:.2f}"


def _groups(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean ± std over seeds of each (algorithm, σ)."""
    out = []
    for algorithm in ALGORITHMS:
        for sigma in sorted({r["sigma"] for r in records if r["algorithm"] == algorithm}, key=_sigma_order):
            runs = [r for r in records if r["algorithm"] == algorithm and r["sigma"] == sigma]
            accs = [r["acc_weighted"] for r in runs]
            out.append({
                "algorithm": algorithm, "sigma": sigma, "epsilon": runs[0]["epsilon"], "seeds": len(runs),
                "acc": statistics.fmean(accs), "std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                "acc_worst10": statistics.fmean(r["acc_worst10"] for r in runs),
                "final_clip": statistics.fmean(r["final_clip"] for r in runs),
                "seconds": statistics.fmean(r["seconds"] for r in runs),
            })
    return out


def write_report(records: list[dict[str, Any]], settings: dict[str, Any], command: str, out: Path) -> None:
    """``<out>.md``, ``<out>.csv`` and ``<out>.png`` (copied to docs/images/privacy.png)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    columns = ["algorithm", "sigma", "seed", "epsilon", "delta", "acc_weighted", "acc_mean", "acc_worst10",
               "final_clip", "clipped_fraction_last", "rounds_trained", "seconds"]
    with open(out.with_suffix(".csv"), "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(columns)
        for r in sorted(records, key=lambda r: (r["algorithm"], _sigma_order(r["sigma"]), r["seed"])):
            sigma = "" if r["sigma"] is None else r["sigma"]
            writer.writerow([r["algorithm"], sigma, r["seed"], r["epsilon"], settings["delta"],
                             *(f"{r[c]:.6g}" if isinstance(r[c], float) else r[c] for c in columns[5:])])
    groups = _groups(records)
    seconds: dict[str, list[float]] = {}
    for r in records:
        if r["sigma"] is not None:
            seconds.setdefault(r["algorithm"], []).append(r["seconds"])
    q = settings["cohort"] / settings["clients"]
    lines = [
        "# Accuracy against privacy: DP-FedAvg on Fashion-MNIST",
        "",
        f"Command: `{command}`",
        "",
        "Personalised accuracy (sample-weighted over clients, one fine-tune step from the global model, each "
        f"client's own test data) after {settings['rounds']} rounds, mean ± std over "
        f"{max((g['seeds'] for g in groups), default=0)} seeds; ε at δ = {settings['delta']:g} from the module's "
        f"accountant (Opacus RDP, sample rate q = {settings['cohort']}/{settings['clients']} = {q:g}, one step per "
        "round; the analysis assumes Poisson sampling of clients while the loop samples fixed-size cohorts, see "
        "docs/reliability.md). σ = 0 clips without noise (ε = ∞): the non-private reference; the untrained model "
        "(0 rounds, the same fine-tune step) is the floor. The runs draw their noise from the seed so that they "
        "reproduce: ε here measures accuracy against privacy at equal noise, and would hold against someone who "
        "knows the seed only with model.dp.secure_mode (docs/security.md).",
        "",
        "| σ (noise multiplier) | ε | " + " | ".join(f"{ALGORITHMS[a]} acc" for a in ALGORITHMS) + " | "
        + " | ".join(f"{ALGORITHMS[a]} worst 10%" for a in ALGORITHMS) + " |",
        "|---|---|" + "---|" * (2 * len(ALGORITHMS)),
    ]
    for sigma in sorted({g["sigma"] for g in groups}, key=_sigma_order):
        row = {g["algorithm"]: g for g in groups if g["sigma"] == sigma}
        eps = next(iter(row.values()))["epsilon"]
        cells = [f"{row[a]['acc']:.4f} ± {row[a]['std']:.4f}" if a in row else "" for a in ALGORITHMS]
        worst = [f"{row[a]['acc_worst10']:.4f}" if a in row else "" for a in ALGORITHMS]
        lines.append(f"| {_fmt_sigma(sigma)} | {_fmt_eps(eps)} | " + " | ".join(cells + worst) + " |")
    lines += [
        "",
        "Settings: " + ", ".join(f"`{k}={v}`" for k, v in settings.items()) + ". Model: the Per-FedAvg paper's MLP "
        f"784-{'-'.join(str(h) for h in settings['hidden'])}-10 (ELU); data: `perfedavg_paper` split with "
        f"{settings['clients']} clients (a = {settings['samples_per_class']} images per class); "
        f"{settings['cohort']} clients per round, uniform weights 1/m, server SGD(lr={settings['server_lr']:g}); "
        + ("adaptive clipping to the median update norm (Andrew et al. 2021, η_C = 0.2, σ_b = m/20) from "
           f"C = {settings['clip']:g}." if settings["adaptive_clip"] else f"fixed clip C = {settings['clip']:g}."),
        "",
        "Fraction of the round's updates that were clipped (‖Δ_i‖ > C), in the final round, mean over seeds "
        "(noise makes the model, and so the updates, larger):",
        "",
        "| σ | " + " | ".join(ALGORITHMS[a] for a in ALGORITHMS) + " |",
        "|---|" + "---|" * len(ALGORITHMS),
        *(f"| {sigma:g} | " + " | ".join(_clipped(records, a, sigma) for a in ALGORITHMS) + " |"
          for sigma in sorted({g["sigma"] for g in groups if g["sigma"] is not None})),
        "",
        "Seconds per training run: " + ", ".join(
            f"{ALGORITHMS[a]} {statistics.fmean(seconds[a]):.0f}" for a in ALGORITHMS if seconds.get(a)
        ) + " (mean over its runs). The whole benchmark: "
        f"{sum(r['seconds'] for r in records) / 60:.0f} min of training and evaluation.",
        "",
        "Timings were measured on a shared 2-core machine (other jobs running, one thread per run): indicative only.",
        "",
    ]
    out.with_suffix(".md").write_text("\n".join(lines))
    _plot(groups, settings, out.with_suffix(".png"))
    images = ROOT / "docs" / "images"
    if images.is_dir():
        shutil.copyfile(out.with_suffix(".png"), images / "privacy.png")


def _plot(groups: list[dict[str, Any]], settings: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2), dpi=120)
    ax = fig.add_subplot()
    colors = {"fedavg_ft": "tab:blue", "perfedavg_fo": "tab:orange"}
    for algorithm, label in ALGORITHMS.items():
        points = sorted((g for g in groups if g["algorithm"] == algorithm and g["sigma"] is not None
                         and math.isfinite(g["epsilon"])),
                        key=lambda g: g["epsilon"])
        color = colors.get(algorithm)
        if points:
            ax.errorbar([g["epsilon"] for g in points], [g["acc"] for g in points], yerr=[g["std"] for g in points],
                        marker="o", capsize=3, color=color, label=label)
            for g in points:
                ax.annotate(f"σ={g['sigma']:g}", (g["epsilon"], g["acc"]), textcoords="offset points",
                            xytext=(4, -11), fontsize=7, color=color)
        reference = [g for g in groups if g["algorithm"] == algorithm and g["sigma"] == 0]
        if reference:
            ax.axhline(reference[0]["acc"], linestyle="--", linewidth=1, color=color,
                       label=f"{label}, σ = 0 (ε = ∞)")
        untrained = [g for g in groups if g["algorithm"] == algorithm and g["sigma"] is None]
        if untrained:
            ax.axhline(untrained[0]["acc"], linestyle=":", linewidth=1, color=color,
                       label=f"{label}, untrained (0 rounds)")
    ax.set_xscale("log")
    ax.set_xlabel(f"ε (δ = {settings['delta']:g}, {settings['rounds']} rounds, q = "
                  f"{settings['cohort']}/{settings['clients']})")
    ax.set_ylabel("personalised accuracy (weighted)")
    ax.set_title("Client-level DP-FedAvg, Fashion-MNIST", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (1 on a shared machine)")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--samples-per-class", type=int, default=10, help="a of the perfedavg_paper split")
    parser.add_argument("--cohort", type=int, default=20, help="clients per round m")
    parser.add_argument("--hidden", type=int, nargs="*", default=[80, 60])
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=40)
    parser.add_argument("--local-lr", type=float, default=0.05, help="FedAvg's local rate, Per-FedAvg's β")
    parser.add_argument("--finetune-lr", type=float, default=0.05, help="the fine-tune rate, Per-FedAvg's α")
    parser.add_argument("--server-lr", type=float, default=1.0)
    parser.add_argument("--clip", type=float, default=0.3, help="C (the initial C with --adaptive-clip)")
    parser.add_argument("--adaptive-clip", action="store_true",
                        help="Andrew et al.'s adaptive clip (σ_b = m/20 refuses σ >= m/10)")
    parser.add_argument("--delta", type=float, default=1e-4)
    parser.add_argument("--sigmas", type=float, nargs="+", default=[0.0, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    parser.add_argument("--root", type=Path, default=ROOT / "runs" / "privacy")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "privacy")
    parser.add_argument("--no-untrained", action="store_true", help="skip the untrained-model reference")
    parser.add_argument("--force", action="store_true", help="run everything again")
    parser.add_argument("--report-only", action="store_true", help="write the report from the stored results")
    args = parser.parse_args(argv)
    limit_threads(args.threads)
    import logging
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")

    settings = _settings(args)
    args.root.mkdir(parents=True, exist_ok=True)
    results_path = args.root / "results.jsonl"
    stored = {} if args.force else records_by_key(results_path)
    sigmas: list[float | None] = [*([] if args.no_untrained else [None]), *args.sigmas]
    plan = [(a, s, seed) for a in args.algorithms for s in sigmas for seed in args.seeds]
    todo = [p for p in plan if _key(*p, settings) not in stored]
    print(f"[privacy] {len(plan)} runs, {len(plan) - len(todo)} stored in {results_path}, {len(todo)} to run",
          flush=True)
    datamodule = None
    if todo and not args.report_only:
        from lightning_fedmeta.data import FederatedDataModule

        datamodule = FederatedDataModule(
            dataset="fashion_mnist", partition="perfedavg_paper", num_clients=args.clients,
            samples_per_class=args.samples_per_class, eval_every=args.rounds, data_seed=0,
        )
        times: dict[tuple[str, bool], list[float]] = {}  # seconds per run, by (algorithm, trained)
        started = time.perf_counter()
        for i, (algorithm, sigma, seed) in enumerate(todo):
            result = run_one(datamodule, algorithm, sigma, seed, settings)
            record = {"key": _key(algorithm, sigma, seed, settings), "algorithm": algorithm, "sigma": sigma,
                      "seed": seed, "settings": settings, **result}
            append_record(results_path, record)
            stored[record["key"]] = record
            times.setdefault((algorithm, sigma is not None), []).append(result["seconds"])
            trained = [t for (_, kind), ts in times.items() if kind for t in ts]
            overall = statistics.fmean(trained) if trained else result["seconds"]
            eta = sum(statistics.fmean(times[(a, s is not None)]) if (a, s is not None) in times
                      else (overall if s is not None else 0.0) for a, s, _ in todo[i + 1:])
            print(f"[privacy] {i + 1}/{len(todo)} {algorithm} σ={_fmt_sigma(sigma)} seed={seed}: acc "
                  f"{result['acc_weighted']:.4f}, ε {_fmt_eps(result['epsilon'])}, C {result['final_clip']:.3g}, "
                  f"{result['seconds']:.0f} s; elapsed {time.perf_counter() - started:.0f} s, ETA {eta:.0f} s",
                  flush=True)
    records = [stored[_key(*p, settings)] for p in plan if _key(*p, settings) in stored]
    if not records:
        print("[privacy] no results to report", flush=True)
        return 1
    given = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--report-only"]
    command = "python -m benchmarks.privacy " + " ".join(given)
    write_report(records, settings, command.strip(), args.out)
    print(f"[privacy] wrote {args.out.with_suffix('.md')}, .csv, .png", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
