"""PFLlib's published benchmark protocol on Fashion-MNIST, both label-skew columns (issue 26, item 5).

    python -m benchmarks.pfllib_protocol [--threads 1] [--only FedAvg Ditto] [--splits pat dir]
                                         [--max-rounds 2000] [--quick] [--report-only]
                                         [--budget-minutes M] [--state-dir DIR] [--ckpt-every 5]

The protocol of PFLlib's leaderboard (github.com/TsingZ0/PFLlib, docs/benchmark.html, "Other Implementation
Details"): 20 clients, all join every round, each client's rows split 75/25, batch 10, 1 local epoch (PFLlib's
``DataLoader(drop_last=True)``), the 4-layer CNN (``FedAvgCNN``), local rate 0.005, the same clients as PFLlib's
``np.random.seed(1)`` (configs/datasets/fmnist_pfllib.yaml). Two columns: ``pat`` (pathological, 2 classes per
client) and ``dir`` (``dirichlet_min_size``, Dir(0.1)). Every algorithm PFLlib and this library share runs with
PFLlib's defaults for its own hyper-parameters (``system/main.py`` and the algorithm's client/server files,
:data:`SPECS`). An algorithm that refuses ``local_epochs`` runs ``local_steps`` = the median client's steps of one
epoch, computed from the split (:func:`local_work`).

Two phases per (algorithm, split), so that nothing is chosen on test data:

1. **stop** (seed 0): ``data.validation_fraction 0.2`` (the test rows are never read), evaluated every round, and
   Lightning's ``EarlyStopping(monitor="val/acc_weighted", mode="max", min_delta=0.001, patience=20)``, or
   ``--max-rounds``. The stopping round is the last round run. The rule: a round *improves* when its validation
   accuracy exceeds the reference by more than 0.1 point, and the reference is then set to it; the run stops after
   20 rounds in a row without an improvement. It is not "the last round minus the round 20 earlier < 0.1 point":
   the reference is the accuracy at the last improvement (not the best accuracy seen, since gains of at most 0.1
   point do not move it, nor the accuracy 20 rounds ago), and any single round above it by more than 0.1 point
   resets the count, even if accuracy falls back.
2. **final** (seeds 0, 1, 2): the full training rows, the stopping round's number of rounds, evaluated on the test
   rows every round. Reported: the final round's accuracy (the headline), the best round's accuracy (labelled
   "chosen on test data": PFLlib's leaderboard reports it), the std over clients of the final accuracies, the
   rounds run.

Every run is a ``fedmeta fit`` process (:func:`benchmarks.harness.run_fit_until`) on a config written from
:func:`run_config`; its record is appended to ``benchmarks/results/pfllib_protocol.jsonl`` under the key
``sha256(config text)[:16]/seed/phase`` and a re-run skips it.

Runs resume inside themselves (issue 38, item 5): each run adds ``ModelCheckpoint(every_n_epochs=
--ckpt-every)`` (an epoch is a round here: ``eval_every`` 1) to its config (not to the text its key is hashed
from: the numbers do not depend on it), writing
``STATE/<run id>-r<round>.ckpt`` (one file per run, the older one replaced; ``--state-dir``, default
``runs/STEM/checkpoints``). A run that finds its checkpoint there starts with ``--ckpt_path`` from it; the library
resumes bit for bit (docs/reliability.md), so its record equals an uninterrupted run's. The checkpoint is deleted
when the run's record is written. ``--budget-minutes M`` runs the next runs in the issue's order
(:func:`budget_plan`: the Dir(0.1) column of :data:`FIRST`, then their pathological column, then the rest),
starts none with less than ``--min-start-s`` left, and ends the run in progress at the deadline (SIGTERM, SIGKILL
after :data:`KILL_GRACE_S`) (its checkpoint
stays for the next invocation; a file over 15 MiB is cut into ``.partNN`` pieces, which a GPU machine sends back,
and joined again at the next start). The report is rewritten after every run; the end prints what remains and
an estimate of its minutes at the measured seconds per round (:func:`remaining`).

The report: ``pfllib_protocol.md`` (a table per split, with PFLlib's published number for the cell,
:data:`PUBLISHED`) and ``pfllib_protocol.png`` (the seed-mean test curves of the finals). ``--quick`` (FedAvg and
Ditto, 3 rounds at most, 4 clients of 40 rows as ``shards``, 1 seed, a stop rule that fires at round 2) is the
smoke test of tests/benchmarks/test_pfllib_protocol.py.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from benchmarks.harness import (
    REPO,
    append_record,
    fmt_duration,
    mean_std,
    pct,
    records_by_key,
    run_fit_until,
    sha256_text,
    utc_now,
)

__all__ = ["FIRST", "PUBLISHED", "SPECS", "SPLITS", "Settings", "budget_plan", "local_work", "main", "plan",
           "remaining", "run_config", "run_one", "summarise"]

RESULTS = REPO / "benchmarks" / "results"
BASE_CONFIG = REPO / "configs" / "datasets" / "fmnist_pfllib.yaml"
#: the columns: name → ``data`` overrides of the base config
SPLITS: dict[str, dict[str, Any]] = {
    "pat": {},
    "dir": {"partition": "dirichlet_min_size", "dirichlet_alpha": 0.1},
}
SPLIT_TITLES = {"pat": "pathological (2 classes per client)", "dir": "practical, Dirichlet(0.1)"}
HEAD = ["fc"]  # PFLlib's BaseHeadSplit of FedAvgCNN: head = the last Linear (``fc``), base = the rest

#: label → (registered name, PFLlib's defaults in this library's names; ``local_lr`` 0.005, batch 10, 1 epoch
#: and ``drop_last`` are added by :func:`run_config` unless the algorithm has no ``local_lr``)
SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "FedAvg": ("fedavg", {}),
    # clientperavg.py: beta = learning_rate (args.beta commented out); loader batch 2·10 cut into two halves
    "Per-FedAvg": ("perfedavg", {"variant": "fo", "alpha": 0.005, "beta": 0.005, "finetune_steps": 1,
                                 "finetune_batch_size": 10}),
    # main.py: -lam 1.0, -K 5, -lrp 0.01 (-bt 0.0: see the report)
    "pFedMe": ("pfedme", {"lam": 1.0, "inner_steps": 5, "personal_lr": 0.01}),
    # main.py: -mu 0.0, -pls 1
    "Ditto": ("ditto", {"lam": 0.0}),
    "FedPer": ("fedper", {"head_prefix": HEAD}),
    # main.py: -pls 1 (head epochs): set to the body's work by local_work
    "FedRep": ("fedrep", {"head_prefix": HEAD}),
    # main.py: -al 1.0; clientapfl.py updates alpha every step (alpha_update)
    "APFL": ("apfl", {"alpha": 1.0, "adaptive": True}),
    "FedBN": ("fedbn", {}),
    # serverlg.py: the head is global, the base personal
    "LG-FedAvg": ("lg_fedavg", {"global_prefix": HEAD}),
    # main.py: -fte 10 (fine-tuning epochs of the head)
    "FedBABU": ("fedbabu", {"head_prefix": HEAD, "finetune_epochs": 10, "finetune_batch_size": 10}),
    "FedRoD": ("fedrod", {"head_prefix": HEAD, "balanced": True}),
    # main.py: -et 1.0, -p 2 (-s 80: no counterpart)
    "FedALA": ("fedala", {"eta": 1.0, "ala_layers": 2}),
    # main.py: -lam 1.0
    "FedProto": ("fedproto", {"lam": 1.0, "head_prefix": HEAD}),
    # main.py: -M 5
    "FedFomo": ("fedfomo", {"models_per_client": 5}),
    # main.py: -lam 1.0, -alk 1.0, -sg 1.0
    "FedAMP": ("fedamp", {"lam": 1.0, "alpha_k": 1.0, "sigma": 1.0}),
    # main.py: -klw 0.0, -mo 0.1
    "FedDBE": ("feddbe", {"kappa": 0.0, "momentum": 0.1, "head_prefix": HEAD}),
}
#: PFLlib's leaderboard (docs/benchmark.html of github.com/TsingZ0/PFLlib at d832e76, "The test accuracy (%) on
#: the CV and NLP tasks in label skew settings", FMNIST columns): best round over 2000, mean ± std of 3 trials
PUBLISHED: dict[str, dict[str, str]] = {
    "pat": {"FedAvg": "80.41 ± 0.08", "Per-FedAvg": "99.18 ± 0.08", "pFedMe": "99.35 ± 0.14",
            "Ditto": "99.44 ± 0.06", "APFL": "99.41 ± 0.02", "FedFomo": "99.46 ± 0.01", "FedAMP": "99.42 ± 0.03",
            "FedALA": "99.57 ± 0.01", "FedPer": "99.47 ± 0.03", "FedRep": "99.56 ± 0.03", "FedRoD": "99.52 ± 0.05",
            "FedBABU": "99.41 ± 0.05", "FedDBE": "99.74 ± 0.04", "FedProto": "99.49 ± 0.04"},
    "dir": {"FedAvg": "85.85 ± 0.19", "Per-FedAvg": "95.10 ± 0.10", "pFedMe": "97.25 ± 0.17",
            "Ditto": "97.47 ± 0.04", "APFL": "97.25 ± 0.08", "FedFomo": "97.21 ± 0.02", "FedAMP": "97.20 ± 0.06",
            "FedALA": "97.66 ± 0.02", "FedPer": "97.44 ± 0.06", "FedRep": "97.56 ± 0.04", "FedRoD": "97.52 ± 0.04",
            "FedBABU": "97.46 ± 0.07", "FedDBE": "97.69 ± 0.05", "FedProto": "97.40 ± 0.02"},
}
#: where a row differs from PFLlib's code (github.com/TsingZ0/PFLlib at d832e76), shown under the tables
DIFFERENCES = [
    "Rounds: PFLlib runs 2000 and quotes the best round on test data; here the stopping round is chosen on "
    "validation rows and the headline is the final round (the best round is shown, labelled).",
    "Per-FedAvg: PFLlib's first-order step with both rates = 0.005 (clientperavg.py sets beta = learning_rate), "
    "a loader of 20 rows cut into two batches of 10, evaluated after one step on a training batch: the same here "
    "(variant fo, alpha = beta = 0.005, finetune_steps 1).",
    "pFedMe: PFLlib's default -bt 0.0 makes its server step (1 − β)·previous + β·average keep the previous global "
    "model; the fedmeta-pfedme plugin has no β (the plain average, β = 1). lam 1.0, K = 5, personal rate 0.01 as "
    "PFLlib's defaults.",
    "Ditto (-mu 0.0) and FedDBE (-klw 0.0) run PFLlib's defaults, which switch their regularisers off.",
    "FedBN: FedAvgCNN has no normalisation layer, so FedBN is FedAvg here, as in PFLlib.",
    "FedBABU: PFLlib fine-tunes the head for 10 epochs once, after the last round; here every evaluation "
    "fine-tunes 10 epochs (finetune_epochs 10), so every round's number is the fine-tuned one.",
    "FedALA: PFLlib's -s 80 (random 80 % of the rows for the weight learning) has no counterpart; PFLlib learns the "
    "weights until the loss settles on the first round, here ala_start_steps 20 and ala_steps 5 (the defaults).",
    "FedFomo: PFLlib holds out 20 % of each client's training rows to weight the downloaded models; here the "
    "algorithm's own validation batch (docs/algorithms/fedfomo.md).",
    "An algorithm that refuses local_epochs runs local_steps = the median client's (lower middle of 20) steps of "
    "one drop_last epoch; its row's 'local work' says so.",
]
PUBLISHED_SOURCE = "https://github.com/TsingZ0/PFLlib/blob/master/docs/benchmark.html"


@dataclass(frozen=True)
class Settings:
    """What a whole benchmark shares: rounds cap, stop rule, seeds, data size, where records and runs go."""

    max_rounds: int = 2000
    patience: int = 20
    min_delta: float = 0.001
    seeds: tuple[int, ...] = (0, 1, 2)
    data: tuple[tuple[str, Any], ...] = ()  #: extra ``data`` options (``--quick``: 4 small clients)
    model: tuple[tuple[str, Any], ...] = ()  #: extra ``model`` options (``--quick``: no compilation)
    records: Path = RESULTS / "pfllib_protocol.jsonl"
    work: Path = REPO / "runs" / "pfllib_protocol"  #: run folders and configs (git-ignored)
    trainer: tuple[tuple[str, Any], ...] = ()  #: extra ``trainer`` options (``callbacks`` are appended)
    state: Path | None = None  #: in-progress checkpoints (``None``: ``work / "checkpoints"``)
    ckpt_every: int = 5  #: rounds between a run's checkpoints
    data_root: str | None = None  #: Fashion-MNIST's folder where it is not the default (a GPU machine's copy)

    @property
    def state_dir(self) -> Path:
        return self.state if self.state is not None else self.work / "checkpoints"


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` merged in, nested dicts key by key (``base`` is not changed)."""
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def run_config(label: str, split: str, phase: str, rounds: int, settings: Settings,
               work: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``fedmeta fit`` config of one run: the base config, the split's data, ``label``'s spec, the phase's
    evaluation (``stop``: validation rows and the early-stopping callback; ``final``: test rows) and ``rounds``.

    ``work`` replaces the local-work keys (``{"local_epochs": 1}`` by default; :func:`local_work`)."""
    base = yaml.safe_load(BASE_CONFIG.read_text())
    name, spec = SPECS[label]
    algorithm = {"name": name, **{k: v for k, v in base["model"]["algorithm"].items() if k != "name"}, **spec}
    if name == "perfedavg":
        algorithm.pop("local_lr")  # its rates are alpha and beta
    algorithm.update(work or {})
    if "local_steps" in algorithm:
        algorithm.pop("local_epochs", None)
    data = {**SPLITS[split], **dict(settings.data), "eval_every": 1,
            "validation_fraction": 0.2 if phase == "stop" else 0.0}
    trainer: dict[str, Any] = {"max_steps": rounds}
    if phase == "stop":
        trainer["callbacks"] = [{
            "class_path": "lightning.pytorch.callbacks.EarlyStopping",
            "init_args": {"monitor": "val/acc_weighted", "mode": "max", "min_delta": settings.min_delta,
                          "patience": settings.patience},
        }]
    extra = dict(settings.trainer)
    if "callbacks" in extra:
        trainer["callbacks"] = [*trainer.get("callbacks", []), *copy.deepcopy(extra.pop("callbacks"))]
    trainer.update(copy.deepcopy(extra))
    config = _merge(base, {"trainer": trainer, "data": data, "model": dict(settings.model)})
    config["model"]["algorithm"] = algorithm
    return config


def local_work(label: str, split: str, phase: str, settings: Settings) -> tuple[dict[str, Any], str]:
    """The local-work keys of ``label`` and how the report names them: ``{"local_epochs": 1}`` when the algorithm
    accepts it, else ``local_steps`` (and FedRep's ``head_steps``, Ditto's ``personal_steps``) = the median over
    clients of ``⌊n_c / (per_step·B)⌋``, one epoch of ``drop_last`` batches on the phase's training rows."""
    from lightning_fedmeta.registry import create_algorithm

    algorithm = dict(run_config(label, split, phase, 1, settings)["model"]["algorithm"])
    name = algorithm.pop("name")
    try:
        create_algorithm(name, **algorithm).check_epoch_plans()
        return {"local_epochs": 1}, "1 epoch"
    except ValueError as err:
        if "local_epochs" not in str(err):
            raise
    algorithm.pop("local_epochs")
    per_step = create_algorithm(name, **algorithm).round_plan().per_step
    steps = statistics.median_low(n // (per_step * algorithm["batch_size"]) for n in _train_counts(split, phase,
                                                                                                    settings))
    work: dict[str, Any] = {"local_steps": int(steps)}
    if name == "fedrep":
        work["head_steps"] = int(steps)
    if name == "ditto":
        work["personal_steps"] = int(steps)
    return work, f"{steps} steps (median client's epoch; local_epochs refused)"


