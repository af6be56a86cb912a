"""Ring all-reduce as an XLA FFI custom call, usable inside ``jax.jit``.

The endpoint is named by its integer handle (an ``np.int64`` attribute), so the compiled program
holds no Python object. On CPU the handler runs the native ring directly on XLA's host buffers; on
CUDA it stages through pinned host buffers on the call's stream.

Ordering: the call is ``has_side_effect=True`` so XLA never drops it, but that alone does not order
two independent calls, and every peer must issue its all-reduces in the same order. Each call
therefore takes an int32[1] *token* and returns its successor; chaining the token through a sequence
of calls (``token=`` / :func:`all_reduce_tree`) makes each depend on the previous one, which fixes
the order by data dependency. A call given no token starts from a fresh one and is ordered only by
its own data dependencies.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxodc._native import register_targets
from jaxodc.comm.ring import OPS, QUANTIZE
from jaxodc.ops._common import native_handle, new_token

__all__ = ["all_reduce", "all_reduce_tree", "new_token"]

_TARGET = "jaxodc_ring_all_reduce"


def all_reduce(x, endpoint, op: str = "sum", quantize: str | None = None, *, token=None, tag: int = 0):
    """All-reduces `x` over the ring of `endpoint`; every peer ends with the same bits.

    Args:
      x: array of float32, float64, float16, bfloat16, int32 or int64.
      endpoint: a connected `jaxodc.comm.ring.RingEndpoint`, or its `handle`.
      op: "sum", "avg", "min", "max" or "prod".
      quantize: None, "uint8" or "uint16" (floating dtypes): min-max quantised transfer.
      token: the ordering token of the previous communicating op (default: a fresh one).
      tag: names the operation on the wire; peers must issue the same tags in the same order.

    Returns:
      ``(y, token)``: the reduction (x's shape and dtype) and the token for the next op.
    """
    register_targets()
    if op not in OPS:
        raise ValueError(f"all_reduce: unknown op {op!r}; expected one of {sorted(OPS)}")
    if quantize not in QUANTIZE:
        raise ValueError(f"all_reduce: unknown quantize {quantize!r}")
    x = jnp.asarray(x)
    if QUANTIZE[quantize] and not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"all_reduce: quantize={quantize!r} needs a floating dtype, got {x.dtype}")
    call = jax.ffi.ffi_call(
        _TARGET,
        (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((1,), jnp.int32)),
        has_side_effect=True,
        vmap_method="sequential",
    )
    return call(x, new_token() if token is None else token,
                handle=native_handle(endpoint, "all_reduce", "RingEndpoint"), op=np.int64(OPS[op]),
                quant=np.int64(QUANTIZE[quantize]), tag=np.int64(tag))


def all_reduce_tree(tree, endpoint, op: str = "sum", quantize: str | None = None, *, token=None, tag: int = 0):
    """All-reduces every leaf of `tree` in tree-flatten order, threading one token through them.

    Args: as :func:`all_reduce` (one `op`, `quantize` and `tag` for every leaf).

    Returns:
      ``(tree, token)``: the reduced tree and the token after its last leaf.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out = []
    for leaf in leaves:
        y, token = all_reduce(leaf, endpoint, op, quantize, token=token, tag=tag)
        out.append(y)
    return jax.tree_util.tree_unflatten(treedef, out), new_token() if token is None else token
