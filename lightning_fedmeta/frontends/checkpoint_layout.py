"""The layout of ``checkpoint["fedmeta"]``: one key per part, each part's own ``state_dict`` under it.

    checkpoint["fedmeta"] = {
        "layout": 2,
        "engine":    RoundEngine.state_dict()      client state or a disk manifest, BN statistics, server state,
                                                   {"federation": {"seen"}}, {"compile": ...}, {"schedule": ...},
                                                   top-k residuals, byte counts
        "evaluator": Evaluator.state_dict()        the last evaluation's per-client metric states and its round
        "run":       FitState.state_dict()         data spec, round, loss, model class, privacy record
        "record":    the run record the resume checks compare (algorithm, datamodule class, server optimizer,
                     trainer settings; lightning_fedmeta.frontends.resume_settings.RUN_RECORD_KEYS)
    }

Every release up to 0.3 wrote one flat namespace (``{"seen": ..., "metric_state": ..., "algorithm": ...}``);
:func:`per_part_layout` migrates such a checkpoint's keys on load (after its checksum is verified on the keys it was
written with), so old checkpoints keep loading. A key this table does not know is refused, never guessed at.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["FLAT_KEYS", "LAYOUT", "PARTS", "per_part_layout"]

#: the layout :func:`per_part_layout` returns and ``FederatedModule.on_save_checkpoint`` writes
LAYOUT = 2
#: the parts of the layout, each one ``state_dict``
PARTS = ("engine", "evaluator", "run", "record")
#: a key of the flat layout -> its path in the per-part layout
FLAT_KEYS: dict[str, tuple[str, ...]] = {
    "client_state": ("engine", "client_state"),
    "client_buffers": ("engine", "client_buffers"),
    "server_state": ("engine", "server_state"),
    "seen": ("engine", "federation", "seen"),
    "compile_decision": ("engine", "compile", "compile_decision"),
    "step_cost": ("engine", "schedule", "step_cost"),
    "compression_residual": ("engine", "compression_residual"),
    "traffic": ("engine", "traffic"),
    "metric_state": ("evaluator", "metric_state"),
    "metric_round": ("evaluator", "metric_round"),
    "data_spec": ("run", "data_spec"),
    "round": ("run", "round"),
    "loss": ("run", "loss"),
    "model_class": ("run", "model_class"),
    "privacy": ("run", "privacy"),
    "algorithm": ("record", "algorithm"),
    "datamodule_class": ("record", "datamodule_class"),
    "server_optimizer": ("record", "server_optimizer"),
    "trainer": ("record", "trainer"),
}


def per_part_layout(saved: Mapping[str, Any]) -> dict[str, Any]:
    """``checkpoint["fedmeta"]`` in the per-part layout: returned as it is when it is already, migrated from the
    flat layout of earlier releases otherwise (every key moved to its path in :data:`FLAT_KEYS`; a part the old
    file lacks is an empty mapping).

    Raises:
        ValueError: the layout is newer than this release's, not an int, or a flat key is unknown.
    """
    if not isinstance(saved, Mapping):
        raise ValueError(f"checkpoint['fedmeta'] must be a mapping, got {type(saved).__name__}")
    layout = saved.get("layout")
    if layout is not None:
        if isinstance(layout, bool) or not isinstance(layout, int):
            raise ValueError(f"checkpoint['fedmeta']['layout'] must be an int, got {layout!r}")
        if layout > LAYOUT:
            raise ValueError(f"this checkpoint has layout {layout}, written by a newer lightning_fedmeta (this one "
                             f"reads layouts up to {LAYOUT}); upgrade lightning_fedmeta to load it")
        if layout == LAYOUT:
            missing = [part for part in PARTS if not isinstance(saved.get(part, {}), Mapping)]
            if missing:
                raise ValueError(f"checkpoint['fedmeta'] parts {missing} are not mappings")
            return {"layout": LAYOUT, **{part: dict(saved.get(part) or {}) for part in PARTS}}
    unknown = sorted(str(k) for k in saved if k not in FLAT_KEYS and k != "layout")
    if unknown:
        raise ValueError(f"checkpoint['fedmeta'] holds keys no release of lightning_fedmeta wrote: {unknown}")
    nested: dict[str, Any] = {"layout": LAYOUT, **{part: {} for part in PARTS}}
    for key, value in saved.items():
        if key == "layout":
            continue
        *parents, last = FLAT_KEYS[str(key)]
        target = nested
        for part in parents:
            target = target.setdefault(part, {})
        target[last] = value
    return nested
