"""Property-based fuzzing of every public option: an invalid value never reaches round 1 and always gives a
``ValueError`` that names the option (docs/reliability.md, "Crashes and checkpoints").

The options are enumerated from the signatures (``inspect.signature``): ``FederatedModule``'s arguments, the
algorithms' common hyper-parameters (:data:`~lightning_fedmeta.algorithms.base.COMMON_ARGS`), every built-in
algorithm's own, and ``FederatedDataModule``'s. Each has an entry in a table below: a strategy of valid values
and one of invalid values (values of the option's annotated type, which is what the command line lets through,
outside the valid domain), or the reason there are none. An option without an entry fails
``test_every_option_has_a_strategy``, which lists it: a new option is fuzzed as soon as it has its row.

"Never reaches round 1": the checks run by construction and setup (``FederatedModule(...)``, ``attach_data``,
``configure_optimizers``; ``FederatedDataModule(...)``, ``setup``), which is what a ``Trainer`` runs before its
first training step. A valid value must pass them all.
"""

from __future__ import annotations

import inspect
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

from lightning_fedmeta import FederatedModule
from lightning_fedmeta.algorithms.base import COMMON_ARGS
from lightning_fedmeta.client.losses import LOSSES
from lightning_fedmeta.communication.compressors import COMPRESSORS, DOWNLOADS
from lightning_fedmeta.data import FederatedDataModule
from lightning_fedmeta.data.datamodule import DATASET_NAMES, PARTITION_NAMES, SYNTHETIC_DATASETS, TEST_SPLITS
from lightning_fedmeta.models.lora import add_lora
from lightning_fedmeta.registry import list_algorithms, load_algorithm
from lightning_fedmeta.reliability.attacks import ATTACKS
from lightning_fedmeta.reliability.robust import AGGREGATORS
from tests.helpers import tiny_data, tiny_linear

K = 6  # clients of the tiny federation (tests.helpers.tiny_data)
# derandomized (the same examples every run), no shrinking (a failing example is reported as drawn)
_QUICK = {"deadline": None, "derandomize": True, "database": None, "phases": [Phase.explicit, Phase.generate],
          "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much]}
FUZZ = settings(max_examples=6, **_QUICK)
VALID = settings(max_examples=3, **_QUICK)


@dataclass(frozen=True)
class Option:
    """How to fuzz one option: ``invalid`` values (``None``: there are none, see ``no_invalid``) and ``valid``
    ones; ``base`` overrides other options so that this one is the only thing wrong (e.g. ``fraction`` needs
    ``clients_per_round=None``)."""

    valid: st.SearchStrategy[Any]
    invalid: st.SearchStrategy[Any] | None
    no_invalid: str = ""
    base: dict[str, Any] = field(default_factory=dict)
    errors: tuple[type[Exception], ...] = (ValueError,)


# ----------------------------------------------------------------------------------------------
# strategies
# ----------------------------------------------------------------------------------------------
NAN = st.just(math.nan)
INF = st.sampled_from([math.inf, -math.inf])


def below(x: float, inclusive: bool = False) -> st.SearchStrategy[float]:
    return st.floats(max_value=x, exclude_max=not inclusive, allow_nan=False, allow_infinity=True)


def above(x: float, inclusive: bool = False) -> st.SearchStrategy[float]:
    return st.floats(min_value=x, exclude_min=not inclusive, allow_nan=False, allow_infinity=True)


def between(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(min_value=lo, max_value=hi, allow_nan=False, allow_infinity=False)


def nonnegative_finite() -> Option:
    """A finite float >= 0 (a learning rate, a regularisation weight): negative, NaN and infinite are invalid."""
    return Option(between(0.0, 2.0), below(0.0) | NAN | st.just(math.inf))


def positive_finite() -> Option:
    return Option(between(1e-4, 2.0), below(0.0, inclusive=True) | NAN | st.just(math.inf))


def int_at_least(low: int, valid_high: int = 5) -> Option:
    return Option(st.integers(low, max(low, valid_high)), st.integers(max_value=low - 1))


def optional(option: Option) -> Option:
    return Option(st.none() | option.valid, option.invalid, option.no_invalid, option.base)


def text_not_in(choices: Any) -> st.SearchStrategy[str]:
    return st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=1, max_size=8).filter(
        lambda s: s not in set(choices))


def factory(fn: Callable[..., Any]) -> st.SearchStrategy[Any]:
    return st.just(fn)


NOT_CALLABLE = st.integers() | st.text(max_size=5)
NO_INVALID_BOOL = "every bool is valid"


def _two_layers() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


def _lora_two_layers() -> nn.Module:
    return add_lora(_two_layers(), rank=2)


def _batch_norm() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))


