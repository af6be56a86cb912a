"""Lock-step collectives over jaxodc's transports (jaxodc.comm.lockstep, jaxodc.ops.lockstep) and
CollectiveTrainer(transport="jaxodc"): against jax's own collectives (gloo) element by element, on
2 and 3 processes, over shm and tcp, in float32 and bfloat16; channels sharing the two staging
areas when called at once in orders that differ by rank; bad input; a dead or silent peer, or one
that never reads the staging areas, raises instead of hanging."""
import os

import ml_dtypes
import numpy as np
import pytest

bf16 = ml_dtypes.bfloat16

from harness import error_text, run_ranks

SHARD, SCATTER, REDUCE, CALLS = 37, 29, 5, 3


def _bf16_sum(parts):
    """Rank order, each rank's addition in float32 rounded to bfloat16 (the lockstep group's rule)."""
    acc = np.asarray(parts[0]).astype(bf16)
    for p in parts[1:]:
        acc = (acc.astype(np.float32) + np.asarray(p).astype(bf16).astype(np.float32)).astype(bf16)
    return acc


def _allgather(ctx):
    keys = iter(range(1 << 30))
    return lambda b: ctx.rendezvous.allgather(f"test_lockstep/{next(keys)}", b, ctx.world)


def ops_body(ctx, link):
    from jaxodc.launch.context import init_jax_distributed
    init_jax_distributed(ctx)
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P
    from jaxodc.comm.lockstep import Channel, LockstepGroup
    from jaxodc.ops.lockstep import lockstep_collective

    W, r = ctx.world, ctx.rank
    group = LockstepGroup([Channel("gather", SHARD, "g"), Channel("scatter", SCATTER, "s"),
                           Channel("reduce", REDUCE, "r"), Channel("gather", SHARD, "gb", "bfloat16"),
                           Channel("scatter", SCATTER, "sb", "bfloat16")],
                          rank=r, world=W, allgather=_allgather(ctx), link=link)
    assert group.links == ["self" if p == r else link for p in range(W)]
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.process_index)), ("d",))

    def both(x, y, z):
        mine = (lockstep_collective(x, group=group, channel=0), lockstep_collective(y, group=group, channel=1),
                lockstep_collective(z, group=group, channel=2))
        theirs = (jax.lax.all_gather(x, "d", tiled=True), jax.lax.psum_scatter(y, "d", scatter_dimension=0, tiled=True),
                  jax.lax.psum(z, "d"))
        bf16 = (lockstep_collective(x.astype(jnp.bfloat16), group=group, channel=3),
                lockstep_collective(y.astype(jnp.bfloat16), group=group, channel=4),
                jax.lax.all_gather(x.astype(jnp.bfloat16), "d", tiled=True))
        return mine + theirs + bf16

    f = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=(P("d"),) * 3, out_specs=(P("d"),) * 9, check_vma=False))
    out = []
    for call in range(CALLS):  # several calls: both parities of every channel's areas, reused
        rng = np.random.default_rng([call, r])
        x = rng.normal(size=SHARD).astype(np.float32)
        y = rng.normal(size=W * SCATTER).astype(np.float32)
        z = rng.normal(size=REDUCE).astype(np.float32)
        glob = lambda a: jax.make_array_from_process_local_data(jax.sharding.NamedSharding(mesh, P("d")), a,
                                                                 (W * a.shape[0],))
        res = [np.asarray(a.addressable_data(0)) for a in f(glob(x), glob(y), glob(z))]
        host = [group.run(0, x), group.run(1, y), group.run(2, z), group.run(3, x), group.run(4, y)]
        out.append({"inputs": (x, y, z), "jit": res, "host": host})
    group.close()
    return out


