"""Where one training round of workload W spends its time.

Three views of the same rounds (``run_round`` of ``benchmarks/speed.py``: compute_round +
finiteness checks + aggregate + SGD server step + state scatter, no Trainer):

1. Sections: wall time of the round's parts, measured by wrapping the module's methods —
   client sampling + mini-batch gathering (``draw_batch_indices`` and the index gather),
   client-state gather, the client computation (``run_clients``: forward/backward under
   ``vmap`` or looped), and the server side (finiteness checks, aggregate, optimizer step,
   scatter). Shares are of the round's wall time.
2. ``torch.profiler``: the top aten ops by self CPU time (GEMMs vs element-wise vs copies).
3. ``cProfile``: the top Python functions by internal time (interpreter overhead of the
   functional stack: functorch wrappers, ``functional_call``, pytree helpers).

    python -m benchmarks.profile_round --algorithm "Per-FedAvg HF" --batching vmap --rounds 5
    python -m benchmarks.profile_round --algorithm FedAvg --batching loop --threads 1
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import logging
import pstats
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

import lightning_fedmeta.client.functional as functional_lib
import lightning_fedmeta.loop.clients as engine_lib  # the client half: where the engine calls run_clients
import lightning_fedmeta.loop.gather as gather_lib
from benchmarks import speed
from benchmarks.speed import ALGORITHMS, build_algorithm, load_workload, make_module, run_round
from lightning_fedmeta.client.functional import Params

__all__ = ["SectionTimer", "profile_sections", "PROPOSALS", "compare_proposals", "main"]


def _import_quietly(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:  # an algorithm being written elsewhere may not import yet
        return False
    return True


class SectionTimer:
    """Accumulates wall time of wrapped callables by section name."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = speed.CLOCK()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[name] += speed.CLOCK() - t0

        return timed


def profile_sections(
    module: Any, opt: torch.optim.Optimizer, start: int, rounds: int
) -> tuple[dict[str, float], float]:
    """Per-round ms of each section, and the median ms of a whole round.

    The module's ``_batches`` and ``client_states.gather`` are wrapped on the instance and
    ``run_clients`` in ``lightning_fedmeta.module``'s namespace; everything is restored after.
    """
    timer = SectionTimer()
    original_run, original_draw = engine_lib.run_clients, gather_lib.draw_batch_indices
    gather_lib.draw_batch_indices = timer.wrap("draw_batch_indices (Python loop, argsort)", original_draw)
    module._batches = timer.wrap("mini-batch index gather (train_x[idx])", module._batches)
    module.client_states.gather = timer.wrap("client-state gather", module.client_states.gather)
    engine_lib.run_clients = timer.wrap("client computation (run_clients)", original_run)
    times = []
    try:
        for r in range(start, start + rounds):
            t0 = speed.CLOCK()
            run_round(module, opt, r)
            times.append(speed.CLOCK() - t0)
    finally:
        engine_lib.run_clients, gather_lib.draw_batch_indices = original_run, original_draw
        del module._batches
        del module.client_states.gather
    total = sum(times)
    sections = {k: 1e3 * v / rounds for k, v in timer.totals.items()}
    # _batches includes draw_batch_indices: keep the two disjoint
    gather, draw = "mini-batch index gather (train_x[idx])", "draw_batch_indices (Python loop, argsort)"
    sections[gather] -= sections.get(draw, 0.0)
    sections["server: checks, aggregate, step, scatter + rest"] = 1e3 * total / rounds - sum(sections.values())
    return sections, 1e3 * statistics.median(times)


# ------------------------------------------------------------------------------------------------
# proposed optimisations, applied by monkeypatching (the diffs are in benchmarks/README.md)
# ------------------------------------------------------------------------------------------------
def _fused_tree_axpy(alpha: float | Tensor, x: Params, y: Params) -> Params:
    """``y + alpha * x`` in one kernel per leaf (``torch.add(..., alpha=)``) for a Python ``alpha``."""
    if isinstance(alpha, Tensor):
        return {k: y[k] + alpha * x[k] for k in y}
    return {k: torch.add(y[k], x[k], alpha=alpha) for k in y}


