"""GPU paths: the CUDA hash kernel equals the CPU hash; the CUDA FFI all-reduce (pinned staging)
inside jax.jit equals the CPU ring bit for bit. Run on the device machine: pytest -m gpu tests/gpu."""
from concurrent.futures import ThreadPoolExecutor

import jax
import ml_dtypes
import numpy as np
import pytest

from gpu import gpu_devices_or_skip
from jaxodc.comm.hashing import hash_array
from jaxodc.comm.ring import RingEndpoint
from jaxodc.ops import all_reduce

pytestmark = pytest.mark.gpu


GPU = gpu_devices_or_skip()[0]


@pytest.mark.parametrize("n", [1, 1000, 65536 // 4, 65536 // 4 + 3, 3_000_001])
@pytest.mark.parametrize("dtype", [np.float32, np.int64, ml_dtypes.bfloat16, np.uint8])
def test_cuda_hash_equals_cpu_hash(n, dtype):
    x = (np.random.default_rng(n).standard_normal(n) * 100).astype(dtype)
    g = jax.device_put(x, GPU)
    # Without jax_enable_x64 an int64 array lands on the device as int32: compare with the bytes
    # the device actually holds.
    assert hash_array(g) == hash_array(np.asarray(g))
    if g.dtype == x.dtype:
        assert hash_array(g) == hash_array(x)


def test_cuda_hash_detects_one_bit():
    x = np.zeros(1 << 20, np.float32)
    y = x.copy()
    y.view(np.uint32)[12345] ^= 1
    dev = GPU
    assert hash_array(jax.device_put(x, dev)) != hash_array(jax.device_put(y, dev))


@pytest.mark.parametrize("op,quantize", [("sum", None), ("avg", None), ("max", None), ("sum", "uint8")])
def test_cuda_ffi_all_reduce_matches_cpu_ring(op, quantize):
    eps = [RingEndpoint(secret=b"gpu", timeout_s=30) for _ in range(2)]
    addrs = [e.address for e in eps]
    try:
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda i: eps[i].connect_ring(addrs, i, 1), range(2)))
        xs = [np.random.default_rng(i).standard_normal((257, 33)).astype(np.float32) for i in range(2)]
        dev = GPU

        def gpu_peer():
            f = jax.jit(lambda v: all_reduce(v, eps[0], op=op, quantize=quantize))
            y, token = f(jax.device_put(xs[0], dev))
            assert int(token[0]) == 1
            assert y.devices() == {dev}
            return np.asarray(y)

        def cpu_peer():
            return eps[1].all_reduce(xs[1], op=op, quantize=quantize)

        with ThreadPoolExecutor(2) as ex:
            fg, fc = ex.submit(gpu_peer), ex.submit(cpu_peer)
            yg, yc = fg.result(timeout=60), fc.result(timeout=60)
        np.testing.assert_array_equal(yg.view(np.uint32), yc.view(np.uint32))
        ref = {"sum": xs[0] + xs[1], "avg": (xs[0] + xs[1]) / 2, "max": np.maximum(xs[0], xs[1])}[op]
        tol = 0 if quantize is None else 3 * (ref.max() - ref.min()) / 255
        assert np.abs(yg - ref).max() <= tol + 1e-6
    finally:
        for e in eps:
            e.close()
