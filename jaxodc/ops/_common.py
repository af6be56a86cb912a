"""What every communicating op shares: the ordering token and naming its native object."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.interpreters import mlir


def new_token() -> jax.Array:
    """A fresh ordering token: int32[1]. Every communicating op (`all_reduce`,
    `odc_scatter_accumulate`) takes one and returns its successor; passing each call the token
    of the previous one fixes their order (mpi4jax's convention)."""
    return jnp.zeros((1,), jnp.int32)


@functools.lru_cache(maxsize=None)
def _pinned_primitive(target: str, results: tuple) -> Primitive:
    prim = Primitive(f"{target}_pinned")
    prim.multiple_results = True
    prim.def_abstract_eval(lambda *args, **attrs: [ShapedArray(shape, dtype) for shape, dtype in results])
    mlir.register_lowering(prim, jax.ffi.ffi_lowering(target, has_side_effect=True))
    return prim


def pinned_ffi_call(target: str, result):
    """`jax.ffi.ffi_call(target, result, has_side_effect=True)` for an op whose result (an ordering
    token) the caller always consumes: the HLO custom call keeps its side effect, so XLA never
    drops or merges it, but jax sees no effect, so the program keeps jit's C++ fast dispatch (an
    effect costs about 60 us per execution on this project's CPU host, more under load, once per
    microbatch step or optimizer program). jax itself drops a call whose result is unused: only
    for calls inside jaxodc whose results are wired into an output, never for a public op.
    `result`: one ShapeDtypeStruct, or a tuple of them (then a tuple comes back)."""
    many = isinstance(result, (tuple, list))
    prim = _pinned_primitive(target, tuple((tuple(r.shape), np.dtype(r.dtype)) for r in (result if many else [result])))
    return lambda *args, **attrs: (tuple if many else lambda outs: outs[0])(prim.bind(*args, **attrs))


def native_handle(obj, op: str, kind: str) -> np.int64:
    """The FFI attribute naming `obj` (anything with a `handle`, or the integer handle itself)."""
    handle = obj if isinstance(obj, (int, np.integer)) else getattr(obj, "handle", None)
    if handle is None or isinstance(handle, bool):
        raise TypeError(f"{op}: expected a {kind} or its integer handle, got {obj!r}")
    return np.int64(handle)
