"""The trainer's view of the ODC runtime (the `OdcRuntime` hook of jaxodc.train.collective),
backed by jaxodc.odc.Runtime and the FFI ops."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxodc.odc import Runtime
from jaxodc.ops import odc_gather, odc_gather_pieces
from jaxodc.train.collective import OdcRuntime
from jaxodc.train.units import Layout


class TrainerRuntime(OdcRuntime):
    """Units are the layout's units in order; each is registered padded (K_pad = W * shard).

    `per_leaf` (default: on the CPU backend, where the range push exists): a unit's gradient is
    pushed parameter by parameter (odc_gather_pieces), never concatenated into one unit-sized
    buffer, which saves a unit of peak memory per microbatch."""

    def __init__(self, runtime: Runtime, compute_dtype=jnp.float32, per_leaf: bool | None = None):
        self.runtime = runtime
        self.rank, self.world = runtime.rank, runtime.world
        self.compute_dtype = compute_dtype
        self.per_leaf = jax.default_backend() == "cpu" if per_leaf is None else bool(per_leaf)

    @classmethod
    def create(cls, layout: Layout, ctx, compute_dtype=jnp.float32, per_leaf: bool | None = None,
               **kwargs) -> "TrainerRuntime":
        """Builds the native runtime for `layout` from a jaxodc.dist.Context (kwargs: Runtime's)."""
        return cls(Runtime.create([u.padded for u in layout.units], ctx, **kwargs), compute_dtype, per_leaf)

    def gather(self, shard: jax.Array, spec, version: jax.Array):
        f32 = lambda x: x.astype(jnp.float32) if x.dtype != jnp.float32 else x  # noqa: E731
        if self.per_leaf:
            return tuple(f32(x) for x in odc_gather_pieces(shard, version, runtime=self.runtime, unit=spec.index,
                                                           numel=spec.padded, pieces=spec.leaf_pieces(),
                                                           dtype=self.compute_dtype))
        return f32(odc_gather(shard, version, runtime=self.runtime, unit=spec.index, numel=spec.padded,
                              dtype=self.compute_dtype))

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