@pytest.mark.parametrize("world,link", [(2, "shm"), (3, "tcp"), (3, "shm")])
def test_ops_equal_jax_collectives(world, link):
    ranks = run_ranks(ops_body, world, args=(link,), timeout_s=120)
    for call in range(CALLS):
        xs = [ranks[r][call]["inputs"][0] for r in range(world)]
        ys = [ranks[r][call]["inputs"][1] for r in range(world)]
        zs = [ranks[r][call]["inputs"][2] for r in range(world)]
        for r in range(world):
            got = ranks[r][call]
            ag, rs, ar, jag, jrs, jar, bag, brs, jbag = got["jit"]
            # all-gather: bit-identical to jax's and to the inputs, every element
            np.testing.assert_array_equal(ag.view(np.uint32), jag.view(np.uint32))
            np.testing.assert_array_equal(ag, np.concatenate(xs))
            # sums: rank order exactly (numpy, same order), jax's up to fp32 summation order
            want_rs = ys[0][r * SCATTER:(r + 1) * SCATTER].copy()
            want_ar = zs[0].copy()
            for q in range(1, world):
                want_rs += ys[q][r * SCATTER:(r + 1) * SCATTER]
                want_ar += zs[q]
            np.testing.assert_array_equal(rs, want_rs)
            np.testing.assert_array_equal(ar, want_ar)
            np.testing.assert_allclose(rs, jrs, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(ar, jar, rtol=1e-6, atol=1e-6)
            # bfloat16 channels: the gather bit-identical to jax's; sums add in float32 and round
            # to bfloat16 after every rank's addition, in rank order
            np.testing.assert_array_equal(bag.view(np.uint16), jbag.view(np.uint16))
            np.testing.assert_array_equal(bag.view(np.uint16), np.concatenate(xs).astype(bf16).view(np.uint16))
            want_brs = _bf16_sum([yq[r * SCATTER:(r + 1) * SCATTER] for yq in ys])
            np.testing.assert_array_equal(brs.view(np.uint16), want_brs.view(np.uint16))
            for a, b in zip(got["host"], (ag, rs, ar, bag, brs)):
                np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
        # every rank's all-reduce holds the same bits
        for r in range(1, world):
            np.testing.assert_array_equal(ranks[r][call]["jit"][2].view(np.uint32), ranks[0][call]["jit"][2].view(np.uint32))


ORDER_SIZES, ORDER_ROUNDS, ORDER_DTYPES = (5, 300, 17, 1000, 64, 1, 129), 4, ("float32", "bfloat16")


def orders_body(ctx, link):
    """Channels of several sizes and kinds called at once from threads, in an order that differs by
    rank: posts contend for the two staging areas shared by every channel, and those that find both
    unread wait for them on the progress thread."""
    import threading
    from jaxodc.comm.lockstep import Channel, LockstepGroup

    W, r = ctx.world, ctx.rank
    kinds = ("gather", "scatter", "reduce")
    chans = [Channel(kinds[i % 3], n, f"c{i}", ORDER_DTYPES[i % 2]) for i, n in enumerate(ORDER_SIZES)]
    group = LockstepGroup(chans, rank=r, world=W, allgather=_allgather(ctx), link=link, timeout_s=60.0)
    results, errors = {}, []

    def worker(c):
        try:
            for call in range(ORDER_ROUNDS):
                x = np.random.default_rng([c, call, r]).normal(size=group.in_size(c)).astype(np.float32)
                results[f"{c},{call}"] = group.run(c, x)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    order = list(range(len(chans)))[::(-1 if r % 2 else 1)]
    threads = [threading.Thread(target=worker, args=(c,)) for c in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out = {"results": results, "errors": errors, "segment": group.segment_bytes, "native": group.native_bytes}
    group.close()
    return out


@pytest.mark.parametrize("world,link", [(2, "shm"), (3, "shm"), (3, "tcp")])
def test_channels_share_staging_areas(world, link):
    ranks = run_ranks(orders_body, world, args=(link,), timeout_s=120)
    kinds = ("gather", "scatter", "reduce")
    for r, got in enumerate(ranks):
        assert not got["errors"], got["errors"]
        for c, n in enumerate(ORDER_SIZES):
            kind = kinds[c % 3]
            size = world * n if kind == "scatter" else n
            for call in range(ORDER_ROUNDS):
                xs = [np.random.default_rng([c, call, q]).normal(size=size).astype(np.float32) for q in range(world)]
                is_bf16 = ORDER_DTYPES[c % 2] == "bfloat16"
                if is_bf16:
                    xs = [x.astype(bf16) for x in xs]
                if kind == "gather":
                    want = np.concatenate(xs)
                else:
                    part = [x[r * n:(r + 1) * n] if kind == "scatter" else x for x in xs]
                    if is_bf16:
                        want = _bf16_sum(part)
                    else:
                        want = part[0].copy()
                        for q in range(1, world):
                            want += part[q]  # rank order, exactly
                res = got["results"][f"{c},{call}"]
                assert res.dtype == want.dtype
                np.testing.assert_array_equal(res.view(np.uint8), want.view(np.uint8))
    # The segment: two staging areas of the largest post (a gather's n, a reduce-scatter's
    # world - 1 slices) and a few pages of tables, not two areas per channel.
    eb = [4 if ORDER_DTYPES[c % 2] == "float32" else 2 for c in range(len(ORDER_SIZES))]
    largest = max(eb[c] * (n * (world - 1) if kinds[c % 3] == "scatter" else n) for c, n in enumerate(ORDER_SIZES))
    per_channel = sum(2 * eb[c] * (n * world if kinds[c % 3] == "scatter" else n) for c, n in enumerate(ORDER_SIZES))
    for got in ranks:
        assert 2 * largest < got["segment"] <= 2 * largest + 2 * 4096, (got["segment"], largest)
        assert got["segment"] < per_channel
        if link == "tcp":  # receive double buffers of every channel, per tcp peer
            assert got["native"] == got["segment"] + (world - 1) * 2 * sum(e * n for e, n in zip(eb, ORDER_SIZES))
        else:
            assert got["native"] == got["segment"]


def errors_body(ctx):
    from jaxodc.comm.lockstep import Channel, LockstepGroup
    from jaxodc.ops.lockstep import lockstep_collective
    import jax.numpy as jnp

    W, r = ctx.world, ctx.rank
    ag = _allgather(ctx)
    out = {}
    # Channels that differ between ranks are refused when the group is built, on every rank.
    out["layout"] = error_text(lambda: LockstepGroup([Channel("gather", 4 + r, "g")], rank=r, world=W, allgather=ag))
    out["kind"] = error_text(lambda: LockstepGroup([Channel("bogus", 4, "g")], rank=r, world=W, allgather=ag))
    out["link"] = error_text(lambda: LockstepGroup([Channel("gather", 4, "g")], rank=r, world=W, allgather=ag,
                                                   link="udp"))
    group = LockstepGroup([Channel("gather", 4, "g"), Channel("scatter", 2, "s")], rank=r, world=W, allgather=ag,
                          timeout_s=2.0)
    out["size"] = error_text(lambda: lockstep_collective(jnp.zeros(5), group=group, channel=0))
    out["dtype"] = error_text(lambda: lockstep_collective(jnp.zeros(4, jnp.int32), group=group, channel=0))
    out["host_size"] = error_text(lambda: group.run(1, np.zeros(3, np.float32)))
    # Only rank 0 calls: it times out naming the channel and the rank it waited for.
    ctx.barrier("test_lockstep/timeout")
    if r == 0:
        out["timeout"] = error_text(lambda: group.run(0, np.zeros(4, np.float32)))
    # Three calls at once while rank 1 makes none: two fill rank 0's staging areas, the third
    # times out waiting for one, naming the peer that has not read them.
    busy = LockstepGroup([Channel("gather", 4, f"b{i}") for i in range(3)], rank=r, world=W, allgather=ag,
                         timeout_s=2.0)
    if r == 0:
        import threading
        msgs = [None] * 3
        threads = [threading.Thread(target=lambda i=i: msgs.__setitem__(i, error_text(
            lambda: busy.run(i, np.zeros(4, np.float32))))) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["busy"] = msgs
    ctx.barrier("test_lockstep/closed")
    busy.close()
    group.close()
    out["closed"] = error_text(lambda: group.run(0, np.zeros(4, np.float32)))
    return out


def test_errors():
    out = run_ranks(errors_body, 2, timeout_s=90)
    for r, o in enumerate(out):
        assert "other lockstep channels" in o["layout"], o["layout"]
        assert "bogus" in o["kind"] and "udp" in o["link"]
        assert "takes 8 elements, got 5" in o["size"] or "takes 4 elements, got 5" in o["size"], o["size"]
        assert "float32" in o["dtype"]
        assert "channel 1 takes 4 elements in" in o["host_size"], o["host_size"]
        assert "closed" in o["closed"] or "no live" in o["closed"], o["closed"]
    t = out[0]["timeout"]
    assert "TimeoutError" in t and "'g'" in t and "waiting for rank 1" in t and "timed out after 2" in t, t
    busy = out[0]["busy"]
    assert all("TimeoutError" in m and "timed out after 2" in m and "rank 1" in m for m in busy), busy
    staged = [m for m in busy if "free staging area" in m]
    assert len(staged) == 1 and "rank 1 has not read call 0 on channel 'b" in staged[0], busy


def dead_peer_body(ctx, link, path):
    import json
    import time
    from jaxodc.comm.lockstep import Channel, LockstepGroup

    group = LockstepGroup([Channel("reduce", 3, "r")], rank=ctx.rank, world=ctx.world, allgather=_allgather(ctx),
                          link=link, timeout_s=30.0)
    group.run(0, np.ones(3, np.float32))
    ctx.barrier("test_lockstep/dead")
    if ctx.rank == 1:
        os._exit(0)  # dies without closing anything
    t0 = time.monotonic()
    err = error_text(lambda: group.run(0, np.ones(3, np.float32)))
    with open(path, "w") as f:
        json.dump([err, time.monotonic() - t0], f)
    os._exit(0)  # the harness's final barrier would wait for rank 1


@pytest.mark.parametrize("link", ["shm", "tcp"])
def test_dead_peer_raises(link, tmp_path):
    import json
    from harness import RankFailure
    path = str(tmp_path / "err.json")
    with pytest.raises(RankFailure, match="without a result"):
        run_ranks(dead_peer_body, 2, args=(link, path), timeout_s=60)
    err, waited = json.load(open(path))
    assert "PeerError" in err and "rank 1" in err and "'r'" in err and waited < 10, (err, waited)


# -- the trainer -----------------------------------------------------------------------------------

TW, SIZES, STEPS, MBS = 2, (7, 40, 19, 5), 3, 2


def _microbatch(step, rank, j):
    rng = np.random.default_rng([step, rank, j])
    return {"x": rng.normal(size=(4, SIZES[0])).astype(np.float32),
            "y": rng.integers(0, SIZES[-1], 4).astype(np.int32), "mask": np.ones(4, np.float32)}


def trainer_body(ctx, link):
    from jaxodc.launch.context import init_jax_distributed
    init_jax_distributed(ctx)
    import jax
    import optax
    from jaxodc.compress.policy import Compression
    from jaxodc.models.mlp import MLP
    from jaxodc.optim.clipping import clip_by_global_norm
    from jaxodc.train.collective import CollectiveTrainer
    from jaxodc.modeling.units import make_layout
    model = MLP(SIZES)
    params = model.init(jax.random.PRNGKey(0))
    opt = optax.chain(clip_by_global_norm(0.05), optax.adam(1e-3, eps=1e-6))  # the clip needs the all-sum

    def run(transport, precision="fp32"):
        tr = CollectiveTrainer(model, opt, params, transport=transport, lockstep={"link": link}, precision=precision)
        losses = [tr.train_minibatch([_microbatch(s, ctx.rank, j) for j in range(MBS)], 4.0 * ctx.world * MBS).loss
                  for s in range(STEPS)]
        shards = tr.local_shards()
        if transport == "jaxodc":  # the units' channels carry the compute dtype
            assert {c.dtype for c in tr.group.channels if "reduce_scatter" in c.name} == \
                {"float32" if precision == "fp32" else "bfloat16"}
        tr.close()
        return shards, losses

    gloo, jaxodc = run("gloo"), run("jaxodc")
    gloo_bf16, jaxodc_bf16 = run("gloo", "bf16"), run("jaxodc", "bf16")
    plan = Compression(select=lambda path, shape: len(shape) >= 2).plan(make_layout(params, ctx.world, order=model.unit_names))
    err = error_text(lambda: CollectiveTrainer(model, opt, params, transport="jaxodc", compress=plan))
    bad = error_text(lambda: CollectiveTrainer(model, opt, params, transport="nccl"))
    return gloo, jaxodc, err, bad, gloo_bf16, jaxodc_bf16


@pytest.mark.parametrize("world,link", [(2, "shm"), (3, "tcp")])
def test_trainer_jaxodc_equals_gloo(world, link):
    out = run_ranks(trainer_body, world, args=(link,), timeout_s=180)
    for r, ((g_shards, g_loss), (j_shards, j_loss), err, bad, (gb_shards, gb_loss), (jb_shards, jb_loss)) in enumerate(out):
        # bf16: gathered and reduce-scattered in bfloat16 on both transports; at W = 2 the same loss
        # bits (one rounded addition), above that within bf16 summation-order differences. The
        # shards within fp32 rounding: over gloo the optimizer runs one unit at a time
        # (train.unitwise), which XLA fuses differently from the lock-step path's whole-tree step.
        np.testing.assert_allclose(jb_loss, gb_loss, rtol=0 if world == 2 else 1e-4, err_msg=f"rank {r} (bf16)")
        for n, a in gb_shards.items():
            np.testing.assert_allclose(jb_shards[n], a, rtol=1e-5, atol=1e-7 if world == 2 else 1e-3,
                                       err_msg=f"rank {r} unit {n} (bf16)")
        np.testing.assert_allclose(j_loss, g_loss, rtol=1e-5, err_msg=f"rank {r}")
        for n, a in g_shards.items():
            np.testing.assert_allclose(j_shards[n], a, rtol=1e-5, atol=1e-6, err_msg=f"rank {r} unit {n}")
        assert "compression" in err and "transport='gloo'" in err, err
        assert "nccl" in bad
