"""Datasets and partitioners by name: the ``lightning_fedmeta.datasets`` and ``lightning_fedmeta.partitioners``
entry-point groups, and the built-ins registered in them (docs/plugins.md).

**A dataset** is a callable registered under its name; ``data.dataset: <name>`` calls it with keyword arguments
only, and returns either

* a :class:`~lightning_fedmeta.data.federated.FederatedData` or a
  :class:`~lightning_fedmeta.data.federated.FederatedDataset` (natural clients: the data brings its own split), or
* a :class:`LabeledPool` (centralised train and test rows with class labels): ``data.partition`` splits its train
  rows among the clients and each client gets test rows in its train class proportions (``test_split``).

Its parameters are filled by name: the **context** the data module knows (:data:`DATASET_CONTEXT`:
``num_clients``, ``seed`` (``data.data_seed``), ``root``, ``synthetic_alpha``, ``synthetic_beta``) and, for any
other parameter, ``data.dataset_options[<parameter>]`` (the dataset's own options; one it does not take is
refused). A dataset may set the attribute ``num_classes`` (an int, or ``None`` for regression) so the class count
is known before the data is built.

**A partitioner** is a callable registered under its name; ``data.partition: <name>`` calls it as
``partitioner(labels, **kwargs)`` with ``labels`` the pool's int64 train labels ``[N]`` and returns one int64 index
tensor (or array) per client, the clients' rows of the pool. The keyword arguments are filled by name from the
context (:data:`PARTITION_CONTEXT`: ``num_clients``, ``seed``, ``num_classes``, ``rng`` (the
``numpy.random.RandomState(data_seed)`` the test split then continues), and the data module's split options
``dirichlet_alpha``, ``classes_per_client``, ``samples_per_class``, ``max_samples_per_client``, ``balance``,
``min_client_samples``, ``max_retries``, ``partitioner``), then from ``data.partition_options``. Contract
(:func:`lightning_fedmeta.testing.check_partitioner`): exactly ``num_clients`` parts, disjoint, in range, a pure
function of ``seed`` (and ``rng``'s state).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_fedmeta.data.datasets import _load_pixels, _standardize
from lightning_fedmeta.data.federated import FederatedData, FederatedDataset, from_client_tensors
from lightning_fedmeta.data.leaf import LeafDataset
from lightning_fedmeta.data.more_datasets import MORE_DATASETS
from lightning_fedmeta.data.partition import cap_client_sizes, dirichlet, iid, perfedavg_paper, shards
from lightning_fedmeta.data.splits import dirichlet_min_size, flower_partition, pathological
from lightning_fedmeta.data.synthetic import make_synthetic
from lightning_fedmeta.data.synthetic_scale import make_synthetic_scale
from lightning_fedmeta.data.synthetic_tasks import (
    make_synthetic_multilabel,
    make_synthetic_next_token,
    make_synthetic_regression,
)
from lightning_fedmeta.registry import DATASETS, PARTITIONERS

__all__ = [
    "DATASET_CONTEXT",
    "PARTITION_CONTEXT",
    "LabeledPool",
    "build_dataset",
    "check_dataset_options",
    "check_partition_options",
    "dataset_num_classes",
    "load_dataset",
    "load_partitioner",
    "partition_labels",
]

#: what the data module passes a dataset, by parameter name
DATASET_CONTEXT: tuple[str, ...] = ("num_clients", "seed", "root", "synthetic_alpha", "synthetic_beta")
#: what the data module passes a partitioner besides the labels, by parameter name
PARTITION_CONTEXT: tuple[str, ...] = (
    "num_clients", "seed", "num_classes", "rng", "dirichlet_alpha", "classes_per_client", "samples_per_class",
    "max_samples_per_client", "balance", "min_client_samples", "max_retries", "partitioner",
)


@dataclass(frozen=True)
class LabeledPool:
    """Centralised rows with class labels, for ``data.partition`` to split.

    Attributes:
        train_x, test_x: ``[N, ...]`` inputs (tensors, or NumPy arrays such as read-only ``uint8`` views).
        train_y, test_y: int64 ``[N]`` class labels in ``[0, num_classes)``.
        num_classes: the number of classes.
        transform: applied to the rows a client gets (e.g. standardising ``uint8`` pixels); ``None``: as they are.
    """

    train_x: Tensor | np.ndarray
    train_y: Tensor
    test_x: Tensor | np.ndarray
    test_y: Tensor
    num_classes: int
    transform: Callable[[Tensor | np.ndarray], Tensor] | None = None


# ----------------------------------------------------------------------------------------------
# the built-in datasets (entry points of this distribution)
# ----------------------------------------------------------------------------------------------
def _with_classes(n: int | None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.num_classes = n  # type: ignore[attr-defined]
        return fn
    return mark


@_with_classes(10)
def synthetic(num_clients: int, seed: int, synthetic_alpha: float = 1.0, synthetic_beta: float = 1.0) -> FederatedData:
    """FedProx Synthetic(alpha, beta), natural clients, 10 classes (:func:`~lightning_fedmeta.data.make_synthetic`)."""
    return make_synthetic(synthetic_alpha, synthetic_beta, num_clients=num_clients, seed=seed)


@_with_classes(10)
def synthetic_scale(num_clients: int, seed: int, synthetic_alpha: float = 1.0,
                    synthetic_beta: float = 1.0) -> FederatedData:
    """Synthetic(alpha, beta) with power-law client sizes, generated in chunks (10^5 clients and more)."""
    return make_synthetic_scale(synthetic_alpha, synthetic_beta, num_clients=num_clients, seed=seed)


@_with_classes(None)
def synthetic_regression(num_clients: int, seed: int, synthetic_alpha: float = 1.0,
                         synthetic_beta: float = 1.0) -> FederatedData:
    """Synthetic(alpha, beta) inputs with scalar linear targets."""
    return make_synthetic_regression(synthetic_alpha, synthetic_beta, num_clients=num_clients, seed=seed)


@_with_classes(10)
def synthetic_multilabel(num_clients: int, seed: int, synthetic_alpha: float = 1.0,
                         synthetic_beta: float = 1.0) -> FederatedData:
    """Synthetic(alpha, beta) inputs with 10 thresholded linear labels."""
    return make_synthetic_multilabel(synthetic_alpha, synthetic_beta, num_clients=num_clients, seed=seed)


@_with_classes(16)
def synthetic_next_token(num_clients: int, seed: int) -> FederatedData:
    """Per-client Markov chains over 16 tokens, 20-token windows with next-token targets."""
    return make_synthetic_next_token(num_clients=num_clients, seed=seed)


class ImagePool:
    """A built-in image dataset read from files (torchvision's layout under ``root``), as a :class:`LabeledPool`
    of ``uint8`` pixels standardised per channel when a client gets them."""

    def __init__(self, name: str, num_classes: int) -> None:
        self.name, self.num_classes = name, num_classes
        self.__doc__ = f"The {name} image dataset ({num_classes} classes), split by data.partition."

    def __call__(self, root: str | None = None) -> LabeledPool:
        train_x, train_y, test_x, test_y = _load_pixels(self.name, root, download=False)
        return LabeledPool(train_x, train_y, test_x, test_y, self.num_classes,
                           partial(_standardize, name=self.name))


class Leaf:
    """A LEAF benchmark (``femnist``, ``shakespeare``): JSON files under ``root``, one client per LEAF user, the
    first ``num_clients`` users by id (:class:`~lightning_fedmeta.data.leaf.LeafDataset`)."""

    def __init__(self, kind: str, num_classes: int) -> None:
        self.kind, self.num_classes = kind, num_classes

    def __call__(self, num_clients: int, root: str | None = None) -> FederatedData:
        leaf = LeafDataset(root or "", kind=self.kind, max_clients=num_clients)  # type: ignore[arg-type]
        return from_client_tensors(leaf.client_data(), leaf.num_classes, leaf.client_names, leaf.task)


fashion_mnist = ImagePool("fashion_mnist", 10)
mnist = ImagePool("mnist", 10)
cifar10 = ImagePool("cifar10", 10)
_MORE = {name: ImagePool(name, n) for name, n in MORE_DATASETS.items()}
globals().update(_MORE)  # cifar100, emnist_<split>, tiny_imagenet: module attributes for their entry points


def _leaf(kind: str) -> Leaf:
    from lightning_fedmeta.data.leaf import ALL_LETTERS, FEMNIST_NUM_CLASSES

    return Leaf(kind, FEMNIST_NUM_CLASSES if kind == "femnist" else len(ALL_LETTERS))


femnist = _leaf("femnist")
shakespeare = _leaf("shakespeare")


# ----------------------------------------------------------------------------------------------
# the built-in partitioners (entry points of this distribution); each calls the split it names with exactly the
# arguments the data module always used, so the partitions do not move
# ----------------------------------------------------------------------------------------------
def iid_partition(labels: Tensor, num_clients: int, seed: int, max_samples_per_client: int | None = None
                  ) -> list[Tensor]:
    """Shuffled near-equal parts (:func:`~lightning_fedmeta.data.partition.iid`), capped per client."""
    return cap_client_sizes(iid(labels, num_clients, seed=seed), max_samples_per_client, seed)


def dirichlet_partition(labels: Tensor, num_clients: int, seed: int, dirichlet_alpha: float = 0.5,
                        max_samples_per_client: int | None = None) -> list[Tensor]:
    """Label skew ``Dir(dirichlet_alpha)`` (:func:`~lightning_fedmeta.data.partition.dirichlet`), capped."""
    parts = dirichlet(labels, num_clients, alpha=dirichlet_alpha, seed=seed)
    return cap_client_sizes(parts, max_samples_per_client, seed)


def shards_partition(labels: Tensor, num_clients: int, seed: int, classes_per_client: int = 2,
                     max_samples_per_client: int | None = None) -> list[Tensor]:
    """``classes_per_client`` label shards per client (:func:`~lightning_fedmeta.data.partition.shards`), capped."""
    parts = shards(labels, num_clients, classes_per_client=classes_per_client, seed=seed)
    return cap_client_sizes(parts, max_samples_per_client, seed)


def perfedavg_paper_partition(labels: Tensor, num_clients: int, seed: int, samples_per_class: int) -> list[Tensor]:
    """The Per-FedAvg paper's split (:func:`~lightning_fedmeta.data.partition.perfedavg_paper`)."""
    return perfedavg_paper(labels, num_clients, samples_per_class, seed)


def pathological_partition(labels: Tensor, num_clients: int, rng: np.random.RandomState, num_classes: int,
                           classes_per_client: int = 2, balance: bool = False,
                           min_client_samples: int | None = None) -> list[Tensor]:
    """PFLlib's ``pat`` (:func:`~lightning_fedmeta.data.splits.pathological`)."""
    found = pathological(labels, num_clients, classes_per_client, balance, min_client_samples, rng, num_classes)
    return [torch.as_tensor(p, dtype=torch.long) for p in found]


def dirichlet_min_size_partition(labels: Tensor, num_clients: int, rng: np.random.RandomState, num_classes: int,
                                 dirichlet_alpha: float = 0.5, min_client_samples: int | None = None,
                                 max_retries: int = 100) -> list[Tensor]:
    """PFLlib's ``dir`` (:func:`~lightning_fedmeta.data.splits.dirichlet_min_size`)."""
    found = dirichlet_min_size(labels, num_clients, dirichlet_alpha, min_client_samples, max_retries, rng,
                               num_classes)
    return [torch.as_tensor(p, dtype=torch.long) for p in found]


def flower_partitioner(labels: Tensor, num_clients: int, partitioner: Any) -> list[Tensor]:
    """A Flower Datasets partitioner (``data.partitioner``) used as-is (:func:`~lightning_fedmeta.data.splits.
    flower_partition`); its ``num_partitions`` must be ``data.num_clients``."""
    found = flower_partition(partitioner, labels)
    if len(found) != num_clients:
        raise ValueError(f"the Flower partitioner has num_partitions={len(found)} but data.num_clients="
                         f"{num_clients}; set them equal")
    return [torch.as_tensor(p, dtype=torch.long) for p in found]


# ----------------------------------------------------------------------------------------------
# calling them
# ----------------------------------------------------------------------------------------------
def _parameters(fn: Callable[..., Any]) -> tuple[list[str], bool, list[str]]:
    """``fn``'s keyword-passable parameter names, whether it takes ``**kwargs``, and the required ones."""
    target = fn if not inspect.isclass(fn) else fn.__init__
    params = list(inspect.signature(target).parameters.values())
    if params and params[0].name == "self":
        params = params[1:]
    names = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    required = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD,
                                                                                p.KEYWORD_ONLY)]
    return names, any(p.kind is p.VAR_KEYWORD for p in params), required


