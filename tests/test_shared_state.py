"""Shared state: per-key hashing, the peer-to-peer key server, and sync strategies/revisions."""
import logging
import socket

import ml_dtypes
import numpy as np
import pytest

from jaxodc import auth
from jaxodc.comm import shared_state as ss
from jaxodc.comm.hashing import hash_array
from jaxodc.coord import protocol as P
from jaxodc.coord.service import CoordinatorService

from comm_util import SECRET, close_all, make_group, run_threads


def test_combined_hash_is_order_independent_and_content_sensitive():
    a = {"x": np.arange(5, dtype=np.float32), "y": np.zeros((2, 3))}
    b = {"y": np.zeros((2, 3)), "x": np.arange(5, dtype=np.float32)}
    ha, hb = ss.state_hashes(a), ss.state_hashes(b)
    assert ha == hb and ss.combined_hash(ha) == ss.combined_hash(hb)
    assert ha["x"] == hash_array(a["x"])
    b["x"][4] = np.nextafter(np.float32(4), np.float32(5))   # one ulp
    assert ss.combined_hash(ss.state_hashes(b)) != ss.combined_hash(ha)
    assert ss.combined_hash({"x": 1, "y": 2}) != ss.combined_hash({"x": 2, "y": 1})  # keys matter


def test_key_server_serves_published_arrays_only_to_authenticated_peers(caplog):
    caplog.set_level(logging.WARNING)
    srv = ss.SharedStateServer("127.0.0.1", SECRET, job_id="group7")
    fetch = lambda keys, secret=SECRET, job="group7": ss.fetch_keys(srv.address, secret, 1, keys, 5.0, job, 3)  # noqa: E731
    try:
        state = {"f": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32),
                 "b": np.arange(6, dtype=np.float32).astype(ml_dtypes.bfloat16),
                 "i": np.arange(7, dtype=np.int64), "e": np.zeros((0, 3), np.float64)}
        with pytest.raises(ConnectionError, match="no shared state published"):
            fetch(["f"])
        srv.publish(1, state)
        got, n = fetch(["f", "b", "i", "e"])
        assert n == sum(a.nbytes for a in state.values())
        for k, a in state.items():
            assert got[k].dtype == a.dtype and got[k].shape == a.shape
            assert got[k].tobytes() == a.tobytes()
        with pytest.raises(ConnectionError, match="keys not held here"):
            fetch(["nope"])
        for secret, job in ((b"wrong", "group7"), (b"", "group7"), (SECRET, "group8")):
            with pytest.raises(auth.AuthError, match="refused by the server"):
                fetch(["f"], secret, job)
        host, port = P.parse_address(srv.address)
        with socket.create_connection((host, port), timeout=5) as s:   # garbage instead of auth
            assert P.recv_exact(s, 36)[:4] == auth.MAGIC
            s.sendall(b"\xff" * 68)
            assert s.recv(1) == b""
        with socket.create_connection((host, port), timeout=5) as s:   # authenticated, oversized frame
            auth.client_handshake(s, SECRET, "shared_state", "group7", 3)
            s.sendall(P.HEADER.pack(P.MAX_FRAME + 1))
            assert s.recv(1) == b""
        assert srv.refused == 5
        assert srv.retract() == n
        got, _ = fetch([])  # still alive after the garbage
        assert got == {}
    finally:
        srv.close()
    assert "wrong secret for claimed rank 3" in caplog.text
    assert f"exceeds the limit of {P.MAX_FRAME} bytes" in caplog.text


def test_key_server_needs_a_secret_off_loopback():
    with pytest.raises(auth.AuthError, match="shared-state server: refusing to listen on 0.0.0.0"):
        ss.SharedStateServer("0.0.0.0", b"")


@pytest.fixture
def group3():
    svc = CoordinatorService("127.0.0.1", 0, SECRET, heartbeat_timeout_s=5.0).start()
    comms = make_group(svc.address, 3)
    yield svc, comms
    close_all(comms)
    svc.stop()


def _state(seed):
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal(1000).astype(np.float32), "b": rng.standard_normal((10, 10)),
            "c": np.arange(50, dtype=np.int32)}