class _EveryOther:
    """A partitioner of Flower Datasets' shape (``dataset`` attribute, ``num_partitions``, ``load_partition``):
    partition ``i`` is every ``num_partitions``-th row from ``i``."""

    def __init__(self, num_partitions: int) -> None:
        self.num_partitions, self.dataset = num_partitions, None

    def load_partition(self, partition_id: int) -> Any:
        rows = range(len(self.dataset["label"]))
        return self.dataset.select([i for i in rows if i % self.num_partitions == partition_id])


# ----------------------------------------------------------------------------------------------
# the tables
# ----------------------------------------------------------------------------------------------
MODULE_BASE: dict[str, Any] = {
    "algorithm": {"name": "fedavg", "local_steps": 1, "batch_size": 4}, "clients_per_round": 3,
}
MODULE_OPTIONS: dict[str, Option] = {
    "model": Option(st.builds(tiny_linear) | st.none(),
                    st.sampled_from([lambda: nn.Linear(5, 4), lambda: nn.Linear(4, 3)]).map(lambda make: make())),
    "algorithm": Option(
        st.sampled_from(["fedavg", "fedprox", "scaffold", "ditto", "reptile", "perfedavg", "ifca", "mtl_mean"]),
        text_not_in([e.name for e in list_algorithms()])
        | st.fixed_dictionaries({"name": st.just("fedavg"), "not_an_option": st.integers()})
        | st.fixed_dictionaries({"not_a_name": st.just("fedavg")}),
    ),
    "clients_per_round": Option(st.integers(1, K), st.integers(max_value=0) | st.integers(K + 1, 50)),
    "fraction": Option(between(0.01, 1.0), below(0.0, inclusive=True) | above(1.0) | NAN,
                       base={"clients_per_round": None}),
    "aggregation": Option(st.sampled_from(["samples", "uniform"]), text_not_in(["samples", "uniform"])),
    "server_lr": Option(between(0.0, 5.0), below(0.0) | NAN | st.just(math.inf)),
    "server_optimizer": Option(
        st.none() | factory(lambda p: torch.optim.SGD(p, lr=0.5)) | factory(lambda p: torch.optim.Adam(p, lr=0.1)),
        NOT_CALLABLE),
    "server_lr_scheduler": Option(st.none() | factory(lambda o: torch.optim.lr_scheduler.StepLR(o, 2)),
                                  NOT_CALLABLE),
    "client_batching": Option(st.sampled_from(["auto", "vmap", "loop"]), text_not_in(["auto", "vmap", "loop"])),
    "client_chunk_size": Option(st.none() | st.just("auto") | st.integers(1, 200),
                                st.integers(max_value=0) | text_not_in(["auto"])),
    "compile_clients": Option(st.sampled_from([False, "auto"]), text_not_in(["auto"])),
    "step_schedule": Option(st.sampled_from(["auto", "grouped", "lockstep", "compacted"]),
                            text_not_in(["auto", "grouped", "lockstep", "compacted"])),
    "cuda_graphs": Option(st.sampled_from([False, "auto"]), text_not_in(["auto"])),
    "client_state": Option(st.sampled_from(["auto", "memory", "disk"]), text_not_in(["auto", "memory", "disk"])),
    "client_state_dir": Option(st.none() | st.just(os.path.join(tempfile.gettempdir(), "fedmeta_fuzz_client_state")),
                               st.just("/dev/null/client_state") | st.just("/proc/version"),
                               base={"client_state": "disk"}),
    "holdout_clients": Option(st.integers(0, 2) | between(0.0, 0.4),
                              st.integers(max_value=-1) | st.integers(K, 40) | below(0.0) | above(1.0, True) | NAN),
    "seed": Option(st.integers(-(2**40), 2**40), None, "any integer is a seed (sampling hashes it)"),
    "loss": Option(st.sampled_from(["cross_entropy", "nll"]) | st.none(),
                   text_not_in(LOSSES) | st.just("no_such_package.losses.focal")),
    "metrics": Option(st.none() | st.just({"acc": "accuracy"}),
                      st.just({}) | st.fixed_dictionaries({"m": text_not_in(["accuracy", "mse", "mae", "rmse",
                                                                                "perplexity"])})),
    "client_dropout": Option(between(0.0, 0.9), below(0.0) | above(1.0, inclusive=True) | NAN),
    "over_selection": Option(between(0.0, 2.0), below(0.0) | NAN | st.just(math.inf)),
    "local_steps_dist": Option(
        st.none() | st.lists(st.integers(1, 3), min_size=K, max_size=K)
        | st.integers(1, 2).map(lambda low: {"distribution": "uniform", "low": low, "high": low + 1}),
        st.lists(st.integers(1, 3), min_size=1, max_size=12).filter(lambda v: len(v) != K)
        | st.lists(st.integers(-3, 0), min_size=K, max_size=K)
        | st.fixed_dictionaries({"distribution": text_not_in(["uniform", "choice"])})
        | st.integers(2, 5).map(lambda high: {"distribution": "uniform", "low": high + 1, "high": high}),
        base={"algorithm": {"name": "fedavg", "local_steps": 3, "batch_size": 4}},  # budgets of at most 3 steps
    ),
    "aggregator": Option(
        st.none() | st.sampled_from(["mean", "median", "geometric_median"])
        | between(0.0, 0.3).map(lambda b: {"name": "trimmed_mean", "beta": b}),
        text_not_in(AGGREGATORS)
        | (below(0.0) | above(0.5, inclusive=True) | NAN).map(lambda b: {"name": "trimmed_mean", "beta": b})
        | st.just({"name": "median", "beta": 0.1}),
    ),
    "byzantine": Option(
        st.none() | st.fixed_dictionaries({"fraction": between(0.2, 0.45), "attack": st.sampled_from(
            ["sign_flip", "gaussian", "scaled"])}),
        st.fixed_dictionaries({"fraction": below(0.0, True) | above(0.5, True) | NAN, "attack": st.just("sign_flip")})
        | st.fixed_dictionaries({"fraction": st.just(0.2), "attack": text_not_in(ATTACKS)}),
    ),
    "dp": Option(
        st.none() | st.fixed_dictionaries({"clip": between(0.1, 5.0), "noise_multiplier": between(0.0, 2.0)}),
        st.fixed_dictionaries({"clip": below(0.0, True) | NAN, "noise_multiplier": st.just(1.0)})
        | st.fixed_dictionaries({"clip": st.just(1.0), "noise_multiplier": below(0.0) | NAN})
        | st.fixed_dictionaries({"clip": st.just(1.0), "noise_multiplier": st.just(1.0),
                                 "delta": below(0.0, True) | above(1.0, True)})
        | st.fixed_dictionaries({"clip": st.just(1.0), "not_an_option": st.just(1)}),
        base={"aggregation": "uniform"},
    ),
    "compression": Option(
        st.none() | st.sampled_from(COMPRESSORS)
        | st.fixed_dictionaries({"upload": st.just("qsgd"), "bits": st.sampled_from([2, 4, 8]),
                                 "bucket_size": st.none() | st.integers(1, 64)})
        | st.fixed_dictionaries({"upload": st.sampled_from(["topk", "randomk"]), "fraction": between(0.01, 1.0),
                                 "download": st.sampled_from(DOWNLOADS)}),
        text_not_in(COMPRESSORS)
        | st.fixed_dictionaries({"download": text_not_in(DOWNLOADS)})
        | st.fixed_dictionaries({"upload": st.just("qsgd"), "bits": st.integers().filter(lambda b: b not in (2, 4, 8))
                                 | st.sampled_from([8.5, 4.0, "8", True])})
        | st.fixed_dictionaries({"upload": st.just("qsgd"), "bucket_size": st.integers(max_value=0)
                                 | st.sampled_from([True, 16.5, "all"])})
        | st.fixed_dictionaries({"upload": st.sampled_from(["topk", "randomk"]),
                                 "fraction": below(0.0, True) | above(1.0) | NAN | st.sampled_from(["half", True])})
        | st.fixed_dictionaries({"upload": st.just("qsgd"), "fraction": st.just(0.1)})  # a key qsgd does not use
        | st.sampled_from([["qsgd"], 8]),  # neither a name nor a mapping
    ),
}

