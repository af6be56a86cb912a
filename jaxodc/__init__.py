"""jaxodc: on-demand communication (ODC), compressed gradient exchange and a fault-tolerant
communicator for JAX post-training.

Subpackages import lazily-heavy pieces (jax, the native extension) only when used:
`jaxodc.odc` (runtime), `jaxodc.ops` (FFI ops), `jaxodc.train` (trainer, balancing),
`jaxodc.comm` / `jaxodc.coord` (fault-tolerant communicator), `jaxodc.dist` / `jaxodc.launch`.
"""
from jaxodc._version import __version__

__all__ = ["__version__"]
