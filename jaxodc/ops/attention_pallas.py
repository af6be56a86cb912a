"""segment_attention's GPU kernel: FlashAttention-2 in Pallas (Triton), run in Pallas interpret
mode elsewhere (tests on CPU).

The kernels are jax's own (jax.experimental.pallas.ops.gpu.attention, The JAX Authors, Apache-2.0:
the forward and the fused dK/dV + dQ backward), adapted in one respect: jax's kernel visits every
key block up to the causal diagonal, so its cost follows rows (~T^2 / 2 per row whatever the
packing). Here each program visits only the blocks its samples reach: a query block starts at the
first key of its first token's run, a key block's dK/dV stops at the last query of its last
token's run. Work is then ~ sum(s^2) over the row's samples s (up to a block's rounding), like the
CPU kernel. Runs are contiguous, so run ids never decrease along a row; each padding token is a
run of its own. Deviations from jax's code besides that: the caller pads T to the block sizes and
the head size to a power of two >= 16 (no masked loads), dQ / delta need no extra kernel, and the
dots compute in the dot mode the caller resolved (attention_policy: bf16 operands with fp32
accumulation, TF32, bf16x3 or full fp32; in interpret mode TF32's rounding is emulated), with
block sizes from attention_policy.BLOCKS (swept on an H200 for Hopper; defaults elsewhere). Softmax, the
running max / sum and every accumulator stay fp32 in all modes.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxodc.ops.attention_policy import Blocks, mixed_dot, padded_head

LOG2E = math.log2(math.e)
MASK = -0.7 * float(np.finfo(np.float32).max)  # jax's DEFAULT_MASK_VALUE: finite, so exp2(MASK - MASK) = 1 is
# possible in a row's first, fully masked blocks; the row's own key comes later and zeroes it out.


def _pallas():
    """pallas and its Triton module, with the names that moved between jax 0.11 and 0.12 resolved."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    load = getattr(plgpu, "load", None) or pl.load
    dot = getattr(plgpu, "dot", None) or pl.dot
    params = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
    return pl, load, dot, params


def layout(segment_ids: jax.Array, T_pad: int):
    """(run id, run start, run end) per token of the rows padded to T_pad with padding tokens:
    int32 [B, T_pad] each; the run of token t is [start[t], end[t])."""
    from jaxodc.ops.attention import run_ids
    seg = jnp.pad(jnp.asarray(segment_ids, jnp.int32), ((0, 0), (0, T_pad - segment_ids.shape[1])))
    r = run_ids(seg)
    pos = jnp.arange(T_pad, dtype=jnp.int32)[None, :]
    first = jnp.concatenate([jnp.ones_like(r[:, :1], bool), r[:, 1:] != r[:, :-1]], axis=1)
    last = jnp.concatenate([r[:, 1:] != r[:, :-1], jnp.ones_like(r[:, :1], bool)], axis=1)
    start = lax.cummax(jnp.where(first, pos, 0), axis=1)
    end = lax.cummin(jnp.where(last, pos + 1, T_pad), axis=1, reverse=True)
    return r, start, end


def _dots(mode, interpret):
    """dot(a, b) in the dot mode, fp32 result (pl.dot accumulates in fp32 for bf16 operands)."""
    _, _, dot, _ = _pallas()
    product = lambda a, b, precision: dot(a, b, precision=precision)  # noqa: E731
    return lambda a, b: mixed_dot(product, a, b, mode, pallas=True, interpret=interpret)


