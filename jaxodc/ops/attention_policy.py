"""How segment attention computes on a device: the precision of its dots, the Pallas kernels'
block sizes, and which implementation "auto" runs on a GPU.

Dots (`dot_mode`): jax.default_matmul_precision's semantics, applied to the attention's products
(q k^T, p v and the backward's four):
  "bf16"    operands rounded to bf16, fp32 accumulation (tensor cores); the default for bf16 inputs.
  "tf32"    fp32 operands read as TF32 by the tensor cores (10-bit mantissa), fp32 accumulation;
            the default for fp32 inputs, as XLA's own fp32 dots on a GPU ("default" and "high").
  "bf16x3"  each fp32 operand split into bf16 hi + lo, three bf16 products (lo*hi, hi*lo, hi*hi):
            about fp32's accuracy at three times bf16's cost ("BF16_BF16_F32_X3").
  "fp32"    full fp32 FMAs ("highest" / "float32"); the only mode of the CPU kernel.
TF32 is a hardware read: off the GPU (Pallas interpret mode) the kernels emulate it by truncating
the operands to TF32, so CPU tests see its rounding; XLA's dense path on CPU computes it in fp32.

The tables' Hopper entries were swept on an NVIDIA H200 (`python3 bench/attention.py --gpu --sweep`,
run by `GPU_CHECK_ATTENTION=only bash scripts/gpu_check.sh`, which prints the entries to paste);
other GPUs get the shipped blocks and dense. The sweep's records are in bench/gpu/.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

MODES = ("bf16", "bf16x3", "tf32", "fp32")

# jax.default_matmul_precision's names (and the dot algorithm presets that are one of our modes).
_DEFAULT, _HIGHEST = "default", "highest"
_NAMES = {"default": _DEFAULT, "bfloat16": _DEFAULT, "fastest": _DEFAULT, "high": _DEFAULT,
          "tensorfloat32": _DEFAULT, "highest": _HIGHEST, "float32": _HIGHEST,
          "BF16_BF16_F32": "bf16", "BF16_BF16_F32_X3": "bf16x3", "TF32_TF32_F32": "tf32", "F32_F32_F32": "fp32",
          **{m: m for m in MODES}}


def dot_mode(dtype, precision=None) -> str:
    """The attention's dot mode for inputs of `dtype` under `precision` (None: the current
    jax.default_matmul_precision; a jax name such as "highest" / "tensorfloat32", a lax.Precision,
    a dot algorithm preset name, or one of MODES). "default" and "high" are TF32 for fp32 inputs
    (lax.Precision's meaning on a GPU) and bf16 for bf16 inputs; "highest" is fp32 for both."""
    if precision is None:
        precision = jax.config.jax_default_matmul_precision or "default"
    if isinstance(precision, lax.Precision):
        precision = {lax.Precision.DEFAULT: "default", lax.Precision.HIGH: "high"}.get(precision, "highest")
    name = _NAMES.get(str(precision))
    if name is None:
        raise ValueError(f"segment_attention: precision {precision!r} is not one of {sorted(_NAMES)} or a lax.Precision")
    if name == _HIGHEST:
        return "fp32"
    if name == _DEFAULT:
        return "bf16" if jnp.dtype(dtype) == jnp.bfloat16 else "tf32"
    return name


def _tf32(x):
    """x rounded as a tensor core reads fp32 as TF32: the low 13 mantissa bits dropped (truncation,
    the worse of truncation and rounding)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return lax.bitcast_convert_type(bits & jnp.uint32(0xFFFFE000), jnp.float32)


def mixed_dot(product, a, b, mode: str, *, pallas: bool, interpret: bool = False):
    """product(a, b, precision) -> fp32, computed as `mode` says. `product` is the caller's fp32
    accumulating contraction: pl.dot in the Pallas kernels (`pallas`), an einsum in XLA's dense
    path. The kernels split bf16x3 themselves (the same arithmetic interpreted and on the GPU) and
    emulate TF32's rounding in interpret mode; XLA gets the precision / algorithm preset (CPU XLA
    computes TF32 in fp32, bf16x3 in fp32 or emulated)."""
    if mode == "bf16":
        return product(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), lax.Precision.DEFAULT)
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    if mode == "tf32":
        return product(_tf32(a), _tf32(b), lax.Precision.HIGHEST) if interpret else product(a, b, lax.Precision.HIGH)
    if mode == "bf16x3" and not pallas:
        return product(a, b, lax.DotAlgorithmPreset.BF16_BF16_F32_X3)
    if mode == "bf16x3":
        a_hi, b_hi = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
        a_lo, b_lo = (a - a_hi.astype(jnp.float32)).astype(jnp.bfloat16), (b - b_hi.astype(jnp.float32)).astype(jnp.bfloat16)
        small = product(a_lo, b_hi, lax.Precision.DEFAULT) + product(a_hi, b_lo, lax.Precision.DEFAULT)
        return small + product(a_hi, b_hi, lax.Precision.DEFAULT)  # the small terms first
    if mode == "fp32":
        return product(a, b, lax.Precision.HIGHEST)
    raise ValueError(f"dot mode {mode!r} is not one of {MODES}")


def generation(device_kind: str | None) -> str:
    """"hopper", "ampere", "blackwell" or "*" (unknown) from a jax device_kind ("NVIDIA H200")."""
    kind = (device_kind or "").upper()
    for gen, names in (("blackwell", ("B100", "B200", "GB200", "B300")), ("hopper", ("H100", "H200", "H800", "H20")),
                       ("ampere", ("A100", "A800", "A30", "A40", "A10"))):
        if any(n in kind for n in names):
            return gen
    return "*"


def device_kind() -> str | None:
    """The GPU being lowered for: the abstract mesh's device (lowering for a GPU from another
    machine) or the first GPU of this process; None without either."""
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    if abstract is not None and abstract.platform in ("gpu", "cuda"):
        return abstract.device_kind
    try:
        return jax.devices("gpu")[0].device_kind
    except RuntimeError:
        return None


class Blocks(NamedTuple):
    """Pallas kernel tiling: forward query / key blocks, the backward's block (queries and keys),
    Triton's warps and pipeline stages."""
    fwd_q: int
    fwd_k: int
    bwd: int
    warps: int = 4
    stages: int = 2


