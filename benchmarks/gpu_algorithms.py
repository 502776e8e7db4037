"""Every registered algorithm on a device: loop == vmap, and a ``bf16-mixed`` run that stays finite.

``benchmarks/gpu.py`` checks three algorithms in depth; this script checks them all, briefly, on the device the
unit tests never see. For each algorithm (its ``example_arguments`` and ``example_model``, else the defaults on a
small MLP), on the Synthetic(1, 1) data of 12 clients, 4 per round, ``rounds`` rounds:

* ``loop`` and ``vmap`` runs from the same seed (2 of the 12 clients held out, so a new client's personalisation
  is scored too): the largest relative difference of the global parameters and of
  the personalised validation scores (flag above :data:`benchmarks.gpu_check.REL_TOL`);
* a ``bf16-mixed`` run (CUDA only) of the batched path: the parameters and the last loss finite.

Algorithms run in :func:`order` (the newest first) until ``--budget`` seconds have passed; the rest are listed as
not run. Results are written after every algorithm (``gpu_algorithms.json`` and ``.md``), so a run stopped by its
time limit keeps what it finished.

    python3 -m pip install --no-deps --no-build-isolation --no-index -e .   # on the GPU machine: the entry points
    python benchmarks/gpu_algorithms.py --out OUTDIR
    python benchmarks/gpu_algorithms.py --device cpu --rounds 1 --algorithms fedavg fedpac --out /tmp/a   # smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_check import (  # noqa: E402
    NUM_CLASSES,
    REL_TOL,
    SYNTHETIC_DIM,
    diff,
    environment,
    fit,
    run_check,
    small_mlp,
    synthetic_dm,
    val_summary,
)
from lightning_fedmeta.registry import list_algorithms, load_algorithm  # noqa: E402

NUM_CLIENTS, PER_ROUND, HOLDOUT = 12, 4, 2
#: checked first: the algorithms added last (issue 27 and its stretch), which no GPU has run yet
NEWEST = ("fedpac", "fedas", "fedbn", "apfl", "lg_fedavg", "fedbabu", "fedrod", "fedala", "fedproto", "fedfomo",
          "fedamp", "fedem", "pfedhn", "feddbe")


def order(names: list[str]) -> list[str]:
    """:data:`NEWEST` first (those registered), then the others by name."""
    return [n for n in NEWEST if n in names] + sorted(n for n in names if n not in NEWEST)


def spec_and_model(name: str) -> tuple[dict[str, Any], torch.nn.Module]:
    """The algorithm's ``example_arguments`` and ``example_model`` (a small MLP where it declares none), initialised
    from seed 0: a row does not depend on the algorithms checked before it."""
    cls = load_algorithm(name)
    torch.manual_seed(0)
    model = cls.example_model((SYNTHETIC_DIM,), NUM_CLASSES)
    return {"name": name, **cls.example_arguments()}, model if model is not None else small_mlp()


def _params(module: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().cpu().clone() for k, v in module.model.named_parameters()}


def check_one(row: dict[str, Any], device: str, name: str, rounds: int) -> None:
    """Fill ``row`` with the loop/vmap differences and the bf16 run's finiteness of algorithm ``name``."""
    spec, model = spec_and_model(name)
    runs = {}
    for batching in ("loop", "vmap"):
        L.seed_everything(0, verbose=False)
        module, t, _ = fit(device, _copy(model), spec, synthetic_dm(NUM_CLIENTS, rounds), rounds, PER_ROUND, batching,
                           holdout_clients=HOLDOUT)
        runs[batching] = (_params(module), val_summary(t))
    row["params"] = diff(runs["loop"][0], runs["vmap"][0])
    row["val"] = diff(runs["loop"][1], runs["vmap"][1])
    row["val_acc"] = runs["vmap"][1].get("val/acc_weighted")
    row["new_acc"] = runs["vmap"][1].get("val/new/acc_weighted")  # the held-out clients, personalised
    row["val_keys"] = sorted(runs["vmap"][1])
    finite = all(bool(torch.isfinite(v).all()) for run in runs.values() for v in run[0].values())
    row["flag"] = (row["params"]["rel"] > REL_TOL or row["val"]["rel"] > REL_TOL or not finite
                   or bool(row["val"]["missing"]) or not runs["loop"][1])
    if device == "cuda":
        L.seed_everything(0, verbose=False)
        module, _, timer = fit(device, _copy(model), spec, synthetic_dm(NUM_CLIENTS, rounds), rounds, PER_ROUND,
                               "vmap", precision="bf16-mixed", validate=False, holdout_clients=HOLDOUT)
        loss = timer.losses[-1] if timer.losses else math.nan
        row["bf16_finite"] = math.isfinite(loss) and all(bool(torch.isfinite(v).all())
                                                         for v in _params(module).values())
        row["bf16_loss"] = loss
        row["flag"] = row["flag"] or not row["bf16_finite"]


