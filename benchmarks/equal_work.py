"""Every algorithm beside Per-FedAvg on the paper's split, at equal client work, tuned on validation data (issue 14).

    python -m benchmarks.equal_work [--jobs 2] [--threads 1] [--entries E ...] [--smoke]
                                    [--report-only] [--write-winners]
                                    [--dataset fashion_mnist | --dataset mnist --root DIR]

Two comparisons on the Per-FedAvg paper's setting (benchmarks/reproduce.py: MLP 784-80-60-10 ELU,
n = 50 users on ``partition: perfedavg_paper`` of Fashion-MNIST, 10 per round, batch 40, uniform
aggregation, 5 users held out as new clients, 1000 rounds, seeds 0, 1, 2):

* **The grid's second baseline** (``fedavg_tuned_tau<τ>_alpha<α>``): FedAvg with τ local steps at a
  *tuned* local rate, then one fine-tune step at α before evaluation, in each of the grid's four
  (τ, α) cells. Its work is τ gradient evaluations per client per round, as the matched baseline's.
* **Every algorithm at equal work** (``<algorithm>_w16``): W = 16 gradient evaluations per client per
  round, the work of Per-FedAvg HF / exact at τ = 4 (4 per step: two gradients and one
  Hessian-vector product counted as 2). Each algorithm's steps are set so that
  ``benchmarks/accuracy.py`` :func:`grad_evals_per_round` gives 16 (e.g. FedAvg 16 SGD steps,
  Ditto 8 global + 8 personal, FedRep 8 head + 8 body, pFedMe 4 local rounds × 4 inner steps,
  FedMAML 8 first-order meta-gradients; the issue-27 rows: APFL and FedRoD 8 steps of 2 gradients, FedEM 2
  components × 8 steps, FedALA 4 weight-learning + 12 SGD steps, FedBN, LG-FedAvg, FedBABU, FedAMP, pFedHN,
  FedProto, FedDBE and FedFomo 16 SGD steps; FedBN on a SmallCNN with BatchNorm, as the MLP has no
  normalisation layer). MOCHA has no gradients and needs a linear model: it runs a 784→10 linear model
  with 640 SDCA coordinate steps per round (16 × batch 40 per-sample updates); its row is not
  work-matched in the same unit and says so. Each algorithm is evaluated as its authors evaluate it
  (the algorithm's own ``personalize``: the global model for FedProx and SCAFFOLD, one fine-tune step
  for FedAvg + FT, Per-FedAvg, Reptile and the MAMLs, the personal model for Ditto, the MTL models,
  pFedMe and MOCHA, the personal head for FedRep and FedPer, the cluster model for IFCA and CFL).

**Tuning never sees test data.** Each entry lists a small sweep (:data:`ENTRIES`: 3 or 4 values of
its main rate or strength). Every candidate runs ``SWEEP_ROUNDS`` = 300 rounds on seed 0 with
``data.validation_fraction: 0.2`` (each client's training data split 80/20 by
``lightning_fedmeta/data/validation_split.py``; the run evaluates on the 20 % and never reads the test
set) and is scored by its final-round sample-weighted validation accuracy. A sweep whose best value is
its largest (smallest) is extended by the next value on :data:`LADDER` (…, 0.03, 0.1, 0.3, 1, …), at most
:data:`MAX_EXTENSIONS` = 2 times and not past a diverged value, so a winner at the edge of a too-narrow
sweep gets its chance. The best candidate (ties: the smaller value) becomes the committed config
``configs/paper/equal_work/<entry>.yaml``,
whose header lists every candidate's score; the final runs train that config on the full training
data for 1000 rounds with seeds 0, 1, 2 and report test accuracy (finals are keyed by the config
without its comment lines, so an extended sweep with the same winner keeps its finals). A winner
whose final run diverges with any seed (a non-finite loss or update: seen in training, not in test
data) is withdrawn, and the next best candidate by validation score takes its place; the config
header and the report say so. The short
sweep is a budget choice (300 of 1000 rounds) and can favour faster rates; the report says where a
winner is still at the edge of its sweep.

``--dataset mnist --root DIR`` runs the same comparison on MNIST for users who have its files: the sweeps are
scored on MNIST's own validation split, the winners go to ``configs/paper/equal_work_mnist/``, the report to
``equal_work_mnist.md`` / ``.csv``, and ``python -m benchmarks.reproduce --dataset mnist`` adds the tuned baseline
rows.

Records (one JSON line per finished run, written the moment it finishes) go to
``benchmarks/results/equal_work/sweep_<dataset>.jsonl`` and ``final_<dataset>.jsonl``; a re-run
skips runs whose (config text hash, seed, rounds) already succeeded, so an interrupted run resumes.
Finals of an entry start as soon as its sweep is complete. The report is
``benchmarks/results/equal_work[_<dataset>].md`` / ``.csv`` with PNGs under ``benchmarks/results/equal_work/``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks.accuracy import grad_evals_per_round
from benchmarks.harness import REPO, append_record, fit_record, fmt_duration, mean_std, pct, read_records, sha256_text
from benchmarks.paper import BATCH, CLIENTS_PER_ROUND, HOLDOUT, NUM_CLIENTS, ROUNDS, SEEDS

__all__ = [
    "ENTRIES",
    "Entry",
    "PFL_ENTRIES",
    "SWEEP_ROUNDS",
    "WORK",
    "candidate_config",
    "entry_work",
    "final_config",
    "main",
    "paired_against",
    "pick_winner",
    "summarise",
]

SWEEP_ROUNDS = 300
SWEEP_SEED = 0
SMOKE_ROUNDS = 3  # ``--smoke``: rounds of each entry's first candidate
VALIDATION_FRACTION = 0.2
WORK = 16  # gradient evaluations per client per round: Per-FedAvg HF / exact at τ = 4
WINNER_DIR = Path("configs/paper/equal_work")
RESULTS = Path("benchmarks/results/equal_work")
#: the default dataset: the one this machine has (Debian's ``dataset-fashion-mnist``)
DATASET = "fashion_mnist"
#: datasets the comparison runs on (``--dataset``); MNIST needs its files (``--root DIR``)
DATASETS = ("fashion_mnist", "mnist")
TITLES = {"fashion_mnist": "Fashion-MNIST", "mnist": "MNIST"}
MLP = {"class_path": "lightning_fedmeta.models.MLP",
       "init_args": {"in_features": 784, "hidden": [80, 60], "num_classes": 10, "activation": "elu"}}
LINEAR = {"class_path": "lightning_fedmeta.models.LogisticRegression",
          "init_args": {"in_features": 784, "num_classes": 10}}
LR_SWEEP = [0.01, 0.03, 0.1]
#: the issue-27 rows' local-rate sweep: one step up from LR_SWEEP, whose winner was 0.1 (or its extension) for most
#: of the earlier rows, so that the usual winner sits inside the sweep rather than at its edge
PFL_LR_SWEEP = [0.03, 0.1, 0.3]
#: FedBN's network: the MLP has no normalisation layer (FedBN on it is FedAvg), so FedBN runs on the same MLP with a
#: BatchNorm1d after each hidden layer (280 more parameters, the same cost), next to FedAvg + FT on that network as
#: its control (``fedavg_ft_bn_w16``): FedBN's row compares with the control, not with the MLP rows
MLP_BN = {"class_path": "lightning_fedmeta.models.MLP",
          "init_args": {**MLP["init_args"], "norm": "batch"}}


@dataclass(frozen=True)
class Entry:
    """One row of the comparison: a base config and the sweep that tunes it.

    ``algorithm`` is the algorithm block and ``model`` the other ``model:`` keys (e.g. ``server_lr``);
    each sweep candidate overrides keys given as ``"algorithm.<key>"`` or ``"model.<key>"``.
    """

    key: str
    label: str
    algorithm: dict[str, Any]
    sweep: list[dict[str, Any]]
    model: dict[str, Any] = field(default_factory=dict)
    network: dict[str, Any] = field(default_factory=lambda: MLP)
    evaluation: str = ""
    cell: tuple[int, float] | None = None  # (τ, α) for the grid's tuned-FedAvg baseline
    plugin: str | None = None  # distribution that provides the algorithm


def _lr(key: str = "algorithm.local_lr", values: list[float] = LR_SWEEP, also: tuple[str, ...] = ()
        ) -> list[dict[str, Any]]:
    """One candidate per value of ``key``; the ``also`` keys take the same value (e.g. the fine-tune rate)."""
    return [{key: v, **dict.fromkeys(also, v)} for v in values]


def _entries() -> list[Entry]:
    b = {"batch_size": BATCH}
    out = [
        Entry(f"fedavg_tuned_tau{t}_alpha{a:g}", f"FedAvg (tuned rate) + 1 FT step at α, τ = {t}, α = {a:g}",
              {"name": "fedavg", "local_steps": t, **b, "finetune_steps": 1, "finetune_lr": a,
               "finetune_batch_size": BATCH},
              _lr(values=[0.003, 0.01, 0.03, 0.1]), evaluation=f"1 SGD step at α = {a:g}", cell=(t, a))
        for t in (4, 10) for a in (0.001, 0.01)
    ]
    ft = {"finetune_steps": 1, "finetune_batch_size": BATCH}
    out += [
        Entry("fedavg_ft_w16", "FedAvg + 1 FT step", {"name": "fedavg", "local_steps": 16, **b, **ft},
              _lr(also=("algorithm.finetune_lr",)), evaluation="1 SGD step at the local rate"),
        Entry("perfedavg_hf_w16", "Per-FedAvg (HF), τ = 4, α = 0.01",
              {"name": "perfedavg", "variant": "hf", "alpha": 0.01, "delta": 0.001, "local_steps": 4, **b, **ft},
              _lr("algorithm.beta", [0.001, 0.01, 0.03]), evaluation="1 SGD step at α"),
        Entry("reptile_w16", "Reptile", {"name": "reptile", "local_steps": 16, **b, **ft},
              _lr("algorithm.alpha"), model={"server_lr": 1.0}, evaluation="1 SGD step at α"),
        Entry("fedmaml_w16", "FedMAML (first order)",
              {"name": "fedmaml", "alpha": 0.01, "second_order": False, "local_steps": 8, **b, **ft},
              _lr("model.server_lr", [0.1, 0.3, 1.0]), evaluation="1 SGD step at α"),
        Entry("perfedmaml_w16", "Per-FedMAML (first order)",
              {"name": "perfedmaml", "alpha": 0.01, "lam": 0.5, "second_order": False, "local_steps": 8, **b, **ft},
              _lr("algorithm.beta", [0.01, 0.05, 0.2]), evaluation="1 SGD step at α from θ_i"),
        Entry("fedprox_w16", "FedProx (μ = 0.01)", {"name": "fedprox", "mu": 0.01, "local_steps": 16, **b},
              _lr(), evaluation="global model"),
        Entry("scaffold_w16", "SCAFFOLD", {"name": "scaffold", "local_steps": 16, **b}, _lr(),
              evaluation="global model"),
        Entry("mtl_mean_w16", "Mean-regularised MTL (λ = 0.1)", {"name": "mtl_mean", "lam": 0.1, "local_steps": 16,
                                                                **b}, _lr(), evaluation="personal model"),
        Entry("ditto_w16", "Ditto (λ = 0.1)",
              {"name": "ditto", "lam": 0.1, "local_steps": 8, "personal_steps": 8, **b}, _lr(),
              evaluation="personal model"),
        Entry("mtl_pairwise_w16", "Pairwise MTL (λ = 0.02)",
              {"name": "mtl_pairwise", "lam": 0.02, "local_steps": 16, **b}, _lr(), evaluation="personal model"),
        Entry("mtl_graph_w16", "Graph MTL (λ = 0.1, 5-NN of labels)",
              {"name": "mtl_graph", "lam": 0.1, "knn": 5, "local_steps": 16, **b}, _lr(),
              evaluation="personal model"),
        Entry("fedrep_w16", "FedRep", {"name": "fedrep", "head_steps": 8, "local_steps": 8, **b}, _lr(),
              evaluation="personal head + global body"),
        Entry("fedper_w16", "FedPer", {"name": "fedper", "local_steps": 16, **b}, _lr(),
              evaluation="personal head + global body"),
        Entry("ifca_w16", "IFCA (3 clusters)", {"name": "ifca", "num_clusters": 3, "local_steps": 16, **b}, _lr(),
              evaluation="best cluster model"),
        Entry("cfl_w16", "CFL", {"name": "cfl", "eps1": 0.4, "eps2": 1.6, "max_clusters": 4, "warmup_rounds": 20,
                                 "local_steps": 16, **b}, _lr(), evaluation="cluster model"),
        Entry("pfedme_w16", "pFedMe (λ = 15, ν = 0.05, 4 × 4 steps)",
              {"name": "pfedme", "lam": 15.0, "personal_lr": 0.05, "inner_steps": 4, "local_steps": 4, **b},
              _lr(values=[0.005, 0.02, 0.05]), evaluation="personal model θ_i", plugin="fedmeta-pfedme"),
        Entry("mocha_linear", "MOCHA (linear model, 640 SDCA steps)",
              {"name": "mocha", "loss": "hinge", "lambda2": 0.1, "local_iters": 640, "budget_spread": 0.0,
               "omega_every": 10, "sigma_warm_start": "primal", "fit_bias": True},
              _lr("algorithm.lambda1", [0.1, 1.0, 10.0]),
              network=LINEAR, evaluation="personal linear model"),
    ]
    return out + _pfl_entries()


def _pfl_entries() -> list[Entry]:
    """The issue-27 algorithms at W = 16 (how each reaches 16: ``benchmarks/accuracy.py`` and docs/reproduction.md),
    each swept over its local rate (:data:`PFL_LR_SWEEP`) with its strength fixed at its config's value."""
    b, lr = {"batch_size": BATCH}, _lr(values=PFL_LR_SWEEP)
    return [
        Entry("fedbn_w16", "FedBN (MLP + BatchNorm: compare with the next row)",
              {"name": "fedbn", "local_steps": 16, **b}, lr,
              network=MLP_BN, evaluation="shared weights + the client's own BatchNorm γ, β and statistics"),
        Entry("fedavg_ft_bn_w16", "FedAvg + 1 FT step (MLP + BatchNorm: FedBN's control)",
              {"name": "fedavg", "local_steps": 16, **b, "finetune_steps": 1, "finetune_batch_size": BATCH},
              _lr(values=PFL_LR_SWEEP, also=("algorithm.finetune_lr",)), network=MLP_BN,
              evaluation="1 SGD step at the local rate, the client's own BatchNorm statistics"),
        Entry("lg_fedavg_w16", "LG-FedAvg (global top 2 layers)",
              {"name": "lg_fedavg", "global_prefix": ["net.3", "net.5"], "local_steps": 16, **b}, lr,
              evaluation="the client's local first layer + global top layers"),
        Entry("fedbabu_w16", "FedBABU (+ 10 FT steps)",
              {"name": "fedbabu", "local_steps": 16, **b, "finetune_steps": 10, "finetune_batch_size": BATCH},
              _lr(values=PFL_LR_SWEEP, also=("algorithm.finetune_lr",)),
              evaluation="10 SGD steps on the whole model at the local rate"),
        Entry("fedrod_w16", "FedRoD (balanced softmax, linear personal head)",
              {"name": "fedrod", "balanced": True, "local_steps": 8, **b}, lr,
              evaluation="global body, generic + personal head"),
        Entry("apfl_w16", "APFL (adaptive α from 0.5)",
              {"name": "apfl", "alpha": 0.5, "adaptive": True, "local_steps": 8, **b}, lr,
              evaluation="mixed model α_k v_k + (1 − α_k) w"),
        Entry("fedala_w16", "FedALA (4 ALA + 12 SGD steps, η_W = 1)",
              {"name": "fedala", "eta": 1.0, "ala_layers": 2, "ala_steps": 4, "ala_start_steps": 4,
               "local_steps": 12, **b}, lr, evaluation="the ALA start θ̂_k (W_k learned again, 4 steps)"),
        Entry("fedamp_w16", "FedAMP (λ = 0.02, α = 0.2, σ = 10)",
              {"name": "fedamp", "lam": 0.02, "alpha_k": 0.2, "sigma": 10.0, "local_steps": 16, **b}, lr,
              evaluation="personal model"),
        Entry("fedem_w16", "FedEM (M = 2 components × 8 steps)",
              {"name": "fedem", "num_components": 2, "local_steps": 8, **b}, lr,
              evaluation="the client's most likely component"),
        Entry("pfedhn_w16", "pFedHN (hypernetwork rate 0.1)",
              {"name": "pfedhn", "hidden_dim": 100, "mlp_layers": 4, "server_lr": 0.1, "momentum": 0.9,
               "weight_decay": 0.001, "clip_norm": 50.0, "local_steps": 16, **b}, lr,
              evaluation="generated model h(v_i; φ)"),
        Entry("fedproto_w16", "FedProto (λ = 1)", {"name": "fedproto", "lam": 1.0, "local_steps": 16, **b}, lr,
              evaluation="the client's own model (local head)"),
        Entry("feddbe_w16", "FedDBE (κ = 1, ρ = 1)",
              {"name": "feddbe", "kappa": 1.0, "momentum": 1.0, "local_steps": 16, **b}, lr,
              evaluation="global model with the client's representation bias μ_i"),
        Entry("fedfomo_w16", "FedFomo (M = 5 models)",
              {"name": "fedfomo", "models_per_client": 5, "local_steps": 16, **b}, lr,
              evaluation="the client's own model"),
        Entry("fedpac_w16", "FedPAC (λ = 1, 4 head + 12 body steps)",
              {"name": "fedpac", "lam": 1.0, "head_steps": 4, "local_steps": 12, **b}, lr,
              evaluation="global body + the client's combined head"),
        Entry("fedas_w16", "FedAS (4 alignment + 8 SGD steps, Fisher trace on 4 batches)",
              {"name": "fedas", "align_steps": 4, "local_steps": 8, "fisher": "trace", "fisher_steps": 4, **b}, lr,
              evaluation="the client's last trained model θ_i"),
    ]


