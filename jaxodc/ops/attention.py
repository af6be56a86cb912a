"""Causal attention within packed samples (`segment_attention`).

A packed row of T tokens holds several samples, each one contiguous run of equal segment ids
(jaxodc.balance.packing; 0 = padding). Token i attends to token j iff j <= i and j lies in the
same run as i; a padding token attends only to itself (its output is its own value vector; its
loss is masked, and nothing real attends to it). Scale 1/sqrt(Dh).

Implementations:
  "dense":  masked softmax over the whole [T, T] score matrix: the reference; cost ~ T^2 per row.
  "kernel": the variable-length CPU kernel (csrc/attention/varlen_attention.cc, XLA FFI), which
            works only over each run's causal triangle: cost ~ a * sum(s^2) + b * sum(s) over the
            row's sample lengths s. Its backward is FlashAttention-2's (recomputes P from the
            saved log-sum-exp).
  "pallas": FlashAttention-2 in Pallas (jaxodc/ops/attention_pallas.py: jax's Triton kernel, made
            to visit only the blocks a row's samples reach): cost ~ sum(s^2) up to block rounding,
            memory linear in T. Compiled by Triton on a GPU; elsewhere it runs in Pallas interpret
            mode (slow: tests). NEVER YET RUN ON A GPU: checked only in interpret mode on CPU
            against the CPU kernel; tests/gpu/test_attention_gpu.py is its GPU check.
  "auto":   the kernel on CPU, "pallas" on CUDA, dense elsewhere.
All compute in float32 and return the input dtype (float32 or bfloat16).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxodc import _native
from jaxodc.ops import attention_pallas

_native.register_targets()

IMPLS = ("auto", "dense", "kernel", "pallas")
ISAS = ("scalar", "sse2", "avx2", "avx512")  # the kernel's `isa` attribute is index + 1; 0 = best


def run_ids(segment_ids: jax.Array) -> jax.Array:
    """[B, T] int32 id of each token's run: a new run starts where the segment id changes, and
    every padding token (segment 0) is a run of its own."""
    seg = jnp.asarray(segment_ids)
    change = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    return jnp.cumsum(change | (seg == 0), axis=1, dtype=jnp.int32)


def attention_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, 1, T, T] boolean: same run and not in the future."""
    r = run_ids(segment_ids)
    T = r.shape[-1]
    causal = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]
    return ((r[:, :, None] == r[:, None, :]) & causal)[:, None]


def _dense_scores(q, k, segment_ids):
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
    return jnp.where(attention_mask(segment_ids), logits, -jnp.inf)  # the diagonal is always kept


def _dense(q, k, v, segment_ids):
    """The reference: float32 [B, T, H, Dh] in, (o [B, T, H, Dh], lse [B, H, T]) out."""
    s = _dense_scores(q, k, segment_ids)
    lse = jax.nn.logsumexp(s, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - lse[..., None]), v)
    return o, lse


def _kernel_fwd_call(q, k, v, segment_ids, isa):
    B, T, H, Dh = q.shape
    return jax.ffi.ffi_call(
        "jaxodc_varlen_attention_fwd",
        (jax.ShapeDtypeStruct((B, T, H, Dh), jnp.float32), jax.ShapeDtypeStruct((B, H, T), jnp.float32)),
        vmap_method="sequential",
    )(q, k, v, segment_ids, isa=np.int64(isa))


def _kernel_bwd_call(q, k, v, segment_ids, o, lse, do, isa):
    sds = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    return jax.ffi.ffi_call("jaxodc_varlen_attention_bwd", (sds, sds, sds), vmap_method="sequential")(
        q, k, v, segment_ids, o, lse, do, isa=np.int64(isa))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _kernel(q, k, v, segment_ids, isa):
    return _kernel_fwd_call(q, k, v, segment_ids, isa)[0]


def _kernel_vjp_fwd(q, k, v, segment_ids, isa):
    o, lse = _kernel_fwd_call(q, k, v, segment_ids, isa)
    return o, (q, k, v, segment_ids, o, lse)


def _kernel_vjp_bwd(isa, res, do):
    return (*_kernel_bwd_call(*res, do, isa), None)


_kernel.defvjp(_kernel_vjp_fwd, _kernel_vjp_bwd)


# Triton compiles the Pallas kernels on CUDA; any other platform interprets them.
def _pallas_fwd_call(q, k, v, segment_ids):
    return jax.lax.platform_dependent(
        q, k, v, segment_ids, cuda=functools.partial(attention_pallas.forward, interpret=False),
        default=functools.partial(attention_pallas.forward, interpret=True))


def _pallas_bwd_call(q, k, v, segment_ids, o, lse, do):
    return jax.lax.platform_dependent(
        q, k, v, segment_ids, o, lse, do, cuda=functools.partial(attention_pallas.backward, interpret=False),
        default=functools.partial(attention_pallas.backward, interpret=True))


