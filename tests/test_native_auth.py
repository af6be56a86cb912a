"""jaxodc-auth-v2 on the native listeners (ODC tcp, lock-step tcp links, ring endpoints): the C++ tag
against the shared vectors, every listener refusing a wrong secret (and admitting the right one,
through the Python client: the two implementations interoperate), frames bounded before they touch
memory, and idle or truncated connections that do not delay close()."""
import json
import os
import socket
import struct
import time

import numpy as np
import pytest

from harness import run_ranks
from jaxodc import auth
from jaxodc._native import C

VECTORS = json.load(open(os.path.join(os.path.dirname(__file__), "support", "auth_vectors.json")))["cases"]
SECRET = b"natsec-test-secret"
# csrc/odc/wire.h WireHeader: op rank unit status version count aux value sketch_width sketch_seed
# elem_type reserved sent_at
WIRE = struct.Struct("<IiiiqqQdqQiid")
HELLO, PUSH, BYE = 1, 3, 7


@pytest.mark.parametrize("case", VECTORS, ids=lambda c: c["listener"])
def test_cpp_tag_matches_the_shared_vectors(case):
    args = (bytes.fromhex(case["secret"]),)
    rest = (case["listener"], case["job_id"], case["rank"], bytes.fromhex(case["nonce_s"]),
            bytes.fromhex(case["nonce_c"]))
    assert C.auth_tag(*args, "client", *rest).hex() == case["client"]
    assert C.auth_tag(*args, "server", *rest).hex() == case["server"]
    # and the C++ tag is the Python one for inputs no vector holds
    ns, nc = os.urandom(32), os.urandom(32)
    for role in ("client", "server"):
        assert C.auth_tag(b"x" * 100, role, "coord", "j_9", 12345, ns, nc) == \
            auth.tag(b"x" * 100, role, "coord", "j_9", 12345, ns, nc)