DATA_BASE: dict[str, Any] = {"dataset": "synthetic", "num_clients": 4, "eval_every": 2}
DATA_OPTIONS: dict[str, Option] = {
    "dataset": Option(st.sampled_from(list(SYNTHETIC_DATASETS)), text_not_in(DATASET_NAMES)),
    "root": Option(st.none() | st.text(max_size=10), st.just("/nonexistent/fedmeta-fuzz"), base={"dataset": "mnist"},
                   errors=(FileNotFoundError,)),  # the files are missing: it names the folder and `root`
    "download": Option(st.booleans(), None, NO_INVALID_BOOL),
    "partition": Option(st.sampled_from([p for p in PARTITION_NAMES if p != "flower"]),  # flower: see partitioner
                        text_not_in(PARTITION_NAMES)),
    "num_clients": Option(st.integers(1, 6), st.integers(max_value=0)),
    "dirichlet_alpha": Option(between(0.01, 50.0), below(0.0, inclusive=True) | NAN),
    "classes_per_client": Option(st.integers(1, 10), st.integers(max_value=0)),
    "samples_per_class": Option(st.integers(2, 500), st.integers(max_value=1)),
    "max_samples_per_client": optional(int_at_least(1, 1000)),
    "synthetic_alpha": Option(between(0.0, 2.0), below(0.0) | NAN | st.just(math.inf)),
    "synthetic_beta": Option(between(0.0, 2.0), below(0.0) | NAN | st.just(math.inf)),
    "eval_every": Option(st.integers(1, 100), st.integers(max_value=0)),
    "data_seed": Option(st.integers(0, 2**32 - 1), st.integers(max_value=-1)),
    "validation_fraction": Option(st.just(0.0) | between(0.05, 0.5), below(0.0) | above(1.0, True) | NAN),
    "eval_clients": optional(int_at_least(1, 10)),
    "balance": Option(st.booleans(), None, NO_INVALID_BOOL),
    "min_client_samples": optional(int_at_least(0, 50)),
    "max_retries": int_at_least(1, 200),
    "test_split": Option(st.sampled_from(TEST_SPLITS), text_not_in(TEST_SPLITS)),
    "train_fraction": Option(between(0.05, 0.95), below(0.0, inclusive=True) | above(1.0, inclusive=True) | NAN),
    "partitioner": Option(st.integers(1, 4).map(_EveryOther),  # the synthetic sets ignore the partition
                          st.none() | st.just(object()) | st.integers() | st.just("IidPartitioner"),
                          base={"partition": "flower"}),
    # a plugin's own options (data/plugins.py): the built-in synthetic dataset and iid split have none of their own
    # (their parameters are data.* settings), so anything but an empty mapping is refused, naming the option
    "dataset_options": Option(st.none() | st.just({}),
                              st.dictionaries(st.sampled_from(["size", "seed", "num_clients", "noise"]), st.integers(),
                                              min_size=1) | st.sampled_from([[1], "size=3", 3])),
    "partition_options": Option(st.none() | st.just({}),
                                st.dictionaries(st.sampled_from(["beta", "seed", "rng", "alpha"]), st.integers(),
                                                min_size=1) | st.sampled_from([[1], "beta=3", 3]),
                                base={"partition": "iid"}),
}