def _arguments(kind: str, name: str, fn: Callable[..., Any], context: Mapping[str, Any],
               options: Mapping[str, Any] | None, option: str, skip: Sequence[str] = ()) -> dict[str, Any]:
    """The keyword arguments of ``fn``: its context parameters from ``context``, the rest from ``options``.

    Refused: an option that names a context parameter (set it through its own ``data.*`` setting), an option
    ``fn`` does not take, and a required parameter nobody gives."""
    options = dict(options or {})
    names, var_kw, required = _parameters(fn)
    names = [n for n in names if n not in skip]
    shadow = [k for k in options if k in context]
    if shadow:
        raise ValueError(f"{option}: {', '.join(map(repr, shadow))} are set by data.* settings "
                         f"(data.{'data_seed' if shadow[0] == 'seed' else shadow[0]}), not here")
    unknown = [k for k in options if k not in names]
    if unknown and not var_kw:
        own = [n for n in names if n not in context]
        raise ValueError(f"{kind} {name!r} has no option(s) {', '.join(map(repr, unknown))} ({option}); "
                         f"accepted: {', '.join(own) or '(none)'}")
    missing = [n for n in required if n not in skip and n not in context and n not in options]
    if missing:
        raise ValueError(f"{kind} {name!r} needs {option}.{missing[0]}"
                         + (f" (and {', '.join(missing[1:])})" if missing[1:] else ""))
    return {**{n: context[n] for n in names if n in context}, **options}


