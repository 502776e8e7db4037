"""Attributes a facade forwards to the part that owns them (``module.seen`` is ``module.engine.federation.seen``).

The Lightning module keeps its historical attribute names (read by users, callbacks and the checkpoint checks)
while the state lives in one place: reading or assigning ``module.<name>`` reads or assigns the owner's.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MODULE_FORWARDS", "Forward", "forward_attributes"]


class Forward:
    """A data descriptor: ``Forward("engine.federation")`` on a class makes ``obj.<name>`` mean
    ``obj.engine.federation.<name>`` (``attr`` renames the target)."""

    def __init__(self, owner: str, attr: str | None = None) -> None:
        self.path = owner.split(".")
        self.attr = attr

    def __set_name__(self, cls: type, name: str) -> None:
        self.attr = self.attr or name

    def _owner(self, obj: Any) -> Any:
        for part in self.path:
            obj = getattr(obj, part)
        return obj

    def __get__(self, obj: Any, cls: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(self._owner(obj), self.attr)  # type: ignore[arg-type]

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(self._owner(obj), self.attr, value)  # type: ignore[arg-type]


#: ``FederatedModule``'s attribute -> (the part that owns it, its name there): state and phases under their
#: historical names
MODULE_FORWARDS: dict[str, tuple[str, str]] = {
    **{n: ("engine", n) for n in ("algorithm", "data", "client_states", "server_state", "batching", "ctx", "records")},
    **{n: ("engine.federation", n) for n in ("seen", "holdout", "is_holdout", "eligible", "client_weight",
                                             "num_sampled", "num_candidates", "byzantine_clients", "round_clients")},
    **{n: ("evaluator", n) for n in ("metric", "metric_directions", "primary_metric", "last_summary",
                                     "last_summary_round", "last_per_client", "last_evaluated", "evaluate_clients",
                                     "evaluation_clients", "write_per_client_csv", "accuracy_of",
                                     "last_per_client_accuracy")},
    "compiler": ("engine.compile", "compiler"), "compile_decision": ("engine.compile", "decision"),
    "client_buffers": ("engine.running", "store"), "stat_names": ("engine.running", "names"),
    "commit_round": ("engine", "commit_output"), "_global_params": ("engine", "global_params"),
    "_batches": ("engine.gatherer", "batches"),
}


def forward_attributes(cls: type, table: dict[str, tuple[str, str]]) -> None:
    """Give ``cls`` a :class:`Forward` for every ``name: (owner path, attribute)`` of ``table``."""
    for name, (owner, attr) in table.items():
        setattr(cls, name, Forward(owner, attr))
