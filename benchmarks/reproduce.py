"""Reproduce the Per-FedAvg paper's experiment grid as one resumable benchmark (issue 14).

    python -m benchmarks.reproduce [--jobs 2] [--threads 1] [--rounds 1000] [--seeds 0 1 2]
                                    [--methods M ...] [--cells tau10_alpha0.001 ...]
                                    [--dataset fashion_mnist | --dataset mnist --root DIR]
                                    [--results DIR] [--runs DIR] [--report-only] [--write-configs]

The grid (Fallah, Mokhtari, Ozdaglar, "Personalized Federated Learning with Theoretical Guarantees:
A Model-Agnostic Meta-Learning Approach", NeurIPS 2020, §6): τ ∈ {4, 10} local steps × α ∈ {0.001,
0.01} for Per-FedAvg FO, HF and exact and for the matched baseline, FedAvg whose local rate is α plus
one fine-tune step at α. Setting: MLP 784-80-60-10 ELU, n = 50 users on the paper's split
(``partition: perfedavg_paper``), 10 users (r = 0.2) per round, batch 40, β = 0.001, 1000 rounds,
every model evaluated after one SGD step of local adaptation at rate α on a batch of 40
(``finetune_steps: 1``), 5 users held out as new clients (``model.holdout_clients: 5``).

One config per cell and method lives in ``configs/paper/<method>_tau<τ>_alpha<α>.yaml``, written by
:func:`render_config` (``--write-configs`` rewrites them; a run refuses a config that differs from
the generator, so the committed files and this script cannot drift apart). Each run is

    fedmeta fit --config CELL --seed_everything S --data.data_seed S --model.seed S --trainer.max_steps R

in its own process (``python -m lightning_fedmeta.cli``; with ``--dataset mnist --root DIR`` also
``--data.dataset mnist --data.root DIR``): the seed changes the split, the initialisation and the
client sampling. The run's numbers are read from what ``fedmeta fit`` writes, the log dir's
``fedmeta_history.json`` (lightning_fedmeta/frontends/callbacks.py ``PlotCallback``), never re-computed here:

* final-round sample-weighted mean, unweighted mean and worst-decile accuracy of the training
  clients (``val/acc_weighted``, ``val/acc_mean``, ``val/acc_worst10`` of the last evaluation, which
  must be round R), and of the 5 new clients (``val/new/acc_weighted``);
* the best evaluated round of ``val/acc_weighted`` (secondary: choosing it looks at test data);
* the per-client accuracies of the final evaluation and the accuracy at every evaluated round;
* the process's wall time and the gradient evaluations per client per round
  (``benchmarks/accuracy.py`` :func:`grad_evals_per_round`).

Each finished run is appended as one JSON line to ``<results>/runs_<dataset>[_<R>rounds].jsonl`` the moment it
finishes; a re-run skips a run whose (config file hash, seed, rounds, dataset, root) already has a
successful record, so an interrupted grid resumes where it stopped. Failures are recorded and retried.
At most ``--jobs`` runs go at once, each with ``--threads`` OMP/MKL threads.

The report (:func:`write_report`) goes to ``benchmarks/results/reproduction[_<dataset>][_<R>rounds].md``
and ``.csv`` (no suffix for Fashion-MNIST and 1000 rounds, so a quick ``--rounds`` check never
overwrites the grid's files) and PNGs under ``<results>/``: accuracy vs round with a band
over seeds per method, the τ × α heat-map per method, and the per-client accuracy box plot per
method. Missing runs are reported as missing. The only numbers typed in by hand are the published
re-implementation's MNIST accuracies (:data:`PUBLISHED`, quoted in issue 14).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import equal_work as ew
from benchmarks.accuracy import grad_evals_per_round
from benchmarks.harness import REPO, append_record, fit_record, fmt_duration, mean_std, pct, read_records, sha256_text
from benchmarks.paper import BATCH, CLIENTS_PER_ROUND, HOLDOUT, NUM_CLIENTS, ROUNDS, SEEDS

__all__ = [
    "ALPHAS",
    "METHODS",
    "PUBLISHED",
    "TAUS",
    "Run",
    "cell_name",
    "config_path",
    "grid",
    "main",
    "paired_differences",
    "render_config",
    "run_one",
    "summarise",
    "tuned_rows",
    "write_configs",
    "write_report",
]

CONFIG_DIR = Path("configs/paper")
TAUS: tuple[int, ...] = (4, 10)
ALPHAS: tuple[float, ...] = (0.001, 0.01)
BETA = 0.001
DELTA = 0.001
EVAL_EVERY = 10

#: method -> (label, algorithm block without the rates and τ)
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "perfedavg_fo": ("Per-FedAvg (FO)", {"name": "perfedavg", "variant": "fo"}),
    "perfedavg_hf": ("Per-FedAvg (HF)", {"name": "perfedavg", "variant": "hf"}),
    "perfedavg_exact": ("Per-FedAvg (exact)", {"name": "perfedavg", "variant": "exact"}),
    "fedavg_ft": ("FedAvg + 1 fine-tune step", {"name": "fedavg"}),
}

#: The published re-implementation's MNIST accuracies (%), quoted in issue 14 ("A published
#: re-implementation reports on MNIST, Per-FedAvg FO / HF: ..."): (method, τ, α) -> accuracy.
PUBLISHED: dict[tuple[str, int, float], float] = {
    ("perfedavg_fo", 10, 0.001): 89.98, ("perfedavg_hf", 10, 0.001): 89.35,
    ("perfedavg_fo", 10, 0.01): 70.22, ("perfedavg_hf", 10, 0.01): 60.12,
    ("perfedavg_fo", 4, 0.001): 87.14, ("perfedavg_hf", 4, 0.001): 86.38,
    ("perfedavg_fo", 4, 0.01): 73.81, ("perfedavg_hf", 4, 0.01): 72.17,
}

Run = tuple[str, int, float, int]  # (method, τ, α, seed)


def cell_name(tau: int, alpha: float) -> str:
    """``tau<τ>_alpha<α>``, e.g. ``tau10_alpha0.001``."""
    return f"tau{tau}_alpha{alpha:g}"


def config_path(method: str, tau: int, alpha: float) -> Path:
    """The committed config of one method and cell, relative to the repository root."""
    return CONFIG_DIR / f"{method}_{cell_name(tau, alpha)}.yaml"


def _algorithm_block(method: str, tau: int, alpha: float) -> dict[str, Any]:
    base = dict(METHODS[method][1])
    if base["name"] == "perfedavg":
        base.update(alpha=alpha, beta=BETA)
        if base["variant"] == "hf":
            base["delta"] = DELTA
    else:  # FedAvg: local rate α, the matched baseline
        base["local_lr"] = alpha
    base.update(local_steps=tau, batch_size=BATCH, finetune_steps=1, finetune_lr=alpha, finetune_batch_size=BATCH)
    return base


def render_config(method: str, tau: int, alpha: float) -> str:
    """The YAML text of one cell's config (usable alone with ``fedmeta fit --config``)."""
    if method not in METHODS:
        raise ValueError(f"--methods: unknown method {method!r}; choose from {list(METHODS)}")
    algo = _algorithm_block(method, tau, alpha)
    evals = grad_evals_per_round(algo["name"], {k: v for k, v in algo.items() if k != "name"})
    label = METHODS[method][0]
    rate = "α" if algo["name"] == "perfedavg" else "local rate α"
    lines = [
        f"# {label}, Per-FedAvg paper grid cell τ = {tau}, {rate} = {alpha:g} (issue 14; Fallah et al. 2020 §6).",
        f"# n = {NUM_CLIENTS} users (perfedavg_paper split), {CLIENTS_PER_ROUND} per round (r = 0.2), batch {BATCH},"
        + (f" β = {BETA:g}," if algo["name"] == "perfedavg" else "") + f" {ROUNDS} rounds,",
        f"# MLP 784-80-60-10 ELU, uniform aggregation (Algorithm 1), {HOLDOUT} users held out as new clients;",
        f"# every model evaluated after one SGD step at rate α = {alpha:g} on a batch of {BATCH} of the client's data.",
        f"# Work: {evals} gradient evaluations per client per round (benchmarks/accuracy.py grad_evals_per_round).",
        "# Generated by benchmarks/reproduce.py --write-configs; the driver overrides the seed:",
        f"#   fedmeta fit --config {config_path(method, tau, alpha).as_posix()} "
        "--seed_everything S --data.data_seed S --model.seed S",
        "seed_everything: 0",
        "trainer:",
        f"  max_steps: {ROUNDS}",
        "  accelerator: cpu",
        "model:",
        "  algorithm:",
        *[f"    {k}: {v if not isinstance(v, float) else f'{v:g}'}" for k, v in algo.items()],
        "  aggregation: uniform   # Per-FedAvg Algorithm 1: w ← (1/|S|) Σ_{i∈S} w_i",
        f"  clients_per_round: {CLIENTS_PER_ROUND}",
        f"  holdout_clients: {HOLDOUT}",
        "  seed: 0",
        "  model:",
        "    class_path: lightning_fedmeta.models.MLP",
        "    init_args: {in_features: 784, hidden: [80, 60], num_classes: 10, activation: elu}",
        "data:",
        "  dataset: fashion_mnist",
        "  partition: perfedavg_paper",
        f"  num_clients: {NUM_CLIENTS}",
        f"  eval_every: {EVAL_EVERY}",
        "  data_seed: 0",
    ]
    return "\n".join(lines) + "\n"


