"""ODC primitives across processes: gather, scatter-accumulate, the version protocol, jax.grad
through odc_gather, and the fault cases (bad input, dead peers, timeouts, shared-memory leaks)."""
import json
import re
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from harness import RankFailure, run_ranks
from odc_checks import check_grad_reaches_owners, wait_zeroed

UNIT_SIZES = [1, 7, 1000, 12345]


def unit_values(unit, numel, version, seed=0):
    """Deterministic full contents of a unit at a version (every rank can recompute them)."""
    return np.random.default_rng([seed, unit, version]).standard_normal(numel).astype(np.float32)


def make_runtime(ctx, sizes=UNIT_SIZES, transport="auto", timeout_s=30.0):
    from jaxodc.odc import Runtime
    return Runtime.create(sizes, ctx, transport=transport, timeout_s=timeout_s)


def publish_all(rt, version, seed=0):
    for u, n in enumerate(rt.unit_sizes):
        lo, hi = rt.shard_range(u)
        shard = np.zeros(rt.shard_size(u), np.float32)
        shard[: hi - lo] = unit_values(u, n, version, seed)[lo:hi]
        rt.publish(u, shard, version)


def shm_entries(job_id, rank=None):
    prefix = f"jaxodc_{job_id}_" + ("" if rank is None else str(rank))
    return sorted(n for n in os.listdir("/dev/shm") if n == prefix or (rank is None and n.startswith(prefix)))


# -- gather --------------------------------------------------------------------------------------

def gather_body(ctx, transport):
    rt = make_runtime(ctx, transport=transport)
    publish_all(rt, 0)
    leftover = shm_entries(ctx.job_id, ctx.rank)
    for u, n in enumerate(UNIT_SIZES):
        np.testing.assert_array_equal(rt.gather(u, 0), unit_values(u, n, 0))
    rt.close()
    return rt.transports, leftover


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_gather_is_exact_concatenation(world, transport):
    results = run_ranks(gather_body, world, args=(transport,))
    for rank, (transports, leftover) in enumerate(results):
        assert transports[rank] == "self"
        assert all(t == transport for r, t in enumerate(transports) if r != rank)
        # Segment names are dropped once every peer mapped them: a crash cannot leak them.
        assert leftover == []


def pieces_body(ctx, transport):
    """odc_gather_pieces straight into one buffer per piece equals the whole unit's slices, with
    gaps between pieces and pieces spanning owners, in fp32 and bf16."""
    import jax
    import jax.numpy as jnp
    from jaxodc.ops import odc_gather, odc_gather_pieces
    rt = make_runtime(ctx, transport=transport)
    publish_all(rt, 0)
    u, n = 3, UNIT_SIZES[3]
    pieces = ((0, 5), (5, 0), (100, 6000), (6001, 1), (7000, n - 7000 - 3))  # spans both owners
    shard = jnp.asarray(rt.read_shard(u))
    for dtype in (jnp.float32, jnp.bfloat16):
        got = jax.jit(lambda s: odc_gather_pieces(s, 0, runtime=rt, unit=u, numel=n, pieces=pieces, dtype=dtype))(shard)
        whole = odc_gather(shard, 0, runtime=rt, unit=u, numel=n, dtype=dtype)
        for (o, k), g in zip(pieces, got):
            assert g.dtype == dtype and g.shape == (k,)
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(whole[o:o + k], np.float32))
    rt.close()
    return True


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_gathered_pieces_equal_the_units_slices(transport):
    assert run_ranks(pieces_body, 2, args=(transport,)) == [True, True]


# -- work-stealing deques --------------------------------------------------------------------------

