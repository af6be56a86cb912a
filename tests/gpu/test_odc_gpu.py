"""ODC ops on CUDA with 2 processes sharing the GPU: gather into device memory (fp32 and bf16)
and jax.grad pushing device gradients to the owners. Run on the device machine:
pytest -m gpu tests/gpu (not collected in CI, which has no GPU)."""
import numpy as np
import pytest

from harness import run_ranks

pytestmark = pytest.mark.gpu

GPU_ENV = {"JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
SIZES = [45, 27, 100003]


def _values(unit, n, version):
    return np.random.default_rng([unit, version]).standard_normal(n).astype(np.float32)


def _loss(w1, w2, x):
    import jax.numpy as jnp
    return jnp.sum((jnp.tanh(x @ w1.reshape(5, 9)) @ w2.reshape(9, 3)) ** 2)


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
        got = jax.jit(lambda s, d=dtype: odc_gather(s, 0, unit=2, numel=SIZES[2], dtype=d))(shards[2])
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                      np.asarray(jnp.asarray(full[2]).astype(dtype).astype(jnp.float32)))

    def loss(s1, s2, x, v):
        return _loss(odc_gather(s1, v, unit=0, numel=45), odc_gather(s2, v, unit=1, numel=27), x)

    xs = [np.random.default_rng([r, 5]).standard_normal((4, 5)).astype(np.float32) for r in range(ctx.world)]
    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1)))(shards[0], shards[1], xs[ctx.rank], 0))
    rt.done(0)
    rt.wait_complete(0)
    ref = [np.zeros(45, np.float32), np.zeros(27, np.float32)]
    for x in xs:
        g1, g2 = jax.grad(_loss, argnums=(0, 1))(full[0], full[1], x)
        ref[0] += np.asarray(g1)
        ref[1] += np.asarray(g2)
    for u in range(2):
        lo, hi = rt.shard_range(u)
        np.testing.assert_allclose(rt.fetch_grad(u)[: hi - lo], ref[u][lo:hi], rtol=1e-5, atol=1e-5)
    rt.close()
    return True


def test_odc_on_cuda_two_processes():
    assert run_ranks(gpu_body, 2, timeout_s=180, env=GPU_ENV) == [True, True]
