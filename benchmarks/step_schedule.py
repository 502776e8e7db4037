"""Sequential steps of a local-epoch round under each schedule, on PFLlib's Fashion-MNIST protocol (issue 38).

    python -m benchmarks.step_schedule [--time] [--rounds 2] [--device cpu] [--out benchmarks/results/step_schedule.md]

The clients are the protocol's own (``configs/datasets/fmnist_pfllib.yaml`` through
:func:`benchmarks.pfllib_protocol.run_config`: 20 clients, all join, 75 % of each client's rows for training, the
``pat`` and ``dir`` columns), each taking one epoch of ``drop_last`` batches of 10: ``s_c = ⌊n_c/10⌋``. For every
schedule of :mod:`lightning_fedmeta.loop.schedule` the table gives the groups, the **sequential batched steps** of a
round (``Σ_g ⌈n_g/chunk⌉·max_g``, what a latency-bound device pays), and the **computed client-steps** (the padded
ones included, what a FLOP-bound device pays); ``compacted`` computes only the real ones. ``auto`` is shown with the
cost model measured here (:meth:`~lightning_fedmeta.loop.RoundEngine.measure_step_cost` on FedAvgCNN, this device)
and with a latency-bound model (``a = 100 b``: a GPU's small step, where one group is optimal).

With ``--time`` each schedule also runs ``--rounds`` FedAvg rounds through the engine (``RoundEngine.run_round``, no
Trainer, no evaluation) and the table gives the mean wall seconds of the rounds after the first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.harness import REPO, utc_now  # noqa: E402
from benchmarks.pfllib_protocol import SPLITS, Settings, run_config  # noqa: E402
from lightning_fedmeta.algorithms.base import BatchPlan  # noqa: E402
from lightning_fedmeta.client.execution import AUTO_CHUNK  # noqa: E402
from lightning_fedmeta.client.sampling import plan_steps  # noqa: E402
from lightning_fedmeta.loop.schedule import (  # noqa: E402
    StepCost,
    StepSchedule,
    sequential_steps,
)

PLAN = BatchPlan(steps=0, batch_size=10, epochs=1, drop_last=True)
SCHEDULES = ("grouped", "lockstep", "compacted", "auto")


def protocol_module(split: str, schedule: str = "auto", device: str = "cpu", compile_clients: bool = False) -> Any:
    """FedAvg on the split's clients as the protocol runs it (FedAvgCNN, local rate 0.005, 1 epoch at batch 10)."""
    from lightning_fedmeta import FederatedModule
    from lightning_fedmeta.data import FederatedDataModule
    from lightning_fedmeta.models.reference import FedAvgCNN

    config = run_config("FedAvg", split, "final", 1, Settings())
    dm = FederatedDataModule(**config["data"])
    dm.setup("fit")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = FederatedModule(model=FedAvgCNN(in_channels=1, num_classes=10, image_size=28),
                                 algorithm=config["model"]["algorithm"], clients_per_round=20,
                                 compile_clients=compile_clients, step_schedule=schedule)
    assert dm.federated_data is not None
    module.attach_data(dm.federated_data)
    module.engine.place(torch.device(device))
    return module


def schedule_rows(steps: torch.Tensor, chunk: int | None, costs: dict[str, StepCost]) -> list[dict[str, Any]]:
    """One row per schedule (``auto`` once per cost model): groups, sequential steps, computed client-steps."""
    rows = []
    real = int(steps.sum())
    for mode in SCHEDULES:
        variants = costs.items() if mode == "auto" else [("", None)]
        for label, cost in variants:
            schedule = StepSchedule(mode)  # type: ignore[arg-type]
            schedule.cost = cost
            groups = schedule.groups(steps, "vmap", chunk)
            padded = sum(int(steps[g].max()) * g.numel() for g in groups)
            rows.append({
                "schedule": mode + (f" ({label})" if label else ""),
                "groups": len(groups),
                "sequential": sequential_steps(steps, groups, chunk),
                "computed": real if mode == "compacted" else padded,
                "real": real,
            })
    return rows


