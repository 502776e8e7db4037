"""The contract between an algorithm and the federated loop.

An algorithm is hyper-parameters plus pure functions:

* ``client_update(ctx, w, batches, state_i, server_state, client) -> ClientOutput`` — client
  ``i``'s local procedure for one round. ``batches`` holds every mini-batch the client draws this
  round, shaped ``[local_steps, batches_per_step, B, ...]`` (see :class:`BatchPlan`); ``state_i``
  is its row of the client state store; ``client`` is its :class:`ClientRecord` (index,
  aggregation weight, held out or not, trained before or not). The same function runs looped over
  clients or under ``torch.func.vmap`` across them, so it must be written with tensor operations
  only (no ``.item()``, no data-dependent Python branching on tensor values).
* ``aggregate(w, outputs, weights, server_state, clients) -> (Δ, server_state)`` — the server's
  combination of the stacked client outputs; ``weights`` are the round's weights (sum to 1 over
  the sampled clients) and ``clients`` their stacked records. The loop turns ``Δ`` into the
  pseudo-gradient ``−Δ`` and lets a ``torch.optim`` optimizer take the step (``w ← w + β Δ`` for
  SGD with learning rate β).
* ``personalize(ctx, w, batches, state_i, server_state, client) -> w_i`` — the model client ``i``
  is evaluated with (the global model, a fine-tuned copy, a personal model, a cluster model).

A client is known by its explicit record, never inferred from shapes or counts (docs/design.md,
contract 9). The loop never lets an algorithm see the Trainer, the device or the precision
(docs/design.md, contract 4).
"""

from __future__ import annotations

import functools
import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from lightning_fedmeta.client.functional import Batch, ClientContext, Params, tree_weighted_sum
from lightning_fedmeta.client.sampling import BatchPlan  # defined there, below the algorithms; re-exported
from lightning_fedmeta.persistence.memory_store import map_state

__all__ = [
    "COMMON_ARGS",
    "Algorithm",
    "BatchPlan",
    "ClientOutput",
    "ClientRecord",
    "PersonalModel",
    "client_records",
    "check_integer",
    "check_positive",
    "check_non_negative",
    "check_range",
    "check_seed",
    "phase_epochs",
    "started_from",
    "weighted_mean_metrics",
]


class ClientOutput(NamedTuple):
    """What one client returns from a round (a pytree: works under ``vmap``).

    Attributes:
        delta: proposed change of the global parameters ``w_i − w`` (or ``−g_i`` for algorithms
            that upload a gradient); aggregated by :meth:`Algorithm.aggregate`.
        state: the client's new per-client state (same keys and shapes as the state it received).
        extras: other per-client tensors the server needs (e.g. SCAFFOLD's ``Δc_i``).
        metrics: scalar training metrics (e.g. ``{"loss": ...}``), averaged with the
            aggregation weights for logging.
    """

    delta: Params
    state: dict[str, Tensor]
    extras: dict[str, Tensor]
    metrics: dict[str, Tensor]


class ClientRecord(NamedTuple):
    """Who a client is, passed explicitly by the loop (a pytree of 0-d tensors per client; stacked
    ``[C]`` when it describes several clients, e.g. in :meth:`Algorithm.aggregate`).

    Attributes:
        index: int64, the client's row in the federation (its row of the client state store);
            ``-1`` for a client outside the federation (``FederatedModule.personalize((x, y))``).
        weight: float64, the client's weight ``p_i`` in the training objective ``Σ_i p_i F_i``:
            ``n_i / Σ_j n_j`` (``aggregation="samples"``) or ``1/N`` (``"uniform"``) over the N
            *training* clients, so the training clients' weights sum to 1; 0 for a held-out client.
        is_new: bool, the client is held out of training (or outside the federation): it is
            evaluated as a new client.
        seen: bool, the client has taken part in at least one completed round. Personal parts of
            a client that has not (its personal model, head, dual variables) are not trained yet:
            algorithms start them from the current global, cluster or mean model.
        num_samples: int64, the client's number of training samples ``n_i``.
    """

    index: Tensor
    weight: Tensor
    is_new: Tensor
    seen: Tensor
    num_samples: Tensor


