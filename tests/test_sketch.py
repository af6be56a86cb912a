"""The gradient-sketch kernels (jaxodc.ops.sketch, csrc/sketch) against the numpy reference of
tests/support/sketch_reference.py, every element checked: exact selection with error feedback, the
bitmap and its OR, the count sketch and its additivity, and peeling below and above capacity."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sketch_reference as ref
from jaxodc.ops.sketch import bitmap_words, sketch_build, sketch_peel, sketch_sparsify, sketch_width

SIZES = [1, 7, 32, 1023, (1 << 20) + 3]


def _grad(n, kind, rng):
    if kind == "random":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "zeros":
        return np.zeros(n, np.float32)
    return np.full(n, 0.5, np.float32)  # all equal: the selection is decided by the index alone


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", ["random", "zeros", "equal"])
@pytest.mark.parametrize("fraction", [0.01, 0.3, 1.0])
def test_sparsify_equals_reference(n, kind, fraction):
    rng = np.random.default_rng(n)
    g = _grad(n, kind, rng)
    r = (rng.standard_normal(n) * 0.1).astype(np.float32) if kind == "random" else np.zeros(n, np.float32)
    kept, res, bits = jax.jit(lambda g, r: sketch_sparsify(g, r, fraction=fraction))(g, r)
    want_kept, want_res, want_bits = ref.sparsify(g, r, fraction)
    np.testing.assert_array_equal(np.asarray(bits), want_bits)
    np.testing.assert_array_equal(np.asarray(kept), want_kept)
    np.testing.assert_array_equal(np.asarray(res), want_res)
    k = min(max(int(np.ceil(fraction * n)), 1), n)
    assert int(ref.unpack_bits(np.asarray(bits), n).sum()) == (0 if kind == "zeros" else k)  # zeros never kept


def test_sparsify_bf16_gradient():
    rng = np.random.default_rng(0)
    g = jnp.asarray(rng.standard_normal(4099), jnp.bfloat16)
    r = rng.standard_normal(4099).astype(np.float32)
    kept, res, bits = sketch_sparsify(g, r, fraction=0.05)
    want = ref.sparsify(np.asarray(g.astype(jnp.float32)), r, 0.05)
    for got, w in zip((kept, res, bits), want):
        np.testing.assert_array_equal(np.asarray(got), w)


def test_error_feedback_sends_everything_eventually():
    """After k steps, what was sent plus the residual is the sum of the raw gradients (integer
    values: every sum exact)."""
    rng = np.random.default_rng(1)
    n, steps = 1001, 6
    residual, sent, total = jnp.zeros(n, jnp.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
    step = jax.jit(lambda g, r: sketch_sparsify(g, r, fraction=0.1))
    for _ in range(steps):
        g = rng.integers(-50, 50, n).astype(np.float32)
        kept, residual, _ = step(g, residual)
        sent += np.asarray(kept)
        total += g
    np.testing.assert_array_equal(sent + np.asarray(residual), total)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_bitmap_or_across_ranks_is_numpy_or(ranks):
    rng = np.random.default_rng(ranks)
    n = 1000 + ranks  # not a multiple of 32
    masks, bitmaps = [], []
    for _ in range(ranks):
        _, _, bits = sketch_sparsify(rng.standard_normal(n).astype(np.float32), np.zeros(n, np.float32), fraction=0.2)
        bitmaps.append(bits)
        masks.append(ref.unpack_bits(np.asarray(bits), n))
    combined = bitmaps[0]
    for b in bitmaps[1:]:
        combined = jnp.bitwise_or(combined, b)
    np.testing.assert_array_equal(np.asarray(combined), ref.pack_bits(np.logical_or.reduce(masks)))
    assert not (int(combined[-1]) >> (n % 32))  # no bit past element n - 1


@pytest.mark.parametrize("n", [7, 1023, (1 << 20) + 3])
def test_build_equals_reference(n):
    rng = np.random.default_rng(n)
    kept, _, bits = sketch_sparsify(rng.standard_normal(n).astype(np.float32), np.zeros(n, np.float32),
                                    fraction=0.05)
    width = sketch_width(int(ref.unpack_bits(np.asarray(bits), n).sum()), 0.5)
    s = sketch_build(kept, bits, width=width, seed=7)
    assert s.shape == (3, width)
    np.testing.assert_array_equal(np.asarray(s), ref.build(np.asarray(kept), np.asarray(bits), width, seed=7))


def test_sketch_is_additive():
    rng = np.random.default_rng(3)
    n, width = 5000, 300
    a, b = (rng.integers(-1000, 1000, n).astype(np.float32) for _ in range(2))
    bits = jnp.asarray(ref.pack_bits(rng.random(n) < 0.3))
    lhs = sketch_build(a, bits, width=width) + sketch_build(b, bits, width=width)
    np.testing.assert_array_equal(np.asarray(lhs), np.asarray(sketch_build(a + b, bits, width=width)))


@pytest.mark.parametrize("n", [100, 10_007])
def test_peel_recovers_everything_below_capacity(n):
    rng = np.random.default_rng(n)
    mask = rng.random(n) < 0.2
    values = np.where(mask, rng.integers(-10_000, 10_000, n), 0).astype(np.float32)
    bits = ref.pack_bits(mask)
    width = sketch_width(int(mask.sum()), 0.5)  # 1.5 buckets per element, above the 1.22 threshold
    got, counts = sketch_peel(sketch_build(values, bits, width=width), bits, n=n)
    np.testing.assert_array_equal(np.asarray(got), values)
    assert tuple(np.asarray(counts)) == (int(mask.sum()), 0)
    floats = np.where(mask, rng.standard_normal(n), 0).astype(np.float32)
    got, counts = sketch_peel(sketch_build(floats, bits, width=width), bits, n=n)
    np.testing.assert_allclose(np.asarray(got), floats, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ratio", [1.0, 3.0])
def test_peel_above_capacity_equals_reference(ratio):
    """Too narrow to peel everything: the peeled elements are exact, the rest are the median of
    their buckets; both, and the counts, equal the reference peeler's."""
    rng = np.random.default_rng(int(ratio * 10))
    n = 3000
    mask = rng.random(n) < 0.1
    values = np.where(mask, rng.integers(-1000, 1000, n), 0).astype(np.float32)
    bits = ref.pack_bits(mask)
    s = sketch_build(values, bits, width=sketch_width(int(mask.sum()), ratio), seed=11)
    got, counts = sketch_peel(s, bits, n=n, seed=11)
    want, want_counts = ref.peel(np.asarray(s), bits, n, seed=11)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert tuple(np.asarray(counts)) == want_counts
    peeled, estimated = want_counts
    assert estimated > 0 and peeled + estimated == int(mask.sum())
    assert np.all(np.asarray(got)[~mask] == 0)


