"""A small image classifier with BatchNorm, written the usual flax.linen way (not in the unit
protocol): conv -> BatchNorm -> relu -> 2x2 average pool, conv -> BatchNorm -> relu, global average
pool, dense head. Sized for scikit-learn's 8x8 digits (`jaxodc.data.load_digits`).

batch = {"x": [B, H, W, C] float, "y": [B] int labels, "mask": [B] float (0: a padding slot)};
`__call__(batch, train)` returns per-image cross entropy x mask. In training, BatchNorm normalises
with the statistics of the microbatch's real images (padding slots excluded) and updates
`batch_stats`: train it through `linen_loss_fn(CNN(), loss, mutable=("batch_stats",))`; the sharded
trainers make the minibatch's new statistics the image-weighted mean of its microbatches' (see
jaxodc/modeling/state.py).
"""
from __future__ import annotations

from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp


class CNN(nn.Module):
    features: Sequence[int] = (8, 16)
    n_classes: int = 10
    momentum: float = 0.9

    @nn.compact
    def __call__(self, batch, train: bool = True):
        x = batch["x"]
        valid = batch["mask"] > 0
        # An all-padding microbatch (collective pads to equal counts) normalises over every slot,
        # so its statistics stay finite; its weight in the minibatch's state is 0.
        rows = jnp.where(jnp.any(valid), valid, True)[:, None, None, None]
        for i, f in enumerate(self.features):
            x = nn.Conv(f, (3, 3), use_bias=False)(x)  # BatchNorm subtracts any bias
            x = nn.BatchNorm(use_running_average=not train, momentum=self.momentum)(
                x, mask=jnp.broadcast_to(rows, x.shape))
            x = nn.relu(x)
            if i == 0:
                x = nn.avg_pool(x, (2, 2), (2, 2))
        logits = nn.Dense(self.n_classes)(jnp.mean(x, axis=(1, 2)))
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, batch["y"][:, None].astype(jnp.int32), axis=-1)[:, 0] * batch["mask"]