def _fwd_kernel(q_ref, k_ref, v_ref, r_ref, start_ref, o_ref, lse_ref, *, scale, bq, bk, mode, interpret):
    pl, load, _, _ = _pallas()
    dot = _dots(mode, interpret)
    iq = pl.program_id(0)
    q_rows = pl.ds(iq * bq, bq)
    q = load(q_ref)
    rq = load(r_ref.at[q_rows])
    pos_q = iq * bq + jnp.arange(bq)
    D = q.shape[-1]

    def body(j, carry):
        o, m, l = carry
        k_rows = pl.ds(j * bk, bk)
        k = load(k_ref.at[k_rows, :])
        s = dot(q, k.T) * (scale * LOG2E)  # base 2: e^x = 2^(x log2 e)
        pos_k = j * bk + jnp.arange(bk)
        keep = (rq[:, None] == load(r_ref.at[k_rows])[None, :]) & (pos_q[:, None] >= pos_k[None, :])
        s = jnp.where(keep, s, MASK)
        m_next = jnp.maximum(m, jnp.max(s, axis=-1))
        alpha = jnp.exp2(m - m_next)
        p = jnp.exp2(s - m_next[:, None])
        v = load(v_ref.at[k_rows, :])
        return alpha[:, None] * o + dot(p, v), m_next, alpha * l + jnp.sum(p, axis=-1)

    # The block's earliest key is its first token's run start (run starts never decrease).
    lo = lax.div(jnp.min(load(start_ref.at[q_rows])), bk)
    hi = lax.div(bq * (iq + 1) + bk - 1, bk)
    init = (jnp.zeros((bq, D), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32), jnp.zeros((bq,), jnp.float32))
    o, m, l = lax.fori_loop(lo, hi, body, init)
    o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log2(l)


def _bwd_kernel(q_ref, k_ref, v_ref, r_ref, start_ref, end_ref, do_ref, lse_ref, delta_ref, dq_ref, dk_ref, dv_ref,
                *, scale, blk, mode, interpret):
    pl, load, _, _ = _pallas()
    dot = _dots(mode, interpret)
    i = pl.program_id(2)
    rows = pl.ds(i * blk, blk)
    pos = i * blk + jnp.arange(blk)
    D = q_ref.shape[-1]

    def scores(q, k, rq, rk, pos_q, pos_k, lse):
        s = dot(q, k.T) * (scale * LOG2E)
        keep = (rq[:, None] == rk[None, :]) & (pos_q[:, None] >= pos_k[None, :])
        return jnp.exp2(jnp.where(keep, s, MASK) - lse[:, None])

    # dK, dV of key block i: the queries of its tokens' runs from the block on.
    k, v, rk = load(k_ref.at[rows, :]), load(v_ref.at[rows, :]), load(r_ref.at[rows])

    def dkdv(j, carry):
        dk, dv = carry
        q_rows = pl.ds(j * blk, blk)
        q, do = load(q_ref.at[q_rows, :]), load(do_ref.at[q_rows, :])
        p = scores(q, k, load(r_ref.at[q_rows]), rk, j * blk + jnp.arange(blk), pos, load(lse_ref.at[q_rows]))
        dv = dv + dot(p.T, do)
        ds = p * (dot(do, v.T) - load(delta_ref.at[q_rows])[:, None]) * scale
        return dk + dot(ds.T, q), dv

    q_hi = lax.div(jnp.max(load(end_ref.at[rows])) + blk - 1, blk)
    zeros = jnp.zeros((blk, D), jnp.float32)
    dk, dv = lax.fori_loop(i, q_hi, dkdv, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)

    # dQ of query block i: the keys of its tokens' runs up to the block.
    q, do, rq = load(q_ref.at[rows, :]), load(do_ref.at[rows, :]), load(r_ref.at[rows])
    lse, delta = load(lse_ref.at[rows]), load(delta_ref.at[rows])

    def dq_step(j, dq):
        k_rows = pl.ds(j * blk, blk)
        k = load(k_ref.at[k_rows, :])
        p = scores(q, k, rq, load(r_ref.at[k_rows]), pos, j * blk + jnp.arange(blk), lse)
        ds = p * (dot(do, load(v_ref.at[k_rows, :]).T) - delta[:, None]) * scale
        return dq + dot(ds, k)

    k_lo = lax.div(jnp.min(load(start_ref.at[rows])), blk)
    dq_ref[...] = lax.fori_loop(k_lo, i + 1, dq_step, zeros).astype(dq_ref.dtype)


def _padded(x, T_pad, D_pad):
    return jnp.pad(x, ((0, 0), (0, T_pad - x.shape[1]), (0, 0), (0, D_pad - x.shape[3])))


