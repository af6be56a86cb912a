"""Communicator over the real ring: collectives under consensus, abort on SIGKILL and retry with
W-1, joining mid-run with bit-identical state, and rejected intruders while the run continues."""
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxodc.comm.communicator import CommError, Communicator
from jaxodc.coord import protocol as P
from jaxodc.coord.service import CoordinatorService

from comm_util import SECRET, close_all, make_group, run_threads

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture
def svc():
    s = CoordinatorService("127.0.0.1", 0, SECRET, heartbeat_timeout_s=3.0).start()
    yield s
    s.stop()


def test_all_reduce_under_consensus(svc):
    comms = make_group(svc.address, 3)
    try:
        rng = np.random.default_rng(0)
        xs = [rng.standard_normal(1001).astype(np.float32) for _ in comms]
        x0 = [x.copy() for x in xs]
        outs = run_threads([lambda c=c, x=x: c.all_reduce(x, op="sum") for c, x in zip(comms, xs)])
        ref = xs[0].astype(np.float64) + xs[1] + xs[2]
        for o, x, x_orig in zip(outs, xs, x0):
            np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-5)
            assert o.tobytes() == outs[0].tobytes()       # bit-identical on every peer
            assert np.array_equal(x, x_orig)              # input untouched (out-of-place)
        # two tags in flight at once, issued in the same order everywhere; one in place via out=
        ys = [np.full(7, float(i + 1), np.float64) for i in range(3)]

        def two(c, x, y):
            h1 = c.all_reduce_async(x, op="max", tag=1)
            h2 = c.all_reduce_async(y, op="avg", tag=2, out=y)
            return h1.wait(), h2.wait()

        res = run_threads([lambda c=c, x=x, y=y: two(c, x, y) for c, x, y in zip(comms, xs, ys)])
        for (m, a), y in zip(res, ys):
            assert np.array_equal(m, np.maximum(np.maximum(xs[0], xs[1]), xs[2]))
            assert np.array_equal(a, np.full(7, 2.0)) and a is y
        # quantised transfer stays bit-identical across peers
        q = run_threads([lambda c=c, x=x: c.all_reduce(x, op="avg", quantize="uint8") for c, x in zip(comms, xs)])
        assert all(v.tobytes() == q[0].tobytes() for v in q)
        np.testing.assert_allclose(q[0], ref / 3, atol=0.05 * float(np.abs(ref).max()))
    finally:
        close_all(comms)


