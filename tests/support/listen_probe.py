"""Rank program for tests/test_cluster.py, started by `jaxodc launch` on each emulated host:

    python tests/support/listen_probe.py TIMEOUT_S [cache|nocache]

The rank joins the job, builds an ODC runtime and a lock-step group (their listeners take the
launcher's defaults, nothing set by hand) and moves data through them: ODC gathers of two units
over three versions, each unit gathered 3 times per version as microbatches would, then once more
asking for a finished version after the next was published, and one lock-step all-gather. Prints one
JSON line: its host, the address it advertised, its transport to every rank, whether every gather
held the published values, and the gather bytes that crossed the network in versions 0 and 1
with the host gather cache on (`cache`, the default) or off."""
import itertools
import json
import socket
import sys

import numpy as np

from jaxodc.comm.lockstep import Channel, LockstepGroup
from jaxodc.launch.context import init_from_env, shutdown
from jaxodc.odc import Runtime

timeout = float(sys.argv[1])
cache = (sys.argv[2] if len(sys.argv) > 2 else "cache") == "cache"
ctx = init_from_env(timeout_s=timeout + 10)
sizes = [8 * ctx.world + 3, 40 * ctx.world]
rt = Runtime.create(sizes, ctx, timeout_s=timeout, device=None, host_cache=cache)


def values(unit: int, version: int) -> np.ndarray:
    return (np.arange(sizes[unit]) * (unit + 1) + 1000 * version).astype(np.float32)


ok = True
for v in range(3):
    for u in range(len(sizes)):
        lo, hi = rt.shard_range(u)
        shard = np.zeros(rt.shard_size(u), np.float32)
        shard[: hi - lo] = values(u, v)[lo:hi]
        rt.publish(u, shard, v)
    if v == 2:
        wire = rt.gather_wire_bytes  # versions 0 and 1
    for _ in range(3):
        for u in range(len(sizes)):
            ok &= bool(np.array_equal(rt.gather(u, v), values(u, v)))
    rt.done(v)
    rt.wait_complete(v)
# Version 3 published everywhere; a gather that asks for version 2, which this rank finished, gets
# the owners' current version 3 (a cache entry still holds version 2: it must not answer).
for u in range(len(sizes)):
    lo, hi = rt.shard_range(u)
    shard = np.zeros(rt.shard_size(u), np.float32)
    shard[: hi - lo] = values(u, 3)[lo:hi]
    rt.publish(u, shard, 3)
ctx.barrier("probe/published3")
for u in range(len(sizes)):
    ok &= bool(np.array_equal(rt.gather(u, 2), values(u, 3)))
names = itertools.count()
group = LockstepGroup([Channel("gather", 2, "probe")], rank=ctx.rank, world=ctx.world, timeout_s=timeout,
                      allgather=lambda b: ctx.allgather(f"probe/{next(names)}", b))
rows = group.run(0, np.full(2, ctx.rank, np.float32))
print(json.dumps({"rank": ctx.rank, "host": socket.gethostname(), "addr": ctx.local_addr,
                  "odc": list(rt.transports), "lockstep": list(group.links), "gather_ok": ok,
                  "host_cache": rt.host_cache, "host_cache_bytes": rt.host_cache_bytes,
                  "wire_bytes": wire, "remote_shard_bytes": rt.remote_shard_bytes(),
                  "cache_hits": rt.gather_cache_hits, "allgather": rows.tolist()}), flush=True)
group.close()
rt.close()
shutdown(ctx)
