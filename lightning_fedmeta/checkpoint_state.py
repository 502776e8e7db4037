"""The module's part of a checkpoint, composed from each part's own ``state_dict``.

``checkpoint["fedmeta"]`` holds the engine's state (client state or a disk store's manifest, per-client BatchNorm
statistics, server state, ``seen``, the compile decision), the evaluator's (the last evaluation's per-client
metric states), the data spec, the round, the loss, the model class and the run record the resume checks compare
(:mod:`lightning_fedmeta.checkpointing`). The keys are those of every earlier release, so old checkpoints load.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from lightning_fedmeta.checkpointing import (
    VERIFIED_MARK,
    check_resume_settings,
    fedmeta_run_record,
    loading_path,
    seal_checkpoint,
    verify_checkpoint,
)
from lightning_fedmeta.options import default_model_for

__all__ = ["restore_module_state", "save_module_state"]


def save_module_state(module: Any, checkpoint: dict[str, Any]) -> None:
    """Fill ``checkpoint["fedmeta"]`` and seal the checkpoint (Lightning calls this hook after filling the rest)."""
    round_idx = int(module.global_step)
    checkpoint["fedmeta"] = {
        **module.engine.state_dict(round_idx),
        **module.evaluator.state_dict(),
        "data_spec": module._data_spec,
        "round": round_idx,
        "loss": getattr(module, "_loss_name", None),
        # checkpoints load with weights_only=True, so the architecture is named, not pickled
        "model_class": f"{type(module.model).__module__}.{type(module.model).__qualname__}",
        **fedmeta_run_record(module),
        "privacy": module.privacy_record(),  # ε and the release count continue in a warm start
    }
    seal_checkpoint(checkpoint)


def restore_module_state(module: Any, checkpoint: dict[str, Any]) -> None:
    """Verify the checkpoint, refuse settings that must match, and restore every part's state."""
    saved = checkpoint.get("fedmeta")
    if saved is None:
        raise ValueError("this checkpoint was not written by lightning_fedmeta.FederatedModule")
    path = loading_path(module)
    if not checkpoint.pop(VERIFIED_MARK, False):  # not verified on the raw file already
        verify_checkpoint(checkpoint, path)
    changed = check_resume_settings(module, checkpoint, path)  # refuses settings that must match
    if changed:
        rank_zero_info("[lightning_fedmeta] settings changed since the checkpoint (allowed): "
                       + "; ".join(d.describe() for d in changed))
    module._locate_store()
    module.engine.load_state_dict(saved)
    module._placed_on = None
    module._data_spec = saved.get("data_spec")
    module._loaded_round = int(checkpoint.get("global_step", 0))
    module._saved_privacy = saved.get("privacy")
    # evaluating with other metrics: their states differ
    metric_state = None if any(d.name == "model.metrics" for d in changed) else saved.get("metric_state")
    module.evaluator.load_state_dict(metric_state, attached=module.data is not None)
    module._evaluated_round = saved.get("metric_round")  # None: a checkpoint from before it was recorded
    trained_loss, current = saved.get("loss"), getattr(module, "_loss_name", None)
    if trained_loss is not None and current is not None and trained_loss != current:
        raise ValueError(f"this checkpoint was trained with loss {trained_loss!r}, this module uses {current!r}; "
                         "pass the same loss again (FederatedModule.load_from_checkpoint(path, loss=...))")
    if module.model is None and module._data_spec is not None:
        module.model = module.engine.model = _default_model_named(module._data_spec, saved.get("model_class"))


def _default_model_named(data_spec: dict[str, Any], trained: str | None) -> Any:
    """The default model of the checkpoint's data spec, refused if the checkpoint names another class."""
    model = default_model_for(data_spec)
    built = f"{type(model).__module__}.{type(model).__qualname__}"
    if trained is not None and trained != built:
        raise ValueError(f"this checkpoint was trained with model {trained}; pass the architecture again: "
                         f"FederatedModule.load_from_checkpoint(path, model={trained.rsplit('.', 1)[-1]}(...))")
    return model