# (generation, padded head size, dot mode) -> Blocks; "*" matches any generation / mode. The "*"
# entries are the defaults the kernels shipped with (jax's Triton kernel's: 64-token forward blocks,
# 32 for heads over 64; 32-token backward blocks), untuned. The Hopper entries are the fastest
# fwd+bwd of `bench/attention.py --gpu --sweep` (one 8192-token sample, 8 heads, 3 repetitions) on
# an NVIDIA H200, jax 0.11.2 + CUDA 13, 2026-11-28; the times are that sweep's (bench/gpu/).
BLOCKS: dict[tuple[str, int | str, str], Blocks] = {
    ("*", "*", "*"): Blocks(64, 64, 32),
    ("*", 128, "*"): Blocks(32, 32, 32),
    ("*", 256, "*"): Blocks(32, 32, 32),
    ("hopper", 64, "tf32"): Blocks(64, 64, 64, 4, 3),  # 4.91 ms (shipped default 5.81 ms)
    ("hopper", 64, "bf16"): Blocks(64, 64, 64, 4, 3),  # 1.70 ms (2.41 ms)
    ("hopper", 128, "tf32"): Blocks(32, 32, 32, 4, 2),  # 12.80 ms: the default was the fastest
    ("hopper", 128, "bf16"): Blocks(64, 32, 32, 4, 3),  # 3.67 ms (4.69 ms)
}


