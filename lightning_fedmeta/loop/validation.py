"""Checks at the boundary between the federated loop and an algorithm (docs/design.md, contract 8).

What an algorithm returns is checked once, where it enters the loop, so that a wrong key, shape,
dtype or device fails with a message naming the algorithm, the function, the key, the expected and
the actual value, instead of a raw error deep inside a round (``index_copy_(): Source
dimensionality (2), destination dimensionality (1)``):

* ``init_client_state(s)`` and ``init_server_state``, when the module binds its data;
* ``client_update`` and ``aggregate``, on the first round the module runs. Later rounds pay
  nothing: the loop remembers that it validated them.

The checks walk arbitrary pytrees (nested dicts, lists, tuples), naming a nested entry as
``state['a']['b']``. Each raises :class:`AlgorithmContractError` (a ``ValueError``). The plugin
author's kit (:mod:`lightning_fedmeta.testing`) runs the same checks on every round it drives.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import keystr, tree_flatten_with_path

__all__ = [
    "AlgorithmContractError",
    "named_leaves",
    "validate_init_client_states",
    "validate_init_server_state",
    "validate_client_output",
    "validate_aggregate_output",
]


class AlgorithmContractError(ValueError):
    """An algorithm returned something the loop cannot use (a missing or extra key, or a shape, dtype,
    device or value that breaks the contract of :class:`~lightning_fedmeta.Algorithm`)."""


def named_leaves(tree: Any, root: str = "") -> list[tuple[str, Any]]:
    """``(name, leaf)`` for every leaf of a pytree, named like Python indexing: ``state['a']['b']``, ``x[0]``."""
    leaves, _ = tree_flatten_with_path(tree)
    return [(root + keystr(path), leaf) for path, leaf in leaves]


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------
def _where(algorithm: Any, function: str) -> str:
    cls = type(algorithm)
    registered = getattr(cls, "name", "")
    suffix = f" (algorithm {registered!r})" if registered and registered != cls.__name__ else ""
    return f"{cls.__name__}.{function}{suffix}"


def _shape(shape: Any) -> str:
    return str(list(shape))


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "floating"
    return "integer"


def _dtypes_agree(actual: torch.dtype, expected: torch.dtype, strict_dtypes: bool) -> bool:
    if strict_dtypes:
        return actual == expected
    return _kind(actual) == _kind(expected)


def _require_mapping(where: str, what: str, value: Any) -> None:
    if not isinstance(value, Mapping):
        raise AlgorithmContractError(
            f"{where} returned {what} as a {type(value).__name__}; it must be a dict of tensors (name -> Tensor)"
        )


def _tensor_leaves(where: str, tree: Any, root: str) -> dict[str, Tensor]:
    out: dict[str, Tensor] = {}
    for name, leaf in named_leaves(tree, root):
        if not isinstance(leaf, Tensor):
            raise AlgorithmContractError(
                f"{where} returned {name} as a {type(leaf).__name__} ({leaf!r:.60}); every entry must be a tensor "
                "(wrap a number with torch.as_tensor)"
            )
        out[name] = leaf
    return out


def _check_keys(where: str, what: str, actual: dict[str, Tensor], expected: dict[str, Any], source: str) -> None:
    missing = [k for k in expected if k not in actual]
    extra = [k for k in actual if k not in expected]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"without {', '.join(missing)}")
        if extra:
            parts.append(f"with unexpected {', '.join(extra)}")
        raise AlgorithmContractError(
            f"{where} returned {what} {' and '.join(parts)}: {what} must have exactly the keys of {source} "
            f"({', '.join(expected) or 'none'})"
        )


def _check_nan(where: str, leaves: dict[str, Tensor], allow_inf: bool, per_client: bool = False) -> None:
    for name, t in leaves.items():
        if not (t.is_floating_point() or t.is_complex()):
            continue
        bad = torch.isnan(t) if allow_inf else ~torch.isfinite(t)
        if bool(bad.any()):
            at = ""
            if per_client and t.dim() > 0:
                rows = bad.reshape(t.shape[0], -1).any(1).nonzero().flatten().tolist()
                at = f" for the client(s) at position(s) {rows[:5]} of the round"
            kind = "NaN" if allow_inf else "a non-finite value (NaN or inf)"
            raise AlgorithmContractError(f"{where} returned {name} holding {kind}{at}")


def _compare(
    where: str,
    name: str,
    actual: Tensor,
    shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device | None,
    source: str,
    per_client: bool,
    strict_dtypes: bool,
    hint: str,
) -> None:
    """``actual`` (stacked over clients when ``per_client``) against the expected shape/dtype/device."""
    unit = " per client" if per_client else ""
    got = actual.shape[1:] if per_client else actual.shape
    if got != shape:
        raise AlgorithmContractError(
            f"{where} returned {name} with shape {_shape(got)}{unit}, but {source} has shape {_shape(shape)}; {hint}"
        )
    if not _dtypes_agree(actual.dtype, dtype, strict_dtypes):
        raise AlgorithmContractError(
            f"{where} returned {name} as {actual.dtype}, but {source} is {dtype}; {hint} "
            f"(cast with .to({dtype}))"
        )
    if device is not None and actual.device != device and not (actual.dim() == 0 and actual.device.type == "cpu"):
        raise AlgorithmContractError(
            f"{where} returned {name} on device {actual.device}, but {source} is on {device}; create new tensors "
            "on the device of the inputs (torch.zeros_like(x), x.new_zeros(...), device=x.device)"
        )


# ----------------------------------------------------------------------------------------------
# state initialisers (checked when the data is bound)
# ----------------------------------------------------------------------------------------------
def _init_name(algorithm: Any) -> str:
    """``init_client_states`` when the algorithm overrides it, else ``init_client_state`` (the row it copies)."""
    from lightning_fedmeta.algorithms.base import Algorithm

    overridden = type(algorithm).init_client_states is not Algorithm.init_client_states
    return "init_client_states" if overridden else "init_client_state"


def validate_init_client_states(algorithm: Any, states: Any, num_clients: int) -> None:
    """What ``init_client_states(params, clients)`` returned for ``num_clients`` clients: a dict of tensors,
    each with one row per client along axis 0, all finite."""
    init = _init_name(algorithm)
    where = _where(algorithm, init)
    _require_mapping(where, "the client state", states)
    leaves = _tensor_leaves(where, states, "state")
    for name, t in leaves.items():
        if t.dim() == 0 or t.shape[0] != num_clients:
            raise AlgorithmContractError(
                f"{where} returned {name} with shape {_shape(t.shape)}, but it must stack one row per client along "
                f"axis 0: expected a leading axis of {num_clients} (the number of clients), got "
                f"{_shape(t.shape[:1])}"
            )
    _check_nan(where, leaves, allow_inf=False)


def validate_init_server_state(algorithm: Any, server_state: Any) -> None:
    """What ``init_server_state(params)`` returned: a dict of tensors without NaN (infinity is allowed as a
    sentinel, e.g. MOCHA's duality gap before the first round)."""
    where = _where(algorithm, "init_server_state")
    _require_mapping(where, "the server state", server_state)
    _check_nan(where, _tensor_leaves(where, server_state, "server_state"), allow_inf=True)


# ----------------------------------------------------------------------------------------------
# the round (checked on the first round)
# ----------------------------------------------------------------------------------------------
def validate_client_output(
    algorithm: Any,
    out: Any,
    params: Mapping[str, Tensor],
    stored_states: Mapping[str, Tensor],
    num_clients: int,
    *,
    strict_dtypes: bool = True,
    check_finite: bool = False,
) -> None:
    """The stacked outputs of ``client_update`` for the round's ``num_clients`` clients.

    * ``delta``: exactly the parameter names, each of the parameter's shape, dtype and device per client;
    * ``state``: exactly the keys of the client state store, each of its stored row's shape, dtype and device;
    * ``extras``: tensors, one row per client; ``metrics``: one scalar per client;
    * with ``check_finite``, every floating value finite (the loop checks that itself, every round).

    ``strict_dtypes=False`` (under autocast) accepts another floating precision for a floating entry.
    """
    from lightning_fedmeta.algorithms.base import ClientOutput

    where = _where(algorithm, "client_update")
    if not isinstance(out, tuple) or len(out) != 4:
        raise AlgorithmContractError(
            f"{where} returned a {type(out).__name__}; it must return ClientOutput(delta, state, extras, metrics)"
        )
    out = ClientOutput(*out)
    device = next(iter(params.values())).device if params else None
    for field in ClientOutput._fields:
        _require_mapping(where, field, getattr(out, field))
    delta = _tensor_leaves(where, out.delta, "delta")
    expected_delta = {f"delta{keystr(path)}": t for path, t in tree_flatten_with_path(dict(params))[0]}
    _check_keys(where, "delta", delta, expected_delta, "the model's parameters")
    for name, p in expected_delta.items():
        _compare(where, name, delta[name], p.shape, p.dtype, p.device, "the parameter", True, strict_dtypes,
                 "delta is the proposed change of that parameter (w_i - w)")
    state = _tensor_leaves(where, out.state, "state")
    expected_state = {f"state{keystr(path)}": t for path, t in tree_flatten_with_path(dict(stored_states))[0]}
    init = _init_name(algorithm)
    _check_keys(where, "state", state, expected_state, f"the client state from {type(algorithm).__name__}.{init}")
    for name, rows in expected_state.items():
        _compare(where, name, state[name], rows.shape[1:], rows.dtype, device, f"its stored row (from {init})",
                 True, strict_dtypes, "client_update must return every state entry with the shape and dtype of its row")
    for field in ("extras", "metrics"):
        for name, t in _tensor_leaves(where, getattr(out, field), field).items():
            if t.dim() == 0 or t.shape[0] != num_clients:
                raise AlgorithmContractError(f"{where} returned {name} with shape {_shape(t.shape)}, not one row per "
                                             f"client ({num_clients} clients)")
            if field == "metrics" and t.dim() != 1:
                raise AlgorithmContractError(
                    f"{where} returned {name} with shape {_shape(t.shape[1:])} per client; a metric must be one scalar "
                    "(0-d tensor) per client, e.g. loss.mean()"
                )
            if device is not None and t.device != device:
                raise AlgorithmContractError(f"{where} returned {name} on device {t.device}, not {device}")
    if check_finite:
        for field in ClientOutput._fields:
            _check_nan(where, _tensor_leaves(where, getattr(out, field), field), allow_inf=False, per_client=True)


def validate_aggregate_output(
    algorithm: Any,
    result: Any,
    params: Mapping[str, Tensor],
    server_state: Mapping[str, Tensor],
    *,
    strict_dtypes: bool = True,
    check_finite: bool = False,
) -> None:
    """What ``aggregate`` returned: ``(Δ, server_state)`` with Δ of the parameters' names, shapes, dtypes and
    devices, and the new server state with the keys, shapes and dtypes of the one it received (no NaN;
    0-d tensors may live on the CPU). With ``check_finite``, Δ must be finite too (the loop checks that
    itself, every round)."""
    where = _where(algorithm, "aggregate")
    if not isinstance(result, tuple) or len(result) != 2:
        raise AlgorithmContractError(
            f"{where} returned a {type(result).__name__}; it must return a pair (delta, server_state)"
        )
    delta_tree, new_state = result
    _require_mapping(where, "delta", delta_tree)
    _require_mapping(where, "the server state", new_state)
    delta = _tensor_leaves(where, delta_tree, "delta")
    expected_delta = {f"delta{keystr(path)}": t for path, t in tree_flatten_with_path(dict(params))[0]}
    _check_keys(where, "delta", delta, expected_delta, "the model's parameters")
    for name, p in expected_delta.items():
        _compare(where, name, delta[name], p.shape, p.dtype, p.device, "the parameter", False, strict_dtypes,
                 "the aggregate delta is the change of that parameter")
    state = _tensor_leaves(where, new_state, "server_state")
    expected = {f"server_state{keystr(path)}": t for path, t in tree_flatten_with_path(dict(server_state))[0]}
    _check_keys(where, "server_state", state, expected, "the server state it received")
    for name, old in expected.items():
        device = None if old.dim() == 0 else old.device
        _compare(where, name, state[name], old.shape, old.dtype, device, "the server state it received", False,
                 strict_dtypes, "aggregate must return every server state entry with the shape and dtype it received")
    _check_nan(where, state, allow_inf=True)
    if check_finite:
        _check_nan(where, delta, allow_inf=False)
