"""The Lightning module's own state besides the engine's and the evaluator's: what checkpoints, logging and a
private fit read and write, owned here and changed only through these methods.

    data_spec        {input_shape, num_classes, task, target_shape} of the bound data (or of a loaded checkpoint)
    loss_name        the per-sample loss's name, compared on resume
    placed_on        the device data and client state were last moved to (``None``: move them again)
    loaded_round     the round of a loaded checkpoint (``test``/``validate`` do not restore ``global_step``)
    evaluated_round  the round the loaded checkpoint's last evaluation scored (``None``: not recorded)
    saved_privacy    a loaded checkpoint's privacy record (``{"history", "released"}``), which a DP fit continues
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_fedmeta.data.federated import FederatedData

__all__ = ["FitState"]


class FitState:
    """The module's run state (module docstring); read through its properties, changed through its methods."""

    def __init__(self) -> None:
        self._data_spec: dict[str, Any] | None = None
        self._loss_name: str | None = None
        self._placed_on: torch.device | None = None
        self._loaded_round = 0
        self._evaluated_round: int | None = None
        self._saved_privacy: dict[str, Any] | None = None

    # -- reading ------------------------------------------------------------------------------
    @property
    def data_spec(self) -> dict[str, Any] | None:
        return None if self._data_spec is None else dict(self._data_spec)

    @property
    def loss_name(self) -> str | None:
        return self._loss_name

    @property
    def loaded_round(self) -> int:
        return self._loaded_round

    @property
    def evaluated_round(self) -> int | None:
        return self._evaluated_round

    @property
    def saved_privacy(self) -> dict[str, Any] | None:
        return self._saved_privacy

    def is_placed_on(self, device: torch.device) -> bool:
        """Whether data and client state are already on ``device``."""
        return self._placed_on == device

    # -- changing -----------------------------------------------------------------------------
    def bind(self, data: FederatedData) -> dict[str, Any]:
        """New data: its spec (returned), and everything must be moved to the device again."""
        self._placed_on = None
        self._data_spec = {"input_shape": list(data.input_shape), "num_classes": data.num_classes,
                           "task": data.task, "target_shape": list(data.target_shape)}
        return dict(self._data_spec)

    def use_loss(self, name: str) -> None:
        self._loss_name = str(name)

    def placed(self, device: torch.device) -> None:
        self._placed_on = device

    def restore(self, run: Mapping[str, Any], evaluated_round: int | None, global_step: int) -> None:
        """From a checkpoint's ``run`` part: the data spec and privacy record; ``global_step`` is its round."""
        self._placed_on = None
        self._data_spec = None if run.get("data_spec") is None else dict(run["data_spec"])
        self._loaded_round = int(global_step)
        self._saved_privacy = run.get("privacy")
        self._evaluated_round = evaluated_round

    def state_dict(self, round_idx: int, model: torch.nn.Module | None,
                   privacy: dict[str, Any] | None) -> dict[str, Any]:
        """The checkpoint's ``run`` part: data spec, round, loss, the model's class (checkpoints load with
        ``weights_only=True``, so the architecture is named, not pickled) and the privacy record."""
        return {"data_spec": self.data_spec, "round": int(round_idx), "loss": self._loss_name,
                "model_class": None if model is None else f"{type(model).__module__}.{type(model).__qualname__}",
                "privacy": privacy}