def blocks_for(head_size: int, mode: str, kind: str | None) -> Blocks:
    """The most specific BLOCKS entry for a padded head size, dot mode and device kind."""
    gen = generation(kind)
    for key in ((gen, head_size, mode), (gen, head_size, "*"), ("*", head_size, mode), ("*", head_size, "*"),
                (gen, "*", mode), (gen, "*", "*"), ("*", "*", mode)):
        if key in BLOCKS:
            return BLOCKS[key]
    return BLOCKS[("*", "*", "*")]


def padded_head(Dh: int) -> int:
    """The kernels' head size: a power of two >= 16 (no masked loads)."""
    return max(16, 1 << (Dh - 1).bit_length())


# (generation, padded head size, dot mode) -> the longest sample (tokens) up to which the Pallas
# kernel's fwd+bwd was measured no slower than XLA's dense attention on a row of such samples
# (float("inf"): it never was slower), with that mode's BLOCKS entry, on rows of 8192 tokens of 8
# heads holding equal samples of 8192, 4096, ..., 128 tokens. Measured by `bench/attention.py --gpu
# --sweep` on an NVIDIA H200 (jax 0.11.2, CUDA 13), 2026-11-28. Without an entry (fp32 and bf16x3
# dots, other GPUs) "auto" takes dense, which cannot lose to itself.
CROSSOVER: dict[tuple[str, int, str], float] = {
    ("hopper", 64, "tf32"): float("inf"),  # 1 x 8192: 4.71 ms against dense's 7.50
    ("hopper", 64, "bf16"): float("inf"),  # 1 x 8192: 1.63 ms against 6.75
    ("hopper", 128, "tf32"): 4096,  # 1 x 8192: 12.44 ms against 9.03; 2 x 4096: 6.50 against 9.08
    ("hopper", 128, "bf16"): float("inf"),  # 1 x 8192: 3.74 ms against 7.99
}

# Dense attention's [B, H, T, T] fp32 scores above this many bytes: the Pallas kernel (memory linear
# in T) whatever the speed. A memory policy, not a measurement: dense keeps about three such
# matrices alive through its backward.
DENSE_SCORE_BYTES = 4 << 30


def choose_impl(T: int, Dh: int, mode: str, kind: str | None, *, longest: int | None = None, B: int = 1,
                H: int = 1, dense_score_bytes: int = DENSE_SCORE_BYTES) -> str:
    """"pallas" or "dense" for rows of T tokens whose longest sample has `longest` tokens (None:
    unknown, so possibly T): the Pallas kernel where the sweep found it no slower than dense for
    such samples, or where dense's scores would not fit `dense_score_bytes`; dense otherwise."""
    if B * H * T * T * 4 > dense_score_bytes:
        return "pallas"
    longest = T if longest is None else min(int(longest), T)
    crossover = CROSSOVER.get((generation(kind), padded_head(Dh), mode))
    return "pallas" if crossover is not None and longest <= crossover else "dense"


def useful_flops(sample_lens, H: int, Dh: int, backward: bool) -> float:
    """Matmul FLOPs of causal attention over samples of these lengths (one row, H heads): forward
    2 products of s(s+1)/2 dots of Dh; the backward's 5 products count 2.5 forwards (FlashAttention's
    accounting). Segment and dense implementations are credited the same useful work."""
    fwd = sum(2 * 2 * H * Dh * s * (s + 1) / 2 for s in sample_lens)
    return fwd * (3.5 if backward else 1.0)


# Dense bf16 tensor-core peak (TFLOP/s, no sparsity) from NVIDIA's data sheets, for the bench's
# "share of peak" bar; matched by substring of device_kind, most specific first.
BF16_PEAK_TFLOPS = (("H100 PCIE", 756.0), ("H100 NVL", 835.0), ("H200", 989.4), ("H100", 989.4), ("A100", 312.0))


def bf16_peak_tflops(kind: str | None) -> float | None:
    kind = (kind or "").upper()
    return next((peak for name, peak in BF16_PEAK_TFLOPS if name in kind), None)