#: the budget's clock (``time.monotonic``; a test replaces it to end a run at a chosen moment)
CLOCK = time.monotonic
#: seconds between SIGTERM and SIGKILL of a run ended at the deadline (its checkpoints are written atomically)
KILL_GRACE_S = 3.0

_COUNTS: dict[tuple[str, str, tuple[tuple[str, Any], ...]], list[int]] = {}


def _train_counts(split: str, phase: str, settings: Settings) -> list[int]:
    """Each client's training rows in ``phase`` of ``split`` (validation rows taken out in ``stop``)."""
    key = (split, phase, settings.data)
    if key not in _COUNTS:
        from lightning_fedmeta.data import FederatedDataModule

        data = run_config("FedAvg", split, phase, 1, settings)["data"]
        dm = FederatedDataModule(**data)
        dm.setup()
        assert dm.federated_data is not None
        _COUNTS[key] = [int(n) for n in dm.federated_data.train_counts]
    return _COUNTS[key]


# -- runs ----------------------------------------------------------------------------------------------
def plan(labels: list[str], splits: list[str]) -> list[tuple[str, str]]:
    """The (algorithm, split) cells in running order: algorithm by algorithm, each on every split."""
    return [(label, split) for label in labels for split in splits]


#: issue 38's order for the budgeted runs: these algorithms' Dir(0.1) column first, then their pathological one
FIRST = ["FedAvg", "Per-FedAvg", "Ditto", "FedPer", "FedRep", "APFL", "FedALA", "FedDBE"]