def _load(registry: Any, kind: str, name: str, builtins: Sequence[str]) -> Callable[..., Any]:
    """The plugin registered as ``name``; ``ValueError`` listing the installed names (built-ins first) when none
    is, ``ImportError`` naming the distribution when it fails to import."""
    try:
        entry = registry.resolve(name)
    except ValueError:
        if not any(e.builtin for e in registry.list()):  # stale metadata: the registry's message says so
            raise
        installed = [*builtins, *(n for n in registry.names() if n not in builtins)]
        raise ValueError(f"unknown {kind} {name!r}; choose one of {installed}") from None
    return registry.load_entry(entry)


def load_dataset(name: str) -> Callable[..., Any]:
    """The dataset registered as ``name`` (``ValueError`` listing the installed ones when there is none)."""
    from lightning_fedmeta.data.datamodule import DATASET_NAMES

    return _load(DATASETS, "dataset", name, DATASET_NAMES)


def load_partitioner(name: str) -> Callable[..., Any]:
    """The partitioner registered as ``name`` (``ValueError`` listing the installed ones when there is none)."""
    from lightning_fedmeta.data.datamodule import PARTITION_NAMES

    return _load(PARTITIONERS, "partition", name, PARTITION_NAMES)


def check_dataset_options(name: str, options: Mapping[str, Any] | None) -> None:
    """Refuse an unknown dataset (listing the installed ones), one whose package fails to import (naming it) and
    ``data.dataset_options`` it does not take."""
    fn = load_dataset(name)
    _arguments("dataset", name, fn, dict.fromkeys(DATASET_CONTEXT), options, "data.dataset_options")


