"""One short GPU check of lightning_fedmeta through its public API (FederatedModule, FederatedDataModule,
lightning.Trainer), on embedded data only (no files, no network).

Sections (each one's failure is recorded with its traceback; the others still run):

1. ``loop == vmap``: FedAvg, Per-FedAvg (HF) and Ditto, ``R`` rounds each on ``dataset="synthetic"``, same seed,
   ``client_batching="loop"`` vs ``"vmap"`` (eager, ``compile_clients=False``): max abs / relative difference
   of the final global parameters and of the logged validation summary (``val/*``). CUDA need not be bit-exact:
   a relative difference above ``1e-5`` is flagged.
2. ``bf16-mixed``: FedAvg for several rounds with ``Trainer(precision="bf16-mixed")`` vs ``"32-true"``: the
   final training loss must be finite; validation accuracy of both runs.
3. Speed: seconds per round (median after 2 warm-up rounds, ``torch.cuda.synchronize`` around each round) of
   FedAvg on a workload like benchmarks/speed.py's W (MLP 784-80-60-10 ELU, τ = 10 local steps (the default),
   batch 40, lr 0.001; random in-memory data of W's shapes, 100 clients of 60 samples) at 20 and 100 clients
   per round, vmap vs loop, eager; on the device, and on the CPU for comparison (``--cpu-speed``).

    python benchmarks/gpu_check.py --device cuda --out OUTDIR       # the device check (about 1-3 min)
    python benchmarks/gpu_check.py --device cpu --quick --out /tmp/x  # smoke run of the script itself

Writes ``OUTDIR/gpu_check.json`` (after every section, so a killed run still leaves what it finished) and
``OUTDIR/gpu_check.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import platform
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.data import FederatedDataModule

REL_TOL = 1e-5
SYNTHETIC_DIM, NUM_CLASSES = 60, 10
W_LAYERS = (784, 80, 60, 10)

#: (label, algorithm spec) of section 1
EQUIVALENCE = [
    ("FedAvg", {"name": "fedavg"}),
    ("Per-FedAvg HF", {"name": "perfedavg", "variant": "hf", "alpha": 0.01, "beta": 0.01}),
    ("Ditto", {"name": "ditto", "lam": 0.1}),
    # local epochs: unequal clients take different step counts, run in groups (lightning_fedmeta/loop/grouping.py)
    ("FedAvg, 1 local epoch", {"name": "fedavg", "local_epochs": 1, "batch_size": 20}),
    ("Ditto, 1 + 1 epochs", {"name": "ditto", "lam": 0.1, "local_epochs": 1, "personal_epochs": 1, "batch_size": 20}),
]


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(SYNTHETIC_DIM, 32), nn.ReLU(), nn.Linear(32, NUM_CLASSES))


def w_mlp() -> nn.Module:
    a, b, c, d = W_LAYERS
    return nn.Sequential(nn.Flatten(), nn.Linear(a, b), nn.ELU(), nn.Linear(b, c), nn.ELU(), nn.Linear(c, d))


class RandomImages:
    """In-memory random data (FederatedDataset protocol): ``num_clients`` equal clients of ``shape`` inputs
    (uniform in [0, 1)) and uniform labels, ``train`` training and ``test`` test rows each.

    ``per_client=True`` draws each client's four tensors in turn (the W check's data, gpu_check.py), else every
    client's inputs at once and then their labels (gpu.py's workloads); the same seed gives different numbers in
    the two orders, and each benchmark keeps the order its recorded results were drawn in.
    """

    def __init__(self, num_clients: int, shape: tuple[int, ...], num_classes: int, train: int, test: int = 4,
                 seed: int = 0, per_client: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.num_classes = num_classes
        if per_client:
            self.clients = [
                (torch.rand(train, *shape, generator=g), torch.randint(0, num_classes, (train,), generator=g),
                 torch.rand(test, *shape, generator=g), torch.randint(0, num_classes, (test,), generator=g))
                for _ in range(num_clients)
            ]
            return
        x = torch.rand(num_clients, train + test, *shape, generator=g)
        y = torch.randint(0, num_classes, (num_clients, train + test), generator=g)
        self.clients = [(x[c, :train], y[c, :train], x[c, train:], y[c, train:]) for c in range(num_clients)]

    def client_data(self) -> list[tuple[torch.Tensor, ...]]:
        return self.clients


class RoundTimer(Callback):
    """Wall time of every training round (one Lightning training batch), synchronised on CUDA; last loss."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.starts: list[float] = []  # time.perf_counter() at the start of every round
        self.losses: list[float] = []
        self._t0 = 0.0

    @staticmethod
    def _sync(pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._sync(pl_module)
        self._t0 = time.perf_counter()
        self.starts.append(self._t0)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._sync(pl_module)
        self.times.append(time.perf_counter() - self._t0)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self.losses.append(float(loss.detach().float().cpu()))


def trainer(device: str, rounds: int, precision: str = "32-true", validate: bool = True,
            callbacks: list[Callback] | None = None) -> L.Trainer:
    return L.Trainer(
        accelerator="gpu" if device == "cuda" else "cpu", devices=1, max_steps=rounds, precision=precision,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=None if validate else 0, callbacks=callbacks or [],
    )


def fit(device: str, model: nn.Module, algorithm: dict[str, Any], dm: FederatedDataModule, rounds: int,
        clients_per_round: int, batching: str, precision: str = "32-true", validate: bool = True,
        **options: Any) -> tuple[FederatedModule, L.Trainer, RoundTimer]:
    module = FederatedModule(model=model, algorithm=dict(algorithm), clients_per_round=clients_per_round,
                             client_batching=batching, compile_clients=False, seed=0, **options)
    timer = RoundTimer()
    t = trainer(device, rounds, precision, validate, [timer])
    t.fit(module, dm)
    return module, t, timer


def val_summary(t: L.Trainer) -> dict[str, float]:
    return {k: float(v) for k, v in sorted(t.callback_metrics.items()) if k.startswith("val/")}


def synthetic_dm(num_clients: int, rounds: int) -> FederatedDataModule:
    return FederatedDataModule(dataset="synthetic", num_clients=num_clients, eval_every=rounds, data_seed=0)


def diff(a: dict[str, torch.Tensor | float], b: dict[str, torch.Tensor | float]) -> dict[str, float]:
    """Max abs difference over the common keys and that relative to the largest magnitude."""
    abs_max, scale = 0.0, 0.0
    for k in a:
        x = torch.as_tensor(a[k]).detach().double().cpu()
        y = torch.as_tensor(b[k]).detach().double().cpu()
        abs_max = max(abs_max, float((x - y).abs().max()))
        scale = max(scale, float(x.abs().max()), float(y.abs().max()))
    return {"max_abs": abs_max, "rel": abs_max / scale if scale > 0 else abs_max,
            "keys": len(a), "missing": sorted(set(a) ^ set(b))}


def error(exc: BaseException) -> dict[str, str]:
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


# ------------------------------------------------------------------------------------------------
# sections
# ------------------------------------------------------------------------------------------------
def run_check(tag: str, row: dict[str, Any], fill: Callable[[dict[str, Any]], None],
              flag_errors: bool = True) -> dict[str, Any]:
    """``row`` after ``fill(row)`` has measured and written its results into it: an exception is recorded in the row
    instead (``error``, ``traceback``, and ``flag`` when ``flag_errors``) so the other checks go on. Adds the
    ``seconds`` it took and prints the row (less its traceback) after ``tag``."""
    t0 = time.perf_counter()
    try:
        fill(row)
    except Exception as exc:  # noqa: BLE001 - recorded, the other checks go on
        row.update(error(exc))
        if flag_errors:
            row["flag"] = True
    row["seconds"] = round(time.perf_counter() - t0, 2)
    print(f"{tag} {json.dumps({k: v for k, v in row.items() if k != 'traceback'})}", flush=True)
    return row


def _equivalence_row(row: dict[str, Any], device: str, spec: dict[str, Any], rounds: int, num_clients: int,
                     per_round: int) -> None:
    """One algorithm looped and under vmap on ``device``: the differences of their parameters and scores."""
    runs = {}
    for batching in ("loop", "vmap"):
        L.seed_everything(0, verbose=False)
        module, t, _ = fit(device, small_mlp(), spec, synthetic_dm(num_clients, rounds), rounds, per_round,
                           batching)
        assert module.model is not None
        params = {k: v.detach().clone() for k, v in module.model.named_parameters()}
        runs[batching] = (params, val_summary(t))
    row["params"] = diff(runs["loop"][0], runs["vmap"][0])
    row["val"] = diff(runs["loop"][1], runs["vmap"][1])
    row["val_loop"], row["val_vmap"] = runs["loop"][1], runs["vmap"][1]
    row["params_finite"] = all(bool(torch.isfinite(v).all()) for p in runs.values() for v in p[0].values())
    row["flag"] = (row["params"]["rel"] > REL_TOL or row["val"]["rel"] > REL_TOL or not row["params_finite"]
                   or bool(row["val"]["missing"]) or not runs["loop"][1])


def check_equivalence(device: str, rounds: int, num_clients: int, per_round: int) -> list[dict[str, Any]]:
    rows = []
    for label, spec in EQUIVALENCE:
        row: dict[str, Any] = {"algorithm": label, "spec": spec, "rounds": rounds, "num_clients": num_clients,
                               "clients_per_round": per_round}
        fill = functools.partial(_equivalence_row, device=device, spec=spec, rounds=rounds, num_clients=num_clients,
                                 per_round=per_round)
        rows.append(run_check(f"[equivalence] {label}:", row, fill))
    return rows


#: the round engine's server stages, each run on the device and on the CPU (same seed: the DP noise and the
#: attacks are drawn on the CPU, so the two runs differ only by floating-point rounding)
STAGES: list[tuple[str, dict[str, Any]]] = [
    ("dp_adaptive", {"aggregation": "uniform", "dp": {"clip": 0.5, "noise_multiplier": 0.3, "adaptive_clip": True}}),
    ("median_sign_flip", {"aggregator": "median", "byzantine": {"fraction": 0.2, "attack": "sign_flip"}}),
    ("dropout_stragglers", {"client_dropout": 0.3, "over_selection": 0.5,
                            "local_steps_dist": {"distribution": "uniform", "low": 1, "high": 5}}),
]


def _stage_row(row: dict[str, Any], device: str, options: dict[str, Any], rounds: int, num_clients: int,
               per_round: int) -> None:
    """FedAvg through one server stage on ``device`` and on the CPU: the difference of their parameters."""
    spec = {"name": "fedavg", "local_lr": 0.05, "local_steps": 5, "batch_size": 20}
    runs = {}
    for where in dict.fromkeys([device, "cpu"]):
        L.seed_everything(0, verbose=False)
        module, t, _ = fit(where, small_mlp(), spec, synthetic_dm(num_clients, rounds), rounds, per_round,
                           "vmap", **options)
        assert module.model is not None
        runs[where] = ({k: v.detach().cpu().clone() for k, v in module.model.named_parameters()},
                       val_summary(t), {k: float(v) for k, v in t.callback_metrics.items()
                                        if k.startswith("dp/")})
    row["params"] = diff(runs[device][0], runs["cpu"][0])
    row["val"] = diff(runs[device][1], runs["cpu"][1])
    row["dp"] = runs[device][2]
    row["flag"] = row["params"]["rel"] > 1e-4 or not all(
        bool(torch.isfinite(v).all()) for v in runs[device][0].values())


def check_server_stages(device: str, rounds: int, num_clients: int, per_round: int) -> list[dict[str, Any]]:
    """FedAvg through each reliability stage on ``device`` against the same run on the CPU."""
    rows = []
    for label, options in STAGES:
        row: dict[str, Any] = {"stage": label, "options": options, "rounds": rounds}
        fill = functools.partial(_stage_row, device=device, options=options, rounds=rounds, num_clients=num_clients,
                                 per_round=per_round)
        rows.append(run_check(f"[stages] {label}:", row, fill))
    return rows


def check_bf16(device: str, rounds: int, num_clients: int, per_round: int) -> dict[str, Any]:
    out: dict[str, Any] = {"algorithm": "FedAvg", "rounds": rounds, "num_clients": num_clients,
                           "clients_per_round": per_round}
    if device == "cpu":
        out["note"] = "bf16-mixed on the CPU (autocast cpu)"
    for precision in ("32-true", "bf16-mixed"):
        t0 = time.perf_counter()
        try:
            L.seed_everything(0, verbose=False)
            module, t, timer = fit(device, small_mlp(), {"name": "fedavg"}, synthetic_dm(num_clients, rounds), rounds,
                                   per_round, "vmap", precision=precision)
            assert module.model is not None
            val = val_summary(t)
            out[precision] = {
                "final_loss": timer.losses[-1] if timer.losses else None,
                "first_loss": timer.losses[0] if timer.losses else None,
                "loss_finite": bool(timer.losses) and all(math.isfinite(x) for x in timer.losses),
                "params_finite": all(bool(torch.isfinite(p).all()) for p in module.model.parameters()),
                "param_dtype": str(next(module.model.parameters()).dtype),
                "val": val,
                "seconds": round(time.perf_counter() - t0, 2),
            }
        except Exception as exc:  # noqa: BLE001
            out[precision] = error(exc)
        print(f"[bf16] {precision}: {json.dumps({k: v for k, v in out[precision].items() if k != 'traceback'})}",
              flush=True)
    a, b = out.get("32-true", {}), out.get("bf16-mixed", {})
    acc_key = next((k for k in a.get("val", {}) if k.endswith("acc_weighted")), None)
    if acc_key and acc_key in b.get("val", {}):
        out["accuracy_key"] = acc_key
        out["accuracy_32"], out["accuracy_bf16"] = a["val"][acc_key], b["val"][acc_key]
    out["flag"] = not (b.get("loss_finite") and b.get("params_finite")) or "error" in a or "error" in b
    return out


def check_speed(device: str, rounds: int, per_rounds: list[int], batchings: list[str], warmup: int = 2,
                deadline: float = math.inf) -> list[dict[str, Any]]:
    rows = []
    data = RandomImages(max(per_rounds), (1, 28, 28), NUM_CLASSES, train=60, test=20, per_client=True)
    algorithm = {"name": "fedavg", "local_lr": 0.001, "batch_size": 40}
    for per_round in per_rounds:
        for batching in batchings:
            row: dict[str, Any] = {"device": device, "clients_per_round": per_round, "batching": batching,
                                   "rounds": rounds, "warmup": warmup}
            if time.perf_counter() > deadline:
                row["skipped"] = "time budget of the run spent"
                rows.append(row)
                continue
            try:
                L.seed_everything(0, verbose=False)
                dm = FederatedDataModule(dataset=data, num_clients=len(data.clients), eval_every=10**6)
                _, _, timer = fit(device, w_mlp(), algorithm, dm, rounds, per_round, batching, validate=False)
                timed = timer.times[warmup:]
                row["s_per_round"] = statistics.median(timed)
                row["ms_per_round"] = 1e3 * row["s_per_round"]
                row["first_round_s"] = timer.times[0]
                row["timed_rounds"] = len(timed)
                row["final_loss"] = timer.losses[-1] if timer.losses else None
            except Exception as exc:  # noqa: BLE001
                row.update(error(exc))
            print(f"[speed] {json.dumps({k: v for k, v in row.items() if k != 'traceback'})}", flush=True)
            rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def environment(device: str) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": sys.version.split()[0], "platform": platform.platform(), "torch": torch.__version__,
        "torch_cuda": torch.version.cuda, "lightning": L.__version__,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cpu_threads": torch.get_num_threads(), "device": device,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=torch.cuda.get_device_name(0), gpu_capability=f"{props.major}.{props.minor}",
                   gpu_memory_gib=round(props.total_memory / 2**30, 1), gpu_sms=props.multi_processor_count,
                   bf16_supported=torch.cuda.is_bf16_supported())
    else:
        env["gpu"] = None
    return env