def _connect(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.settimeout(5)
    return s


def _refused(port, listener, job_id, rank, secret):
    """True when the listener refuses the handshake (closes without its proof)."""
    with _connect(port) as s:
        try:
            auth.client_handshake(s, secret, listener, job_id, rank, timeout_s=5)
            return False
        except auth.AuthError:
            return True


def _listeners(secret=SECRET, job=f"jnatsec{os.getpid()}"):
    """One native listener of each kind, bound to loopback: (name, port, job id, closer)."""
    odc = C.OdcRuntime(0, 2, job, [64, 1000], 10.0, "127.0.0.1", 0, secret)
    group = C.LockstepGroup(0, 2, f"/jaxodc_{job}_lockstep_t", [(0, 8, "c", 0)], 10.0, "127.0.0.1", secret, job)
    from jaxodc.comm.ring import RingEndpoint
    ring = RingEndpoint(secret=secret, group_id="group0", timeout_s=10)
    return [("odc_tcp", odc.port, job, lambda: odc.close(False)),
            ("lockstep_tcp", group.port, job, group.close),
            ("ring", int(ring.address.rsplit(":", 1)[1]), "group0", ring.close)], ring


def test_every_native_listener_refuses_a_wrong_secret_and_admits_the_right_one():
    listeners, ring = _listeners()
    try:
        for name, port, job, _ in listeners:
            assert _refused(port, name, job, 1, b"wrong"), name
            assert _refused(port, name, job, 1, b""), name
            assert _refused(port, name, "another_job", 1, SECRET), name
            other = "coord" if name != "coord" else "ring"
            assert _refused(port, other, job, 1, SECRET), name  # a transcript for another listener
            if name != "ring":  # a world of 2: rank 2 does not exist
                assert _refused(port, name, job, 2, SECRET), name
            assert not _refused(port, name, job, 1, SECRET), name
        assert ring.stats()["auth_rejected"] == 4
    finally:
        for *_, close in listeners:
            close()


def test_an_empty_secret_only_on_loopback():
    with pytest.raises(RuntimeError, match="without a job secret"):
        C.OdcRuntime(0, 2, f"jnatsec_open{os.getpid()}", [8], 5.0, "0.0.0.0", 0, b"")
    # the refused runtime's shared-memory segment went with it
    assert not os.path.exists(f"/dev/shm/jaxodc_jnatsec_open{os.getpid()}_0")
    with pytest.raises(RuntimeError, match="without a job secret"):
        C.LockstepGroup(0, 2, f"/jaxodc_jnatsec_open{os.getpid()}_l", [(0, 8, "c", 0)], 5.0, "0.0.0.0", b"", "j")
    from jaxodc.comm.ring import RingEndpoint
    with pytest.raises(ValueError, match="without a job secret"):
        RingEndpoint(host="0.0.0.0")
    for ep in (RingEndpoint(host="0.0.0.0", secret=b"k"), RingEndpoint()):  # with a secret, or on loopback
        ep.close()


def test_idle_and_truncated_connections_do_not_delay_close():
    listeners, _ = _listeners()
    held = []
    try:
        for name, port, job, _ in listeners:
            held.append(_connect(port))                 # idle: never answers the challenge
            s = _connect(port)
            s.recv(36)
            s.sendall(b"\0" * 20)                       # a truncated handshake reply
            held.append(s)
            s = _connect(port)                          # authenticated, then a truncated frame
            auth.client_handshake(s, SECRET, name, job, 1, timeout_s=5)
            s.sendall(b"\1" * 11)
            held.append(s)
        time.sleep(0.3)
        t0 = time.monotonic()
        for *_, close in listeners:
            close()
        assert time.monotonic() - t0 < 3.0
        for s in held:  # every connection was ended by the listener
            s.settimeout(5)
            while s.recv(4096):
                pass
    finally:
        for s in held:
            s.close()


# -- an authenticated rank that breaks the protocol: refused, named, nothing corrupted ------------

def _fake_rank1(rt, frames, payload=b""):
    """Connects to my own ODC server as rank 1 with the job secret, says hello and sends frames."""
    s = _connect(rt._native.port)
    auth.client_handshake(s, SECRET, "odc_tcp", rt.job_id, 1, timeout_s=5)
    s.sendall(WIRE.pack(HELLO, 1, 0, 0, 0, 2, rt._native.layout_hash, 0, 0, 0, 0, 0, time.monotonic()))
    assert WIRE.unpack(s.recv(WIRE.size))[3] == 0  # hello accepted
    for f in frames:
        s.sendall(f)
    s.sendall(payload)
    s.settimeout(15)
    try:
        while s.recv(4096):  # the server ends the connection
            pass
    except ConnectionError:
        pass
    s.close()
    time.sleep(0.5)  # the owner's daemon drains what was accepted


def hostile_body(ctx, attack):
    from jaxodc.odc import Runtime
    sizes = [64, 1000]
    rt = Runtime.create(sizes, ctx, transport="tcp", timeout_s=20)
    grads = [np.full(n, ctx.rank + 1.0, np.float32) for n in sizes]
    if ctx.rank == 0:
        offset, version = {"wrap": ((1 << 63) - 2, 0), "version": (0, 10 ** 9), "negative": (0, -5)}[attack]
        count = 4
        push = WIRE.pack(PUSH, 1, 0, 0, version, count, offset, 0, 0, 0, 0, 0, time.monotonic())
        _fake_rank1(rt, [push], np.array([1000, 2000, 3000, 4000], np.float32).tobytes()
                    + WIRE.pack(BYE, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
    for u, g in enumerate(grads):
        rt.scatter_accumulate(u, 0, g)
    rt.done(0)
    try:
        rt.wait_complete(0)
        out = ("ok", [rt.fetch_grad(u).tolist() for u in range(len(sizes))])
    except Exception as e:  # noqa: BLE001 - the error is the result
        out = ("error", str(e))
    rt.close()
    return out


@pytest.mark.parametrize("attack", ["wrap", "version", "negative"])
def test_malformed_pushes_are_refused_naming_the_rank(attack):
    r0, r1 = run_ranks(hostile_body, 2, args=(attack,), timeout_s=90, env={auth.SECRET_ENV: SECRET.hex()})
    assert r0[0] == "error" and "rank 1" in r0[1], r0
    expect = {"wrap": "malformed push", "version": "version 1000000000", "negative": "negative version"}[attack]
    assert expect in r0[1], r0
    # rank 1's shards were untouched by the attack on rank 0: both ranks' pushes summed exactly
    assert r1[0] == "ok", r1
    for piece in r1[1]:
        assert piece == [3.0] * len(piece)
