"""`jaxodc bench load`: loading a generated Hugging Face checkpoint (Llama-style, >= --gb GB, in
--dtype) into fp32 master shards at W = 1, 2, 4 real rank processes, each rank reading only the
ranges it owns (jaxodc.modeling.hf_load). One record per W:
{"ranks", "checkpoint_bytes", "master_bytes", "peak_rss", "load_s", "baseline_s"} (+ each
rank's peak and the bars). `peak_rss`: the largest rank's resident peak while it loads (VmHWM
reset just before; the process's imports included); `load_s`: from the first rank's start to
the last rank's end (the ranks start together); `baseline_s`: one process reading every file
once with the safetensors library (`safetensors.numpy.load_file`), the physical limit here.
Bars: peak_rss <= 1.25 * master_bytes / W + 300 MiB; load_s <= 1.5 * baseline_s. Each rank
reads with its share of the cores (hf_load.load_threads: `threads`); `rank_cpu_s` and
`baseline_cpu_s` are CPU seconds (user + system), the work itself where the machine is shared.

    python -m jaxodc bench load --json load.json            # the issue's run (>= 1 GB)
    python -m jaxodc bench load --gb 0.05 --ranks 1,2       # a smoke run
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

MiB = 1 << 20


def checkpoint_config(gb: float, dtype: str) -> dict:
    """A Llama-3-style config (GQA, llama3 rope scaling, untied head) with enough layers for
    `gb` GB of tensors in `dtype`."""
    from jaxodc.modeling.synthetic import tiny_config
    item = 4 if dtype == "float32" else 2
    h, ffn, vocab, heads, kv = 2048, 5632, 32000, 16, 4
    per_layer = (2 * h * h + 2 * h * h * kv // heads + 3 * h * ffn + 2 * h) * item
    rest = (2 * vocab * h + h) * item
    layers = max(1, math.ceil((gb * 1e9 - rest) / per_layer))
    if gb < 0.5:  # smoke runs: a smaller width
        h, ffn, vocab = 512, 1408, 8000
        per_layer = (2 * h * h + 2 * h * h * kv // heads + 3 * h * ffn + 2 * h) * item
        layers = max(1, math.ceil((gb * 1e9 - (2 * vocab * h + h) * item) / per_layer))
    return tiny_config("llama", vocab=vocab, hidden=h, layers=layers, heads=heads, kv_heads=kv, ffn=ffn,
                       llama3_scaling=True, dtype=dtype)


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def rank_main(a) -> int:
    """One rank: set up (headers, layout), signal ready, wait for go, load its shards, report."""
    from jaxodc.modeling.hf_load import load_hf, load_threads
    from jaxodc.modeling.discover import discover_units
    ck = load_hf(a.dir)
    layout = discover_units(ck.abstract_params(), a.world).layout  # the trainers' default units
    open(os.path.join(a.sync, f"ready{a.rank}"), "w").close()
    go = os.path.join(a.sync, "go")
    deadline = time.time() + 600
    while not os.path.exists(go):
        if time.time() > deadline:
            raise TimeoutError(f"rank {a.rank}: no start signal {go} within 600 s")
        time.sleep(0.002)
    with open("/proc/self/clear_refs", "w") as f:  # "5": VmHWM restarts from the current RSS
        f.write("5")
    rss0 = _status_bytes("VmRSS")
    c0, t0 = os.times(), time.time()
    shards = ck.read_shards(layout, a.rank)
    t1, c1 = time.time(), os.times()
    out = {"rank": a.rank, "t0": t0, "t1": t1, "peak_rss": _status_bytes("VmHWM"), "rss_before": rss0,
           "threads": load_threads(), "cpu_s": c1.user + c1.system - c0.user - c0.system,
           "shard_bytes": int(sum(s.nbytes for s in shards.values())),
           "master_bytes": int(sum(u.padded for u in layout.units)) * 4}
    with open(os.path.join(a.sync, f"rank{a.rank}.json"), "w") as f:
        json.dump(out, f)
    return 0


def baseline(directory: str) -> tuple[float, float]:
    """Seconds (wall, CPU) for one process to read every safetensors file of `directory` with
    safetensors."""
    code = ("import glob, os, sys, time, ml_dtypes, safetensors.numpy as s  # ml_dtypes: numpy's bfloat16\n"
            "c, t = os.times(), time.perf_counter()\n"
            "for p in sorted(glob.glob(sys.argv[1] + '/*.safetensors')):\n"
            "    d = s.load_file(p); sum(x.nbytes for x in d.values()); del d\n"
            "e = os.times()\n"
            "print(time.perf_counter() - t, e.user + e.system - c.user - c.system)\n")
    r = subprocess.run([sys.executable, "-c", code, directory], capture_output=True, text=True, timeout=1200)
    if r.returncode:
        raise RuntimeError(f"baseline read failed: {r.stderr[-2000:]}")
    wall, cpu = (float(x) for x in r.stdout.split()[-2:])
    return wall, cpu


def run_world(directory: str, world: int, timeout_s: float) -> list[dict]:
    sync = tempfile.mkdtemp(prefix="jaxodc_load_")
    # JAXODC_LOCAL_WORLD_SIZE as the launcher sets it: a rank reads with its share of the cores
    env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false",
           "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu", "JAXODC_LOCAL_WORLD_SIZE": str(world)}
    procs = [subprocess.Popen([sys.executable, "-m", "jaxodc.bench.load", "--rank-worker", "--dir", directory,
                               "--world", str(world), "--rank", str(r), "--sync", sync], env=env)
             for r in range(world)]
    try:
        deadline = time.time() + timeout_s
        while not all(os.path.exists(os.path.join(sync, f"ready{r}")) for r in range(world)):
            if time.time() > deadline or any(p.poll() not in (None, 0) for p in procs):
                raise RuntimeError(f"W={world}: ranks did not get ready (exit codes {[p.poll() for p in procs]})")
            time.sleep(0.01)
        open(os.path.join(sync, "go"), "w").close()
        for r, p in enumerate(procs):
            if p.wait(timeout=max(1.0, deadline - time.time())):
                raise RuntimeError(f"W={world}: rank {r} exited with {p.returncode}")
        return [json.load(open(os.path.join(sync, f"rank{r}.json"))) for r in range(world)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(sync, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxodc bench load", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--gb", type=float, default=1.0, help="checkpoint size to generate (GB, >= 1 for the bars)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--dir", help="where to generate the checkpoint (default: a temporary directory, removed)")
    p.add_argument("--timeout", type=float, default=1200.0)
    p.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sync", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.rank_worker:
        return rank_main(a)
    from jaxodc.bench.common import print_table, write_records
    from jaxodc.modeling.synthetic import write_checkpoint
    tmp = None if a.dir else tempfile.mkdtemp(prefix="jaxodc_ckpt_")
    directory = a.dir or tmp
    try:
        if not os.path.exists(os.path.join(directory, "config.json")):
            t = time.perf_counter()
            write_checkpoint(directory, checkpoint_config(a.gb, a.dtype), seed=0, max_shard_bytes=256 * MiB)
            print(f"generated {directory} in {time.perf_counter() - t:.1f} s", flush=True)
        ckpt_bytes = sum(os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory)
                         if f.endswith(".safetensors"))
        base, base_cpu = baseline(directory)
        rows = []
        for world in [int(x) for x in a.ranks.split(",") if x.strip()]:
            ranks = run_world(directory, world, a.timeout)
            master = ranks[0]["master_bytes"]
            peak = max(r["peak_rss"] for r in ranks)
            load_s = max(r["t1"] for r in ranks) - min(r["t0"] for r in ranks)
            rss_bar = 1.25 * master / world + 300 * MiB
            rows.append({"ranks": world, "checkpoint_bytes": ckpt_bytes, "master_bytes": master, "peak_rss": peak,
                         "load_s": load_s, "baseline_s": base, "peak_rss_ranks": [r["peak_rss"] for r in ranks],
                         "rank_load_s": [r["t1"] - r["t0"] for r in ranks],
                         "rank_start_s": [r["t0"] - min(q["t0"] for q in ranks) for r in ranks],
                         "threads": ranks[0]["threads"], "baseline_cpu_s": base_cpu,
                         "rank_cpu_s": [r["cpu_s"] for r in ranks],
                         "rss_bar": int(rss_bar), "rss_ok": peak <= rss_bar, "time_ok": load_s <= 1.5 * base})
        write_records(a.json, rows)
        print_table([{**r, "peak_rss_MiB": r["peak_rss"] / MiB, "bar_MiB": r["rss_bar"] / MiB,
                      "master_MiB": r["master_bytes"] / MiB} for r in rows],
                    ["ranks", "threads", "master_MiB", "peak_rss_MiB", "bar_MiB", "rss_ok", "load_s", "baseline_s",
                     "time_ok"])
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
