"""JAX ops over the ODC runtime: `odc_gather` reads a whole unit from its owners; its VJP pushes
the cotangent to the owners (scatter-accumulate), so `jax.grad` of an ordinary loss drives the
whole exchange layer by layer. Both run as XLA FFI custom calls inside `jax.jit`.
`odc_gather_pieces` returns the unit cut into pieces (its parameters) and pushes each piece's
cotangent on its own, so the unit's gradient is never concatenated into one buffer.

Every op names its runtime explicitly (`runtime=`: a `jaxodc.odc.Runtime` or its `handle`, passed
to the handler as an np.int64 attribute), so one process may hold several runtimes."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxodc import _native
from jaxodc.ops._common import native_handle, new_token, pinned_ffi_call

# An extension built before the one-buffer-per-piece gather lacks it: pieces are then cut from the
# whole unit (same values, a unit's worth more memory).
_GATHER_PIECES = "jaxodc_odc_gather_pieces" in _native.register_targets()


def _reject_vmap(op: str, unit: int, *args) -> None:
    # Named here because jax's own error for an unbatchable ffi_call does not say which op.
    # (BatchTracer is not public API; its class name is stable across jax 0.4-0.12.)
    if any(isinstance(a, jax.core.Tracer) and type(a).__name__ == "BatchTracer" for a in args):
        raise NotImplementedError(
            f"{op} (unit {unit}) cannot be vmapped: each call moves one unit between ranks. Gather "
            "outside vmap and vmap only the computation that uses the gathered parameters.")


def _gather_call(local_shard, version, *, runtime: np.int64, unit: int, numel: int, dtype):
    return jax.ffi.ffi_call(
        "jaxodc_odc_gather", jax.ShapeDtypeStruct((numel,), dtype),
    )(local_shard, version, runtime=runtime, unit=np.int64(unit))


def _scatter_call(local_shard, grad, version, token, *, runtime: np.int64, unit: int, offset: int | None = None,
                  pinned: bool = True):
    # offset None: `grad` is the whole unit; else elements [offset, offset + grad.size) of it.
    # pinned: the caller consumes the token (the VJPs below, through _zero_after); the public op
    # keeps jax's effect, so a push whose token is dropped still happens.
    target, attrs = "jaxodc_odc_scatter", {}
    if offset is not None:
        target, attrs = "jaxodc_odc_scatter_range", {"offset": np.int64(offset)}
    token_type = jax.ShapeDtypeStruct((1,), jnp.int32)
    call = pinned_ffi_call(target, token_type) if pinned else jax.ffi.ffi_call(target, token_type, has_side_effect=True)
    return call(local_shard, grad, version, token, runtime=runtime, unit=np.int64(unit), **attrs)


def _zero_after(local_shard, tokens):
    # The shard's own gradient went to its owners; the zero returned for it depends on the pushes'
    # tokens so the pushes are ordered before anything that consumes it.
    return jnp.zeros_like(local_shard) + jnp.concatenate(tokens).sum().astype(local_shard.dtype) * 0


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _gather(local_shard, version, runtime, unit, numel, dtype):
    return _gather_call(local_shard, version, runtime=runtime, unit=unit, numel=numel, dtype=dtype)


def _gather_fwd(local_shard, version, runtime, unit, numel, dtype):
    full = _gather_call(local_shard, version, runtime=runtime, unit=unit, numel=numel, dtype=dtype)
    return full, (local_shard, version)


def _gather_bwd(runtime, unit, numel, dtype, residuals, cotangent):
    local_shard, version = residuals
    token = _scatter_call(local_shard, cotangent, version, new_token(), runtime=runtime, unit=unit)
    return _zero_after(local_shard, [token]), np.zeros(np.shape(version), dtype=jax.dtypes.float0)


_gather.defvjp(_gather_fwd, _gather_bwd)


def _cut(full, pieces):
    return tuple(full[o:o + n] for o, n in pieces)


def _in_order(pieces) -> bool:
    return all(o >= (pieces[i - 1][0] + pieces[i - 1][1] if i else 0) for i, (o, _) in enumerate(pieces))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _gather_pieces(local_shard, version, runtime, unit, numel, pieces, dtype):
    if not (_GATHER_PIECES and _in_order(pieces)):  # overlapping or unsorted pieces: cut from the whole unit
        return _cut(_gather_call(local_shard, version, runtime=runtime, unit=unit, numel=numel, dtype=dtype), pieces)
    # Straight into one buffer per piece: slicing a whole gathered unit makes XLA copy every
    # slice at a non-zero offset, a second unit's worth of memory beside the unit.
    return tuple(jax.ffi.ffi_call("jaxodc_odc_gather_pieces", tuple(jax.ShapeDtypeStruct((n,), dtype) for _, n in pieces))(
        local_shard, version, runtime=runtime, unit=np.int64(unit), offsets=np.array([o for o, _ in pieces], np.int64)))


def _gather_pieces_fwd(local_shard, version, runtime, unit, numel, pieces, dtype):
    return _gather_pieces(local_shard, version, runtime, unit, numel, pieces, dtype), (local_shard, version)


def _gather_pieces_bwd(runtime, unit, numel, pieces, dtype, residuals, cotangents):
    local_shard, version = residuals
    # A fresh token each: the pushes need no order among themselves, so each may leave as soon as
    # XLA has its cotangent.
    tokens = [_scatter_call(local_shard, ct, version, new_token(), runtime=runtime, unit=unit, offset=o)
              for ct, (o, _) in zip(cotangents, pieces)]
    return _zero_after(local_shard, tokens), np.zeros(np.shape(version), dtype=jax.dtypes.float0)


_gather_pieces.defvjp(_gather_pieces_fwd, _gather_pieces_bwd)


def _checked(op: str, runtime, unit: int, local_shard, version, dtype) -> tuple[np.int64, jax.Array]:
    """Validates a gather's arguments (naming op and unit); the runtime attribute and the version
    as an int32 scalar."""
    handle = native_handle(runtime, op, "jaxodc.odc.Runtime")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise TypeError(f"{op}: unit {unit}: dtype must be float32 or bfloat16, got {dtype}")
    if local_shard.dtype != jnp.float32 or local_shard.ndim != 1:
        raise TypeError(f"{op}: unit {unit}: local shard must be a 1-D float32 array, got "
                        f"{local_shard.dtype}{list(local_shard.shape)}")
    _reject_vmap(op, unit, local_shard, version)
    version = jnp.asarray(version, dtype=jnp.int32)
    if version.ndim != 0:
        raise TypeError(f"{op}: unit {unit}: version must be a scalar")
    return handle, version


def odc_gather(local_shard: jax.Array, version, *, runtime, unit: int, numel: int, dtype=jnp.float32) -> jax.Array:
    """The whole flat unit `unit`, read from every owner at parameter version >= `version`.

    Differentiable: the backward pass pushes the cotangent to the owners' accumulators
    (scatter-accumulate) and returns a zero gradient for `local_shard`.

    Args:
      local_shard: this rank's float32 shard of the unit (the differentiation path).
      version: int32 scalar; a traced value, so the jitted step does not recompile per minibatch.
      runtime: the `jaxodc.odc.Runtime` holding the unit (or its `handle`).
      unit: the unit's index in the runtime's layout.
      numel: the unit's number of elements.
      dtype: float32 or bfloat16, the dtype of the result (cast after the copy).

    Returns:
      The unit, shape (numel,), of `dtype`.
    """
    handle, version = _checked("odc_gather", runtime, unit, local_shard, version, dtype)
    return _gather(local_shard, version, handle, int(unit), int(numel), jnp.dtype(dtype))


def odc_gather_pieces(local_shard: jax.Array, version, *, runtime, unit: int, numel: int, pieces,
                      dtype=jnp.float32) -> tuple[jax.Array, ...]:
    """`odc_gather`, returned as the flat slices of `pieces` (e.g. one per parameter of the unit).

    Its VJP pushes each piece's cotangent to the owners separately, as soon as XLA has it, so the
    unit's gradient is never concatenated and each piece's can be freed after its push. Elements
    outside every piece (padding) receive no gradient. On CUDA (docs/gpu.md, never yet run on a
    GPU) the pieces are staged through host memory or cut from a device scratch of the unit, and
    each range push leaves through host memory.

    Args:
      local_shard, version, runtime, unit, numel, dtype: as for `odc_gather`.
      pieces: sequence of (offset, size) within [0, numel).

    Returns:
      One array per piece, shape (size,), of `dtype`.
    """
    pieces = tuple((int(o), int(n)) for o, n in pieces)
    for o, n in pieces:
        if o < 0 or n < 0 or o + n > numel:
            raise ValueError(f"odc_gather_pieces: unit {unit}: piece [{o}, {o + n}) outside its {numel} elements")
    handle, version = _checked("odc_gather_pieces", runtime, unit, local_shard, version, dtype)
    return _gather_pieces(local_shard, version, handle, int(unit), int(numel), pieces, jnp.dtype(dtype))


def odc_gather_into(buffer: jax.Array, local_shard: jax.Array, version, *, runtime, unit: int) -> jax.Array:
    """`odc_gather` into an existing flat buffer that XLA may reuse for the result.

    Under `jax.jit(..., donate_argnums=0)` no new output is allocated, which keeps persistent
    gather buffers (e.g. a prefetch double buffer) free of allocation costs. Not differentiable;
    use odc_gather inside losses.

    Args:
      buffer: flat float32 or bfloat16 array of the unit's size (its dtype is the result's).
      local_shard, version, runtime, unit: as for `odc_gather`.

    Returns:
      The unit, in `buffer`'s shape and dtype (aliased to it).
    """
    handle = native_handle(runtime, "odc_gather_into", "jaxodc.odc.Runtime")
    _reject_vmap("odc_gather_into", unit, buffer, local_shard, version)
    if buffer.ndim != 1 or buffer.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"odc_gather_into: unit {unit}: buffer must be a flat float32/bfloat16 array")
    return jax.ffi.ffi_call("jaxodc_odc_gather_into", jax.ShapeDtypeStruct(buffer.shape, buffer.dtype),
                            input_output_aliases={0: 0})(
        buffer, local_shard, jnp.asarray(version, dtype=jnp.int32), runtime=handle, unit=np.int64(unit))


def odc_scatter_accumulate(local_shard: jax.Array, grad: jax.Array, version, *, runtime, unit: int,
                           offset: int | None = None, token=None) -> jax.Array:
    """Adds `grad` into the owners' accumulators of unit `unit` for minibatch `version`.

    Args:
      local_shard: this rank's float32 shard of the unit.
      grad: float32 or bfloat16; the whole flat unit, or with `offset` its elements
        [offset, offset + grad.size) (on CUDA: through host memory, docs/gpu.md).
      version: int32 scalar, the minibatch the gradient belongs to.
      runtime: the `jaxodc.odc.Runtime` holding the unit (or its `handle`).
      unit: the unit's index in the runtime's layout.
      offset: see `grad`.
      token: the ordering token of the previous communicating op (default: a fresh one).

    Returns:
      The ordering token for the next op (int32[1], see jaxodc.ops.new_token).
    """
    handle = native_handle(runtime, "odc_scatter_accumulate", "jaxodc.odc.Runtime")
    _reject_vmap("odc_scatter_accumulate", unit, local_shard, grad, version)
    return _scatter_call(local_shard, grad if offset is None else jnp.ravel(grad),
                         jnp.asarray(version, dtype=jnp.int32), new_token() if token is None else token,
                         runtime=handle, unit=int(unit), offset=None if offset is None else int(offset), pinned=False)


def odc_store_master(value: jax.Array, token: jax.Array, *, runtime, unit: int) -> jax.Array:
    """Writes `value` over this rank's master shard of `unit` in the runtime (CPU), from inside a
    compiled program: the optimizer's new parameters land where peers read them, and no unit's new
    shard has to outlive its store. Call only between `wait_complete(v)` and
    `publish_in_place(unit, v + 1)`, which announces it.

    Args:
      value: float32 [shard_size(unit)].
      token: the ordering token (`new_token()`, or the previous store's).
      runtime, unit: as for `odc_gather`.

    Returns:
      The next token: what orders later work after this store. It must reach the program's
      outputs (jax drops a store whose token is unused; `pinned_ffi_call`).
    """
    handle = native_handle(runtime, "odc_store_master", "jaxodc.odc.Runtime")
    _reject_vmap("odc_store_master", unit, value, token)
    if value.dtype != jnp.float32 or value.ndim != 1:
        raise TypeError(f"odc_store_master: unit {unit}: value must be a 1-D float32 array, got "
                        f"{value.dtype}{list(value.shape)}")
    return pinned_ffi_call("jaxodc_odc_store_master", jax.ShapeDtypeStruct((1,), jnp.int32))(
        value, token, runtime=handle, unit=np.int64(unit))


def odc_allgather(head: jax.Array, values: jax.Array, version, exchange, *, runtime) -> tuple[jax.Array, jax.Array]:
    """The minibatch's one exchange (`Runtime.allgather`) from inside a compiled program: what the
    optimizer's global reductions need, summed over ranks, and a few float64 values per rank.

    Args:
      head: uint32[2k], k float64 values as their raw bits (e.g. `np.float64(...).view(np.uint32)`):
        exact whatever jax's x64 setting; comes back from every rank.
      values: float32[n], this rank's partial sums; comes back summed over ranks in rank order in
        float64 and rounded once, the same bits on every rank.
      version: int32 scalar or [1]; labels errors only.
      exchange: int32 scalar or [1]; 0 skips the peers (warm-up: every rank's values are mine).
      runtime: the `jaxodc.odc.Runtime` (its world size shapes the result). On CUDA the inputs
        and results pass through pinned host memory (the call waits for its stream).

    Returns:
      (uint32[world, 2k] every rank's head by rank, float32[n] the sum). Both must reach the
      program's outputs or feed what does (`pinned_ffi_call`).
    """
    handle = native_handle(runtime, "odc_allgather", "jaxodc.odc.Runtime")
    if not hasattr(runtime, "world"):
        raise TypeError(f"odc_allgather: runtime must be a jaxodc.odc.Runtime (its world size shapes the result), "
                        f"got {runtime!r}")
    world = int(runtime.world)
    if head.dtype != jnp.uint32 or head.ndim != 1 or head.shape[0] % 2:
        raise TypeError(f"odc_allgather: head must be uint32[2k] (float64 bits), got {head.dtype}{list(head.shape)}")
    if values.dtype != jnp.float32 or values.ndim != 1:
        raise TypeError(f"odc_allgather: values must be a 1-D float32 array, got {values.dtype}{list(values.shape)}")
    rows, total = pinned_ffi_call("jaxodc_odc_allgather", (jax.ShapeDtypeStruct((world * head.shape[0],), jnp.uint32),
                                                            jax.ShapeDtypeStruct(values.shape, jnp.float32)))(
        head, values, jnp.reshape(jnp.asarray(version, jnp.int32), (1,)), jnp.reshape(jnp.asarray(exchange, jnp.int32), (1,)),
        runtime=handle)
    return rows.reshape(world, head.shape[0]), total
