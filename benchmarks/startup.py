"""Start-up and per-round Lightning overhead of ``fedmeta fit`` (issue #12, "speed").

Three measurements, each in fresh subprocesses (this file re-runs itself with ``--child``), medians
over repeats, with the machine's load average (``os.getloadavg()``) sampled around every child:

(a) ``import lightning`` alone: the first thing every child does, timed there (4-8 s on the 2-core
    machine; not this project's code).
(b) The project's start-up after ``import lightning``, for ``fedmeta fit --config CONFIG --plots false``
    (workload W by default), split into named parts by wrapping the methods that bound them:

    * ``import``: ``import lightning_fedmeta.cli`` (the package, the CLI and what they import);
    * ``cli parse``: ``FedMetaCLI.__init__`` until ``instantiate_classes`` (jsonargparse parser
      built from the signatures, config read and checked);
    * ``instantiate``: the model and data module built from the config (``instantiate_classes``
      without the Trainer);
    * ``trainer``: ``instantiate_trainer`` (Trainer construction, callbacks added);
    * ``fit until data setup``: from there to ``FederatedDataModule.setup`` (seed, ``trainer.fit`` entry,
      ``prepare_data``, strategy set-up);
    * ``data read``: reading the dataset files (``load_dataset`` or the raw reader the data module calls);
    * ``partition``: the client split, the matching test split and the gather (with the pixel
      standardisation when it runs on the gathered rows);
    * ``data setup, other``: the rest of ``FederatedDataModule.setup`` (``FederatedData`` checks, summary);
    * ``module setup``: ``FederatedModule.setup`` (``attach_data``: model, state, pre-round checks);
    * ``until round 1``: from there to the entry of the first ``training_step`` (optimizers, dataloaders,
      callbacks' ``on_train_start``).

    The child stops at the entry of round ``--startup-rounds + 1`` (no evaluation runs), so the first
    rounds' times are reported too: round 1 carries one-off warm-up (first ``vmap``/autograd calls).
(c) Lightning's per-round overhead: ``fedmeta fit`` for N rounds with ``training_step``, ``self.log`` and
    ``validation_step`` timed, and before every round but the first one bare round (``speed.run_round``: the
    round's own work without the Trainer, no ``self.log``, a plain optimizer step) on the same module, at
    other round indices (other clients and batches). Pairing each Lightning round with a bare round run
    right next to it makes the difference immune to the load drifting on a shared machine. Per round:

    * ``step interval``: from one ``training_step`` entry to the next, minus the paired bare round (steps that
      straddle an evaluation left out), i.e. the whole Lightning loop per round;
    * ``training_step``: its own duration, of which ``self.log`` calls (Lightning's logging);
    * ``outside training_step`` = interval - training_step: batch fetch, callbacks (progress bar,
      plots/history), loop bookkeeping, logger;
    * ``overhead vs bare``: median of (interval - paired bare round).

    Three runs: a trivially cheap one (synthetic data, FedAvg with one local step of 8 samples on 2
    clients, progress bar and plots on) where the overhead is visible, the same with the CLI's default
    logger (CSV, a row every round), and workload W itself for R rounds, which also gives the end-to-end
    ratio of the issue: ``fit / (start-up + R x bare round + evaluations)`` (target <= 1.05), where ``fit``
    is the process's time after ``import lightning`` to the end of ``trainer.fit`` minus the paired bare
    rounds, and the bare round is their mean (the Lightning rounds are summed: warm-up, tails and all).
    Wall and CPU (``time.process_time``) figures are both given.

    python -m benchmarks.startup                # -> benchmarks/results/startup.md (about 1.5 minutes)
    python -m benchmarks.startup --quick        # fewer repeats and rounds (about 50 s) -> startup_quick.md
    python -m benchmarks.startup --threads 0    # torch's default threads (default 1: a shared 2-core machine)
    python -m benchmarks.startup --fit-args '--model.compile_clients false'   # extra fedmeta flags

The tables go between ``<!-- BEGIN startup.py -->`` and ``<!-- END startup.py -->`` of the output file;
text outside the markers (notes, figures from before a change) is kept. Every finished child appends
its record to ``runs/startup/records.jsonl``, keyed by the measurement, its arguments and a fingerprint
of the package's sources; ``--resume`` reuses matching records (an interrupted run picks up where it
stopped) while any edit of ``lightning_fedmeta`` measures afresh.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
RECORDS = ROOT / "runs" / "startup" / "records.jsonl"
DEFAULT_CONFIG = "benchmarks/perfedavg_hf_1000.yaml"
BEGIN = "<!-- BEGIN startup.py -->"
END = "<!-- END startup.py -->"

#: the start-up parts, in order, with their labels in the table
STARTUP_PARTS: tuple[tuple[str, str], ...] = (
    ("import", "import lightning_fedmeta + cli"),
    ("cli_parse", "CLI parsing (jsonargparse parser, config)"),
    ("instantiate", "instantiate model + data module"),
    ("trainer", "Trainer construction (+ callbacks)"),
    ("fit_to_setup", "fit until data setup (seed, prepare_data, strategy)"),
    ("data_read", "data read (dataset files)"),
    ("partition", "partition + test split + gather"),
    ("data_other", "data setup, other (checks, summary)"),
    ("module_setup", "module setup (attach_data, pre-round checks)"),
    ("to_round1", "until round 1 starts (optimizers, loaders, callbacks)"),
)

#: the trivially cheap fit of (c): synthetic data, FedAvg with 1 local step on 2 clients
CHEAP_ARGS: tuple[str, ...] = (
    "--seed_everything", "0",
    "--trainer.accelerator", "cpu", "--trainer.devices", "1",
    "--trainer.enable_checkpointing", "false",
    "--model.algorithm", '{"name": "fedavg", "local_steps": 1, "batch_size": 8, "finetune_steps": 0}',
    "--model.clients_per_round", "2",
    "--data.dataset", "synthetic", "--data.num_clients", "10",
)

# functions of lightning_fedmeta.data.datamodule that read files / split and gather (timed when present)
_READERS = ("load_dataset", "_load_pixels")
_SPLITTERS = ("iid", "dirichlet", "shards", "perfedavg_paper", "cap_client_sizes", "matching_test_split",
              "_gather")


# ------------------------------------------------------------------------------------------------
# child side: runs in a fresh interpreter, prints one JSON line
# ------------------------------------------------------------------------------------------------
class _Stop(Exception):
    """Raised at the entry of the first round not to be run: ends ``trainer.fit`` without evaluation."""


class _ClockView:
    """One clock's marks (name -> seconds) and spans (name -> ``[(start, end)]``); totals per name."""

    def __init__(self, marks: dict[str, float], spans: dict[str, list[tuple[float, float]]]) -> None:
        self.marks, self.spans = marks, spans
        self.totals = {n: sum(b - a for a, b in sp) for n, sp in spans.items()}


