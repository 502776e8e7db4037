"""Turn any ``LightningDataModule`` into a federated dataset by splitting its samples among clients.

:class:`LightningDataPartition` reads every ``(x, y)`` sample of a user's own datamodule (its train
loader, and its test loader -- or the validation loader when there is none), splits the train samples
among ``num_clients`` clients with the partitioners of :mod:`lightning_fedmeta.data.partition`, and
gives each client a test set from the test samples. It follows the
:class:`~lightning_fedmeta.data.federated.FederatedDataset` protocol, so ``FederatedDataModule`` (and
LightningCLI) can use it::

    data:
      dataset:
        class_path: lightning_fedmeta.data.lightning_adapter.LightningDataPartition
        init_args:
          datamodule:
            class_path: my_package.MyDataModule
            init_args: {batch_size: 256}
          num_clients: 20
          partition: dirichlet
          dirichlet_alpha: 0.3
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor

from lightning_fedmeta.data.federated import TASKS, infer_task
from lightning_fedmeta.data.lazy_clients import ClientTensors, LazyClientData
from lightning_fedmeta.data.partition import cap_client_sizes, dirichlet, iid, matching_test_split, shards

__all__ = ["ADAPTER_PARTITIONS", "STANDALONE_DEFAULTS", "LightningDataPartition"]

#: The partitions :class:`LightningDataPartition` offers (``dirichlet`` and ``shards`` split by class label).
ADAPTER_PARTITIONS: tuple[str, ...] = ("iid", "dirichlet", "shards")
_TEST_SPLITS = ("matching", "iid")
#: The split options a :class:`LightningDataPartition` used on its own takes when they are left out (``None``).
STANDALONE_DEFAULTS: dict[str, Any] = {
    "num_clients": 10, "partition": "iid", "dirichlet_alpha": 0.5, "classes_per_client": 2, "seed": 0,
    "max_samples_per_client": None,
}
#: Each split option's name on :class:`~lightning_fedmeta.data.FederatedDataModule`.
_DATAMODULE_NAMES = {name: "data_seed" if name == "seed" else name for name in STANDALONE_DEFAULTS}


class LightningDataPartition(LazyClientData):
    """Split a ``LightningDataModule``'s samples among ``num_clients`` clients.

    On first use (``client_data()``, ``num_classes`` or ``task``) it calls ``datamodule.prepare_data()``,
    ``datamodule.setup("fit")`` and reads every batch of ``train_dataloader()``, then
    ``datamodule.setup("test")`` and ``test_dataloader()``; a datamodule without a test loader gives its
    ``val_dataloader()`` samples instead (with a warning), and one with neither is an error. The result is
    kept, so the loaders are read once. ``prepare_data`` runs in every process that builds the data, so it
    must be safe to call more than once. Loaders are read inside ``torch.random.fork_rng`` seeded with
    ``seed``: a shuffling loader or random transforms give the same samples every time, and the global
    random state is left untouched.

    Batches may be any size and must be ``(x, y)`` tuples/lists of two tensors or dicts with ``"x"`` and
    ``"y"`` keys (anything ``torch.as_tensor`` accepts); an unbatched sample (a loader with
    ``batch_size=None``, whose ``y`` has no batch dimension) counts as a batch of one only when its
    target is a scalar.

    Train samples are split by ``partition``:

    * ``"iid"`` -- :func:`~lightning_fedmeta.data.partition.iid`, any targets;
    * ``"dirichlet"`` -- label skew ``p_c ~ Dir(dirichlet_alpha * 1_K)``
      (:func:`~lightning_fedmeta.data.partition.dirichlet`, Hsu et al. 2019);
    * ``"shards"`` -- ``classes_per_client`` label-sorted shards per client
      (:func:`~lightning_fedmeta.data.partition.shards`, McMahan et al. 2017).

    The label-based ones need one integer class id per sample (targets ``[N]`` of an integer dtype);
    float (regression, multi-label) or sequence targets allow only ``"iid"``. ``max_samples_per_client``
    then caps each client (:func:`~lightning_fedmeta.data.partition.cap_client_sizes`).
    Test samples: ``test="matching"`` for a classification task gives each client test samples in its
    train class proportions (:func:`~lightning_fedmeta.data.partition.matching_test_split`; test samples of
    classes no client trains on are unused); otherwise (``test="iid"``, or a task other than
    classification) the test samples are split i.i.d. into ``num_clients`` near-equal parts.

    ``num_classes``: the datamodule's ``num_classes`` attribute (read after ``setup``) when it has one that
    is not ``None``; otherwise ``max + 1`` of the integer targets (and of the inputs too for next-token
    data), the label count ``y.shape[1]`` for multi-label, and ``None`` for regression.

    **Inside a** :class:`~lightning_fedmeta.data.FederatedDataModule` the split follows the data module's
    options, so the CLI's ``--data.num_clients``, ``--data.partition``, ``--data.dirichlet_alpha``,
    ``--data.classes_per_client``, ``--data.max_samples_per_client`` and ``--data.data_seed`` (the
    three-seed recipe of docs/reproduction.md) change it: leave the six split options below out here
    (``None``). One given here that differs from the data module's value is refused
    (:meth:`follow_datamodule`), never silently overridden either way; ``data.partition="perfedavg_paper"``
    is refused too. Used on its own, the options left out take the defaults of
    :data:`STANDALONE_DEFAULTS` (10 clients, ``"iid"``, alpha 0.5, 2 classes per client, seed 0, no cap).

    Args:
        datamodule: the user's datamodule (``class_path``/``init_args`` in YAML).
        num_clients: number of clients ``K >= 1`` (``None``: ``data.num_clients``).
        partition: ``"iid"``, ``"dirichlet"`` or ``"shards"`` (``None``: ``data.partition``).
        dirichlet_alpha: concentration of ``"dirichlet"``, ``> 0`` (``None``: ``data.dirichlet_alpha``).
        classes_per_client: shards per client of ``"shards"``, ``>= 1`` (``None``: ``data.classes_per_client``).
        test: ``"matching"`` or ``"iid"`` (above).
        seed: seed of the loaders' randomness, the partition, the cap and the test split (``None``:
            ``data.data_seed``).
        max_samples_per_client: keep at most this many train samples per client; ``None`` keeps all (or
            follows ``data.max_samples_per_client``).
        task: one of :data:`~lightning_fedmeta.data.federated.TASKS`; ``None`` infers it from the dtypes
            (:func:`~lightning_fedmeta.data.federated.infer_task`; multi-label must be named, its targets
            look like regression's).
    """

    def __init__(
        self,
        datamodule: L.LightningDataModule,
        num_clients: int | None = None,
        partition: Literal["iid", "dirichlet", "shards"] | None = None,
        dirichlet_alpha: float | None = None,
        classes_per_client: int | None = None,
        test: Literal["matching", "iid"] = "matching",
        seed: int | None = None,
        max_samples_per_client: int | None = None,
        task: str | None = None,
    ) -> None:
        if not isinstance(datamodule, L.LightningDataModule):
            raise ValueError(f"datamodule must be a lightning.LightningDataModule, got {type(datamodule).__name__}")
        if test not in _TEST_SPLITS:
            raise ValueError(f"test must be one of {list(_TEST_SPLITS)}, got {test!r}")
        if task is not None and task not in TASKS:
            raise ValueError(f"task must be one of {list(TASKS)} or None, got {task!r}")
        given = {"num_clients": num_clients, "partition": partition, "dirichlet_alpha": dirichlet_alpha,
                 "classes_per_client": classes_per_client, "seed": seed,
                 "max_samples_per_client": max_samples_per_client}
        self._given = {name: value for name, value in given.items() if value is not None}
        _check_split_options(self._given, "")
        self.datamodule = datamodule
        self.test = test
        self._set_split_options({**STANDALONE_DEFAULTS, **self._given})
        self._task = task
        self._clients: list[ClientTensors] | None = None
        self._num_classes: int | None = None
        self._loader_names = {"train": "train_dataloader()", "test": "test_dataloader()"}

    def follow_datamodule(self, options: Mapping[str, Any]) -> None:
        """Split as the :class:`~lightning_fedmeta.data.FederatedDataModule` that uses this says.

        ``options`` maps this class's split option names (``num_clients``, ``partition``, ``dirichlet_alpha``,
        ``classes_per_client``, ``seed``, ``max_samples_per_client``) to the data module's values. An option
        given to this class that differs is refused: which of two values a run used must not depend on which
        one silently won. A split already read with other options is dropped and made again on next use.
        """
        for name, value in options.items():
            if name in self._given and self._given[name] != value:
                option = _DATAMODULE_NAMES[name]
                raise ValueError(
                    f"LightningDataPartition({name}={self._given[name]!r}) disagrees with data.{option}={value!r} "
                    f"(the FederatedDataModule's option, --data.{option} on the CLI), which sets the split: give "
                    f"it there only (data.{option}: {self._given[name]!r}) and leave {name} out of "
                    "LightningDataPartition"
                )
        _check_split_options(options, "data.")
        resolved = {**STANDALONE_DEFAULTS, **options}
        if self._clients is not None and resolved != self._split_options():
            self._clients = None
        self._set_split_options(resolved)

    def _set_split_options(self, options: Mapping[str, Any]) -> None:
        self.num_clients: int = options["num_clients"]
        self.partition: str = options["partition"]
        self.dirichlet_alpha: float = options["dirichlet_alpha"]
        self.classes_per_client: int = options["classes_per_client"]
        self.seed: int = options["seed"]
        self.max_samples_per_client: int | None = options["max_samples_per_client"]

    def _split_options(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in STANDALONE_DEFAULTS}

    @property
    def num_classes(self) -> int | None:  # type: ignore[override]
        """The number of classes (see the class docstring); reads the datamodule on first use."""
        self._load()
        return self._num_classes

    @property
    def task(self) -> str:
        """The task of the data (the ``task`` argument, or inferred from the dtypes)."""
        self._load()
        assert self._task is not None
        return self._task

    def _read_clients(self) -> list[ClientTensors]:
        """Read the datamodule's samples and split them among the clients."""
        dm = self.datamodule
        train_x, train_y, test_x, test_y = self._read_samples()
        task = self._task or infer_task(train_x, train_y)
        self._task = task
        self._num_classes = _num_classes(dm, task, train_x, train_y, test_y)
        for what, (x, y) in (("train", (train_x, train_y)), ("test", (test_x, test_y))):
            _check_samples(x, y, self._loader_names[what], task, self._num_classes)
        class_ids = train_y.dim() == 1 and not train_y.is_floating_point() and train_y.dtype != torch.bool

        k, n_train, n_test = self.num_clients, train_y.shape[0], test_y.shape[0]
        parts = self._train_parts(train_y, class_ids)
        matching = self.test == "matching" and task == "classification" and class_ids
        if matching:
            test_parts = matching_test_split([train_y[p] for p in parts], test_y, self.seed)
        else:
            if n_test < k:
                raise ValueError(f"num_clients={k} exceeds the {n_test} test samples; each client needs one")
            test_parts = iid(torch.zeros(n_test, dtype=torch.long), k, self.seed)
        clients = [(train_x[p], train_y[p], test_x[q], test_y[q]) for p, q in zip(parts, test_parts, strict=True)]
        rank_zero_info(
            f"LightningDataPartition of {type(dm).__name__}: {n_train} train and {n_test} test samples, "
            f"task {task}, split among {k} clients ({self.partition} partition, "
            f"{'matching' if matching else 'iid'} test split)"
        )
        return clients

    def _read_samples(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(train_x, train_y, test_x, test_y)`` read from the datamodule's loaders under a seeded ``fork_rng``."""
        dm = self.datamodule
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            dm.prepare_data()
            dm.setup("fit")
            train_x, train_y = _gather(dm.train_dataloader(), "train_dataloader()")
            if is_overridden("test_dataloader", dm, L.LightningDataModule):
                dm.setup("test")
                test_x, test_y = _gather(dm.test_dataloader(), "test_dataloader()")
            elif is_overridden("val_dataloader", dm, L.LightningDataModule):
                self._loader_names["test"] = "val_dataloader()"
                rank_zero_warn(
                    f"{type(dm).__name__} has no test_dataloader(); the clients' test sets come from its "
                    "val_dataloader() samples"
                )
                test_x, test_y = _gather(dm.val_dataloader(), "val_dataloader()")
            else:
                raise ValueError(
                    f"{type(dm).__name__} has neither test_dataloader() nor val_dataloader(); the clients need "
                    "test samples from one of them"
                )
        if train_x.shape[1:] != test_x.shape[1:] or train_y.shape[1:] != test_y.shape[1:]:
            raise ValueError(
                f"train and test samples differ in shape: x {tuple(train_x.shape[1:])} against "
                f"{tuple(test_x.shape[1:])}, y {tuple(train_y.shape[1:])} against {tuple(test_y.shape[1:])}"
            )
        return train_x, train_y, test_x, test_y

    def _train_parts(self, train_y: Tensor, class_ids: bool) -> list[Tensor]:
        """Each client's train sample indices under ``partition``, capped at ``max_samples_per_client``."""
        k, n_train = self.num_clients, train_y.shape[0]
        if n_train < k:
            raise ValueError(f"num_clients={k} exceeds the {n_train} samples of train_dataloader()")
        if self.partition == "iid":
            parts = iid(torch.zeros(n_train, dtype=torch.long), k, self.seed)
        elif not class_ids:
            raise ValueError(
                f"partition={self.partition!r} splits by class label and needs one integer class id per sample "
                f"(targets of shape [N], integer dtype), but the targets have shape {tuple(train_y.shape)} and "
                f"dtype {train_y.dtype}; use partition='iid'"
            )
        elif self.partition == "dirichlet":
            parts = dirichlet(train_y, k, self.dirichlet_alpha, self.seed)
        else:
            parts = shards(train_y, k, self.classes_per_client, self.seed)
        return cap_client_sizes(parts, self.max_samples_per_client, self.seed)

def _check_split_options(options: Mapping[str, Any], prefix: str) -> None:
    """Refuse a split option outside its range, named as the caller knows it (``prefix`` ``"data."`` for the
    data module's options)."""
    def named(name: str) -> str:
        return prefix + (_DATAMODULE_NAMES[name] if prefix else name)

    for name in ("num_clients", "classes_per_client", "max_samples_per_client"):
        if options.get(name) is not None:
            _check_int(named(name), options[name], 1)
    if "seed" in options:
        _check_int(named("seed"), options["seed"], 0)
    if "partition" in options and options["partition"] not in ADAPTER_PARTITIONS:
        raise ValueError(
            f"{named('partition')} must be one of {list(ADAPTER_PARTITIONS)} for a LightningDataPartition, got "
            f"{options['partition']!r}"
        )
    if "dirichlet_alpha" in options and not options["dirichlet_alpha"] > 0:
        raise ValueError(f"{named('dirichlet_alpha')} must be > 0, got {options['dirichlet_alpha']!r}")


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _split_batch(batch: Any, what: str, index: int) -> tuple[Tensor, Tensor]:
    if isinstance(batch, Mapping):
        if "x" not in batch or "y" not in batch:
            raise ValueError(
                f"batch {index} of {what} is a dict with keys {sorted(map(str, batch))}; it needs 'x' and 'y'"
            )
        x, y = batch["x"], batch["y"]
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        x, y = batch
    else:
        desc = f"a {type(batch).__name__} of length {len(batch)}" if isinstance(batch, (tuple, list)) else (
            type(batch).__name__
        )
        raise ValueError(
            f"batch {index} of {what} is {desc}; batches must be (x, y) tuples/lists or dicts with 'x' and 'y' keys"
        )
    try:
        x, y = torch.as_tensor(x), torch.as_tensor(y)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"batch {index} of {what}: x and y must be tensors or arrays ({err})") from err
    if y.dim() == 0:  # an unbatched sample (DataLoader(batch_size=None))
        x, y = x.unsqueeze(0), y.unsqueeze(0)
    if x.dim() == 0 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"batch {index} of {what} has x of shape {tuple(x.shape)} and y of shape {tuple(y.shape)}; "
            "both need the same batch size in dimension 0"
        )
    return x.detach().cpu(), y.detach().cpu()


