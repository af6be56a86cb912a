"""The cuda_ipc transport of the ODC runtime: 2 processes on one node (they may share one GPU).

Checked against numpy / pure JAX, every element: gather of units whose sizes are not divisible by
the world (fp32 exact, bf16 = round-to-nearest-even of the fp32 values, odc_gather_into), scatter-
accumulate with a random number of pushes per rank (rank 1 none) mixed with bf16 device pushes and
host (numpy) pushes into the same accumulators, a second minibatch that overwrites the device
masters, and jax.grad through odc_gather. The same body runs with the routes mixed (device self +
shm / tcp peers) and without a device (the staged path). Faults: a peer killed before publishing or
after pushing raises a PeerError naming it. Run on the device machine:
pytest -m gpu tests/gpu/test_odc_cuda_ipc.py (not collected in CI, which has no GPU)."""
import json
import os
import signal
import time

import numpy as np
import pytest

from harness import RankFailure, run_ranks
from odc_checks import check_grad_reaches_owners

pytestmark = pytest.mark.gpu

GPU_ENV = {"JAX_PLATFORMS": "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
# Units 0 and 1 are the loss's weights (5x9, 9x3); unit 2 leaves rank 1 an empty piece.
SIZES = [45, 27, 1, 1001, 100003]


def values(unit, n, version, seed=0):
    return np.random.default_rng([seed, unit, version]).standard_normal(n).astype(np.float32)


def to_bf16_f32(x):
    import jax.numpy as jnp
    return np.asarray(x, np.float32).astype(jnp.bfloat16).astype(np.float32)  # numpy (ml_dtypes) RNE


def publish_all(rt, version):
    for u, n in enumerate(rt.unit_sizes):
        lo, hi = rt.shard_range(u)
        shard = np.zeros(rt.shard_size(u), np.float32)
        shard[: hi - lo] = values(u, n, version)[lo:hi]
        rt.publish(u, shard, version)


def pushes_of(rank, world, seed=3):
    """Random number of pushes per rank (rank 1 pushes nothing), each a dict unit -> fp32 gradient."""
    counts = np.random.default_rng([seed, 99]).integers(1, 4, size=world)
    counts[1 % world] = 0
    rng = np.random.default_rng([seed, rank])
    return [{u: rng.standard_normal(n).astype(np.float32) for u, n in enumerate(SIZES)} for _ in range(counts[rank])]


def bf16_push(rank):
    return to_bf16_f32(values(3, SIZES[3], 70 + rank))  # exactly representable in bf16


def host_push(rank):
    return values(4, SIZES[4], 50 + rank)


def exchange_body(ctx, transport, device):
    import jax
    import jax.numpy as jnp
    from jaxodc.odc import Runtime
    from jaxodc.ops import odc_gather, odc_gather_into, odc_scatter_accumulate
    assert jax.default_backend() == "gpu"
    # fp32 matmuls in full precision, so the ODC gradient and the reference use the same arithmetic.
    jax.config.update("jax_default_matmul_precision", "highest")
    rt = Runtime.create(SIZES, ctx, transport=transport, device=device, timeout_s=60.0)
    out = {"transports": rt.transports, "device": rt.device}
    publish_all(rt, 0)
    shards = [jax.device_put(rt.read_shard(u)) for u in range(len(SIZES))]

    # gather, fp32 and bf16, every unit
    for u, n in enumerate(SIZES):
        g32 = jax.jit(lambda s, v, u=u, n=n: odc_gather(s, v, runtime=rt, unit=u, numel=n))(shards[u], 0)
        np.testing.assert_array_equal(np.asarray(g32), values(u, n, 0), err_msg=f"fp32 unit {u}")
        g16 = jax.jit(lambda s, v, u=u, n=n: odc_gather(s, v, runtime=rt, unit=u, numel=n, dtype=jnp.bfloat16))(shards[u], 0)
        assert g16.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(g16.astype(jnp.float32)), to_bf16_f32(values(u, n, 0)),
                                      err_msg=f"bf16 unit {u}")
    gi = jax.jit(lambda b, s, v: odc_gather_into(b, s, v, runtime=rt, unit=4), donate_argnums=0)
    buf = gi(jnp.zeros(SIZES[4], jnp.float32), shards[4], 0)
    buf = gi(buf, shards[4], 0)  # twice: the donated buffer is reused
    np.testing.assert_array_equal(np.asarray(buf), values(4, SIZES[4], 0))

    # scatter-accumulate: device fp32 pushes (random count), one bf16 device push, one host push
    scatter = jax.jit(lambda s, g, v, u: odc_scatter_accumulate(s, g, v, runtime=rt, unit=u), static_argnums=3)
    for push in pushes_of(ctx.rank, ctx.world):
        for u, g in push.items():
            jax.block_until_ready(scatter(shards[u], jnp.asarray(g), 0, u))
    jax.block_until_ready(scatter(shards[3], jnp.asarray(bf16_push(ctx.rank), dtype=jnp.bfloat16), 0, 3))
    rt.scatter_accumulate(4, 0, host_push(ctx.rank))
    rt.done(0)
    rt.wait_complete(0)
    ref = [np.zeros(n, np.float64) for n in SIZES]
    for r in range(ctx.world):
        for push in pushes_of(r, ctx.world):
            for u, g in push.items():
                ref[u] += g
        ref[3] += bf16_push(r)
        ref[4] += host_push(r)
    for u, n in enumerate(SIZES):
        lo, hi = rt.shard_range(u)
        got = rt.fetch_grad(u)
        np.testing.assert_allclose(got[: hi - lo], ref[u][lo:hi], rtol=1e-5, atol=1e-5, err_msg=f"unit {u}")
        assert not np.any(got[hi - lo:]), f"unit {u}: padding of the shard accumulated something"

    # minibatch 1: the device masters are overwritten; gather sees exactly the new values
    publish_all(rt, 1)
    for u, n in enumerate(SIZES):
        got = jax.jit(lambda s, v, u=u, n=n: odc_gather(s, v, runtime=rt, unit=u, numel=n))(shards[u], 1)
        np.testing.assert_array_equal(np.asarray(got), values(u, n, 1), err_msg=f"version 1 unit {u}")

    # jax.grad through odc_gather pushes the owners their gradient (minibatch 1)
    check_grad_reaches_owners(ctx, rt, shards, [values(0, 45, 1), values(1, 27, 1)], 1)

    stats = rt.stats()
    out.update(device_bytes=stats["device_bytes"], slot_bytes=stats["slot_bytes"],
               pushes=stats["pushes_received"])
    rt.close()
    return out