def test_enforce_popular_fetches_only_differing_keys(group3):
    svc, comms = group3
    states = [_state(0), _state(0), _state(0)]
    states[2]["b"][3, 3] += 1.0                     # one peer differs in one key
    orig_c = states[2]["c"]
    infos = run_threads([lambda c=c, s=s: c.sync_shared_state(s, 1) for c, s in zip(comms, states)])
    assert infos[2].keys_fetched == ["b"] and infos[2].bytes_received == states[0]["b"].nbytes
    assert infos[0].bytes_received == infos[1].bytes_received == 0
    assert sum(i.bytes_sent for i in infos) == states[0]["b"].nbytes
    assert len({i.hash for i in infos}) == 1 and all(i.revision == 1 for i in infos)
    assert all(np.array_equal(s["b"], states[0]["b"]) for s in states)
    assert states[2]["c"] is orig_c                 # untouched keys are not replaced
    # the next, correctly advanced, sync transfers nothing
    infos = run_threads([lambda c=c, s=s: c.sync_shared_state(s, 2) for c, s in zip(comms, states)])
    assert all(i.bytes_received == 0 and i.bytes_sent == 0 and i.keys_fetched == [] for i in infos)


def test_send_only_and_receive_only(group3):
    svc, comms = group3
    # two receive_only newcomer-like peers agree with each other but must never win popularity
    states = [_state(1), _state(2), _state(2)]
    infos = run_threads([lambda: comms[0].sync_shared_state(states[0], 1, "send_only"),
                         lambda: comms[1].sync_shared_state(states[1], 0, "receive_only"),
                         lambda: comms[2].sync_shared_state(states[2], 0, "receive_only")])
    ref = _state(1)
    for s in states:
        assert all(np.array_equal(s[k], ref[k]) for k in ref)
    # "c" is the same in every seed: only "a" and "b" travel, from the one send_only peer
    assert infos[1].keys_fetched == ["a", "b"] and infos[1].revision == 1
    assert infos[0].keys_fetched == [] and infos[0].bytes_sent == 2 * (ref["a"].nbytes + ref["b"].nbytes)
    # a send_only peer that differs from the popular state is not overwritten
    states[0]["a"][0] = 7.0
    infos = run_threads([lambda: comms[0].sync_shared_state(states[0], 2, "send_only"),
                         lambda: comms[1].sync_shared_state(states[1], 2),
                         lambda: comms[2].sync_shared_state(states[2], 2)])
    assert states[0]["a"][0] == 7.0 and states[1]["a"][0] != 7.0
    assert infos[0].hash != infos[1].hash == infos[2].hash


def test_revision_rules(group3, caplog):
    caplog.set_level(logging.INFO)
    svc, comms = group3
    states = [_state(3) for _ in comms]
    run_threads([lambda c=c, s=s: c.sync_shared_state(s, 10) for c, s in zip(comms, states)])
    assert svc.snapshot()["groups"][0]["revision"] == 10
    # peer 2 is behind (10 again, e.g. it missed a step) and has a different state: it is outdated
    states[2]["a"][:] = 0
    infos = run_threads([lambda: comms[0].sync_shared_state(states[0], 11),
                         lambda: comms[1].sync_shared_state(states[1], 11),
                         lambda: comms[2].sync_shared_state(states[2], 10)])
    assert infos[2].keys_fetched == ["a"] and infos[2].revision == 11 and infos[2].rejected is None
    # a majority that skips ahead does not win: only revision 12 is eligible
    states[1]["c"][:] = -1
    states[2]["c"][:] = -1
    infos = run_threads([lambda: comms[0].sync_shared_state(states[0], 12),
                         lambda: comms[1].sync_shared_state(states[1], 14),
                         lambda: comms[2].sync_shared_state(states[2], 14)])
    assert infos[0].rejected is None and all("revision 14 skips ahead" in i.rejected for i in infos[1:])
    assert all(np.array_equal(s["c"], np.arange(50, dtype=np.int32)) for s in states)
    assert all(i.revision == 12 for i in infos)
    assert svc.snapshot()["groups"][0]["revision"] == 12
    assert caplog.text.count("rejected shared-state revision from peer") == 2
    with pytest.raises(ValueError, match="strategy"):
        comms[0].sync_shared_state(states[0], 13, "bogus")
