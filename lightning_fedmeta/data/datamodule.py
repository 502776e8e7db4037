"""``FederatedDataModule``: builds the clients' data and drives communication rounds.

The module does not serve mini-batches. It builds one :class:`FederatedData` (all clients'
tensors, kept on CPU) that the federated LightningModule reads from
``trainer.datamodule.federated_data``; the dataloaders only yield round counters:

* ``train_dataloader()`` yields one item per communication round (one round per training step) up
  to the next evaluation: the next multiple of ``eval_every``, or ``trainer.max_steps`` when that
  comes first. One Lightning training epoch is thus ``eval_every`` rounds, validation (which
  Lightning runs at epoch end) happens after every multiple of ``eval_every`` and after the final
  round, and a run resumed between two evaluations keeps the same schedule
  (:func:`rounds_until_evaluation`);
* ``val_dataloader()`` / ``test_dataloader()`` yield one item: a single evaluation step in which
  the module evaluates every client.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from lightning_fedmeta.data.datasets import (
    DEFAULT_FASHION_MNIST_ROOT,
    IMAGE_DATASETS,
    download_dataset,
    has_dataset_files,
)
from lightning_fedmeta.data.federated import FederatedData, FederatedDataset, from_client_tensors
from lightning_fedmeta.data.leaf import ALL_LETTERS, FEMNIST_NUM_CLASSES, LEAF_KINDS
from lightning_fedmeta.data.more_datasets import MORE_DATASETS
from lightning_fedmeta.data.partition import PERFEDAVG_SAMPLES_PER_CLASS, matching_test_split
from lightning_fedmeta.data.plugins import (
    LabeledPool,
    build_dataset,
    check_dataset_options,
    check_partition_options,
    dataset_num_classes,
    partition_labels,
)
from lightning_fedmeta.data.splits import PFLLIB_TRAIN_RATIO, per_client_train_test
from lightning_fedmeta.data.validation_split import validation_split

__all__ = [
    "DATASET_NAMES",
    "PARTITION_NAMES",
    "FederatedDataModule",
    "RoundCounter",
    "TrainingRounds",
    "rounds_until_evaluation",
]

# The built-in names below are entry points of this distribution (``lightning_fedmeta.datasets`` and
# ``lightning_fedmeta.partitioners``, lightning_fedmeta.data.plugins); installed packages add their own.
#: Embedded synthetic benchmarks, one per task kind (made in code from ``data_seed``).
SYNTHETIC_DATASETS: tuple[str, ...] = (
    "synthetic", "synthetic_regression", "synthetic_multilabel", "synthetic_next_token", "synthetic_scale",
)
#: Federated text read from files under ``root`` (:mod:`~lightning_fedmeta.data.text_clients`).
TEXT_DATASETS: tuple[str, ...] = ("text_jsonl",)
DATASET_NAMES: tuple[str, ...] = (*SYNTHETIC_DATASETS, *IMAGE_DATASETS, *LEAF_KINDS, *TEXT_DATASETS)
PARTITION_NAMES: tuple[str, ...] = (
    "iid", "dirichlet", "shards", "perfedavg_paper", "pathological", "dirichlet_min_size", "flower",
)
#: How an image dataset's clients get test rows: ``matching`` (from the test pool, :func:`matching_test_split`) or
#: ``per_client`` (train and test pools merged, split, then each client's rows split at ``train_fraction``).
TEST_SPLITS: tuple[str, ...] = ("matching", "per_client")
_NUM_CLASSES: dict[str, int | None] = {
    "synthetic": 10, "synthetic_scale": 10, "synthetic_regression": None, "synthetic_multilabel": 10,
    "synthetic_next_token": 16,
    "fashion_mnist": 10, "mnist": 10, "cifar10": 10, **MORE_DATASETS,
    "femnist": FEMNIST_NUM_CLASSES, "shakespeare": len(ALL_LETTERS),
}


class RoundCounter(IterableDataset):
    """Yields ``torch.tensor(0) .. torch.tensor(n - 1)``: one token per step (the loop ignores their values).

    Deliberately has no ``__len__`` (Lightning warns about ``__len__`` on an ``IterableDataset``).
    """

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = int(n)

    def __iter__(self) -> Iterator[Tensor]:
        return (torch.tensor(i) for i in range(self.n))


def rounds_until_evaluation(done: int, eval_every: int, max_steps: int | None) -> int:
    """Rounds to train from ``done`` completed rounds until the next evaluation.

    Evaluations follow every round that is a multiple of ``eval_every`` and the final round
    ``max_steps`` (``None`` or ``-1``: no limit), whatever round a run was started or resumed at.
    """
    n = eval_every - done % eval_every
    if max_steps is not None and max_steps >= 0:
        n = min(n, max_steps - done)
    return max(n, 0)


class TrainingRounds(IterableDataset):
    """The training tokens of one epoch: one per round from the current one to the next evaluation.

    Each ``iter()`` (Lightning calls it once per epoch, after a checkpoint is restored) asks
    ``progress()`` for ``(completed rounds r, max_steps)`` and yields
    ``n = rounds_until_evaluation(r, eval_every, max_steps)`` tokens, each the round's position
    ``(r + i) % eval_every`` within its evaluation interval (Lightning's ``batch_idx``; the module
    ignores the values). Lightning runs validation after the last item, so the epoch
    ends exactly at the next multiple of ``eval_every`` or at ``max_steps``. Under DDP every rank
    reads the same global step and ``max_steps``, so the ranks agree on the count.

    Deliberately has no ``__len__``: its length changes from epoch to epoch, and Lightning takes an
    ``IterableDataset`` without a length as "ends when the iterator does".

    Args:
        eval_every: rounds between evaluations.
        progress: returns ``(completed rounds, max_steps)``; ``None`` (no trainer) gives whole
            epochs of ``eval_every`` rounds from round 0.
    """

    def __init__(self, eval_every: int, progress: Callable[[], tuple[int, int | None]] | None = None) -> None:
        super().__init__()
        self.eval_every = int(eval_every)
        self.progress = progress

    def __iter__(self) -> Iterator[Tensor]:
        done, max_steps = self.progress() if self.progress is not None else (0, None)
        n = rounds_until_evaluation(done, self.eval_every, max_steps)
        return (torch.tensor((done + i) % self.eval_every) for i in range(n))


class FederatedDataModule(L.LightningDataModule):
    """Clients' data for personalized federated learning.

    Args:
        dataset: ``"synthetic"`` (FedProx Synthetic(alpha, beta), natural clients, 10 classes),
            ``"synthetic_regression"`` (the same inputs, scalar linear targets),
            ``"synthetic_multilabel"`` (10 thresholded linear labels), ``"synthetic_next_token"``
            (per-client Markov chains over 16 tokens, 20-token windows with next-token targets),
            ``"synthetic_scale"`` (Synthetic(alpha, beta) with power-law client sizes, generated in chunks for
            10^5 clients and more: :mod:`~lightning_fedmeta.data.synthetic_scale`),
            ``"fashion_mnist"``, ``"mnist"``, ``"cifar10"``, or an object following the
            :class:`FederatedDataset` protocol (``num_classes`` and ``client_data()``; e.g.
            :class:`~lightning_fedmeta.data.leaf.LeafDataset` for LEAF JSON files, or
            :class:`~lightning_fedmeta.data.lightning_adapter.LightningDataPartition` around your own
            ``LightningDataModule``), or a :class:`~lightning_fedmeta.data.plugins.LabeledPool` (centralised rows
            split by ``partition``). A dataset registered by an installed package
            (``lightning_fedmeta.datasets`` entry points) is chosen by its name too. Also read from files under
            ``root``: ``"cifar100"``, ``"emnist_<split>"``
            (``balanced``, ``byclass``, ``bymerge``, ``letters``, ``digits``, ``mnist``), ``"tiny_imagenet"``
            (:mod:`~lightning_fedmeta.data.more_datasets`), and LEAF's ``"femnist"`` and ``"shakespeare"`` (JSON
            files, one client per LEAF user, the first ``num_clients`` users by id:
            :class:`~lightning_fedmeta.data.leaf.LeafDataset`), and ``"text_jsonl"``: federated text, one
            ``<client>.jsonl`` file per client in ``root`` (or ``root`` one ``.jsonl``/``.csv`` table with a client
            column), tokenised by the tokenizer in ``dataset_options`` into next-token windows
            (:mod:`~lightning_fedmeta.data.text_clients`; ``partition`` does not apply).
        root: data folder. Fashion-MNIST defaults to ``/usr/share/datasets/fashion-mnist``
            (Debian package ``dataset-fashion-mnist``); MNIST and CIFAR-10 need it.
        download: fetch missing image files with torchvision into ``root`` in ``prepare_data``.
        partition: how an image dataset's train set is split (``"pathological"``: PFLlib's ``pat``,
            ``"dirichlet_min_size"``: PFLlib's ``dir``, ``"flower"``: a Flower Datasets partitioner; or) ``"iid"``,
            ``"dirichlet"``
            (label skew, Dir(``dirichlet_alpha``)), ``"shards"`` (``classes_per_client`` label
            shards per client) or ``"perfedavg_paper"`` (the Per-FedAvg paper's split with
            ``a = samples_per_class``). Ignored for the synthetic datasets and user datasets, except a
            :class:`~lightning_fedmeta.data.lightning_adapter.LightningDataPartition`, which splits with this
            module's ``num_clients``, ``partition``, ``dirichlet_alpha``, ``classes_per_client``,
            ``max_samples_per_client`` and ``data_seed``.
        num_clients: number of clients ``K >= 1`` (the paper split of Per-FedAvg uses 50).
        dirichlet_alpha: concentration ``alpha > 0`` of the Dirichlet partition; smaller is more skewed.
        classes_per_client: shards per client for ``"shards"``, in ``[1, 10]``.
        samples_per_class: ``a`` of ``"perfedavg_paper"``, ``>= 2`` (default 196, the paper's MNIST value).
        max_samples_per_client: optional cap on each client's train samples for ``"iid"``,
            ``"dirichlet"`` and ``"shards"`` (a random subset is kept); ``None`` for no cap.
        balance: ``"pathological"`` (PFLlib's ``pat``): equal shares of each class (``True``) or random ones.
        min_client_samples: ``"pathological"``/``"dirichlet_min_size"``: PFLlib's ``least_samples`` (``None``:
            ``int(min(40, N / K / 2))``, PFLlib's value; :mod:`~lightning_fedmeta.data.splits`).
        max_retries: ``"dirichlet_min_size"`` redraws at most this many times, then raises.
        test_split: ``"matching"`` (default) or ``"per_client"``: merge the train and test pools, partition them,
            and split each client's rows at random, ``train_fraction`` for training (PFLlib's protocol).
        train_fraction: the training share of ``"per_client"`` (PFLlib's ``train_ratio`` 0.75).
        partitioner: with ``partition: flower``, a ``flwr_datasets.partitioner`` object (YAML ``class_path``),
            used as-is on the labels (:func:`~lightning_fedmeta.data.splits.flower_partition`).
        dataset_options: the own options of a dataset registered by a package (``lightning_fedmeta.datasets``
            entry points, :mod:`~lightning_fedmeta.data.plugins`), checked against its signature; ``None``: none.
        partition_options: the own options of a partitioner registered by a package
            (``lightning_fedmeta.partitioners``), checked against its signature; ``None``: none.
        synthetic_alpha: model heterogeneity ``alpha >= 0`` of Synthetic(alpha, beta) (and of the
            regression and multi-label variants).
        synthetic_beta: input heterogeneity ``beta >= 0`` of Synthetic(alpha, beta) (and variants).
        eval_every: communication rounds per training epoch (validation runs after each, and after
            the final round), ``>= 1``.
        data_seed: seed of the partition, the test split, the validation split and the synthetic generator.
        validation_fraction: ``0`` (default) evaluates on the clients' test sets. ``f`` in ``(0, 1)``
            holds out ``round(f · n_i)`` (at least 1, at most ``n_i − 1``) of each client's training
            samples and evaluates on them instead, never reading the test set: for choosing
            hyper-parameters (:func:`~lightning_fedmeta.data.validation_split.validation_split`).
        eval_clients: ``None`` (default) scores every client at every evaluation. ``N >= 1``: each validation
            scores the same seeded sample of ``N`` clients (training and held-out clients in proportion to their
            numbers, drawn from ``model.seed``: :meth:`FederatedModule.evaluation_clients
            <lightning_fedmeta.FederatedModule.evaluation_clients>`), logged once; ``test`` still scores every
            client. For large populations (docs/scale.md).

    Each client's test set: for ``"synthetic"``, 10% of the client's own samples (as FedProx); for
    image datasets, drawn from the dataset's test set with the client's train class proportions
    (:func:`matching_test_split`); for user datasets, what ``client_data()`` returns.
    """

    def __init__(
        self,
        dataset: str | FederatedDataset | LabeledPool = "synthetic",
        root: str | None = None,
        download: bool = False,
        partition: str = "iid",
        num_clients: int = 30,
        dirichlet_alpha: float = 0.5,
        classes_per_client: int = 2,
        samples_per_class: int = PERFEDAVG_SAMPLES_PER_CLASS,
        max_samples_per_client: int | None = None,
        synthetic_alpha: float = 1.0,
        synthetic_beta: float = 1.0,
        eval_every: int = 10,
        data_seed: int = 0,
        validation_fraction: float = 0.0,
        eval_clients: int | None = None,
        balance: bool = False,
        min_client_samples: int | None = None,
        max_retries: int = 100,
        test_split: str = "matching",
        train_fraction: float = PFLLIB_TRAIN_RATIO,
        partitioner: Any = None,
        dataset_options: dict[str, Any] | None = None,
        partition_options: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        _check_dataset(dataset, dataset_options)
        _check_partition_options(
            dataset, partition, num_clients, dirichlet_alpha, classes_per_client, samples_per_class,
            max_samples_per_client, partition_options,
        )
        _check_split_options(partition, balance, min_client_samples, max_retries, test_split, train_fraction,
                             partitioner)
        _check_int("data_seed", data_seed, 0)
        _check_synthetic_options(synthetic_alpha, synthetic_beta)
        _check_evaluation_options(eval_every, validation_fraction, eval_clients)
        _check_root(dataset, root)
        _share_split_options(dataset, {
            "num_clients": num_clients, "partition": partition, "dirichlet_alpha": dirichlet_alpha,
            "classes_per_client": classes_per_client, "seed": data_seed,
            "max_samples_per_client": max_samples_per_client,
        })

        self.dataset = dataset
        self.root = root
        self.download = download
        self.partition = partition
        self.num_clients = num_clients
        self.dirichlet_alpha = dirichlet_alpha
        self.classes_per_client = classes_per_client
        self.samples_per_class = samples_per_class
        self.max_samples_per_client = max_samples_per_client
        self.synthetic_alpha = synthetic_alpha
        self.synthetic_beta = synthetic_beta
        self.eval_every = eval_every
        self.seed = data_seed
        self.validation_fraction = float(validation_fraction)
        self.eval_clients = eval_clients
        self.balance, self.min_client_samples, self.max_retries = balance, min_client_samples, max_retries
        self.test_split, self.train_fraction, self.partitioner = test_split, float(train_fraction), partitioner
        self.dataset_options, self.partition_options = dict(dataset_options or {}), dict(partition_options or {})
        self.federated_data: FederatedData | None = None
        ignored = ([] if isinstance(dataset, str) else ["dataset"]) + ([] if partitioner is None else ["partitioner"])
        self.save_hyperparameters(ignore=ignored or None)

    @property
    def num_classes(self) -> int | None:
        """Number of label classes (known before ``setup``; ``None`` for regression)."""
        if self.federated_data is not None:
            return self.federated_data.num_classes
        if isinstance(self.dataset, LabeledPool):
            return int(self.dataset.num_classes)
        if isinstance(self.dataset, str):
            if self.dataset in _NUM_CLASSES:
                return _NUM_CLASSES[self.dataset]
            known, declared = dataset_num_classes(self.dataset)
            if known:
                return declared
            self.setup()  # a plugin dataset that does not declare num_classes: build it to know
            assert self.federated_data is not None
            return self.federated_data.num_classes
        n = self.dataset.num_classes
        return None if n is None else int(n)

    def prepare_data(self) -> None:
        """Download the image files with torchvision when ``download=True`` (rank 0 only)."""
        if not (self.download and isinstance(self.dataset, str) and self.dataset in IMAGE_DATASETS):
            return
        if self.dataset == "fashion_mnist" and self.root is None:
            if has_dataset_files("fashion_mnist", DEFAULT_FASHION_MNIST_ROOT):
                return  # the Debian package's files are there; nothing to download
        download_dataset(self.dataset, self.root)  # raises ValueError for root=None

    def setup(self, stage: str | None = None) -> None:
        """Build ``self.federated_data`` once (later calls reuse it) and log per-client sizes."""
        if self.federated_data is not None:
            return
        data = self._build()
        if self.validation_fraction > 0:
            data = validation_split(data, self.validation_fraction, self.seed)
        data.check_no_empty_client()
        self.federated_data = data
        rank_zero_info(_summary(data, self._describe()))
        if self.validation_fraction > 0:
            rank_zero_info(
                f"FederatedDataModule: validation_fraction={self.validation_fraction:g}: every evaluation uses "
                "the validation split of each client's training data (the 'test' counts above); the test "
                "set is not read"
            )

    def _describe(self) -> str:
        if isinstance(self.dataset, LabeledPool):
            return f"LabeledPool of {len(self.dataset.train_y)} rows, partition={self.partition}"
        if not isinstance(self.dataset, str):
            return f"{type(self.dataset).__name__} (user dataset)"
        if self.dataset in ("synthetic_next_token", *LEAF_KINDS):
            return self.dataset
        if self.dataset in TEXT_DATASETS:
            options = "".join(f", {k}={v!r}" for k, v in self.dataset_options.items())
            return f"{self.dataset}(root={self.root!r}{options})"
        if self.dataset in SYNTHETIC_DATASETS:
            return f"{self.dataset}({self.synthetic_alpha}, {self.synthetic_beta})"
        if self.dataset not in DATASET_NAMES:
            options = "".join(f", {k}={v!r}" for k, v in self.dataset_options.items())
            return f"{self.dataset} (plugin{options}), partition={self.partition}"
        if self.test_split == "per_client":
            return f"{self.dataset}, partition={self.partition}, per-client split {self.train_fraction:g} train"
        return f"{self.dataset}, partition={self.partition}"

    def _build(self) -> FederatedData:
        if isinstance(self.dataset, LabeledPool):
            return self._build_pool(self.dataset)
        if not isinstance(self.dataset, str):
            names = getattr(self.dataset, "client_names", None)
            task = getattr(self.dataset, "task", None)
            return from_client_tensors(self.dataset.client_data(), self.dataset.num_classes, names, task)
        context = {"num_clients": self.num_clients, "seed": self.seed, "root": self.root,
                   "synthetic_alpha": self.synthetic_alpha, "synthetic_beta": self.synthetic_beta}
        built = build_dataset(self.dataset, context, self.dataset_options)
        if isinstance(built, LabeledPool):
            return self._build_pool(built)
        if isinstance(built, FederatedData):
            return built
        names, task = getattr(built, "client_names", None), getattr(built, "task", None)
        return from_client_tensors(built.client_data(), built.num_classes, names, task)

    def _build_pool(self, pool: LabeledPool) -> FederatedData:
        """Partition a pool's rows and give each client test rows (``test_split``)."""
        train_x, train_y, test_x, test_y = pool.train_x, pool.train_y, pool.test_x, pool.test_y
        num_classes, transform = int(pool.num_classes), pool.transform
        rng = np.random.RandomState(self.seed)  # one stream for partition then split, as PFLlib's scripts
        if self.test_split == "per_client":  # PFLlib: merge the pools, partition, split every client's rows
            pool_x = (np.concatenate([train_x, test_x]) if isinstance(train_x, np.ndarray)
                      else torch.cat([train_x, test_x]))  # type: ignore[list-item]
            pool_y = torch.cat([train_y, test_y])
            parts = self._partition(pool_y, num_classes, rng)
            train_parts, test_parts = per_client_train_test(parts, self.train_fraction, rng)
            return _gather(pool_x, pool_y, train_parts, pool_x, pool_y, test_parts, num_classes, transform=transform)
        parts = self._partition(train_y, num_classes, rng)
        test_parts = matching_test_split([train_y[p] for p in parts], test_y, self.seed)
        return _gather(train_x, train_y, parts, test_x, test_y, test_parts, num_classes, transform=transform)

    def _partition(self, y: Tensor, num_classes: int, rng: np.random.RandomState) -> list[Tensor]:
        """``self.partition`` of the labels ``y``: one int64 index tensor per client (the partitioner registered
        under that name, :func:`~lightning_fedmeta.data.plugins.partition_labels`)."""
        context = {
            "num_clients": self.num_clients, "seed": self.seed, "num_classes": num_classes, "rng": rng,
            "dirichlet_alpha": self.dirichlet_alpha, "classes_per_client": self.classes_per_client,
            "samples_per_class": self.samples_per_class, "max_samples_per_client": self.max_samples_per_client,
            "balance": self.balance, "min_client_samples": self.min_client_samples, "max_retries": self.max_retries,
            "partitioner": self.partitioner,
        }
        return partition_labels(self.partition, y, context, self.partition_options)

    @classmethod
    def load_from_checkpoint(  # type: ignore[override]
        cls, checkpoint_path: Any, map_location: Any = None, hparams_file: Any = None, weights_only: bool | None = None,
        **kwargs: Any,
    ) -> FederatedDataModule:
        """The datamodule a checkpoint was trained with, read as data only (docs/security.md): the file is read with
        ``torch.load(weights_only=True)`` (URLs too; ``weights_only=False`` is refused), and a saved setting that
        names a folder or code (``root``, a dataset class) is taken only when passed again as a keyword argument
        (``root=...``); ``hparams_file`` (a YAML file of your choosing) replaces the saved settings."""
        from lightning_fedmeta.persistence.safe_loading import (
            CheckpointSettingsError,
            code_or_path_settings,
            load_checkpoint_file,
            refuse_unsafe_load,
            signature_defaults,
        )

        refuse_unsafe_load(weights_only, checkpoint_path)
        checkpoint = load_checkpoint_file(checkpoint_path, map_location or "cpu", weights_only=True)
        saved = dict(checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_KEY) or {})
        if hparams_file is not None:
            import yaml

            with open(hparams_file, encoding="utf-8") as f:
                saved = dict(yaml.safe_load(f) or {})
        defaults = signature_defaults(cls)
        taken = {k: v for k, v in saved.items() if k not in kwargs and not (k in defaults and defaults[k] == v)}
        refused = code_or_path_settings("data", taken)
        if refused:
            raise CheckpointSettingsError(
                f"{os.fspath(checkpoint_path) if isinstance(checkpoint_path, str | os.PathLike) else checkpoint_path}"
                f" names {', '.join(refused)}: a checkpoint is data and may not choose a folder or code to read; pass "
                f"the setting again (FederatedDataModule.load_from_checkpoint(path, root=...)) if you trust it"
            )
        return cls(**{**saved, **kwargs})

    def train_dataloader(self) -> DataLoader:
        """One token per communication round up to the next evaluation (:class:`TrainingRounds`):
        ``eval_every`` rounds, fewer when ``trainer.max_steps`` or a resumed round comes in between.

        An ``IterableDataset`` is not given a ``DistributedSampler`` by Lightning, so under DDP
        every rank iterates all items (the rounds are not sharded across ranks).
        """
        return DataLoader(TrainingRounds(self.eval_every, self._training_progress), batch_size=None)

    def _training_progress(self) -> tuple[int, int | None]:
        """``(global_step, max_steps)`` of the attached trainer; ``(0, None)`` without one."""
        trainer = self.trainer
        if trainer is None:
            return 0, None
        return int(trainer.global_step), trainer.max_steps

    def val_dataloader(self) -> DataLoader:
        """One token: a single validation step that evaluates all clients."""
        return DataLoader(RoundCounter(1), batch_size=None)

    def test_dataloader(self) -> DataLoader:
        """One token: a single test step that evaluates all clients."""
        return DataLoader(RoundCounter(1), batch_size=None)


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    """Raise ``ValueError`` unless ``value`` is an ``int`` (not ``bool``) in ``[low, high]``."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= low:
        if high is None or value <= high:
            return
    allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
    raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")


def _check_dataset(dataset: str | FederatedDataset, options: dict[str, Any] | None) -> None:
    """Raise ``ValueError`` unless ``dataset`` is a registered name (built-in or a plugin's, taking
    ``dataset_options``) or a :class:`FederatedDataset`."""
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"data.dataset_options must be a mapping of the dataset's options, got {options!r}")
    if isinstance(dataset, str):
        check_dataset_options(dataset, options)
    elif options:
        raise ValueError("data.dataset_options apply to a dataset chosen by name, not to a dataset object")
    elif isinstance(dataset, LabeledPool):
        return
    elif not isinstance(dataset, FederatedDataset):
        raise ValueError(
            f"dataset must be one of {list(DATASET_NAMES)} or an object with `num_classes` and "
            f"`client_data()`, got {type(dataset).__name__}"
        )


def _check_partition_options(
    dataset: str | FederatedDataset, partition: str, num_clients: int, dirichlet_alpha: float,
    classes_per_client: int, samples_per_class: int, max_samples_per_client: int | None,
    partition_options: dict[str, Any] | None = None,
) -> None:
    """Raise ``ValueError`` for a partition option of :class:`FederatedDataModule` outside its range (an unknown
    partition lists the installed ones; ``partition_options`` must be options the partitioner takes)."""
    if partition_options is not None and not isinstance(partition_options, dict):
        raise ValueError(f"data.partition_options must be a mapping of the partitioner's options, "
                         f"got {partition_options!r}")
    check_partition_options(partition, partition_options)
    _check_int("num_clients", num_clients, 1)
    if not dirichlet_alpha > 0:
        raise ValueError(f"dirichlet_alpha must be > 0, got {dirichlet_alpha!r}")
    max_classes = None
    if isinstance(dataset, str) and dataset in IMAGE_DATASETS:
        max_classes = _NUM_CLASSES[dataset]
    _check_int("classes_per_client", classes_per_client, 1, max_classes)
    _check_int("samples_per_class", samples_per_class, 2)
    if max_samples_per_client is not None:
        _check_int("max_samples_per_client", max_samples_per_client, 1)


def _check_split_options(
    partition: str, balance: bool, min_client_samples: int | None, max_retries: int, test_split: str,
    train_fraction: float, partitioner: Any,
) -> None:
    """Raise ``ValueError`` for an option of the PFLlib / Flower splits outside its range."""
    if not isinstance(balance, bool):
        raise ValueError(f"balance must be true or false, got {balance!r}")
    if min_client_samples is not None:
        _check_int("min_client_samples", min_client_samples, 0)
    _check_int("max_retries", max_retries, 1)
    if test_split not in TEST_SPLITS:
        raise ValueError(f"unknown test_split {test_split!r}; choose one of {list(TEST_SPLITS)}")
    if isinstance(train_fraction, bool) or not 0 < train_fraction < 1:
        raise ValueError(f"train_fraction must be in (0, 1) (PFLlib's train_ratio is 0.75), got {train_fraction!r}")
    if (partition == "flower") != (partitioner is not None):
        raise ValueError("partition: flower needs data.partitioner (a flwr_datasets.partitioner object, e.g. "
                         "class_path: flwr_datasets.partitioner.IidPartitioner), and data.partitioner needs "
                         f"partition: flower; got partition={partition!r}, partitioner={type(partitioner).__name__}")
    for attr in ("num_partitions", "load_partition"):
        if partitioner is not None and not (hasattr(type(partitioner), attr) or hasattr(partitioner, attr)):
            raise ValueError(f"data.partitioner {type(partitioner).__name__} has no {attr!r}: it must follow "
                             "flwr_datasets.partitioner.Partitioner")


def _share_split_options(dataset: str | FederatedDataset, options: dict[str, Any]) -> None:
    """Give a user dataset that splits samples itself (``follow_datamodule``, as
    :class:`~lightning_fedmeta.data.lightning_adapter.LightningDataPartition` has) this module's split options, so
    ``--data.num_clients``, ``--data.partition``, ``--data.data_seed`` and the others change its split (it refuses
    one it cannot apply) instead of being ignored."""
    if isinstance(dataset, str | LabeledPool):
        return
    follow = getattr(dataset, "follow_datamodule", None)
    if callable(follow):
        follow(options)
        return
    params = inspect.signature(FederatedDataModule.__init__).parameters
    defaults = {("seed" if n == "data_seed" else n): p.default for n, p in params.items()}
    unused = [f"data.{'data_seed' if k == 'seed' else k}={v!r}" for k, v in options.items()
              if k in defaults and v != defaults[k]]
    if unused:  # a dataset that brings its own clients: the split options cannot change it
        rank_zero_warn(f"{', '.join(unused)} do not apply to {type(dataset).__name__}: it brings its own clients "
                       "(FederatedDataset.client_data), so these options are ignored", category=UserWarning)


def _check_synthetic_options(synthetic_alpha: float, synthetic_beta: float) -> None:
    """Raise ``ValueError`` unless both heterogeneity parameters are finite and ``>= 0``."""
    if not 0 <= synthetic_alpha < float("inf") or not 0 <= synthetic_beta < float("inf"):
        raise ValueError(
            "synthetic_alpha and synthetic_beta must be >= 0, "
            f"got {synthetic_alpha!r} and {synthetic_beta!r}"
        )


def _check_evaluation_options(eval_every: int, validation_fraction: float, eval_clients: int | None) -> None:
    """Raise ``ValueError`` for an evaluation option of :class:`FederatedDataModule` outside its range."""
    _check_int("eval_every", eval_every, 1)
    if isinstance(validation_fraction, bool) or not (
        validation_fraction == 0 or 0 < validation_fraction < 1
    ):
        raise ValueError(
            f"validation_fraction must be 0 (evaluate on the test sets) or in (0, 1), got {validation_fraction!r}"
        )
    if eval_clients is not None and (
        isinstance(eval_clients, bool) or not isinstance(eval_clients, int) or eval_clients < 1
    ):
        raise ValueError(
            f"data.eval_clients must be an integer >= 1 (clients scored at each validation) or null (every "
            f"client), got {eval_clients!r}"
        )


def _check_root(dataset: str | FederatedDataset, root: str | None) -> None:
    """Raise ``ValueError`` when a dataset read from files (all but the synthetic ones and Fashion-MNIST, which
    has a default folder) is asked for without a ``root`` folder."""
    needs_root = isinstance(dataset, str) and dataset in DATASET_NAMES and dataset not in (
        *SYNTHETIC_DATASETS, "fashion_mnist")
    if needs_root and root is None:
        how = ("the folder with LEAF's train/ and test/ JSON files" if dataset in LEAF_KINDS
               else "a folder of <client>.jsonl files, or one .jsonl/.csv table with a client column"
               if dataset in TEXT_DATASETS
               else "with `download: true` the files are fetched there, where torchvision can")
        raise ValueError(f"dataset {dataset!r} needs a `root` folder, got root=None ({how})")


def _gather(
    train_x: Tensor | np.ndarray, train_y: Tensor, parts: list[Tensor],
    test_x: Tensor | np.ndarray, test_y: Tensor, test_parts: list[Tensor], num_classes: int,
    transform: Callable[[Tensor | np.ndarray], Tensor] | None = None,
) -> FederatedData:
    """Concatenate the rows of each client's index set into the ``FederatedData`` layout.

    Inputs may be tensors or NumPy arrays (e.g. read-only ``uint8`` views of the files); ``transform``
    (an element-wise standardisation) is applied to the gathered rows only.
    """

    def offsets(ps: list[Tensor]) -> Tensor:
        return torch.tensor([0] + [p.numel() for p in ps], dtype=torch.long).cumsum(0)

    def rows(x: Tensor | np.ndarray, index: Tensor) -> Tensor:
        picked = x[index.numpy()] if isinstance(x, np.ndarray) else x[index]  # a fresh, contiguous copy
        if transform is not None:
            return transform(picked)
        return torch.from_numpy(picked) if isinstance(picked, np.ndarray) else picked

    tr, te = torch.cat(parts), torch.cat(test_parts)
    return FederatedData(
        train_x=rows(train_x, tr), train_y=train_y[tr], train_offsets=offsets(parts),
        test_x=rows(test_x, te), test_y=test_y[te], test_offsets=offsets(test_parts),
        num_classes=num_classes,
    )


def _describe_task(data: FederatedData) -> str:
    """``10 classes``, ``regression to (3,)``, ``multilabel with 5 labels``, ``next_token over 80 tokens``."""
    if data.task == "classification":
        return f"{data.num_classes} classes"
    if data.task == "regression":
        return f"regression to {data.target_shape or 'a scalar'}"
    if data.task == "multilabel":
        return f"multilabel with {data.num_classes} labels"
    return f"next_token over {data.num_classes} tokens, targets {data.target_shape or 'one token'}"


def _summary(data: FederatedData, what: str) -> str:
    """One line per client (``K <= 20``) or min/median/max plus totals."""
    train, test = data.train_counts, data.test_counts
    head = (
        f"FederatedDataModule: {what}: {data.num_clients} clients, input {data.input_shape}, {_describe_task(data)}, "
        f"{int(train.sum())} train / {int(test.sum())} test samples"
    )
    if data.num_clients <= 20:
        classes = data.has_class_labels
        lines = [head, f"  {'client':>12} {'train':>7} {'test':>6}" + (f" {'classes':>7}" if classes else "")]
        for i in range(data.num_clients):
            _, y = data.client_train(i)
            row = f"  {data.client_names[i]:>12} {int(train[i]):>7} {int(test[i]):>6}"
            lines.append(row + (f" {y.unique().numel():>7}" if classes else ""))
        return "\n".join(lines)

    def stats(c: Tensor) -> str:
        return f"min {int(c.min())} / median {int(c.median())} / max {int(c.max())}"

    return f"{head}\n  train per client: {stats(train)}\n  test per client:  {stats(test)}"
