"""JAX ops over the ODC runtime: `odc_gather` reads a whole unit from its owners; its VJP pushes
the cotangent to the owners (scatter-accumulate), so `jax.grad` of an ordinary loss drives the
whole exchange layer by layer. Both run as XLA FFI custom calls inside `jax.jit`."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxodc import _native

_native.register_targets()


def _reject_vmap(op: str, unit: int, *args) -> None:
    # Named here because jax's own error for an unbatchable ffi_call does not say which op.
    # (BatchTracer is not public API; its class name is stable across jax 0.4-0.12.)
    if any(isinstance(a, jax.core.Tracer) and type(a).__name__ == "BatchTracer" for a in args):
        raise NotImplementedError(
            f"{op} (unit {unit}) cannot be vmapped: each call moves one unit between ranks. Gather "
            "outside vmap and vmap only the computation that uses the gathered parameters.")


def _gather_call(local_shard, version, *, unit: int, numel: int, dtype):
    return jax.ffi.ffi_call(
        "jaxodc_odc_gather", jax.ShapeDtypeStruct((numel,), dtype),
    )(local_shard, version, unit=np.int64(unit))


def _scatter_call(local_shard, grad, version, *, unit: int):
    return jax.ffi.ffi_call(
        "jaxodc_odc_scatter", jax.ShapeDtypeStruct((), jnp.uint32), has_side_effect=True,
    )(local_shard, grad, version, unit=np.int64(unit))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _gather(local_shard, version, unit, numel, dtype):
    return _gather_call(local_shard, version, unit=unit, numel=numel, dtype=dtype)


def _gather_fwd(local_shard, version, unit, numel, dtype):
    return _gather_call(local_shard, version, unit=unit, numel=numel, dtype=dtype), (local_shard, version)


def _gather_bwd(unit, numel, dtype, residuals, cotangent):
    local_shard, version = residuals
    token = _scatter_call(local_shard, cotangent, version, unit=unit)
    # The shard's own gradient went to its owners; the zero returned here depends on the push's
    # token so the push is ordered before anything that consumes it.
    zero = jnp.zeros_like(local_shard) + token.astype(local_shard.dtype) * 0
    return zero, np.zeros(np.shape(version), dtype=jax.dtypes.float0)


_gather.defvjp(_gather_fwd, _gather_bwd)


def odc_gather(local_shard: jax.Array, version, *, unit: int, numel: int, dtype=jnp.float32) -> jax.Array:
    """Full flat unit `unit` (numel elements, `dtype`) at parameter version >= `version`.

    local_shard: this rank's float32 shard of the unit (the differentiation path: its gradient
    is zero locally because the unit's gradient is pushed to every owner in the backward pass).
    version: int32 scalar (a traced value, so the jitted step does not recompile per minibatch).
    """
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise TypeError(f"odc_gather: unit {unit}: dtype must be float32 or bfloat16, got {dtype}")
    if local_shard.dtype != jnp.float32 or local_shard.ndim != 1:
        raise TypeError(f"odc_gather: unit {unit}: local shard must be a 1-D float32 array, got "
                        f"{local_shard.dtype}{list(local_shard.shape)}")
    _reject_vmap("odc_gather", unit, local_shard, version)
    version = jnp.asarray(version, dtype=jnp.int32)
    if version.ndim != 0:
        raise TypeError(f"odc_gather: unit {unit}: version must be a scalar")
    return _gather(local_shard, version, int(unit), int(numel), jnp.dtype(dtype))


def odc_gather_into(buffer: jax.Array, local_shard: jax.Array, version, *, unit: int) -> jax.Array:
    """`odc_gather` into an existing flat buffer (float32 or bfloat16) that XLA may reuse for the
    result: under `jax.jit(..., donate_argnums=0)` no new output is allocated, which keeps
    persistent gather buffers (e.g. a prefetch double buffer) free of allocation costs.
    Not differentiable; use odc_gather inside losses."""
    _reject_vmap("odc_gather_into", unit, buffer, local_shard, version)
    if buffer.ndim != 1 or buffer.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"odc_gather_into: unit {unit}: buffer must be a flat float32/bfloat16 array")
    return jax.ffi.ffi_call("jaxodc_odc_gather_into", jax.ShapeDtypeStruct(buffer.shape, buffer.dtype),
                            input_output_aliases={0: 0})(
        buffer, local_shard, jnp.asarray(version, dtype=jnp.int32), unit=np.int64(unit))


def odc_scatter_accumulate(local_shard: jax.Array, grad: jax.Array, version, *, unit: int) -> jax.Array:
    """Pushes `grad` (the full flat unit) to the owners' accumulators; returns an ordering token."""
    _reject_vmap("odc_scatter_accumulate", unit, local_shard, grad, version)
    return _scatter_call(local_shard, grad, jnp.asarray(version, dtype=jnp.int32), unit=int(unit))
