"""All-reduce benchmark: jaxodc's TCP ring against jax `psum` over gloo, on the same processes.

`jaxodc bench allreduce --json PATH [--sizes 1,16,64] [--ranks 2,4] [--reps 3]` spawns W processes
on 127.0.0.1 for each world size; every process runs both implementations. Records:
{"impl", "ranks", "bytes", "seconds", "gbps", "quantize", "concurrency", "link_cap_gbit", "cpu_seconds"}
where bytes is one peer's f32 contribution, seconds the per-op time of the slowest rank (best of two
batches of `reps` back-to-back ops after a barrier), cpu_seconds the most CPU time (user + system,
all threads) one rank spent per op in that batch, and
gbps = 8 * bytes / seconds / 1e9 (implementation-agnostic reduce throughput, as in the PCCL paper).
Under the emulated link cap, the quantised rows report the same f32 bytes, so gbps is the effective
throughput. One compute thread per rank so that ranks sharing few cores do not fight.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

from jaxodc.launch.context import free_port
from jaxodc.launch.launcher import rank_env_defaults, rank_pythonpath

MB = 1 << 20



# ------------------------------------------------------------------------------------------------
# worker (one per rank)

_MARK = "@@jaxodc-bench "


def _say(obj) -> None:
    print(_MARK + json.dumps(obj), flush=True)

def _worker(rank: int, world: int, coord_port: int) -> int:
    import jax
    import numpy as np
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{coord_port}", num_processes=world, process_id=rank)
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxodc.comm.ring import RingEndpoint

    plan = json.loads(sys.stdin.readline())
    ep = RingEndpoint(pool_size=max(plan["concurrency"]), secret=b"bench", timeout_s=120.0)
    _say({"address": ep.address})
    addrs = json.loads(sys.stdin.readline())["ring"]
    ep.connect_ring(addrs, rank, 1)
    nxt = addrs[(rank + 1) % world]
    barrier_buf = np.zeros(1, np.float32)

    def barrier():
        ep.all_reduce(barrier_buf, tag=999)

    def cpu_s():
        r = resource.getrusage(resource.RUSAGE_SELF)  # all threads of this rank
        return r.ru_utime + r.ru_stime

    def timed(fn, reps):
        # warm up (page faults, compilation), then `reps` back-to-back ops after one barrier,
        # twice; per-op time = batch time / reps, so barrier skew between ranks is amortised
        fn()
        times, cpus = [], []
        for _ in range(2):
            barrier()
            c0, t0 = cpu_s(), time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t0) / reps)
            cpus.append((cpu_s() - c0) / reps)
        return times, cpus

    def emit(impl, nbytes, tc, quantize=None, concurrency=1, cap=None, rnd=None):
        _say({"impl": impl, "bytes": nbytes, "times": tc[0], "cpus": tc[1], "quantize": quantize,
              "concurrency": concurrency, "link_cap_gbit": cap, "round": rnd})

    mesh = jax.make_mesh((world,), ("x",), devices=jax.devices())
    sharding = NamedSharding(mesh, P("x"))
    psum = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    for mb in plan["sizes"]:
        n = int(mb * MB) // 4
        x = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
        out = np.empty_like(x)
        for conc in plan["concurrency"]:
            if conc == 1:
                fn = lambda: ep.all_reduce(x, out=out)  # noqa: E731
            else:
                parts = np.array_split(np.arange(n), conc)

                def fn(parts=parts):
                    hs = [ep.all_reduce_async(x[p[0]:p[-1] + 1], tag=t, out=out[p[0]:p[-1] + 1])
                          for t, p in enumerate(parts)]
                    for h in hs:
                        h.wait()
            emit("jaxodc_ring", n * 4, timed(fn, plan["reps"]), concurrency=conc)
        if not plan["skip_gloo"]:
            g = jax.make_array_from_process_local_data(sharding, x)
            emit("jax_psum_gloo", n * 4, timed(lambda: psum(g).block_until_ready(), plan["reps"]))
            del g
    cap = plan["cap_gbit"]
    if cap:
        ep.set_link(nxt, cap * 1e9 / 8)
        n = int(plan["cap_size_mb"] * MB) // 4
        x = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
        out = np.empty_like(x)
        for rnd in range(plan["cap_rounds"]):  # modes interleaved, so load drifts hit all alike
            for q in (None, "uint16", "uint8"):
                emit("jaxodc_ring", n * 4, timed(lambda: ep.all_reduce(x, quantize=q, out=out), plan["reps"]),
                     quantize=q, cap=cap, rnd=rnd)
        ep.set_link(nxt, None)
    _say({"done": True})
    ep.close()
    jax.distributed.shutdown()
    return 0


# ------------------------------------------------------------------------------------------------
# driver

def _readline(p, timeout_s):
    """Next protocol line of a rank (other output, e.g. library logs, is passed through)."""
    deadline = time.monotonic() + timeout_s
    while True:
        box = []
        t = threading.Thread(target=lambda: box.append(p.stdout.readline()), daemon=True)
        t.start()
        t.join(max(0.0, deadline - time.monotonic()))
        if not box or not box[0]:
            raise RuntimeError(f"benchmark rank (pid {p.pid}) sent nothing for {timeout_s} s; exit code {p.poll()}")
        if box[0].startswith(_MARK):
            return json.loads(box[0][len(_MARK):])
        sys.stderr.write(box[0])


def run_world(world: int, plan: dict, timeout_s: float) -> list[dict]:
    env = {**os.environ, **rank_env_defaults(), "PYTHONPATH": rank_pythonpath()}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(r), str(world), str(port)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    try:
        for p in procs:
            p.stdin.write(json.dumps(plan) + "\n")
            p.stdin.flush()
        addrs = [_readline(p, timeout_s)["address"] for p in procs]
        for p in procs:
            p.stdin.write(json.dumps({"ring": addrs}) + "\n")
            p.stdin.flush()
        per_rank = [[] for _ in procs]
        for r, p in enumerate(procs):
            while True:
                rec = _readline(p, timeout_s)
                if rec.get("done"):
                    break
                per_rank[r].append(rec)
        rows = []
        for recs in zip(*per_rank):
            slowest = [max(ts) for ts in zip(*(rec["times"] for rec in recs))]
            best = min(range(len(slowest)), key=slowest.__getitem__)
            sec = slowest[best]
            r0 = recs[0]
            rows.append({"impl": r0["impl"], "ranks": world, "bytes": r0["bytes"], "seconds": sec,
                         "gbps": 8 * r0["bytes"] / sec / 1e9, "quantize": r0["quantize"],
                         "concurrency": r0["concurrency"], "link_cap_gbit": r0["link_cap_gbit"],
                         "cpu_seconds": max(rec["cpus"][best] for rec in recs)})
            if r0.get("round") is not None:
                rows[-1]["round"] = r0["round"]
        for p in procs:
            p.wait(timeout=60)
        return rows
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


def _table(rows):
    cols = ["impl", "ranks", "bytes", "quantize", "concurrency", "link_cap_gbit", "seconds", "gbps", "cpu_seconds"]
    cells = [[("" if r.get(c) is None else (f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]))) for c in cols]
             for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(x, widths)) for x in cells]
    return "\n".join(lines)


def summarize(rows) -> list[str]:
    out = []
    for w in sorted({r["ranks"] for r in rows}):
        ring = {r["bytes"]: r for r in rows if r["ranks"] == w and r["impl"] == "jaxodc_ring"
                and r["concurrency"] == 1 and r["link_cap_gbit"] is None}
        gloo = {r["bytes"]: r for r in rows if r["ranks"] == w and r["impl"] == "jax_psum_gloo"}
        for b in sorted(set(ring) & set(gloo)):
            out.append(f"ranks={w} {b / MB:g} MB: ring/gloo throughput = {ring[b]['gbps'] / gloo[b]['gbps']:.2f}x")
        capped = [r for r in rows if r["ranks"] == w and r["link_cap_gbit"]]
        rounds = sorted({r.get("round", 0) for r in capped})
        by = {(r.get("round", 0), r["quantize"]): r for r in capped}
        for q in ("uint8", "uint16"):
            ratios = [by[k, q]["gbps"] / by[k, None]["gbps"] for k in rounds if (k, q) in by and (k, None) in by]
            if ratios:
                out.append(f"ranks={w} under {capped[0]['link_cap_gbit']:g} Gbit/s cap: {q}/f32 effective throughput = "
                           f"{statistics.median(ratios):.2f}x (median of {len(ratios)} interleaved rounds: "
                           + ", ".join(f"{x:.2f}" for x in ratios) + ")")
    return out


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--worker":
        return _worker(int(argv[1]), int(argv[2]), int(argv[3]))
    ap = argparse.ArgumentParser(prog="jaxodc bench allreduce", description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write the records here")
    ap.add_argument("--sizes", default="1,16,64", help="comma-separated MB per peer (e.g. 1,16,64,256)")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--concurrency", default="1,2", help="concurrent ring ops splitting each buffer")
    ap.add_argument("--cap-gbit", type=float, default=1.0, help="emulated link cap for the quantised rows (0 = skip)")
    ap.add_argument("--cap-size-mb", type=float, default=16)
    ap.add_argument("--cap-rounds", type=int, default=3, help="interleaved f32/uint16/uint8 rounds under the cap")
    ap.add_argument("--skip-gloo", action="store_true")
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args(argv)
    plan = {"sizes": [float(s) for s in a.sizes.split(",") if s], "reps": a.reps,
            "concurrency": [int(c) for c in a.concurrency.split(",") if c], "cap_gbit": a.cap_gbit,
            "cap_size_mb": a.cap_size_mb, "cap_rounds": a.cap_rounds, "skip_gloo": a.skip_gloo}
    rows = []
    for w in [int(r) for r in a.ranks.split(",") if r]:
        rows += run_world(w, plan, a.timeout)
    print(_table(rows))
    for line in summarize(rows):
        print(line)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