def _spawn(master, name, npeers, size, link):
    return subprocess.Popen([sys.executable, os.path.join(HERE, "support", "comm_peer.py"), master, SECRET.decode(), name,
                             str(npeers), str(size), str(link)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _read_event(proc, event, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        msg = json.loads(line)
        if msg["event"] == event:
            return msg
    raise AssertionError(f"peer process {proc.pid} did not report {event!r} within {timeout} s; "
                         f"stderr: {proc.stderr.read()[-2000:] if proc.poll() is not None else '(running)'}")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
def test_dead_peer_mid_all_reduce_survivors_abort_restore_and_retry(svc, sig):
    """SIGKILL closes the victim's sockets (detected at once); SIGSTOP keeps them open and
    silent, so only the service's heartbeat timeout (3 s here) can detect it."""
    n, size, link = 4, 1 << 20, 4e6   # 4 MiB per peer over 4 MB/s links: ~2 s per all-reduce
    procs = [_spawn(svc.address, f"p{i}", n, size, link) for i in range(n)]
    try:
        starts = [_read_event(p, "start", 60) for p in procs]
        assert all(s["world"] == n for s in starts)
        time.sleep(0.6)  # every peer is inside the all-reduce now
        victim = procs[1]
        victim.send_signal(sig)
        if sig == signal.SIGKILL:
            victim.wait(10)
        survivors = [p for p in procs if p is not victim]
        firsts = [_read_event(p, "aborted", 30) for p in survivors]
        assert all(f["restored"] for f in firsts), firsts   # caller's buffer restored
        if sig == signal.SIGSTOP:
            assert any("no heartbeat" in f["reason"] for f in firsts), firsts
        retries = [_read_event(p, "retry_ok", 60) for p in survivors]
        expected = sum(r["input"] for r in retries)        # the survivors' inputs only
        for r in retries:
            assert r["world"] == n - 1 and r["all_equal"]
            assert r["value"] == expected, (r, expected)
        assert len({tuple(r["ring"]) for r in retries}) == 1
        if sig == signal.SIGSTOP:
            victim.kill()
        for p in survivors:
            assert p.wait(30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stdout.close()
            p.stderr.close()


def _train(comm, state, revision, steps, log, name, first=False):
    """The PCCL loop: admit pending peers, sync shared state, all-reduce, advance."""
    for _ in range(steps):
        if not first and comm.are_peers_pending():
            comm.update_topology()
        first = False
        info = comm.sync_shared_state(state, revision)
        revision = info.revision
        g = np.sin(np.arange(state["w"].size, dtype=np.float32) * (1 + len(name)) + revision).astype(np.float32)
        avg = comm.run_with_retry(comm.all_reduce, g, op="avg")
        state["w"] += avg
        state["step"][0] += 1
        revision += 1
        log.append({"rev": info.revision, "hash": info.hash, "world": comm.world_size,
                    "recv": info.bytes_received, "sent": info.bytes_sent, "fetched": info.keys_fetched,
                    "w": state["w"].tobytes()})
    return revision


def test_join_mid_run_bit_identical(svc):
    comms = make_group(svc.address, 2)
    newcomer = Communicator(svc.address, secret=SECRET, timeout_s=30, heartbeat_s=0.2)
    states = [{"w": np.zeros(4096, np.float32), "step": np.zeros(1, np.int64), "frozen": np.ones((3, 5))}
              for _ in range(3)]
    states[2]["w"][:] = 123.0   # the newcomer starts from garbage
    logs = [[], [], []]
    try:
        revs = run_threads([lambda i=i: _train(comms[i], states[i], 0, 3, logs[i], f"p{i}", first=True)
                            for i in range(2)])
        assert revs == [3, 3]

        def join():
            newcomer.connect()
            newcomer.update_topology()   # blocks until the others vote it in
            return _train(newcomer, states[2], 0, 5, logs[2], "p2", first=True)

        def established(i):
            # start once the newcomer is parked in its update_topology, so it is admitted at the
            # first pending check (revision 3) and the test is deterministic
            end = time.monotonic() + 20
            while not svc.snapshot()["groups"][0]["waiting"]:
                assert time.monotonic() < end, "newcomer never asked to join"
                time.sleep(0.02)
            return _train(comms[i], states[i], 3, 5, logs[i], f"p{i}")

        out = run_threads([lambda i=i: established(i) for i in range(2)] + [join])
        assert out == [8, 8, 8]
        # the newcomer fetched exactly the differing keys ("w" and "step"; "frozen" matched)
        first = logs[2][0]
        assert first["rev"] == 3 and first["fetched"] == ["step", "w"]
        assert first["recv"] == 4096 * 4 + 8
        assert sum(l["sent"] for lg in logs[:2] for l in lg) == first["recv"]
        # after that every sync is a no-op and every peer holds the same bytes at every revision
        for lg in logs:
            for l in lg:
                if l is not first:
                    assert l["recv"] == 0 and l["fetched"] == []
        by_rev = {}
        for lg in logs:
            for l in lg:
                by_rev.setdefault(l["rev"], set()).add((l["hash"], l["w"]))
        assert all(len(v) == 1 for v in by_rev.values()), {k: len(v) for k, v in by_rev.items()}
        assert [l["world"] for l in logs[0]] == [2, 2, 2, 3, 3, 3, 3, 3]
        for s in states[1:]:
            assert all(np.array_equal(s[k], states[0][k]) for k in s)
        # independent reference for the values: replay the averages in float64
        w = np.zeros(4096)
        for rev in range(8):
            names = ["p0", "p1"] + (["p2"] if rev >= 3 else [])
            w += np.mean([np.sin(np.arange(4096, dtype=np.float32) * (1 + len(n)) + rev).astype(np.float32)
                          for n in names], axis=0)
        np.testing.assert_allclose(states[0]["w"], w, rtol=1e-5, atol=1e-4)
    finally:
        close_all(comms + [newcomer])


def test_intruders_are_rejected_and_run_continues(svc, caplog):
    caplog.set_level(logging.INFO)
    comms = make_group(svc.address, 2)
    states = [{"w": np.arange(10, dtype=np.float32)} for _ in comms]
    try:
        run_threads([lambda c=c, s=s: c.sync_shared_state(s, 1) for c, s in zip(comms, states)])
        # wrong secret at the service
        with pytest.raises(CommError, match="authentication failed|HMAC"):
            Communicator(svc.address, secret=b"not-the-secret", timeout_s=5).connect()
        # garbage at the service and at a peer's shared-state server
        host, port = P.parse_address(svc.address)
        with socket.create_connection((host, port), timeout=5) as s:
            s.sendall(b"\x00\x00\x00\x05hello garbage")
        ssh, ssp = P.parse_address(comms[0].ss_server.address)
        with socket.create_connection((ssh, ssp), timeout=5) as s:  # a forged jaxodc-auth-v2 answer
            assert P.recv_exact(s, 36)[:4] == b"JXA2"
            s.sendall(b"x" * 32 + b"\x00\x00\x00\x00" + b"y" * 32)
            assert s.recv(1) == b""
        assert comms[0].ss_server.refused == 1
        # a revision that skips: peer 1 claims 5 instead of 2 -> rejected, receives the popular state
        states[1]["w"][0] = -1.0
        infos = run_threads([lambda: comms[0].sync_shared_state(states[0], 2),
                             lambda: comms[1].sync_shared_state(states[1], 5)])
        assert infos[0].rejected is None and infos[1].rejected is not None
        assert "revision 5 skips ahead" in infos[1].rejected
        assert infos[1].keys_fetched == ["w"] and infos[1].revision == 2
        assert np.array_equal(states[1]["w"], states[0]["w"])
        # the run continues: a collective and the next sync work
        outs = run_threads([lambda c=c: c.all_reduce(np.ones(5, np.float32)) for c in comms])
        assert all(np.array_equal(o, np.full(5, 2.0, np.float32)) for o in outs)
        infos = run_threads([lambda c=c, s=s: c.sync_shared_state(s, 3) for c, s in zip(comms, states)])
        assert all(i.bytes_received == 0 and i.rejected is None for i in infos)
        text = caplog.text
        assert f"rejected shared-state revision from peer {comms[1].peer_id}" in text
        assert "expected" in text and "last synced revision 1" in text
        assert "wrong shared secret" in text
        assert "dropped unauthenticated connection" in text
        assert "wrong secret for claimed rank 0" in text  # the shared-state server refused the forged auth
    finally:
        close_all(comms)


def test_embedded_master():
    """host_master=True: the first peer runs the service in a background thread."""
    c0 = Communicator(None, secret=SECRET, host_master=True, timeout_s=20)
    c1 = Communicator(c0.address, secret=SECRET, timeout_s=20)
    try:
        c0.connect()
        c1.connect()
        c0.update_topology()

        def admit():
            while c0.world_size < 2:
                if c0.are_peers_pending():
                    c0.update_topology()

        run_threads([admit, c1.update_topology])
        outs = run_threads([lambda c=c, v=v: c.all_reduce(np.full(3, v, np.int64)) for c, v in ((c0, 2), (c1, 5))])
        assert all(np.array_equal(o, np.full(3, 7, np.int64)) for o in outs)
    finally:
        c1.close()
        c0.close()


def test_peer_groups_reduce_and_sync_independently(svc):
    """Two groups on one service: collectives and shared state stay inside each group."""
    g0 = make_group(svc.address, 2, group=0)
    g1 = make_group(svc.address, 2, group=1)
    try:
        comms = g0 + g1
        vals = [1.0, 2.0, 10.0, 20.0]
        outs = run_threads([lambda c=c, v=v: c.all_reduce(np.full(100, v, np.float32)) for c, v in zip(comms, vals)])
        assert [float(o[0]) for o in outs] == [3.0, 3.0, 30.0, 30.0]
        states = [{"w": np.full(4, float(k // 2), np.float32)} for k in range(4)]
        infos = run_threads([lambda c=c, s=s: c.sync_shared_state(s, 1) for c, s in zip(comms, states)])
        assert all(i.bytes_received == 0 for i in infos)          # each group agrees internally
        assert infos[0].hash == infos[1].hash != infos[2].hash == infos[3].hash
        snap = svc.snapshot()["groups"]
        assert snap[0]["revision"] == snap[1]["revision"] == 1 and snap[0]["ring"] != snap[1]["ring"]
    finally:
        close_all(g0 + g1)


def test_unreachable_service_says_what_to_check():
    """A peer that cannot reach the service is told to check `jaxodc master`; across hosts, that
    the master listens on loopback unless --host."""
    from jaxodc.comm import MasterUnavailable
    from jaxodc.comm.communicator import _master_hint
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(MasterUnavailable, match=rf"127\.0\.0\.1:{port}: .*`jaxodc master`"):
        Communicator(f"127.0.0.1:{port}", secret=SECRET, timeout_s=5).connect()
    assert "--host 0.0.0.0" in _master_hint("host0") and "--host" not in _master_hint("127.0.0.1")
