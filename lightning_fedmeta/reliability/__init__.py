"""Reliability options: participation, robust aggregation rules, simulated attacks, and their parsed, checked
combination."""

# the public names of the module this package replaced (reliability.py), so
# `from lightning_fedmeta.reliability import X` keeps working
from lightning_fedmeta.reliability.options import (
    Reliability,
    uploads_delta,
)

__all__ = [
    "Reliability",
    "uploads_delta",
]
