"""Ring all-reduce as an XLA FFI custom call, usable inside ``jax.jit``.

The endpoint is named by its integer handle (an ``np.int64`` attribute), so the compiled program
holds no Python object. On CPU the handler runs the native ring directly on XLA's host buffers; on
CUDA it stages through pinned host buffers on the call's stream.

Ordering: the call is ``has_side_effect=True`` so XLA never drops it, but that alone does not order
two independent calls, and every peer must issue its all-reduces in the same order. Each call
therefore takes and returns a small int32[1] *token*; chaining the token through a sequence of calls
(``token=`` / :func:`all_reduce_tree`) makes each depend on the previous one, which fixes the order
by data dependency. A call without a token is only ordered by its own data dependencies.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxodc._native import register_targets
from jaxodc.comm.ring import OPS, QUANTIZE

__all__ = ["all_reduce", "all_reduce_tree", "new_token"]

_TARGET = "jaxodc_ring_all_reduce"


def new_token() -> jax.Array:
    return jnp.zeros((1,), jnp.int32)


def _handle(endpoint) -> int:
    h = endpoint if isinstance(endpoint, (int, np.integer)) else getattr(endpoint, "handle", None)
    if h is None:
        raise TypeError(f"all_reduce: endpoint must be a RingEndpoint or its integer handle, got {endpoint!r}")
    return int(h)


def all_reduce(x, endpoint, op: str = "sum", quantize: str | None = None, *, token=None, tag: int = 0):
    """All-reduces `x` over the endpoint's ring. Returns y, or (y, token) when a token is given."""
    register_targets()
    if op not in OPS:
        raise ValueError(f"all_reduce: unknown op {op!r}; expected one of {sorted(OPS)}")
    if quantize not in QUANTIZE:
        raise ValueError(f"all_reduce: unknown quantize {quantize!r}")
    x = jnp.asarray(x)
    if QUANTIZE[quantize] and not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"all_reduce: quantize={quantize!r} needs a floating dtype, got {x.dtype}")
    tok = new_token() if token is None else token
    call = jax.ffi.ffi_call(
        _TARGET,
        (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((1,), jnp.int32)),
        has_side_effect=True,
        vmap_method="sequential",
    )
    y, tok_out = call(x, tok, handle=np.int64(_handle(endpoint)), op=np.int64(OPS[op]),
                      quant=np.int64(QUANTIZE[quantize]), tag=np.int64(tag))
    return y if token is None else (y, tok_out)


def all_reduce_tree(tree, endpoint, op: str = "sum", quantize: str | None = None, *, token=None, tag: int = 0):
    """All-reduces every leaf in tree-flatten order, threading one token so the order is fixed."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    tok = new_token() if token is None else token
    out = []
    for leaf in leaves:
        y, tok = all_reduce(leaf, endpoint, op, quantize, token=tok, tag=tag)
        out.append(y)
    res = jax.tree_util.tree_unflatten(treedef, out)
    return res if token is None else (res, tok)