@jax.custom_vjp
def _pallas(q, k, v, segment_ids):
    return _pallas_fwd_call(q, k, v, segment_ids)[0]


def _pallas_vjp_fwd(q, k, v, segment_ids):
    o, lse = _pallas_fwd_call(q, k, v, segment_ids)
    return o, (q, k, v, segment_ids, o, lse)


def _pallas_vjp_bwd(res, do):
    return (*_pallas_bwd_call(*res, do), None)


_pallas.defvjp(_pallas_vjp_fwd, _pallas_vjp_bwd)


# "auto" picks the implementation when lowering. One custom_vjp around all keeps the residuals
# identical ((q, k, v, segment_ids, o, lse), lse in natural log): a platform_dependent around
# differentiable branches would make the CPU branch carry zeros for the dense branch's [B, H, T, T]
# residuals. The dense backward therefore recomputes its forward.
@jax.custom_vjp
def _auto(q, k, v, segment_ids):
    return _auto_fwd(q, k, v, segment_ids)[0]


def _auto_fwd(q, k, v, segment_ids):
    o, lse = jax.lax.platform_dependent(
        q, k, v, segment_ids, cpu=lambda *a: _kernel_fwd_call(*a, 0),
        cuda=lambda *a: attention_pallas.forward(*a, interpret=False), default=_dense)
    return o, (q, k, v, segment_ids, o, lse)


def _auto_bwd(res, do):
    def dense_bwd(q, k, v, segment_ids, o, lse, do):
        _, vjp = jax.vjp(lambda q, k, v: _dense(q, k, v, segment_ids)[0], q, k, v)
        return vjp(do)

    dq, dk, dv = jax.lax.platform_dependent(
        *res, do, cpu=lambda *a: _kernel_bwd_call(*a, 0),
        cuda=lambda *a: attention_pallas.backward(*a, interpret=False), default=dense_bwd)
    return dq, dk, dv, None


_auto.defvjp(_auto_fwd, _auto_bwd)


def _check(q, k, v, segment_ids, impl):
    if impl not in IMPLS:
        raise ValueError(f"segment_attention: impl must be one of {IMPLS}, got {impl!r}")
    shape = tuple(np.shape(q))
    for name, x in (("q", q), ("k", k), ("v", v)):
        dt = jnp.result_type(x)
        if dt not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise TypeError(f"segment_attention: {name} must be float32 or bfloat16, got {dt}{list(np.shape(x))}")
        if np.ndim(x) != 4 or (name != "q" and tuple(np.shape(x)) != shape):
            raise ValueError(f"segment_attention: {name} must be [B, T, H, Dh]"
                             f"{'' if name == 'q' else f' like q {list(shape)}'}, got {list(np.shape(x))}")
        if dt != jnp.result_type(q):
            raise TypeError(f"segment_attention: {name} is {dt} but q is {jnp.result_type(q)}")
    if shape[3] < 1:
        raise ValueError(f"segment_attention: q must have a head size >= 1, got {list(shape)}")
    if not jnp.issubdtype(jnp.result_type(segment_ids), jnp.integer) or tuple(np.shape(segment_ids)) != shape[:2]:
        raise ValueError(f"segment_attention: segment_ids must be integer [B, T] = {list(shape[:2])}, got "
                         f"{jnp.result_type(segment_ids)}{list(np.shape(segment_ids))}")


def segment_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                      impl: str = "auto") -> jax.Array:
    """Causal attention within each packed sample. Works under jit and grad; under vmap the
    kernel runs once per mapped element.

    Args:
      q, k, v: [B, T, H, Dh], float32 or bfloat16 (all the same dtype).
      segment_ids: [B, T] integer; each sample is one contiguous run of one id, 0 = padding.
      impl: "auto" (kernel on CPU, pallas on CUDA, dense elsewhere), "dense", "kernel" (CPU only)
        or "pallas" (GPU; interpret mode elsewhere).

    Returns:
      [B, T, H, Dh] in q's dtype.
    """
    return _segment_attention(q, k, v, segment_ids, impl=impl)


def _segment_attention(q, k, v, segment_ids, *, impl: str = "auto", isa: int = 0):
    _check(q, k, v, segment_ids, impl)
    dtype = jnp.result_type(q)
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    if impl == "dense":
        o = _dense(q, k, v, segment_ids)[0]
    elif impl == "kernel":
        o = _kernel(q, k, v, segment_ids, int(isa))
    elif impl == "pallas":
        o = _pallas(q, k, v, segment_ids)
    else:
        o = _auto(q, k, v, segment_ids)
    return o.astype(dtype)
