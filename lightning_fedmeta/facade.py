"""Attributes a facade forwards to the part that owns them (``module.seen`` is ``module.engine.federation.seen``).

The Lightning module keeps its historical attribute names (read by users, callbacks and the checkpoint checks)
while the state lives in one place: reading or assigning ``module.<name>`` reads or assigns the owner's.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Forward"]


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
