"""TAGC's gradient compression as FFI kernels (csrc/sketch): exact top-fraction sparsification with
an error-feedback residual, the support as a bitmap, a 3-row count sketch of the kept values, and
the peeling decoder. Sketches add and bitmaps OR (`jnp.bitwise_or`), so a receiver may sum several
senders' before one `sketch_peel`.

    kept, residual, bitmap = sketch_sparsify(grad, residual, fraction=0.01)
    s = sketch_build(kept, bitmap, width=sketch_width(grad.size, ratio=10))  # what travels: bitmap + s
    values, (peeled, estimated) = sketch_peel(s, bitmap, n=grad.size)
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxodc._native import register_targets

__all__ = ["PEEL_MARGIN", "bitmap_words", "peel_width", "sketch_build", "sketch_peel", "sketch_sparsify",
           "sketch_width"]

ROWS = 3
# Buckets per element a sketch needs to peel every element: the 3-row threshold is 1.222 for large
# supports; at 1.25 supports of ~800 elements still failed 2 times in 5 (bench/RESULTS.md, TAGC).
PEEL_MARGIN = 1.3


def bitmap_words(n: int) -> int:
    """uint32 words of a bitmap over n elements (bit i in word i // 32, bit i % 32)."""
    return (int(n) + 31) // 32


def sketch_width(n: int, ratio: float) -> int:
    """Buckets per row for a sketch `ratio` times smaller than n fp32 values sent densely
    (3 rows x width = n / ratio buckets, TAGC's "compression level"); at least 1.

    Peeling recovers every kept element, with high probability, while the 3 * width buckets
    number about 1.23 x the kept count or more (the 3-row hypergraph peeling threshold)."""
    if not ratio > 0:
        raise ValueError(f"sketch_width: ratio must be > 0, got {ratio}")
    return max(1, math.ceil(n / (ROWS * ratio)))


def peel_width(count: int) -> int:
    """Buckets per row that peel a support of `count` elements (PEEL_MARGIN x count buckets in all)."""
    return max(1, math.ceil(PEEL_MARGIN * int(count) / ROWS))


def _flat(x, what: str, dtypes) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim != 1 or x.dtype not in dtypes:
        raise TypeError(f"{what} must be a flat array of {' or '.join(str(jnp.dtype(d)) for d in dtypes)}, "
                        f"got {x.dtype}{list(x.shape)}")
    return x


def sketch_sparsify(grad, residual, *, fraction: float):
    """Keeps the top `fraction` of |grad + residual| exactly (ties: lower index first).

    Args:
      grad: flat float32 or bfloat16 gradient (n elements).
      residual: flat float32, what earlier calls did not send (zeros at first).
      fraction: in (0, 1]; the k = ceil(fraction * n) largest are kept (at least one), except
        exact zeros, which carry nothing and would only load the sketch.

    Returns:
      ``(kept, residual, bitmap)``: kept float32 [n] (grad + residual where kept, else 0), the next
      residual float32 [n] (the rest), and the kept positions as uint32 [bitmap_words(n)].
    """
    register_targets()
    g = _flat(grad, "sketch_sparsify: grad", (jnp.float32, jnp.bfloat16))
    r = _flat(residual, "sketch_sparsify: residual", (jnp.float32,))
    if r.shape != g.shape:
        raise ValueError(f"sketch_sparsify: residual has {r.size} elements, grad {g.size}")
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"sketch_sparsify: fraction must be in (0, 1], got {fraction}")
    f32 = jax.ShapeDtypeStruct(g.shape, jnp.float32)
    return jax.ffi.ffi_call(
        "jaxodc_sketch_sparsify",
        (f32, f32, jax.ShapeDtypeStruct((bitmap_words(g.size),), jnp.uint32)),
        vmap_method="sequential",
    )(g, r, fraction=np.float64(fraction))


def sketch_build(values, bitmap, *, width: int, seed: int = 0) -> jax.Array:
    """The count sketch of `values` on the bitmap's support.

    Args:
      values: flat float32 [n] (off-support elements are ignored).
      bitmap: uint32 [bitmap_words(n)].
      width: buckets per row (`sketch_width`).
      seed: the hash seed; sender and receiver must use the same.

    Returns:
      float32 [3, width]: row r, bucket b holds the sum of sign_r(i) * values[i] over the support's
      elements i hashed to b in row r. Additive: build(a) + build(b) = build(a + b) on one support.
    """
    register_targets()
    v = _flat(values, "sketch_build: values", (jnp.float32,))
    b = _flat(bitmap, "sketch_build: bitmap", (jnp.uint32,))
    if int(width) < 1:
        raise ValueError(f"sketch_build: width must be >= 1, got {width}")
    return jax.ffi.ffi_call("jaxodc_sketch_build", jax.ShapeDtypeStruct((ROWS, int(width)), jnp.float32),
                            vmap_method="sequential")(v, b, seed=np.int64(seed))


def sketch_peel(sketch, bitmap, *, n: int, seed: int = 0):
    """Decodes a (summed) count sketch over the bitmap's support.

    Args:
      sketch: float32 [3, width], from `sketch_build` (or a sum of several).
      bitmap: uint32 [bitmap_words(n)], the support (an OR of the senders' bitmaps).
      n: elements of the decoded vector.
      seed: the hash seed used to build the sketch.

    Returns:
      ``(values, counts)``: float32 [n] (0 off the support) and int32 [2]: elements recovered
      exactly by peeling, and elements estimated by the median of their three buckets.
    """
    register_targets()
    s = jnp.asarray(sketch)
    if s.ndim != 2 or s.shape[0] != ROWS or s.dtype != jnp.float32:
        raise TypeError(f"sketch_peel: sketch must be float32 [3, width], got {s.dtype}{list(s.shape)}")
    b = _flat(bitmap, "sketch_peel: bitmap", (jnp.uint32,))
    if b.size != bitmap_words(n):
        raise ValueError(f"sketch_peel: the bitmap holds {b.size} words; n={n} needs {bitmap_words(n)}")
    return jax.ffi.ffi_call(
        "jaxodc_sketch_peel",
        (jax.ShapeDtypeStruct((int(n),), jnp.float32), jax.ShapeDtypeStruct((2,), jnp.int32)),
        vmap_method="sequential",
    )(s, b, seed=np.int64(seed))