#: the entries added by issue 27 (the pFL methods other toolkits ship)
PFL_ENTRIES: tuple[str, ...] = tuple(e.key for e in _pfl_entries())
ENTRIES: dict[str, Entry] = {e.key: e for e in _entries()}


def entry_work(entry: Entry) -> int | None:
    """Gradient evaluations per client per round of the entry's base config."""
    algo = entry.algorithm
    return grad_evals_per_round(algo["name"], {k: v for k, v in algo.items() if k != "name"})


def _apply(entry: Entry, candidate: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    algo, model = dict(entry.algorithm), dict(entry.model)
    for k, v in candidate.items():
        scope, name = k.split(".", 1)
        (algo if scope == "algorithm" else model)[name] = v
    return algo, model


def winner_dir(dataset: str = DATASET) -> Path:
    """Where the winner configs of ``dataset``'s sweeps live: ``configs/paper/equal_work[_<dataset>]``
    (each dataset is tuned on its own validation data)."""
    return WINNER_DIR if dataset == DATASET else WINNER_DIR.with_name(f"{WINNER_DIR.name}_{dataset}")


def report_name(dataset: str = DATASET) -> str:
    """The stem of the report and its PNGs: ``equal_work`` for the default dataset, else ``equal_work_<dataset>``."""
    return "equal_work" if dataset == DATASET else f"equal_work_{dataset}"


def _config(entry: Entry, candidate: dict[str, Any], rounds: int, validation: bool, eval_every: int,
            dataset: str = DATASET) -> dict[str, Any]:
    algo, model = _apply(entry, candidate)
    data = {"dataset": dataset, "partition": "perfedavg_paper", "num_clients": NUM_CLIENTS,
            "eval_every": eval_every, "data_seed": 0}
    if validation:
        data["validation_fraction"] = VALIDATION_FRACTION
    return {
        "seed_everything": 0,
        "trainer": {"max_steps": rounds, "accelerator": "cpu"},
        "model": {"algorithm": algo, "aggregation": "uniform", "clients_per_round": CLIENTS_PER_ROUND,
                  "holdout_clients": HOLDOUT, "seed": 0, **model, "model": entry.network},
        "data": data,
    }


def _tag(candidate: dict[str, Any]) -> str:
    return "_".join(f"{k.split('.', 1)[1]}{v:g}" if isinstance(v, float) else f"{k.split('.', 1)[1]}{v}"
                    for k, v in candidate.items())


def candidate_config(entry: Entry, candidate: dict[str, Any], dataset: str = DATASET) -> str:
    """The YAML of one sweep candidate: ``SWEEP_ROUNDS`` rounds scored on the validation split."""
    head = (f"# Sweep candidate of {entry.key} ({entry.label}): {candidate}; benchmarks/equal_work.py, issue 14.\n"
            f"# Scored on data.validation_fraction = {VALIDATION_FRACTION:g} of each client's training data "
            "(the test set is not read).\n")
    return head + yaml.safe_dump(_config(entry, candidate, SWEEP_ROUNDS, True, 50, dataset), sort_keys=False)


def smoke_config(entry: Entry, candidate: dict[str, Any], dataset: str = DATASET) -> str:
    """The sweep candidate's YAML cut to ``SMOKE_ROUNDS`` rounds, evaluated at the last (``--smoke``: before, the
    smoke ran the candidate's full ``SWEEP_ROUNDS``, as nothing overrode its ``trainer.max_steps``)."""
    doc = yaml.safe_load(candidate_config(entry, candidate, dataset))
    doc["trainer"]["max_steps"] = SMOKE_ROUNDS
    doc["data"]["eval_every"] = SMOKE_ROUNDS
    return (f"# Smoke of {entry.key} ({entry.label}): {candidate}, {SMOKE_ROUNDS} rounds; benchmarks/equal_work.py\n"
            + yaml.safe_dump(doc, sort_keys=False))


def final_config(entry: Entry, winner: dict[str, Any], scores: list[tuple[dict[str, Any], float | None]],
                 withdrawn: list[tuple[dict[str, Any], list[int]]] | None = None, dataset: str = DATASET) -> str:
    """The committed YAML of the entry's sweep winner (1000 rounds, test evaluation), with the sweep in its header
    (and the better-scoring candidates whose final runs diverged, ``withdrawn``: (candidate, seeds))."""
    gone = {json.dumps(c, sort_keys=True): seeds for c, seeds in withdrawn or []}
    lines = [
        f"# {entry.label}: the winner of its validation sweep (issue 14; benchmarks/equal_work.py).",
        f"# Work: {entry_work(entry) if entry.key != 'mocha_linear' else 'n/a (640 SDCA steps)'} gradient "
        "evaluations per client per round; evaluation: " + entry.evaluation + ".",
        f"# Sweep: {SWEEP_ROUNDS} rounds, seed {SWEEP_SEED}, final-round weighted accuracy on a "
        f"{VALIDATION_FRACTION:g} validation split of each client's training data:",
        *[f"#   {c}: {_score(s)}{'  <- winner' if c == winner else ''}"
          + (f"  (withdrawn: its final run diverged with seed(s) {gone[k]})" if (k := json.dumps(c, sort_keys=True))
             in gone else "")
          for c, s in scores],
        "# Generated by `python -m benchmarks.equal_work --write-winners`; the driver overrides the seed:",
        f"#   fedmeta fit --config {(winner_dir(dataset) / (entry.key + '.yaml')).as_posix()} "
        "--seed_everything S --data.data_seed S --model.seed S" + ("" if dataset == DATASET else " --data.root DIR"),
    ]
    body = _config(entry, winner, ROUNDS, False, 10, dataset)
    return "\n".join(lines) + "\n" + yaml.safe_dump(body, sort_keys=False)


def _available(entry: Entry) -> bool:
    if entry.plugin is None:
        return True
    try:
        from lightning_fedmeta.registry import load_algorithm

        load_algorithm(entry.algorithm["name"])
        return True
    except Exception:  # noqa: BLE001 - a missing plugin drops its row
        return False


# -- running ---------------------------------------------------------------------------------------
def _run(config_text: str, config_file: Path, seed: int, rounds: int, out_dir: Path, threads: int | None,
         extra: dict[str, Any], root: str | None = None) -> dict[str, Any]:
    """Run ``fedmeta fit`` on ``config_file`` (whose text is ``config_text``; relative to the repository root) and
    return its record."""
    overrides = ["--seed_everything", str(seed), "--data.data_seed", str(seed), "--model.seed", str(seed)]
    if root is not None:
        overrides += ["--data.root", root]
    rec: dict[str, Any] = {**extra, "seed": seed, "rounds": rounds, "root": root,
                           "config_sha256": sha256_text(config_text), "config_body_sha256": body_sha256(config_text)}
    return rec | fit_record(config_file, out_dir, rounds, overrides, threads=threads, cwd=REPO)


def _ok(records: list[dict[str, Any]], key: str = "config_sha256") -> dict[tuple[Any, ...], dict[str, Any]]:
    return {(r.get("entry"), r.get(key), r.get("seed"), r.get("rounds")): r for r in records if "error" not in r}


def body_sha256(text: str) -> str:
    """The hash of a config without its comment lines: a winner config's header (the sweep's scores) may grow
    when the sweep is extended, but the runs it defines are the same as long as the YAML is."""
    return sha256_text("\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))


#: the score of a sweep candidate whose run stopped on a non-finite loss or update (a result, not a failure)
DIVERGED = -math.inf
#: the score of a sweep candidate the library refused at setup (a ``fedmeta: error:`` line, e.g. pFedMe's
#: ``local_lr·lam < 2`` stability bound): a result as well, ranked below every accuracy (which lie in [0, 1])
REFUSED = -1.0
#: how the CLI reports a configuration the library refuses before training (``lightning_fedmeta.cli``)
SETUP_ERROR_PREFIX = "fedmeta: error:"


def failed_score(s: float | None) -> bool:
    """Whether a sweep score marks a candidate without an accuracy: :data:`DIVERGED` or :data:`REFUSED`."""
    return s is not None and s < 0


#: rates and strengths the sweeps take their values from; an extension goes to the next value on it
LADDER: tuple[float, ...] = (0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
#: at most this many values are added to a sweep whose best value is at its edge
MAX_EXTENSIONS = 2


def _next_value(values: list[float], up: bool) -> float:
    """The value after the largest (``up``) or before the smallest of ``values``: its neighbour on
    :data:`LADDER` when every value is on it, else the sweep's own outer ratio (2 significant digits)."""
    ordered = sorted(values)
    if all(v in LADDER for v in ordered):
        i = LADDER.index(ordered[-1] if up else ordered[0]) + (1 if up else -1)
        if 0 <= i < len(LADDER):
            return LADDER[i]
    ratio = ordered[-1] / ordered[-2] if up else ordered[1] / ordered[0]
    v = ordered[-1] * ratio if up else ordered[0] / ratio
    return float(f"{v:.2g}")


def extend(candidates: list[dict[str, Any]], up: bool) -> dict[str, Any]:
    """One more candidate beyond the edge: the swept key (the first) takes :func:`_next_value`, and the
    keys tied to it (the same value in every candidate, e.g. the fine-tune rate) follow it."""
    main = next(iter(candidates[0]))
    values = [c[main] for c in candidates]
    v = _next_value(values, up)
    tied = [k for k in candidates[0] if all(c[k] == c[main] for c in candidates)]
    return {k: (v if k in tied else candidates[0][k]) for k in candidates[0]}


def _score_of(entry: Entry, c: dict[str, Any], ok: dict[tuple[Any, ...], dict[str, Any]],
              diverged: set[tuple[Any, ...]], refused: set[tuple[Any, ...]], dataset: str = DATASET) -> float | None:
    key = (entry.key, sha256_text(candidate_config(entry, c, dataset)), SWEEP_SEED, SWEEP_ROUNDS)
    r = ok.get(key)
    if r is not None:
        return r.get("acc_weighted")
    return DIVERGED if key in diverged else (REFUSED if key in refused else None)


def sweep_scores(entry: Entry, sweep_records: list[dict[str, Any]], dataset: str = DATASET
                 ) -> list[tuple[dict[str, Any], float | None]]:
    """Each candidate with its final-round validation accuracy: ``None`` until it has a successful run,
    :data:`DIVERGED` when its run stopped on a non-finite loss or update (the loop's divergence check),
    :data:`REFUSED` when the library refused its configuration at setup (a ``fedmeta: error:`` line).

    The candidates are the entry's sweep, extended while its best value is at an edge: when every score is in
    and the winner is the largest (smallest) value, the next value beyond it (:func:`extend`) joins the sweep,
    at most :data:`MAX_EXTENSIONS` times, and not past a value that diverged. The candidates stay in
    ascending order of the swept value."""
    ok = _ok(sweep_records)
    diverged = {(r.get("entry"), r.get("config_sha256"), r.get("seed"), r.get("rounds"))
                for r in sweep_records if "non-finite" in str(r.get("error", ""))}
    refused = {(r.get("entry"), r.get("config_sha256"), r.get("seed"), r.get("rounds"))
               for r in sweep_records if str(r.get("error", "")).startswith(SETUP_ERROR_PREFIX)}
    cands = sorted(entry.sweep, key=lambda c: c[next(iter(c))])
    for _ in range(MAX_EXTENSIONS + 1):
        scores = [(c, _score_of(entry, c, ok, diverged, refused, dataset)) for c in cands]
        winner = pick_winner(scores)
        if winner is None:
            return scores
        i = cands.index(winner)
        added = len(cands) - len(entry.sweep)
        if added >= MAX_EXTENSIONS or len(cands) < 2:
            return scores
        if i == len(cands) - 1 and not failed_score(scores[-1][1]):
            cands = [*cands, extend(cands, up=True)]
        elif i == 0 and not failed_score(scores[0][1]):
            cands = [extend(cands, up=False), *cands]
        else:
            return scores
    return scores


def pick_winner(scores: list[tuple[dict[str, Any], float | None]]) -> dict[str, Any] | None:
    """The candidate with the highest validation score (ties: the first listed); ``None`` if any is missing
    or every candidate diverged or was refused."""
    if not scores or any(s is None for _, s in scores) or all(failed_score(s) for _, s in scores):
        return None
    best = max(range(len(scores)), key=lambda i: (scores[i][1], -i))
    return scores[best][0]


def choose(entry: Entry, sweep_records: list[dict[str, Any]], final_records: list[dict[str, Any]] | None = None,
           dataset: str = DATASET) -> tuple[dict[str, Any] | None, list[tuple[dict[str, Any], float | None]],
                      list[tuple[dict[str, Any], list[int]]]]:
    """``(winner, scores, withdrawn)``: the best candidate by validation score (:func:`pick_winner`), except that a
    candidate whose final run diverged (a non-finite loss or update, seen in training, not in test data) is
    withdrawn and the next best by validation takes its place. ``withdrawn`` lists (candidate, diverged seeds)."""
    scores = sweep_scores(entry, sweep_records, dataset)
    if pick_winner(scores) is None:
        return None, scores, []
    diverged: dict[str, list[int]] = {}
    for r in final_records or []:
        if r.get("entry") == entry.key and "non-finite" in str(r.get("error", "")):
            diverged.setdefault(str(r.get("config_body_sha256")), []).append(int(r["seed"]))
    withdrawn = []
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i][1], i))  # type: ignore[operator]
    for i in ranked:
        c, score = scores[i]
        if failed_score(score):
            break
        seeds = diverged.get(body_sha256(final_config(entry, c, scores, dataset=dataset)))
        if not seeds:
            return c, scores, withdrawn
        withdrawn.append((c, sorted(set(seeds))))
    return None, scores, withdrawn


