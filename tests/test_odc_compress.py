"""TAGC over the ODC runtime: compressed pushes (bitmap + count sketch, decoded per push by the
owner) against a numpy model of the whole exchange, error feedback, traffic counters, the
emulated link of the tcp transport, and bad settings."""
import math
import re
import time

import numpy as np
import pytest

import sketch_reference as ref
from harness import run_ranks

SIZES = [1000, 12345, 77]
# (unit, offset, size, fraction, ratio): unit 0 whole and lossy (its sketch holds fewer buckets
# than kept values, so some are estimated), unit 1 two ranges with dense gaps, unit 2 dense.
RANGES = [(0, 0, 1000, 0.1, 20.0), (1, 100, 9000, 0.1, 4.0), (1, 9100, 3000, 0.05, 3.0)]
VERSIONS, PUSHES = 2, 3
SPLIT = 5000  # odd pushes of unit 1 travel as two range pushes cut here (across a range)


def seed_of(unit):
    return 7 + unit


def gradient(rank, version, push, unit):
    return np.random.default_rng([rank, version, push, unit]).standard_normal(SIZES[unit]).astype(np.float32)


def pushes(version, push, unit):
    """(offset, n) of the pushes of one microbatch's unit gradient: whole, or cut at SPLIT."""
    if unit == 1 and push % 2:
        return [(0, SPLIT), (SPLIT, SIZES[1] - SPLIT)]
    return [(None, SIZES[unit])]


def exchange_body(ctx, transport, link_mbps=0.0):
    from jaxodc.odc import Link, Runtime
    rt = Runtime.create(SIZES, ctx, transport=transport, timeout_s=30.0,
                        link=Link(mbps=link_mbps) if link_mbps else None)
    for u, o, n, f, r in RANGES:
        rt.add_range(u, o, n, fraction=f, ratio=r, seed=seed_of(u))
    grads = []
    for v in range(VERSIONS):
        for u in range(len(SIZES)):  # as the trainer: version v's pushes follow its gathers
            if v == 0:
                rt.publish(u, np.zeros(rt.shard_size(u), np.float32), 0)
            rt.gather(u, v)
        for p in range(PUSHES):
            for u in range(len(SIZES)):
                g = gradient(ctx.rank, v, p, u)
                for offset, n in pushes(v, p, u):
                    rt.scatter_accumulate(u, v, g if offset is None else g[offset:offset + n], offset=offset)
        rt.done(v)
        rt.wait_complete(v)
        grads.append([rt.fetch_grad(u) for u in range(len(SIZES))])
        for u in range(len(SIZES)):
            rt.publish(u, np.zeros(rt.shard_size(u), np.float32), v + 1)
    out = {"grads": grads, "traffic": [rt.traffic(u) for u in range(len(SIZES))],
           "residual": {(u, o): rt.residual(u, o) for u, o, *_ in RANGES},
           "shards": [rt.shard_size(u) for u in range(len(SIZES))]}
    rt.close()
    return out


def model_exchange(world):
    """The numpy model: every rank's pushes, piece by piece as the runtime cuts them (per owner,
    per registered range), compressed ones sparsified with error feedback, sketched and peeled."""
    shards = [math.ceil(n / world) for n in SIZES]
    acc = [[[np.zeros(shards[u], np.float32) for u in range(len(SIZES))] for _ in range(world)]
           for _ in range(VERSIONS)]
    residual = {(r, u, o): np.zeros(n, np.float32) for r in range(world) for u, o, n, *_ in RANGES}
    traffic = [[dict(wire_bytes=0, range_bytes=0, range_elems=0, kept_elems=0, peeled=0, estimated=0)
                for _ in SIZES] for _ in range(world)]
    for v in range(VERSIONS):
        for p in range(PUSHES):
            for r in range(world):
                for u in range(len(SIZES)):
                    g = gradient(r, v, p, u)
                    for offset, n in pushes(v, p, u):
                        a0, b0 = (0, SIZES[u]) if offset is None else (offset, offset + n)
                        for d in range(world):
                            lo = min(d * shards[u], SIZES[u])
                            a, b = max(lo, a0), min(lo + shards[u], SIZES[u], b0)
                            for x, y, rng in split(u, a, b):
                                target = acc[v][d][u][x - lo:y - lo]
                                t = traffic[r][u]
                                if d == r:
                                    target += g[x:y]
                                    continue
                                if rng is None:
                                    target += g[x:y]
                                    t["wire_bytes"] += 4 * (y - x)
                                    continue
                                _, o, _, f, ratio = rng
                                res = residual[(r, u, o)][x - o:y - o]
                                kept, _, bits = ref.sparsify(g[x:y], res, f)
                                width = max(1, math.ceil((y - x) / (3 * ratio)))
                                decoded, (peeled, est) = ref.peel(ref.build(kept, bits, width, seed_of(u)), bits,
                                                                  y - x, seed_of(u))
                                res[:] = g[x:y] + res - decoded  # what the owner did not get
                                target += decoded
                                nbytes = 4 * bits.size + 12 * width
                                t.update(wire_bytes=t["wire_bytes"] + nbytes, range_bytes=t["range_bytes"] + nbytes,
                                         range_elems=t["range_elems"] + y - x,
                                         kept_elems=t["kept_elems"] + int(ref.unpack_bits(bits, y - x).sum()))
                                traffic[d][u]["peeled"] += peeled
                                traffic[d][u]["estimated"] += est
    return acc, residual, traffic


