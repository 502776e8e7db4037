"""Byzantine robustness benchmark (ByzFL-style): worst-case accuracy over attacks, per aggregation rule and f.

    python -m benchmarks.robustness [--rounds 100] [--seeds 0 1 2] [--threads 1] [--root runs/robustness]
                                    [--out-dir benchmarks/results] [--force]

Setting (the ByzFL benchmark's protocol, Allouah et al., on this library's synthetic benchmark):

* data: Synthetic(1, 1) of FedProx (``FederatedDataModule(dataset="synthetic")``, non-IID: every client has its
  own labelling model and input distribution), 10 training clients, all 10 sampled every round (n = 10);
* training: FedAvg, τ = 10 local SGD steps of batch 10 at rate 0.05, server rate 1, uniform aggregation weights,
  the default model (multinomial logistic regression, 60 → 10);
* Byzantine clients: ``fraction = f/10`` of the training clients (the same ``f`` clients for the whole run), f ∈
  {1, 2, 3}; every attack of :data:`lightning_fedmeta.reliability.attacks.ATTACKS` with its default parameters;
* rules: mean, median, trimmed_mean (β = f/n: trims f values at each end, as ByzFL's ``TrMean(f)``), krum,
  multi_krum (m = n − f), geometric_median, and bulyan where n ≥ 4f + 3 (f = 1 only), each told the true f;
  plus the clean run (no attack) of every rule (for krum, multi_krum and bulyan with the f they assume);
* metric: the personalised accuracy the module computes per client (``module.last_per_client["acc"]``, the
  final round's evaluation), averaged over the *honest* clients (the Byzantine clients' own test accuracy says
  nothing about the defence); clean runs are averaged over the same honest clients. The module's own
  ``val/acc_mean`` over all clients is kept in the CSV as ``acc_all``.

For every rule and f the table gives the WORST accuracy over the attacks (the attack whose mean over seeds is
lowest; mean ± std over seeds) and the clean accuracy. A run whose training stops on a non-finite value
(``FloatingPointError``) is recorded as diverged and counts as accuracy 0.

Resumable: each finished run is appended as one JSON line to ``<root>/results.jsonl`` and a re-run skips the runs
already there with the same settings (``--force`` runs everything again). Progress: run i of N, elapsed, ETA.
Writes ``<out-dir>/robustness.md`` (settings, command, tables), ``robustness.csv`` (every rule × f × attack) and
``robustness.png`` (worst-case accuracy vs f, one line per rule; dashed: the clean FedAvg mean).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import logging
import math
import sys
import time
import warnings
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import append_record, limit_threads, quiet_trainer, read_records

__all__ = ["Run", "plan", "run_one", "summarise", "main"]

RULES = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "geometric_median", "bulyan")
F_VALUES = (1, 2, 3)
NUM_CLIENTS = 10
SETTINGS: dict[str, Any] = {
    "dataset": "synthetic",
    "synthetic_alpha": 1.0,
    "synthetic_beta": 1.0,
    "num_clients": NUM_CLIENTS,
    "clients_per_round": NUM_CLIENTS,
    "algorithm": {"name": "fedavg", "local_lr": 0.05, "local_steps": 10, "batch_size": 10},
    "aggregation": "uniform",
    "server_lr": 1.0,
    "model": "default (logistic regression 60 -> 10)",
}


@dataclass(frozen=True)
class Run:
    """One training run: a rule, the number f of Byzantine clients, an attack (``"none"``: clean) and a seed."""

    rule: str
    f: int
    attack: str
    seed: int
    rounds: int

    @property
    def key(self) -> str:
        return f"{self.rule}|f={self.f}|{self.attack}|seed={self.seed}|R={self.rounds}"


def _attacks() -> tuple[str, ...]:
    from lightning_fedmeta.reliability.attacks import ATTACKS

    return ATTACKS


def _uses_f(rule: str) -> bool:
    """Whether the rule's parameters depend on f (its clean run is then trained once per f)."""
    return rule in ("trimmed_mean", "krum", "multi_krum", "bulyan")