def _winner_text(entry: Entry, sweep_records: list[dict[str, Any]],
                 final_records: list[dict[str, Any]] | None = None, dataset: str = DATASET) -> str | None:
    winner, scores, withdrawn = choose(entry, sweep_records, final_records, dataset)
    return None if winner is None else final_config(entry, winner, scores, withdrawn, dataset)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", nargs="+", choices=list(ENTRIES), default=None)
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dataset", choices=list(DATASETS), default=DATASET)
    parser.add_argument("--root", default=None, help="data folder (needed for --dataset mnist)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--report-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--runs", type=Path, default=Path("runs/equal_work"))
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--write-winners", action="store_true",
                        help="(re)write configs/paper/equal_work[_<dataset>]/<entry>.yaml from the stored records")
    parser.add_argument("--smoke", action="store_true",
                        help="run each entry's first candidate for 3 rounds (nothing recorded): checks every config")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.dataset != DATASET and args.root is None and not (args.report_only or args.write_winners):
        parser.error(f"--dataset {args.dataset} needs --root DIR (the folder with its files)")
    dataset, root = args.dataset, None if args.root is None else str(Path(args.root).resolve())
    entries = [ENTRIES[k] for k in (args.entries or ENTRIES) if _available(ENTRIES[k])]
    args.results.mkdir(parents=True, exist_ok=True)
    sweep_path, final_path = args.results / f"sweep_{dataset}.jsonl", args.results / f"final_{dataset}.jsonl"
    runs_dir = args.runs.resolve() / ("" if dataset == DATASET else dataset)
    wdir = winner_dir(dataset)

    def cand_file(entry: Entry, c: dict[str, Any]) -> tuple[str, Path]:
        text = candidate_config(entry, c, dataset)
        p = runs_dir / "configs" / f"{entry.key}__{_tag(c)}.yaml"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        return text, p

    if args.smoke:
        failed = 0
        with cf.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            futs = {}
            for e in entries:
                text = smoke_config(e, e.sweep[0], dataset)
                p = runs_dir / "configs" / f"{e.key}__smoke.yaml"
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(text)
                futs[pool.submit(_run, text, p, 0, SMOKE_ROUNDS, runs_dir / "smoke" / e.key, args.threads,
                                 {"entry": e.key}, root)] = e
            for fut in cf.as_completed(futs):
                rec = fut.result()
                failed += "error" in rec
                print(f"[equal_work] smoke {futs[fut].key}: {rec.get('error') or 'ok'} ({rec['wall_s']:.0f}s)",
                      flush=True)
        return 1 if failed else 0

    def write_winners() -> None:
        sweep, final = read_records(sweep_path), read_records(final_path)
        for e in entries:
            text = _winner_text(e, sweep, final, dataset)
            p = REPO / wdir / f"{e.key}.yaml"
            if text is None:  # no winner (yet): an extended sweep is running, so an older winner is withdrawn
                p.unlink(missing_ok=True)
            elif not p.exists() or p.read_text() != text:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(text)

    def report() -> None:
        """The winners of the entries run, and the report of every entry (a run of some entries, ``--entries``,
        must not drop the others' rows from the shared report)."""
        write_winners()
        every = [e for e in ENTRIES.values() if _available(e)]
        rows = summarise(every, read_records(sweep_path), read_records(final_path), args.seeds, dataset)
        md, csv_path = write_report(rows, args.report_dir, args.results, dataset)
        print(f"[equal_work] report: {md}, {csv_path}", flush=True)

    if args.write_winners or args.report_only:
        report()
        return 0

    def pending() -> list[tuple[str, Entry, dict[str, Any] | None, int]]:
        """Runs still to do: sweep candidates, then the finals of entries whose sweep is complete. A final job
        carries its winner, so a winner withdrawn mid-run (its final diverged) does not hide its successor's
        finals from the ``tried`` set below."""
        sweep, final = read_records(sweep_path), read_records(final_path)
        ok_f = _ok(final, "config_body_sha256")
        todo: list[tuple[str, Entry, dict[str, Any] | None, int]] = []
        for e in entries:
            winner, scores, withdrawn = choose(e, sweep, final, dataset)
            if winner is not None:
                text = final_config(e, winner, scores, withdrawn, dataset)
                todo += [("final", e, winner, s) for s in args.seeds
                         if (e.key, body_sha256(text), s, ROUNDS) not in ok_f]
        for e in entries:  # a candidate that diverged has its result; one that failed otherwise is retried
            todo += [("sweep", e, c, SWEEP_SEED) for c, score in sweep_scores(e, sweep, dataset) if score is None]
        return todo

    def launch(pool: cf.ThreadPoolExecutor, job: tuple[str, Entry, dict[str, Any] | None, int]) -> cf.Future:
        stage, e, c, s = job
        if stage == "sweep":
            assert c is not None
            text, p = cand_file(e, c)
            out = runs_dir / "sweep" / f"{e.key}__{_tag(c)}"
            return pool.submit(_run, text, p, s, SWEEP_ROUNDS, out, args.threads,
                               {"stage": "sweep", "entry": e.key, "candidate": c,
                                "grad_evals_per_client_round": entry_work(e)}, root)
        write_winners()
        p = REPO / wdir / f"{e.key}.yaml"
        return pool.submit(_run, p.read_text(), p.relative_to(REPO), s, ROUNDS, runs_dir / "final" / e.key / f"seed{s}",
                           args.threads, {"stage": "final", "entry": e.key,
                                          "config": (wdir / f"{e.key}.yaml").as_posix(),
                                          "grad_evals_per_client_round": entry_work(e)}, root)

    start, done, failed = time.perf_counter(), 0, 0
    running: dict[cf.Future, tuple[str, Entry, dict[str, Any] | None, int]] = {}
    tried: set[tuple[str, str, str, int]] = set()
    print(f"[equal_work] {len(pending())} runs to do (sweeps first; finals as sweeps complete), "
          f"{args.jobs} at once", flush=True)
    with cf.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        while True:
            for job in pending():
                if len(running) >= args.jobs:
                    break
                ident = (job[0], job[1].key, json.dumps(job[2], sort_keys=True), job[3])
                if ident in tried:
                    continue
                tried.add(ident)
                running[launch(pool, job)] = job
            if not running:
                break
            finished, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                stage, e, c, s = running.pop(fut)
                try:
                    rec = fut.result()
                except Exception as err:  # noqa: BLE001 - record and go on
                    rec = {"stage": stage, "entry": e.key, "candidate": c, "seed": s, "error": f"{err!r}"}
                append_record(sweep_path if stage == "sweep" else final_path, rec)
                done += 1
                failed += "error" in rec
                left = len([j for j in pending()
                            if (j[0], j[1].key, json.dumps(j[2], sort_keys=True), j[3]) not in tried])
                status = rec.get("error") or (f"acc {100 * (rec.get('acc_weighted') or math.nan):.2f}% "
                                              f"in {rec['wall_s']:.0f}s")
                elapsed = fmt_duration(time.perf_counter() - start)
                print(f"[equal_work] {done} done ({left} queued, {len(running)} running): {stage} {e.key} "
                      f"{'' if c is None else c} seed {s}: {status}; elapsed {elapsed}", flush=True)
                report()
    report()
    return 1 if failed else 0