@pytest.mark.parametrize("transport,device,expect", [
    ("auto", "auto", "cuda_ipc"),  # both ranks on a GPU, same host
    ("shm", "auto", "shm"),        # device self, peers staged through shared memory
    ("tcp", "auto", "tcp"),        # device self, peers staged through tcp
    ("auto", None, "shm"),         # no device block: the staged path throughout
])
def test_exchange_on_cuda(transport, device, expect):
    results = run_ranks(exchange_body, 2, args=(transport, device), timeout_s=240, env=GPU_ENV)
    padded_max = max(-(-n // 2) * 2 for n in SIZES) * 4
    for rank, out in enumerate(results):
        assert out["transports"][rank] == "self"
        assert out["transports"][1 - rank] == expect, out
        assert (out["device"] is None) == (device is None), out
        assert (out["device_bytes"] > 0) == (device is not None), out
        assert out["slot_bytes"] <= padded_max, out  # the paper's bound: one unit per server
        assert out["pushes"] > 0, out


def dying_body(ctx, mode, report, transport="auto", expect="cuda_ipc"):
    import jax
    import jax.numpy as jnp
    from jaxodc.odc import Runtime
    from jaxodc.ops import odc_gather, odc_scatter_accumulate
    rt = Runtime.create([1000], ctx, transport=transport, timeout_s=20.0)
    assert rt.transports[1 - ctx.rank] == expect, rt.transports
    publish_all(rt, 0)
    shard = jax.device_put(rt.read_shard(0))
    if mode == "gather":  # finish minibatch 0 so that only rank 1's version 1 is missing
        rt.done(0)
        rt.wait_complete(0)
    if ctx.rank == 1:
        if mode == "push":  # lands in rank 0's device slot, then rank 1 dies before done(0)
            jax.block_until_ready(jax.jit(lambda s, g: odc_scatter_accumulate(s, g, 0, runtime=rt, unit=0))(
                shard, jnp.ones(1000, jnp.float32)))
        ctx.barrier("ready")
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "gather":
        publish_all(rt, 1)
    ctx.barrier("ready")
    start = time.monotonic()
    try:
        if mode == "gather":  # rank 1 never publishes version 1
            jax.block_until_ready(jax.jit(lambda s: odc_gather(s, 1, runtime=rt, unit=0, numel=1000))(shard))
        else:
            rt.done(0)
            rt.wait_complete(0)
        result = {"error": "none"}
    except Exception as e:  # noqa: BLE001 - jax wraps the FFI error; the message is what matters
        result = {"error": type(e).__name__, "message": str(e)}
    result["seconds"] = time.monotonic() - start
    with open(report, "w") as f:
        json.dump(result, f)
    rt.close(barrier=False)
    result["leftover"] = sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"jaxodc_{ctx.job_id}_0"))
    with open(report, "w") as f:
        json.dump(result, f)


@pytest.mark.parametrize("mode", ["gather", "push"])
def test_peer_killed_over_cuda_ipc_raises_naming_it(tmp_path, mode):
    report = tmp_path / "rank0.json"
    with pytest.raises(RankFailure) as failure:
        run_ranks(dying_body, 2, args=(mode, str(report)), timeout_s=120, env=GPU_ENV)
    assert "rank 1" in str(failure.value)
    result = json.loads(report.read_text())
    assert result["error"] != "none", result
    assert "rank 1" in result["message"] and ("died" in result["message"] or "shut down" in result["message"]), result
    assert result["seconds"] < 5, result
    assert result.get("leftover", []) == [], result
