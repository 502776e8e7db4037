"""fedmeta-centered-clip: centered clipping as a lightning_fedmeta robust rule (entry point ``centered_clipping``)."""

from fedmeta_centered_clip.rule import CenteredClipping

__version__ = "0.1.0"

__all__ = ["CenteredClipping", "__version__"]
