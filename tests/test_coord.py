"""Coordination service: authentication, malformed input, heartbeats, votes and consensus.

Peers here speak the wire protocol directly (no data path), so every decision of the service is
observable frame by frame."""
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from jaxodc import auth
from jaxodc.coord import protocol as P
from jaxodc.coord.service import CoordinatorService

SECRET = b"test-secret"


class RawPeer:
    """Minimal protocol-level peer: replies by rid, pushes (abort/measure) in a queue."""

    def __init__(self, address, secret=SECRET, group=0, name="p"):
        host, port = P.parse_address(address)
        self.sock = socket.create_connection((host, port), timeout=10)
        w = P.client_handshake(self.sock, secret, {"group": group, "ring_addr": f"ring-{name}",
                                                   "ss_addr": f"ss-{name}"})
        self.id = w["peer_id"]
        self.sock.settimeout(None)
        self.replies, self.pushes = {}, queue.Queue()
        self.cv = threading.Condition()
        self.rid = 0
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        try:
            while True:
                m = P.recv_frame(self.sock)
                if m["t"] == "reply":
                    with self.cv:
                        self.replies[m["rid"]] = m
                        self.cv.notify_all()
                else:
                    self.pushes.put(m)
        except (OSError, ConnectionError, P.ProtocolError):
            pass

    def send(self, t, **f):
        self.rid += 1
        P.send_frame(self.sock, {"t": t, "rid": self.rid, **f})
        return self.rid

    def wait(self, rid, timeout=5.0):
        with self.cv:
            ok = self.cv.wait_for(lambda: rid in self.replies, timeout)
        assert ok, f"peer {self.id}: no reply to request {rid} within {timeout} s"
        return self.replies.pop(rid)

    def call(self, t, **f):
        return self.wait(self.send(t, **f))

    def close(self):
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.t.join(2)


