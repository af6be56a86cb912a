"""The lock-step collectives of a `jaxodc.comm.lockstep.LockstepGroup` as an XLA FFI custom call,
usable inside `jax.jit` and `shard_map` (one process per device). Not differentiable by itself: the
collective trainer pairs a gather channel with a scatter channel in its own custom_vjp.

The handler is asynchronous: a rank whose peers are late leaves the call to the group's progress
thread and XLA goes on with independent work, so ranks may run calls of different channels in
different orders without deadlocking."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxodc import _native
from jaxodc.ops._common import native_handle

_native.register_targets()


def lockstep_collective(x: jax.Array, *, group, channel: int) -> jax.Array:
    """The collective of `group`'s channel `channel` on this rank's `x` (see `Channel`).

    Args:
      x: the channel's dtype (float32 or bfloat16), `group.in_size(channel)` elements (any shape;
        flattened).
      group: a connected `LockstepGroup`.
      channel: the channel's index in the group.

    Returns:
      [group.out_size(channel)] of the channel's dtype: the gathered ranks in rank order (gather), this rank's
      slice of the sum (scatter), or the sum (reduce).
    """
    handle = native_handle(group, "lockstep_collective", "LockstepGroup")
    x = jnp.ravel(x)
    dtype = jnp.dtype(group.channels[channel].dtype)
    if x.dtype != dtype:
        raise TypeError(f"lockstep_collective: channel {channel}: x must be {dtype} (the channel's dtype), got {x.dtype}")
    want = group.in_size(channel)
    if x.size != want:
        c = group.channels[channel]
        raise ValueError(f"lockstep_collective: channel {channel} ({c.kind} {c.name!r}) takes {want} elements, "
                         f"got {x.size}")
    return jax.ffi.ffi_call("jaxodc_lockstep", jax.ShapeDtypeStruct((group.out_size(channel),), dtype))(
        x, group=handle, channel=np.int64(channel))