COMMON_OPTIONS: dict[str, Option] = {
    "local_steps": int_at_least(1, 4),
    "local_lr": nonnegative_finite(),
    "batch_size": optional(int_at_least(1, 64)),
    "finetune_steps": int_at_least(0, 3),
    "finetune_lr": optional(nonnegative_finite()),
    "finetune_batch_size": optional(int_at_least(1, 64)),
    "local_epochs": optional(int_at_least(1, 3)),
    "finetune_epochs": optional(int_at_least(1, 3)),
    "drop_last": Option(st.booleans(), None, NO_INVALID_BOOL),
}

#: each built-in algorithm: its base hyper-parameters and model, and a row per option of its own
ALGORITHM_BASES: dict[str, tuple[dict[str, Any], Callable[[], nn.Module]]] = {
    "fedper": ({}, _two_layers), "fedrep": ({}, _two_layers), "mtl_graph": ({"knn": 1}, tiny_linear),
    "fedala": ({}, _two_layers), "fedbabu": ({}, _two_layers), "fedbn": ({}, _batch_norm),
    "feddbe": ({}, _two_layers), "fedproto": ({}, _two_layers), "fedrod": ({}, _two_layers),
    "lg_fedavg": ({}, _two_layers), "fedas": ({}, _two_layers), "fedpac": ({}, _two_layers),
    "fedsa_lora": ({}, _lora_two_layers), "fdlora": ({}, _lora_two_layers), "hetlora": ({}, _lora_two_layers),
}
HEAD_PREFIX = Option(st.none() | st.just("2."), st.just("zzz") | st.just("") | st.just(["0.", "2."]))
SEED64 = Option(st.integers(-(2**63), 2**64 - 1), st.integers(min_value=2**64) | st.integers(max_value=-(2**63) - 1))
#: a phase counted in epochs (Ditto's personal_epochs, FedRep's head_epochs) needs local_epochs
PHASE_EPOCHS = Option(st.none() | st.integers(1, 3), st.integers(max_value=0), base={"local_epochs": 1})
ALGORITHM_OPTIONS: dict[str, dict[str, Option]] = {
    "apfl": {"alpha": Option(between(0.0, 1.0), below(0.0) | above(1.0) | NAN),
             "adaptive": Option(st.booleans(), None, NO_INVALID_BOOL), "alpha_lr": optional(nonnegative_finite())},
    "cfl": {"eps1": Option(between(0.01, 2.0), below(0.0, True) | NAN), "eps2": Option(between(0.0, 3.0), below(0.0)
            | NAN), "max_clusters": int_at_least(1), "warmup_rounds": int_at_least(0), "min_split_size":
            int_at_least(2)},
    "ditto": {"lam": nonnegative_finite(), "personal_steps": optional(int_at_least(1)),
              "personal_lr": optional(nonnegative_finite()), "personal_epochs": PHASE_EPOCHS},
    "fedala": {"eta": nonnegative_finite(), "ala_layers": int_at_least(1, 2), "ala_steps": int_at_least(1, 3),
               "ala_start_steps": int_at_least(1, 3)},
    "fedamp": {"lam": nonnegative_finite(), "alpha_k": positive_finite(), "sigma": positive_finite()},
    "fedas": {"align_steps": int_at_least(0, 3), "align_lr": nonnegative_finite(),
              "fisher": Option(st.sampled_from(["parameter", "trace", "off"]), text_not_in(["parameter", "trace",
                                                                                             "off"])),
              "fisher_steps": optional(int_at_least(1, 3)), "head_prefix": HEAD_PREFIX},
    "fedavg": {},
    "fedbabu": {"head_prefix": HEAD_PREFIX},
    "fedbn": {"norm_prefix": Option(st.none() | st.just("1.") | st.just(["1"]),
                                    st.just("zzz") | st.just("") | st.just(["zzz"]))},
    "feddbe": {"kappa": nonnegative_finite(), "momentum": Option(between(0.01, 1.0), below(0.0, True) | above(1.0)
                                                                 | NAN), "head_prefix": HEAD_PREFIX},
    "fedem": {"num_components": int_at_least(1, 3), "init_noise": nonnegative_finite(), "init_seed": SEED64,
              "em_steps": int_at_least(1, 3)},
    "fedfomo": {"models_per_client": int_at_least(1, 5)},
    "fedmaml": {"alpha": nonnegative_finite(), "second_order": Option(st.booleans(), None, NO_INVALID_BOOL)},
    "fedper": {"head_prefix": HEAD_PREFIX},
    "fedproto": {"lam": nonnegative_finite(), "head_prefix": HEAD_PREFIX},
    "fedpac": {"lam": nonnegative_finite(), "head_steps": int_at_least(1, 3), "head_epochs": PHASE_EPOCHS,
               "head_lr": optional(nonnegative_finite()), "collaborate": Option(st.booleans(), None, NO_INVALID_BOOL),
               "min_weight": Option(between(0.0, 0.99), below(0.0) | above(1.0, True) | NAN),
               "qp_iters": int_at_least(1, 50), "head_prefix": HEAD_PREFIX},
    "fedprox": {"mu": nonnegative_finite()},
    "fedrep": {"head_prefix": HEAD_PREFIX, "head_steps": int_at_least(1), "head_epochs": PHASE_EPOCHS},
    "fedrod": {"head_prefix": HEAD_PREFIX, "balanced": Option(st.booleans(), None, NO_INVALID_BOOL)},
    "fedsa_lora": {"personal": Option(st.sampled_from(["lora_B", ["lora_B"], ["2.lora_B"], ["*.lora_B", "0.lora_A"]]),
                                      st.sampled_from(["zzz", "", [], [3], ["lora_A", "lora_B"]]))},
    "fdlora": {"personal_lr": optional(nonnegative_finite()), "fusion_steps": int_at_least(0, 3),
               "fusion_lr": nonnegative_finite(), "fusion_l1": nonnegative_finite(),
               "fusion_init": Option(st.sampled_from([[0.5, 0.5], [0.0, 0.5], (-0.5, 0.25)]),
                                     st.sampled_from([[2.0, 0.0], [1.0], "x", [0.5, math.nan]])),
               "fusion_bound": Option(between(0.5, 3.0), below(0.0, True) | NAN | st.just(math.inf))},
    "hetlora": {"ranks": Option(st.none(), st.sampled_from([[], [0], "x", [1, 2.5]])),
                "rank_choices": Option(st.none() | st.sampled_from([[1], [1, 2], [2]]),
                                       st.sampled_from([[], [0], "x", [True]])),
                "rank_seed": SEED64,
                "weighting": Option(st.sampled_from(["norm", "data"]), text_not_in(["norm", "data"]))},
    "ifca": {"num_clusters": int_at_least(1, 3), "init": Option(st.sampled_from(["kmeans++", "perturb"]),
             text_not_in(["kmeans++", "perturb"])), "init_noise": nonnegative_finite(),
             "init_seed": Option(st.integers(0, 2**31), None, "any integer is a seed"),
             "init_restarts": int_at_least(1), "reseed_after": int_at_least(0)},
    "lg_fedavg": {"global_prefix": HEAD_PREFIX},
    "mocha": {"loss": Option(st.sampled_from(["hinge", "squared"]), text_not_in(["hinge", "squared"])),
              "lambda1": Option(between(0.1, 2.0), below(0.0) | NAN | st.just(math.inf)),
              "lambda2": Option(between(0.0, 2.0), below(0.0) | NAN | st.just(math.inf)),
              "local_iters": int_at_least(1, 20), "budget_spread": Option(between(0.0, 0.9), below(0.0) | above(
                  0.999) | NAN), "omega_every": int_at_least(0), "sigma_prime": optional(positive_finite()),
              "sigma_warm_start": Option(st.sampled_from(["primal", "dual"]), text_not_in(["primal", "dual"])),
              "fit_bias": Option(st.booleans(), None, NO_INVALID_BOOL),
              "seed": Option(st.integers(0, 2**31), None, "any integer is a seed")},
    "mtl_graph": {"lam": nonnegative_finite(),
                  "edges": Option(st.just([[0, 1], [2, 3, 0.5]]), st.just([[0, K]]) | st.just([[0]])
                                  | st.just([[0, 1, -1.0]]), base={"knn": None}),
                  "knn": Option(st.integers(1, K - 1), st.integers(max_value=0) | st.integers(K, 20))},
    "mtl_mean": {"lam": nonnegative_finite()},
    "mtl_pairwise": {"lam": nonnegative_finite(),
                     "similarity": Option(st.none() | st.just([[0.0 if i == j else 1.0 for j in range(K)]
                                                                for i in range(K)]),
                                          st.just([[0.0, 1.0], [1.0, 0.0]]) | st.just([[-1.0] * K] * K)
                                          | st.just([[1.0] * (K - 1)] * K) | st.just("/nonexistent/sim.npy"))},
    "perfedavg": {"variant": Option(st.sampled_from(["fo", "hf", "exact"]), text_not_in(["fo", "hf", "exact"])),
                  "alpha": nonnegative_finite(), "beta": nonnegative_finite(), "delta": positive_finite()},
    "perfedmaml": {"alpha": nonnegative_finite(), "beta": nonnegative_finite(), "lam": nonnegative_finite(),
                   "second_order": Option(st.booleans(), None, NO_INVALID_BOOL)},
    "pfedhn": {"embed_dim": optional(int_at_least(1, 4)), "hidden_dim": int_at_least(1, 8),
               "mlp_layers": int_at_least(0, 3), "server_lr": nonnegative_finite(), "embed_lr": optional(
                   nonnegative_finite()), "momentum": Option(between(0.0, 0.99), below(0.0) | above(1.0, True) | NAN),
               "weight_decay": nonnegative_finite(), "clip_norm": nonnegative_finite(),
               "embed_init_std": nonnegative_finite(), "init_seed": SEED64},
    "reptile": {"alpha": nonnegative_finite()},
    "scaffold": {},
}