# -- report ----------------------------------------------------------------------------------------
def summarise(entries: list[Entry], sweep: list[dict[str, Any]], final: list[dict[str, Any]],
              seeds: list[int], dataset: str = DATASET) -> list[dict[str, Any]]:
    """One row per entry: its sweep, winner, and final-run mean ± sample std over the finished seeds."""
    ok_f = _ok(final, "config_body_sha256")
    rows = []
    for e in entries:
        winner, scores, withdrawn = choose(e, sweep, final, dataset)
        text = None if winner is None else final_config(e, winner, scores, withdrawn, dataset)
        runs = [] if text is None else [ok_f[k] for s in seeds
                                        if (k := (e.key, body_sha256(text), s, ROUNDS)) in ok_f]
        row: dict[str, Any] = {"entry": e.key, "label": e.label, "cell": e.cell, "evaluation": e.evaluation,
                               "work": entry_work(e) if e.key != "mocha_linear" else None,
                               "scores": scores, "winner": winner, "withdrawn": withdrawn, "seeds_done": len(runs),
                               "seeds_asked": len(seeds), "runs": runs}
        if winner is not None:
            i = next(j for j, (c, _) in enumerate(scores) if c == winner)
            row["winner_at_edge"] = len(scores) > 1 and i in (0, len(scores) - 1)
        for key in ("acc_weighted", "acc_worst10", "new_acc_weighted", "best_acc_weighted", "wall_s"):
            mean, std = mean_std([r[key] for r in runs if isinstance(r.get(key), (int, float))])
            row[f"{key}_mean"], row[f"{key}_std"] = mean, std
        rows.append(row)
    return rows


