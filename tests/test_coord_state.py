"""The coordination state machine driven directly, without sockets: every message it sends is
checked. Peers are named a, b, c... (ids 1, 2, 3... in registration order)."""
import numpy as np

from jaxodc.coord.state import CoordState, Send, SolveRing


def reply(rid, **fields):
    return {"t": "reply", "rid": rid, **fields}


def error(rid, kind, reason):
    return reply(rid, ok=False, kind=kind, reason=reason)


def name(pid):
    return f"peer {pid} (ring-{'abcdef'[pid - 1]}, group 0)"


def register(s, n):
    return [s.register(0, f"ring-{c}", f"ss-{c}") for c in "abcdef"[:n]]


def formed_group(n):
    """n accepted peers on one ring (epoch 1 for n = 1, else 2); operation ids 1 and 2 used."""
    s = CoordState()
    pids = register(s, n)
    for p in pids:  # the first bootstraps the group, the others are parked
        s.receive(p, {"t": "topo", "rid": 100}, 0.0)
    s.receive(pids[0], {"t": "topo_done", "rid": 101, "op": 1, "ok": True}, 0.0)
    if n > 1:
        s.receive(pids[0], {"t": "topo", "rid": 102, "accept_new": True}, 0.0)
        for p in pids:
            s.receive(p, {"t": "topo_done", "rid": 103, "op": 2, "ok": True}, 0.0)
    g = s.snapshot()["groups"][0]
    assert g["accepted"] == pids and g["ring"] == pids and not g["stale"]
    return s, pids


def test_admission_vote_accepted_peers_vote_a_newcomer_in():
    s = CoordState()
    a, b = register(s, 2)
    # alone, a bootstraps the group: accepted at once on a ring of one
    assert s.receive(a, {"t": "topo", "rid": 1}, 0.0) == [
        Send(a, reply(1, ok=True, changed=True, op=1, epoch=1, ring=["ring-a"], rank=0))]
    assert s.receive(a, {"t": "topo_done", "rid": 2, "op": 1, "ok": True}, 0.0) == [
        Send(a, reply(2, ok=True, epoch=1))]
    # b is only registered: it may not run collectives, and its update_topology is parked
    assert s.receive(b, {"t": "open", "rid": 1, "tag": 0, "epoch": 1}, 0.0) == [
        Send(b, error(1, "not_accepted", f"{name(b)} is registered but not accepted: call update_topology first"))]
    assert s.receive(b, {"t": "topo", "rid": 2}, 0.0) == []
    assert s.receive(a, {"t": "pending", "rid": 3}, 0.0) == [Send(a, reply(3, ok=True, pending=True))]
    # a votes no: the ring stays as it is and b stays parked
    assert s.receive(a, {"t": "topo", "rid": 4, "accept_new": False}, 0.0) == [
        Send(a, reply(4, ok=True, changed=False, epoch=1, ring=["ring-a"], rank=0))]
    assert s.snapshot()["groups"][0]["waiting"] == [b]
    # a votes yes: b is accepted, and both get the new ring at epoch 2
    ring = ["ring-a", "ring-b"]
    assert s.receive(a, {"t": "topo", "rid": 5, "accept_new": True}, 0.0) == [
        Send(a, reply(5, ok=True, changed=True, op=3, epoch=2, ring=ring, rank=0)),
        Send(b, reply(2, ok=True, changed=True, op=3, epoch=2, ring=ring, rank=1))]
    # the update closes once every ring member connected
    assert s.receive(b, {"t": "topo_done", "rid": 3, "op": 3, "ok": True}, 0.0) == []
    assert s.receive(a, {"t": "topo_done", "rid": 6, "op": 3, "ok": True}, 0.0) == [
        Send(b, reply(3, ok=True, epoch=2)), Send(a, reply(6, ok=True, epoch=2))]
    g = s.snapshot()["groups"][0]
    assert g["accepted"] == [a, b] and g["stale"] is False and g["epoch"] == 2
    assert s.snapshot()["counters"]["accepted"] == 2


def test_a_joiner_never_founds_an_empty_group():
    """found=False (a site joining a running job): parked even in an empty group; the first peer
    that may found the group bootstraps it with every waiting peer, joiners included."""
    s = CoordState()
    a, b = register(s, 2)
    assert s.receive(b, {"t": "topo", "rid": 1, "found": False}, 0.0) == []
    assert s.snapshot()["groups"][0]["accepted"] == [] and s.snapshot()["groups"][0]["waiting"] == [b]
    ring = ["ring-a", "ring-b"]
    assert s.receive(a, {"t": "topo", "rid": 2}, 0.0) == [
        Send(a, reply(2, ok=True, changed=True, op=1, epoch=1, ring=ring, rank=0)),
        Send(b, reply(1, ok=True, changed=True, op=1, epoch=1, ring=ring, rank=1))]
    assert s.snapshot()["groups"][0]["accepted"] == [a, b]