def fmt(x: Any, spec: str = ".3g") -> str:
    return "—" if x is None else format(x, spec) if isinstance(x, float) else str(x)


def markdown(res: dict[str, Any]) -> str:
    env = res["environment"]
    lines = [
        "# GPU check (benchmarks/gpu_check.py)", "",
        f"Command: `{res['command']}`  ", f"Total: {res['total_seconds']:.1f} s  ",
        f"GPU: {env.get('gpu')} (capability {env.get('gpu_capability')}, {env.get('gpu_memory_gib')} GiB), "
        f"torch {env['torch']} (CUDA {env['torch_cuda']}, cuDNN {env['cudnn']}), lightning {env['lightning']}, "
        f"Python {env['python']}, float32 matmul precision `{env['float32_matmul_precision']}`, "
        f"{env['cpu_threads']} CPU threads", "",
    ]
    if "equivalence" in res:
        lines += [f"## 1. loop vs vmap on {res['device']} (eager, same seed; flag: relative difference > {REL_TOL:g})",
                  "", "| algorithm | rounds | clients/round | params max abs | params rel | val max abs | val rel |"
                  " val accuracy (loop / vmap) | flag |", "|---|---|---|---|---|---|---|---|---|"]
        for r in res["equivalence"]:
            if "error" in r:
                lines.append(f"| {r['algorithm']} | {r['rounds']} | {r['clients_per_round']} | ERROR: "
                             f"{r['error'][:150]} | | | | | FLAG |")
                continue
            key = next((k for k in r["val_loop"] if k.endswith("acc_weighted")), None)
            acc = f"{fmt(r['val_loop'].get(key), '.4f')} / {fmt(r['val_vmap'].get(key), '.4f')}" if key else "—"
            lines.append(f"| {r['algorithm']} | {r['rounds']} | {r['clients_per_round']} | {r['params']['max_abs']:.2e}"
                         f" | {r['params']['rel']:.2e} | {r['val']['max_abs']:.2e} | {r['val']['rel']:.2e} | {acc} |"
                         f" {'FLAG' if r['flag'] else 'ok'} |")
        lines.append("")
    if "bf16" in res:
        b = res["bf16"]
        lines += [f"## 2. bf16-mixed vs 32-true, FedAvg, {b['rounds']} rounds, {b['clients_per_round']} of "
                  f"{b['num_clients']} clients per round", "",
                  "| precision | first loss | final loss | finite | param dtype | val accuracy (weighted) | s |",
                  "|---|---|---|---|---|---|---|"]
        for p in ("32-true", "bf16-mixed"):
            r = b.get(p, {})
            if "error" in r:
                lines.append(f"| {p} | ERROR: {r['error'][:200]} | | | | | |")
                continue
            acc = r.get("val", {}).get(b.get("accuracy_key", ""), None)
            lines.append(f"| {p} | {fmt(r.get('first_loss'), '.4f')} | {fmt(r.get('final_loss'), '.4f')} | "
                         f"{r.get('loss_finite') and r.get('params_finite')} | {r.get('param_dtype')} | "
                         f"{fmt(acc, '.4f')} | {fmt(r.get('seconds'), '.1f')} |")
        lines += ["", f"bf16 flag: {'FLAG' if b['flag'] else 'ok'}", ""]
    if "speed" in res:
        lines += ["## 3. Speed: FedAvg on W-like data (MLP 784-80-60-10 ELU, τ = 10, B = 40, eager), "
                  "median s/round after 2 warm-up rounds (CUDA synchronised)", "",
                  "| device | clients/round | batching | ms/round | first round (s) | timed rounds |",
                  "|---|---|---|---|---|---|"]
        for r in res["speed"]:
            if "error" in r or "skipped" in r:
                lines.append(f"| {r['device']} | {r['clients_per_round']} | {r['batching']} | "
                             f"{r.get('skipped') or 'ERROR: ' + r['error'][:150]} | | |")
                continue
            lines.append(f"| {r['device']} | {r['clients_per_round']} | {r['batching']} | {r['ms_per_round']:.1f} | "
                         f"{r['first_round_s']:.2f} | {r['timed_rounds']} |")
        lines.append("")
    if "stages" in res:
        lines += [f"## 4. The engine's server stages on {res['device']} vs the CPU (FedAvg, vmap, same seed; "
                  "flag: params relative difference > 1e-4)", "",
                  "| stage | params max abs | params rel | val max abs | dp/clip | flag |", "|---|---|---|---|---|---|"]
        for r in res["stages"]:
            if "error" in r:
                lines.append(f"| {r['stage']} | ERROR: {r['error'][:150]} | | | | FLAG |")
                continue
            lines.append(f"| {r['stage']} | {r['params']['max_abs']:.2e} | {r['params']['rel']:.2e} | "
                         f"{r['val']['max_abs']:.2e} | {fmt(r['dp'].get('dp/clip'), '.4f')} | "
                         f"{'FLAG' if r['flag'] else 'ok'} |")
        lines.append("")
    failures = list(res.get("failures", []))
    lines += ["## Flags", ""] + ([f"- {f}" for f in failures] or ["- none"]) + [""]
    return "\n".join(lines)


