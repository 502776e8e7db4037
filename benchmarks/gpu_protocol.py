"""The field's protocol at GPU speed (issue 38, item 4): one prepared script, at most about 8 minutes on one GPU.

Rows, in this order (each written to ``OUT/gpu_protocol.json`` and ``.md`` the moment it finishes, so a run
stopped by its time limit keeps what it finished; rows not started before ``--budget`` seconds are listed as
skipped):

1. **The PFLlib Fashion-MNIST protocol round** (benchmarks/pfllib_protocol.py: ``SPECS``, ``SPLITS``,
   ``run_config``, ``local_work``; 20 clients, all join, 1 local epoch at batch 10, FedAvgCNN, evaluated every
   round) for FedAvg, Ditto and FedALA on ``dir`` (Dir(0.1)) and ``pat``:

   * **ours**: through the public API: ``FederatedModule`` + ``FederatedDataModule`` + a ``lightning.Trainer``
     (``eval_every`` 1), one fit of ``--warmup`` + ``--rounds`` rounds; a callback times each round's training
     step and its evaluation (CUDA synchronised) and reads ``val/acc_weighted`` after each evaluation. Reported:
     the median over the rounds after the warm-up of training, evaluation and their sum (the round), and the
     accuracy after every round. ``--schedules`` adds rows with ``model.step_schedule`` set (``default``: the
     option not passed); an engine without the option records its refusal instead of a number.
   * **PFLlib**: its own ``system/main.py``, unmodified, from ``--pfllib PATH`` (a checkout kept outside the
     repository, or in an ignored folder), on the same device, on the *same clients*: this library's split is
     written in PFLlib's format (``dataset/<name>/train/<i>.npz`` and ``test/<i>.npz``, each
     ``np.savez_compressed(data={"x": float32 [n, 1, 28, 28], "y": int64 [n]})``, as PFLlib's
     ``dataset/utils/dataset_utils.save_file`` writes them and ``system/utils/data_utils.read_data`` reads them),
     with this library's normalised pixels, so both train on identical rows. It runs
     ``python -u main.py -data NAME -m CNN -algo ALGO -gr N -nc 20 -lbs 10 -ls 1 -lr 0.005 -jr 1 -eg 1 -dev DEV
     -did 0`` (PFLlib's defaults for the algorithm's own flags: Ditto ``-mu 0 -pls 1``, FedALA ``-et 1 -p 2 -s
     80``) in a work folder whose ``../dataset`` is the written split (PFLlib reads and writes relative to its
     working folder; nothing is written into the checkout). Its round ``i`` evaluates (before training) the model
     after ``i`` rounds, prints ``time cost`` per round; the evaluation's share is timed from the arrival of its
     output lines (``Evaluate ...`` to the last ``Std Test AUC``), the rest is training. Round 0 is the warm-up.
     Accuracy after round ``i`` is the last ``Averaged Test Accuracy`` of round ``i``'s evaluation (Ditto: the
     personalised models', as ours). Modules PFLlib's ``main.py`` imports for algorithms not run here and absent
     from the environment (``cvxpy``: FedPAC; ``calmsize``: the memory report after training) are given stub
     modules on ``PYTHONPATH``; the row names them.

   Without ``--pfllib`` the PFLlib rows are refused with a one-line reason and ours still run.
2. **The W, CNN and ResNet-18 rows of benchmarks/gpu.py** (``gpu.check_speed``, not a copy): FedAvg rounds/s
   of the default batched path against the plain per-client loop, at ``--gpu-clients`` clients per round.

The order of the rows puts the headline first: FedAvg on both columns (ours, then PFLlib), then gpu.py's rows,
then Ditto and FedALA.

    python3 -m pip install --no-deps --no-build-isolation --no-index -e .     # on the GPU machine: entry points
    python -m benchmarks.gpu_protocol --pfllib .pfllib --data-root .fmnist --out $OUT      # the GPU run
    python -m benchmarks.gpu_protocol --device cpu --quick --out /tmp/gp                    # the tests' smoke run

``--quick``: 4 clients of 40 rows (pfllib_protocol's quick data), 1 warm-up and 1 timed round, gpu.py's quick
workloads at 2 clients. On the CPU the CUDA-only parts (synchronisation, peak memory, utilisation) are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from benchmarks import pfllib_protocol as pp  # noqa: E402
from benchmarks.gpu_check import environment, error, fmt  # noqa: E402

ALGORITHMS = ["FedAvg", "Ditto", "FedALA"]
#: PFLlib's -algo name and its flags for the algorithm's own hyper-parameters (its main.py defaults, as SPECS)
PFLLIB_ALGO: dict[str, tuple[str, list[str]]] = {
    "FedAvg": ("FedAvg", []),
    "Ditto": ("Ditto", ["-mu", "0.0", "-pls", "1"]),
    "FedALA": ("FedALA", ["-et", "1.0", "-p", "2", "-s", "80"]),
}
#: modules system/main.py imports at the top that the algorithms run here never use (stubbed when missing)
STUBS = {
    "cvxpy": "# stub written by benchmarks/gpu_protocol.py: only PFLlib's FedPAC uses cvxpy, not run here\n",
    "calmsize": ("# stub written by benchmarks/gpu_protocol.py: PFLlib's memory report after training only\n"
                 "def size(num_bytes):\n    return float(num_bytes)\n"),
}
SCHEDULE_OPTION = "step_schedule"


# ------------------------------------------------------------------------------------------------
# ours: FederatedModule + FederatedDataModule + Trainer
# ------------------------------------------------------------------------------------------------
class ProtocolTimer(Callback):
    """Per round: the training step's and the evaluation's wall time (CUDA synchronised) and the weighted
    accuracy of the evaluation (``val/acc_weighted``)."""

    def __init__(self) -> None:
        self.train_s: list[float] = []
        self.eval_s: list[float] = []
        self.acc: list[float | None] = []
        self._t0 = 0.0

    @staticmethod
    def _now(pl_module: L.LightningModule) -> float:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        return time.perf_counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        self._t0 = self._now(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.train_s.append(self._now(pl_module) - self._t0)

    def on_validation_start(self, trainer, pl_module) -> None:  # noqa: ANN001
        self._t0 = self._now(pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:  # noqa: ANN001
        self.eval_s.append(self._now(pl_module) - self._t0)
        value = trainer.callback_metrics.get("val/acc_weighted")
        self.acc.append(None if value is None else float(value))


def _settings(quick: bool) -> pp.Settings:
    if quick:
        return pp.Settings(data=pp.QUICK_DATA, model=(("clients_per_round", 4), ("compile_clients", False)))
    return pp.Settings()


def protocol_config(label: str, split: str, rounds: int, quick: bool) -> dict[str, Any]:
    """pfllib_protocol's final-phase config of ``label`` on ``split`` (test rows, evaluated every round)."""
    settings = _settings(quick)
    work, _ = pp.local_work(label, split, "final", settings)
    return pp.run_config(label, split, "final", rounds, settings, work)