def split(unit, a, b):
    """[a, b) cut at the registered ranges of `unit`: (x, y, range or None)."""
    out, at = [], a
    for rng in sorted(r for r in RANGES if r[0] == unit):
        _, o, n, *_ = rng
        if o + n <= at or o >= b:
            continue
        if o > at:
            out.append((at, o, None))
        out.append((max(at, o), min(b, o + n), rng))
        at = min(b, o + n)
    if at < b:
        out.append((at, b, None))
    return [piece for piece in out if piece[1] > piece[0]]


@pytest.mark.parametrize("transport,world", [("shm", 2), ("tcp", 2), ("shm", 3)])
def test_compressed_exchange_equals_numpy_model(transport, world):
    results = run_ranks(exchange_body, world, args=(transport,), timeout_s=120)
    acc, residual, traffic = model_exchange(world)
    for d, res in enumerate(results):
        for v in range(VERSIONS):
            for u in range(len(SIZES)):
                np.testing.assert_allclose(res["grads"][v][u], acc[v][d][u], rtol=2e-5, atol=2e-5,
                                           err_msg=f"owner {d} version {v} unit {u}")
        for u, o, *_ in RANGES:
            np.testing.assert_allclose(res["residual"][(u, o)], residual[(d, u, o)], rtol=2e-5, atol=2e-5,
                                       err_msg=f"rank {d} residual of unit {u} range at {o}")
        for u in range(len(SIZES)):
            assert res["traffic"][u] == traffic[d][u], f"rank {d} unit {u}"
    lossy = sum(res["traffic"][0]["estimated"] for res in results)
    assert lossy > 0  # unit 0's sketch is too small to peel everything: estimates happened
    assert sum(res["traffic"][1]["estimated"] for res in results) == 0  # unit 1's sketches peel


def test_error_feedback_delivers_everything_eventually():
    """What an owner received from the other rank plus that rank's residual equals the sum of the
    raw gradients it pushed (the owner's own slice arrives dense)."""
    results = run_ranks(exchange_body, 2, args=("shm",), timeout_s=120)
    for u, o, n, *_ in RANGES:
        for d in range(2):
            sender = 1 - d
            shard = results[d]["shards"][u]
            lo, hi = max(d * shard, o), min((d + 1) * shard, o + n, SIZES[u])
            if lo >= hi:
                continue  # owner d holds none of this range
            raw_sender = sum(gradient(sender, v, p, u) for v in range(VERSIONS) for p in range(PUSHES))
            raw_owner = sum(gradient(d, v, p, u) for v in range(VERSIONS) for p in range(PUSHES))
            received = sum(results[d]["grads"][v][u] for v in range(VERSIONS))[lo - d * shard:hi - d * shard]
            delivered = received - raw_owner[lo:hi]
            left = results[sender]["residual"][(u, o)][lo - o:hi - o]
            # fp32 rounding scales with the largest term: estimates of an overloaded sketch (unit 0)
            # can be far off, and the residual then carries their error.
            scale = max(1.0, float(np.abs(received).max()), float(np.abs(left).max()))
            np.testing.assert_allclose(delivered + left, raw_sender[lo:hi], rtol=1e-5, atol=1e-5 * scale * PUSHES)