def collect_failures(res: dict[str, Any]) -> list[str]:
    out = []
    for r in res.get("equivalence", []):
        if "error" in r:
            out.append(f"equivalence {r['algorithm']}: {r['error']}")
        elif r["flag"]:
            out.append(f"equivalence {r['algorithm']}: params rel {r['params']['rel']:.2e}, "
                       f"val rel {r['val']['rel']:.2e}, finite {r['params_finite']}, "
                       f"missing val keys {r['val']['missing']}")
    for r in res.get("stages", []):
        if r["flag"]:
            out.append(f"stage {r['stage']}: " + (r.get("error") or f"params rel {r['params']['rel']:.2e}"))
    b = res.get("bf16")
    if b and b["flag"]:
        errs = [f"{p}: {b[p]['error']}" for p in ("32-true", "bf16-mixed") if "error" in b.get(p, {})]
        out.append("bf16: " + ("; ".join(errs) or "non-finite loss or parameters"))
    for r in res.get("speed", []):
        if "error" in r:
            out.append(f"speed {r['device']} {r['clients_per_round']} {r['batching']}: {r['error']}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--quick", action="store_true", help="smoke run: fewer rounds and clients")
    p.add_argument("--cpu-speed", action="store_true", help="also time the speed rows on the CPU (on a cuda run)")
    p.add_argument("--budget", type=float, default=240.0, help="seconds after which remaining speed rows are skipped")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_fedmeta"):
        logging.getLogger(name).setLevel(logging.ERROR)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    deadline = start + args.budget
    res: dict[str, Any] = {"command": " ".join([Path(sys.argv[0]).as_posix(), *(argv or sys.argv[1:])]),
                           "device": args.device, "quick": args.quick, "rel_tol": REL_TOL,
                           "environment": environment(args.device)}
    print(json.dumps(res["environment"]), flush=True)

    def save() -> None:
        res["total_seconds"] = time.perf_counter() - start
        res["failures"] = collect_failures(res)
        (args.out / "gpu_check.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
        (args.out / "gpu_check.md").write_text(markdown(res))

    q = args.quick
    res["equivalence"] = check_equivalence(args.device, rounds=3, num_clients=10 if q else 20, per_round=5 if q else 10)
    save()
    res["stages"] = check_server_stages(args.device, rounds=4 if q else 6, num_clients=10 if q else 20,
                                        per_round=5 if q else 10)
    save()
    res["bf16"] = check_bf16(args.device, rounds=5 if q else 30, num_clients=10 if q else 30, per_round=5 if q else 10)
    save()
    speed_rounds = 4 if q else 12
    per_rounds = [5, 20] if q else [20, 100]
    res["speed"] = check_speed(args.device, speed_rounds, per_rounds, ["vmap", "loop"], deadline=deadline)
    save()
    if args.cpu_speed and args.device != "cpu":
        res["speed"] += check_speed("cpu", 6 if not q else 4, per_rounds, ["vmap", "loop"], deadline=deadline)
        save()
    print(markdown(res), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