def plan(rounds: int, seeds: Iterable[int]) -> list[Run]:
    """Every run of the benchmark. Clean runs of rules that do not depend on f (mean, median, geometric median)
    are trained once per seed (``f = 0``) and scored on the honest clients of each f."""
    runs: list[Run] = []
    for seed in seeds:
        for rule in RULES:
            fs = [f for f in F_VALUES if rule != "bulyan" or NUM_CLIENTS >= 4 * f + 3]
            if not fs:
                continue
            for f in fs:
                runs.extend(Run(rule, f, attack, seed, rounds) for attack in _attacks())
            runs.extend(Run(rule, f, "none", seed, rounds) for f in (fs if _uses_f(rule) else [0]))
    return runs


def aggregator_option(rule: str, f: int) -> dict[str, Any]:
    """``model.aggregator`` of a rule for f Byzantine clients out of :data:`NUM_CLIENTS`."""
    if rule == "trimmed_mean":
        return {"name": rule, "beta": f / NUM_CLIENTS}
    if rule in ("krum", "multi_krum", "bulyan"):
        return {"name": rule, "f": f}
    return {"name": rule}


def honest_mask(seed: int, f: int) -> Any:
    """The clients that are honest when f of the 10 are Byzantine (the module's own choice of them)."""
    import torch

    from lightning_fedmeta.reliability.attacks import choose_byzantine_clients

    mask = torch.ones(NUM_CLIENTS, dtype=torch.bool)
    if f > 0:
        mask[choose_byzantine_clients(seed, torch.arange(NUM_CLIENTS), f / NUM_CLIENTS)] = False
    return mask


def run_one(run: Run) -> dict[str, Any]:
    """Train one run in this process; return its per-client accuracies and summary numbers."""
    import torch

    from lightning_fedmeta import FederatedModule
    from lightning_fedmeta.data import FederatedDataModule

    torch.manual_seed(run.seed)  # the default model's initialisation
    data = FederatedDataModule(
        dataset="synthetic", num_clients=NUM_CLIENTS, synthetic_alpha=SETTINGS["synthetic_alpha"],
        synthetic_beta=SETTINGS["synthetic_beta"], eval_every=run.rounds, data_seed=run.seed,
    )
    byzantine = None if run.attack == "none" else {"fraction": run.f / NUM_CLIENTS, "attack": run.attack}
    clean_f = run.attack == "none" and not _uses_f(run.rule)
    module = FederatedModule(
        algorithm=dict(SETTINGS["algorithm"]), clients_per_round=NUM_CLIENTS, aggregation="uniform",
        server_lr=SETTINGS["server_lr"], seed=run.seed, compile_clients=False,
        aggregator=aggregator_option(run.rule, 0 if clean_f else run.f), byzantine=byzantine,
    )
    trainer = quiet_trainer(run.rounds)
    record: dict[str, Any] = {**asdict(run), "key": run.key}
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            trainer.fit(module, data)
    except FloatingPointError as err:
        record.update(diverged=True, error=str(err).splitlines()[0], seconds=time.perf_counter() - start)
        return record
    record["seconds"] = time.perf_counter() - start
    per_client = module.last_per_client["acc"].to(torch.float64)
    record["per_client_acc"] = per_client.tolist()
    record["byzantine_clients"] = module.byzantine_clients.tolist()
    record["acc_all"] = float(trainer.callback_metrics["val/acc_mean"])
    record["diverged"] = False
    if run.attack != "none":
        assert sorted(record["byzantine_clients"]) == (~honest_mask(run.seed, run.f)).nonzero().flatten().tolist()
    return record


def _honest_acc(record: dict[str, Any], f: int) -> float:
    if record.get("diverged"):
        return 0.0
    import torch

    pc = torch.tensor(record["per_client_acc"], dtype=torch.float64)
    return float(pc[honest_mask(record["seed"], f)].mean())


def _mean_std(values: list[float]) -> tuple[float, float]:
    m = sum(values) / len(values)
    s = math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
    return m, s


