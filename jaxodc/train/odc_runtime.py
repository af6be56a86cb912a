"""The trainer's view of the ODC runtime (the `OdcRuntime` hook of jaxodc.train.collective),
backed by jaxodc.odc.Runtime and the FFI ops."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxodc.odc import Runtime
from jaxodc.ops import odc_gather
from jaxodc.train.collective import OdcRuntime
from jaxodc.train.units import Layout


class TrainerRuntime(OdcRuntime):
    """Units are the layout's units in order; each is registered padded (K_pad = W * shard)."""

    def __init__(self, runtime: Runtime, compute_dtype=jnp.float32):
        self.runtime = runtime
        self.rank, self.world = runtime.rank, runtime.world
        self.compute_dtype = compute_dtype

    @classmethod
    def create(cls, layout: Layout, ctx, **kwargs) -> "TrainerRuntime":
        """Builds the native runtime for `layout` from a jaxodc.dist.Context."""
        return cls(Runtime.create([u.padded for u in layout.units], ctx, **kwargs))

    def gather(self, shard: jax.Array, spec, version: jax.Array) -> jax.Array:
        full = odc_gather(shard, version, unit=spec.index, numel=spec.padded, dtype=self.compute_dtype)
        return full.astype(jnp.float32) if full.dtype != jnp.float32 else full

    def publish(self, unit: int, shard: np.ndarray, version: int) -> None:
        self.runtime.publish(unit, shard, version)

    def master_view(self, unit: int) -> np.ndarray:
        return self.runtime.master_view(unit)

    def grad_view(self, unit: int) -> np.ndarray:
        return self.runtime.grad_view(unit)

    def clear_grad(self, unit: int) -> None:
        self.runtime.clear_grad(unit)

    def publish_in_place(self, unit: int, version: int) -> None:
        self.runtime.publish_in_place(unit, version)

    def done(self, version: int) -> None:
        self.runtime.done(version)

    def wait_complete(self, version: int) -> None:
        self.runtime.wait_complete(version)

    def fetch_grad(self, unit: int) -> np.ndarray:
        return self.runtime.fetch_grad(unit)

    def allgather_scalar(self, version: int, x: float) -> np.ndarray:
        return self.runtime.allgather_scalar(version, x)

    def claim(self, version: int, owner: int, count: int, steal: bool) -> int:
        return self.runtime.claim(version, owner, count, steal)

    def close(self, barrier: bool = True) -> None:
        self.runtime.close(barrier=barrier)