def budget_plan(labels: list[str], splits: list[str]) -> list[tuple[str, str]]:
    """The cells in the order ``--budget-minutes`` runs them: :data:`FIRST` on ``dir``, then on ``pat``, then
    the other algorithms (:data:`SPECS` order) on ``dir``, then on ``pat`` (only ``labels`` and ``splits``)."""
    first = [label for label in FIRST if label in labels]
    rest = [label for label in SPECS if label in labels and label not in FIRST]
    order = [s for s in ("dir", "pat") if s in splits] + [s for s in splits if s not in ("dir", "pat")]
    return [(label, split) for group in (first, rest) for split in order for label in group]


def _key(config_text: str, seed: int, phase: str) -> str:
    return f"{sha256_text(config_text)[:16]}/{seed}/{phase}"


def run_one(label: str, split: str, phase: str, seed: int, rounds: int, settings: Settings,
            records: dict[str, dict[str, Any]], threads: int | None,
            deadline: float | None = None) -> dict[str, Any] | None:
    """Run (or read back) one ``fedmeta fit`` of the cell: its record, appended to ``settings.records`` when new.

    The run resumes from its checkpoint in ``settings.state_dir`` when there is one, and writes one every
    ``settings.ckpt_every`` rounds. ``deadline`` (a :data:`CLOCK` value) ends it: then nothing is recorded, the
    checkpoint stays, and ``None`` is returned."""
    work, work_label = local_work(label, split, phase, settings)
    text = yaml.safe_dump(run_config(label, split, phase, rounds, settings, work), sort_keys=False)
    key = _key(text, seed, phase)
    if key in records:
        return records[key]
    digest = sha256_text(text)[:16]
    run_id = _run_id(label, split, phase, seed, text)
    config = settings.work / "configs" / f"{digest}_s{seed}.yaml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(yaml.safe_dump(_with_checkpoints(yaml.safe_load(text), run_id, settings), sort_keys=False))
    out = settings.work / f"{label}_{split}_{phase}_s{seed}"
    overrides = ["--seed_everything", str(seed)]
    resume = _checkpoint(settings.state_dir, run_id)
    if resume is not None:
        overrides += ["--ckpt_path", str(resume[1])]
    print(f"[pfllib_protocol] {utc_now()} {label} {split} {phase} seed {seed}: up to {rounds} rounds"
          + (f", resuming at round {resume[0]}" if resume else ""), flush=True)
    rec: dict[str, Any] = {"key": key, "algorithm": label, "split": split, "phase": phase, "seed": seed,
                           "local_work": work_label, "max_rounds": rounds}
    outcome = run_fit_until(config, out, overrides, deadline=deadline, threads=threads, clock=lambda: CLOCK(),
                            grace_s=KILL_GRACE_S)
    run = outcome.run
    if outcome.killed:
        now = _checkpoint(settings.state_dir, run_id)
        print(f"[pfllib_protocol]   stopped at the budget's deadline after {fmt_duration(run.wall_s)}; "
              + (f"checkpoint of round {now[0]} kept: {now[1]}" if now else "no checkpoint yet"), flush=True)
        return None
    rec.update(command=run.command, wall_s=run.wall_s, finished_at=run.finished_at, threads=threads,
               resumed_from_round=resume[0] if resume else 0)
    rec.update(_metrics(run.history) if run.history is not None else {"error": run.error})
    append_record(settings.records, rec)
    records[key] = rec
    for path in settings.state_dir.glob(f"{run_id}-r*.ckpt*"):
        path.unlink()  # the run is recorded: its checkpoints are done with
    print(f"[pfllib_protocol]   {rec.get('rounds')} rounds, acc {rec.get('acc')}, {fmt_duration(run.wall_s)}"
          + (f", error: {rec['error']}" if "error" in rec else ""), flush=True)
    return rec