#: (group, option) -> the exact change that would make an invalid value give a ValueError naming the option
#: before round 1, for a known gap not fixed yet. Each is an expected failure (strict): once the fix lands, its
#: XPASS fails here and the entry is removed.
KNOWN_GAPS: dict[tuple[str, str], str] = {}  # (group, option) -> the fix still owed; none today


# ----------------------------------------------------------------------------------------------
# the options from the signatures
# ----------------------------------------------------------------------------------------------
def _builtin_algorithms() -> list[str]:
    return sorted(e.name for e in list_algorithms() if e.builtin)


def _own_options(name: str) -> list[str]:
    params = inspect.signature(load_algorithm(name).__init__).parameters
    return [p for p in params if p != "self" and p not in COMMON_ARGS
            and params[p].kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]


def _signature_options() -> dict[str, list[str]]:
    module = [p for p in inspect.signature(FederatedModule.__init__).parameters if p != "self"]
    data = [p for p in inspect.signature(FederatedDataModule.__init__).parameters if p != "self"]
    options = {"module": module, "data": data, "common": list(COMMON_ARGS)}
    for name in _builtin_algorithms():
        options[f"algorithm:{name}"] = _own_options(name)
    return options


def _table(group: str) -> dict[str, Option]:
    if group == "module":
        return MODULE_OPTIONS
    if group == "data":
        return DATA_OPTIONS
    if group == "common":
        return COMMON_OPTIONS
    return ALGORITHM_OPTIONS.get(group.split(":", 1)[1], {})


