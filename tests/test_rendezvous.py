"""Rendezvous server/client: key-value, blocking get, allgather/barrier with name reuse, timeouts,
garbage on the wire, and the same across real processes via the harness."""
import logging
import os
import socket
import struct
import threading
import time

import msgpack
import pytest

from harness import run_ranks
from jaxodc.launch.context import free_port
from jaxodc import auth
from jaxodc.launch.rendezvous import MAX_FRAME, RendezvousClient, RendezvousError, RendezvousServer


@pytest.fixture
def server():
    s = RendezvousServer()
    yield s
    s.close()


def _threads(world, target):
    """Run target(rank) on `world` threads; return results by rank, re-raising any error."""
    results, errors = [None] * world, [None] * world

    def run(r):
        try:
            results[r] = target(r)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors[r] = e

    ts = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
        assert not t.is_alive(), "rendezvous thread did not finish"
    for e in errors:
        if e is not None:
            raise e
    return results


def test_set_get_allgather_barrier_three_ranks(server):
    world = 3
    clients = [RendezvousClient(server.address, r, timeout_s=10) for r in range(world)]
    try:
        clients[0].set("alpha", b"\x00\x01binary\xff")
        assert [c.get("alpha") for c in clients] == [b"\x00\x01binary\xff"] * world
        clients[2].set("alpha", b"overwritten")
        assert clients[1].get("alpha") == b"overwritten"

        def body(r):
            c = clients[r]
            out = []
            # Same name three times: each round must deliver that round's values only.
            for gen in range(3):
                out.append(c.allgather("ag", f"r{r}g{gen}".encode(), world))
                c.barrier("b", world)
            return out

        res = _threads(world, body)
        for r in range(world):
            for gen in range(3):
                assert res[r][gen] == [f"r{k}g{gen}".encode() for k in range(world)]
        # Every finished round was freed on the server.
        assert server._rounds == {}
    finally:
        for c in clients:
            c.close()


def test_get_blocks_server_side_until_set(server):
    waiter = RendezvousClient(server.address, 1, timeout_s=10)
    setter = RendezvousClient(server.address, 0, timeout_s=10)
    try:
        before = server.requests
        threading.Timer(0.6, setter.set, args=("late", b"v")).start()
        t0 = time.monotonic()
        assert waiter.get("late") == b"v"
        assert 0.5 < time.monotonic() - t0 < 5
        # One get and one set: the wait happened in the server, not by polling.
        assert server.requests - before == 2
    finally:
        waiter.close()
        setter.close()


def test_get_timeout_names_key_and_rank(server):
    with RendezvousClient(server.address, 2, timeout_s=10) as c:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=r"rank 2.*'never/set'"):
            c.get("never/set", timeout_s=0.4)
        assert 0.35 < time.monotonic() - t0 < 3
        # The connection stays usable after a timeout.
        c.set("k", b"1")
        assert c.get("k", timeout_s=1) == b"1"


def test_allgather_timeout_names_missing_ranks(server):
    with RendezvousClient(server.address, 0, timeout_s=10) as c:
        with pytest.raises(TimeoutError, match=r"'lonely'.*ranks \[1, 2\] of 3"):
            c.allgather("lonely", b"x", 3, timeout_s=0.3)


def test_mismatched_world_is_an_error(server):
    a = RendezvousClient(server.address, 0, timeout_s=5)
    b = RendezvousClient(server.address, 1, timeout_s=5)
    try:
        t = threading.Thread(target=lambda: pytest.raises(TimeoutError, a.allgather, "w", b"",
                                                          2, 1.0))
        t.start()
        time.sleep(0.2)
        with pytest.raises(RendezvousError, match=r"rank 1 .*world size 3.*another rank with 2"):
            b.allgather("w", b"", 3)
        t.join(5)
    finally:
        a.close()
        b.close()


def _send_raw(address, data: bytes, secret: bytes | None = None, job_id: str = "",
              rank: int = 0) -> bytes:
    """Send raw bytes (after the handshake as `rank` when a secret is given), return whatever
    comes back before the server closes the connection."""
    host, port = address.rsplit(":", 1)
    chunks = []
    with socket.create_connection((host, int(port)), timeout=5) as s:
        if secret is not None:
            auth.client_handshake(s, secret, "rendezvous", job_id, rank)
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            while True:
                c = s.recv(4096)
                if not c:
                    break
                chunks.append(c)
        except OSError:  # reset: the server closed with our unread bytes pending
            pass
    return b"".join(chunks)


