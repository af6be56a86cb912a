"""A peer process for multi-process communicator tests (killed with SIGKILL by the tests).

Usage: python tests/comm_peer.py MASTER SECRET NAME NPEERS SIZE LINK_BPS
Joins group 0, waits until NPEERS peers are accepted, slows its outgoing links to LINK_BPS so an
all-reduce lasts long enough to be killed in the middle, then all-reduces x = full(SIZE, k+1)
where k is its index in the ring; prints JSON lines to stdout."""
import json
import sys
import time

import numpy as np

sys.path.insert(0, ".")
from jaxodc.comm.communicator import CollectiveAborted, Communicator  # noqa: E402


def say(**kw):
    print(json.dumps(kw), flush=True)


def main():
    master, secret, name, npeers, size, link = sys.argv[1:7]
    npeers, size, link = int(npeers), int(size), float(link)
    comm = Communicator(master, secret=secret.encode(), timeout_s=30, heartbeat_s=0.2).connect()
    comm.update_topology()
    while comm.world_size < npeers:  # the accepted peers keep admitting until all are in
        if comm.are_peers_pending():
            comm.update_topology()
        else:
            time.sleep(0.05)
    for peer in comm.ring:
        if peer != comm.ep.address:
            comm.ep.set_link(peer, link, 0.0)
    x = np.arange(size, dtype=np.float32) * 0 + (comm.rank + 1)
    x0 = x.copy()
    say(event="start", name=name, rank=comm.rank, world=comm.world_size, ring=comm.ring)
    try:
        comm.all_reduce(x, op="sum", tag=3, out=x)
        say(event="first_ok", name=name)
    except CollectiveAborted as e:
        say(event="aborted", name=name, restored=bool(np.array_equal(x, x0)), reason=str(e)[:300])
    for peer in comm.ring:
        comm.ep.set_link(peer, None, 0.0)
    t0 = time.monotonic()
    y = comm.run_with_retry(comm.all_reduce, x, op="sum", tag=3)
    say(event="retry_ok", name=name, world=comm.world_size, rank=comm.rank, ring=comm.ring,
        value=float(y[0]), all_equal=bool(np.all(y == y[0])), input=float(x[0]),
        seconds=time.monotonic() - t0)
    comm.close()


if __name__ == "__main__":
    main()
