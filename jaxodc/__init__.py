"""jaxodc: on-demand communication (ODC) and a fault-tolerant communicator for JAX post-training.

`import jaxodc` stays light: the public names below load their modules (jax, the native extension)
on first use. Packages, lowest first: `ops` (FFI ops) and `odc` (the ODC runtime); `balance`
(planning without a trainer); `train` (the sharded trainers, checkpoints); `coord` / `comm` (the
fault-tolerant communicator); `optim` (clipping over shards, DiLoCo); `launch` (launcher, process
context, rendezvous); `cli` (the `jaxodc` command); `models` (example Flax models); `bench`.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from jaxodc._version import __version__

_PUBLIC = {
    # sharded trainer
    "Trainer": "jaxodc.train.api",
    "sharded_step": "jaxodc.train.api",
    "ShardedStep": "jaxodc.train.api",
    "MixedPrecision": "jaxodc.modeling.precision",
    "ShardedTrainer": "jaxodc.train.core",
    "StepResult": "jaxodc.train.core",
    "ConfigMismatchError": "jaxodc.train.core",
    "MinibatchRecord": "jaxodc.train.metrics",
    "CheckpointError": "jaxodc.train.checkpoint",
    "clip_by_global_norm": "jaxodc.optim.clipping",
    "global_norm": "jaxodc.optim.clipping",
    # ODC primitives
    "Runtime": "jaxodc.odc",
    "OdcError": "jaxodc.odc",
    "OdcTimeoutError": "jaxodc.odc",
    "PeerError": "jaxodc.odc",
    "LayoutMismatchError": "jaxodc.odc",
    "odc_gather": "jaxodc.ops",
    "odc_scatter_accumulate": "jaxodc.ops",
    "segment_attention": "jaxodc.ops",
    # fault-tolerant communicator and DiLoCo
    "Communicator": "jaxodc.comm",
    "CommError": "jaxodc.comm",
    "CollectiveAborted": "jaxodc.comm",
    "SyncInfo": "jaxodc.comm",
    "DiLoCo": "jaxodc.optim",
    "diloco_outer": "jaxodc.optim",
    "PseudoGradientReducer": "jaxodc.optim",
    "default_outer_optimizer": "jaxodc.optim",
}

__all__ = ["__version__", *_PUBLIC]

if TYPE_CHECKING:  # the same names, eagerly, for type checkers and IDEs
    from jaxodc.comm import CollectiveAborted, CommError, Communicator, SyncInfo
    from jaxodc.odc import LayoutMismatchError, OdcError, OdcTimeoutError, PeerError, Runtime
    from jaxodc.ops import odc_gather, odc_scatter_accumulate, segment_attention
    from jaxodc.optim import DiLoCo, PseudoGradientReducer, default_outer_optimizer, diloco_outer
    from jaxodc.optim.clipping import clip_by_global_norm, global_norm
    from jaxodc.train.api import ShardedStep, Trainer, sharded_step
    from jaxodc.train.checkpoint import CheckpointError
    from jaxodc.train.core import ConfigMismatchError, ShardedTrainer, StepResult
    from jaxodc.train.metrics import MinibatchRecord
    from jaxodc.modeling.precision import MixedPrecision


def __getattr__(name):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'jaxodc' has no attribute {name!r}")


def __dir__():
    return sorted(__all__)