def _frame(obj_bytes: bytes) -> bytes:
    return struct.pack(">I", len(obj_bytes)) + obj_bytes


GARBAGE = [
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # length prefix decodes to ~1.2 GB
    _frame(b"\xc1\xc1\xc1"),  # 0xc1 is never valid msgpack
    _frame(msgpack.packb([1, 2, 3])),  # not a map
    _frame(msgpack.packb({"op": "explode"})),  # unknown op
    _frame(msgpack.packb({"op": "set", "key": 5, "value": "text"})),  # wrong types
    _frame(msgpack.packb({"op": "get"})),  # missing fields
    _frame(msgpack.packb({"op": "hello", "rank": 1})),  # authenticated as rank 0
    struct.pack(">I", 100) + b"short",  # truncated frame
]


def test_garbage_closes_connection_not_server(caplog):
    caplog.set_level(logging.WARNING, logger="jaxodc.launch.rendezvous")
    with RendezvousServer(secret=SECRET, job_id="jg", world=2) as server, \
            RendezvousClient(server.address, 0, timeout_s=5, secret=SECRET, job_id="jg") as keep:
        keep.set("before", b"1")
        for g in GARBAGE:
            # without the handshake: the challenge comes back, nothing else
            got = _send_raw(server.address, g)
            assert len(got) == 36 and got[:4] == b"JXA2", got
            # authenticated rank 0 sending garbage: closed without a reply
            assert _send_raw(server.address, g, SECRET, "jg", 0) == b""
        msgs = [r.getMessage() for r in caplog.records]
        assert len([m for m in msgs if "closing connection" in m]) == len(GARBAGE), msgs
        assert len([m for m in msgs if "refused" in m]) == len(GARBAGE), msgs
        assert server.refused == 2 * len(GARBAGE)
        # The server and the existing connection still work.
        assert keep.get("before") == b"1"
        with RendezvousClient(server.address, 1, timeout_s=5, secret=SECRET, job_id="jg") as fresh:
            fresh.set("after", b"2")
            assert keep.get("after") == b"2"


SECRET = b"rendezvous test secret"