def paired_against(rows: list[dict[str, Any]], base_key: str, other: dict[int, float] | None = None
                   ) -> dict[str, tuple[float | None, float | None, int]]:
    """Each entry's final weighted accuracy minus ``base_key``'s (or ``other``'s), paired by seed:
    ``entry -> (mean, sample std, number of common seeds)``."""
    by = {r["entry"]: r for r in rows}
    base = other if other is not None else {r["seed"]: r["acc_weighted"] for r in by.get(base_key, {}).get("runs", [])}
    out = {}
    for r in rows:
        mine = {x["seed"]: x["acc_weighted"] for x in r["runs"]}
        common = sorted(set(mine) & set(base))
        mean, std = mean_std([mine[s] - base[s] for s in common])
        out[r["entry"]] = (mean, std, len(common))
    return out


def _grid_hf(cell: tuple[int, float], dataset: str = DATASET) -> dict[int, float]:
    """Per-FedAvg HF's final accuracy per seed in a grid cell, from benchmarks/reproduce.py's records."""
    path = REPO / f"benchmarks/results/reproduction/runs_{dataset}.jsonl"
    if not path.exists():
        return {}
    t, a = cell
    return {r["seed"]: r["acc_weighted"] for r in read_records(path)
            if "error" not in r and r.get("method") == "perfedavg_hf" and r.get("tau") == t
            and r.get("alpha") == a and r.get("rounds") == ROUNDS and r.get("dataset", DATASET) == dataset}