def _copy(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model)


def markdown(res: dict[str, Any]) -> str:
    env = res["environment"]
    lines = [
        "# Every algorithm on the device (benchmarks/gpu_algorithms.py)", "",
        f"Command: `{res['command']}`  ",
        f"Device: {env.get('gpu') or res['device']}, torch {env.get('torch')}; {res['rounds']} rounds, "
        f"{NUM_CLIENTS} Synthetic(1, 1) clients ({HOLDOUT} held out), {PER_ROUND} per round; "
        f"total {res['total_seconds']:.1f} s", "",
        f"Flag: loop and vmap differ by more than {REL_TOL:g} (relative), a non-finite parameter, or a non-finite "
        "bf16-mixed run.", "",
        "| algorithm | params rel | val rel | val acc (vmap) | held-out acc (vmap) | bf16-mixed loss | flag | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['algorithm']} | ERROR: {r['error'][:150]} | | | | | FLAG | {r.get('seconds', 0):.1f} |")
            continue
        bf16 = f"{r['bf16_loss']:.4f}" if "bf16_loss" in r else "(CPU: not run)"
        acc, new = (f"{r[k]:.4f}" if r.get(k) is not None else "—" for k in ("val_acc", "new_acc"))
        lines.append(f"| {r['algorithm']} | {r['params']['rel']:.2e} | {r['val']['rel']:.2e} | {acc} | {new} | "
                     f"{bf16} | {'FLAG' if r['flag'] else 'ok'} | {r['seconds']:.1f} |")
    if res["not_run"]:
        lines += ["", f"Not run (the {res['budget']:.0f} s budget was spent): {', '.join(res['not_run'])}."]
    flagged = [r["algorithm"] for r in res["rows"] if r.get("flag")]
    lines += ["", f"Flags: {', '.join(flagged) if flagged else 'none'}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget", type=float, default=240.0, help="seconds after which no algorithm is started")
    parser.add_argument("--algorithms", nargs="+", default=None, help="these only (default: every registered one)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; use --device cpu for a smoke run")
    names = order([e.name for e in list_algorithms()])
    if not names:
        parser.error("no algorithm is registered: run `python3 -m pip install --no-deps --no-build-isolation "
                     "--no-index -e .` first")
    if args.algorithms:
        unknown = sorted(set(args.algorithms) - set(names))
        if unknown:
            parser.error(f"not registered: {', '.join(unknown)}")
        names = [n for n in names if n in args.algorithms]
    warnings.filterwarnings("ignore")
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    res: dict[str, Any] = {"command": " ".join(["benchmarks/gpu_algorithms.py", *(argv or sys.argv[1:])]),
                           "environment": environment(args.device), "device": args.device, "rounds": args.rounds,
                           "budget": args.budget, "rows": [], "not_run": list(names)}
    for name in names:
        if time.perf_counter() - start > args.budget:
            break
        row: dict[str, Any] = {"algorithm": name}
        res["rows"].append(run_check(f"[{name}]", row, lambda r, n=name: check_one(r, args.device, n, args.rounds)))
        res["not_run"].remove(name)
        _write(res, args.out, start)
    _write(res, args.out, start)
    return res


def _write(res: dict[str, Any], out: Path, start: float) -> None:
    res["total_seconds"] = time.perf_counter() - start
    (out / "gpu_algorithms.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    (out / "gpu_algorithms.md").write_text(markdown(res))


if __name__ == "__main__":
    main()