def client_records(
    num_samples: Tensor | list[int],
    weight: Tensor | list[float] | None = None,
    is_new: Tensor | list[bool] | None = None,
    seen: Tensor | list[bool] | None = None,
    index: Tensor | list[int] | None = None,
) -> ClientRecord:
    """Stacked records of ``C`` clients (for tests and direct calls of an algorithm's functions).

    Defaults: indices ``0..C-1``, nobody held out, nobody seen, and weights ``∝ num_samples`` over
    the clients that are not new (0 for new clients).
    """
    n = torch.as_tensor(num_samples, dtype=torch.long).reshape(-1)
    new = torch.zeros(n.numel(), dtype=torch.bool) if is_new is None else torch.as_tensor(is_new, dtype=torch.bool)
    if weight is None:
        counts = n.to(torch.float64) * (~new).to(torch.float64)
        w = counts / counts.sum().clamp_min(1.0)
    else:
        w = torch.as_tensor(weight, dtype=torch.float64).reshape(-1)
    return ClientRecord(
        index=torch.arange(n.numel(), dtype=torch.long) if index is None else torch.as_tensor(index, dtype=torch.long),
        weight=w,
        is_new=new,
        seen=torch.zeros(n.numel(), dtype=torch.bool) if seen is None else torch.as_tensor(seen, dtype=torch.bool),
        num_samples=n,
    )


def check_positive(name: str, value: float | int | None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if value == math.inf:
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def check_non_negative(name: str, value: float | int) -> None:
    if not value >= 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    if value == math.inf:
        raise ValueError(f"{name} must be a finite number, got {value!r}")


def check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value!r}")


