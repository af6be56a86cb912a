"""jaxodc-auth-v2 in Python: the shared test vectors, a loopback handshake, and every refusal."""
import json
import os
import socket
import threading

import pytest

from jaxodc import auth

VECTORS = json.load(open(os.path.join(os.path.dirname(__file__), "support", "auth_vectors.json")))["cases"]


@pytest.mark.parametrize("case", VECTORS, ids=lambda c: c["listener"])
def test_vectors(case):
    args = (bytes.fromhex(case["secret"]),)
    rest = (case["listener"], case["job_id"], case["rank"], bytes.fromhex(case["nonce_s"]),
            bytes.fromhex(case["nonce_c"]))
    assert auth.tag(*args, "client", *rest).hex() == case["client"]
    assert auth.tag(*args, "server", *rest).hex() == case["server"]


def _pair(server_kw, client_kw):
    a, b = socket.socketpair()
    out = {}

    def serve():
        try:
            out["rank"] = auth.server_handshake(a, **server_kw)
        except auth.AuthError as e:
            out["err"] = e
        finally:
            a.close()

    t = threading.Thread(target=serve)
    t.start()
    try:
        auth.client_handshake(b, **client_kw)
        client_err = None
    except auth.AuthError as e:
        client_err = e
    finally:
        b.close()
    t.join(5)
    return out, client_err


def test_handshake_ok():
    out, err = _pair(dict(secret=b"k", listener="odc_tcp", job_id="j1", world=4),
                     dict(secret=b"k", listener="odc_tcp", job_id="j1", rank=3))
    assert err is None and out == {"rank": 3}


@pytest.mark.parametrize("field,value", [("secret", b"wrong"), ("job_id", "j2"), ("listener", "ring"),
                                         ("rank", 4)])
def test_handshake_refused(field, value):
    client = dict(secret=b"k", listener="odc_tcp", job_id="j1", rank=1)
    client[field] = value
    out, err = _pair(dict(secret=b"k", listener="odc_tcp", job_id="j1", world=4, timeout_s=2),
                     dict(client, timeout_s=2))
    assert isinstance(out.get("err"), auth.AuthError) and "rank" not in out
    assert isinstance(err, auth.AuthError)


def test_silent_client_times_out():
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(auth.AuthError, match="timed out"):
            auth.server_handshake(a, b"k", "odc_tcp", "j1", 2, timeout_s=0.3)


def test_secret_sources(tmp_path):
    assert auth.secret_from_env({auth.SECRET_ENV: "00ff"}) == b"\x00\xff"
    f = tmp_path / "s"
    f.write_bytes(b"  abc\n")
    assert auth.secret_from_env({auth.SECRET_FILE_ENV: str(f)}) == b"abc"
    f.write_bytes(b"\n")
    with pytest.raises(auth.AuthError, match="empty"):
        auth.secret_from_env({auth.SECRET_FILE_ENV: str(f)})
    assert auth.secret_from_env({}) == b""
    auth.require_secret_for_bind(b"", "127.0.0.1", "x")
    with pytest.raises(auth.AuthError, match="every interface"):
        auth.require_secret_for_bind(b"", "", "x")
    with pytest.raises(auth.AuthError):
        auth.require_secret_for_bind(b"", "0.0.0.0", "x")


def test_refusals_bound_the_connections_and_count_every_refusal(caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="jaxodc.test.refusals")
    r = auth.Refusals("listener X", threading.Lock(), 2, logging.getLogger("jaxodc.test.refusals"))
    pairs = [socket.socketpair() for _ in range(4)]
    try:
        assert r.admit(pairs[0][0], ("127.0.0.1", 1)) and r.admit(pairs[1][0], ("127.0.0.1", 2))
        assert not r.admit(pairs[2][0], ("127.0.0.1", 3))  # over the limit: closed, counted
        assert pairs[2][0].fileno() == -1 and r.count == 1 and len(r.conns) == 2
        assert "listener X: refused 127.0.0.1:3: already 2 connections" in caplog.text
        r.release(pairs[0][0])
        assert not r.admit(pairs[3][0], ("127.0.0.1", 4), closing=lambda: True)  # closing: closed, not counted
        assert pairs[3][0].fileno() == -1 and r.count == 1 and len(r.conns) == 1
        r.refused(("127.0.0.1", 5), "wrong secret for claimed rank 1")
        r.dropped("rank 1 (127.0.0.1:2)", "frame length 9 exceeds the limit")
        assert r.count == 3
        assert "listener X: refused 127.0.0.1:5: wrong secret for claimed rank 1" in caplog.text
        assert "listener X: closing connection from rank 1 (127.0.0.1:2): frame length 9 exceeds" in caplog.text
    finally:
        for a, b in pairs:
            a.close()
            b.close()