def time_rounds(split: str, schedule: str, rounds: int, device: str, compile_clients: bool = False) -> float:
    """Mean wall seconds of FedAvg rounds 2..``rounds`` under ``schedule`` (round 1 carries one-time costs, and with
    ``compile_clients`` the compilation of every program the rounds use: printed)."""
    module = protocol_module(split, schedule, device, compile_clients)
    opt = torch.optim.SGD(module.model.parameters(), lr=1.0)
    seconds = []
    for r in range(rounds):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        module.engine.run_round(r, opt)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    if compile_clients:
        stats = module.engine.compile.compiler.stats
        print(f"{split} {schedule}: {stats.programs} programs compiled in {stats.compile_seconds:.0f} s; rounds "
              f"{', '.join(f'{t:.1f}' for t in seconds)} s", flush=True)
    return statistics.mean(seconds[1:] if len(seconds) > 1 else seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "step_schedule.md")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--time", action="store_true", help="also time FedAvg rounds under each schedule")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="time with compile_clients=True")
    parser.add_argument("--splits", nargs="+", default=list(SPLITS), choices=list(SPLITS))
    parser.add_argument("--timed", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES),
                        help="the schedules --time runs (the others show a dash)")
    args = parser.parse_args(argv)
    lines = [
        "# Local-epoch schedules on PFLlib's Fashion-MNIST protocol (issue 38)", "",
        f"Command: `python -m benchmarks.step_schedule {' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"({utc_now()}; torch {torch.__version__}, {torch.get_num_threads()} threads). See the module docstring.",
        "",
    ]
    for split in args.splits:
        module = protocol_module(split, device=args.device)
        engine = module.engine
        counts = engine.data.train_counts.cpu()
        steps = plan_steps(counts, PLAN)
        chunk = engine.training_chunk
        measured = engine.measure_step_cost(int(steps.numel()), PLAN.batch_size)
        costs = {"latency-bound, a = 100 b": StepCost(100.0, 1.0)}
        if measured is not None:
            costs = {f"measured: a = {1e3 * measured.latency:.2f} ms, b = {1e3 * measured.per_client:.2f} ms":
                     measured, **costs}
        lines += [f"## {split}: {steps.numel()} clients, s_c from {int(steps.min())} to {int(steps.max())}, "
                  f"{int(steps.sum())} real client-steps", ""]
        header = "| schedule | clients per call | groups | sequential steps | computed client-steps | padding |"
        if args.time:
            header += f" FedAvg round, {args.device}{', compiled' if args.compile else ''} (s) |"
        lines += [header, "|---" * (header.count("|") - 1) + "|"]
        timed: dict[str, float] = {}
        rows = [(chunk, row) for row in schedule_rows(steps, chunk, costs)]
        if chunk != AUTO_CHUNK:  # a GPU's chunk (the CPU caps convolutions at 10 clients per call)
            rows += [(AUTO_CHUNK, row) for row in schedule_rows(steps, AUTO_CHUNK, costs) if "measured" not in
                     row["schedule"]]
        for call, row in rows:
            cells = [row["schedule"], str(call), str(row["groups"]), str(row["sequential"]), str(row["computed"]),
                     f"{100 * (row['computed'] - row['real']) / row['real']:.1f} %"]
            if args.time and call != chunk:
                cells.append("—")
            elif args.time:
                mode = row["schedule"].split(" ")[0]
                if (mode == "auto" and "latency" in row["schedule"]) or mode not in args.timed:
                    cells.append("—")
                else:
                    if mode not in timed:
                        timed[mode] = time_rounds(split, mode, args.rounds, args.device, args.compile)
                        print(f"{split} {mode}: {timed[mode]:.2f} s a round", flush=True)
                    cells.append(f"{timed[mode]:.2f}")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
