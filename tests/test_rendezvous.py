"""Rendezvous server/client: key-value, blocking get, allgather/barrier with name reuse, timeouts,
garbage on the wire, and the same across real processes via the harness."""
import logging
import socket
import struct
import threading
import time

import msgpack
import pytest

from harness import run_ranks
from jaxodc.launch.context import free_port
from jaxodc.launch.rendezvous import RendezvousClient, RendezvousError, RendezvousServer


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


def _send_raw(address, data: bytes) -> bytes:
    """Send raw bytes, return whatever comes back before the server closes the connection."""
    host, port = address.rsplit(":", 1)
    chunks = []
    with socket.create_connection((host, int(port)), timeout=5) as s:
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


def test_garbage_closes_connection_not_server(server, caplog):
    caplog.set_level(logging.WARNING, logger="jaxodc.launch.rendezvous")
    with RendezvousClient(server.address, 0, timeout_s=5) as keep:
        keep.set("before", b"1")
        garbage = [
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # length prefix decodes to ~1.2 GB
            _frame(b"\xc1\xc1\xc1"),  # 0xc1 is never valid msgpack
            _frame(msgpack.packb([1, 2, 3])),  # not a map
            _frame(msgpack.packb({"op": "explode"})),  # unknown op
            _frame(msgpack.packb({"op": "set", "key": 5, "value": "text"})),  # wrong types
            _frame(msgpack.packb({"op": "get"})),  # missing fields
            struct.pack(">I", 100) + b"short",  # truncated frame
        ]
        for g in garbage:
            assert _send_raw(server.address, g) == b""  # closed without a reply
        assert len([r for r in caplog.records if "closing connection" in r.getMessage()]) == len(
            garbage)
        # The server and the existing connection still work.
        assert keep.get("before") == b"1"
        with RendezvousClient(server.address, 1, timeout_s=5) as fresh:
            fresh.set("after", b"2")
            assert keep.get("after") == b"2"


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