def summarise(records: list[dict[str, Any]], rounds: int, seeds: list[int]) -> list[dict[str, Any]]:
    """One row per (rule, f, attack), attack ``none`` included: accuracy on the honest clients over seeds."""
    by_key = {r["key"]: r for r in records}
    rows: list[dict[str, Any]] = []
    for rule in RULES:
        for f in F_VALUES:
            if rule == "bulyan" and NUM_CLIENTS < 4 * f + 3:
                continue
            for attack in (*_attacks(), "none"):
                train_f = 0 if attack == "none" and not _uses_f(rule) else f
                recs = [by_key.get(Run(rule, train_f, attack, s, rounds).key) for s in seeds]
                if any(r is None for r in recs):
                    continue
                accs = [_honest_acc(r, f) for r in recs]  # type: ignore[arg-type]
                alls = [r["acc_all"] for r in recs if not r.get("diverged")]  # type: ignore[index,union-attr]
                m, s = _mean_std(accs)
                rows.append({
                    "rule": rule, "f": f, "attack": attack, "seeds": len(accs), "acc_honest_mean": m,
                    "acc_honest_std": s, "acc_all_mean": _mean_std(alls)[0] if alls else float("nan"),
                    "diverged": sum(bool(r.get("diverged")) for r in recs),  # type: ignore[union-attr]
                    "per_seed": accs,
                })
    for rule in RULES:
        for f in F_VALUES:
            attacked = [r for r in rows if r["rule"] == rule and r["f"] == f and r["attack"] != "none"]
            if attacked:
                min(attacked, key=lambda r: r["acc_honest_mean"])["worst"] = True
    return rows


def _pm(m: float, s: float) -> str:
    return f"{m:.3f} ± {s:.3f}"