def test_collective_opened_and_closed_by_unanimous_consensus():
    s, (a, b) = formed_group(2)
    assert s.receive(a, {"t": "open", "rid": 1, "tag": 1, "epoch": 2}, 0.0) == []
    assert s.receive(b, {"t": "open", "rid": 1, "tag": 1, "epoch": 2}, 0.0) == [
        Send(a, reply(1, ok=True, op=3, world=2)), Send(b, reply(1, ok=True, op=3, world=2))]
    # no major operation beside a collective; no second open of the same tag
    assert s.receive(a, {"t": "sync", "rid": 2, "revision": 1, "hashes": {}, "strategy": "enforce_popular"},
                     0.0) == [Send(a, error(2, "busy", "group 0: sync requested while collectives [1] are in flight"))]
    assert s.receive(a, {"t": "open", "rid": 3, "tag": 1, "epoch": 2}, 0.0) == [
        Send(a, error(3, "busy", f"collective tag 1 already in flight for {name(a)}"))]
    # it closes when both closed
    assert s.receive(a, {"t": "close", "rid": 4, "tag": 1, "op": 3, "ok": True}, 0.0) == []
    assert s.receive(b, {"t": "close", "rid": 2, "tag": 1, "op": 3, "ok": True}, 0.0) == [
        Send(a, reply(4, ok=True)), Send(b, reply(2, ok=True))]
    assert s.receive(a, {"t": "close", "rid": 5, "tag": 1, "op": 3, "ok": True}, 0.0) == [
        Send(a, error(5, "aborted", "already closed"))]
    # a stale epoch is refused
    assert s.receive(a, {"t": "open", "rid": 6, "tag": 2, "epoch": 1}, 0.0) == [
        Send(a, error(6, "stale", f"{name(a)} is on ring epoch 1, group 0 on 2; call update_topology"))]


def test_peer_death_mid_collective_aborts_it_everywhere():
    s, (a, b, c) = formed_group(3)
    for p in (a, b, c):
        s.receive(p, {"t": "open", "rid": 1, "tag": 7, "epoch": 2}, 0.0)
    assert s.receive(a, {"t": "close", "rid": 2, "tag": 7, "op": 3, "ok": True}, 0.0) == []
    why = f"{name(c)} failed: connection closed"
    abort = {"t": "abort", "tags": [7], "reason": why}
    # a's close is refused (its result must not be kept) and every survivor gets the abort
    assert s.disconnect(c, "connection closed", 1.0) == [
        Send(a, error(2, "aborted", why)), Send(a, abort), Send(b, abort)]
    assert s.disconnect(c, "connection closed", 1.0) == []  # reported once
    assert s.receive(b, {"t": "close", "rid": 2, "tag": 7, "op": 3, "ok": True}, 1.0) == [
        Send(b, error(2, "aborted", why))]
    stale = "group 0: ring is stale (a peer left or a collective was aborted); call update_topology"
    assert s.receive(a, {"t": "open", "rid": 3, "tag": 8, "epoch": 2}, 1.0) == [Send(a, error(3, "stale", stale))]
    # the survivors re-form a ring of two at a new epoch
    assert s.receive(a, {"t": "topo", "rid": 4, "accept_new": False}, 1.0) == []
    ring = ["ring-a", "ring-b"]
    assert s.receive(b, {"t": "topo", "rid": 3, "accept_new": False}, 1.0) == [
        Send(a, reply(4, ok=True, changed=True, op=4, epoch=3, ring=ring, rank=0)),
        Send(b, reply(3, ok=True, changed=True, op=4, epoch=3, ring=ring, rank=1))]
    assert s.snapshot()["counters"]["aborts"] == 1


def test_peer_death_while_the_ring_connects_fails_the_update_everywhere():
    s, (a, b, c) = formed_group(3)
    d = s.register(0, "ring-d", "ss-d")
    s.receive(d, {"t": "topo", "rid": 1}, 0.0)
    for p in (a, b, c):
        s.receive(p, {"t": "topo", "rid": 1, "accept_new": True}, 0.0)
    assert s.receive(a, {"t": "topo_done", "rid": 2, "op": 3, "ok": True}, 0.0) == []
    why = f"{name(b)} failed: no heartbeat"
    abort = {"t": "abort", "tags": [], "reason": why}
    assert s.disconnect(b, "no heartbeat", 1.0) == [
        Send(a, error(2, "aborted", why)), Send(a, abort), Send(c, abort), Send(d, abort)]
    g = s.snapshot()["groups"][0]
    assert g["accepted"] == [a, c, d] and g["stale"] is True  # d stays admitted