class _Clock:
    """Timestamps and durations of wrapped callables, on two clocks at once, relative to the child's start.

    ``wall`` (``time.perf_counter``) is what a user waits; ``cpu`` (``time.process_time``, this process's
    CPU time over all its threads) is nearly insensitive to other processes on a shared machine.
    :meth:`view` gives the marks, spans and totals of one clock.
    """

    CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}

    def __init__(self) -> None:
        self.t0 = {k: f() for k, f in self.CLOCKS.items()}
        self.marks: dict[str, dict[str, float]] = {}
        self.spans: dict[str, list[dict[str, tuple[float, float]]]] = {}

    def now(self) -> dict[str, float]:
        return {k: f() - self.t0[k] for k, f in self.CLOCKS.items()}

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, self.now())

    def record(self, name: str, start: dict[str, float]) -> None:
        end = self.now()
        self.spans.setdefault(name, []).append({k: (start[k], end[k]) for k in start})

    def count(self, name: str) -> int:
        return len(self.spans.get(name, []))

    def view(self, kind: str) -> _ClockView:
        return _ClockView(
            marks={n: m[kind] for n, m in self.marks.items()},
            spans={n: [sp[kind] for sp in spans] for n, spans in self.spans.items()},
        )

    def wrap(self, owner: Any, attr: str, name: str) -> None:
        """Replace ``owner.attr`` by a wrapper that records each call's span under ``name``."""
        fn = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.record(name, start)

        setattr(owner, attr, timed)

    def wrap_step(self, owner: Any, attr: str, name: str, before: Callable[[Any], None] | None = None) -> None:
        """Like :meth:`wrap` for a ``*_step(batch, batch_idx)`` hook, keeping that signature: Lightning
        reads it to decide whether to pass ``dataloader_idx``. ``before(module)`` runs untimed first."""
        fn = getattr(owner, attr)

        def step(module: Any, batch: Any, batch_idx: int) -> Any:
            if before is not None:
                before(module)
            start = self.now()
            try:
                return fn(module, batch, batch_idx)
            finally:
                self.record(name, start)

        setattr(owner, attr, step)


