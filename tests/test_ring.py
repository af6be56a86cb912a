"""Ring all-reduce: exact against a numpy model of the ring's reduction order, bit-identical peers,
quantisation bounds, abort/restore, peer death (multi-process), concurrency, link emulation, auth."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest

from jaxodc.comm.ring import RingAborted, RingEndpoint

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), BF16,
          np.dtype(np.int32), np.dtype(np.int64)]
OPS = ["sum", "avg", "min", "max", "prod"]


def parallel(fns, timeout=60):
    with ThreadPoolExecutor(len(fns)) as ex:
        futs = [ex.submit(f) for f in fns]
        return [f.result(timeout=timeout) for f in futs]


def make_ring(W, epoch=1, eps=None, **kw):
    kw.setdefault("secret", b"test-secret")
    kw.setdefault("timeout_s", 10.0)
    eps = eps or [RingEndpoint(**kw) for _ in range(W)]
    addrs = [e.address for e in eps]
    parallel([lambda i=i: eps[i].connect_ring(addrs, i, epoch) for i in range(W)])
    return eps


def close_all(eps):
    for e in eps:
        e.close()


@pytest.fixture(scope="module")
def rings():
    cache = {}

    def get(W):
        if W not in cache:
            cache[W] = make_ring(W)
        return cache[W]

    yield get
    for eps in cache.values():
        close_all(eps)


def acc_type(dt):
    return np.dtype(np.float32) if dt in (np.dtype(np.float16), BF16) else dt


def combine(op, a, b):
    if op in ("sum", "avg"):
        return a + b
    if op == "min":
        return np.where(b < a, b, a)
    if op == "max":
        return np.where(b > a, b, a)
    return a * b


def ring_reference(xs, op):
    """The ring's arithmetic: chunk c starts at rank c and visits c+1, ..., c-1 (its owner); the
    partial is stored in the array dtype after each hop; avg divides once at the owner."""
    W, dt = len(xs), xs[0].dtype
    flat = [x.reshape(-1) for x in xs]
    n = flat[0].size
    out = np.empty(n, dt)
    A = acc_type(dt)
    with np.errstate(over="ignore", invalid="ignore"):
        for c in range(W):
            s, e = n * c // W, n * (c + 1) // W
            acc = flat[c][s:e].astype(A)
            for k in range(1, W):
                r = combine(op, acc, flat[(c + k) % W][s:e].astype(A))
                if k == W - 1 and op == "avg":
                    if dt.kind == "i":
                        r = (np.sign(r) * (np.abs(r) // W)).astype(A)
                    else:
                        r = (r / A.type(W)).astype(A)
                acc = r.astype(dt).astype(A)
            out[s:e] = acc.astype(dt)
    return out.reshape(xs[0].shape)


def numpy_reduce(xs, op):
    stack = np.stack([x.astype(np.float64) for x in xs])
    return {"sum": stack.sum(0), "avg": stack.mean(0), "min": stack.min(0), "max": stack.max(0),
            "prod": stack.prod(0)}[op]


def make_inputs(W, n, dt, op, seed):
    rng = np.random.default_rng(seed)
    if dt.kind == "i":
        hi = 4 if op == "prod" else 1000
        return [rng.integers(-hi, hi, n).astype(dt) for _ in range(W)]
    if op == "prod":
        return [rng.uniform(0.5, 1.5, n).astype(dt) for _ in range(W)]
    return [rng.standard_normal(n).astype(dt) for _ in range(W)]


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


def run_all(eps, xs, **kw):
    return parallel([lambda i=i: eps[i].all_reduce(xs[i], **kw) for i in range(len(eps))])


def check_exact(results, xs, op):
    want = ring_reference(xs, op)
    for r in results:
        assert r.dtype == xs[0].dtype and r.shape == xs[0].shape
        np.testing.assert_array_equal(bits(r), bits(want))
    # the model itself agrees with a plain numpy reduction
    tol = {"f": 1e-3 if xs[0].dtype.itemsize <= 2 else 1e-5, "V": 2e-2}.get(xs[0].dtype.kind, 0)
    if xs[0].dtype == BF16:
        tol = 3e-2
    got = results[0].astype(np.float64)
    ref = numpy_reduce(xs, op)
    if xs[0].dtype.kind == "i":
        if op == "avg":
            ref = np.trunc(ref)
        np.testing.assert_array_equal(got, ref)
    else:
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * len(xs))


def test_all_ops_and_dtypes_world3(rings):
    eps = rings(3)
    tag = 0
    for dt in DTYPES:
        for op in OPS:
            xs = make_inputs(3, 1001, dt, op, seed=tag)
            check_exact(run_all(eps, xs, op=op, tag=tag), xs, op)
            tag += 1


@pytest.mark.parametrize("W", [2, 4, 5, 6])
def test_worlds_2_to_6(rings, W):
    eps = rings(W)
    for tag, (dt, op) in enumerate([(np.dtype(np.float32), "sum"), (BF16, "avg"), (np.dtype(np.int64), "max"),
                                    (np.dtype(np.float16), "sum"), (np.dtype(np.int32), "avg")]):
        xs = make_inputs(W, 997, dt, op, seed=100 + tag)
        check_exact(run_all(eps, xs, op=op, tag=tag), xs, op)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 1000, 1003])
def test_sizes_not_divisible_by_world(rings, n):
    eps = rings(4)
    xs = make_inputs(4, n, np.dtype(np.float32), "sum", seed=n)
    check_exact(run_all(eps, xs, op="sum", tag=7), xs, "sum")


def test_multidim_and_aliased_output(rings):
    eps = rings(3)
    xs = [np.random.default_rng(i).standard_normal((17, 31)).astype(np.float32) for i in range(3)]
    want = ring_reference(xs, "avg")
    ins = [x.copy() for x in xs]
    outs = parallel([lambda i=i: eps[i].all_reduce(ins[i], op="avg", out=ins[i]) for i in range(3)])
    for i in range(3):
        assert outs[i] is ins[i]
        np.testing.assert_array_equal(ins[i], want)
    # non-aliased out: input untouched
    outs2 = [np.empty_like(x) for x in xs]
    parallel([lambda i=i: eps[i].all_reduce(xs[i], op="avg", out=outs2[i]) for i in range(3)])
    for i in range(3):
        np.testing.assert_array_equal(outs2[i], want)
        np.testing.assert_array_equal(xs[i], np.random.default_rng(i).standard_normal((17, 31)).astype(np.float32))


def test_pipelined_small_pieces_bf16_sum():
    eps = make_ring(3, pool_size=1)
    try:
        for e in eps:
            e.set_piece_bytes(1000)  # many pieces per chunk, not a multiple of the element size
        xs = make_inputs(3, 100_003, BF16, "sum", seed=5)
        check_exact(run_all(eps, xs, op="sum"), xs, "sum")
    finally:
        close_all(eps)


@pytest.mark.parametrize("quant,levels", [("uint8", 255), ("uint16", 65535)])
@pytest.mark.parametrize("dt", [np.dtype(np.float32), BF16, np.dtype(np.float64)])
def test_quantized_bit_identical_and_bounded(rings, quant, levels, dt):
    W = 4
    eps = rings(W)
    for e in eps:
        e.set_piece_bytes(4096)
    try:
        xs = [np.random.default_rng(50 + i).uniform(-1, 1, 20_011).astype(dt) for i in range(W)]
        res = run_all(eps, xs, op="sum", quantize=quant, tag=3)
        for r in res[1:]:
            np.testing.assert_array_equal(bits(r), bits(res[0]))
        exact = numpy_reduce(xs, "sum")
        # every hop quantises a partial whose range is at most 2*k for k contributions: error per
        # hop <= range/levels/2, W-1 hops plus the owner's quantisation
        bound = sum(2.0 * k / levels / 2 for k in range(1, W + 1)) * 1.01
        if dt == BF16:
            bound += W * 2 ** -7 * 4  # bf16 rounding of partials of magnitude <= W
        err = np.abs(res[0].astype(np.float64) - exact)
        assert err.max() <= bound, (err.max(), bound)
        assert err.max() > 0  # really quantised
    finally:
        for e in eps:
            e.set_piece_bytes(1 << 20)


def quantized_ring_reference(xs, op, levels, piece_elems):
    """Exact model of quantised transfer, one f32 IEEE operation at a time: every piece is sent as
    min-max codes of the stored partial (code = trunc(clip((v - lo) * inv + 0.5, 0, levels)),
    value = lo + code * scale), the next peer combines the decoded value with its own, and the
    owner's codes of the final chunk are what everyone decodes."""
    W, dt, n = len(xs), xs[0].dtype, xs[0].size
    f32, L = np.float32, np.float32(levels)

    def quant(v):
        lo, hi = v.min(), v.max()
        scale = (hi - lo) / L
        inv = L / (hi - lo) if hi > lo else f32(0)
        t = np.minimum(np.maximum((v - lo) * inv + f32(0.5), f32(0)), L)
        return t.astype(np.int32).astype(f32), lo, scale

    out = np.empty(n, dt)
    for c in range(W):
        s, e = n * c // W, n * (c + 1) // W
        for o in range(s, e, piece_elems):
            sl = slice(o, min(o + piece_elems, e))
            q, lo, scale = quant(xs[c][sl].astype(f32))
            for k in range(1, W):
                r = combine(op, lo + q * scale, xs[(c + k) % W][sl].astype(f32))
                if k == W - 1 and op == "avg":
                    r = r / f32(W)
                q, lo, scale = quant(r.astype(dt).astype(f32))
            out[sl] = (lo + q * scale).astype(dt)
    return out


