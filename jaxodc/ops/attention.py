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
            mode (slow: tests).
  "auto":   the kernel on CPU; on CUDA whichever of "pallas" and "dense" attention_policy.choose_impl
            picks from static shapes (the longest sample if the caller knows it); dense elsewhere.
The dots follow `precision` (attention_policy.dot_mode: jax.default_matmul_precision's semantics;
by default bf16 operands for bf16 inputs, TF32 for fp32 inputs, as XLA's dense dots on a GPU) in
"pallas" and "dense"; the CPU kernel is always fp32. Softmax and accumulation are fp32; the
result has the input dtype (float32 or bfloat16). docs/gpu.md says what has run on a GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxodc import _native
from jaxodc.ops import attention_pallas, attention_policy
from jaxodc.ops.attention_policy import Blocks, mixed_dot

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


def _einsum(spec):
    return lambda a, b, precision: jnp.einsum(spec, a, b, precision=precision, preferred_element_type=jnp.float32)


def _dense_scores(q, k, segment_ids, mode="fp32"):
    logits = mixed_dot(_einsum("bqhd,bkhd->bhqk"), q, k, mode, pallas=False) / jnp.sqrt(jnp.float32(q.shape[-1]))
    return jnp.where(attention_mask(segment_ids), logits, -jnp.inf)  # the diagonal is always kept


def _dense(q, k, v, segment_ids, mode="fp32"):
    """The reference: [B, T, H, Dh] in, (o [B, T, H, Dh], lse [B, H, T]) out, fp32, its two
    products in dot mode `mode` (XLA's precision: TF32 is full fp32 off the GPU)."""
    s = _dense_scores(q, k, segment_ids, mode)
    lse = jax.nn.logsumexp(s, axis=-1)
    o = mixed_dot(_einsum("bhqk,bkhd->bqhd"), jnp.exp(s - lse[..., None]), v, mode, pallas=False)
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


# Triton compiles the Pallas kernels on CUDA; any other platform interprets them. q, k, v keep their
# dtype (bf16 operands are read as such); o and lse are fp32, dq, dk, dv have q's dtype.
def _pallas_fwd_call(q, k, v, segment_ids, mode, blocks):
    f = functools.partial(attention_pallas.forward, mode=mode, blocks=blocks)
    return jax.lax.platform_dependent(q, k, v, segment_ids, cuda=functools.partial(f, interpret=False),
                                      default=functools.partial(f, interpret=True))


def _pallas_bwd_call(q, k, v, segment_ids, o, lse, do, mode, blocks):
    f = functools.partial(attention_pallas.backward, mode=mode, blocks=blocks)
    return jax.lax.platform_dependent(q, k, v, segment_ids, o, lse, do, cuda=functools.partial(f, interpret=False),
                                      default=functools.partial(f, interpret=True))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _pallas(q, k, v, segment_ids, mode, blocks):
    return _pallas_fwd_call(q, k, v, segment_ids, mode, blocks)[0]


def _pallas_vjp_fwd(q, k, v, segment_ids, mode, blocks):
    o, lse = _pallas_fwd_call(q, k, v, segment_ids, mode, blocks)
    return o, (q, k, v, segment_ids, o, lse)


def _pallas_vjp_bwd(mode, blocks, res, do):
    return (*_pallas_bwd_call(*res, do, mode, blocks), None)


_pallas.defvjp(_pallas_vjp_fwd, _pallas_vjp_bwd)


# "auto" picks the implementation when lowering. One custom_vjp around all keeps the residuals
# identical ((q, k, v, segment_ids, o, lse), lse in natural log): a platform_dependent around
# differentiable branches would make the CPU branch carry zeros for the dense branch's [B, H, T, T]
# residuals. The dense backward therefore recomputes its forward. `gpu` is choose_impl's pick for
# CUDA, made from static shapes before tracing.
def _dense_bwd(q, k, v, segment_ids, o, lse, do, mode):
    _, vjp = jax.vjp(lambda q, k, v: _dense(q, k, v, segment_ids, mode)[0], q, k, v)
    return vjp(do)


def _f32(*xs):
    return [x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in xs]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _auto(q, k, v, segment_ids, mode, blocks, gpu):
    return _auto_fwd(q, k, v, segment_ids, mode, blocks, gpu)[0]


def _auto_fwd(q, k, v, segment_ids, mode, blocks, gpu):
    cuda = (functools.partial(attention_pallas.forward, interpret=False, mode=mode, blocks=blocks) if gpu == "pallas"
            else functools.partial(_dense, mode=mode))
    o, lse = jax.lax.platform_dependent(
        q, k, v, segment_ids, cpu=lambda *a: _kernel_fwd_call(*_f32(*a), 0), cuda=cuda,
        default=functools.partial(_dense, mode=mode))
    return o, (q, k, v, segment_ids, o, lse)


def _auto_bwd(mode, blocks, gpu, res, do):
    cuda = (functools.partial(attention_pallas.backward, interpret=False, mode=mode, blocks=blocks) if gpu == "pallas"
            else functools.partial(_dense_bwd, mode=mode))
    grads = jax.lax.platform_dependent(
        *res, do, cpu=lambda *a: [g.astype(res[0].dtype) for g in _kernel_bwd_call(*_f32(*a), 0)],
        cuda=lambda *a: [g.astype(res[0].dtype) for g in cuda(*a)],
        default=lambda *a: [g.astype(res[0].dtype) for g in _dense_bwd(*a, mode=mode)])
    return (*grads, None)


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
                      impl: str = "auto", precision=None, longest: int | None = None) -> jax.Array:
    """Causal attention within each packed sample. Works under jit and grad; under vmap the
    kernel runs once per mapped element.

    Args:
      q, k, v: [B, T, H, Dh], float32 or bfloat16 (all the same dtype).
      segment_ids: [B, T] integer; each sample is one contiguous run of one id, 0 = padding.
      impl: "auto" (kernel on CPU; on CUDA pallas or dense by attention_policy.choose_impl; dense
        elsewhere), "dense", "kernel" (CPU only) or "pallas" (GPU; interpret mode elsewhere).
      precision: the dots' precision in "pallas" and "dense" (attention_policy.dot_mode): None
        follows jax.default_matmul_precision (bf16 dots for bf16 inputs, TF32 for fp32 inputs
        unless "highest"); a jax precision name, lax.Precision, or "bf16", "bf16x3", "tf32", "fp32".
      longest: the longest sample any row can hold, if the caller knows it (a static int): lets
        "auto" take the Pallas kernel on a GPU where it is no slower than dense for such samples.

    Returns:
      [B, T, H, Dh] in q's dtype.
    """
    return _segment_attention(q, k, v, segment_ids, impl=impl, precision=precision, longest=longest)


def _segment_attention(q, k, v, segment_ids, *, impl: str = "auto", isa: int = 0, precision=None,
                       longest: int | None = None, blocks: Blocks | None = None):
    _check(q, k, v, segment_ids, impl)
    dtype = jnp.result_type(q)
    mode = attention_policy.dot_mode(dtype, precision)
    B, T, H, Dh = np.shape(q)
    kind = attention_policy.device_kind()
    blocks = blocks or attention_policy.blocks_for(attention_policy.padded_head(Dh), mode, kind)
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    segment_ids = jnp.asarray(segment_ids, jnp.int32)
    if impl == "dense":
        o = _dense(q, k, v, segment_ids, mode)[0]
    elif impl == "kernel":
        o = _kernel(*_f32(q, k, v), segment_ids, int(isa))
    elif impl == "pallas":
        o = _pallas(q, k, v, segment_ids, mode, blocks)
    else:
        gpu = attention_policy.choose_impl(T, Dh, mode, kind, longest=longest, B=B, H=H)
        o = _auto(q, k, v, segment_ids, mode, blocks, gpu)
    return o.astype(dtype)