def test_shared_state_sync_round():
    s, (a, b, c) = formed_group(3)
    both = {"x": 1, "y": 2}
    assert s.receive(a, {"t": "sync", "rid": 1, "revision": 1, "hashes": both, "strategy": "enforce_popular"},
                     0.0) == []
    assert s.receive(b, {"t": "sync", "rid": 1, "revision": 1, "hashes": both, "strategy": "enforce_popular"},
                     0.0) == []
    # c is behind and holds a different y and an extra key z: it fetches y, spread over a and b
    out = s.receive(c, {"t": "sync", "rid": 1, "revision": 0, "hashes": {"x": 1, "y": 9, "z": 5},
                        "strategy": "enforce_popular"}, 0.0)
    common = dict(ok=True, op=3, revision=1, rejected=None, popular=[("x", 1), ("y", 2)], adopt=True)
    assert out == [Send(a, reply(1, expected={}, fetch={}, extra=[], **common)),
                   Send(b, reply(1, expected={}, fetch={}, extra=[], **common)),
                   Send(c, reply(1, expected={"y": 2}, fetch={"y": ["ss-a", "ss-b"]}, extra=["z"], **common))]
    # the round closes once every participant fetched what it lacked
    assert s.receive(a, {"t": "sync_done", "rid": 2, "op": 3, "ok": True}, 0.0) == []
    assert s.receive(c, {"t": "sync_done", "rid": 2, "op": 3, "ok": True}, 0.0) == []
    assert s.receive(b, {"t": "sync_done", "rid": 2, "op": 3, "ok": True}, 0.0) == [
        Send(a, reply(2, ok=True, revision=1)), Send(c, reply(2, ok=True, revision=1)),
        Send(b, reply(2, ok=True, revision=1))]
    assert s.snapshot()["groups"][0]["revision"] == 1
    # next round: a skips a revision, so its state does not count
    s.receive(a, {"t": "sync", "rid": 3, "revision": 3, "hashes": {"x": 7}, "strategy": "enforce_popular"}, 0.0)
    s.receive(b, {"t": "sync", "rid": 3, "revision": 2, "hashes": both, "strategy": "enforce_popular"}, 0.0)
    out = s.receive(c, {"t": "sync", "rid": 3, "revision": 2, "hashes": both, "strategy": "send_only"}, 0.0)
    skip = ("revision 3 skips ahead: group 0 last synced revision 1, expected 2 (a sync must be exactly "
            "one revision ahead)")
    common = dict(ok=True, op=4, revision=2, popular=[("x", 1), ("y", 2)])
    assert out == [Send(a, reply(3, expected={"x": 1, "y": 2}, fetch={"x": ["ss-b", "ss-c"], "y": ["ss-c", "ss-b"]},
                                 extra=[], rejected=skip, adopt=True, **common)),
                   Send(b, reply(3, expected={}, fetch={}, extra=[], rejected=None, adopt=True, **common)),
                   Send(c, reply(3, expected={}, fetch={}, extra=[], rejected=None, adopt=False, **common))]
    assert s.snapshot()["counters"]["rejected_revisions"] == 1
    # a failed fetch fails the round for everyone
    assert s.receive(a, {"t": "sync_done", "rid": 4, "op": 4, "ok": False, "reason": "reset"}, 0.0) == [
        Send(a, error(4, "aborted", "sync failed"))]
    assert s.receive(b, {"t": "sync_done", "rid": 4, "op": 4, "ok": True}, 0.0) == [
        Send(b, error(4, "aborted", "shared-state sync 4 is not running"))]


