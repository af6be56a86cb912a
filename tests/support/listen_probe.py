"""Rank program for tests/test_cluster.py: `python tests/support/listen_probe.py TIMEOUT_S`, started
by `jaxodc launch` on each emulated host. The rank joins the job, builds an ODC runtime and a
lock-step group (their listeners take the launcher's defaults, nothing set by hand), moves one
gather and one all-gather through them, and prints one JSON line: its host, the address it
advertised and its transport to every rank."""
import itertools
import json
import socket
import sys

import numpy as np

from jaxodc.comm.lockstep import Channel, LockstepGroup
from jaxodc.launch.context import init_from_env, shutdown
from jaxodc.odc import Runtime

timeout = float(sys.argv[1])
ctx = init_from_env(timeout_s=timeout + 10)
rt = Runtime.create([8 * ctx.world], ctx, timeout_s=timeout, device=None)
lo, hi = rt.shard_range(0)
rt.publish(0, np.arange(lo, hi, dtype=np.float32), 0)
full = rt.gather(0, 0)
names = itertools.count()
group = LockstepGroup([Channel("gather", 2, "probe")], rank=ctx.rank, world=ctx.world, timeout_s=timeout,
                      allgather=lambda b: ctx.allgather(f"probe/{next(names)}", b))
rows = group.run(0, np.full(2, ctx.rank, np.float32))
print(json.dumps({"rank": ctx.rank, "host": socket.gethostname(), "addr": ctx.local_addr,
                  "odc": list(rt.transports), "lockstep": list(group.links),
                  "gather_ok": bool(np.array_equal(full, np.arange(8 * ctx.world, dtype=np.float32))),
                  "allgather": rows.tolist()}), flush=True)
group.close()
rt.close()
shutdown(ctx)
