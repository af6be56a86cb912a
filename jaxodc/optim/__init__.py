"""Optimizers for sharded and distributed training: global-norm clipping over shards
(`clipping`), pytree averaging over the fault-tolerant communicator (`reducer`) and DiLoCo /
async DiLoCo (`diloco`); the last two load on first use."""
import importlib

from jaxodc.optim.clipping import clip_by_global_norm, global_norm, global_sum

_LAZY = {"DiLoCo": "diloco", "default_outer_optimizer": "diloco", "diloco_outer": "diloco",
         "pseudo_gradient": "diloco", "PseudoGradientReducer": "reducer", "PendingAverage": "reducer"}

__all__ = ["clip_by_global_norm", "global_norm", "global_sum", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f"jaxodc.optim.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'jaxodc.optim' has no attribute {name!r}")
