"""fedmeta-quantity-skew: Dirichlet client sizes, IID labels; a lightning_fedmeta partitioner (``quantity_skew``)."""

from fedmeta_quantity_skew.partition import quantity_skew

__version__ = "0.1.0"

__all__ = ["__version__", "quantity_skew"]
