"""What every communicating op shares: the ordering token and naming its native object."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def new_token() -> jax.Array:
    """A fresh ordering token: int32[1]. Every communicating op (`all_reduce`,
    `odc_scatter_accumulate`) takes one and returns its successor; passing each call the token
    of the previous one fixes their order (mpi4jax's convention)."""
    return jnp.zeros((1,), jnp.int32)


def native_handle(obj, op: str, kind: str) -> np.int64:
    """The FFI attribute naming `obj` (anything with a `handle`, or the integer handle itself)."""
    handle = obj if isinstance(obj, (int, np.integer)) else getattr(obj, "handle", None)
    if handle is None or isinstance(handle, bool):
        raise TypeError(f"{op}: expected a {kind} or its integer handle, got {obj!r}")
    return np.int64(handle)