def claims_body(ctx, transport):
    """Every rank steals from rank 0's deque of 12 (then 7) microbatches while rank 0 takes its
    front; rank 1 then probes minibatch 0 after minibatch 8 took over its deque word (versions
    share a word modulo 8)."""
    rt = make_runtime(ctx, sizes=[8], transport=transport)
    got = {}
    for v, n in ((0, 12), (8, 7)):
        mine = []
        while (i := rt.claim(v, 0, n, steal=ctx.rank != 0)) >= 0:
            mine.append(i)
        got[v] = mine
        rt.allgather_scalar(v, 0.0)  # everyone drained minibatch v before v + 1 starts
    err = ""
    if ctx.rank == 1:
        try:
            rt.claim(0, 0, 12, steal=True)
        except Exception as e:  # noqa: BLE001 - the message is the check
            err = str(e)
    rt.allgather_scalar(9, 0.0)
    rt.close()
    return got, err


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_claim_hands_out_each_microbatch_once(transport):
    results = run_ranks(claims_body, 3, args=(transport,))
    for v, n in ((0, 12), (8, 7)):
        owner = results[0][0][v]
        assert owner == list(range(len(owner))), owner  # the owner takes from the front
        for got, _ in results[1:]:
            assert got[v] == sorted(got[v], reverse=True), got[v]  # thieves from the back
        assert sorted(i for got, _ in results for i in got[v]) == list(range(n))  # each exactly once
    assert "older" in results[1][1] and "rank 0" in results[1][1], results[1][1]


def bad_claims_body(ctx):
    rt = make_runtime(ctx, sizes=[8], transport="shm")
    errs = []
    for args in ((0, 5, 3, False), (0, 0, -1, False), (0, 0, 1 << 21, False)):
        try:
            rt.claim(*args)
            errs.append("")
        except Exception as e:  # noqa: BLE001 - the message is the check
            errs.append(str(e))
    rt.close()
    return errs


def test_claim_rejects_bad_arguments():
    errs = run_ranks(bad_claims_body, 2)[0]
    assert "owner rank 5" in errs[0] and "rank 0 has -1" in errs[1] and "fit a deque" in errs[2], errs


# -- scatter-accumulate ----------------------------------------------------------------------------

def pushes_of(rank, world, seed):
    """Random number of pushes per rank (rank 1 pushes nothing), each a dict unit -> gradient."""
    counts = np.random.default_rng([seed, 99]).integers(1, 4, size=world)
    counts[1 % world] = 0
    rng = np.random.default_rng([seed, rank])
    return [{u: rng.standard_normal(n).astype(np.float32) for u, n in enumerate(UNIT_SIZES)}
            for _ in range(counts[rank])]