def write_outputs(rows: list[dict[str, Any]], out_dir: Path, command: str, rounds: int, seeds: list[int],
                  minutes: float) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    attacks = _attacks()
    with (out_dir / "robustness.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["rule", "f", "attack", "seeds", "acc_honest_mean", "acc_honest_std", "acc_all_mean",
                    "diverged", "worst_attack", "per_seed_acc_honest"])
        for r in rows:
            w.writerow([r["rule"], r["f"], r["attack"], r["seeds"], f"{r['acc_honest_mean']:.4f}",
                        f"{r['acc_honest_std']:.4f}", f"{r['acc_all_mean']:.4f}", r["diverged"],
                        int(bool(r.get("worst"))), " ".join(f"{a:.4f}" for a in r["per_seed"])])

    def cell(rule: str, f: int, attack: str | None) -> dict[str, Any] | None:
        for r in rows:
            if r["rule"] == rule and r["f"] == f and (r.get("worst") if attack is None else r["attack"] == attack):
                return r
        return None

    lines = [
        "# Byzantine robustness: worst-case accuracy over attacks",
        "",
        f"Command: `{command}` ({minutes:.1f} min on this machine: 2 shared CPU cores, one thread per run).",
        "",
        f"Setting: Synthetic(1, 1) (FedProx's non-IID benchmark), {NUM_CLIENTS} training clients, all sampled every "
        f"round (n = {NUM_CLIENTS}); FedAvg (τ = 10 local SGD steps, batch 10, rate 0.05; server rate 1; uniform "
        f"weights), the default model (logistic regression 60 → 10), {rounds} rounds, seeds {seeds} (each seed: "
        "data, model initialisation, sampling, Byzantine identities and attack draws). f of the 10 clients are "
        "Byzantine for the whole run (`byzantine: {fraction: f/10, attack: ...}`), each rule is told the true f "
        "(trimmed mean: β = f/10, i.e. f values trimmed at each end; Multi-Krum: m = n − f; Bulyan only where "
        "n ≥ 4f + 3). Attacks: " + ", ".join(f"`{a}`" for a in attacks) + " with their default parameters "
        "(docs/reliability.md).",
        "",
        "Accuracy: the module's personalised per-client accuracy after the final round, averaged over the honest "
        "clients (mean ± std over seeds); the clean column is the rule without any attack, scored on the same "
        "honest clients. Worst: the attack with the lowest mean accuracy for that rule and f. A diverged run "
        "counts as 0.",
        "",
        "| rule | " + " | ".join(f"f = {f}: worst (attack)" for f in F_VALUES) + " | "
        + " | ".join(f"f = {f}: clean" for f in F_VALUES) + " |",
        "|---|" + "---|" * (2 * len(F_VALUES)),
    ]
    for rule in RULES:
        worst, clean = [], []
        for f in F_VALUES:
            w_, c_ = cell(rule, f, None), cell(rule, f, "none")
            worst.append("n/a (n < 4f + 3)" if w_ is None else
                         f"{_pm(w_['acc_honest_mean'], w_['acc_honest_std'])} ({w_['attack']})")
            clean.append("n/a" if c_ is None else _pm(c_["acc_honest_mean"], c_["acc_honest_std"]))
        lines.append(f"| {rule} | " + " | ".join(worst) + " | " + " | ".join(clean) + " |")
    lines += [
        "",
        "## Every attack (mean accuracy on the honest clients over seeds)",
        "",
        "| rule | f | " + " | ".join(attacks) + " | none |",
        "|---|---|" + "---|" * (len(attacks) + 1),
    ]
    for rule in RULES:
        for f in F_VALUES:
            cells = [cell(rule, f, a) for a in (*attacks, "none")]
            if all(c is None for c in cells):
                continue
            lines.append(f"| {rule} | {f} | " + " | ".join(
                "" if c is None else (f"{c['acc_honest_mean']:.3f}" + (" (div.)" if c["diverged"] else ""))
                for c in cells) + " |")
    lines += ["", "![worst-case accuracy vs f](robustness.png)", "",
              "What the numbers say, and the definitions of every rule and attack: docs/reliability.md, section "
              "Byzantine-robust aggregation.", ""]
    (out_dir / "robustness.md").write_text("\n".join(lines))
    _plot(rows, out_dir / "robustness.png")


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.5, 4.5))
    ax = fig.add_subplot(1, 1, 1)
    for i, rule in enumerate(RULES):
        pts = sorted((r["f"], r["acc_honest_mean"], r["acc_honest_std"]) for r in rows
                     if r["rule"] == rule and r.get("worst"))
        if not pts:
            continue
        fs, ms, ss = zip(*pts, strict=True)
        ax.errorbar(fs, ms, yerr=ss, marker="o", capsize=3, label=rule, color=f"C{i}")
    clean = sorted((r["f"], r["acc_honest_mean"]) for r in rows if r["rule"] == "mean" and r["attack"] == "none")
    if clean:
        fs, ms = zip(*clean, strict=True)
        ax.plot(fs, ms, linestyle="--", color="black", label="mean, no attack")
    ax.set_xlabel("f (Byzantine clients out of n = 10)")
    ax.set_ylabel("accuracy on honest clients (worst attack)")
    ax.set_xticks(list(F_VALUES))
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1 on a shared machine)")
    parser.add_argument("--root", type=Path, default=Path("runs/robustness"))
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--force", action="store_true", help="re-run the runs already in <root>/results.jsonl")
    args = parser.parse_args(argv)
    limit_threads(args.threads)
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)

    args.root.mkdir(parents=True, exist_ok=True)
    store = args.root / "results.jsonl"
    if args.force and store.exists():
        store.unlink()
    done = {r["key"]: r for r in read_records(store)}
    runs = plan(args.rounds, args.seeds)
    todo = [r for r in runs if r.key not in done]
    print(f"{len(runs)} runs, {len(runs) - len(todo)} already in {store}, {len(todo)} to run", flush=True)
    start = time.perf_counter()
    for i, run in enumerate(todo, 1):
        record = run_one(run)
        append_record(store, record)
        done[run.key] = record
        elapsed = time.perf_counter() - start
        eta = elapsed / i * (len(todo) - i)
        status = "diverged" if record.get("diverged") else f"acc_all {record['acc_all']:.3f}"
        print(f"run {i}/{len(todo)}  {run.key:<45} {status}  {record['seconds']:.1f}s  "
              f"elapsed {elapsed / 60:.1f} min  ETA {eta / 60:.1f} min", flush=True)
    minutes = sum(r.get("seconds", 0.0) for r in done.values() if r["key"] in {x.key for x in runs}) / 60
    rows = summarise(list(done.values()), args.rounds, args.seeds)
    command = "python -m benchmarks.robustness " + " ".join(argv if argv is not None else sys.argv[1:])
    write_outputs(rows, args.out_dir, command.strip(), args.rounds, args.seeds, minutes)
    print(f"wrote {args.out_dir / 'robustness.md'}, robustness.csv, robustness.png", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
