"""ODC ops on CUDA with 2 processes sharing the GPU: gather into device memory (fp32 and bf16)
and jax.grad pushing device gradients to the owners. Run on the device machine:
pytest -m gpu tests/gpu (not collected in CI, which has no GPU)."""
import numpy as np
import pytest

from harness import run_ranks
from odc_checks import check_grad_reaches_owners

pytestmark = pytest.mark.gpu

GPU_ENV = {"JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
SIZES = [45, 27, 100003]


def _values(unit, n, version):
    return np.random.default_rng([unit, version]).standard_normal(n).astype(np.float32)


def gpu_body(ctx):
    import jax
    import jax.numpy as jnp
    from jaxodc.odc import Runtime
    from jaxodc.ops import odc_gather
    assert jax.devices()[0].platform == "gpu"
    rt = Runtime.create(SIZES, ctx)
    full = [_values(u, n, 0) for u, n in enumerate(SIZES)]
    for u in range(len(SIZES)):
        lo, hi = rt.shard_range(u)
        shard = np.zeros(rt.shard_size(u), np.float32)
        shard[: hi - lo] = full[u][lo:hi]
        rt.publish(u, shard, 0)
    shards = [jnp.asarray(rt.read_shard(u)) for u in range(len(SIZES))]
    for dtype in (jnp.float32, jnp.bfloat16):
        got = jax.jit(lambda s, d=dtype: odc_gather(s, 0, runtime=rt, unit=2, numel=SIZES[2], dtype=d))(shards[2])
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                      np.asarray(jnp.asarray(full[2]).astype(dtype).astype(jnp.float32)))

    check_grad_reaches_owners(ctx, rt, shards, full, 0)
    rt.close()
    return True


def test_odc_on_cuda_two_processes():
    assert run_ranks(gpu_body, 2, timeout_s=180, env=GPU_ENV) == [True, True]