#: round index offset of the paired bare rounds: other clients and batches than the fit's own rounds
_BARE_ROUND_OFFSET = 1_000_000


def _bare_round_fn() -> Callable[[Any, int], None]:
    """``speed.run_round`` with a plain ``SGD(lr=server_lr)`` per module: the round without the Trainer."""
    import torch

    from benchmarks.speed import run_round

    optimizers: dict[int, Any] = {}

    def bare(module: Any, round_idx: int) -> None:
        if id(module) not in optimizers:
            optimizers[id(module)] = torch.optim.SGD(list(module.model.parameters()), lr=module.server_lr)
        run_round(module, optimizers[id(module)], round_idx)

    return bare


def _instrument(clock: _Clock, stop_before_round: int | None, paired: bool = False) -> None:
    """Wrap the CLI, data module and module methods that bound the start-up parts and the rounds.

    ``stop_before_round``: raise :class:`_Stop` at the entry of that round (1-based: after that many rounds).
    ``paired``: before every round but the first, run and time one bare round (span ``bare``) on the same
    module, so each Lightning round has a bare round measured right next to it, under the same load.
    """
    import lightning_fedmeta.data.datamodule as dm_lib
    from lightning_fedmeta.cli import FedMetaCLI
    from lightning_fedmeta.module import FederatedModule

    init = FedMetaCLI.__init__

    def cli_init(self: Any, *args: Any, **kwargs: Any) -> None:
        clock.mark("cli_start")
        init(self, *args, **kwargs)

    FedMetaCLI.__init__ = cli_init  # type: ignore[method-assign]
    clock.wrap(FedMetaCLI, "instantiate_classes", "instantiate_classes")
    clock.wrap(FedMetaCLI, "instantiate_trainer", "instantiate_trainer")
    clock.wrap(dm_lib.FederatedDataModule, "setup", "data_setup")
    for name in _READERS:
        if hasattr(dm_lib, name):
            clock.wrap(dm_lib, name, "data_read")
    for name in _SPLITTERS:
        if hasattr(dm_lib, name):
            clock.wrap(dm_lib, name, "partition")
    clock.wrap(FederatedModule, "setup", "module_setup")
    clock.wrap_step(FederatedModule, "validation_step", "validation_step")
    clock.wrap(FederatedModule, "log", "log")  # LightningModule.log, wrapped on the subclass

    bare = _bare_round_fn() if paired else None

    def before_round(module: Any) -> None:
        done = clock.count("training_step")
        if stop_before_round is not None and done >= stop_before_round:
            raise _Stop
        if bare is not None and done >= 1:
            start = clock.now()
            bare(module, _BARE_ROUND_OFFSET + done)
            clock.record("bare", start)

    clock.wrap_step(FederatedModule, "training_step", "training_step", before=before_round)


def _set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def _startup_parts(clock: _ClockView) -> dict[str, float]:
    """Seconds of each start-up part from the recorded marks and spans."""
    first = lambda name: clock.spans[name][0]  # noqa: E731 - (start, end) of the first call
    inst, trainer, data = first("instantiate_classes"), first("instantiate_trainer"), first("data_setup")
    module, round1 = first("module_setup"), first("training_step")
    read = clock.totals.get("data_read", 0.0)
    split = clock.totals.get("partition", 0.0)
    parts = {
        "import": clock.marks["imported"] - clock.marks["lightning"],
        "cli_parse": inst[0] - clock.marks["cli_start"],
        "instantiate": (inst[1] - inst[0]) - (trainer[1] - trainer[0]),
        "trainer": trainer[1] - trainer[0],
        "fit_to_setup": data[0] - inst[1],
        "data_read": read,
        "partition": split,
        "data_other": (data[1] - data[0]) - read - split,
        "module_setup": module[1] - module[0],
        "to_round1": round1[0] - module[1],
    }
    parts["total"] = round1[0] - clock.marks["lightning"]
    return parts


