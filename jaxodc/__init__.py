"""jaxodc: on-demand communication (ODC), compressed gradient exchange and a fault-tolerant
communicator for JAX post-training.

`import jaxodc` stays light: the public names below load their modules (jax, the native
extension) on first use. Subpackages: `jaxodc.odc` (runtime), `jaxodc.ops` (FFI ops),
`jaxodc.train` (trainer, balancing, checkpoints), `jaxodc.optim` (DiLoCo), `jaxodc.comm` /
`jaxodc.coord` (fault-tolerant communicator), `jaxodc.dist` / `jaxodc.launch`.
"""
import importlib

from jaxodc._version import __version__

_PUBLIC = {
    # sharded trainer
    "Trainer": "jaxodc.train.api",
    "sharded_step": "jaxodc.train.api",
    "ShardedStep": "jaxodc.train.api",
    "ConfigMismatchError": "jaxodc.train.api",
    "clip_by_global_norm": "jaxodc.train.collective",
    "global_norm": "jaxodc.train.collective",
    "CheckpointError": "jaxodc.train.checkpoint",
    # ODC primitives
    "Runtime": "jaxodc.odc",
    "odc_gather": "jaxodc.ops",
    "odc_scatter_accumulate": "jaxodc.ops",
    "segment_attention": "jaxodc.ops",
    # fault-tolerant communicator and DiLoCo
    "Communicator": "jaxodc.comm",
    "DiLoCo": "jaxodc.optim",
    "diloco_outer": "jaxodc.optim",
    "async_diloco_outer": "jaxodc.optim",
    "PseudoGradientReducer": "jaxodc.optim",
    "default_outer_optimizer": "jaxodc.optim",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'jaxodc' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