def _run_id(label: str, split: str, phase: str, seed: int, text: str) -> str:
    """A run's name in the checkpoint folder: readable, and tied to its config text (a changed config never
    resumes another's checkpoint). Letters, digits, ``_`` and ``-`` only (what a GPU machine sends back)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", f"{label}_{split}_{phase}_s{seed}_{sha256_text(text)[:12]}")


def _with_checkpoints(config: dict[str, Any], run_id: str, settings: Settings) -> dict[str, Any]:
    """``config`` with a ``ModelCheckpoint`` writing ``STATE/RUN_ID-r<round>.ckpt`` every ``ckpt_every`` rounds
    (the latest only; it replaces ``fedmeta fit``'s default checkpoint after every evaluation), and its
    ``EarlyStopping`` checking after each evaluation (``check_on_train_epoch_end: false``).

    It counts epochs (``every_n_epochs``), which are rounds here (``data.eval_every`` 1), so each checkpoint is
    written after its round's evaluation, with ``EarlyStopping``'s state updated by it (Lightning runs checkpoint
    callbacks last). ``every_n_train_steps`` writes before the evaluation, and a stop run resumed from such a
    checkpoint ran one round longer than the uninterrupted run here (quick run: 3 rounds against 2)."""
    if config["data"].get("eval_every") != 1:
        raise ValueError("checkpoints every_n_epochs count rounds only with data.eval_every 1")
    out = copy.deepcopy(config)
    if settings.data_root is not None:
        out["data"]["root"] = settings.data_root  # where the files are: not part of the key's text
    for callback in out["trainer"].get("callbacks", []):
        if callback["class_path"].endswith(".EarlyStopping"):
            # check after each evaluation, not at the training epoch's end: the same checks on the same numbers
            # (one evaluation per epoch), but a run resumed from a checkpoint written after an evaluation re-runs
            # that epoch's end with no metric yet, which the epoch-end check refuses (RuntimeError, seen here)
            callback.setdefault("init_args", {})["check_on_train_epoch_end"] = False
    out["trainer"].setdefault("callbacks", []).append({
        "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
        "init_args": {"dirpath": str(settings.state_dir), "filename": run_id + "-r{step}",
                      "auto_insert_metric_name": False, "every_n_epochs": settings.ckpt_every,
                      "save_top_k": 1, "save_last": False, "enable_version_counter": False},
    })
    return out


_CKPT = re.compile(r"-r(\d+)\.ckpt$")


def _checkpoint(state: Path, run_id: str) -> tuple[int, Path] | None:
    """The newest checkpoint of ``run_id`` in ``state``: ``(round, path)``, or ``None``."""
    found = [(int(m.group(1)), p) for p in state.glob(f"{run_id}-r*.ckpt") if (m := _CKPT.search(p.name))]
    return max(found) if found else None


#: the largest file a GPU machine sends back is 16 MiB: a bigger checkpoint travels in pieces
PART_BYTES = 15 * 2**20


def split_checkpoints(state: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """Cut every ``*.ckpt`` in ``state`` larger than ``part_bytes`` into ``NAME.partNN`` pieces (the file is
    removed); :func:`join_checkpoints` restores it. Returns the pieces written."""
    pieces = []
    for path in sorted(state.glob("*.ckpt")) if state.exists() else []:
        if path.stat().st_size <= part_bytes:
            continue
        with path.open("rb") as fh:
            i = 0
            while chunk := fh.read(part_bytes):
                piece = path.with_name(f"{path.name}.part{i:02d}")
                piece.write_bytes(chunk)
                pieces.append(piece)
                i += 1
        path.unlink()
    return pieces


def join_checkpoints(state: Path) -> list[Path]:
    """Join the ``NAME.partNN`` pieces of :func:`split_checkpoints` back into ``NAME`` (pieces removed)."""
    joined = []
    firsts = sorted(state.glob("*.ckpt.part00")) if state.exists() else []
    for first in firsts:
        target = first.with_name(first.name[: -len(".part00")])
        pieces = sorted(state.glob(target.name + ".part*"))
        tmp = target.with_name(target.name + ".joining")
        with tmp.open("wb") as fh:
            for piece in pieces:
                fh.write(piece.read_bytes())
        tmp.replace(target)
        for piece in pieces:
            piece.unlink()
        joined.append(target)
    return joined


def _metrics(doc: dict[str, Any]) -> dict[str, Any]:
    """A record's numbers, read from the run's ``fedmeta_history.json``: the rounds run (the last evaluated round),
    the final weighted accuracy, the std over clients of the final accuracies, the history's best round with its
    label, and the curve ``[round, acc]``."""
    vals = [h for h in doc["history"] if h.get("stage") == "val"]
    if not vals:
        return {"error": "no evaluation in the history"}
    per_client = (doc.get("per_client") or {}).get("acc") or []
    best = (doc.get("best") or {}).get("val") or {}
    return {
        "rounds": int(vals[-1]["round"]), "eval_split": doc.get("eval_split"),
        "acc": vals[-1]["metrics"].get("val/acc_weighted"),
        "client_std": statistics.pstdev(per_client) if len(per_client) > 1 else None,
        "best_acc": best.get("value"), "best_round": best.get("round"), "best_label": best.get("label"),
        "curve": [[int(h["round"]), h["metrics"].get("val/acc_weighted")] for h in vals],
    }


def run_cell(label: str, split: str, settings: Settings, records: dict[str, dict[str, Any]],
             threads: int | None, deadline: float | None = None, min_start_s: float = 0.0,
             after_run: Any = None) -> bool:
    """Both phases of one cell: the stopping round on validation rows (seed 0), then the finals for that many
    rounds on the test rows (``settings.seeds``). With a ``deadline`` (a :data:`CLOCK` value), no run starts with
    less than ``min_start_s`` left and the run in progress is ended at it; ``after_run()`` is called after each
    recorded run. Returns ``False`` when the deadline stopped the cell before it was done."""
    def one(phase: str, seed: int, rounds: int) -> dict[str, Any] | None:
        if _find(records, label, split, phase, seed, settings, rounds) is None:
            if deadline is not None and deadline - CLOCK() < min_start_s:
                return None
            rec = run_one(label, split, phase, seed, rounds, settings, records, threads, deadline)
            if rec is not None and after_run is not None:
                after_run()
            return rec
        return run_one(label, split, phase, seed, rounds, settings, records, threads)

    stop = one("stop", 0, settings.max_rounds)
    if stop is None:
        return False
    if "error" in stop:
        return True
    return all(one("final", seed, stop["rounds"]) is not None for seed in settings.seeds)


def pending(labels: list[str], splits: list[str], settings: Settings, records: dict[str, dict[str, Any]]) -> int:
    """How many runs of the plan have no record yet (a final whose stop has not run counts once per seed)."""
    todo = 0
    for label, split in plan(labels, splits):
        stop = _find(records, label, split, "stop", 0, settings)
        if stop is None:
            todo += 1 + len(settings.seeds)
            continue
        todo += sum(_find(records, label, split, "final", s, settings, stop.get("rounds")) is None
                    for s in settings.seeds) if "error" not in stop else 0
    return todo


def remaining(cells: list[tuple[str, str]], settings: Settings,
              records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What is left of ``cells``: the runs without a record (a stop not yet run counts its finals at the median
    stopping round recorded, else at the cap), their rounds, and minutes at the median seconds per round of the
    recorded runs (whole processes; a resumed run's rounds counted from its checkpoint)."""
    done = [r for r in records.values() if "error" not in r and r.get("rounds")]
    rates = [r["wall_s"] / max(1, r["rounds"] - r.get("resumed_from_round", 0)) for r in done]
    stop_rounds = [r["rounds"] for r in done if r["phase"] == "stop"]
    typical = int(statistics.median(stop_rounds)) if stop_rounds else settings.max_rounds
    runs: list[str] = []
    rounds = 0
    for label, split in cells:
        stop = _find(records, label, split, "stop", 0, settings)
        if stop is None:
            runs.append(f"{label} {split} stop")
            rounds += typical
            stop_n = typical
        elif "error" in stop:
            continue
        else:
            stop_n = stop["rounds"]
        for seed in settings.seeds:
            if stop is None or _find(records, label, split, "final", seed, settings, stop_n) is None:
                runs.append(f"{label} {split} final s{seed}")
                rounds += stop_n
    per_round = statistics.median(rates) if rates else None
    left = [p.name for p in sorted(settings.state_dir.glob("*.ckpt*"))] if settings.state_dir.exists() else []
    return {"runs": runs, "rounds": rounds, "s_per_round": per_round,
            "minutes": None if per_round is None else rounds * per_round / 60, "checkpoints": left,
            "stop_rounds_assumed": typical}


def remaining_text(left: dict[str, Any]) -> str:
    """One paragraph of :func:`remaining`."""
    if not left["runs"]:
        return "Nothing remains of this plan."
    head = ", ".join(left["runs"][:12]) + (f", … ({len(left['runs'])} runs)" if len(left["runs"]) > 12 else "")
    rate = (f"about {left['minutes']:.0f} min at {left['s_per_round']:.2f} s per round (the median of the recorded "
            "runs)" if left["minutes"] is not None else "no recorded run to measure a round by")
    ckpt = f"; in-progress checkpoints: {', '.join(left['checkpoints'])}" if left["checkpoints"] else ""
    return (f"Remaining: {len(left['runs'])} runs ({head}), about {left['rounds']} rounds (a stop not yet run counted "
            f"at {left['stop_rounds_assumed']} rounds), {rate}{ckpt}.")


def _find(records: dict[str, dict[str, Any]], label: str, split: str, phase: str, seed: int, settings: Settings,
          rounds: int | None = None) -> dict[str, Any] | None:
    """The record of a run of the current plan (the same config text), or ``None``."""
    work, _ = local_work(label, split, phase, settings)
    text = yaml.safe_dump(run_config(label, split, phase, rounds or settings.max_rounds, settings, work),
                          sort_keys=False)
    return records.get(_key(text, seed, phase))


# -- report --------------------------------------------------------------------------------------------
def summarise(records: list[dict[str, Any]], labels: list[str], split: str,
              seeds: tuple[int, ...] = (0, 1, 2)) -> list[dict[str, Any]]:
    """One row per algorithm of ``split``: its newest stop record, the finals of ``seeds`` that ran the stop's
    rounds, and their final accuracy, best-round accuracy and per-client std (mean ± std over seeds)."""
    rows = []
    for label in labels:
        mine = [r for r in records if r["algorithm"] == label and r["split"] == split]
        stops = [r for r in mine if r["phase"] == "stop"]
        stop = stops[-1] if stops else None
        finals = {r["seed"]: r for r in mine if r["phase"] == "final" and stop is not None and "error" not in r
                  and r["max_rounds"] == stop.get("rounds") and r["seed"] in seeds}
        done = [finals[s] for s in sorted(finals)]
        rows.append({
            "algorithm": label, "stop": stop, "seeds": sorted(finals), "local_work": (stop or {}).get("local_work"),
            "acc": mean_std(r["acc"] for r in done), "best_acc": mean_std(r["best_acc"] for r in done),
            "client_std": mean_std(r["client_std"] for r in done if r["client_std"] is not None),
            "published": PUBLISHED[split].get(label, "not in PFLlib's table"),
        })
    return rows


def _stop_cell(stop: dict[str, Any] | None, max_rounds: int) -> str:
    if stop is None:
        return "not run"
    if "error" in stop:
        return f"failed: {stop['error'][:80]}"
    capped = " (cap)" if stop["rounds"] >= max_rounds else ""
    return f"{stop['rounds']}{capped} (val {100 * stop['acc']:.2f})"


def write_report(records: list[dict[str, Any]], labels: list[str], splits: list[str], settings: Settings,
                 out: Path, command: str, left: dict[str, Any] | None = None) -> None:
    """``out`` (Markdown): the protocol, then a table per split."""
    lines = [
        "# PFLlib's benchmark protocol on Fashion-MNIST", "",
        f"Command: `{command}` (benchmarks/pfllib_protocol.py; records: `{settings.records.name}`, one per run; "
        f"updated {utc_now()}).", "",
        "Protocol (PFLlib's leaderboard): 20 clients, all join each round, per-client 75/25 split, batch 10, "
        "1 local epoch (drop_last), FedAvgCNN, local rate 0.005, PFLlib's defaults for each algorithm's own "
        "hyper-parameters (`SPECS` in the script). Stopping round: seed 0 on 80 % of each client's training rows, "
        f"validated every round on the other 20 %, EarlyStopping(val/acc_weighted, max, min_delta "
        f"{settings.min_delta}, patience {settings.patience}) or {settings.max_rounds} rounds (cap). Finals: seeds "
        f"{', '.join(map(str, settings.seeds))} on the full training rows for the stopping round's number of "
        "rounds, tested every round. **Final acc** (the headline) is the last round's sample-weighted test "
        "accuracy; **best round** is the best round's, *chosen on test data* as PFLlib reports it; **client std** "
        "is the std over clients of the final accuracies. Numbers are mean ± std over the seeds run.", "",
        f"PFLlib's numbers: its leaderboard ({PUBLISHED_SOURCE}, FMNIST columns): best round of 2000 (chosen on "
        "test data), 3 trials.", "",
    ]
    lines += _timing_lines(records, settings)
    if left is not None:
        lines += [remaining_text(left), ""]
    for split in splits:
        lines += [f"## {split}: {SPLIT_TITLES[split]}", "",
                  "| algorithm | local work | stopping round (val acc) | seeds | final acc | best round (chosen on "
                  "test data) | client std | PFLlib (best round) |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in summarise(records, labels, split, settings.seeds):
            lines.append(
                f"| {row['algorithm']} | {row['local_work'] or '—'} | {_stop_cell(row['stop'], settings.max_rounds)}"
                f" | {len(row['seeds'])} | {pct(*row['acc'])} | {pct(*row['best_acc'])} | {pct(*row['client_std'])}"
                f" | {row['published']} |")
        lines.append("")
    lines += ["## Where this differs from PFLlib", "", *[f"* {d}" for d in DIFFERENCES], ""]
    out.write_text("\n".join(lines))


def _timing_lines(records: list[dict[str, Any]], settings: Settings) -> list[str]:
    """The report's cost paragraph: the hand-measured round of ``STEM_timing.json`` (when there is one) and the
    seconds per round of the runs recorded (whole processes, start-up and evaluation included)."""
    lines = ["## Cost", ""]
    timing = settings.records.with_name(settings.records.stem + "_timing.json")
    if timing.exists():
        lines += [json.loads(timing.read_text())["text"], ""]
    runs = [r for r in records if "error" not in r and r.get("rounds")]
    if runs:
        per_round = statistics.median(r["wall_s"] / r["rounds"] for r in runs)
        lines += [f"Recorded runs: {len(runs)}, {fmt_duration(sum(r['wall_s'] for r in runs))} in all, median "
                  f"{per_round:.0f} s per round (whole process).", ""]
    return lines


def plot(records: list[dict[str, Any]], labels: list[str], splits: list[str], out: Path) -> None:
    """``out`` (PNG): per split, each algorithm's seed-mean test accuracy of its finals against the round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(splits), figsize=(6 * len(splits), 4.5), squeeze=False)
    for ax, split in zip(axes[0], splits, strict=True):
        for label in labels:
            finals = [r for r in records if r["algorithm"] == label and r["split"] == split
                      and r["phase"] == "final" and "error" not in r]
            if not finals:
                continue
            rounds = max(r["rounds"] for r in finals)
            curves = [dict(map(tuple, r["curve"])) for r in finals if r["rounds"] == rounds]
            xs = sorted(set().union(*curves))
            ax.plot(xs, [100 * statistics.fmean(c[x] for c in curves if x in c) for x in xs], label=label)
        ax.set(title=f"{split}: {SPLIT_TITLES[split]}", xlabel="round", ylabel="test accuracy (%, mean of seeds)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


# -- command line ----------------------------------------------------------------------------------------
QUICK_ALGORITHMS = ["FedAvg", "Ditto"]
#: ``--quick``'s clients: 4, 40 rows each (30 train, 10 test; PFLlib's ``pat`` has no size cap, shards does)
QUICK_DATA = (("partition", "shards"), ("num_clients", 4), ("max_samples_per_client", 40))


def _settings(args: argparse.Namespace) -> Settings:
    if args.quick:
        settings = Settings(max_rounds=3, patience=1, min_delta=1.0, seeds=(0,), data=QUICK_DATA,
                            model=(("clients_per_round", 4), ("compile_clients", False)),
                            records=args.out.with_suffix(".jsonl"),
                            work=args.work or args.out.parent / (args.out.name + "_runs"))
    else:
        settings = Settings(max_rounds=args.max_rounds, records=args.out.with_suffix(".jsonl"),
                            work=args.work or REPO / "runs" / args.out.name)
    return replace(settings, state=args.state_dir, ckpt_every=args.ckpt_every, data_root=args.data_root)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="OMP/MKL threads of each run (1 when shared)")
    parser.add_argument("--only", nargs="+", choices=list(SPECS), default=None, help="algorithms (labels)")
    parser.add_argument("--splits", nargs="+", choices=list(SPLITS), default=None)
    parser.add_argument("--max-rounds", type=int, default=2000, help="the stop phase's cap (PFLlib: 2000)")
    parser.add_argument("--out", type=Path, default=RESULTS / "pfllib_protocol",
                        help="results stem: STEM.jsonl (records), STEM.md (report), STEM.png (curves)")
    parser.add_argument("--work", type=Path, default=None,
                        help="run folders and configs (default runs/STEM, git-ignored; --quick: STEM_runs)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: FedAvg and Ditto, 4 clients of 40 rows, stop at round 2, 1 seed")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from the records")
    parser.add_argument("--budget-minutes", type=float, default=None,
                        help="run the next runs in issue 38's order (FIRST on dir, then on pat, then the rest) "
                             "within M minutes; the run in progress at the deadline is ended, its checkpoint kept")
    parser.add_argument("--min-start-s", type=float, default=60.0,
                        help="with --budget-minutes: start no run with less than this many seconds left")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="in-progress checkpoints, one file per run (default WORK/checkpoints, git-ignored); "
                             "on a GPU machine a folder under $OUT, given back to the next run")
    parser.add_argument("--ckpt-every", type=int, default=5, help="rounds between a run's checkpoints")
    parser.add_argument("--data-root", default=None,
                        help="Fashion-MNIST's .gz files where they are not /usr/share/datasets/fashion-mnist (the "
                             "run's config only: records keep their keys)")
    args = parser.parse_args(argv)
    if args.ckpt_every < 1:
        parser.error("--ckpt-every must be >= 1")
    start, started = CLOCK(), time.monotonic()
    deadline = None if args.budget_minutes is None else start + 60 * args.budget_minutes
    settings = _settings(args)
    labels = args.only or (QUICK_ALGORITHMS if args.quick else list(SPECS))
    splits = args.splits or (["pat"] if args.quick else list(SPLITS))
    cells = budget_plan(labels, splits) if deadline is not None else plan(labels, splits)
    records = records_by_key(settings.records)
    command = "python -m benchmarks.pfllib_protocol " + " ".join(sys.argv[1:] if argv is None else argv)
    report_labels = labels if args.only or args.quick else list(SPECS)

    def report() -> None:
        ordered = sorted(records.values(), key=lambda r: r.get("finished_at", ""))
        write_report(ordered, report_labels, splits, settings, args.out.with_suffix(".md"), command,
                     remaining(cells, settings, records))

    if not args.report_only:
        for piece in join_checkpoints(settings.state_dir):
            print(f"[pfllib_protocol] joined the pieces of {piece}", flush=True)
        print(f"[pfllib_protocol] {len(cells)} cells, {pending(labels, splits, settings, records)} to run"
              + (f", budget {args.budget_minutes:g} min" if deadline is not None else ""), flush=True)
        for label, split in cells:
            if not run_cell(label, split, settings, records, args.threads, deadline, args.min_start_s, report):
                print(f"[pfllib_protocol] budget spent ({fmt_duration(time.monotonic() - started)}): stopping "
                      f"before the rest of {label} {split}", flush=True)
                break
        for piece in split_checkpoints(settings.state_dir):
            print(f"[pfllib_protocol] checkpoint piece (for a transfer of files up to 16 MiB): {piece}", flush=True)
    report()
    plot(sorted(records.values(), key=lambda r: r.get("finished_at", "")), labels, splits,
         args.out.with_suffix(".png"))
    print(f"[pfllib_protocol] report: {args.out.with_suffix('.md')}", flush=True)
    print(f"[pfllib_protocol] {remaining_text(remaining(cells, settings, records))}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
