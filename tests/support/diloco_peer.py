"""A DiLoCo peer process for the kill test (tests/test_diloco.py).

Usage: python tests/support/diloco_peer.py MASTER SECRET NPEERS MODE T H VICTIM_AT
Joins group 0, waits until NPEERS peers are accepted, trains T outer steps of H inner steps on the
toy problem of diloco_util (data by its rank at the start), printing one JSON line per outer step
(hash of θ_global and the outer state, world) and a final line with θ_global and the world of
every average.
VICTIM_AT >= 0 makes this peer the victim: its outgoing link gets 0.2 s latency per piece (so its
all-reduces last ~1 s), and it SIGKILLs itself inside outer step VICTIM_AT (sync: 0.25 s into the
all-reduce; async: right after starting it, while it overlaps the next inner steps)."""
import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, ".")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import optax  # noqa: E402

import diloco_util as U  # noqa: E402
from jaxodc.comm.communicator import Communicator  # noqa: E402
from jaxodc.optim.diloco import DiLoCo  # noqa: E402


def say(**kw):
    print(json.dumps({**kw, "clock": round(time.time(), 3)}), flush=True)


def main():
    master, secret, npeers, mode, T, H, victim_at = sys.argv[1:8]
    npeers, T, H, victim_at = int(npeers), int(T), int(H), int(victim_at)
    comm = Communicator(master, secret=secret.encode(), timeout_s=30, heartbeat_s=0.2, ring_timeout_s=5.0).connect()
    comm.update_topology()
    while comm.world_size < npeers:  # accepted peers keep admitting until all are in
        if comm.are_peers_pending():
            comm.update_topology()
        else:
            time.sleep(0.05)
    rank = comm.rank
    dl = DiLoCo(comm, U.ADAM, optax.sgd(0.7, momentum=0.9, nesterov=True), H, loss_fn=U.loss_fn,
                asynchronous=(mode == "async")).init(U.init_params())
    say(event="start", rank=rank, world=comm.world_size)
    for t in range(T):
        for i in range(H):
            dl.inner_step(U.batch(rank, t * H + i))
        if t == victim_at:
            for peer in comm.ring:
                if peer != comm.ep.address:
                    comm.ep.set_link(peer, None, 0.2)
            if mode == "sync":   # 0.25 s into the blocking all-reduce (it lasts >= 0.6 s)
                threading.Timer(0.25, os.kill, (os.getpid(), signal.SIGKILL)).start()
            else:                # right after starting it, before it can finish in the background
                start = dl.reducer.start

                def start_and_die(tree, start=start):
                    pending = start(tree)
                    time.sleep(0.05)
                    os.kill(os.getpid(), signal.SIGKILL)
                    return pending

                dl.reducer.start = start_and_die
        dl.outer_step()
        say(event="outer", t=t, rank=rank, world=comm.world_size, hash=dl.state_hash())
    dl.flush()
    say(event="done", rank=rank, worlds=dl.reducer.worlds, retries=dl.reducer.retries, ring=comm.ring,
        theta=U.flat(dl.global_params).tobytes().hex(), hash=dl.state_hash())
    comm.close()


if __name__ == "__main__":
    main()