def check_partition_options(name: str, options: Mapping[str, Any] | None) -> None:
    """Refuse an unknown partitioner (listing the installed ones), one whose package fails to import (naming it)
    and ``data.partition_options`` it does not take."""
    fn = load_partitioner(name)
    _arguments("partitioner", name, fn, dict.fromkeys(PARTITION_CONTEXT), options, "data.partition_options",
               skip=_first(fn))


def _first(fn: Callable[..., Any]) -> tuple[str, ...]:
    names, _, _ = _parameters(fn)
    return tuple(names[:1])


def dataset_num_classes(name: str) -> tuple[bool, int | None]:
    """``(known, n)``: the class count a dataset declares (its ``num_classes`` attribute) before it is built."""
    fn = load_dataset(name)
    if not hasattr(fn, "num_classes"):
        return False, None
    n = fn.num_classes
    return True, None if n is None else int(n)


def build_dataset(name: str, context: Mapping[str, Any], options: Mapping[str, Any] | None
                  ) -> FederatedData | FederatedDataset | LabeledPool:
    """Call the dataset registered as ``name`` with its context and options; check what it returns."""
    fn = load_dataset(name)
    out = fn(**_arguments("dataset", name, fn, context, options, "data.dataset_options"))
    if not isinstance(out, FederatedData | LabeledPool | FederatedDataset):
        raise TypeError(f"dataset {name!r} returned {type(out).__name__}; a dataset returns a FederatedData, a "
                        "FederatedDataset or a LabeledPool (lightning_fedmeta.data.plugins)")
    return out