def grid(methods: list[str] | None = None, cells: list[str] | None = None) -> list[tuple[str, int, float]]:
    """Every (method, τ, α) of the grid, optionally restricted to ``methods`` and ``cells`` names."""
    known = {cell_name(t, a) for t in TAUS for a in ALPHAS}
    for c in cells or []:
        if c not in known:
            raise ValueError(f"--cells: unknown cell {c!r}; choose from {sorted(known)}")
    for m in methods or []:
        if m not in METHODS:
            raise ValueError(f"--methods: unknown method {m!r}; choose from {list(METHODS)}")
    return [
        (m, t, a)
        for t in TAUS
        for a in ALPHAS
        for m in METHODS
        if (not methods or m in methods) and (not cells or cell_name(t, a) in cells)
    ]


def write_configs(root: Path = REPO) -> list[Path]:
    """Write every cell's config under ``root/configs/paper/``; return the paths written."""
    out = []
    for m, t, a in grid():
        p = root / config_path(m, t, a)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(render_config(m, t, a))
        out.append(p)
    return out


# -- running ---------------------------------------------------------------------------------------
def _key(rec: dict[str, Any]) -> tuple[Any, ...]:
    return (rec.get("config"), rec.get("config_sha256"), rec.get("seed"), rec.get("rounds"),
            rec.get("dataset"), rec.get("root"))


