"""Client-level differential privacy: the mechanism and accountant, its random draws, and the privacy budget across
fits."""

# the public names of the module this package replaced (privacy.py), so
# `from lightning_fedmeta.privacy import X` keeps working
from lightning_fedmeta.privacy.mechanism import (
    AdaptiveClipSpec,
    DPSpec,
    PrivacyAccountant,
    adapt_clip,
    clip_rows,
    gaussian_noise,
    noise_multipliers,
    parse_dp,
)

__all__ = [
    "AdaptiveClipSpec",
    "DPSpec",
    "PrivacyAccountant",
    "adapt_clip",
    "clip_rows",
    "gaussian_noise",
    "noise_multipliers",
    "parse_dp",
]