def check_integer(name: str, value: int, low: int) -> None:
    """Refuse a ``value`` that is not an integer ``>= low`` (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def check_seed(name: str, value: int) -> None:
    """Refuse a seed ``torch.Generator().manual_seed`` cannot take: not an integer, or outside
    ``[-2**63, 2**64 - 1]`` (it would fail later with "Overflow when unpacking long long")."""
    if isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value <= 2**64 - 1:
        raise ValueError(f"{name} must be an integer in [-2**63, 2**64 - 1] (torch.Generator's seeds), got {value!r}")


#: The arguments every algorithm accepts (docs/cli.md), through :class:`Algorithm`'s constructor. A
#: subclass whose ``__init__`` does not name one still accepts it (see :class:`Algorithm`), unless it
#: lists it in :attr:`Algorithm.unused_args` with the reason it does not use it.
COMMON_ARGS: tuple[str, ...] = (
    "local_steps",
    "local_lr",
    "batch_size",
    "finetune_steps",
    "finetune_lr",
    "finetune_batch_size",
    "local_epochs",
    "finetune_epochs",
    "drop_last",
)

#: common arguments left out of :meth:`Algorithm.hparams` (and ``repr``) while they hold these defaults, so an
#: algorithm built without them logs and checkpoints exactly what it did before they existed
_OMITTED_DEFAULTS: dict[str, object] = {"local_epochs": None, "finetune_epochs": None, "drop_last": False}


class Algorithm(ABC):
    """Base class of every federated algorithm (built-in or plugin).

    Args:
        local_steps: τ, local steps per round.
        local_lr: client learning rate.
        batch_size: client mini-batch size (``None`` = full batch).
        finetune_steps: SGD steps a client takes from its starting model before evaluation
            (0 = evaluate the starting model). Gives e.g. the FedAvg + fine-tune baseline.
        finetune_lr: rate of those steps (defaults to ``local_lr``).
        finetune_batch_size: batch size of those steps (``None`` = full batch).
        local_epochs: E, local epochs per round; when set it replaces ``local_steps``: client ``c`` with ``n_c``
            training rows takes ``E·⌈n_c/B⌉`` steps, each epoch a fresh permutation of its rows (the last batch of
            an epoch may be partial; ``B = n_c`` for full batch). Only algorithms with ``step_budget = True``
            accept it; Ditto and FedRep count each of their two phases in epochs (docs/concepts.md, "Local epochs").
        finetune_epochs: the same for the evaluation-time fine-tuning (replaces ``finetune_steps``).
        drop_last: with epochs, drop each epoch's last partial batch (``⌊n_c/B⌋`` steps per epoch), as PyTorch's
            ``DataLoader(drop_last=True)``; a client with fewer than ``B`` rows then takes no step.

    These are the common arguments (:data:`COMMON_ARGS`). A subclass's ``__init__`` only needs to
    declare its own arguments: a common argument it does not name is accepted anyway and handed to
    this constructor (the caller's value replaces whatever the subclass passes to
    ``super().__init__``), and the subclass's signature (``inspect.signature``, the CLI,
    ``create_algorithm``) shows it as a keyword-only argument, with its default from
    :attr:`common_defaults` (else this constructor's). Name it in ``__init__`` to handle it yourself. A
    common argument the algorithm cannot honour is listed in :attr:`unused_args` with the reason: it
    is then refused with that reason, and left out of the signature, :meth:`hparams` and ``repr``.
    """

    #: registry name (the entry-point name)
    name: ClassVar[str] = ""
    #: one-line description shown by ``fedmeta algorithms``
    summary: ClassVar[str] = ""
    #: whether ``client_update`` may run under ``torch.func.vmap``
    batchable: ClassVar[bool] = True
    #: whether ``client_update`` honours a per-client budget of local steps (``model.local_steps_dist``): a step whose
    #: batch is empty (every mask entry 0: beyond the client's budget) leaves the client exactly as it was and is not
    #: counted (see :func:`~lightning_fedmeta.client.functional.has_samples`). The loop refuses budgets for algorithms
    #: that do not declare it.
    step_budget: ClassVar[bool] = False
    #: common arguments (:data:`COMMON_ARGS`) this algorithm does not use, each mapped to the reason
    #: (e.g. ``{"local_lr": "the inner learning rate is alpha"}``)
    unused_args: ClassVar[Mapping[str, str]] = {}
    #: this algorithm's defaults for common arguments its ``__init__`` does not name (the others default as in
    #: :class:`Algorithm`), e.g. ``{"finetune_steps": 1}``: its signature shows them, and a caller who does not pass
    #: one gets it (it replaces what the subclass passes to ``super().__init__``, as a caller's value does)
    common_defaults: ClassVar[Mapping[str, Any]] = {}
    #: set by the ``__init__`` wrapper (:func:`_taking_common_args`) until :meth:`__init__` consumes it: the caller's
    #: values of the common arguments the subclass's ``__init__`` does not name
    _caller_common_args: dict[str, Any]

    @classmethod
    def example_model(cls, input_shape: tuple[int, ...], num_classes: int) -> nn.Module | None:
        """A model this algorithm is defined for, on inputs of ``input_shape`` and ``num_classes`` classes, for
        :func:`~lightning_fedmeta.testing.check_algorithm` when no model is given; ``None`` (the default): any
        model (the kit uses a small MLP). Override it when the algorithm needs a particular architecture (MOCHA:
        a linear model)."""
        return None

    @classmethod
    def example_arguments(cls) -> dict[str, Any]:
        """Hyper-parameters for :func:`~lightning_fedmeta.testing.check_algorithm` when it is given the name alone:
        ``{}`` (the defaults) unless the defaults cannot build the algorithm (``mtl_graph`` needs a graph)."""
        return {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__init__ = _taking_common_args(cls)  # type: ignore[method-assign]

    def __init__(
        self,
        local_steps: int = 10,
        local_lr: float = 0.01,
        batch_size: int | None = 32,
        finetune_steps: int = 0,
        finetune_lr: float | None = None,
        finetune_batch_size: int | None = 32,
        local_epochs: int | None = None,
        finetune_epochs: int | None = None,
        drop_last: bool = False,
    ) -> None:
        values = {
            "local_steps": local_steps, "local_lr": local_lr, "batch_size": batch_size,
            "finetune_steps": finetune_steps, "finetune_lr": finetune_lr, "finetune_batch_size": finetune_batch_size,
            "local_epochs": local_epochs, "finetune_epochs": finetune_epochs, "drop_last": drop_last,
        }
        values.update(vars(self).pop("_caller_common_args", {}))  # the caller's: see _taking_common_args
        self._set_common_args(**values)

    def _set_common_args(
        self,
        local_steps: int,
        local_lr: float,
        batch_size: int | None,
        finetune_steps: int,
        finetune_lr: float | None,
        finetune_batch_size: int | None,
        local_epochs: int | None,
        finetune_epochs: int | None,
        drop_last: bool,
    ) -> None:
        """Check and keep the common arguments (``finetune_lr=None``: ``local_lr``)."""
        if not isinstance(local_steps, int) or local_steps < 1:
            raise ValueError(f"local_steps must be an integer >= 1, got {local_steps!r}")
        check_non_negative("local_lr", local_lr)
        check_positive("batch_size", batch_size, allow_none=True)
        if not isinstance(finetune_steps, int) or finetune_steps < 0:
            raise ValueError(f"finetune_steps must be an integer >= 0, got {finetune_steps!r}")
        if finetune_lr is not None:
            check_non_negative("finetune_lr", finetune_lr)
        check_positive("finetune_batch_size", finetune_batch_size, allow_none=True)
        self.local_steps = local_steps
        self.local_lr = local_lr
        self.batch_size = batch_size
        self.finetune_steps = finetune_steps
        self.finetune_lr = local_lr if finetune_lr is None else finetune_lr
        self.finetune_batch_size = finetune_batch_size
        self._set_epochs(local_epochs, finetune_epochs, drop_last)

    def _set_epochs(self, local_epochs: int | None, finetune_epochs: int | None, drop_last: bool) -> None:
        """Check and keep the epoch arguments; refuse ``local_epochs`` for an algorithm whose client_update does
        not honour empty steps (the padded steps of the clients with fewer steps than the round's longest)."""
        for name, value in (("local_epochs", local_epochs), ("finetune_epochs", finetune_epochs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 (or None: count steps), got {value!r}")
        if not isinstance(drop_last, bool):
            raise ValueError(f"drop_last must be true or false, got {drop_last!r}")
        if local_epochs is not None and not type(self).step_budget:
            label = type(self).name or type(self).__name__
            raise ValueError(
                f"local_epochs: {label!r} cannot count its local work in epochs: clients of different sizes take "
                "different numbers of steps, padded with empty steps, and its client_update does not declare "
                "step_budget = True (an empty step would still move it); use local_steps"
            )
        self.local_epochs = local_epochs
        self.finetune_epochs = finetune_epochs
        self.drop_last = drop_last

    def check_epoch_plans(self) -> None:
        """Refuse ``local_epochs`` / ``finetune_epochs`` when this algorithm's own :meth:`round_plan` /
        :meth:`eval_plan` does not carry them (an override that lays its batches out another way); the loop calls
        it when it binds the data."""
        label = type(self).name or type(self).__name__
        for arg, value, plan, method in (("local_epochs", self.local_epochs, self.round_plan(), "round_plan"),
                                         ("finetune_epochs", self.finetune_epochs, self.eval_plan(), "eval_plan")):
            carried = plan.epochs == value or (isinstance(plan.epochs, tuple) and value in plan.epochs)
            if value is not None and (not carried or plan.drop_last != self.drop_last):
                raise ValueError(
                    f"{arg}: {label!r} lays out its batches with its own {method} ({plan}), which does not count "
                    f"epochs; use {'local_steps' if arg == 'local_epochs' else 'finetune_steps'}"
                )

    # ------------------------------------------------------------------------------------------
    # data plans
    # ------------------------------------------------------------------------------------------
    def round_plan(self) -> BatchPlan:
        """The batches a client draws for one round of ``client_update`` (under ``local_epochs`` the step axis is set
        per call, from the clients' sizes: ``steps=0`` here)."""
        steps = self.local_steps if self.local_epochs is None else 0
        return BatchPlan(steps=steps, per_step=1, batch_size=self.batch_size,
                         epochs=self.local_epochs, drop_last=self.drop_last)

    def eval_plan(self) -> BatchPlan:
        """The batches a client draws from its *training* data to personalise before evaluation (under
        ``finetune_epochs`` the step axis is set per call: ``steps=0`` here)."""
        steps = self.finetune_steps if self.finetune_epochs is None else 0
        return BatchPlan(steps=steps, per_step=1, batch_size=self.finetune_batch_size,
                         epochs=self.finetune_epochs, drop_last=self.drop_last)

    # ------------------------------------------------------------------------------------------
    # state
    # ------------------------------------------------------------------------------------------
    def bind_clients(self, clients: ClientRecord, label_counts: Tensor) -> None:  # noqa: B027
        """Called once by the loop, before any state is initialised, with the stacked records of all
        ``K`` clients (held-out ones included: ``is_new``, weight 0) and every client's training label
        histogram ``[K, C]``. Default: nothing.

        On a Flower node it gets the client's view instead (:func:`~lightning_fedmeta.flower.client.population_view`:
        its own record and histogram, and for every other client only the largest size), so what the *client*
        computes (``init_client_states`` row, ``client_update``, ``personalize``) may read only the client's own
        row and the largest size; the server side may read all of it. ``check_algorithm``'s
        ``check_population_view`` tests this."""

    def init_server_state(self, params: Params) -> dict[str, Tensor]:
        """Global tensors the server keeps between rounds (checkpointed). Default: none."""
        return {}

    def init_client_state(self, params: Params) -> dict[str, Tensor]:
        """Initial state of ONE client (one row of the store). Default: none."""
        return {}

    def init_client_states(self, params: Params, clients: ClientRecord) -> dict[str, Tensor]:
        """Initial state of the clients described by the stacked ``clients`` records, along axis 0
        (all ``K`` clients at setup; one client outside the federation for ``personalize((x, y))``).

        Default: :meth:`init_client_state` copied for every client. Override when the state
        depends on the client (e.g. one dual variable per training sample: ``clients.num_samples``).
        """
        one = self.init_client_state(params)
        k = int(clients.index.numel())
        return map_state(lambda t: t.unsqueeze(0).repeat(k, *([1] * t.dim())), one)

    # ------------------------------------------------------------------------------------------
    # client and server
    # ------------------------------------------------------------------------------------------
    @abstractmethod
    def client_update(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> ClientOutput:
        """One client's local procedure for one round (pure; see the module docstring)."""

    def aggregate(
        self,
        params: Params,
        outputs: ClientOutput,
        weights: Tensor,
        server_state: dict[str, Tensor],
        clients: ClientRecord,
    ) -> tuple[Params, dict[str, Tensor]]:
        """Combine the stacked outputs of the sampled clients: ``Δ = Σ_i p_i Δ_i`` by default.

        ``weights`` are the round's weights (the sampled clients' ``p_i`` renormalised to sum to 1);
        ``clients`` are the sampled clients' stacked records (``clients.weight`` holds the global ``p_i``).
        """
        return tree_weighted_sum(outputs.delta, weights), server_state

    # ------------------------------------------------------------------------------------------
    # evaluation
    # ------------------------------------------------------------------------------------------
    def personalize(
        self,
        ctx: ClientContext,
        params: Params,
        batches: Batch,
        state: dict[str, Tensor],
        server_state: dict[str, Tensor],
        client: ClientRecord,
    ) -> Params:
        """The model client ``i`` is evaluated with: ``finetune_steps`` SGD steps from
        :meth:`personal_start` on the batches of :meth:`eval_plan`."""
        return self.finetune(ctx, self.personal_start(params, state, server_state, client), batches)

    def finetune(self, ctx: ClientContext, w: Params, batches: Batch, steps: int | None = None) -> Params:
        """``steps`` SGD steps ``w ← w − finetune_lr ∇f(w; batches[t, 0])`` (default: one per batch)."""
        for t in range(batches.x.shape[0] if steps is None else steps):
            w, _ = ctx.sgd_step(w, batches.at(t, 0), self.finetune_lr)
        return w

    def personal_start(
        self, params: Params, state: dict[str, Tensor], server_state: dict[str, Tensor], client: ClientRecord
    ) -> Params:
        """The model a client starts its evaluation-time adaptation from. Default: the global one."""
        return params

    #: whether the server optimizer's step is the whole server update. Algorithms that keep models
    #: outside the module's parameters (cluster models, personal models tracked by their mean, task
    #: models) set this to False; the loop then refuses a server optimizer other than SGD(lr=1)
    #: with a message instead of letting FedAdam/FedYogi silently do nothing to those models.
    server_optimizer_applies: ClassVar[bool] = True

    # ------------------------------------------------------------------------------------------
    def hparams(self) -> dict[str, object]:
        """Hyper-parameters for logging: public attributes that are plain values (numbers, strings,
        ``None``), less the common arguments the algorithm does not use (:attr:`unused_args`) and the epoch
        arguments while they hold their defaults (``local_epochs=None``, ``finetune_epochs=None``,
        ``drop_last=False``)."""
        unused = type(self).unused_args
        return {
            k: v for k, v in vars(self).items()
            if not k.startswith("_") and k not in unused and (v is None or isinstance(v, int | float | str))
            and not (k in _OMITTED_DEFAULTS and v is _OMITTED_DEFAULTS[k])
        }

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hparams().items())
        return f"{type(self).__name__}({args})"

    # ------------------------------------------------------------------------------------------
    # communication (docs/communication.md)
    # ------------------------------------------------------------------------------------------
    def download(self, params: Params, server_state: dict[str, Tensor], client: ClientRecord) -> dict[str, Any]:
        """What one client receives at the start of a round (a possibly nested dict of tensors). Default: the
        global parameters.

        Override it when :meth:`client_update` reads more (server state such as SCAFFOLD's ``c``, cluster models)
        or something else; ``client`` is the client's unstacked record. What is declared is counted in bytes
        (:mod:`lightning_fedmeta.communication.accounting`); ``check_algorithm`` checks that ``client_update`` reads
        nothing
        of ``params`` and ``server_state`` that the declared tensors do not depend on, and that their sizes do
        not depend on the client."""
        return dict(params)

    def upload(self, output: ClientOutput) -> dict[str, Any]:
        """What one client sends back, as a sub-tree of ``{"delta", "state", "extras", "metrics"}`` of its own
        (unstacked) output. Default: the delta and the extras (the state stays on the client; the metrics are for
        logging only).

        ``check_algorithm`` checks that every declared tensor is the output's tensor at that path and that
        :meth:`aggregate` reads no output tensor that is not declared."""
        return {"delta": output.delta, "extras": output.extras}


def unused_args_message(cls: type[Algorithm], names: list[str]) -> str:
    """The refusal of common arguments ``cls`` does not use, each with its reason."""
    label = cls.name or cls.__name__
    reasons = "; ".join(f"{n!r}: {cls.unused_args[n]}" for n in names)
    return f"algorithm {label!r} does not use {', '.join(map(repr, names))} ({reasons})"


def _taking_common_args(cls: type[Algorithm]) -> Callable[..., None]:
    """``cls.__init__`` (its own or the inherited one) made to take every common argument it does not name.

    The returned ``__init__`` refuses the arguments of ``cls.unused_args`` with their reason; takes the other common
    arguments ``cls.__init__`` does not name out of the call (the caller's value, else ``cls.common_defaults``'),
    keeps them on the instance for :meth:`Algorithm.__init__`, where they replace what the subclass passes to
    ``super().__init__``, and calls ``cls.__init__`` with the rest. Its ``__signature__`` is ``cls.__init__``'s
    without the unused arguments and with those it takes as keyword-only parameters (before ``**kwargs``), so
    ``inspect.signature``, ``create_algorithm`` and the CLI (jsonargparse reads ``inspect.signature(cls.__init__)``)
    see every argument the class accepts. An ``__init__`` with ``**kwargs`` is trusted to forward them (with
    ``cls.common_defaults`` for those the caller leaves out).
    """
    unused = dict(cls.unused_args)
    init = cls.__dict__.get("__init__", cls.__init__)
    sig = inspect.signature(init)
    params = list(sig.parameters.values())
    named = [p.name for p in params]
    forwards = any(p.kind is p.VAR_KEYWORD for p in params)
    missing = [n for n in COMMON_ARGS if n not in named and n not in unused]
    stray = sorted(set(unused) - set(COMMON_ARGS))
    if stray:
        raise TypeError(f"{cls.__name__}.unused_args names {stray}, which are not common arguments {COMMON_ARGS}")
    stray = sorted(set(cls.__dict__.get("common_defaults", {})) - set(missing))
    if stray:
        raise TypeError(f"{cls.__name__}.common_defaults names {stray}, which are not common arguments its __init__ "
                        f"leaves to Algorithm (those are {missing})")
    if "__init__" in cls.__dict__ and set(named) & set(unused):
        raise TypeError(f"{cls.__name__}.__init__ takes {[n for n in named if n in unused]}, which its unused_args "
                        "says it does not use")
    defaults = {n: v for n, v in cls.common_defaults.items() if n in missing}  # an inherited one may be named now

    @functools.wraps(init)
    def __init__(self: Algorithm, *args: Any, **kwargs: Any) -> None:
        refused = [k for k in kwargs if k in unused]
        if refused:
            raise ValueError(unused_args_message(cls, refused))
        if forwards:  # its **kwargs hands the common arguments on itself
            init(self, *args, **{**defaults, **kwargs})
            return
        caller = {**defaults, **{n: kwargs.pop(n) for n in missing if n in kwargs}}
        outer = getattr(self, "_caller_common_args", {})  # a subclass's wrapper ran first: its caller's values win
        self._caller_common_args = {**caller, **outer}
        init(self, *args, **kwargs)

    base = inspect.signature(Algorithm.__init__).parameters
    added = [base[n].replace(kind=inspect.Parameter.KEYWORD_ONLY, default=defaults.get(n, base[n].default))
             for n in missing]
    kept = [p for p in params if p.name not in unused and p.kind is not p.VAR_KEYWORD]
    var_kw = [p for p in params if p.kind is p.VAR_KEYWORD]
    __init__.__signature__ = sig.replace(parameters=kept + added + var_kw)  # type: ignore[attr-defined]
    return __init__


def phase_epochs(name: str, value: int | None, local_epochs: int | None, steps_arg: str) -> int | None:
    """The epochs of the second phase of a two-phase round (Ditto's ``personal_epochs``, FedRep's ``head_epochs``):
    ``value``, or ``local_epochs`` when ``value`` is ``None``; ``None`` without ``local_epochs`` (the round counts
    steps). Refuses a value that is not an integer ≥ 1, or one given without ``local_epochs``."""
    if value is None:
        return local_epochs
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1 (or None = local_epochs), got {value!r}")
    if local_epochs is None:
        raise ValueError(f"{name}={value} counts a phase in epochs, but local_epochs is not set: give local_epochs "
                         f"too, or count the phase in steps with {steps_arg}")
    return value


def weighted_mean_metrics(metrics: dict[str, Tensor], weights: Tensor) -> dict[str, Tensor]:
    """``Σ_i p_i m_i`` for each stacked per-client scalar metric."""
    return {k: (v.to(weights.dtype) * weights).sum() for k, v in metrics.items()}


def started_from(
    client: ClientRecord, personal: dict[str, Tensor], fallback: dict[str, Tensor]
) -> dict[str, Tensor]:
    """``personal`` for a client that has trained (``client.seen``), ``fallback`` otherwise (vmap-safe).

    Personal parts of a never-trained client are still their initialisation: algorithms use it to
    start them, and to evaluate them, from the current global (cluster, mean) model instead.
    """
    return {k: torch.where(client.seen, v, fallback[k]) for k, v in personal.items()}


class PersonalModel(Algorithm):
    """Base of the algorithms whose every client keeps a whole personal model θ_i in its client state
    (``{"personal": {name: tensor}}``: Ditto, PerFedMAML, the regularised MTL family, FedFomo, FedProto).

    θ_i starts as a copy of the initial global parameters and is read only once the client has trained
    (``client.seen``, :func:`started_from`); until then (never sampled yet, held out, or outside the federation)
    the client's model is the current global one, θ_i = θ.
    """

    def init_client_state(self, params: Params) -> dict[str, Tensor]:
        """θ_i, a copy of the (initial) global parameters (not read before the client has trained)."""
        return {"personal": {k: v.detach().clone() for k, v in params.items()}}

    def personal_start(
        self, params: Params, state: dict[str, Tensor], server_state: dict[str, Tensor], client: ClientRecord
    ) -> Params:
        """θ_i for a client that has trained; the global parameters θ for one that has not."""
        return started_from(client, state["personal"], params)