def test_every_option_has_a_strategy() -> None:
    """Every option of the signatures has a row (valid and invalid strategies, or why it has no invalid value),
    and no row names an option that no longer exists."""
    missing, stale = [], []
    for group, names in _signature_options().items():
        table = _table(group)
        missing += [f"{group}.{n}" for n in names if n not in table]
        stale += [f"{group}.{n}" for n in table if n not in names]
    stale += [f"algorithm:{n}" for n in ALGORITHM_OPTIONS if n not in _builtin_algorithms()]
    assert not missing, f"options without a fuzzing strategy (add a row to the tables): {missing}"
    assert not stale, f"rows for options that no longer exist: {stale}"
    for group, names in _signature_options().items():
        for name in names:
            row = _table(group)[name]
            assert row.invalid is not None or row.no_invalid, f"{group}.{name}: an invalid strategy or a reason"


def _cases(invalid: bool) -> list[Any]:
    cases = []
    for group, names in _signature_options().items():
        for name in names:
            row = _table(group).get(name)
            if row is None:
                continue
            marks = []
            if invalid and (group, name) in KNOWN_GAPS:
                marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_GAPS[(group, name)]))
            cases.append(pytest.param(group, name, marks=marks, id=f"{group}.{name}"))
    return cases


# ----------------------------------------------------------------------------------------------
# construction and setup: everything a Trainer runs before round 1
# ----------------------------------------------------------------------------------------------
def _algorithm_spec(group: str, name: str, value: Any, row: Option) -> tuple[dict[str, Any], nn.Module]:
    if group == "common":
        return {"name": "fedavg", "local_steps": 1, "batch_size": 4, name: value}, tiny_linear()
    algorithm = group.split(":", 1)[1]
    base, make_model = ALGORITHM_BASES.get(algorithm, ({}, tiny_linear))
    spec = {"name": algorithm, **base, **row.base, name: value}
    if "local_steps" in inspect.signature(load_algorithm(algorithm).__init__).parameters:
        spec.setdefault("local_steps", 1)
    return {k: v for k, v in spec.items() if not (v is None and k in row.base)}, make_model()


