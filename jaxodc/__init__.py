"""jaxodc: on-demand communication (ODC), compressed gradient exchange and a fault-tolerant
communicator for JAX post-training."""
from jaxodc._version import __version__

__all__ = ["__version__"]
