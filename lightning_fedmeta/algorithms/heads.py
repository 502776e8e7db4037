"""The head of a partial-model algorithm: which parameters are the local head, and the check of ``head_prefix``.

Shared by every algorithm that splits the model into a body and a head by parameter name (FedRep, FedPer, FedBABU,
LG-FedAvg, FedRoD, FedProto, FedDBE, FedPAC, FedAS and the feature-based ones of ``feature_common``).

Head: the parameters whose name equals a ``head_prefix`` entry or starts with ``<prefix>.``; by default the parameters
of the module owning the last entry of ``named_parameters()`` (for ``Sequential(..., Linear)`` the last layer's
``weight`` and ``bias``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["check_head_prefix", "head_names"]


def head_names(names: Sequence[str], head_prefix: str | Sequence[str] | None) -> list[str]:
    """Parameter names of the local head.

    ``head_prefix`` (a prefix or a list of prefixes): names equal to a prefix or starting with
    ``prefix + "."``. ``None``: the parameters of the module that owns the last parameter (its
    ``weight`` and ``bias`` for a final ``Linear``). Raises ``ValueError`` if the head would be empty
    or would take every parameter (no shared body).
    """
    names = list(names)
    if not names:
        raise ValueError("the model has no parameters")
    if head_prefix is None:
        last_module = names[-1].rpartition(".")[0]
        head = [n for n in names if n.rpartition(".")[0] == last_module]
    else:
        prefixes = [head_prefix] if isinstance(head_prefix, str) else list(head_prefix)
        prefixes = [p.rstrip(".") for p in prefixes]
        head = [n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes)]
        if not head:
            raise ValueError(f"head_prefix {head_prefix!r} matches no parameter; parameters are {names}")
    if len(head) == len(names):
        raise ValueError(
            f"the head {head} takes every parameter, leaving no shared body; choose a narrower head_prefix"
        )
    return head


def check_head_prefix(head_prefix: object) -> None:
    """Refuse a ``head_prefix`` (of FedRep, FedPer, FedProto, FedDBE) that is neither ``None``, a string nor a list
    of strings."""
    if head_prefix is not None and not (
        isinstance(head_prefix, str)
        or (isinstance(head_prefix, Iterable) and all(isinstance(p, str) for p in head_prefix))
    ):
        raise ValueError(f"head_prefix must be a string, a list of strings or None, got {head_prefix!r}")
