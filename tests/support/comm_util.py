"""Helpers for communicator tests: peers in threads against an embedded service."""
import threading
import time

from jaxodc.comm.communicator import Communicator

SECRET = b"comm-test-secret"


def run_threads(fns, timeout=60.0):
    """Run callables in threads; return their results, re-raising the first exception."""
    results, errors = [None] * len(fns), [None] * len(fns)

    def wrap(i, f):
        try:
            results[i] = f()
        except BaseException as e:  # reported below with the peer index
            errors[i] = e

    ts = [threading.Thread(target=wrap, args=(i, f), daemon=True) for i, f in enumerate(fns)]
    for t in ts:
        t.start()
    end = time.monotonic() + timeout
    for i, t in enumerate(ts):
        t.join(max(0.0, end - time.monotonic()))
        if t.is_alive():
            raise TimeoutError(f"peer thread {i} still running after {timeout} s")
    for i, e in enumerate(errors):
        if e is not None:
            raise AssertionError(f"peer thread {i} failed: {type(e).__name__}: {e}") from e
    return results


def make_group(address, n, secret=SECRET, group=0, **kw):
    """Connect n communicators and admit them all into one ring (join order)."""
    comms = [Communicator(address, peer_group=group, secret=secret, timeout_s=30, heartbeat_s=0.2, **kw).connect()
             for _ in range(n)]
    comms[0].update_topology()
    def admit(c, size):  # the accepted peers' loop: vote whenever peers are pending
        while c.world_size < size:
            if c.are_peers_pending():
                c.update_topology()
            else:
                time.sleep(0.01)

    for k in range(1, n):
        run_threads([comms[k].update_topology] + [lambda c=c: admit(c, k + 1) for c in comms[:k]])
    assert [c.world_size for c in comms] == [n] * n
    assert [c.rank for c in comms] == list(range(n))
    return comms


def close_all(comms):
    for c in comms:
        c.close()
