"""Small MLP classifier as a chain of units (one unit per layer), same staged protocol as
models.lm.LM: batch = {"x": [B, D] float, "y": [B] int labels, "mask": [B] float}; the last unit
returns per-example cross entropy x mask."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import flax.linen as nn

from jaxodc.modeling.units import StagedModel


class _Layer(nn.Module):
    features: int
    last: bool = False

    @nn.compact
    def __call__(self, x, y=None, mask=None):
        h = nn.Dense(self.features)(x)
        if not self.last:
            return jax.nn.relu(h)
        logp = jax.nn.log_softmax(h, axis=-1)
        return -jnp.take_along_axis(logp, y[:, None].astype(jnp.int32), axis=-1)[:, 0] * mask


class MLP(StagedModel):
    def __init__(self, sizes: tuple[int, ...] = (16, 64, 64, 10)):
        if len(sizes) < 2:
            raise ValueError(f"MLP needs at least input and output sizes, got {sizes}")
        self.sizes = tuple(sizes)
        n = len(sizes) - 1
        self.unit_names = tuple(f"layer_{i}" for i in range(n))
        self._layers = [_Layer(sizes[i + 1], last=(i == n - 1)) for i in range(n)]

    def init(self, rng: jax.Array) -> dict:
        out = jax.jit(self._init)(rng)
        return {n: out[n] for n in self.unit_names}  # jit returns dicts key-sorted; keep unit order

    def _init(self, rng: jax.Array) -> dict:
        ks = jax.random.split(rng, len(self._layers))
        params, x = {}, jnp.zeros((1, self.sizes[0]), jnp.float32)
        for i, (name, layer) in enumerate(zip(self.unit_names, self._layers)):
            if layer.last:
                params[name] = layer.init(ks[i], x, jnp.zeros((1,), jnp.int32), jnp.zeros((1,)))["params"]
            else:
                params[name] = layer.init(ks[i], x)["params"]
                x = jnp.zeros((1, self.sizes[i + 1]), jnp.float32)
        return params

    def apply_unit(self, name: str, params, carry, batch):
        i = self.unit_names.index(name)
        layer = self._layers[i]
        x = batch["x"] if i == 0 else carry
        if layer.last:
            return layer.apply({"params": params}, x, batch["y"], batch["mask"])
        return layer.apply({"params": params}, x)
