"""What the benchmarks share: result files, ``fedmeta fit`` runs in a subprocess, in-process runs, report helpers.

* **Result files** are JSON lines, one record a line, appended the moment a run finishes
  (:func:`append_record`), so an interrupted benchmark resumes: :func:`read_records` skips a line cut by an
  interrupted write, :func:`records_by_key` keeps the newest record of each key.
* **A run of the CLI** (:func:`run_fit`): ``python -m lightning_fedmeta.cli fit --config CONFIG OVERRIDES
  --trainer.default_root_dir OUT --trainer.enable_progress_bar false`` in a fresh process, its folder ``OUT``
  emptied first (a stale history must never be read), its output kept in ``OUT/run.log``, and its numbers read
  from what ``fedmeta fit`` writes, the newest ``fedmeta_history.json`` under ``OUT`` (``PlotCallback``), never
  re-computed. :func:`fit_record` adds :func:`final_metrics`: the final-round accuracies, the best round, the
  per-client accuracies and the curve. :func:`run_fit_until` is the same run ended at a deadline (a time budget).
* **In-process runs**: :func:`limit_threads` and :func:`quiet_trainer` (a CPU Trainer with logging,
  checkpointing, progress bar and sanity checks off).
* **Reports**: :func:`mean_std`, :func:`pct`, :func:`fmt_duration`, :func:`sha256_text`, :func:`git_commit`.

Only the standard library is imported at module level (Lightning inside :func:`quiet_trainer`), so a benchmark
that times start-up can import this module. Benchmarks are run from the repository root as modules:
``python -m benchmarks.<name>`` (benchmarks/README.md).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "REPO", "DeadlineRun", "FitRun", "append_record", "final_metrics", "fit_command", "fit_record", "fmt_duration",
    "git_commit",
    "limit_threads", "mean_std", "pct", "quiet_trainer", "read_history", "read_records", "records_by_key",
    "run_fit", "run_fit_until", "sha256_text", "thread_env", "utc_now",
]

#: the repository root (benchmarks/..)
REPO = Path(__file__).resolve().parent.parent


# -- result files ----------------------------------------------------------------------------------
def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a JSON-lines results file, in order ([] when it does not exist; blank lines and lines cut
    by an interrupted write are skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by an interrupted write
    return out


def records_by_key(path: str | os.PathLike[str], key: str = "key") -> dict[Any, dict[str, Any]]:
    """The records of a JSON-lines results file by their ``key`` field (the newest record of a key wins)."""
    return {r[key]: r for r in read_records(path) if key in r}


def append_record(path: str | os.PathLike[str], record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line to ``path`` (its folder created): a finished run is kept at once."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(record) + "\n")


# -- fedmeta fit in a subprocess ---------------------------------------------------------------------
@dataclass(frozen=True)
class FitRun:
    """One ``fedmeta fit`` process: its command line, wall time, end time and outcome."""

    command: str  #: as a user would type it: ``fedmeta fit --config ...``
    wall_s: float  #: the whole process (start-up, data loading, evaluation included)
    finished_at: str  #: UTC, ISO 8601 to the second
    error: str | None  #: the last line of stderr (or ``exit status N``), or that no history was written
    history: dict[str, Any] | None  #: the ``fedmeta_history.json`` document, when the run succeeded


def thread_env(threads: int | None) -> dict[str, str]:
    """This process's environment, with ``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` set to ``threads`` if given."""
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def fit_command(config: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                overrides: Sequence[str] = ()) -> list[str]:
    """The argv of ``fedmeta fit --config CONFIG OVERRIDES`` writing into ``out_dir``, without a progress bar."""
    return [sys.executable, "-m", "lightning_fedmeta.cli", "fit", "--config", os.fspath(config), *overrides,
            "--trainer.default_root_dir", os.fspath(out_dir), "--trainer.enable_progress_bar", "false"]


