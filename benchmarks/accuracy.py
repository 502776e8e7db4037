"""Accuracy reproduction: run configs through the ``fedmeta`` CLI and tabulate personalised accuracy.

    python -m benchmarks.accuracy CFG [CFG ...] [--rounds 200] [--out FILE] [--threads N]
                                  [--force] [--quiet-machine]

Each config runs as ``fedmeta fit --config CFG --trainer.max_steps R`` in its own process (the
real user path: data loading, evaluation every ``eval_every`` rounds, checkpoints, plots), with its
run folder ``runs/accuracy/<config stem>/`` (``--root``) emptied first and the process's output kept
in ``run.log`` there. The table gives, per config:

* ``grad evals / client / round``: the client's training work per round, from the config's
  algorithm and hyper-parameters (:func:`grad_evals_per_round`; evaluation not included);
* ``eval round``: the round of the evaluation the accuracies come from; it must be the final round
  ``R`` (the data module evaluates after the final round whatever ``eval_every`` is); a mismatch
  is flagged in the table and makes the script exit with status 1;
* the last evaluation's sample-weighted mean, unweighted mean and worst-decile personalised accuracy;
* wall seconds per round of the whole process (start-up, data loading and evaluation included).

Every finished config is appended, as one JSON object per line, to ``<root>/results.jsonl`` the
moment it finishes. A re-run skips a config whose config file (SHA-256 of its text), round count and
thread setting already have a successful record there, and reuses that record, so an interrupted run
resumes where it stopped; ``--force`` runs everything again. Failures are recorded but never reused.

Timings: unless ``--quiet-machine`` is passed (say it only when nothing else ran on the machine), the
table carries a note that the timings were measured on a shared machine (other jobs may have been
running), with the range of the 1-minute load average sampled before and after each run.
``--threads N`` sets ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` of the runs (use 1 on a shared machine,
see benchmarks/README.md).

The table is written to ``--out`` (default ``benchmarks/results/accuracy.md``) between the lines
``<!-- BEGIN accuracy.py -->`` and ``<!-- END accuracy.py -->``; text outside them (notes, earlier
tables) is kept. A file without those markers is replaced.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from benchmarks.harness import append_record, read_records, run_fit

__all__ = ["grad_evals_per_round", "config_grad_evals", "run_config", "main"]

BEGIN = "<!-- BEGIN accuracy.py -->"
END = "<!-- END accuracy.py -->"
RESULTS_FILE = "results.jsonl"

# Gradient evaluations per client per round, one entry per algorithm. τ = ``local_steps``. A
# gradient evaluation is one forward + backward pass on one mini-batch; a Hessian-vector product
# (``ctx.hvp``: vjp of grad) costs about two backward passes and is counted as 2. Evaluation
# (fine-tuning before the personalised accuracy) is not counted: it is the same for every config of
# a comparison and not part of a round's training.
#   fedavg, reptile:   τ            (one ∇f per SGD step)
#   fedprox, scaffold: τ            (the proximal term / control-variate correction are closed form)
#   perfedavg fo:      2τ           (∇f(w; D), ∇f(w̃; D′) per step)
#   perfedavg hf:      4τ           (+ ∇f(w ± δv; D″), the finite-difference Hessian-vector product)
#   perfedavg exact:   4τ = τ(2+2)  (+ one exact Hessian-vector product, counted as 2)
#   fedmaml:           2τ first order, 4τ with ``second_order`` (per (D^tr, D^val) pair:
#                      ∇L(θ; D^tr), ∇L(θ′; D^val), + one Hessian-vector product)
#   perfedmaml:        2τ first order, 4τ with ``second_order`` (per meta-step, as fedmaml)
#   ditto:             τ + s        (τ FedAvg steps of the global model, s = ``personal_steps`` personal steps)
#   fedrep:            h + τ        (h = ``head_steps`` head-only steps, then τ body-only steps)
#   fedper, mtl_mean, mtl_pairwise, mtl_graph, ifca, cfl:   τ   (IFCA's k loss evaluations to pick a
#                      cluster are forward passes only, not counted)
#   pfedme:            R·K          (R = ``local_steps`` local rounds of K = ``inner_steps`` prox steps)
#   mocha:             n/a          (no gradients: ``local_iters`` SDCA coordinate steps per round)
#   fedbn, lg_fedavg, fedbabu:  τ   (SGD on the whole model / the body; FedBABU's head gradient is computed with
#                      the body's and dropped, one pass)
#   fedamp:            τ            (the proximal term λ/α (w − u_k) is closed form; the server's message passing
#                      is server work)
#   pfedhn:            τ            (local SGD from the generated model; generating θ_i = h(v_i; φ) is a forward
#                      pass of the hypernetwork, not a data gradient, and its VJP is server work)
#   apfl:              2τ           (per step ∇f(w_k; D) and ∇f(v̄_k; D) at the mixed model; the v and α steps
#                      both read the second)
#   fedrod:            2τ           (per step the balanced-softmax gradient of body and generic head, and the
#                      personal head's gradient through its own forward/backward pass)
#   fedem:             M·τ          (M = ``num_components``: τ steps for each component; the E-step's M loss
#                      evaluations are forward passes only, not counted)
#   fedproto, feddbe:  τ            (the prototype / running-mean regularisers are in the same forward/backward)
#   fedfomo:           τ            (+ one forward pass on the validation batch per received model, not counted)
#   fedala:            A + τ        (A = max(``ala_steps``, ``ala_start_steps``) W-gradient steps ∇_θ̂ f(θ̂_k; D):
#                      the client computes A every round, the steps beyond ``ala_steps`` at rate 0 after the first)
#   fedpac:            H + τ        (H = ``head_steps`` head-only steps before the τ body steps; the statistics and
#                      prototypes are forward passes, not counted)
#   fedas:             A + τ + F    (A = ``align_steps`` alignment steps on the body, F = ``fisher_steps`` (default τ)
#                      batch gradients for the Fisher information, 0 with ``fisher="off"``; the prototypes are
#                      forward passes, not counted)
_PER_STEP: dict[str, Any] = {
    "fedavg": 1,
    "reptile": 1,
    "fedprox": 1,
    "scaffold": 1,
    "perfedavg": lambda hp: {"fo": 2, "hf": 4, "exact": 4}.get(hp.get("variant")),
    "fedmaml": lambda hp: 4 if hp.get("second_order") else 2,
    "perfedmaml": lambda hp: 4 if hp.get("second_order") else 2,
    "fedper": 1,
    "mtl_mean": 1,
    "mtl_pairwise": 1,
    "mtl_graph": 1,
    "ifca": 1,
    "cfl": 1,
    "pfedme": lambda hp: hp.get("inner_steps"),
    "fedbn": 1,
    "lg_fedavg": 1,
    "fedbabu": 1,
    "fedamp": 1,
    "pfedhn": 1,
    "apfl": 2,
    "fedrod": 2,
    "fedem": lambda hp: hp.get("num_components"),
    "fedproto": 1,
    "feddbe": 1,
    "fedfomo": 1,
}
#: algorithms whose work is not (per-step count) × τ: the total per round
_TOTAL: dict[str, Any] = {
    "ditto": lambda hp: hp["local_steps"] + (hp.get("personal_steps") or hp["local_steps"]),
    "fedrep": lambda hp: hp["local_steps"] + hp.get("head_steps", 0),
    "fedala": lambda hp: hp["local_steps"] + max(hp["ala_steps"], hp["ala_start_steps"]),
    "fedpac": lambda hp: hp["local_steps"] + hp["head_steps"],
    "fedas": lambda hp: hp["local_steps"] + hp["align_steps"] + (
        0 if hp["fisher"] == "off" else min(hp["fisher_steps"] or hp["local_steps"], hp["local_steps"])),
}


def _algorithm_defaults(name: str) -> dict[str, Any]:
    """The constructor defaults of the registered algorithm ``name`` (empty if it does not load)."""
    try:
        from lightning_fedmeta.registry import load_algorithm

        cls = load_algorithm(name)
        sig = inspect.signature(cls.__init__)
    except Exception:  # noqa: BLE001 - a broken plugin must not stop the benchmark
        return {}
    return {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}


def grad_evals_per_round(name: str, hparams: dict[str, Any]) -> int | None:
    """Gradient evaluations one sampled client spends in one round of algorithm ``name``.

    ``hparams`` are the algorithm's hyper-parameters (``local_steps``, ``variant``,
    ``second_order``), with the algorithm's defaults filled in for missing ones. A Hessian-vector
    product counts as 2. Returns ``None`` for an algorithm outside the table in this module
    (the table prints "n/a") or when ``local_steps`` is unknown.
    """
    hp = {**_algorithm_defaults(name), **hparams}
    if name in _TOTAL and isinstance(hp.get("local_steps"), int):
        return int(_TOTAL[name](hp))
    rule = _PER_STEP.get(name)
    if rule is None:
        return None
    tau = hp.get("local_steps")
    per_step = rule(hp) if callable(rule) else rule
    if per_step is None or not isinstance(tau, int):
        return None
    return per_step * tau


def config_grad_evals(config: Path) -> tuple[str | None, int | None]:
    """``(algorithm name, gradient evaluations per client per round)`` of a ``fedmeta fit`` config."""
    doc = yaml.safe_load(config.read_text()) or {}
    algo = (doc.get("model") or {}).get("algorithm")
    if isinstance(algo, str):
        name, hparams = algo, {}
    elif isinstance(algo, dict) and isinstance(algo.get("name"), str):
        name, hparams = algo["name"], {k: v for k, v in algo.items() if k != "name"}
    else:
        return None, None
    return name, grad_evals_per_round(name, hparams)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def run_config(config: Path, rounds: int, root: Path, threads: int | None = None) -> dict[str, Any]:
    """Run one config through the CLI (in ``root/<config stem>``); return its final personalised metrics, work
    and timing."""
    name, evals = config_grad_evals(config)
    record: dict[str, Any] = {
        "config": config.as_posix(),
        "name": config.stem,
        "config_sha256": _sha256(config),
        "rounds": rounds,
        "threads": threads,
        "algorithm": name,
        "grad_evals_per_client_round": evals,
        "load_before": _load(),
    }
    run = run_fit(config, root / config.stem, ["--trainer.max_steps", str(rounds)], threads=threads)
    record["load_after"] = _load()
    record["finished_at"] = run.finished_at
    if run.error is not None:
        record["error"] = run.error
        return record
    assert run.history is not None
    vals = [r for r in run.history["history"] if r.get("stage") == "val"]
    if not vals:
        record["error"] = "no validation in the history"
        return record
    last = vals[-1]
    metrics = last["metrics"]
    record.update(
        eval_round=int(last["round"]),
        acc_weighted=metrics.get("val/acc_weighted"),
        acc_mean=metrics.get("val/acc_mean"),
        acc_worst10=metrics.get("val/acc_worst10"),
        s_per_round=run.wall_s / rounds,
        wall_s=run.wall_s,
    )
    return record


def _cached(results: list[dict[str, Any]], config: Path, rounds: int, threads: int | None) -> dict[str, Any] | None:
    sha = _sha256(config)
    for r in reversed(results):
        if (
            r.get("config") == config.as_posix()
            and r.get("config_sha256") == sha
            and r.get("rounds") == rounds
            and r.get("threads") == threads
            and "error" not in r
        ):
            return r
    return None


def _fmt(v: object) -> str:
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def render(rows: list[dict[str, Any]], command: str, rounds: int, quiet_machine: bool) -> list[str]:
    """The Markdown table (with its heading, command and notes) for ``rows``."""
    lines = [
        f"# Personalised accuracy after {rounds} rounds (Fashion-MNIST unless the config says otherwise)",
        "",
        f"Command: `{command}`",
        "",
        "| config | grad evals / client / round | eval round | acc (weighted) | acc (mean) | acc (worst 10%) "
        "| s / round (whole run) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        evals = r.get("grad_evals_per_client_round")
        evals_s = "n/a" if evals is None else str(evals)
        if "error" in r:
            lines.append(f"| {r['name']} | {evals_s} | | failed: {r['error']} | | | |")
            continue
        er = r["eval_round"]
        er_s = str(er) if er == r["rounds"] else f"**{er} ≠ {r['rounds']}: not the final round**"
        lines.append(
            f"| {r['name']} | {evals_s} | {er_s} | {_fmt(r['acc_weighted'])} | {_fmt(r['acc_mean'])} "
            f"| {_fmt(r['acc_worst10'])} | {r['s_per_round']:.3f} |"
        )
    lines += [
        "",
        "grad evals / client / round: gradient evaluations a sampled client spends on training per round "
        "(a Hessian-vector product counted as 2; evaluation not included; `grad_evals_per_round` in "
        "benchmarks/accuracy.py). eval round: the round of the evaluation the accuracies come from.",
    ]
    if not quiet_machine:
        loads = [x for r in rows for x in (r.get("load_before"), r.get("load_after")) if isinstance(x, float)]
        span = f"1-minute load average {min(loads):.1f}–{max(loads):.1f} on {os.cpu_count()} cores, " if loads else ""
        threads = ", ".join(
            "torch default" if t is None else str(t) for t in sorted({r.get("threads") for r in rows}, key=str)
        )
        lines.append(
            f"Timings were measured on a shared machine, not a quiet one: other jobs may have been running "
            f"during the runs ({span}the run itself included), threads per run: {threads}. "
            "s / round is the whole process's wall time (start-up, data loading, evaluation included) divided "
            "by the rounds; read it as indicative only, not as the code's speed (see results/speed.md)."
        )
    else:
        lines.append(
            "s / round is the whole process's wall time (start-up, data loading, evaluation included) divided "
            "by the rounds, measured on a machine with no other jobs."
        )
    return lines


def _write(out: Path, lines: list[str]) -> None:
    block = "\n".join([BEGIN, *lines, END]) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = out.read_text() if out.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        out.write_text(head + block + ("\n" + tail if tail else ""))
    else:
        out.write_text(block)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+", type=Path)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--root", type=Path, default=Path("runs/accuracy"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/accuracy.md"))
    parser.add_argument("--threads", type=int, default=None, help="OMP/MKL threads of each run (default: torch's)")
    parser.add_argument("--force", action="store_true", help="re-run configs already in <root>/results.jsonl")
    parser.add_argument(
        "--quiet-machine",
        action="store_true",
        help="nothing else ran on the machine: drop the note that timings were measured on a shared machine",
    )
    args = parser.parse_args(argv)
    stems = [c.stem for c in args.configs]
    if len(set(stems)) != len(stems):
        parser.error(f"configs must have distinct file names (their run folders are <root>/<stem>): {stems}")
    results_path = args.root / RESULTS_FILE
    args.root.mkdir(parents=True, exist_ok=True)
    rows = []
    for cfg in args.configs:
        row = None if args.force else _cached(read_records(results_path), cfg, args.rounds, args.threads)
        if row is not None:
            print(f"[accuracy] {cfg}: already done ({row.get('finished_at')}), reusing; --force re-runs", flush=True)
        else:
            print(f"[accuracy] {cfg}: running {args.rounds} rounds", flush=True)
            row = run_config(cfg, args.rounds, args.root, args.threads)
            append_record(results_path, row)
            print(json.dumps(row), flush=True)
        rows.append(row)
    command = "python -m benchmarks.accuracy " + " ".join(c.as_posix() for c in args.configs)
    command += f" --rounds {args.rounds}"
    if args.threads is not None:
        command += f" --threads {args.threads}"
    if args.out != Path("benchmarks/results/accuracy.md"):
        command += f" --out {args.out.as_posix()}"
    lines = render(rows, command, args.rounds, args.quiet_machine)
    _write(args.out, lines)
    print("\n".join(lines))
    bad = [r["name"] for r in rows if "error" in r or r.get("eval_round") != args.rounds]
    if bad:
        print(f"[accuracy] failed or not evaluated at round {args.rounds}: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