def _set_up(group: str, name: str, value: Any) -> None:
    """Build and set up the object ``group.name = value`` belongs to, with every other option valid."""
    row = _table(group)[name]
    if group == "data":
        kwargs = {**DATA_BASE, **row.base, name: value}
        datamodule = FederatedDataModule(**kwargs)
        datamodule.setup("fit")
        module = FederatedModule(model=None, algorithm=MODULE_BASE["algorithm"], clients_per_round=1)
        module.attach_data(datamodule.federated_data)
        module.configure_optimizers()
        return
    if group == "module":
        kwargs = {"model": tiny_linear(), **MODULE_BASE, **row.base, name: value}
        if name == "model" and value is None:
            kwargs["model"] = None
    else:
        algorithm, model = _algorithm_spec(group, name, value, row)
        kwargs = {"model": model, **MODULE_BASE, "algorithm": algorithm}
    module = FederatedModule(**kwargs)
    module.attach_data(tiny_data(K))
    module.configure_optimizers()


@pytest.mark.parametrize("group, name", _cases(invalid=True))
@FUZZ
@given(data=st.data())
def test_an_invalid_value_is_refused_before_round_1_naming_the_option(group: str, name: str, data: Any) -> None:
    row = _table(group)[name]
    if row.invalid is None:
        return  # no invalid value exists (row.no_invalid says why)
    value = data.draw(row.invalid, label=f"{group}.{name}")
    with pytest.raises(row.errors) as info:
        _set_up(group, name, value)
    assert name in str(info.value), f"{group}.{name}={value!r} gave an error that does not name it: {info.value}"


@pytest.mark.parametrize("group, name", _cases(invalid=False))
@VALID
@given(data=st.data())
def test_a_valid_value_passes_setup(group: str, name: str, data: Any) -> None:
    row = _table(group)[name]
    if group == "data" and row.base.get("dataset") == "mnist":
        return  # the valid values of root are only read by image datasets (files this test does not have)
    _set_up(group, name, data.draw(row.valid, label=f"{group}.{name}"))