def _patch_axpy(on: bool) -> None:
    fn = _fused_tree_axpy if on else _ORIGINAL_AXPY
    for mod in (functional_lib, *_AXPY_IMPORTERS):
        mod.tree_axpy = fn


_ORIGINAL_AXPY = functional_lib.tree_axpy
_AXPY_IMPORTERS = [
    sys.modules[name] for name in ("lightning_fedmeta.algorithms.perfedavg", "lightning_fedmeta.algorithms.fedmaml")
    if _import_quietly(name)
]

#: name -> switch(on) of each proposal; "all" switches every one.
PROPOSALS: dict[str, Callable[[bool], None]] = {
    "fused tree_axpy (torch.add alpha=)": _patch_axpy,
}


def compare_proposals(module: Any, opt: torch.optim.Optimizer, start: int, rounds: int) -> list[str]:
    """Median ms/round with each proposal off and on, rounds interleaved (off, on, off, on, ...)
    so that load from other processes hits both sides alike."""
    switches = dict(PROPOSALS)
    switches["all of the above"] = lambda on: [fn(on) for fn in PROPOSALS.values()]  # type: ignore[func-returns-value]
    lines = []
    r = start
    for name, switch in switches.items():
        off, on = [], []
        for _ in range(rounds):
            for state, bucket in ((False, off), (True, on)):
                switch(state)
                t0 = speed.CLOCK()
                run_round(module, opt, r)
                bucket.append(speed.CLOCK() - t0)
                r += 1
        switch(False)
        a, b = 1e3 * statistics.median(off), 1e3 * statistics.median(on)
        lines.append(f"  {name:<40} off {a:8.1f} ms   on {b:8.1f} ms   saving {100 * (a - b) / a:5.1f}%")
    return lines


def main(argv: list[str] | None = None) -> int:
    labels = [label for label, _ in ALGORITHMS]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algorithm", default="Per-FedAvg HF", choices=labels)
    p.add_argument("--batching", default="vmap", choices=["vmap", "loop"])
    p.add_argument("--rounds", type=int, default=5, help="profiled rounds (after 2 warm-up rounds)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: as given)")
    p.add_argument("--top", type=int, default=20, help="rows of the op and function tables")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="cpu: process CPU time (robust to other processes; use with --threads 1)")
    p.add_argument("--compare", action="store_true", help="only time the proposed optimisations, off vs on")
    args = p.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    speed.CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    data = load_workload()
    module, opt = make_module(build_algorithm(dict(ALGORITHMS)[args.algorithm]), data, 10, args.batching)
    for r in range(2):
        run_round(module, opt, r)
    print(f"{args.algorithm}, {args.batching} clients, {torch.get_num_threads()} thread(s), {args.rounds} rounds")
    if args.compare:
        print("\n".join(compare_proposals(module, opt, 2, args.rounds)))
        return 0

    sections, median = profile_sections(module, opt, 2, args.rounds)
    print(f"\n== sections (median round {median:.1f} ms)")
    total = sum(sections.values())
    for name, ms in sections.items():
        print(f"  {name:<50} {ms:8.1f} ms  {100 * ms / total:5.1f}%")

    start = 2 + args.rounds
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for r in range(start, start + args.rounds):
            run_round(module, opt, r)
    print(f"\n== torch.profiler: top {args.top} ops by self CPU time ({args.rounds} rounds)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=40))

    start += args.rounds
    prof_py = cProfile.Profile()
    prof_py.enable()
    for r in range(start, start + args.rounds):
        run_round(module, opt, r)
    prof_py.disable()
    out = io.StringIO()
    pstats.Stats(prof_py, stream=out).sort_stats("tottime").print_stats(args.top)
    print(f"== cProfile: top {args.top} functions by internal time ({args.rounds} rounds)")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