def test_optimize_measures_each_link_then_solves():
    s, (a, b) = formed_group(2)
    assert s.receive(a, {"t": "optimize", "rid": 1, "nbytes": 1000}, 0.0) == []
    assert s.receive(b, {"t": "optimize", "rid": 1, "nbytes": 2000}, 0.0) == [  # the largest request wins
        Send(a, {"t": "measure", "mid": 4, "peer": "ring-b", "nbytes": 2000})]
    assert s.receive(a, {"t": "measured", "mid": 4, "ok": True, "bw": 10.0}, 1.0) == [
        Send(b, {"t": "measure", "mid": 5, "peer": "ring-a", "nbytes": 2000})]
    assert s.receive(a, {"t": "measured", "mid": 5, "ok": True, "bw": 1.0}, 1.0) == []  # not a's probe
    [solve] = s.receive(b, {"t": "measured", "mid": 5, "ok": True, "bw": 20.0}, 2.0)
    assert isinstance(solve, SolveRing) and (solve.group, solve.op) == (0, 3)
    np.testing.assert_array_equal(solve.bandwidth, [[0, 10], [20, 0]])
    result = dict(ok=True, improved=False, ring=["ring-a", "ring-b"], bottleneck=0.1, previous_bottleneck=0.1,
                  peers=["ring-a", "ring-b"], bandwidth=[[0.0, 10.0], [20.0, 0.0]])
    assert s.ring_solved(0, 3, [0, 1], (0.1, 0.15)) == [Send(a, reply(1, **result)), Send(b, reply(1, **result))]
    assert s.ring_solved(0, 3, [0, 1], (0.1, 0.15)) == []  # already answered


def test_overdue_bandwidth_probe_fails_optimize():
    s, (a, b) = formed_group(2)
    s.receive(a, {"t": "optimize", "rid": 1}, 0.0)
    s.receive(b, {"t": "optimize", "rid": 1}, 0.0)
    assert s.tick(59.0) == []
    why = f"topology optimisation failed: peer {a} did not report its bandwidth to peer {b} within 60.0 s"
    assert s.tick(61.0) == [Send(a, error(1, "aborted", why)), Send(b, error(1, "aborted", why))]
    assert s.receive(a, {"t": "measured", "mid": 4, "ok": True, "bw": 1.0}, 62.0) == []  # too late


def test_heartbeat_echo_and_malformed_frames():
    s, (a,) = formed_group(1)
    assert s.receive(a, {"t": "hb"}, 0.0) == [Send(a, {"t": "hb"})]
    assert s.receive(a, {"t": "no_such_op", "rid": 9}, 0.0) == [
        Send(a, error(9, "error", "unknown request type 'no_such_op'"))]
    assert s.receive(a, {"t": "open", "rid": 10}, 0.0) == []  # lacks tag and epoch: dropped
    assert s.receive(a, {"t": "sync", "rid": 11, "revision": 1, "hashes": {"x": -1},
                         "strategy": "enforce_popular"}, 0.0) == []
    assert s.receive(a, {"t": "sync", "rid": 12, "revision": 1, "hashes": {}, "strategy": "sideways"}, 0.0) == [
        Send(a, error(12, "error", "unknown shared-state strategy 'sideways'"))]
    assert s.snapshot()["counters"]["malformed_frames"] == 3
    assert s.receive(a, {"t": "pending", "rid": 13}, 0.0) == [Send(a, reply(13, ok=True, pending=False))]


def test_peer_leaving_mid_measurement_fails_optimize():
    s, (a, b, c) = formed_group(3)
    for p in (a, b, c):
        s.receive(p, {"t": "optimize", "rid": 1}, 0.0)
    why = f"topology optimisation failed: {name(c)} failed during a bandwidth measurement: connection closed"
    assert s.disconnect(c, "connection closed", 1.0) == [Send(a, error(1, "aborted", why)),
                                                          Send(b, error(1, "aborted", why))]
    assert s.receive(a, {"t": "measured", "mid": 4, "ok": True, "bw": 1.0}, 1.0) == []  # too late


def test_unoptimised_ring_follows_the_peers_hosts_not_their_registration_order():
    """The same members on the same hosts form the same ring whatever order they registered in, so
    a rerun of a job sums in the same order (bit-identical); peers of one host keep their order."""
    for order in ([3, 1, 2], [2, 3, 1], [1, 2, 3]):
        s = CoordState()
        addrs = {h: f"10.0.0.{h}:{7000 - h}" for h in order}
        pids = [s.register(0, addrs[h], f"ss-{h}") for h in order]
        s.register(0, "10.0.0.2:1", "ss-2b")  # registers last, on host 2's address with a lower port
        pids.append(len(pids) + 1)
        for p in pids:
            s.receive(p, {"t": "topo", "rid": 100}, 0.0)
        s.receive(pids[0], {"t": "topo_done", "rid": 101, "op": 1, "ok": True}, 0.0)
        out = s.receive(pids[0], {"t": "topo", "rid": 102, "accept_new": True}, 0.0)
        ring = [m.msg["ring"] for m in out if m.to == pids[0]][0]
        assert ring == ["10.0.0.1:6999", "10.0.0.2:6998", "10.0.0.2:1", "10.0.0.3:6997"], (order, ring)