def _gather(loader: Iterable[Any], what: str) -> tuple[Tensor, Tensor]:
    loaders = list(loader) if isinstance(loader, (list, tuple)) else [loader]
    xs: list[Tensor] = []
    ys: list[Tensor] = []
    for one in loaders:
        for batch in one:
            x, y = _split_batch(batch, what, len(xs))
            if xs and (x.shape[1:] != xs[0].shape[1:] or y.shape[1:] != ys[0].shape[1:]):
                raise ValueError(
                    f"batch {len(xs)} of {what} has samples of shape x {tuple(x.shape[1:])}, y {tuple(y.shape[1:])} "
                    f"but the first batch x {tuple(xs[0].shape[1:])}, y {tuple(ys[0].shape[1:])}"
                )
            xs.append(x)
            ys.append(y)
    if not xs:
        raise ValueError(f"{what} yielded no batches")
    return torch.cat(xs), torch.cat(ys)


def _check_samples(x: Tensor, y: Tensor, what: str, task: str, num_classes: int | None) -> None:
    """Refuse, before the split, non-finite inputs or targets and class ids / next tokens outside
    ``[0, num_classes)``, naming the loader, the first such sample, its value and how many there are (a test
    label past ``num_classes`` would otherwise be dropped by the matching test split without a word)."""
    clean = "clean or drop these samples in the datamodule"
    checks = [(t, ~torch.isfinite(t), f"{name} that are not finite (NaN or inf)", clean)
              for t, name in ((x, "input values"), (y, "target values")) if t.is_floating_point() or t.is_complex()]
    if task in ("classification", "next_token") and num_classes is not None and not y.is_floating_point():
        checks.append((y, (y < 0) | (y >= num_classes), f"labels outside [0, num_classes={num_classes})",
                       "fix the labels, or give the datamodule the dataset's true num_classes attribute"))
    for values, bad, kind, fix in checks:
        flat = bad.reshape(bad.shape[0], -1)
        if bool(flat.any()):
            row = int(flat.any(1).nonzero()[0, 0])
            value = values.reshape(values.shape[0], -1)[row][flat[row]][0].item()
            raise ValueError(f"{what} gave {int(flat.sum())} {kind}, the first in sample {row} ({value!r}): {fix}")


def _num_classes(dm: L.LightningDataModule, task: str, x: Tensor, y: Tensor, test_y: Tensor) -> int | None:
    declared = getattr(dm, "num_classes", None)
    if declared is not None:
        return int(declared)
    if task == "multilabel":
        return int(y.shape[1]) if y.dim() == 2 else None
    if y.is_floating_point() or y.dtype == torch.bool:
        return None
    top = max(int(y.max()), int(test_y.max()) if test_y.numel() else 0)
    if task == "next_token" and not x.is_floating_point():
        top = max(top, int(x.max()))
    return top + 1