def partition_labels(name: str, labels: Tensor, context: Mapping[str, Any], options: Mapping[str, Any] | None
                     ) -> list[Tensor]:
    """The partitioner registered as ``name`` on ``labels``: one int64 index tensor per client, checked
    (``num_clients`` parts, indices in range, no row given twice)."""
    fn = load_partitioner(name)
    parts = fn(labels, **_arguments("partitioner", name, fn, context, options, "data.partition_options",
                                    skip=_first(fn)))
    return check_parts(name, parts, int(labels.shape[0]), int(context["num_clients"]))


def check_parts(name: str, parts: Any, n: int, num_clients: int) -> list[Tensor]:
    """``parts`` as int64 tensors, or a ``ValueError`` saying how they break the partitioner contract."""
    if not isinstance(parts, Sequence) or isinstance(parts, str | bytes):
        raise ValueError(f"partitioner {name!r} returned {type(parts).__name__}; expected a list of index tensors")
    if len(parts) != num_clients:
        raise ValueError(f"partitioner {name!r} returned {len(parts)} parts for num_clients={num_clients}")
    out = []
    for i, p in enumerate(parts):
        t = torch.as_tensor(np.asarray(p) if not isinstance(p, Tensor) else p)
        if t.dim() != 1 or (t.numel() and (t.dtype.is_floating_point or t.dtype == torch.bool)):
            raise ValueError(f"partitioner {name!r}: part {i} is not a 1-D integer index tensor "
                             f"(shape {tuple(t.shape)}, {t.dtype})")
        t = t.to(torch.long)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= n):
            raise ValueError(f"partitioner {name!r}: part {i} has indices outside [0, {n})")
        out.append(t)
    joined = torch.cat(out) if out else torch.zeros(0, dtype=torch.long)
    if joined.numel() != joined.unique().numel():
        raise ValueError(f"partitioner {name!r} gives some rows to more than one client (or twice to one)")
    return out


def canonical_options(kind: str, name: Any, options: Mapping[str, Any] | None) -> Any:
    """``options`` of the dataset or partitioner (``kind``) registered as ``name``, with the defaults of its
    signature filled in, so that settings that mean the same compare equal (the checkpoint resume check); as given
    when ``name`` is not a registered name or the plugin cannot be loaded."""
    if not isinstance(name, str) or (options is not None and not isinstance(options, Mapping)):
        return options
    try:
        fn = load_dataset(name) if kind == "dataset" else load_partitioner(name)
    except (ValueError, ImportError, TypeError):
        return options
    context = DATASET_CONTEXT if kind == "dataset" else PARTITION_CONTEXT
    skip = () if kind == "dataset" else _first(fn)
    target = fn if not inspect.isclass(fn) else fn.__init__
    params = [p for p in inspect.signature(target).parameters.values()
              if p.name not in ("self", *context, *skip) and p.default is not p.empty
              and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return {**{p.name: p.default for p in params}, **dict(options or {})}
