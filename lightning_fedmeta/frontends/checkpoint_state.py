"""The module's part of a checkpoint, composed from each part's own ``state_dict`` under its own key.

``checkpoint["fedmeta"]`` (:mod:`~lightning_fedmeta.frontends.checkpoint_layout`) holds the engine's state (client
state or a disk store's manifest, per-client BatchNorm statistics, server state, ``seen``, the compile decision),
the evaluator's (the last evaluation's per-client metric states), the run's (data spec, round, loss, model class,
privacy record) and the run record the resume checks compare (:mod:`lightning_fedmeta.persistence`). A
checkpoint in the flat layout of earlier releases is migrated on load.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from lightning_fedmeta.evaluation import Evaluator
from lightning_fedmeta.frontends.checkpoint_layout import LAYOUT, per_part_layout
from lightning_fedmeta.frontends.fit_state import FitState
from lightning_fedmeta.frontends.options import default_model_for
from lightning_fedmeta.frontends.resume_settings import ResumeCandidate, check_resume_settings
from lightning_fedmeta.loop import RoundEngine
from lightning_fedmeta.persistence.checksums import VERIFIED_MARK, seal_checkpoint, verify_checkpoint

__all__ = ["restore_module_state", "save_module_state"]


def save_module_state(checkpoint: dict[str, Any], *, engine: RoundEngine, evaluator: Evaluator, fit: FitState,
                      model: nn.Module | None, round_idx: int, record: dict[str, Any],
                      privacy: dict[str, Any] | None) -> None:
    """Fill ``checkpoint["fedmeta"]``, one key per part, and seal the checkpoint (Lightning calls the module's hook
    after filling the rest). ``record`` is :func:`~lightning_fedmeta.frontends.resume_settings.fedmeta_run_record`'s."""
    checkpoint["fedmeta"] = {
        "layout": LAYOUT,
        "engine": engine.state_dict(round_idx),
        "evaluator": evaluator.state_dict(),
        "run": fit.state_dict(round_idx, model, privacy),
        "record": record,
    }
    seal_checkpoint(checkpoint)


def restore_module_state(checkpoint: dict[str, Any], path: Any, *, candidate: ResumeCandidate, engine: RoundEngine,
                         evaluator: Evaluator, fit: FitState, model: nn.Module | None) -> nn.Module | None:
    """Verify the checkpoint (on the keys it was written with), migrate its layout, refuse settings that must
    match, and restore every part's state. Returns the model to use: ``model``, or when it is ``None`` the default
    model of the checkpoint's data spec (refused if the checkpoint names another class)."""
    if checkpoint.get("fedmeta") is None:
        raise ValueError("this checkpoint was not written by lightning_fedmeta.FederatedModule")
    if not checkpoint.pop(VERIFIED_MARK, False):  # not verified on the raw file already
        verify_checkpoint(checkpoint, path)
    saved = checkpoint["fedmeta"] = per_part_layout(checkpoint["fedmeta"])
    changed = check_resume_settings(candidate, checkpoint, path)  # refuses settings that must match
    if changed:
        rank_zero_info("[lightning_fedmeta] settings changed since the checkpoint (allowed): "
                       + "; ".join(d.describe() for d in changed))
    run, scores = saved["run"], saved["evaluator"]
    trained_loss, current = run.get("loss"), fit.loss_name
    if trained_loss is not None and current is not None and trained_loss != current:
        raise ValueError(f"this checkpoint was trained with loss {trained_loss!r}, this module uses {current!r}; "
                         "pass the same loss again (FederatedModule.load_from_checkpoint(path, loss=...))")
    engine.load_state_dict(saved["engine"])
    fit.restore(run, scores.get("metric_round"), int(checkpoint.get("global_step", 0)))
    # evaluating with other metrics: their states differ
    metric_state = None if any(d.name == "model.metrics" for d in changed) else scores.get("metric_state")
    evaluator.load_state_dict(metric_state, attached=engine.data is not None)
    if model is None and fit.data_spec is not None:
        model = _default_model_named(fit.data_spec, run.get("model_class"))
        engine.use_model(model)
    return model


def _default_model_named(data_spec: dict[str, Any], trained: str | None) -> nn.Module:
    """The default model of the checkpoint's data spec, refused if the checkpoint names another class."""
    model = default_model_for(data_spec)
    built = f"{type(model).__module__}.{type(model).__qualname__}"
    if trained is not None and trained != built:
        raise ValueError(f"this checkpoint was trained with model {trained}; pass the architecture again: "
                         f"FederatedModule.load_from_checkpoint(path, model={trained.rsplit('.', 1)[-1]}(...))")
    return model
