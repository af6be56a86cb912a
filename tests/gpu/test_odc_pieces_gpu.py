"""The CUDA handlers of the per-leaf ODC ops, 2 processes sharing the GPU: odc_gather_pieces into
device memory (fp32 and bf16, against numpy, every element), jax.grad through it pushing each
piece's cotangent with the range push (against the single-process gradient), a bf16 range push,
and TAGC-compressed range pushes of device arrays against the numpy model of the CPU tests
(tests/test_odc_compress.py), bit for bit in the traffic counters. Each runs with and without a
device block. NEVER YET RUN ON A GPU when written. Run on the device machine:
pytest -m gpu tests/gpu/test_odc_pieces_gpu.py (not collected in CI, which has no GPU)."""
import numpy as np
import pytest

import test_odc_compress as toc
from harness import run_ranks
from odc_checks import check_grad_reaches_owners

pytestmark = pytest.mark.gpu

GPU_ENV = {"JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
SIZES = [45, 27, 1001]
PIECES = ((0, 10), (10, 500), (700, 301))  # elements 510..699 belong to no piece
CPU_PUSHES = toc.pushes  # the CPU tests' cut of each push (the test below patches toc.pushes)


def values(unit, n, version):
    return np.random.default_rng([unit, version]).standard_normal(n).astype(np.float32)


def to_bf16_f32(x):
    import jax.numpy as jnp
    return np.asarray(x, np.float32).astype(jnp.bfloat16).astype(np.float32)  # numpy (ml_dtypes) RNE


def pieces_body(ctx, transport, device):
    import jax
    import jax.numpy as jnp
    from jaxodc.odc import Runtime
    from jaxodc.ops import odc_gather_pieces, odc_scatter_accumulate
    assert jax.default_backend() == "gpu"
    jax.config.update("jax_default_matmul_precision", "highest")
    rt = Runtime.create(SIZES, ctx, transport=transport, device=device, timeout_s=60.0)
    full = [values(u, n, 0) for u, n in enumerate(SIZES)]
    for u in range(len(SIZES)):
        lo, hi = rt.shard_range(u)
        shard = np.zeros(rt.shard_size(u), np.float32)
        shard[: hi - lo] = full[u][lo:hi]
        rt.publish(u, shard, 0)
    shards = [jax.device_put(rt.read_shard(u)) for u in range(len(SIZES))]

    for dtype in (jnp.float32, jnp.bfloat16):
        got = jax.jit(lambda s, d=dtype: odc_gather_pieces(s, 0, runtime=rt, unit=2, numel=SIZES[2], pieces=PIECES,
                                                           dtype=d))(shards[2])
        for (o, n), g in zip(PIECES, got):
            assert g.dtype == dtype and g.shape == (n,)
            assert all(d.platform == "gpu" for d in g.devices())
            want = full[2][o:o + n] if dtype == jnp.float32 else to_bf16_f32(full[2][o:o + n])
            np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), want, err_msg=f"{dtype} piece at {o}")

    # jax.grad through odc_gather_pieces: each piece's cotangent leaves by the CUDA range push.
    check_grad_reaches_owners(ctx, rt, shards, full, 0, pieces=True)

    # A bf16 range push (minibatch 1) lands in fp32, exactly (bf16 values, one push per rank).
    for u in range(len(SIZES)):
        rt.publish(u, np.zeros(rt.shard_size(u), np.float32), 1)
    g16 = [to_bf16_f32(values(2, 300, 40 + r)) for r in range(ctx.world)]
    push = jax.jit(lambda s, g: odc_scatter_accumulate(s, g, 1, runtime=rt, unit=2, offset=600))
    jax.block_until_ready(push(shards[2], jnp.asarray(g16[ctx.rank], jnp.bfloat16)))
    rt.done(1)
    rt.wait_complete(1)
    want = np.zeros(SIZES[2], np.float32)
    want[600:900] = sum(g16)
    lo, hi = rt.shard_range(2)
    np.testing.assert_array_equal(rt.fetch_grad(2)[: hi - lo], want[lo:hi], err_msg=f"rank {ctx.rank} bf16 range")
    out = {"transports": rt.transports, "device": rt.device}
    rt.close()
    return out