def _sizes(q, blocks: Blocks):
    """B, T, H, Dh, T padded to a multiple of every block, the padded head size."""
    B, T, H, Dh = q.shape
    pad = math.lcm(blocks.fwd_q, blocks.fwd_k, blocks.bwd)
    return B, T, H, Dh, -(-T // pad) * pad, padded_head(Dh)


def forward(q, k, v, segment_ids, *, interpret: bool, mode: str, blocks: Blocks):
    """[B, T, H, Dh] q, k, v (fp32 or bf16) in; (o [B, T, H, Dh] fp32, lse [B, H, T]) out, lse in
    natural log like the other implementations'. `mode`: the dots' (attention_policy.MODES)."""
    pl, _, _, params = _pallas()
    B, T, H, Dh, Tp, Dp = _sizes(q, blocks)
    bq, bk = blocks.fwd_q, blocks.fwd_k
    r, start, _ = layout(segment_ids, Tp)
    row = pl.BlockSpec((None, Tp, None, Dp), lambda i, b, h: (b, 0, h, 0))
    ids = pl.BlockSpec((None, Tp), lambda i, b, h: (b, 0))
    tile = pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0))
    o, lse2 = pl.pallas_call(
        functools.partial(_fwd_kernel, scale=1.0 / math.sqrt(Dh), bq=bq, bk=bk, mode=mode, interpret=interpret),
        grid=(Tp // bq, B, H),
        in_specs=[tile, row, row, ids, ids],
        out_specs=[tile, pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, Dp), jnp.float32), jax.ShapeDtypeStruct((B, H, Tp), jnp.float32)],
        compiler_params=params(num_warps=blocks.warps, num_stages=blocks.stages),
        interpret=interpret,
        name="jaxodc_segment_attention_fwd",
    )(*(_padded(x, Tp, Dp) for x in (q, k, v)), r, start)
    return o[:, :T, :, :Dh], lse2[:, :, :T] * math.log(2.0)


def backward(q, k, v, segment_ids, o, lse, do, *, interpret: bool, mode: str, blocks: Blocks):
    """(dq, dk, dv) in q's dtype from forward's residuals (o, natural-log lse) and the cotangent do."""
    pl, _, _, params = _pallas()
    B, T, H, Dh, Tp, Dp = _sizes(q, blocks)
    blk = blocks.bwd
    r, start, end = layout(segment_ids, Tp)
    # Padding rows: do = 0 and lse = 0 (their p is 0 or 1 against their own key only, times do = 0).
    lse2 = jnp.pad(lse * LOG2E, ((0, 0), (0, 0), (0, Tp - T)))
    delta = jnp.pad(jnp.einsum("bthd,bthd->bht", o, do.astype(jnp.float32)), ((0, 0), (0, 0), (0, Tp - T)))
    if mode == "bf16":  # the kernel's dots round it to bf16 anyway: read half the bytes
        do = do.astype(jnp.bfloat16)
    row = pl.BlockSpec((None, Tp, None, Dp), lambda b, h, i: (b, 0, h, 0))
    ids = pl.BlockSpec((None, Tp), lambda b, h, i: (b, 0))
    per_head = pl.BlockSpec((None, None, Tp), lambda b, h, i: (b, h, 0))
    tile = pl.BlockSpec((None, blk, None, Dp), lambda b, h, i: (b, i, h, 0))
    sds = jax.ShapeDtypeStruct((B, Tp, H, Dp), q.dtype)
    qp, kp, vp, dop = (_padded(x, Tp, Dp) for x in (q, k, v, do))
    dq, dk, dv = pl.pallas_call(
        functools.partial(_bwd_kernel, scale=1.0 / math.sqrt(Dh), blk=blk, mode=mode, interpret=interpret),
        grid=(B, H, Tp // blk),
        in_specs=[row, row, row, ids, ids, ids, row, per_head, per_head],
        out_specs=[tile, tile, tile],
        out_shape=[sds, sds, sds],
        compiler_params=params(num_warps=blocks.warps, num_stages=blocks.stages),
        interpret=interpret,
        name="jaxodc_segment_attention_bwd",
    )(qp, kp, vp, r, start, end, dop, lse2, delta)
    return tuple(x[:, :T, :, :Dh] for x in (dq, dk, dv))