def run_one(run: Run, rounds: int, runs_dir: Path, dataset: str, root: str | None,
            threads: int | None) -> dict[str, Any]:
    """Run one (method, τ, α, seed) through the CLI and return its record (``error`` set on failure)."""
    method, tau, alpha, seed = run
    cfg = config_path(method, tau, alpha)
    text = (REPO / cfg).read_text()
    if text != render_config(method, tau, alpha):
        raise ValueError(f"{cfg} differs from render_config(); run `python -m benchmarks.reproduce --write-configs`")
    group = dataset + ("" if rounds == ROUNDS else f"_{rounds}rounds")
    out_dir = runs_dir.resolve() / group / f"{method}_{cell_name(tau, alpha)}" / f"seed{seed}"
    overrides = ["--seed_everything", str(seed), "--data.data_seed", str(seed), "--model.seed", str(seed),
                 "--trainer.max_steps", str(rounds)]
    if dataset != "fashion_mnist":
        overrides += ["--data.dataset", dataset]
    if root is not None:
        overrides += ["--data.root", root]
    algo = _algorithm_block(method, tau, alpha)
    rec: dict[str, Any] = {
        "method": method, "tau": tau, "alpha": alpha, "seed": seed, "rounds": rounds, "dataset": dataset,
        "root": root, "config": cfg.as_posix(), "config_sha256": sha256_text(text),
        "grad_evals_per_client_round": grad_evals_per_round(algo["name"], {k: v for k, v in algo.items()
                                                                          if k != "name"}),
    }
    return rec | fit_record(cfg.as_posix(), out_dir, rounds, overrides, threads=threads, cwd=REPO)