def _score(s: float | None, digits: int = 2) -> str:
    if s is None:
        return "pending"
    if s == DIVERGED:
        return "diverged"
    if s == REFUSED:
        return "refused at setup"
    return f"{100 * s:.{digits}f}" + (" %" if digits == 2 else "")


def _cand(c: dict[str, Any]) -> str:
    return ", ".join(f"{k.split('.', 1)[1]} = {v:g}" if isinstance(v, float) else f"{k.split('.', 1)[1]} = {v}"
                     for k, v in c.items())


def write_report(rows: list[dict[str, Any]], out_dir: Path, png_dir: Path, dataset: str = DATASET
                 ) -> tuple[Path, Path]:
    """``equal_work[_<dataset>].md`` / ``.csv`` in ``out_dir``, PNGs in ``png_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    name = report_name(dataset)
    csv_path, md_path = out_dir / f"{name}.csv", out_dir / f"{name}.md"
    fields = ["entry", "label", "work", "evaluation", "winner", "seeds_done", "acc_weighted_mean", "acc_weighted_std",
              "acc_worst10_mean", "acc_worst10_std", "new_acc_weighted_mean", "new_acc_weighted_std",
              "best_acc_weighted_mean", "wall_s_mean"]
    with csv_path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else (_cand(r[k]) if k == "winner" else r[k])) for k in fields})
    pngs = _plots(rows, png_dir, dataset)
    rel = os.path.relpath(png_dir, out_dir)
    grid_rows = [r for r in rows if r["cell"] is not None]
    work_rows = [r for r in rows if r["cell"] is None]
    paired = paired_against(work_rows, "fedavg_ft_w16")

    def line(r: dict[str, Any], extra: str) -> str:
        sweep = "; ".join(f"{_cand(c)}: {_score(s, 1)}" for c, s in r["scores"])
        win = "pending" if r["winner"] is None else _cand(r["winner"]) + (" (edge)" if r.get("winner_at_edge") else "")
        win += "".join(f"; withdrawn {_cand(c)}: diverged in the final run with seed(s) {', '.join(map(str, sd))}"
                       for c, sd in r.get("withdrawn") or [])
        wall = "" if r["wall_s_mean"] is None else f"{r['wall_s_mean']:.0f}"
        return (f"| {r['label']} | {'n/a' if r['work'] is None else r['work']} | {r['evaluation']} | {sweep} | {win} "
                f"| {r['seeds_done']}/{r['seeds_asked']} | {pct(r['acc_weighted_mean'], r['acc_weighted_std'])} "
                f"| {pct(r['acc_worst10_mean'], r['acc_worst10_std'])} "
                f"| {pct(r['new_acc_weighted_mean'], r['new_acc_weighted_std'])} "
                f"| {pct(r['best_acc_weighted_mean'], r['best_acc_weighted_std'])} | {extra} | {wall} |")

    head = ("| entry | grad evals / client / round | evaluation | sweep: validation acc % (300 rounds, seed 0) "
            "| winner | seeds | test acc (weighted) | worst 10% | new clients | best round (secondary) | {} "
            "| wall s |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [
        f"# Every algorithm at equal work, tuned on validation data ({TITLES[dataset]}, Per-FedAvg paper split)",
        "",
        "Generated by `python -m benchmarks.equal_work` (issue 14); do not edit by hand. Setting and "
        "protocol: docs/reproduction.md and the script's docstring. Test accuracies in %, final round "
        "(1000), mean ± sample std over seeds 0, 1, 2; the sweep scores are validation accuracies "
        "(20 % of each client's training data, the test set not read) after 300 rounds, seed 0; "
        "`(edge)`: the winner is the first or last value of its sweep; *withdrawn*: a better-scoring candidate "
        "whose final (1000-round) run diverged, replaced by the next best by validation score.",
        "",
        "## FedAvg at a tuned local rate + 1 fine-tune step at α (the grid's second baseline)",
        "",
        head.format("Per-FedAvg (HF) − this, paired by seed"),
    ]
    for r in grid_rows:
        hf = paired_against([r], r["entry"], _grid_hf(r["cell"], dataset))[r["entry"]]
        d = (-hf[0] if hf[0] is not None else None, hf[1], hf[2])
        lines.append(line(r, pct(d[0], d[1], signed=True) + (f" ({d[2]} seeds)" if d[2] else "")))
    lines += [
        "",
        f"## Every algorithm at {WORK} gradient evaluations per client per round",
        "",
        head.format("− FedAvg + FT (equal work), paired by seed"),
    ]
    for r in work_rows:
        d = paired[r["entry"]]
        extra = "—" if r["entry"] == "fedavg_ft_w16" else pct(d[0], d[1], signed=True)
        lines.append(line(r, extra))
    lines += ["", *[f"![{p.stem}]({rel}/{p.name})" for p in pngs]]
    md_path.write_text("\n".join(lines) + "\n")
    return md_path, csv_path


def _plots(rows: list[dict[str, Any]], png_dir: Path, dataset: str = DATASET) -> list[Path]:
    """Accuracy vs round (mean, min–max band over seeds) and the per-client accuracy box plot per entry."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    png_dir.mkdir(parents=True, exist_ok=True)
    work_rows = [r for r in rows if r["cell"] is None]
    paths = []
    fig, ax = plt.subplots(figsize=(11, 6.5))
    cmap = plt.get_cmap("tab20")
    for i, r in enumerate(work_rows):
        curves = [x["curve"] for x in r["runs"] if x.get("curve")]
        if not curves:
            continue
        axis = [c[0] for c in curves[0]]
        curves = [c for c in curves if [x[0] for x in c] == axis]
        ys = np.array([[100 * (x[1] if x[1] is not None else np.nan) for x in c] for c in curves])
        ax.plot(axis, np.nanmean(ys, axis=0), color=cmap(i % 20), label=f"{r['label']} ({len(curves)})")
        if len(curves) > 1:
            ax.fill_between(axis, np.nanmin(ys, axis=0), np.nanmax(ys, axis=0), color=cmap(i % 20), alpha=0.15)
    ax.set_xlabel("round")
    ax.set_ylabel("weighted test accuracy (%)")
    ax.set_ylim(40, 100)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2, loc="lower right")
    ax.set_title(f"{TITLES[dataset]}, equal work ({WORK} grad evals / client / round): mean and min–max over seeds")
    fig.tight_layout()
    p = png_dir / f"{report_name(dataset)}_curves.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(12, 5.5))
    data, labels = [], []
    for r in work_rows:
        vals = []
        for x in r["runs"]:
            pc, new = x.get("per_client_acc") or [], x.get("is_new_client") or []
            vals += [100 * v for j, v in enumerate(pc) if v is not None and not (j < len(new) and new[j])]
        data.append(vals if vals else [np.nan])
        labels.append(r["label"].split(" (")[0] + ("" if vals else "\nmissing"))
    ax.boxplot(data, showfliers=True)
    ax.set_xticks(range(1, len(labels) + 1), labels, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("per-client test accuracy (%)")
    ax.grid(alpha=0.3, axis="y")
    ax.set_title("Final-round accuracy of each training client (seeds pooled): who is left behind")
    fig.tight_layout()
    p = png_dir / f"{report_name(dataset)}_per_client.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    return paths


if __name__ == "__main__":
    sys.exit(main())