def scatter_body(ctx, transport, seed):
    rt = make_runtime(ctx, transport=transport)
    publish_all(rt, 0)
    for push in pushes_of(ctx.rank, ctx.world, seed):
        for u, g in push.items():
            rt.scatter_accumulate(u, 0, g)
    rt.done(0)
    rt.wait_complete(0)
    out = {}
    for u, n in enumerate(UNIT_SIZES):
        total = np.zeros(n, np.float64)
        for r in range(ctx.world):
            for push in pushes_of(r, ctx.world, seed):
                total += push[u]
        lo, hi = rt.shard_range(u)
        got = rt.fetch_grad(u)
        np.testing.assert_allclose(got[: hi - lo], total[lo:hi], rtol=1e-5, atol=1e-5)
        assert np.all(got[hi - lo:] == 0)  # padding never receives anything
        out[u] = got[: hi - lo]
    stats = rt.stats()
    rt.close()
    return stats


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_scatter_accumulate_equals_numpy_sum(world, transport):
    stats = run_ranks(scatter_body, world, args=(transport, world * 10))
    for s in stats:
        # All receive slots of a rank together hold one (padded) unit: the paper's bound.
        max_padded = max(-(-n // world) * world for n in UNIT_SIZES) * 4
        assert s["slot_bytes"] == max_padded


def psum_scatter_body(ctx, seed):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    from jaxodc.launch.context import init_jax_distributed
    init_jax_distributed(ctx)
    rt = make_runtime(ctx)
    publish_all(rt, 0)
    local_sum = {u: np.zeros(n, np.float32) for u, n in enumerate(UNIT_SIZES)}
    for push in pushes_of(ctx.rank, ctx.world, seed):
        for u, g in push.items():
            rt.scatter_accumulate(u, 0, g)
            local_sum[u] += g
    rt.done(0)
    rt.wait_complete(0)
    mesh = Mesh(np.array(jax.devices()), ("r",))
    for u, n in enumerate(UNIT_SIZES):
        padded = rt.shard_size(u) * ctx.world
        x = np.zeros(padded, np.float32)
        x[:n] = local_sum[u]
        arr = jax.make_array_from_process_local_data(
            jax.sharding.NamedSharding(mesh, P("r")), x[None, :], (ctx.world, padded))
        f = jax.jit(jax.shard_map(lambda a: jax.lax.psum_scatter(a[0], "r", scatter_dimension=0, tiled=True)[None],
                                  mesh=mesh, in_specs=P("r"), out_specs=P("r")))
        ref = np.asarray(f(arr).addressable_data(0))[0]
        np.testing.assert_allclose(rt.fetch_grad(u), ref, rtol=1e-5, atol=1e-5)
    rt.close()
    return True


def test_scatter_accumulate_matches_gloo_psum_scatter():
    assert run_ranks(psum_scatter_body, 2, args=(7,), timeout_s=120) == [True, True]


# -- version protocol ------------------------------------------------------------------------------

def race_body(ctx, transport):
    rt = make_runtime(ctx, transport=transport)
    publish_all(rt, 0)
    for u, n in enumerate(UNIT_SIZES):
        rt.scatter_accumulate(u, 0, np.ones(n, np.float32))
    rt.done(0)
    rt.wait_complete(0)
    if ctx.rank == 0:
        time.sleep(0.5)  # the slow owner: rank 1 races ahead meanwhile
    for u in range(len(UNIT_SIZES)):
        rt.fetch_grad(u)
    publish_all(rt, 1)
    start = time.monotonic()
    got = [rt.gather(u, 1) for u in range(len(UNIT_SIZES))]
    waited = time.monotonic() - start
    for u, n in enumerate(UNIT_SIZES):
        np.testing.assert_array_equal(got[u], unit_values(u, n, 1))
    rt.close()
    return waited


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_rank_racing_ahead_reads_new_version(transport):
    waited = run_ranks(race_body, 2, args=(transport,))
    assert waited[1] > 0.3, "rank 1 must have blocked until rank 0 published version 1"


# -- jax.grad through odc_gather ---------------------------------------------------------------------

def grad_body(ctx, pieces):
    import jax.numpy as jnp
    sizes = [45, 27]
    rt = make_runtime(ctx, sizes=sizes)
    full = [unit_values(u, n, 0) for u, n in enumerate(sizes)]
    for u in range(2):
        lo, hi = rt.shard_range(u)
        shard = np.zeros(rt.shard_size(u), np.float32)
        shard[: hi - lo] = full[u][lo:hi]
        rt.publish(u, shard, 0)
    shards = [jnp.asarray(rt.read_shard(u)) for u in range(2)]

    check_grad_reaches_owners(ctx, rt, shards, full, 0, pieces=pieces)
    rt.close()
    return True


def test_grad_through_gather_reaches_owners():
    assert run_ranks(grad_body, 2, args=(False,), timeout_s=90) == [True, True]


def test_grad_through_gathered_pieces_reaches_owners():
    """odc_gather_pieces: each piece's cotangent pushed on its own (range pushes; a piece spans
    both owners of unit 0) sums at the owners like the whole unit's."""
    assert run_ranks(grad_body, 3, args=(True,), timeout_s=90) == [True, True, True]


def range_body(ctx, transport, slot_elems, seed):
    from jaxodc.odc import Runtime
    rt = Runtime.create(UNIT_SIZES, ctx, transport=transport, timeout_s=30.0, slot_elems=slot_elems)
    publish_all(rt, 0)

    def ranges_of(rank):  # a whole-unit push, then ranges of every unit (some empty, some whole)
        rng = np.random.default_rng([seed, rank])
        out = [(u, None, rng.standard_normal(n).astype(np.float32)) for u, n in enumerate(UNIT_SIZES)]
        for _ in range(12):
            u = int(rng.integers(len(UNIT_SIZES)))
            a, b = sorted(int(x) for x in rng.integers(0, UNIT_SIZES[u] + 1, 2))
            out.append((u, a, rng.standard_normal(b - a).astype(np.float32)))
        return out

    for u, offset, g in ranges_of(ctx.rank):
        rt.scatter_accumulate(u, 0, g, offset=offset)
    rt.done(0)
    rt.wait_complete(0)
    for u, n in enumerate(UNIT_SIZES):
        total = np.zeros(n, np.float64)
        for r in range(ctx.world):
            for uu, offset, g in ranges_of(r):
                if uu == u:
                    total[offset or 0:(offset or 0) + g.size] += g
        lo, hi = rt.shard_range(u)
        got = rt.fetch_grad(u)
        np.testing.assert_allclose(got[: hi - lo], total[lo:hi], rtol=1e-5, atol=1e-5, err_msg=f"unit {u}")
        assert np.all(got[hi - lo:] == 0)
    with pytest.raises(Exception, match=r"elements \[995, 1005\) are outside unit 2 of 1000"):
        rt.scatter_accumulate(2, 1, np.ones(10, np.float32), offset=995)
    stats = rt.stats()
    rt.close()
    return stats


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_range_pushes_through_small_slots_equal_numpy_sum(transport):
    """Receive slots of 5 elements: every push (whole units and ranges) travels in 5-element
    chunks, and the owners' sums still equal numpy's, element by element."""
    stats = run_ranks(range_body, 3, args=(transport, 5, 11))
    assert all(s["slot_bytes"] == 5 * 4 * 3 for s in stats)


def slot_mismatch_body(ctx):
    from jaxodc.odc import Runtime
    Runtime.create([100], ctx, timeout_s=10.0, slot_elems=8 if ctx.rank == 1 else 16)


def test_mismatched_slot_sizes_name_the_rank():
    with pytest.raises(RankFailure, match="rank 1 has receive slots of 8 elements, rank 0 of 16"):
        run_ranks(slot_mismatch_body, 2)


def bf16_body(ctx):
    import jax
    import jax.numpy as jnp
    from jaxodc.ops import odc_gather
    rt = make_runtime(ctx, sizes=[33])
    publish_all(rt, 0)
    shard = jnp.asarray(rt.read_shard(0))
    got = jax.jit(lambda s: odc_gather(s, 0, runtime=rt, unit=0, numel=33, dtype=jnp.bfloat16))(shard)
    ref = jnp.asarray(unit_values(0, 33, 0)).astype(jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))
    rt.close()
    return True


def test_gather_casts_to_bf16_like_jax():
    assert run_ranks(bf16_body, 2) == [True, True]


# -- bad input -------------------------------------------------------------------------------------

def layout_body(ctx):
    from jaxodc.odc import LayoutMismatchError
    sizes = [10, 20] if ctx.rank == 0 else [10, 21]
    try:
        make_runtime(ctx, sizes=sizes)
    except LayoutMismatchError as e:
        return str(e)
    return "no error"


def test_mismatched_layouts_name_rank_and_unit():
    msgs = run_ranks(layout_body, 2)
    for m in msgs:
        assert "unit 1" in m and "rank 1" in m and "21" in m


def bad_input_body(ctx):
    import jax
    import jax.numpy as jnp
    from jaxodc.odc import OdcError
    from jaxodc.ops import odc_gather
    errors = {}
    rt = make_runtime(ctx, sizes=[10, 20])
    with pytest.raises(OdcError) as e:
        rt.publish(0, np.zeros(3, np.float32), 0)
    errors["publish_shape"] = str(e.value)
    with pytest.raises(OdcError) as e:
        rt.gather(7, 0)
    errors["unknown_unit"] = str(e.value)
    with pytest.raises(OdcError) as e:
        rt.fetch_grad(0)
    errors["fetch_early"] = str(e.value)
    publish_all(rt, 0)
    with pytest.raises(Exception) as e:
        jax.jit(lambda s: odc_gather(s, 0, runtime=rt, unit=0, numel=10))(jnp.zeros(4, jnp.float32))
    errors["ffi_shard_shape"] = str(e.value)
    with pytest.raises(Exception) as e:
        jax.jit(lambda s: odc_gather(s, 0, runtime=rt, unit=3, numel=10))(jnp.zeros(5, jnp.float32))
    errors["ffi_unknown_unit"] = str(e.value)
    with pytest.raises(TypeError) as e:
        odc_gather(jnp.zeros(5, jnp.int32), 0, runtime=rt, unit=0, numel=10)
    errors["dtype"] = str(e.value)
    with pytest.raises(NotImplementedError) as e:
        jax.vmap(lambda s: odc_gather(s, 0, runtime=rt, unit=0, numel=10))(jnp.zeros((2, 5), jnp.float32))
    errors["vmap"] = str(e.value)
    rt.close()
    return errors


def test_bad_input_raises_clear_errors():
    errors = run_ranks(bad_input_body, 2)[0]
    assert "unit 0" in errors["publish_shape"] and "5" in errors["publish_shape"]
    assert "no unit 7" in errors["unknown_unit"]
    assert "wait_complete" in errors["fetch_early"]
    assert "unit 0" in errors["ffi_shard_shape"] and "expected 5" in errors["ffi_shard_shape"]
    assert "no unit 3" in errors["ffi_unknown_unit"]
    assert "unit 0" in errors["dtype"]
    assert "vmap" in errors["vmap"]


def dead_runtime_body(ctx):
    import jax
    import jax.numpy as jnp
    from jaxodc.ops import odc_gather
    rt = make_runtime(ctx, sizes=[4])
    publish_all(rt, 0)
    gather = jax.jit(lambda s, r: odc_gather(s, 0, runtime=r, unit=0, numel=4), static_argnums=1)
    live = np.asarray(gather(jnp.zeros(4, jnp.float32), rt.handle))
    rt.close()
    errors = []
    for handle in (rt.handle, 424242):  # a closed runtime's handle, one never handed out
        try:
            gather(jnp.zeros(4, jnp.float32), handle).block_until_ready()
            errors.append("no error")
        except Exception as e:  # noqa: BLE001 - any jax error type; the message is what matters
            errors.append(str(e))
    return live, errors


def test_dead_runtime_handle_is_an_error():
    live, (closed, unknown) = run_ranks(dead_runtime_body, 1)[0]
    np.testing.assert_array_equal(live, unit_values(0, 4, 0))
    for err in (closed, unknown):
        assert "no live ODC runtime with handle" in err and "unit 0" in err, err
    assert "handle 424242" in unknown, unknown


# -- faults: dead peers and timeouts -------------------------------------------------------------------

def dying_body(ctx, mode, transport, report):
    rt = make_runtime(ctx, sizes=[1000], transport=transport, timeout_s=20.0)
    publish_all(rt, 0)
    if mode == "gather":  # finish minibatch 0 so that only rank 1's version 1 is missing
        rt.done(0)
        rt.wait_complete(0)
    if ctx.rank == 1:
        if mode == "push":
            rt.scatter_accumulate(0, 0, np.ones(1000, np.float32))
        ctx.barrier("ready")
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "gather":
        publish_all(rt, 1)
    ctx.barrier("ready")
    start = time.monotonic()
    try:
        if mode == "gather":
            rt.gather(0, 1)  # rank 1 will never publish version 1
        else:
            rt.done(0)
            rt.wait_complete(0)
        result = {"error": "none"}
    except Exception as e:  # noqa: BLE001
        result = {"error": type(e).__name__, "message": str(e)}
    result["seconds"] = time.monotonic() - start
    result["leftover"] = shm_entries(ctx.job_id, 0)
    with open(report, "w") as f:
        json.dump(result, f)
    rt.close(barrier=False)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("mode", ["gather", "push"])
def test_peer_killed_mid_operation_raises_naming_it(tmp_path, mode, transport):
    report = tmp_path / "rank0.json"
    with pytest.raises(RankFailure) as failure:
        run_ranks(dying_body, 2, args=(mode, transport, str(report)), timeout_s=60)
    assert "rank 1" in str(failure.value)  # the harness reports the killed rank
    result = json.loads(report.read_text())
    assert result["error"] in ("PeerError", "OdcTimeoutError"), result
    if transport == "shm" or mode == "push":
        assert result["error"] == "PeerError", result
        assert "rank 1" in result["message"], result
        assert result["seconds"] < 5, result
    assert result["leftover"] == []


def timeout_body(ctx, transport="auto"):
    from jaxodc.odc import OdcTimeoutError, PeerError
    # over tcp the owner's server times out and its error reply fails the gather (PeerError)
    expected = OdcTimeoutError if transport == "auto" else PeerError
    rt = make_runtime(ctx, sizes=[100], transport=transport, timeout_s=1.0)
    publish_all(rt, 0)
    rt.done(0)
    rt.wait_complete(0)
    result = None
    if ctx.rank == 0:  # publishes version 1; rank 1 never does
        publish_all(rt, 1)
        start = time.monotonic()
        with pytest.raises(expected) as e:
            rt.gather(0, 1)
        result = str(e.value), time.monotonic() - start
    ctx.barrier("checked")
    rt.close()
    return result


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_gather_timeout_names_unit_and_owner(transport):
    msg, elapsed = run_ranks(timeout_body, 2, args=(transport,))[0]
    assert "rank 1" in msg and "unit 0" in msg and "version 1" in msg and "timed out" in msg, msg
    if transport == "tcp":  # an owner reached over the network is named with its address too
        assert re.search(r"rank 1 \(127\.0\.0\.1:\d+\)", msg), msg
    assert 0.9 < elapsed < 5


def test_segments_of_a_crashed_rank_are_reclaimed():
    code = (
        "import os, signal, sys\n"
        "from jaxodc._native import C\n"
        "rt = C.OdcRuntime(0, 2, sys.argv[1], [64], 5.0, '127.0.0.1')\n"
        "print(rt.shm_name, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n")
    job = f"reclaimtest{os.getpid()}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code, job], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert shm_entries(job) == [f"jaxodc_{job}_0"]
    from jaxodc._native import C
    assert C.odc_reclaim_stale_segments() >= 1
    assert shm_entries(job) == []


def test_grad_view_and_in_place_publish():
    """The zero-copy owner path: the gradient is read where it accumulated and must be cleared
    before the next version is announced; a master written in place is what gathers read."""
    from jaxodc.odc import Runtime
    rt = Runtime([10], rank=0, world=1, rendezvous=None, job_id=f"gv{os.getpid()}", device=None)
    try:
        rt.publish(0, np.arange(10, dtype=np.float32), 0)
        master = rt.master_view(0)
        assert master.ctypes.data % 64 == 0
        np.testing.assert_array_equal(master, np.arange(10))
        g = np.random.default_rng(0).random(10, dtype=np.float32)
        rt.scatter_accumulate(0, 0, g)
        rt.done(0)
        rt.wait_complete(0)
        view = rt.grad_view(0)
        assert view.ctypes.data % 64 == 0
        np.testing.assert_array_equal(view, g)
        with pytest.raises(Exception, match="clear_grad"):
            rt.publish(0, np.zeros(10, np.float32), 1)
        master[:] = 7.0
        rt.clear_grad(0)
        wait_zeroed(view)
        rt.publish_in_place(0, 1)
        np.testing.assert_array_equal(rt.gather(0, 1), np.full(10, 7.0, np.float32))
        with pytest.raises(Exception, match="no completed minibatch"):
            rt.grad_view(0)
    finally:
        rt.close()
    np.testing.assert_array_equal(master, 7.0)  # still mapped: lent views may outlive close()


# -- the minibatch's exchange and the in-place store ----------------------------------------------

def allgather_body(ctx, transport):
    """Vectors of several lengths (one post, several posts) between scalar calls, every rank's in
    rank order; then a rank passing another length is named as out of step."""
    rt = make_runtime(ctx, sizes=[8], transport=transport)
    got = []
    for v, n in enumerate((1, 5, 62, 63, 130)):
        mine = np.random.default_rng([ctx.rank, n]).standard_normal(n)
        got.append(rt.allgather(v, mine))
        got.append(rt.allgather_scalar(v, float(ctx.rank + 0.25)))
    err = ""
    try:
        rt.allgather(9, np.zeros(3 if ctx.rank == 0 else 4))
    except Exception as e:  # noqa: BLE001 - the message is the check
        err = str(e)
    ctx.barrier("test_odc/allgather_mismatch")  # no rank closes before the other has read its post
    rt.close(barrier=False)
    return got, err


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_allgather_vectors_in_one_exchange(transport):
    W = 3
    results = run_ranks(allgather_body, W, args=(transport,))
    for got, err in results:
        for k, n in enumerate((1, 5, 62, 63, 130)):
            want = np.stack([np.random.default_rng([r, n]).standard_normal(n) for r in range(W)])
            np.testing.assert_array_equal(got[2 * k], want)  # float64 on the wire: exact
            np.testing.assert_array_equal(got[2 * k + 1], np.arange(W) + 0.25)
        assert "out of step" in err and "same length" in err, err


def program_allgather_body(ctx, transport):
    """odc_allgather inside a jitted program: the head's float64 values exact from every rank, the
    values summed over ranks in rank order in float64 and rounded once; exchange 0 skips peers."""
    import jax
    import jax.numpy as jnp
    from jaxodc.ops.odc import odc_allgather
    rt = make_runtime(ctx, sizes=[8], transport=transport)
    prog = jax.jit(lambda head, values, on: odc_allgather(head, values, 3, on, runtime=rt))
    head = np.array([np.pi * (ctx.rank + 1), 1e300, 2.0 ** 60 + ctx.rank], np.float64)  # not float32 values
    values = np.random.default_rng([7, ctx.rank]).standard_normal(70).astype(np.float32) * 10.0 ** ctx.rank
    rows, total = (np.asarray(x) for x in prog(head.view(np.uint32), values, np.int32(1)))
    alone = [np.asarray(x) for x in prog(head.view(np.uint32), values, np.int32(0))]
    with pytest.raises(TypeError, match="head must be uint32"):
        odc_allgather(jnp.zeros(3, jnp.uint32), jnp.zeros(2), 0, 1, runtime=rt)
    rt.close(barrier=False)
    return rows.view(np.float64), total, alone[0].view(np.float64), alone[1]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_allgather_inside_a_program(transport):
    W = 3
    heads = np.stack([np.array([np.pi * (r + 1), 1e300, 2.0 ** 60 + r]) for r in range(W)])
    values = [np.random.default_rng([7, r]).standard_normal(70).astype(np.float32) * 10.0 ** r for r in range(W)]
    want = np.zeros(70)
    for v in values:  # rank order, float64, one rounding
        want += v.astype(np.float64)
    for r, (rows, total, alone_rows, alone_total) in enumerate(run_ranks(program_allgather_body, W, args=(transport,))):
        np.testing.assert_array_equal(rows, heads)
        np.testing.assert_array_equal(total, want.astype(np.float32))
        np.testing.assert_array_equal(alone_rows, np.tile(heads[r], (W, 1)))
        np.testing.assert_array_equal(alone_total, (W * values[r].astype(np.float64)).astype(np.float32))


def test_store_master_writes_the_shard_in_place():
    import jax
    import jax.numpy as jnp
    from jaxodc.odc import Runtime
    from jaxodc.ops import new_token
    from jaxodc.ops.odc import odc_store_master
    rt = Runtime([10, 6], rank=0, world=1, rendezvous=None, job_id=f"sm{os.getpid()}", device=None)
    try:
        rt.publish(0, np.zeros(10, np.float32), 0)
        rt.publish(1, np.zeros(6, np.float32), 0)
        x = np.arange(10, dtype=np.float32)

        @jax.jit
        def store(a, b):
            t = odc_store_master(a * 2, new_token(), runtime=rt, unit=0)
            return odc_store_master(b + 1, t, runtime=rt, unit=1)

        rt.done(0)
        rt.wait_complete(0)
        assert int(store(jnp.asarray(x), jnp.zeros(6))[0]) == 2  # the token advanced once per store
        np.testing.assert_array_equal(rt.master_view(0), 2 * x)
        np.testing.assert_array_equal(rt.master_view(1), np.ones(6))
        rt.publish_in_place(0, 1)
        np.testing.assert_array_equal(rt.gather(0, 1), 2 * x)
        with pytest.raises(Exception, match="unit 1 on rank 0: local shard has 5 elements, expected 6"):
            jax.block_until_ready(jax.jit(lambda a: odc_store_master(a, new_token(), runtime=rt, unit=1))(jnp.zeros(5)))
    finally:
        rt.close()