def build_datamodule(config: dict[str, Any], data_root: str | None) -> Any:
    from lightning_fedmeta.data import FederatedDataModule

    data = dict(config["data"])
    if data_root is not None:
        data["root"] = data_root
    dm = FederatedDataModule(**data)
    dm.setup()
    return dm


def _model(config: dict[str, Any]) -> torch.nn.Module:
    import importlib

    spec = config["model"]["model"]
    module, _, name = spec["class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)(**spec.get("init_args", {}))


def run_ours(device: str, label: str, split: str, schedule: str, warmup: int, rounds: int, quick: bool,
             dm: Any) -> dict[str, Any]:
    """One fit of ``warmup + rounds`` protocol rounds through the public API; the timed rounds' medians."""
    from lightning_fedmeta import FederatedModule

    total = warmup + rounds
    config = protocol_config(label, split, total, quick)
    options = {k: v for k, v in config["model"].items() if k not in ("model", "algorithm")}
    if schedule != "default":
        options[SCHEDULE_OPTION] = schedule
    L.seed_everything(int(config.get("seed_everything", 0)), verbose=False)
    row: dict[str, Any] = {"algorithm_spec": config["model"]["algorithm"], "module_options": options}
    try:
        module = FederatedModule(model=_model(config), algorithm=dict(config["model"]["algorithm"]), **options)
    except (TypeError, ValueError) as exc:
        if schedule != "default" and SCHEDULE_OPTION in str(exc):
            return row | {"unsupported": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
        raise
    timer = ProtocolTimer()
    trainer = L.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=total,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, callbacks=[timer])
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.fit(module, dm)
    row["fit_s"] = time.perf_counter() - t0
    timed = slice(warmup, None) if len(timer.train_s) > warmup else slice(None)
    rounds_s = [a + b for a, b in zip(timer.train_s, timer.eval_s, strict=False)]
    row.update(train_s=statistics.median(timer.train_s[timed]), eval_s=statistics.median(timer.eval_s[timed]),
               round_s=statistics.median(rounds_s[timed]), first_round_s=rounds_s[0] if rounds_s else None,
               timed_rounds=len(timer.train_s[timed]), acc=timer.acc, all_train_s=timer.train_s,
               all_eval_s=timer.eval_s)
    if device == "cuda":
        row["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


# ------------------------------------------------------------------------------------------------
# PFLlib's own code on the same clients
# ------------------------------------------------------------------------------------------------
def write_pfllib_dataset(dm: Any, root: Path, name: str) -> dict[str, Any]:
    """This library's split in PFLlib's files: ``root/dataset/name/{train,test}/<i>.npz`` and a config.json."""
    data = dm.federated_data
    base = root / "dataset" / name
    for split in ("train", "test"):
        (base / split).mkdir(parents=True, exist_ok=True)
    sizes = []
    for i in range(data.num_clients):
        for split, (x, y) in (("train", data.client_train(i)), ("test", data.client_test(i))):
            with (base / split / f"{i}.npz").open("wb") as fh:  # as PFLlib's save_file
                np.savez_compressed(fh, data={"x": x.cpu().numpy().astype(np.float32),
                                              "y": y.cpu().numpy().astype(np.int64)})
        sizes.append([int(data.train_counts[i]), int(data.test_counts[i])])
    (base / "config.json").write_text(json.dumps({"num_clients": data.num_clients, "num_classes": data.num_classes,
                                                  "written_by": "benchmarks/gpu_protocol.py", "sizes": sizes}))
    return {"clients": data.num_clients, "train_rows": int(data.train_counts.sum()),
            "test_rows": int(data.test_counts.sum())}


def _stub_dir(root: Path) -> tuple[Path, list[str]]:
    """A folder of stub modules for the :data:`STUBS` this interpreter cannot import."""
    import importlib.util

    folder = root / "stubs"
    folder.mkdir(parents=True, exist_ok=True)
    stubbed = []
    for name, text in STUBS.items():
        if importlib.util.find_spec(name) is None:
            (folder / f"{name}.py").write_text(text)
            stubbed.append(name)
    return folder, stubbed


def pfllib_command(main_py: Path, label: str, name: str, clients: int, rounds: int, device: str) -> list[str]:
    algo, flags = PFLLIB_ALGO[label]
    return [sys.executable, "-u", str(main_py), "-data", name, "-m", "CNN", "-algo", algo, "-gr", str(rounds),
            "-nc", str(clients), "-lbs", "10", "-ls", "1", "-lr", "0.005", "-jr", "1", "-eg", "1",
            "-dev", device, "-did", "0", "-ncl", "10", *flags]


_ACC = re.compile(r"^Averaged Test Accuracy: ([0-9.]+)")
_COST = re.compile(r"time cost -+ ([0-9.eE+-]+)")
_ROUND = re.compile(r"^-+Round number: (\d+)-+")


def parse_pfllib(lines: list[tuple[float, str]]) -> dict[str, Any]:
    """PFLlib's round numbers from its timestamped output lines: per round its ``time cost``, the evaluation's
    seconds (from its first ``Evaluate`` line to its last ``Std Test AUC``) and the last accuracy printed."""
    rounds: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for t, line in lines:
        line = line.strip()
        if m := _ROUND.match(line):
            current = {"round": int(m.group(1)), "eval_start": None, "eval_end": None, "acc": None}
            rounds.append(current)
        elif current is None:
            continue
        elif line.startswith("Evaluate"):
            current["eval_start"] = current["eval_start"] or t
        elif line.startswith("Std Test AUC"):
            current["eval_end"] = t
        elif m := _ACC.match(line):
            current["acc"] = float(m.group(1))
        elif m := _COST.search(line):
            current["round_s"] = float(m.group(1))
    out = []
    for r in rounds:
        if "round_s" not in r:
            continue  # cut by the time limit
        ev = (r["eval_end"] - r["eval_start"]) if r["eval_start"] and r["eval_end"] else None
        out.append({"round": r["round"], "round_s": r["round_s"], "eval_s": ev,
                    "train_s": None if ev is None else r["round_s"] - ev, "acc": r["acc"]})
    return {"rounds": out}


def run_pfllib(pfllib: Path, device: str, label: str, split: str, dm: Any, rounds: int, work: Path,
               timeout_s: float) -> dict[str, Any]:
    """PFLlib's main.py on this library's split of ``dm``: ``rounds`` + 1 rounds (round 0 the warm-up)."""
    main_py = pfllib / "system" / "main.py"
    if not main_py.exists():
        return {"refused": f"no system/main.py under --pfllib {pfllib}"}
    name = f"FMNIST_fedmeta_{split}"  # 'MNIST' in the name: main.py builds FedAvgCNN(1, 10, dim=1024)
    root = work / f"pfllib_{label}_{split}"
    if root.exists():
        shutil.rmtree(root)
    row: dict[str, Any] = {"dataset": write_pfllib_dataset(dm, root, name)}
    stubs, row["stubbed_modules"] = _stub_dir(root)
    cwd = root / "run"  # main.py reads ../dataset/NAME and writes ../results, models/, items/ from here
    cwd.mkdir()
    cmd = pfllib_command(main_py, label, name, dm.federated_data.num_clients, rounds, device)
    row["command"] = "cd RUN && " + " ".join(["python", *cmd[1:]]).replace(str(main_py), "PFLLIB/system/main.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(stubs), os.environ.get("PYTHONPATH")])))
    lines: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.perf_counter(), line))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        row["killed"] = f"ended at the row's time limit ({timeout_s:.0f} s)"
    reader.join(timeout=10)
    row["process_s"] = time.perf_counter() - t0
    (root / "pfllib.log").write_text("".join(line for _, line in lines))
    row["log"] = str(root / "pfllib.log")
    row.update(parse_pfllib(lines))
    if proc.returncode not in (0, None) and "killed" not in row:
        row["error"] = f"exit status {proc.returncode}: " + " | ".join(line.strip() for _, line in lines[-3:])
    timed = [r for r in row["rounds"] if r["round"] >= 1]
    if timed:
        row["round_s"] = statistics.median(r["round_s"] for r in timed)
        evals = [r["eval_s"] for r in timed if r["eval_s"] is not None]
        row["eval_s"] = statistics.median(evals) if evals else None
        row["train_s"] = None if row["eval_s"] is None else row["round_s"] - row["eval_s"]
        row["timed_rounds"] = len(timed)
    # accuracy after i rounds of training is printed by round i's evaluation
    row["acc"] = [r["acc"] for r in row["rounds"] if r["round"] >= 1]
    return row


# ------------------------------------------------------------------------------------------------
# the plan, the report
# ------------------------------------------------------------------------------------------------
def plan(algorithms: list[str], splits: list[str], schedules: list[str],
         gpu_workloads: list[str]) -> list[tuple[str, ...]]:
    """The rows in running order: FedAvg on every split (ours per schedule, then PFLlib), gpu.py's rows, then
    the other algorithms the same way."""
    def cells(labels: list[str]) -> list[tuple[str, ...]]:
        out: list[tuple[str, ...]] = []
        for label in labels:
            for split in splits:
                out += [("ours", label, split, s) for s in schedules]
                out.append(("pfllib", label, split))
        return out

    head = [a for a in algorithms if a == "FedAvg"]
    return cells(head) + [("gpu", w) for w in gpu_workloads] + cells([a for a in algorithms if a != "FedAvg"])


def _s(x: Any, spec: str = ".3f") -> str:
    return fmt(x, spec) if isinstance(x, float) else fmt(x)


def markdown(res: dict[str, Any]) -> str:
    env = res["environment"]
    lines = ["# The PFLlib protocol at GPU speed (benchmarks/gpu_protocol.py, issue 38)", "",
             f"Command: `{res['command']}`  ", f"Total: {res['total_seconds']:.1f} s  ",
             f"Device: {env.get('gpu') or 'CPU'}, torch {env['torch']} (CUDA {env['torch_cuda']}), lightning "
             f"{env['lightning']}, {env['cpu_threads']} CPU threads  ",
             f"PFLlib: {res.get('pfllib') or 'not given (--pfllib PATH): its rows are refused'}", "",
             "## Protocol round: training + the every-round evaluation (s, median of the timed rounds)", "",
             f"Ours: FederatedModule + FederatedDataModule + lightning.Trainer, {res['warmup']} warm-up + "
             f"{res['rounds']} timed rounds. PFLlib: system/main.py unmodified, -gr {res['warmup'] + res['rounds']}"
             ", round 0 the warm-up; its evaluation also computes the training loss over every client's training "
             "rows and the AUC (its own every-round evaluation).", "",
             "| algorithm | split | code | schedule | round s | training s | evaluation s | PFLlib ÷ ours | "
             "accuracy after rounds 1, 2, … |", "|---|---|---|---|---|---|---|---|---|"]
    ours_round: dict[tuple[str, str], float] = {}
    for r in res["protocol"]:
        if r["code"] == "ours" and "round_s" in r and r["schedule"] == "default":
            ours_round[(r["algorithm"], r["split"])] = r["round_s"]
    for r in res["protocol"]:
        head = f"| {r['algorithm']} | {r['split']} | {r['code']} | {r.get('schedule', '—')} |"
        note = r.get("skipped") or r.get("refused") or r.get("unsupported") or (
            "ERROR: " + r["error"][:150] if "error" in r and "round_s" not in r else None)
        if note:
            lines.append(f"{head} {note} | | | | |")
            continue
        ratio = ""
        if r["code"] == "pfllib" and (r["algorithm"], r["split"]) in ours_round:
            ratio = f"{r['round_s'] / ours_round[(r['algorithm'], r['split'])]:.1f}×"
        acc = ", ".join("—" if a is None else f"{100 * a:.2f}" for a in r.get("acc", []))
        lines.append(f"{head} {_s(r.get('round_s'))} | {_s(r.get('train_s'))} | {_s(r.get('eval_s'))} | {ratio} | "
                     f"{acc} |")
    lines.append("")
    if res.get("gpu"):
        from benchmarks.gpu import _speed_lines

        lines += ["## gpu.py's rows: FedAvg, the default batched path vs a plain per-client loop", ""]
        lines += _speed_lines([r for r in res["gpu"] if "workload" in r]) + [""]
        lines += [f"- {r['workload']}: {r['skipped']}" for r in res["gpu"] if "skipped" in r and "workload" in r]
        lines.append("")
    if res.get("notes"):
        lines += ["## Notes", "", *[f"- {n}" for n in res["notes"]], ""]
    return "\n".join(lines)


def _write(res: dict[str, Any], out: Path, start: float) -> None:
    res["total_seconds"] = time.perf_counter() - start
    (out / "gpu_protocol.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    (out / "gpu_protocol.md").write_text(markdown(res))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path, required=True, help="writes gpu_protocol.json and gpu_protocol.md")
    parser.add_argument("--pfllib", type=Path, default=None, help="a PFLlib checkout (its system/main.py)")
    parser.add_argument("--data-root", default=None, help="Fashion-MNIST's .gz files (default: the library's)")
    parser.add_argument("--work", type=Path, default=None, help="PFLlib's data and run folders (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="tiny data and rounds: a smoke run of the script")
    parser.add_argument("--algorithms", nargs="+", default=ALGORITHMS, choices=ALGORITHMS)
    parser.add_argument("--splits", nargs="+", default=["dir", "pat"], choices=list(pp.SPLITS))
    parser.add_argument("--schedules", nargs="+", default=["default"],
                        help="model.step_schedule values (auto, grouped, lockstep, compacted); 'default' passes none")
    parser.add_argument("--warmup", type=int, default=None, help="untimed first rounds (1)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (3; --quick 1)")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds after which no row starts")
    parser.add_argument("--pfllib-timeout", type=float, default=150.0, help="most seconds of one PFLlib row")
    parser.add_argument("--gpu-workloads", nargs="*", default=["W", "CNN", "ResNet-18"],
                        help="gpu.py's workloads (none: skip them)")
    parser.add_argument("--gpu-clients", nargs="+", type=int, default=None, help="clients per round (10 100)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; use --device cpu for a smoke run")
    from lightning_fedmeta.registry import list_algorithms

    if not any(entry.name == "fedavg" for entry in list_algorithms()):
        parser.error("no algorithm is registered: install the package first "
                     "(python3 -m pip install --no-deps --no-build-isolation --no-index -e .)")
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    deadline = start + args.budget
    warmup = 1 if args.warmup is None else args.warmup
    rounds = (1 if args.quick else 3) if args.rounds is None else args.rounds
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_protocol_"))
    pfllib = args.pfllib.resolve() if args.pfllib else None
    res: dict[str, Any] = {
        "command": " ".join(["benchmarks/gpu_protocol.py", *(argv if argv is not None else sys.argv[1:])]),
        "environment": environment(args.device), "device": args.device, "warmup": warmup, "rounds": rounds,
        "pfllib": str(pfllib) if pfllib else None, "protocol": [], "gpu": [], "notes": []}
    if pfllib is None:
        res["notes"].append("PFLlib rows refused: no --pfllib PATH (a PFLlib checkout kept outside the repository)")
    dms: dict[str, Any] = {}
    for row_plan in plan(args.algorithms, args.splits, args.schedules, args.gpu_workloads):
        kind = row_plan[0]
        if kind == "gpu":
            continue  # run together below, at their place in the order
        label, split = row_plan[1], row_plan[2]
        row: dict[str, Any] = {"code": kind, "algorithm": label, "split": split,
                               "schedule": row_plan[3] if kind == "ours" else "—"}
        if kind == "pfllib" and pfllib is None:
            row["refused"] = "no --pfllib PATH given"
        elif time.perf_counter() > deadline:
            row["skipped"] = "time budget of the run spent"
        else:
            t0 = time.perf_counter()
            try:
                if split not in dms:
                    dms[split] = build_datamodule(protocol_config("FedAvg", split, 1, args.quick), args.data_root)
                if kind == "ours":
                    row |= run_ours(args.device, label, split, row["schedule"], warmup, rounds, args.quick,
                                    dms[split])
                else:
                    timeout = max(10.0, min(args.pfllib_timeout, deadline + 60 - time.perf_counter()))
                    row |= run_pfllib(pfllib, args.device, label, split, dms[split], warmup + rounds,
                                      work, timeout)
            except Exception as exc:  # noqa: BLE001 - recorded; the other rows go on
                row |= error(exc)
            row["seconds"] = round(time.perf_counter() - t0, 2)
        print(f"[protocol] {json.dumps({k: v for k, v in row.items() if k not in ('traceback', 'rounds')})}",
              flush=True)
        res["protocol"].append(row)
        _write(res, args.out, start)
        if kind == "pfllib" and label == "FedAvg" and split == args.splits[-1] and args.gpu_workloads:
            _gpu_rows(args, res, deadline, start)
    if args.gpu_workloads and not res["gpu"]:
        _gpu_rows(args, res, deadline, start)
    _write(res, args.out, start)
    return res


def _gpu_rows(args: argparse.Namespace, res: dict[str, Any], deadline: float, start: float) -> None:
    """gpu.py's speed rows (its own function), written as one block."""
    from benchmarks import gpu

    clients = args.gpu_clients or ([2] if args.quick else [10, 100])
    try:
        res["gpu"] = gpu.check_speed(args.device, args.gpu_workloads, args.quick, clients, 2 if args.quick else 4,
                                     2 if args.quick else 50, deadline, 12 if args.quick else 64)
    except Exception as exc:  # noqa: BLE001
        res["gpu"] = [error(exc)]
    _write(res, args.out, start)


if __name__ == "__main__":
    main()