def dense_body(ctx, n, link_mbps, link_ms):
    from jaxodc.odc import Link, Runtime
    rt = Runtime.create([n], ctx, transport="tcp", timeout_s=30.0, link=Link(mbps=link_mbps, ms=link_ms))
    rt.publish(0, np.zeros(rt.shard_size(0), np.float32), 0)
    rt.gather(0, 0)  # connections warm
    t0 = time.perf_counter()
    rt.scatter_accumulate(0, 0, np.ones(n, np.float32))
    push_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    rt.gather(0, 0)
    gather_s = time.perf_counter() - t0
    rt.done(0)
    rt.wait_complete(0)
    grad = rt.fetch_grad(0)
    rt.close()
    return push_s, gather_s, grad


def test_link_emulation_caps_bandwidth_and_adds_latency():
    n = 500_000  # 1 MB of the unit goes to the other rank each way
    results = run_ranks(dense_body, 2, args=(n, 40.0, 30.0), timeout_s=120)
    for push_s, gather_s, grad in results:
        np.testing.assert_array_equal(grad, np.full(n // 2, 2.0, np.float32))
        # 1 MB at 40 Mbit/s is 0.2 s (less the token bucket's 5 ms burst); the gather's request
        # and reply each add 30 ms on top of its 1 MB.
        assert push_s >= 0.18, push_s
        assert gather_s >= 0.18 + 0.06, gather_s


def bad_settings_body(ctx):
    from jaxodc.odc import Runtime
    rt = Runtime.create([100, 10], ctx, transport="shm")
    errors = []
    for kwargs in (dict(unit=0, offset=0, size=50, fraction=0.0, ratio=4.0),
                   dict(unit=0, offset=0, size=50, fraction=1.5, ratio=4.0),
                   dict(unit=0, offset=0, size=50, fraction=0.1, ratio=0.0),
                   dict(unit=0, offset=90, size=20, fraction=0.1, ratio=4.0),
                   dict(unit=5, offset=0, size=5, fraction=0.1, ratio=4.0)):
        try:
            rt.add_range(**kwargs)
        except Exception as e:  # noqa: BLE001 -- the messages are what is checked
            errors.append(str(e))
    rt.add_range(0, 10, 40, fraction=0.1, ratio=4.0)
    for offset, size in ((30, 30), (0, 11)):
        try:
            rt.add_range(0, offset, size, fraction=0.1, ratio=4.0)
        except Exception as e:  # noqa: BLE001
            errors.append(str(e))
    rt.scatter_accumulate(1, 0, np.ones(10, np.float32))
    try:
        rt.add_range(0, 60, 10, fraction=0.1, ratio=4.0)
    except Exception as e:  # noqa: BLE001
        errors.append(str(e))
    try:
        rt.residual(0, 11)
    except Exception as e:  # noqa: BLE001
        errors.append(str(e))
    rt.done(0)
    rt.wait_complete(0)
    rt.close()
    return errors


def test_bad_settings_are_clear_errors():
    errors = run_ranks(bad_settings_body, 2)[0]
    expected = [r"rank 0: compressed range \[0, 50\) of unit 0: fraction must be in \(0, 1\]",
                r"fraction must be in \(0, 1\], got 1\.5",
                r"ratio must be > 0 \(dense bytes / sketch bytes\), got 0\.0",
                r"range \[90, 110\) of unit 0: outside the unit's 100 elements",
                r"has no unit 5",
                r"range \[30, 60\) of unit 0 overlaps the registered range starting at 10",
                r"range \[0, 11\) of unit 0 overlaps the registered range starting at 10",
                r"register compressed ranges before the first push",
                r"rank 0: no compressed range of unit 0 starts at 11"]
    assert len(errors) == len(expected), errors
    for got, pattern in zip(errors, expected):
        assert re.search(pattern, got), (pattern, got)


# -- the ODC trainer with compression ------------------------------------------------------------

TRAIN_STEPS, TRAIN_MBS = 3, 2


def trainer_body(ctx, transport):
    import dataclasses

    import jax
    import optax
    from jaxodc.compress import Compression
    from jaxodc.data import synthetic_text
    from jaxodc.balance.packing import pack
    from jaxodc.models.lm import LM, LMConfig
    from jaxodc.odc import Runtime
    from jaxodc.train.core import ConfigMismatchError
    from jaxodc.train.odc import OdcTrainer
    from jaxodc.modeling.units import make_layout

    model = LM(LMConfig(d_model=64, n_layers=1, n_heads=2))
    params = model.init(jax.random.PRNGKey(0))
    layout = make_layout(params, ctx.world, order=model.unit_names)
    samples = synthetic_text("aime", 64, 24, seed=1)
    mine = lambda step, j: samples[(step * ctx.world * TRAIN_MBS + ctx.rank * TRAIN_MBS + j) % len(samples)]  # noqa: E731
    tokens = lambda step: float(sum(pack([samples[(step * ctx.world * TRAIN_MBS + k) % len(samples)]], 32)  # noqa: E731
                                    .loss_mask.sum() for k in range(ctx.world * TRAIN_MBS)))
    matrices = lambda path, shape: len(shape) == 2  # noqa: E731  (attention's too)

    def run(plan):
        rt = Runtime.create([u.padded for u in layout.units], ctx, transport=transport, timeout_s=60.0)
        tr = OdcTrainer(model, optax.adam(3e-3), params, rt, owns_runtime=True, compress=plan)
        steps = []
        for step in range(TRAIN_STEPS):
            res = tr.train_minibatch([pack([mine(step, j)], 32).as_dict() for j in range(TRAIN_MBS)], tokens(step))
            steps.append((res.loss, res.wire_bytes, res.wire_bytes_selected, res.kept_fraction, res.peeled,
                          res.estimated, res.wire_bytes_units))
        full = {u.name: rt.gather(u.index, tr.version) for u in layout.units}
        tr.close()
        return {"full": full, "steps": steps}

    out = {"plain": run(None)}
    # fraction 1 and a sketch wide enough to peel everything: ratio below what Compression allows
    exact = dataclasses.replace(Compression(fraction=1.0, ratio=2.0, select=matrices).plan(layout), ratio=0.3)
    out["exact"] = run(exact)
    out["lossy"] = run(Compression(fraction=0.1, ratio=8.0).plan(layout))  # the default selection
    try:
        run(Compression(fraction=0.05 if ctx.rank == 0 else 0.1, select=matrices).plan(layout))
        out["mismatch"] = "no error"
    except ConfigMismatchError as e:
        out["mismatch"] = str(e)
    return out


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_odc_trainer_with_compression(transport):
    results = run_ranks(trainer_body, 2, args=(transport,), timeout_s=300)
    for name in ("plain", "exact", "lossy"):  # every rank holds the same parameters
        for u in results[0][name]["full"]:
            np.testing.assert_array_equal(results[0][name]["full"][u], results[1][name]["full"][u])
    for u, plain in results[0]["plain"]["full"].items():  # fraction 1, peeling everything = uncompressed
        np.testing.assert_allclose(results[0]["exact"]["full"][u], plain, rtol=1e-4, atol=1e-5, err_msg=u)
    for r, res in enumerate(results):
        plain_losses = [s[0] for s in res["plain"]["steps"]]
        np.testing.assert_allclose([s[0] for s in res["exact"]["steps"]], plain_losses, rtol=1e-4)
        for loss, wire, selected, kept, peeled, estimated, units in res["exact"]["steps"]:
            assert estimated == 0 and peeled > 0 and 0.5 < kept <= 1  # zeros (unused embedding rows) never kept
        for (_, dense_wire, dense_sel, kept, *_), (loss, wire, selected, lossy_kept, peeled, est, units) in zip(
                res["plain"]["steps"], res["lossy"]["steps"]):
            assert kept is None and 0 < dense_sel < dense_wire  # the default's pieces, counted dense
            assert sum(units.values()) == wire and np.isfinite(loss)
            assert 0 < lossy_kept <= 0.1 + 1e-9 and peeled > 0
            # bitmap (1/32) + sketch (1/8) of the selected pieces' dense bytes, plus rounding up
            assert selected < 0.2 * dense_sel, (selected, dense_sel)
            assert wire - selected == dense_wire - dense_sel  # the rest travels as before
        assert "compression and precision setting" in res["mismatch"] and "fraction" in res["mismatch"], res["mismatch"]