def read_history(out_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The newest ``fedmeta_history.json`` under ``out_dir`` (``None`` if there is none)."""
    histories = sorted(Path(out_dir).glob("**/fedmeta_history.json"), key=lambda p: p.stat().st_mtime)
    return json.loads(histories[-1].read_text()) if histories else None


def _fresh_fit(config: str | os.PathLike[str], out_dir: str | os.PathLike[str], overrides: Sequence[str]
               ) -> tuple[Path, list[str], str]:
    """``out_dir`` emptied and made (a stale history from an earlier run must never be read), the ``fedmeta fit``
    command line and how it reads."""
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    cmd = fit_command(config, out, overrides)
    return out, cmd, "fedmeta " + " ".join(cmd[3:])


def run_fit(config: str | os.PathLike[str], out_dir: str | os.PathLike[str], overrides: Sequence[str] = (), *,
            threads: int | None = None, cwd: str | os.PathLike[str] | None = None) -> FitRun:
    """Run ``fedmeta fit`` on ``config`` in a fresh process writing into ``out_dir`` (emptied first).

    ``overrides`` follow ``--config`` on the command line; ``threads`` sets the run's OMP/MKL threads; ``cwd``
    is the run's working folder (a relative ``config`` is read from there). The output goes to
    ``out_dir/run.log``; the history is read back when the process succeeded.
    """
    out_dir, cmd, command = _fresh_fit(config, out_dir, overrides)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=thread_env(threads))
    wall_s = time.perf_counter() - start
    finished = utc_now()
    (out_dir / "run.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return FitRun(command, wall_s, finished, lines[-1] if lines else f"exit status {proc.returncode}", None)
    history = read_history(out_dir)
    return FitRun(command, wall_s, finished, None if history else "no fedmeta_history.json written", history)


def final_metrics(doc: dict[str, Any], rounds: int) -> dict[str, Any]:
    """A record's metrics, read from a ``fedmeta_history.json`` document whose last evaluation must be round
    ``rounds``: final weighted, mean and worst-decile accuracy (training and new clients), the best evaluated
    round, the per-client accuracies and the curve ``[round, weighted, worst 10%, new clients]``; or ``error``."""
    vals = [h for h in doc["history"] if h.get("stage") == "val"]
    if not vals:
        return {"error": "no validation in the history"}
    last = vals[-1]
    if int(last["round"]) != rounds:
        return {"error": f"last evaluation at round {last['round']}, not the final round {rounds}"}
    m = last["metrics"]
    best = max(vals, key=lambda h: h["metrics"].get("val/acc_weighted", -math.inf))
    per_client = (doc.get("per_client") or {}).get("acc")
    return {
        "eval_round": int(last["round"]),
        "acc_weighted": m.get("val/acc_weighted"),
        "acc_mean": m.get("val/acc_mean"),
        "acc_worst10": m.get("val/acc_worst10"),
        "new_acc_weighted": m.get("val/new/acc_weighted"),
        "new_acc_worst10": m.get("val/new/acc_worst10"),
        "best_round": int(best["round"]),
        "best_acc_weighted": best["metrics"].get("val/acc_weighted"),
        "per_client_acc": per_client,
        "is_new_client": doc.get("is_new_client"),
        "per_client_round": doc.get("per_client_round"),
        "curve": [
            [int(h["round"]), h["metrics"].get("val/acc_weighted"), h["metrics"].get("val/acc_worst10"),
             h["metrics"].get("val/new/acc_weighted")]
            for h in vals
        ],
    }


def fit_record(config: str | os.PathLike[str], out_dir: str | os.PathLike[str], rounds: int,
               overrides: Sequence[str] = (), *, threads: int | None = None,
               cwd: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """:func:`run_fit`, as record fields: ``threads``, ``git_commit``, ``command``, ``wall_s``, ``finished_at``,
    then ``error`` or the :func:`final_metrics` of a run of ``rounds`` rounds."""
    rec: dict[str, Any] = {"threads": threads, "git_commit": git_commit()}
    run = run_fit(config, out_dir, overrides, threads=threads, cwd=cwd)
    rec.update(command=run.command, wall_s=run.wall_s, finished_at=run.finished_at)
    if run.error is not None:
        return rec | {"error": run.error}
    assert run.history is not None
    return rec | final_metrics(run.history, rounds)


# -- in-process runs ---------------------------------------------------------------------------------
def limit_threads(threads: int | None) -> None:
    """Run this process's torch on ``threads`` threads (OMP/MKL too); ``None`` keeps torch's default."""
    if threads is None:
        return
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


def quiet_trainer(max_steps: int, **kwargs: Any) -> Any:
    """A CPU ``lightning.Trainer`` of ``max_steps`` rounds with logging, checkpointing, progress bar, model
    summary and sanity checks off unless ``kwargs`` say otherwise."""
    import lightning as L

    options: dict[str, Any] = {
        "max_steps": max_steps, "max_epochs": -1, "accelerator": "cpu", "devices": 1, "logger": False,
        "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    options.update(kwargs)
    return L.Trainer(**options)


# -- records and reports -----------------------------------------------------------------------------
def sha256_text(text: str) -> str:
    """The SHA-256 hex digest of ``text`` (UTF-8)."""
    return hashlib.sha256(text.encode()).hexdigest()


def git_commit() -> str | None:
    """The repository's ``HEAD`` commit (``None`` outside a git checkout)."""
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def utc_now() -> str:
    """Now, UTC, ISO 8601 to the second."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def mean_std(xs: Iterable[float]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation; ``None`` for the mean of nothing and the std of fewer than 2 values."""
    xs = list(xs)
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def pct(mean: float | None, std: float | None, signed: bool = False) -> str:
    """A fraction's mean ± std in percent (``missing`` without a mean, ``(1 seed)`` without a std)."""
    if mean is None:
        return "missing"
    return f"{100 * mean:{'+' if signed else ''}.2f}" + (f" ± {100 * std:.2f}" if std is not None else " (1 seed)")


def fmt_duration(s: float) -> str:
    """Seconds as ``1h02m`` or ``3m05s``."""
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


# -- fedmeta fit in a subprocess, stopped at a deadline ---------------------------------------------------
@dataclass(frozen=True)
class DeadlineRun:
    """:class:`FitRun` of :func:`run_fit_until`, and whether the process was stopped at the deadline."""

    run: FitRun
    killed: bool  #: ``True``: the deadline came first and the process was ended (no history is read)


def run_fit_until(config: str | os.PathLike[str], out_dir: str | os.PathLike[str], overrides: Sequence[str] = (),
                  *, deadline: float | None = None, threads: int | None = None,
                  cwd: str | os.PathLike[str] | None = None, poll_s: float = 0.5, grace_s: float = 10.0,
                  clock: Callable[[], float] = time.monotonic) -> DeadlineRun:
    """:func:`run_fit`, ended at ``deadline`` (a ``clock()`` value, ``time.monotonic`` by default; ``None``: no
    limit).

    The process runs in its own process session with its output written to files (no pipe to fill while it is
    polled every ``poll_s``); at the deadline its process group gets SIGTERM, then SIGKILL after ``grace_s``. A
    killed run's folder keeps ``run.log``; its history is not read (the run did not finish). What the process
    wrote elsewhere (a checkpoint folder named in its config) stays, so a later run can resume from it.
    """
    import signal

    out_dir, cmd, command = _fresh_fit(config, out_dir, overrides)
    stdout_path, stderr_path = out_dir / "stdout.txt", out_dir / "stderr.txt"
    start = time.perf_counter()
    killed = False
    with stdout_path.open("w") as out, stderr_path.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=err, text=True, env=thread_env(threads),
                                start_new_session=True)
        while proc.poll() is None:
            if deadline is not None and clock() >= deadline:
                killed = True
                for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
                    try:
                        os.killpg(proc.pid, sig)  # the child's own group: it and the workers it started
                    except ProcessLookupError:
                        break
                    try:
                        proc.wait(timeout=wait)
                        break
                    except subprocess.TimeoutExpired:
                        continue
                proc.wait()
                break
            time.sleep(poll_s)
    wall_s = time.perf_counter() - start
    finished = utc_now()
    stdout, stderr = stdout_path.read_text(errors="replace"), stderr_path.read_text(errors="replace")
    (out_dir / "run.log").write_text(stdout + "\n--- stderr ---\n" + stderr)
    stdout_path.unlink()
    stderr_path.unlink()
    if killed:
        return DeadlineRun(FitRun(command, wall_s, finished, "stopped at the deadline", None), True)
    if proc.returncode != 0:
        lines = stderr.strip().splitlines()
        return DeadlineRun(FitRun(command, wall_s, finished, lines[-1] if lines else f"exit status {proc.returncode}",
                                  None), False)
    history = read_history(out_dir)
    return DeadlineRun(FitRun(command, wall_s, finished, None if history else "no fedmeta_history.json written",
                              history), False)
