"""Mixed precision and the federated server step.

Lightning's ``precision="16-mixed"`` pairs float16 autocast with a ``GradScaler``: the loss is multiplied by a scale
before ``backward`` so small float16 gradients do not underflow, and the optimizer step unscales the gradients first.
The federated server step has no loss and no ``backward``: its gradient is the pseudo-gradient ``−Δ``, a float32
aggregate of the clients' updates (:func:`~lightning_fedmeta.loop.server.apply_server_step`), and the clients take
their gradients functionally (``torch.func``) inside the round. Lightning's step then fails ("Attempted unscale_ but
_scale is None"), found by benchmarks/gpu.py on an H100. So the scaler is removed for the fit: autocast still runs
the clients' forward passes in float16, and the server optimizer steps on ``−Δ`` as it does at every precision.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities import rank_zero_info

__all__ = ["drop_loss_scaler"]


def drop_loss_scaler(trainer: Any) -> bool:
    """Remove the ``GradScaler`` of the trainer's precision plugin, if it has one (``16-mixed``); returns whether
    one was removed. The plugin's autocast is kept."""
    plugin = getattr(trainer, "precision_plugin", None)
    if getattr(plugin, "scaler", None) is None:
        return False
    plugin.scaler = None
    rank_zero_info(
        "[lightning_fedmeta] precision 16-mixed: the server step applies the clients' aggregate update, not a "
        "backward pass, so there is no loss to scale: GradScaler is not used (clients still compute in float16 "
        "autocast; prefer bf16-mixed where the hardware has it, as float16 gradients can underflow)"
    )
    return True