def _wait_for(pred, what, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def svc():
    s = CoordinatorService("127.0.0.1", 0, SECRET, heartbeat_timeout_s=1.0).start()
    yield s
    s.stop()


def _join(svc, peers):
    """Bootstrap a group: first peer accepted alone, the rest voted in by all accepted peers."""
    r = peers[0].call("topo", accept_new=True)
    assert r["ok"] and r["changed"] and r["rank"] == 0
    assert peers[0].call("topo_done", op=r["op"], ok=True)["ok"]
    for newcomer in peers[1:]:
        acc = [p for p in peers if p is not newcomer and p.id in svc.snapshot()["groups"][0]["accepted"]]
        prids = [p.send("pending") for p in acc]  # a consensus round: all ask, all get the answer
        assert all(p.wait(r)["pending"] is True for p, r in zip(acc, prids))
        nrid = newcomer.send("topo")
        rids = [p.send("topo", accept_new=True) for p in acc]
        rs = [p.wait(rid) for p, rid in zip(acc, rids)] + [newcomer.wait(nrid)]
        assert all(r["ok"] and r["changed"] for r in rs)
        assert len({r["epoch"] for r in rs}) == 1
        done = [p.send("topo_done", op=r["op"], ok=True) for p, r in zip(acc + [newcomer], rs)]
        assert all(p.wait(d)["ok"] for p, d in zip(acc + [newcomer], done))
    return rs[0]["epoch"] if len(peers) > 1 else r["epoch"]


def test_wrong_secret_and_garbage_are_dropped_and_logged(svc, caplog):
    caplog.set_level(logging.INFO, logger="jaxodc.coord")
    with pytest.raises(P.AuthError):
        RawPeer(svc.address, secret=b"wrong")
    # garbage before authentication: an HTTP request
    host, port = P.parse_address(svc.address)
    with socket.create_connection((host, port), timeout=5) as s:
        P.recv_frame(s)  # the challenge
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(100) == b""  # the service closes the connection
    # a frame announcing 1 GiB before authentication
    with socket.create_connection((host, port), timeout=5) as s:
        P.recv_frame(s)
        s.sendall(P.HEADER.pack(1 << 30))
        assert s.recv(100) == b""
    # the service still works: a good peer registers and joins
    good = RawPeer(svc.address, name="good")
    _join(svc, [good])
    # malformed frames from an authenticated peer are dropped, the peer stays
    good.sock.sendall(P.HEADER.pack(5) + b"\xc1\xc1\xc1\xc1\xc1")   # not msgpack
    good.sock.sendall(P.pack({"no_type": 1}))                         # no message type
    good.sock.sendall(P.pack({"t": "open", "rid": 99}))               # missing fields
    good.sock.sendall(P.pack({"t": "no_such_op", "rid": 98}))
    assert good.wait(98)["ok"] is False
    assert good.call("pending")["pending"] is False  # still served
    snap = svc.snapshot()
    assert snap["counters"]["auth_failures"] == 3
    assert snap["counters"]["malformed_frames"] >= 4
    assert snap["groups"][0]["accepted"] == [good.id]
    text = caplog.text
    assert "wrong shared secret" in text
    assert "dropped unauthenticated connection" in text
    assert "exceeds the limit" in text
    assert "dropped malformed frame" in text and "undecodable msgpack" in text
    good.close()


def test_handshake_binds_the_claimed_group_and_addresses(svc, caplog):
    """A valid answer whose claims are changed afterwards (another group, another ring address)
    is refused: the MAC covers them."""
    caplog.set_level(logging.INFO, logger="jaxodc.coord")
    host, port = P.parse_address(svc.address)
    for field, value in (("group", 1), ("ring_addr", "ring-evil"), ("ss_addr", "ss-evil")):
        with socket.create_connection((host, port), timeout=5) as s:
            chal = P.recv_frame(s)
            frame, _ = P.answer(SECRET, chal, {"group": 0, "ring_addr": "ring-a", "ss_addr": "ss-a"})
            frame[field] = value
            P.send_frame(s, frame)
            assert P.recv_frame(s) == {"t": "error", "reason": "authentication failed"}
    assert svc.snapshot()["counters"]["auth_failures"] == 3
    assert caplog.text.count("wrong shared secret") == 3


def test_connection_limit_and_stop_wake_idle_connections():
    svc = CoordinatorService("127.0.0.1", 0, SECRET, max_connections=2).start()
    host, port = P.parse_address(svc.address)
    idle = [socket.create_connection((host, port), timeout=5) for _ in range(2)]  # inside the handshake
    try:
        for s in idle:
            assert P.recv_frame(s)["t"] == "challenge"
        with socket.create_connection((host, port), timeout=5) as s:  # the third is closed at once
            assert s.recv(100) == b""
        t0 = time.monotonic()
        svc.stop()
        assert time.monotonic() - t0 < 2  # not held by the connections still authenticating
        for s in idle:
            assert s.recv(100) == b""
    finally:
        for s in idle:
            s.close()


def test_master_refuses_to_listen_openly_without_a_secret(tmp_path):
    def master(*argv, **env):
        return subprocess.run([sys.executable, "-m", "jaxodc", "master", "--port", "0", *argv],
                              capture_output=True, text=True, timeout=60,
                              env={k: v for k, v in os.environ.items() if not k.startswith("JAXODC_")} | env)
    p = master("--host", "0.0.0.0")
    assert p.returncode == 2
    assert p.stderr.strip() == ("jaxodc master: coordination service: refusing to listen on 0.0.0.0 without a "
                                "secret; give one (--secret-file, or $JAXODC_JOB_SECRET) or bind 127.0.0.1")
    empty = tmp_path / "empty"
    empty.write_bytes(b"\n")
    p = master("--host", "0.0.0.0", "--secret-file", str(empty))
    assert p.returncode == 2 and f"secret file {empty} is empty" in p.stderr, p.stderr
    p = master("--secret-file", str(tmp_path / "missing"))
    assert p.returncode == 2 and "cannot read secret file" in p.stderr, p.stderr
    with pytest.raises(auth.AuthError, match="refusing to listen on 0.0.0.0"):
        CoordinatorService("0.0.0.0", 0, b"")


def test_master_listens_on_loopback_by_default():
    proc = subprocess.Popen([sys.executable, "-m", "jaxodc", "master", "--port", "0", "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if not k.startswith("JAXODC_")})
    try:
        line = proc.stdout.readline()
        assert line.startswith("jaxodc master listening on 127.0.0.1:"), line
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_client_refuses_service_without_secret(svc):
    """Mutual authentication: a server that does not know the secret cannot fake the welcome."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def fake():
        c, _ = srv.accept()
        chal = P.challenge()
        P.send_frame(c, chal)
        P.recv_frame(c)
        P.send_frame(c, {"t": "welcome", "mac": b"x" * 32, "peer_id": 1})
        c.close()

    th = threading.Thread(target=fake)
    th.start()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        with pytest.raises(P.AuthError, match="server failed to prove"):
            P.client_handshake(s, SECRET, {"group": 0, "ring_addr": "a", "ss_addr": "b"})
    th.join()
    srv.close()


def test_heartbeat_timeout_removes_silent_peer(svc, caplog):
    caplog.set_level(logging.INFO, logger="jaxodc.coord")
    a, b = RawPeer(svc.address, name="a"), RawPeer(svc.address, name="b")
    _join(svc, [a, b])
    stop = threading.Event()

    def beat():  # a keeps beating, b falls silent (a hung process keeps its socket open)
        while not stop.wait(0.2):
            P.send_frame(a.sock, {"t": "hb"})

    th = threading.Thread(target=beat)
    th.start()
    try:
        _wait_for(lambda: svc.snapshot()["groups"][0]["accepted"] == [a.id], "b to be dropped")
        assert "no heartbeat" in caplog.text
        assert svc.snapshot()["groups"][0]["stale"] is True
    finally:
        stop.set()
        th.join()
    a.close()
    b.close()


def test_pending_vote_and_collective_consensus(svc):
    a, b = RawPeer(svc.address, name="a"), RawPeer(svc.address, name="b")
    _join(svc, [a, b])
    epoch = svc.snapshot()["groups"][0]["epoch"]
    # a newcomer is registered: both accepted peers get the same answer
    c = RawPeer(svc.address, name="c")
    ra, rb = a.send("pending"), b.send("pending")
    assert a.wait(ra)["pending"] is True and b.wait(rb)["pending"] is True
    # a unanimous vote is needed: b votes no, so c is not admitted and the ring stays
    rc = c.send("topo")
    ra, rb = a.send("topo", accept_new=True), b.send("topo", accept_new=False)
    assert a.wait(ra)["changed"] is False and b.wait(rb)["changed"] is False
    assert svc.snapshot()["groups"][0]["accepted"] == [a.id, b.id]
    # registered peers cannot run collectives
    r = c.call("open", tag=0, epoch=epoch)
    assert r["ok"] is False and r["kind"] == "not_accepted"
    # a collective opens only when both voted; two tags may be in flight together
    r1 = a.send("open", tag=1, epoch=epoch)
    r2 = a.send("open", tag=2, epoch=epoch)
    time.sleep(0.2)
    assert r1 not in a.replies and r2 not in a.replies  # b has not voted yet
    s1, s2 = b.send("open", tag=1, epoch=epoch), b.send("open", tag=2, epoch=epoch)
    o = [a.wait(r1), a.wait(r2), b.wait(s1), b.wait(s2)]
    assert all(x["ok"] for x in o) and o[0]["op"] == o[2]["op"] and o[1]["op"] == o[3]["op"]
    # a major operation is refused while collectives are in flight
    r = a.call("sync", revision=1, hashes={}, strategy="enforce_popular")
    assert r["ok"] is False and r["kind"] == "busy"
    # close: tag 1 closes when both closed
    c1 = a.send("close", tag=1, op=o[0]["op"], ok=True)
    time.sleep(0.1)
    assert c1 not in a.replies
    d1 = b.send("close", tag=1, op=o[0]["op"], ok=True)
    assert a.wait(c1)["ok"] and b.wait(d1)["ok"]
    # tag 2: b fails locally -> a gets an abort push and its close is refused; the ring is stale
    d2 = b.send("close", tag=2, op=o[1]["op"], ok=False, reason="connection reset")
    assert b.wait(d2)["ok"] is False
    push = a.pushes.get(timeout=5)
    assert push["t"] == "abort" and 2 in push["tags"] and "connection reset" in push["reason"]
    r = a.call("close", tag=2, op=o[1]["op"], ok=True)
    assert r["ok"] is False and r["kind"] == "aborted"
    r = a.call("open", tag=3, epoch=epoch)
    assert r["ok"] is False and r["kind"] == "stale"
    # re-forming the ring admits c too (c was parked in its update_topology)
    ra, rb = a.send("topo", accept_new=True), b.send("topo", accept_new=True)
    rs = [a.wait(ra), b.wait(rb), c.wait(rc)]
    assert [x["rank"] for x in rs] == [0, 1, 2] and rs[0]["ring"] == ["ring-a", "ring-b", "ring-c"]
    done = [p.send("topo_done", op=x["op"], ok=True) for p, x in zip((a, b, c), rs)]
    assert all(p.wait(d)["ok"] for p, d in zip((a, b, c), done))
    assert svc.snapshot()["groups"][0]["stale"] is False
    for p in (a, b, c):
        p.close()


def test_peer_death_aborts_collective_everywhere(svc):
    ps = [RawPeer(svc.address, name=n) for n in "abc"]
    epoch = _join(svc, ps)
    a, b, c = ps
    ra, rb = a.send("open", tag=7, epoch=epoch), b.send("open", tag=7, epoch=epoch)
    rc = c.send("open", tag=7, epoch=epoch)
    op = a.wait(ra)["op"]
    b.wait(rb), c.wait(rc)
    ca = a.send("close", tag=7, op=op, ok=True)  # a finished, the others still run
    c.close()                                    # c dies (closed connection)
    for p in (a, b):
        push = p.pushes.get(timeout=5)
        assert push["t"] == "abort" and 7 in push["tags"] and "failed" in push["reason"]
    assert a.wait(ca)["ok"] is False  # a must not keep its result: the op failed
    snap = svc.snapshot()["groups"][0]
    assert snap["accepted"] == [a.id, b.id] and snap["stale"] is True
    # the survivors re-form a ring of 2 (no admissions) at a new epoch
    ra, rb = a.send("topo", accept_new=False), b.send("topo", accept_new=False)
    x, y = a.wait(ra), b.wait(rb)
    assert x["ring"] == ["ring-a", "ring-b"] and x["epoch"] == y["epoch"] > epoch
    da, db = a.send("topo_done", op=x["op"], ok=True), b.send("topo_done", op=y["op"], ok=True)
    assert a.wait(da)["ok"] and b.wait(db)["ok"]
    assert svc.snapshot()["groups"][0]["stale"] is False
    a.close()
    b.close()


def test_groups_are_independent(svc):
    a, b = RawPeer(svc.address, group=0, name="a"), RawPeer(svc.address, group=1, name="b")
    _join(svc, [a])
    r = b.call("topo")  # group 1 bootstraps on its own, without waiting for group 0
    assert r["ok"] and r["ring"] == ["ring-b"]
    assert b.call("topo_done", op=r["op"], ok=True)["ok"]
    snap = svc.snapshot()["groups"]
    assert snap[0]["accepted"] == [a.id] and snap[1]["accepted"] == [b.id]
    # a consensus in group 0 needs only group 0's peers
    assert a.call("open", tag=0, epoch=snap[0]["epoch"])["ok"]
    a.close()
    b.close()


def test_master_cli_standalone(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET + b"\n")
    proc = subprocess.Popen([sys.executable, "-m", "jaxodc", "master", "--host", "127.0.0.1", "--port", "0",
                             "--secret-file", str(secret_file), "--log-level", "WARNING"],
                            stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        line = proc.stdout.readline()
        assert line.startswith("jaxodc master listening on "), line
        addr = line.split()[-1]
        p = RawPeer(addr, name="x")
        r = p.call("topo")
        assert r["ok"] and r["ring"] == ["ring-x"]
        p.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_blocking_framing_errors():
    """One framing for the service's clients and the rendezvous: a hang-up between frames is
    ConnectionClosed, anything else that breaks the stream is a ProtocolError."""
    a, b = socket.socketpair()
    with a, b:
        P.send_frame(a, {"t": "hb"})
        a.sendall(P.pack({"op": "set"}) + P.HEADER.pack(100) + b"short")
        a.shutdown(socket.SHUT_WR)
        assert P.recv_frame(b) == {"t": "hb"}
        with pytest.raises(P.ProtocolError, match="no string message type"):
            P.recv_frame(b)
        with pytest.raises(P.ProtocolError, match="closed inside a 100-byte frame"):
            P.recv_frame(b, typed=False)
        with pytest.raises(P.ConnectionClosed):
            P.recv_frame(b)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(P.HEADER.pack(P.MAX_FRAME + 1))
        with pytest.raises(P.FrameTooLarge):
            P.recv_frame(b)