@pytest.mark.parametrize("dt,op,quant", [(np.dtype(np.float32), "sum", "uint8"), (np.dtype(np.float32), "avg", "uint16"),
                                         (np.dtype(np.float32), "max", "uint8"), (BF16, "avg", "uint8")])
def test_quantized_matches_exact_model(rings, dt, op, quant):
    """The vectorised, fused host kernels compute exactly the scalar formulas (tails included)."""
    W = 3
    eps = rings(W)
    for e in eps:
        e.set_piece_bytes(4000)  # pieces that are not a multiple of the 16-element vector block
    try:
        xs = [np.random.default_rng(90 + i).standard_normal(30_007).astype(dt) for i in range(W)]
        res = run_all(eps, xs, op=op, quantize=quant, tag=5)
        want = quantized_ring_reference(xs, op, 255 if quant == "uint8" else 65535, 4000 // dt.itemsize)
        for r in res:
            np.testing.assert_array_equal(bits(r), bits(want))
    finally:
        for e in eps:
            e.set_piece_bytes(1 << 20)


def test_quantize_rejects_integers(rings):
    with pytest.raises(ValueError, match="floating"):
        rings(2)[0].all_reduce(np.zeros(4, np.int32), quantize="uint8")


def test_world_of_one_is_a_copy():
    e = RingEndpoint()
    try:
        e.connect_ring([e.address], 0, epoch=1)
        x = np.arange(10, dtype=np.float32)
        y = e.all_reduce(x, op="avg")
        np.testing.assert_array_equal(y, x)
        assert y is not x
    finally:
        e.close()


def test_concurrent_ops_over_the_pool():
    for pool in (2, 3):
        eps = make_ring(3, pool_size=pool)
        try:
            xs = {t: make_inputs(3, 50_000 + t, np.dtype(np.float32), "sum", seed=t) for t in range(3)}

            def peer(i):
                hs = [eps[i].all_reduce_async(xs[t][i], op="sum", tag=t) for t in range(3)]
                return [h.wait(timeout_s=30) for h in hs]

            res = parallel([lambda i=i: peer(i) for i in range(3)])
            for t in range(3):
                check_exact([res[i][t] for i in range(3)], xs[t], "sum")
        finally:
            close_all(eps)


def _slow_ring(W, rate):
    eps = make_ring(W, timeout_s=10.0)
    for i, e in enumerate(eps):
        e.set_link(eps[(i + 1) % W].address, rate)
    return eps


@pytest.mark.parametrize("aliased", [False, True])
def test_abort_mid_operation_restores_buffers(aliased):
    W = 3
    eps = _slow_ring(W, 4e6)  # 4 MB/s per link: a 4 MB all-reduce needs ~0.7 s
    try:
        xs = [np.random.default_rng(i).standard_normal(1 << 20).astype(np.float32) for i in range(W)]
        originals = [x.copy() for x in xs]
        hs = [eps[i].all_reduce_async(xs[i], out=xs[i] if aliased else None) for i in range(W)]
        time.sleep(0.25)
        assert not any(h.done() for h in hs), "operation finished before the abort"
        sent_before = eps[0].stats()["bytes_sent"]
        assert sent_before > 4096  # really mid-flight
        t0 = time.monotonic()
        for e in eps:
            e.abort()
        for i, h in enumerate(hs):
            with pytest.raises((RingAborted, ConnectionError)):
                h.wait(timeout_s=5)
            np.testing.assert_array_equal(xs[i], originals[i])
        assert time.monotonic() - t0 < 2.0
        with pytest.raises(RingAborted):
            eps[0].all_reduce(xs[0])
        # a new epoch works again
        for e in eps:
            e.set_link(eps[(eps.index(e) + 1) % W].address, None)
        make_ring(W, epoch=2, eps=eps)
        check_exact(run_all(eps, xs), xs, "sum")
    finally:
        close_all(eps)


def test_link_emulation_limits_throughput_and_is_measured():
    eps = make_ring(2)
    try:
        xs = [np.ones(1 << 20, np.float32) * (i + 1) for i in range(2)]  # 4 MB
        t0 = time.monotonic()
        run_all(eps, xs)
        fast = time.monotonic() - t0
        rate = 8e6
        for i, e in enumerate(eps):
            e.set_link(eps[1 - i].address, rate, latency_s=0.002)
        t0 = time.monotonic()
        res = run_all(eps, xs)
        slow = time.monotonic() - t0
        np.testing.assert_array_equal(res[0], np.full(1 << 20, 3, np.float32))
        per_link = 4 << 20  # each rank sends (W-1)/W * 2 * 4 MB = 4 MB over its link
        assert slow >= 0.85 * per_link / rate, (slow, fast)
        assert slow > 3 * fast
        bw = eps[0].measure_bandwidth(eps[1].address, nbytes=1 << 20)
        assert 0.6 * rate < bw < 1.25 * rate, bw
        eps[0].set_link(eps[1].address, None)
        assert eps[0].measure_bandwidth(eps[1].address, nbytes=1 << 20) > 3 * rate
    finally:
        close_all(eps)


def _dead_address():
    """host:port with nothing listening (connections are refused)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _connect_in_thread(ep, ring, idx, epoch):
    box = {}

    def run():
        t0 = time.monotonic()
        try:
            ep.connect_ring(ring, idx, epoch)
            box["error"] = None
        except Exception as e:  # noqa: BLE001 - the test inspects it
            box["error"] = e
        box["t"] = time.monotonic()

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


@pytest.mark.parametrize("stage", ["connecting", "accepting"])
def test_abort_interrupts_connect_ring(stage):
    """abort() during connect_ring (next peer refusing connections, or previous peer never
    connecting) ends it promptly with RingAborted naming the peer; the next epoch still connects."""
    a = RingEndpoint(timeout_s=30)
    b = RingEndpoint(timeout_s=30)
    try:
        if stage == "connecting":
            peer = _dead_address()
            ring = [a.address, peer]
        else:
            peer = b.address  # b accepts a's connections but never connects back
            ring = [a.address, b.address]
        th, box = _connect_in_thread(a, ring, 0, 1)
        time.sleep(0.4)
        assert th.is_alive()  # still waiting for the peer
        t_abort = time.monotonic()
        a.abort()
        th.join(5)
        assert not th.is_alive()
        assert box["t"] - t_abort < 1.0, box["t"] - t_abort
        err = box["error"]
        assert isinstance(err, RingAborted), repr(err)
        assert "aborted" in str(err) and peer in str(err), str(err)
        if stage == "accepting":
            assert "previous peer" in str(err)
        else:
            assert "next peer" in str(err)
            return
        # abort ends only the connect in progress: both peers now form epoch 2 and reduce
        parallel([lambda: a.connect_ring(ring, 0, 2), lambda: b.connect_ring(ring, 1, 2)])
        res = parallel([lambda: a.all_reduce(np.full(5, 1.5, np.float32)),
                        lambda: b.all_reduce(np.full(5, 2.0, np.float32))])
        for r in res:
            np.testing.assert_array_equal(r, np.full(5, 3.5, np.float32))
    finally:
        a.close()
        b.close()


def test_close_interrupts_connect_ring():
    a = RingEndpoint(timeout_s=30)
    try:
        th, box = _connect_in_thread(a, [a.address, _dead_address()], 0, 1)
        time.sleep(0.3)
        t0 = time.monotonic()
        a.close()
        th.join(5)
        assert box["t"] - t0 < 1.0 and isinstance(box["error"], RingAborted), box
    finally:
        a.close()


def test_connect_ring_timeout_names_the_peer():
    a = RingEndpoint(timeout_s=0.5)
    try:
        dead = _dead_address()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            a.connect_ring([a.address, dead], 0, 1)
        assert time.monotonic() - t0 < 2.0
        assert dead in str(info.value) and "next peer" in str(info.value), str(info.value)
    finally:
        a.close()


def test_wrong_secret_is_rejected():
    a = RingEndpoint(secret=b"right", timeout_s=3)
    b = RingEndpoint(secret=b"wrong", timeout_s=3)
    try:
        errs = []

        def conn(e, i):
            try:
                e.connect_ring([a.address, b.address], i, 1)
            except (ConnectionError, TimeoutError) as err:
                errs.append(str(err))

        parallel([lambda: conn(a, 0), lambda: conn(b, 1)])
        assert len(errs) == 2
        assert any("authentication" in m for m in errs), errs
        assert a.stats()["auth_rejected"] + b.stats()["auth_rejected"] >= 1
        with pytest.raises(ConnectionError):
            a.measure_bandwidth(b.address, 1000)
    finally:
        a.close()
        b.close()


def test_timeout_names_peer_and_tag():
    eps = make_ring(2, timeout_s=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError) as info:
            eps[0].all_reduce(np.ones(10, np.float32), tag=42)
        assert time.monotonic() - t0 < 3
        assert eps[1].address in str(info.value) and "tag 42" in str(info.value)
    finally:
        close_all(eps)


def test_mismatched_operations_are_reported(rings):
    eps = make_ring(2)
    try:
        r = parallel([lambda: _catch(lambda: eps[0].all_reduce(np.ones(10, np.float32), tag=1)),
                      lambda: _catch(lambda: eps[1].all_reduce(np.ones(12, np.float32), tag=1))])
        assert all(isinstance(e, ConnectionError) for e in r), r
        assert any("different operation" in str(e) for e in r), r
    finally:
        close_all(eps)


def _catch(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001
        return err
    return None


# ----------------------------------------------------------------------------------------------
# Multi-process: one endpoint per process; the parent drives the workers over stdin/stdout.

WORKER = r"""
import json, sys, time
import numpy as np
from jaxodc.comm.ring import RingEndpoint, RingAborted
rank = int(sys.argv[1]); n = int(sys.argv[2]); rate = float(sys.argv[3])
ep = RingEndpoint(secret=b"mp", timeout_s=10.0)
print(json.dumps({"address": ep.address}), flush=True)
def data(r):
    return np.random.default_rng(r).standard_normal(n).astype(np.float32)
for line in sys.stdin:
    cmd = json.loads(line)
    ring, idx, epoch = cmd["ring"], cmd["index"], cmd["epoch"]
    ep.connect_ring(ring, idx, epoch)
    ep.set_link(ring[(idx + 1) % len(ring)], cmd.get("rate") or None)
    x = data(rank); orig = x.copy()
    print(json.dumps({"started": True}), flush=True)
    t0 = time.monotonic(); err = None
    try:
        ep.all_reduce(x, out=x)
    except (RingAborted, ConnectionError, TimeoutError) as e:
        err = type(e).__name__ + ": " + str(e)
    out = {"error": err, "seconds": time.monotonic() - t0,
           "restored": bool(np.array_equal(x, orig)) if err else None,
           "result": x.view(np.uint32).tolist()[:: max(1, n // 257)] if not err else None,
           "checksum": float(np.float64(x).sum()) if not err else None}
    print(json.dumps(out), flush=True)
ep.close()
"""


def _spawn(rank, n):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen([sys.executable, "-c", WORKER, str(rank), str(n), "0"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)


def _read(p, timeout=20.0):
    box = []
    t = threading.Thread(target=lambda: box.append(p.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    if not box or not box[0]:
        raise AssertionError(f"worker pid {p.pid} sent nothing within {timeout} s (exit code {p.poll()})")
    return json.loads(box[0])


def _send(p, obj):
    p.stdin.write(json.dumps(obj) + "\n")
    p.stdin.flush()


def test_multiprocess_sigkill_then_smaller_ring():
    W, n = 3, 1 << 20
    procs = [_spawn(r, n) for r in range(W)]
    try:
        addrs = [_read(p)["address"] for p in procs]
        # epoch 1: slow links so the all-reduce is in flight when rank 2 is killed
        for i, p in enumerate(procs):
            _send(p, {"ring": addrs, "index": i, "epoch": 1, "rate": 3e6})
        for p in procs:
            assert _read(p)["started"]
        time.sleep(0.4)
        procs[2].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        outs = [_read(p) for p in procs[:2]]
        assert time.monotonic() - t0 < 3.0
        for o in outs:
            assert o["error"] and o["error"].split(":")[0] in ("ConnectionError", "RingAborted"), o
            assert o["restored"] is True
        # epoch 2: the survivors form a ring of 2 and succeed
        ring2 = addrs[:2]
        for i, p in enumerate(procs[:2]):
            _send(p, {"ring": ring2, "index": i, "epoch": 2})
        for p in procs[:2]:
            assert _read(p)["started"]
        outs = [_read(p) for p in procs[:2]]
        xs = [np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in range(2)]
        want = ring_reference(xs, "sum")
        for o in outs:
            assert o["error"] is None, o
            assert o["result"] == want.view(np.uint32).tolist()[:: max(1, n // 257)]
            assert abs(o["checksum"] - float(want.astype(np.float64).sum())) < 1e-3
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
            p.stdin.close()
            p.stdout.close()


def test_tags_route_ops_issued_in_different_orders():
    # with a connection per op, peers may issue concurrent ops in any order: the start header's
    # tag routes each incoming connection to the right op
    eps = make_ring(3, pool_size=3)
    try:
        xs = {t: make_inputs(3, 3000 + 7 * t, np.dtype(np.float32), "sum", seed=20 + t) for t in range(3)}
        orders = [[0, 1, 2], [2, 1, 0], [1, 2, 0]]

        def peer(i):
            hs = {t: eps[i].all_reduce_async(xs[t][i], tag=t) for t in orders[i]}
            return {t: h.wait(timeout_s=30) for t, h in hs.items()}

        res = parallel([lambda i=i: peer(i) for i in range(3)])
        for t in range(3):
            check_exact([res[i][t] for i in range(3)], xs[t], "sum")
        assert all(e.stats()["ops_ok"] == 3 for e in eps)
    finally:
        close_all(eps)


def _staged_all_reduce(ep, x, op="sum", quantize=None, tag=0):
    """The CUDA handler's device-staged piece logic, with host memory standing in for the GPU."""
    from jaxodc.comm.ring import _bytes, _codes, _raise
    out = np.empty_like(x)
    dt, opc, qc = _codes(x, op, quantize)
    status, message = ep._ep.all_reduce_staged(_bytes(x), _bytes(out), x.size, dt, opc, qc, tag)
    if status:
        _raise(status, message)
    return out


@pytest.mark.parametrize("dt,op,quant", [(np.dtype(np.float32), "sum", None), (BF16, "avg", None),
                                         (np.dtype(np.int64), "prod", None), (np.dtype(np.float16), "max", None),
                                         (np.dtype(np.float32), "avg", "uint8"), (BF16, "sum", "uint16")])
def test_device_staged_path_matches_host_path(rings, dt, op, quant):
    W = 3
    eps = rings(W)
    for e in eps:
        e.set_piece_bytes(4096)
    try:
        xs = make_inputs(W, 20_003, dt, op, seed=77)
        host = run_all(eps, xs, op=op, quantize=quant, tag=11)
        # peer 1 stages through "device" buffers, the others work in place on the host
        mixed = parallel([lambda i=i: _staged_all_reduce(eps[i], xs[i], op, quant, tag=12) if i == 1
                          else eps[i].all_reduce(xs[i], op=op, quantize=quant, tag=12) for i in range(W)])
        for r in mixed + host:
            np.testing.assert_array_equal(bits(r), bits(host[0]))
        if quant is None:
            check_exact(host, xs, op)
    finally:
        for e in eps:
            e.set_piece_bytes(1 << 20)