# -- report ----------------------------------------------------------------------------------------
def summarise(records: list[dict[str, Any]], rounds: int, seeds: list[int], dataset: str,
              root: str | None = None) -> list[dict[str, Any]]:
    """One row per (method, τ, α) of the grid: mean and sample std over the finished seeds.

    Only successful records of ``rounds`` rounds, of the seeds asked for and of the current config
    text are counted; a cell without any has ``None`` values (reported as missing).
    """
    latest: dict[tuple[str, int, float, int], dict[str, Any]] = {}
    for r in records:
        if "error" in r or r.get("rounds") != rounds or r.get("dataset") != dataset or r.get("seed") not in seeds:
            continue
        if r.get("root") != root:
            continue
        cfg = config_path(r["method"], r["tau"], r["alpha"])
        if r["method"] not in METHODS or r.get("config_sha256") != sha256_text(render_config(r["method"], r["tau"],
                                                                                          r["alpha"])):
            continue
        latest[(r["method"], r["tau"], r["alpha"], r["seed"])] = r | {"config": cfg.as_posix()}
    rows = []
    for m, t, a in grid():
        runs = [latest[(m, t, a, s)] for s in seeds if (m, t, a, s) in latest]
        row: dict[str, Any] = {"method": m, "label": METHODS[m][0], "tau": t, "alpha": a,
                               "seeds_done": len(runs), "seeds_asked": len(seeds)}
        for key in ("acc_weighted", "acc_worst10", "new_acc_weighted", "best_acc_weighted", "wall_s"):
            mean, std = mean_std([r[key] for r in runs if isinstance(r.get(key), (int, float))])
            row[f"{key}_mean"], row[f"{key}_std"] = mean, std
        row["best_rounds"] = [r["best_round"] for r in runs]
        algo = _algorithm_block(m, t, a)
        row["grad_evals_per_client_round"] = grad_evals_per_round(
            algo["name"], {k: v for k, v in algo.items() if k != "name"})
        row["published_mnist"] = PUBLISHED.get((m, t, a))
        row["runs"] = runs
        rows.append(row)
    return rows


def tuned_rows(seeds: list[int], rounds: int, dataset: str) -> list[dict[str, Any]]:
    """The grid's second baseline, FedAvg at a validation-tuned local rate + 1 fine-tune step at α, one row per
    cell in :func:`summarise`'s format, read from ``benchmarks/equal_work.py``'s records of ``dataset`` (which
    tune and run it for 1000 rounds: ``python -m benchmarks.equal_work --dataset D``; no rows for another
    length)."""
    if rounds != ROUNDS:
        return []
    entries = [e for e in ew.ENTRIES.values() if e.cell is not None]
    sweep = read_records(REPO / ew.RESULTS / f"sweep_{dataset}.jsonl")
    final = read_records(REPO / ew.RESULTS / f"final_{dataset}.jsonl")
    rows = []
    for r in ew.summarise(entries, sweep, final, seeds, dataset):
        t, a = r["cell"]
        row = {k: r[k] for k in r if k.endswith(("_mean", "_std"))}
        row.update(method="fedavg_tuned", label="FedAvg (tuned rate) + 1 fine-tune step", tau=t, alpha=a,
                   seeds_done=r["seeds_done"], seeds_asked=r["seeds_asked"], runs=r["runs"],
                   best_rounds=[x["best_round"] for x in r["runs"]], grad_evals_per_client_round=t,
                   published_mnist=None, tuned_rate=None if r["winner"] is None else r["winner"]["algorithm.local_lr"])
        rows.append(row)
    return rows


