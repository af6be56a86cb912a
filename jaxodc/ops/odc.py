"""JAX ops over the ODC runtime: `odc_gather` reads a whole unit from its owners; its VJP pushes
the cotangent to the owners (scatter-accumulate), so `jax.grad` of an ordinary loss drives the
whole exchange layer by layer. Both run as XLA FFI custom calls inside `jax.jit`.
`odc_gather_pieces` returns the unit cut into pieces (its parameters) and pushes each piece's
cotangent on its own (CPU), so the unit's gradient is never concatenated into one buffer."""
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


def _scatter_range_call(local_shard, grad, version, *, unit: int, offset: int):
    return jax.ffi.ffi_call(
        "jaxodc_odc_scatter_range", jax.ShapeDtypeStruct((), jnp.uint32), has_side_effect=True,
    )(local_shard, grad, version, unit=np.int64(unit), offset=np.int64(offset))


def _zero_after(local_shard, tokens):
    # The shard's own gradient went to its owners; the zero returned for it depends on the pushes'
    # tokens so the pushes are ordered before anything that consumes it.
    return jnp.zeros_like(local_shard) + sum(tokens).astype(local_shard.dtype) * 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _gather(local_shard, version, unit, numel, dtype):
    return _gather_call(local_shard, version, unit=unit, numel=numel, dtype=dtype)


def _gather_fwd(local_shard, version, unit, numel, dtype):
    return _gather_call(local_shard, version, unit=unit, numel=numel, dtype=dtype), (local_shard, version)


def _gather_bwd(unit, numel, dtype, residuals, cotangent):
    local_shard, version = residuals
    token = _scatter_call(local_shard, cotangent, version, unit=unit)
    return _zero_after(local_shard, [token]), np.zeros(np.shape(version), dtype=jax.dtypes.float0)


_gather.defvjp(_gather_fwd, _gather_bwd)


def _cut(full, pieces):
    return tuple(full[o:o + n] for o, n in pieces)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _gather_pieces(local_shard, version, unit, numel, pieces, dtype):
    return _cut(_gather_call(local_shard, version, unit=unit, numel=numel, dtype=dtype), pieces)


def _gather_pieces_fwd(local_shard, version, unit, numel, pieces, dtype):
    return _gather_pieces(local_shard, version, unit, numel, pieces, dtype), (local_shard, version)


def _gather_pieces_bwd(unit, numel, pieces, dtype, residuals, cotangents):
    local_shard, version = residuals
    tokens = [_scatter_range_call(local_shard, ct, version, unit=unit, offset=o)
              for ct, (o, _) in zip(cotangents, pieces)]
    return _zero_after(local_shard, tokens), np.zeros(np.shape(version), dtype=jax.dtypes.float0)


_gather_pieces.defvjp(_gather_pieces_fwd, _gather_pieces_bwd)


def _checked_version(op: str, unit: int, local_shard, version, dtype) -> jax.Array:
    """Validates a gather's arguments (naming op and unit); the version as an int32 scalar."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise TypeError(f"{op}: unit {unit}: dtype must be float32 or bfloat16, got {dtype}")
    if local_shard.dtype != jnp.float32 or local_shard.ndim != 1:
        raise TypeError(f"{op}: unit {unit}: local shard must be a 1-D float32 array, got "
                        f"{local_shard.dtype}{list(local_shard.shape)}")
    _reject_vmap(op, unit, local_shard, version)
    version = jnp.asarray(version, dtype=jnp.int32)
    if version.ndim != 0:
        raise TypeError(f"{op}: unit {unit}: version must be a scalar")
    return version


def odc_gather(local_shard: jax.Array, version, *, unit: int, numel: int, dtype=jnp.float32) -> jax.Array:
    """Full flat unit `unit` (numel elements, `dtype`) at parameter version >= `version`.

    local_shard: this rank's float32 shard of the unit (the differentiation path: its gradient
    is zero locally because the unit's gradient is pushed to every owner in the backward pass).
    version: int32 scalar (a traced value, so the jitted step does not recompile per minibatch).
    """
    version = _checked_version("odc_gather", unit, local_shard, version, dtype)
    return _gather(local_shard, version, int(unit), int(numel), jnp.dtype(dtype))


def odc_gather_pieces(local_shard: jax.Array, version, *, unit: int, numel: int, pieces, dtype=jnp.float32):
    """`odc_gather`, returned as the flat slices [offset, offset + size) of `pieces` (a sequence
    of (offset, size), e.g. one per parameter of the unit). Its VJP pushes each piece's cotangent
    to the owners separately (`odc_scatter_accumulate` with an offset), as soon as XLA has it, so
    the unit's gradient is never concatenated and each piece's can be freed after its push.
    Elements outside every piece (padding) receive no gradient. CPU only (the range push has no
    CUDA handler; use odc_gather there)."""
    pieces = tuple((int(o), int(n)) for o, n in pieces)
    for o, n in pieces:
        if o < 0 or n < 0 or o + n > numel:
            raise ValueError(f"odc_gather_pieces: unit {unit}: piece [{o}, {o + n}) outside its {numel} elements")
    version = _checked_version("odc_gather_pieces", unit, local_shard, version, dtype)
    return _gather_pieces(local_shard, version, int(unit), int(numel), pieces, jnp.dtype(dtype))


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


def odc_scatter_accumulate(local_shard: jax.Array, grad: jax.Array, version, *, unit: int,
                           offset: int | None = None) -> jax.Array:
    """Pushes `grad` (the full flat unit, or with `offset` its elements [offset, offset +
    grad.size), CPU only) to the owners' accumulators; returns an ordering token."""
    _reject_vmap("odc_scatter_accumulate", unit, local_shard, grad, version)
    version = jnp.asarray(version, dtype=jnp.int32)
    if offset is None:
        return _scatter_call(local_shard, grad, version, unit=int(unit))
    return _scatter_range_call(local_shard, jnp.ravel(grad), version, unit=int(unit), offset=int(offset))
