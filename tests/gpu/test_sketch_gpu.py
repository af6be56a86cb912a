"""The CUDA sketch kernels against the numpy reference (the same checks as tests/test_sketch.py):
sparsify and peel bit for bit, build to float rounding (its atomics add in another order). Run on
the device machine: pytest -m gpu tests/gpu."""
import jax
import numpy as np
import pytest

import sketch_reference as ref
from gpu import gpu_devices_or_skip
from jaxodc.ops.sketch import sketch_build, sketch_peel, sketch_sparsify, sketch_width

pytestmark = pytest.mark.gpu
GPU = gpu_devices_or_skip()[0]


@pytest.mark.parametrize("n", [1, 7, 1023, (1 << 20) + 3])
@pytest.mark.parametrize("fraction", [0.01, 0.3, 1.0])
def test_sparsify_on_gpu_equals_reference(n, fraction):
    rng = np.random.default_rng(n)
    g, r = rng.standard_normal(n).astype(np.float32), (rng.standard_normal(n) * 0.1).astype(np.float32)
    with jax.default_device(GPU):
        got = jax.jit(lambda g, r: sketch_sparsify(g, r, fraction=fraction))(g, r)
    for x, want in zip(got, ref.sparsify(g, r, fraction)):
        np.testing.assert_array_equal(np.asarray(x), want)


def test_build_and_peel_on_gpu():
    rng = np.random.default_rng(1)
    n = 100_003
    mask = rng.random(n) < 0.05
    values = np.where(mask, rng.integers(-1000, 1000, n), 0).astype(np.float32)
    bits = ref.pack_bits(mask)
    width = sketch_width(int(mask.sum()), 0.5)
    with jax.default_device(GPU):
        s = sketch_build(values, bits, width=width, seed=3)
        np.testing.assert_array_equal(np.asarray(s), ref.build(values, bits, width, seed=3))  # integer sums: exact
        got, counts = sketch_peel(s, bits, n=n, seed=3)
    np.testing.assert_array_equal(np.asarray(got), values)
    assert tuple(np.asarray(counts)) == (int(mask.sum()), 0)