def _pp(v: float | None) -> str:
    """``v`` (a fraction) in percent, ``n/a`` when absent."""
    return "n/a" if v is None else f"{100 * v:.2f}%"


def paired_differences(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell and Per-FedAvg variant: its final weighted accuracy minus FedAvg + fine-tune's, seed by seed.

    A seed fixes the split, the initialisation and the sampling for both methods, so the difference
    d_s = acc(Per-FedAvg, s) − acc(FedAvg + FT, s) is paired; the row gives the seeds where both
    finished, mean(d_s) and its sample std (``None`` with fewer than 2 seeds).
    """
    by = {(r["method"], r["tau"], r["alpha"]): r for r in rows}
    out = []
    for t in TAUS:
        for a in ALPHAS:
            base = {r["seed"]: r["acc_weighted"] for r in (by.get(("fedavg_ft", t, a)) or {}).get("runs", [])}
            for m in METHODS:
                if m == "fedavg_ft":
                    continue
                mine = {r["seed"]: r["acc_weighted"] for r in (by.get((m, t, a)) or {}).get("runs", [])}
                seeds = sorted(set(base) & set(mine))
                diffs = [mine[s] - base[s] for s in seeds]
                mean, std = mean_std(diffs)
                out.append({"method": m, "tau": t, "alpha": a, "seeds": seeds, "diff_mean": mean, "diff_std": std})
    return out


def _paired_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## Per-FedAvg minus FedAvg + 1 fine-tune step at the same α and τ (paired by seed)",
        "",
        "Percentage points of final-round weighted accuracy; mean ± sample std of the per-seed differences "
        "(a seed fixes split, initialisation and sampling for both), over the seeds where both finished.",
        "",
        "| method | τ | α | seeds | Per-FedAvg − FedAvg+FT |",
        "|---|---|---|---|---|",
    ]
    for d in paired_differences(rows):
        lines.append(f"| {METHODS[d['method']][0]} | {d['tau']} | {d['alpha']:g} | {len(d['seeds'])} "
                     f"| {pct(d['diff_mean'], d['diff_std'], signed=True)} |")
    return lines


def _suffix(dataset: str, rounds: int) -> str:
    """``""`` for the paper's run (Fashion-MNIST, 1000 rounds), else ``_<dataset>`` and/or ``_<R>rounds``:
    a quick check never overwrites the grid's records or report."""
    return ("" if dataset == "fashion_mnist" else f"_{dataset}") + ("" if rounds == ROUNDS else f"_{rounds}rounds")


def _report_names(dataset: str, rounds: int) -> str:
    return "reproduction" + _suffix(dataset, rounds)


def write_report(rows: list[dict[str, Any]], out_dir: Path, png_dir: Path, dataset: str, rounds: int,
                 command: str) -> tuple[Path, Path]:
    """Write ``reproduction[_<dataset>].md`` / ``.csv`` into ``out_dir`` and the PNGs into ``png_dir``."""
    name = _report_names(dataset, rounds)
    out_dir.mkdir(parents=True, exist_ok=True)
    png_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out_dir / f"{name}.csv", out_dir / f"{name}.md"
    fields = ["method", "tau", "alpha", "seeds_done", "seeds_asked", "acc_weighted_mean", "acc_weighted_std",
              "acc_worst10_mean", "acc_worst10_std", "new_acc_weighted_mean", "new_acc_weighted_std",
              "best_acc_weighted_mean", "best_acc_weighted_std", "best_rounds", "grad_evals_per_client_round",
              "wall_s_mean", "published_mnist"]
    with csv_path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (" ".join(map(str, r[k])) if k == "best_rounds" else ("" if r[k] is None else r[k]))
                        for k in fields})
    pngs = _plots(rows, png_dir, dataset, rounds)
    done = sum(r["seeds_done"] for r in rows)
    total = sum(r["seeds_asked"] for r in rows)
    rel = os.path.relpath(png_dir, out_dir)
    lines = [
        f"# Per-FedAvg paper grid on {dataset} ({rounds} rounds)",
        "",
        "Generated by `benchmarks/reproduce.py` (issue 14); do not edit by hand. Setting: docs/reproduction.md.",
        f"Runs finished: {done} of {total}. Command: `{command}`",
        "",
        "Accuracies in %, final round, personalised (one SGD step at rate α on a batch of 40 before testing), "
        "mean ± sample std over seeds; `missing` = no finished run. *weighted*: sample-weighted mean over the "
        f"{NUM_CLIENTS - HOLDOUT} training clients; *worst 10%*: mean of the worst decile of them; *new*: "
        f"sample-weighted mean over the {HOLDOUT} held-out clients; *best round*: the best evaluated round's "
        "weighted accuracy (secondary: picking it looks at test data); *published*: the re-implementation's "
        "MNIST numbers quoted in issue 14 (a different dataset unless this table is MNIST). *FedAvg (tuned "
        "rate)*: τ local steps at the local rate chosen on validation data (never test data) by "
        "`benchmarks/equal_work.py`, whose report `equal_work.md` has the sweep and the paired margins.",
        "",
        "| method | τ | α | seeds | acc (weighted) | worst 10% | new clients | best round (secondary) "
        "| grad evals / client / round | wall s / run | published (MNIST) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        best = pct(r["best_acc_weighted_mean"], r["best_acc_weighted_std"])
        if r["best_rounds"]:
            best += f" @ {', '.join(map(str, r['best_rounds']))}"
        wall = "missing" if r["wall_s_mean"] is None else f"{r['wall_s_mean']:.0f}"
        pub = "—" if r["published_mnist"] is None else f"{r['published_mnist']:.2f}"
        label = r["label"] + (f" (local rate {r['tuned_rate']:g})" if r.get("tuned_rate") is not None else "")
        lines.append(
            f"| {label} | {r['tau']} | {r['alpha']:g} | {r['seeds_done']}/{r['seeds_asked']} "
            f"| {pct(r['acc_weighted_mean'], r['acc_weighted_std'])} "
            f"| {pct(r['acc_worst10_mean'], r['acc_worst10_std'])} "
            f"| {pct(r['new_acc_weighted_mean'], r['new_acc_weighted_std'])} | {best} "
            f"| {r['grad_evals_per_client_round']} | {wall} | {pub} |"
        )
    lines += [
        "",
        "grad evals / client / round: gradient evaluations a sampled client spends on training per round "
        "(a Hessian-vector product counted as 2; evaluation not included). wall s / run: the whole "
        "`fedmeta fit` process (start-up, data loading, evaluation every 10 rounds), on a shared 2-core "
        "machine with two runs at once: indicative only.",
        "",
        *_paired_lines(rows),
        "",
        *[f"![{p.stem}]({rel}/{p.name})" for p in pngs],
    ]
    md_path.write_text("\n".join(lines) + "\n")
    return md_path, csv_path


def _plots(rows: list[dict[str, Any]], png_dir: Path, dataset: str, rounds: int) -> list[Path]:
    """Accuracy vs round (band over seeds), τ × α heat-map per method, per-client box plot per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cells = [(t, a) for t in TAUS for a in ALPHAS]
    by = {(r["method"], r["tau"], r["alpha"]): r for r in rows}
    labels_of = {r["method"]: r["label"] for r in rows}
    methods = list(labels_of)  # the grid's methods, then the tuned baseline's rows when present
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    paths = []

    fig, axes = plt.subplots(len(TAUS), len(ALPHAS), figsize=(11, 8), sharey=True, squeeze=False)
    for ax, (t, a) in zip(axes.flat, cells, strict=True):
        for m in methods:
            row = by.get((m, t, a))
            curves = [r["curve"] for r in (row or {}).get("runs", []) if r.get("curve")]
            if not curves:
                continue
            rounds_axis = [c[0] for c in curves[0]]
            curves = [c for c in curves if [x[0] for x in c] == rounds_axis]
            ys = np.array([[100 * (x[1] if x[1] is not None else np.nan) for x in c] for c in curves])
            mean = np.nanmean(ys, axis=0)
            n = len(curves)
            ax.plot(rounds_axis, mean, color=colors[m], label=f"{labels_of[m]} ({n} seed{'' if n == 1 else 's'})")
            if len(curves) > 1:
                lo, hi = np.nanmin(ys, axis=0), np.nanmax(ys, axis=0)
                ax.fill_between(rounds_axis, lo, hi, color=colors[m], alpha=0.2)
        ax.set_title(f"τ = {t}, α = {a:g}")
        ax.set_xlabel("round")
        ax.set_ylabel("weighted accuracy (%)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "missing", transform=ax.transAxes, ha="center", va="center")
    fig.suptitle(f"{dataset}: personalised accuracy vs round (line: mean, band: min–max over seeds)")
    fig.tight_layout()
    p = png_dir / f"{_report_names(dataset, rounds)}_curves.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)

    fig, axes = plt.subplots(1, len(methods), figsize=(4 * len(methods), 3.6), squeeze=False)
    for ax, m in zip(axes.flat, methods, strict=True):
        grid_vals = np.full((len(TAUS), len(ALPHAS)), np.nan)
        for i, t in enumerate(TAUS):
            for j, a in enumerate(ALPHAS):
                v = (by.get((m, t, a)) or {}).get("acc_weighted_mean")
                if v is not None:
                    grid_vals[i, j] = 100 * v
        ax.imshow(np.ma.masked_invalid(grid_vals), vmin=0, vmax=100, cmap="viridis")
        for i in range(len(TAUS)):
            for j in range(len(ALPHAS)):
                v = grid_vals[i, j]
                ax.text(j, i, "missing" if np.isnan(v) else f"{v:.1f}", ha="center", va="center",
                        color="black" if np.isnan(v) or v > 60 else "white")
        ax.set_xticks(range(len(ALPHAS)), [f"α={a:g}" for a in ALPHAS])
        ax.set_yticks(range(len(TAUS)), [f"τ={t}" for t in TAUS])
        ax.set_title(labels_of[m], fontsize=9)
    fig.suptitle(f"{dataset}: final-round weighted accuracy (%), mean over seeds")
    fig.tight_layout()
    p = png_dir / f"{_report_names(dataset, rounds)}_heatmap.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)

    fig, axes = plt.subplots(len(TAUS), len(ALPHAS), figsize=(11, 8), sharey=True, squeeze=False)
    for ax, (t, a) in zip(axes.flat, cells, strict=True):
        data, labels = [], []
        for m in methods:
            vals = []
            for r in (by.get((m, t, a)) or {}).get("runs", []):
                pc, new = r.get("per_client_acc") or [], r.get("is_new_client") or []
                vals += [100 * v for i, v in enumerate(pc) if v is not None and not (i < len(new) and new[i])]
            data.append(vals if vals else [np.nan])
            labels.append(labels_of[m].replace(" + ", "\n+ ").replace(" (", "\n(") + ("" if vals else "\nmissing"))
        ax.boxplot(data, showfliers=True)
        ax.set_xticks(range(1, len(labels) + 1), labels, fontsize=7)
        ax.set_title(f"τ = {t}, α = {a:g}")
        ax.set_ylabel("per-client accuracy (%)")
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"{dataset}: final-round accuracy of each training client (all seeds pooled)")
    fig.tight_layout()
    p = png_dir / f"{_report_names(dataset, rounds)}_per_client.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    return paths


# -- main ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="communication rounds per run (default 1000)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=None)
    parser.add_argument("--cells", nargs="+", default=None, help="e.g. tau10_alpha0.001 (default: all four)")
    parser.add_argument("--dataset", choices=["fashion_mnist", "mnist"], default="fashion_mnist")
    parser.add_argument("--root", default=None, help="data folder (needed for --dataset mnist)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="OMP/MKL threads per run (default 1)")
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results/reproduction"),
                        help="records (runs_<dataset>[_<R>rounds].jsonl) and PNGs")
    parser.add_argument("--report-dir", type=Path, default=Path("benchmarks/results"),
                        help="where reproduction[_<dataset>][_<R>rounds].md/.csv go")
    parser.add_argument("--runs", type=Path, default=Path("runs/reproduce"), help="run folders (logs, checkpoints)")
    parser.add_argument("--report-only", action="store_true", help="write the report from the stored records")
    parser.add_argument("--write-configs", action="store_true", help="(re)write configs/paper/<method>_tau*_alpha*")
    args = parser.parse_args(argv)
    if args.write_configs:
        for p in write_configs():
            print(f"[reproduce] wrote {p.relative_to(REPO)}")
        return 0
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.dataset == "mnist" and args.root is None:
        parser.error("--dataset mnist needs --root DIR (the folder with the MNIST files)")
    try:
        cells = grid(args.methods, args.cells)
    except ValueError as e:
        parser.error(str(e))
    root = None if args.root is None else str(Path(args.root).resolve())
    results_path = args.results / f"runs_{args.dataset}{_suffix(args.dataset, args.rounds)}.jsonl"
    args.results.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.reproduce"
    if args.rounds != ROUNDS:
        command += f" --rounds {args.rounds}"
    if args.dataset != "fashion_mnist":
        command += f" --dataset {args.dataset} --root DIR"

    def report() -> tuple[Path, Path]:
        rows = summarise(read_records(results_path), args.rounds, args.seeds, args.dataset, root)
        rows += tuned_rows(args.seeds, args.rounds, args.dataset)
        return write_report(rows, args.report_dir, args.results, args.dataset, args.rounds, command)

    todo: list[Run] = []
    failed = 0
    if not args.report_only:
        done = {_key(r) for r in read_records(results_path) if "error" not in r}
        for s in args.seeds:  # seed by seed, so a whole one-seed grid lands first
            for m, t, a in cells:
                if not (REPO / config_path(m, t, a)).exists():
                    parser.error(f"{config_path(m, t, a)} is missing; run with --write-configs first")
                text = (REPO / config_path(m, t, a)).read_text()
                key = (config_path(m, t, a).as_posix(), sha256_text(text), s, args.rounds, args.dataset, root)
                if key not in done:
                    todo.append((m, t, a, s))
        n_all = len(cells) * len(args.seeds)
        print(f"[reproduce] {n_all - len(todo)} of {n_all} runs already done; {len(todo)} to run, "
              f"{args.jobs} at once", flush=True)
        start = time.perf_counter()
        walls: list[float] = []
        with cf.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futures = {pool.submit(run_one, run, args.rounds, args.runs, args.dataset, root, args.threads): run
                       for run in todo}
            for i, fut in enumerate(cf.as_completed(futures), 1):
                m, t, a, s = futures[fut]
                try:
                    rec = fut.result()
                except Exception as e:  # noqa: BLE001 - record and go on with the grid
                    rec = {"method": m, "tau": t, "alpha": a, "seed": s, "rounds": args.rounds,
                           "dataset": args.dataset, "root": root, "error": f"{type(e).__name__}: {e}"}
                append_record(results_path, rec)
                failed += "error" in rec
                elapsed = time.perf_counter() - start
                if "wall_s" in rec:
                    walls.append(rec["wall_s"])
                left = len(todo) - i
                eta = statistics.fmean(walls) * left / args.jobs if walls else float("nan")
                status = (f"FAILED: {rec['error']}" if "error" in rec
                          else f"acc {_pp(rec.get('acc_weighted'))} new {_pp(rec.get('new_acc_weighted'))}"
                          f" in {rec['wall_s']:.0f}s")
                print(f"[reproduce] run {i} of {len(todo)}: {m} {cell_name(t, a)} seed {s}: {status}; "
                      f"elapsed {fmt_duration(elapsed)}, est. remaining "
                      f"{'?' if math.isnan(eta) else fmt_duration(eta)}", flush=True)
                if left:
                    report()  # the report follows the grid as it fills
    md, csv_path = report()
    print(f"[reproduce] report: {md}, {csv_path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
