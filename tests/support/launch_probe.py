"""Rank program for tests/test_launch.py: `_launch_probe.py MODE PIDDIR [args]`.

Every rank writes its pid (and a child's pid) to PIDDIR so the test can check nothing survives.
MODE env: print the launcher environment and the init_from_env context as one JSON line.
MODE fail: rank 1 prints last words and exits 3 (others sleep). MODE sigkill: rank 1 kills
itself with SIGKILL. MODE sleep: everyone sleeps. MODE shm: rank 1 creates a shared-memory file
named like the ODC runtime's, then exits 3. MODE hold: every rank joins the job (rank 0 listens
at the coordinator), creates a shared-memory file of the job, prints "ready" and sleeps.
MODE progress: rank 0 prints a line, three \\r-updates a second apart, then a line.
"""
import json
import os
import signal
import subprocess
import sys
import time

mode, piddir = sys.argv[1], sys.argv[2]
rank = int(os.environ["JAXODC_RANK"])
# A grandchild in the rank's process group: teardown must reach it too.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(os.path.join(piddir, f"{rank}.tmp"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}\n")
os.replace(os.path.join(piddir, f"{rank}.tmp"), os.path.join(piddir, f"{rank}.pid"))

if mode == "env":
    from jaxodc.launch.context import init_from_env, shutdown

    ctx = init_from_env(timeout_s=20)
    ranks = [int(b) for b in ctx.rendezvous.allgather("ranks", str(ctx.rank).encode(), ctx.world)]
    keys = ["JAXODC_RANK", "JAXODC_WORLD_SIZE", "JAXODC_LOCAL_RANK", "JAXODC_LOCAL_WORLD_SIZE",
            "JAXODC_COORDINATOR", "JAXODC_JAX_COORDINATOR", "JAXODC_JOB_ID", "RANK", "WORLD_SIZE",
            "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "JAXODC_JOB_SECRET", "JAXODC_SECRET_FILE"]
    print(json.dumps({"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[3:],
                      "ctx": [ctx.rank, ctx.world, ctx.local_rank, ctx.local_world, ctx.job_id,
                              ctx.coordinator, ctx.server is not None],
                      "gathered": ranks}))
    shutdown(ctx)
    child.kill()
    child.wait()
    sys.exit(0)

if mode == "hold":
    from jaxodc.launch.context import init_from_env

    ctx = init_from_env(timeout_s=20)
    with open(f"/dev/shm/jaxodc_{ctx.job_id}_probe{rank}", "wb") as f:
        f.write(b"x" * 64)
    print("ready", flush=True)
    time.sleep(120)
if mode == "progress":
    if rank == 0:
        print("plain line", flush=True)
        for i in range(3):  # as jaxodc.train.metrics.Progress draws its bar
            print(f"\rstep {i}", end="", flush=True)
            time.sleep(1.0)
        print("\nfinished", flush=True)
    child.kill()
    sys.exit(0)

print(f"rank {rank} started", flush=True)
if rank == 1 and mode in ("fail", "sigkill", "shm"):
    # Fail only once every rank has recorded its pids, so the test knows whom to look for.
    world = int(os.environ["JAXODC_WORLD_SIZE"])
    deadline = time.monotonic() + 30
    while len([n for n in os.listdir(piddir) if n.endswith(".pid")]) < world:
        if time.monotonic() > deadline:
            sys.exit("probe: the other ranks never wrote their pid files")
        time.sleep(0.02)
if rank == 1 and mode == "fail":
    print("last words of rank 1", file=sys.stderr, flush=True)
    sys.exit(3)
if rank == 1 and mode == "sigkill":
    print("rank 1 about to die", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
if rank == 1 and mode == "shm":
    with open(f"/dev/shm/jaxodc_{os.environ['JAXODC_JOB_ID']}_unit0", "wb") as f:
        f.write(b"x" * 64)
    sys.exit(3)
time.sleep(120)