def child_startup(config: str, rounds: int, threads: int | None, extra: Sequence[str] = ()) -> dict[str, Any]:
    """(a) + (b): time ``import lightning``, then ``fedmeta fit`` up to the entry of round ``rounds + 1``."""
    clock = _Clock()
    import lightning  # noqa: F401 - timed: (a)

    clock.mark("lightning")
    import lightning_fedmeta.cli as cli

    clock.mark("imported")
    _set_threads(threads)
    _instrument(clock, stop_before_round=rounds)
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["fit", "--config", str(ROOT / config), "--plots", "false",
                "--trainer.default_root_dir", tmp, "--trainer.enable_progress_bar", "false", *extra]
        try:
            cli.run(argv)
        except _Stop:
            pass
    out = {}
    for kind in _Clock.CLOCKS:
        view = clock.view(kind)
        out[kind] = {
            "import_lightning": view.marks["lightning"],
            "parts": _startup_parts(view),
            "rounds": [end - start for start, end in view.spans.get("training_step", [])],
        }
    return out


def _fit_summary(view: _ClockView, fit_end: float) -> dict[str, Any]:
    """Per-round figures of one clock, from rounds whose next round follows without an evaluation.

    With paired bare rounds, the interval from round ``i``'s entry to round ``i + 1``'s holds round ``i``,
    Lightning's work between the two, and the bare round run just before round ``i + 1``; that bare
    round is taken out of the interval and paired with it.
    """
    steps = view.spans["training_step"]
    evals = view.spans.get("validation_step", [])
    bares = view.spans.get("bare", [])
    log_spans = view.spans.get("log", [])
    intervals, inside, logs, paired = [], [], [], []
    rounds_total = steps[-1][1] - steps[-1][0]  # Lightning's rounds, summed: the last one's step alone
    for i, ((s0, e0), (s1, _)) in enumerate(zip(steps, steps[1:], strict=False)):
        bare = bares[i][1] - bares[i][0] if i < len(bares) else 0.0  # bare round i + 2 runs before step i + 2
        between = sum(v1 - v0 for v0, v1 in evals if s0 <= v0 <= s1)
        rounds_total += s1 - s0 - bare - between
        if between:
            continue  # an evaluation ran between these two rounds
        intervals.append(s1 - s0 - bare)
        inside.append(e0 - s0)
        logs.append(sum(b - a for a, b in log_spans if s0 <= a <= e0))
        paired.append(bare)
    return {
        "import_lightning": view.marks["lightning"],
        "startup": steps[0][0] - view.marks["lightning"],
        "fit_end": fit_end,
        "rounds": len(steps),
        "step_interval": intervals,
        "training_step": inside,
        "log": logs,
        "bare": paired,
        "bare_all": [b - a for a, b in bares],
        "rounds_total": rounds_total,
        "evaluations": [b - a for a, b in evals],
        "after_last_round": fit_end - steps[-1][1],
    }


def child_fit(args: Sequence[str], rounds: int, threads: int | None) -> dict[str, Any]:
    """(c): ``fedmeta fit ARGS --trainer.max_steps rounds`` with its rounds timed, each paired with a bare round."""
    clock = _Clock()
    import lightning  # noqa: F401

    clock.mark("lightning")
    import lightning_fedmeta.cli as cli

    clock.mark("imported")
    _set_threads(threads)
    _instrument(clock, stop_before_round=None, paired=True)
    with tempfile.TemporaryDirectory() as tmp:
        cli.run(["fit", *args, "--trainer.max_steps", str(rounds), "--trainer.default_root_dir", tmp])
        fit_end = clock.now()
    return {kind: _fit_summary(clock.view(kind), fit_end[kind]) for kind in _Clock.CLOCKS}