@pytest.mark.parametrize("transport,device", [("auto", "auto"), ("auto", None)])  # cuda_ipc; staged shm
def test_gather_pieces_and_range_push_on_cuda(transport, device):
    results = run_ranks(pieces_body, 2, args=(transport, device), timeout_s=240, env=GPU_ENV)
    for out in results:
        assert (out["device"] is None) == (device is None), out


def gpu_pushes(version, push, unit, ranges_only):
    """The pushes of tests/test_odc_compress.py; with a device block every push is a range push
    (a whole-unit push from a device goes GPU to GPU to same-host owners, dense)."""
    if ranges_only:
        cut = toc.SPLIT if unit == 1 else toc.SIZES[unit] // 2
        return [(0, cut), (cut, toc.SIZES[unit] - cut)]
    return CPU_PUSHES(version, push, unit)


def compressed_body(ctx, transport, device):
    import jax
    import jax.numpy as jnp
    from jaxodc.odc import Runtime
    from jaxodc.ops import odc_scatter_accumulate
    assert jax.default_backend() == "gpu"
    rt = Runtime.create(toc.SIZES, ctx, transport=transport, device=device, timeout_s=60.0)
    for u, o, n, f, r in toc.RANGES:
        rt.add_range(u, o, n, fraction=f, ratio=r, seed=toc.seed_of(u))
    shards = [jax.device_put(np.zeros(rt.shard_size(u), np.float32)) for u in range(len(toc.SIZES))]
    push = jax.jit(lambda s, g, v, u, o: odc_scatter_accumulate(s, g, v, runtime=rt, unit=u, offset=o),
                   static_argnums=(3, 4))
    grads = []
    for v in range(toc.VERSIONS):
        for u in range(len(toc.SIZES)):
            if v == 0:
                rt.publish(u, np.zeros(rt.shard_size(u), np.float32), 0)
            rt.gather(u, v)
        for p in range(toc.PUSHES):
            for u in range(len(toc.SIZES)):
                g = jnp.asarray(toc.gradient(ctx.rank, v, p, u))  # on the GPU
                for offset, n in gpu_pushes(v, p, u, device is not None):
                    jax.block_until_ready(push(shards[u], g if offset is None else g[offset:offset + n], v, u, offset))
        rt.done(v)
        rt.wait_complete(v)
        grads.append([rt.fetch_grad(u) for u in range(len(toc.SIZES))])
        for u in range(len(toc.SIZES)):
            rt.publish(u, np.zeros(rt.shard_size(u), np.float32), v + 1)
    out = {"grads": grads, "traffic": [rt.traffic(u) for u in range(len(toc.SIZES))],
           "residual": {(u, o): rt.residual(u, o) for u, o, *_ in toc.RANGES}, "device": rt.device}
    rt.close()
    return out


@pytest.mark.parametrize("transport,device", [("tcp", None), ("auto", "auto")])
def test_compressed_range_push_on_cuda_equals_numpy_model(transport, device, monkeypatch):
    results = run_ranks(compressed_body, 2, args=(transport, device), timeout_s=240, env=GPU_ENV)
    monkeypatch.setattr(toc, "pushes", lambda v, p, u: gpu_pushes(v, p, u, device is not None))
    acc, residual, traffic = toc.model_exchange(2)
    for d, res in enumerate(results):
        assert (res["device"] is None) == (device is None), res["device"]
        for v in range(toc.VERSIONS):
            for u in range(len(toc.SIZES)):
                np.testing.assert_allclose(res["grads"][v][u], acc[v][d][u], rtol=2e-5, atol=2e-5,
                                           err_msg=f"owner {d} version {v} unit {u}")
        for u, o, *_ in toc.RANGES:
            np.testing.assert_allclose(res["residual"][(u, o)], residual[(d, u, o)], rtol=2e-5, atol=2e-5,
                                       err_msg=f"rank {d} residual of unit {u} range at {o}")
        for u in range(len(toc.SIZES)):
            assert res["traffic"][u] == traffic[d][u], f"rank {d} unit {u}"
    assert sum(res["traffic"][0]["estimated"] for res in results) > 0  # unit 0's lossy sketch was exercised
