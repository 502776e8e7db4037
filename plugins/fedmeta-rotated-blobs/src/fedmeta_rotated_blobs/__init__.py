"""fedmeta-rotated-blobs: a synthetic feature-shift dataset for lightning_fedmeta (entry point ``rotated_blobs``)."""

from fedmeta_rotated_blobs.blobs import rotated_blobs

__version__ = "0.1.0"

__all__ = ["__version__", "rotated_blobs"]