# ------------------------------------------------------------------------------------------------
# parent side: runs the children, keeps their records, writes the table
# ------------------------------------------------------------------------------------------------
def _fingerprint() -> str:
    """SHA-256 (16 hex digits) of the package's sources and this script: a record is reused only if equal."""
    h = hashlib.sha256()
    for path in sorted((ROOT / "lightning_fedmeta").rglob("*.py")) + [Path(__file__).resolve()]:
        h.update(str(path.relative_to(ROOT)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _run_child(kind: str, payload: dict[str, Any], threads: int | None) -> dict[str, Any]:
    """Run one child measurement in a fresh interpreter and return its record (with load averages)."""
    env = dict(os.environ)
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    cmd = [sys.executable, "-m", "benchmarks.startup", "--child", kind, "--payload", json.dumps(payload)]
    load_before = os.getloadavg()
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    process_wall = time.perf_counter() - t
    load_after = os.getloadavg()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{\"result\"")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child {kind} failed (status {proc.returncode}):\n{proc.stderr[-4000:]}")
    record = json.loads(lines[-1])["result"]
    record.update(process_wall=process_wall, load=[load_before[0], load_after[0]])
    return record


def _measure(kind: str, payload: dict[str, Any], repeats: int, threads: int | None, resume: bool,
             fingerprint: str) -> list[dict[str, Any]]:
    """``repeats`` records of one measurement: matching stored ones first (``--resume``), then new children."""
    from benchmarks.harness import append_record, read_records  # parent side only: children time their imports

    key = {"kind": kind, "payload": payload, "threads": threads, "fingerprint": fingerprint}
    found = [r["record"] for r in read_records(RECORDS) if r.get("key") == key] if resume else []
    while len(found) < repeats:
        print(f"  {kind} {len(found) + 1}/{repeats} ...", file=sys.stderr, flush=True)
        record = _run_child(kind, payload, threads)
        append_record(RECORDS, {"key": key, "record": record})
        found.append(record)
    return found[:repeats]


def _med(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _ms(x: float) -> str:
    return f"{1000 * x:.1f}"


def _s(x: float) -> str:
    return f"{x:.2f}"


def _startup_table(records: list[dict[str, Any]]) -> list[str]:
    """Wall seconds of each start-up part (median, min, max over the children) and the median CPU seconds."""
    lines = [
        "| part | median s | min s | max s | CPU s (median) |",
        "|---|---|---|---|---|",
    ]
    walls, cpus = [r["wall"] for r in records], [r["cpu"] for r in records]
    imports = [r["import_lightning"] for r in walls]
    lines.append(f"| *`import lightning` (not ours)* | *{_s(_med(imports))}* | *{_s(min(imports))}* | "
                 f"*{_s(max(imports))}* | *{_s(_med([r['import_lightning'] for r in cpus]))}* |")
    for key, label in (*STARTUP_PARTS, ("total", "**project start-up (sum)**")):
        vals = [r["parts"][key] for r in walls]
        cpu = _med([r["parts"][key] for r in cpus])
        b = "**" if key == "total" else ""
        lines.append(f"| {label} | {b}{_s(_med(vals))}{b} | {_s(min(vals))} | {_s(max(vals))} | {_s(cpu)} |")
    return lines


def _rounds_line(records: list[dict[str, Any]]) -> str:
    per_round = list(zip(*[r["wall"]["rounds"] for r in records], strict=False))
    cells = ", ".join(f"round {i + 1}: {_s(_med(v))} s" for i, v in enumerate(per_round))
    return (f"First rounds of the start-up children (wall, median over children; round work, not start-up): "
            f"{cells}.")


def _fit_row(label: str, rec: dict[str, Any]) -> str:
    interval, inside, bare = _med(rec["step_interval"]), _med(rec["training_step"]), _med(rec["bare"])
    over = _med([i - b for i, b in zip(rec["step_interval"], rec["bare"], strict=True)])  # paired differences
    return (
        f"| {label} | {rec['rounds']} | {_ms(interval)} | {_ms(inside)} | {_ms(_med(rec['log']))} | "
        f"{_ms(interval - inside)} | {_ms(bare)} | {_ms(over)} ({100 * over / bare:.0f}%) |"
    )


def _fit_table(rows: list[tuple[str, dict[str, Any]]]) -> list[str]:
    lines = [
        "| run | clock | rounds | step interval ms | training_step ms | of which self.log ms "
        "| outside training_step ms | bare round ms | overhead vs bare ms (%) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, rec in rows:
        for kind in _Clock.CLOCKS:
            lines.append(_fit_row(f"{label} | {kind}", rec[kind]))
    return lines


def _e2e_table(rec: dict[str, Any], rounds: int) -> list[str]:
    lines = [
        "| quantity | wall s | CPU s |",
        "|---|---|---|",
    ]
    cols: dict[str, dict[str, float]] = {}
    for kind in _Clock.CLOCKS:
        r = rec[kind]
        bare = statistics.fmean(r["bare_all"])  # the mean, as the Lightning rounds are summed
        evals = sum(r["evaluations"])
        total = r["fit_end"] - r["import_lightning"] - sum(r["bare_all"])  # without the paired bare rounds
        cols[kind] = {
            "total": total, "startup": r["startup"], "bare": bare, "rounds": rounds * bare, "evals": evals,
            "lightning": r["rounds_total"], "rest": total - r["startup"] - r["rounds_total"] - evals,
            "ratio": total / (r["startup"] + rounds * bare + evals),
        }
    w, c = cols["wall"], cols["cpu"]
    lines += [
        f"| `fedmeta fit` after `import lightning`, to the end of `fit` (paired bare rounds taken out) | "
        f"{_s(w['total'])} | {_s(c['total'])} |",
        f"| start-up (until round 1 starts) | {_s(w['startup'])} | {_s(c['startup'])} |",
        f"| {rounds} rounds in Lightning, their overhead and round 1's warm-up included | {_s(w['lightning'])} | "
        f"{_s(c['lightning'])} |",
        f"| {rounds} x mean bare round ({_ms(w['bare'])} / {_ms(c['bare'])} ms) | {_s(w['rounds'])} | "
        f"{_s(c['rounds'])} |",
        f"| evaluations ({len(rec['wall']['evaluations'])} x validation_step) | {_s(w['evals'])} | {_s(c['evals'])} |",
        f"| the rest (validation loop around the steps, fit end, teardown) | {_s(w['rest'])} | {_s(c['rest'])} |",
        f"| **ratio: fit / (start-up + rounds x bare + evaluations)** (target <= 1.05) | **{w['ratio']:.3f}** | "
        f"**{c['ratio']:.3f}** |",
    ]
    return lines


def _machine(load: list[float], threads: int | None) -> str:
    import torch  # only for the version and the default thread count

    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}, "
        f"threads {threads or torch.get_num_threads()}; 1-minute load average over the children "
        f"{min(load):.2f}-{max(load):.2f} (median {statistics.median(load):.2f})"
    )


def _write(out: Path, lines: list[str]) -> None:
    """Write ``lines`` between :data:`BEGIN` and :data:`END` of ``out``, keeping the text outside the markers
    (notes, the figures from before a change); a file without the markers is replaced."""
    block = "\n".join([BEGIN, *lines, END]) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = out.read_text(encoding="utf-8") if out.exists() else ""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        tail = rest.split(END, 1)[1].lstrip("\n")
        out.write_text(head + block + ("\n" + tail if tail else ""), encoding="utf-8")
    else:
        out.write_text(block, encoding="utf-8")


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="2 start-up children, short fits; writes startup_quick.md")
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"the workload's config (default {DEFAULT_CONFIG})")
    p.add_argument("--repeats", type=int, default=None, help="start-up children (default 5, --quick 2)")
    p.add_argument("--startup-rounds", type=int, default=3, help="rounds each start-up child runs (default 3)")
    p.add_argument("--cheap-rounds", type=int, default=None, help="rounds of the cheap fit (default 300, quick 100)")
    p.add_argument("--w-rounds", type=int, default=None, help="rounds of the workload fit (default 30, quick 10)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch/OMP threads of the children (default 1: on a shared 2-core machine more threads wait "
                        "for each other; 0: torch's default)")
    p.add_argument("--fit-args", default="",
                   help="extra fedmeta arguments for every child (e.g. '--model.compile_clients false'), shell-split")
    p.add_argument("--note", default="", help="a line added under the command in the markdown (what tree, why)")
    p.add_argument("--resume", action="store_true", help="reuse matching records of runs/startup/records.jsonl")
    p.add_argument("--out", type=Path, default=None, help="markdown file (default results/startup[_quick].md)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--payload", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.child is not None:
        payload = json.loads(args.payload)
        if args.child == "startup":
            result = child_startup(payload["config"], payload["rounds"], payload["threads"], payload["extra"])
        else:
            result = child_fit(payload["args"], payload["rounds"], payload["threads"])
        print(json.dumps({"result": result}), flush=True)
        return 0

    repeats = args.repeats or (2 if args.quick else 5)
    cheap_rounds = args.cheap_rounds or (100 if args.quick else 300)
    w_rounds = args.w_rounds or (10 if args.quick else 30)
    fingerprint = _fingerprint()
    threads = args.threads or None
    t_start = time.perf_counter()

    def measure(kind: str, payload: dict[str, Any], n: int = 1) -> list[dict[str, Any]]:
        return _measure(kind, {**payload, "threads": threads}, n, threads, args.resume, fingerprint)

    extra = shlex.split(args.fit_args)
    startup = measure("startup", {"config": args.config, "rounds": args.startup_rounds, "extra": extra}, repeats)
    cheap_args = [*CHEAP_ARGS, "--data.eval_every", str(cheap_rounds), *extra]
    cheap = measure("fit", {"args": [*cheap_args, "--trainer.logger", "false"], "rounds": cheap_rounds})[0]
    cheap_logged = measure("fit", {"args": cheap_args, "rounds": cheap_rounds})[0]
    w_args = ["--config", str(ROOT / args.config), "--plots", "false", *extra]
    w = measure("fit", {"args": w_args, "rounds": w_rounds})[0]

    loads = [x for r in [*startup, cheap, cheap_logged, w] for x in r["load"]]
    command = "python -m benchmarks.startup" + (" --quick" if args.quick else "") + (
        f" --threads {args.threads}" if args.threads != 1 else "") + (
        f" --fit-args {shlex.quote(args.fit_args)}" if args.fit_args else "")
    out = args.out or RESULTS / ("startup_quick.md" if args.quick else "startup.md")
    lines = [
        "# Start-up and per-round Lightning overhead of `fedmeta fit`",
        "",
        f"Command: `{command}`  ",
        *([f"{args.note}  "] if args.note else []),
        f"Machine: {_machine(loads, threads)}  ",
        f"Workload W: `fedmeta fit --config {args.config} --plots false` (Fashion-MNIST `perfedavg_paper`, "
        f"50 clients, Per-FedAvg HF). Every figure comes from fresh subprocesses (`--child`); medians over "
        f"{repeats} start-up children. Target: the project's start-up after `import lightning` <= 2 s (wall).",
        "",
        "## Start-up (wall seconds unless marked)",
        "",
        *_startup_table(startup),
        "",
        _rounds_line(startup),
        "",
        "## Lightning per-round overhead",
        "",
        "Bare round = `speed.run_round` (the round's work without the Trainer: no `self.log`, plain optimizer "
        "step), run on the same module right before every Lightning round but the first (other clients and "
        "batches); step interval = one `training_step` entry to the next minus that bare round (rounds followed "
        "by an evaluation left out); overhead = median of the paired differences interval - bare. CPU time "
        "(`time.process_time`) is nearly immune to other processes; wall time is what a user waits.",
        "",
        *_fit_table([
            ("cheap: synthetic, FedAvg 1 step x 8 samples, 2 clients/round; progress bar + plots on, logger off",
             cheap),
            ("cheap, CLI defaults (CSVLogger on, `log_every_n_steps` 1)", cheap_logged),
            (f"W: `{args.config}` (progress bar and logger off, `--plots false`)", w),
        ]),
        "",
        f"## End to end on W ({w_rounds} rounds, evaluation every 10)",
        "",
        *_e2e_table(w, w_rounds),
        "",
        f"Measured in {time.perf_counter() - t_start:.0f} s.",
        "",
    ]
    _write(out, lines)
    print("\n".join(lines))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