def test_summed_sketches_of_two_senders_decode_their_sum():
    """The collective path: sketches add and bitmaps OR, one peel decodes the sum."""
    rng = np.random.default_rng(5)
    n = 4096
    grads = [rng.integers(-100, 100, n).astype(np.float32) for _ in range(2)]
    sent = [sketch_sparsify(g, np.zeros(n, np.float32), fraction=0.05) for g in grads]
    union = jnp.bitwise_or(sent[0][2], sent[1][2])
    width = sketch_width(int(ref.unpack_bits(np.asarray(union), n).sum()), 0.5)
    total = sketch_build(sent[0][0], union, width=width) + sketch_build(sent[1][0], union, width=width)
    got, counts = sketch_peel(total, union, n=n)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(sent[0][0]) + np.asarray(sent[1][0]))
    assert int(counts[1]) == 0


def test_bad_input_names_the_setting():
    g = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\], got 0"):
        sketch_sparsify(g, g, fraction=0.0)
    with pytest.raises(TypeError, match="grad must be a flat array of float32 or bfloat16, got int32"):
        sketch_sparsify(np.zeros(10, np.int32), g, fraction=0.5)
    with pytest.raises(ValueError, match="residual has 9 elements, grad 10"):
        sketch_sparsify(g, g[:9], fraction=0.5)
    with pytest.raises(ValueError, match="the bitmap holds 2 words; n=10 needs 1"):
        sketch_peel(jnp.zeros((3, 4), jnp.float32), jnp.zeros(2, jnp.uint32), n=10)
    with pytest.raises(ValueError, match="ratio must be > 0"):
        sketch_width(10, 0)
    # The kernels check too, for callers that bypass the wrappers.
    call = jax.ffi.ffi_call("jaxodc_sketch_build", jax.ShapeDtypeStruct((3, 4), jnp.float32))
    with pytest.raises(Exception, match="sketch_build: the bitmap holds 3 words; 10 elements need 1"):
        jax.block_until_ready(call(g, jnp.zeros(3, jnp.uint32), seed=np.int64(0)))
    assert bitmap_words(0) == 0 and bitmap_words(32) == 1 and bitmap_words(33) == 2


def test_bench_sketch_writes_every_stage(tmp_path):
    import json
    import subprocess
    import sys
    out = tmp_path / "sketch.json"
    proc = subprocess.run([sys.executable, "-m", "jaxodc", "bench", "sketch", "--mb", "1", "--reps", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    records = json.loads(out.read_text())
    assert [r["stage"] for r in records] == ["sparsify", "sketch", "peel", "memcpy", "pipeline"]
    assert all(r["bytes"] == 1 << 20 and r["seconds"] > 0 and r["gbps"] > 0 for r in records)
    assert "pipeline / memcpy" in proc.stdout and "peeled" in proc.stdout