@pytest.mark.parametrize("secret,job,rank,why", [
    (b"wrong", "jw", 0, "wrong secret for claimed rank 0"),
    (b"", "jw", 0, "wrong secret for claimed rank 0"),
    (SECRET, "other_job", 1, "wrong secret for claimed rank 1"),
    (SECRET, "jw", 2, "claimed rank 2 outside a world of 2"),
])
def test_wrong_secret_job_or_rank_is_refused(caplog, secret, job, rank, why):
    caplog.set_level(logging.WARNING, logger="jaxodc.launch.rendezvous")
    with RendezvousServer(secret=SECRET, job_id="jw", world=2) as server:
        with pytest.raises(RendezvousError, match=rf"rank {rank} at {server.address}: refused by the "
                                                  r"server .*JAXODC_JOB_SECRET"):
            RendezvousClient(server.address, rank, timeout_s=3, secret=secret, job_id=job)
        deadline = time.monotonic() + 5
        while not server.refused and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.refused == 1
        assert any(why in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
        with RendezvousClient(server.address, 1, timeout_s=3, secret=SECRET, job_id="jw") as ok:
            ok.set("k", b"v")
            assert ok.get("k") == b"v"


def test_empty_secret_refused_off_loopback():
    with pytest.raises(auth.AuthError, match="refusing to listen on 0.0.0.0 without a secret"):
        RendezvousServer("0.0.0.0", 0)
    RendezvousServer("0.0.0.0", 0, secret=SECRET).close()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_announced_frames_allocate_nothing_and_oversized_ones_are_dropped():
    """Four authenticated connections announce frames just under the limit and send nothing: the
    server's memory does not grow by what they announce (4 x 64 MiB); one announcing more than
    the limit is dropped at once."""
    with RendezvousServer(secret=SECRET, job_id="jf", world=4) as server:
        host, port = server.address.rsplit(":", 1)
        socks = []
        try:
            before = _rss()
            for r in range(4):
                s = socket.create_connection((host, int(port)), timeout=5)
                auth.client_handshake(s, SECRET, "rendezvous", "jf", r)
                s.sendall(struct.pack(">I", MAX_FRAME) + b"\x81")  # announced, one byte sent
                socks.append(s)
            time.sleep(0.5)  # the server threads sit in their reads
            assert server.num_connections == 4
            assert _rss() - before < 32 << 20, (before, _rss())
            assert _send_raw(server.address, struct.pack(">I", MAX_FRAME + 1), SECRET, "jf", 0) == b""
            assert server.refused == 1
        finally:
            for s in socks:
                s.close()


def test_connection_limit_and_close_wakes_idle_readers():
    with RendezvousServer(secret=SECRET, job_id="jl", world=2, max_connections=3) as server:
        host, port = server.address.rsplit(":", 1)
        idle = []
        try:
            held = socket.create_connection((host, int(port)), timeout=5)  # stuck in the handshake
            idle.append(held)
            for r in range(2):  # authenticated, then silent
                s = socket.create_connection((host, int(port)), timeout=5)
                auth.client_handshake(s, SECRET, "rendezvous", "jl", r)
                idle.append(s)
            deadline = time.monotonic() + 5
            while server.num_connections < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert server.num_connections == 3
            with pytest.raises(RendezvousError):  # a fourth is closed on accept
                RendezvousClient(server.address, 0, timeout_s=2, secret=SECRET, job_id="jl")
            assert server.refused == 1
            t0 = time.monotonic()
            server.close()
            assert server.wait_for_disconnects(2.0)  # every blocked read woke
            assert time.monotonic() - t0 < 2
        finally:
            for s in idle:
                s.close()


def test_unauthenticated_connections_do_not_hold_the_shutdown_wait():
    """Rank 0's shutdown waits for the ranks to hang up, not for a stranger's idle connection."""
    with RendezvousServer(secret=SECRET, job_id="jw", world=2) as server:
        host, port = server.address.rsplit(":", 1)
        stranger = socket.create_connection((host, int(port)), timeout=5)  # silent in the handshake
        rank = socket.create_connection((host, int(port)), timeout=5)
        try:
            auth.client_handshake(rank, SECRET, "rendezvous", "jw", 1)
            deadline = time.monotonic() + 5
            while (server.num_connections < 2 or server.num_authenticated < 1) and time.monotonic() < deadline:
                time.sleep(0.01)  # the server marks the rank authenticated after the client's side is done
            assert (server.num_connections, server.num_authenticated) == (2, 1)
            assert not server.wait_for_disconnects(0.3)  # the rank is still connected
            rank.close()
            t0 = time.monotonic()
            assert server.wait_for_disconnects(5.0)
            assert time.monotonic() - t0 < 2
            assert server.num_connections == 1  # the stranger is still there
        finally:
            stranger.close()
            rank.close()


def test_client_retries_until_server_starts():
    port = free_port()
    box = {}
    t = threading.Thread(target=lambda: box.setdefault(
        "c", RendezvousClient(f"127.0.0.1:{port}", 0, timeout_s=10)))
    t.start()
    time.sleep(0.5)
    srv = RendezvousServer("127.0.0.1", port)
    try:
        t.join(10)
        c = box["c"]
        c.set("x", b"y")
        assert c.get("x") == b"y"
        c.close()
    finally:
        srv.close()


def test_connect_timeout_names_address():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"rank 4 could not connect to 127.0.0.1:{port}"):
        RendezvousClient(f"127.0.0.1:{port}", 4, timeout_s=0.5)
    assert time.monotonic() - t0 < 3


def test_server_close_wakes_blocked_get():
    srv = RendezvousServer()
    c = RendezvousClient(srv.address, 0, timeout_s=30)
    threading.Timer(0.3, srv.close).start()
    t0 = time.monotonic()
    with pytest.raises(RendezvousError):
        c.get("forever")
    assert time.monotonic() - t0 < 5
    c.close()


def _mp_body(ctx, rounds):
    rv = ctx.rendezvous
    out = []
    for i in range(rounds):
        out.append(rv.allgather("mp", f"{ctx.rank}:{i}".encode(), ctx.world))
        rv.barrier("mp", ctx.world)
    if ctx.rank == ctx.world - 1:
        rv.set("from_last", b"hello")
    return out, rv.get("from_last"), (ctx.rank, ctx.world, ctx.local_rank, ctx.job_id)


def test_three_processes_via_harness():
    res = run_ranks(_mp_body, 3, args=(4,), timeout_s=30)
    jobs = {r[2][3] for r in res}
    assert len(jobs) == 1
    for rank, (gathered, hello, ids) in enumerate(res):
        assert ids[:3] == (rank, 3, rank)
        assert hello == b"hello"
        assert gathered == [[f"{k}:{i}".encode() for k in range(3)] for i in range(4)]
