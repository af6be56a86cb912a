"""Outer optimizers over the fault-tolerant communicator: DiLoCo and async DiLoCo (see
jaxodc.optim.diloco). Importing this package imports jax and optax."""
from jaxodc.optim.diloco import (
    DiLoCo,
    PseudoGradientReducer,
    async_diloco_outer,
    default_outer_optimizer,
    diloco_outer,
    pseudo_gradient,
)

__all__ = ["DiLoCo", "PseudoGradientReducer", "async_diloco_outer", "default_outer_optimizer", "diloco_outer",
           "pseudo_gradient"]
