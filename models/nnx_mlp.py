"""A small flax.nnx classifier written the usual nnx way (not in the unit protocol): an input
projection, residual blocks (Linear, LayerNorm, Dropout) held in a list, an output head that reuses
the input projection's bias-free sibling `shared` twice (a parameter used in two places).
batch = {"x": [B, D] float, "y": [B] int labels, "mask": [B] float}; `__call__` returns per-example
cross entropy x mask."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Block(nnx.Module):
    def __init__(self, width: int, dropout: float, rngs: nnx.Rngs):
        self.linear = nnx.Linear(width, width, rngs=rngs)
        self.norm = nnx.LayerNorm(width, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(jax.nn.gelu(self.linear(self.norm(x))))


class Classifier(nnx.Module):
    def __init__(self, d_in: int = 8, width: int = 16, n_blocks: int = 3, n_classes: int = 5,
                 dropout: float = 0.0, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(d_in, width, rngs=rngs)
        self.blocks = nnx.List([Block(width, dropout, rngs) for _ in range(n_blocks)])
        self.shared = nnx.Linear(width, width, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(width, n_classes, rngs=rngs)

    def __call__(self, batch):
        x = self.inp(batch["x"])
        for block in self.blocks:
            x = block(x)
        x = self.shared(jax.nn.tanh(self.shared(x)))  # one parameter, two uses
        logp = jax.nn.log_softmax(self.out(x), axis=-1)
        return -jnp.take_along_axis(logp, batch["y"][:, None].astype(jnp.int32), axis=-1)[:, 0] * batch["mask"]
