"""`jaxodc bench sketch`: the gradient-sketch kernels (jaxodc.ops.sketch) on one core against a
memcpy of the same gradient, one record per stage: sparsify (exact top-fraction selection with
error feedback; it also writes the index bitmap), sketch (count-sketch build), peel (decode), and
the pipeline of the three (1 / sum of 1 / gbps). Bar: pipeline >= 0.1 x memcpy.

    python -m jaxodc bench sketch --json bench/out/sketch.json [--mb 64] [--fraction 0.01] [--ratio 50]
"""
from __future__ import annotations

import argparse
import os

from jaxodc.bench.common import median_time, print_table, write_records
from jaxodc.launch.launcher import pin_one_core

MB = 1 << 20


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxodc bench sketch", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the records here")
    p.add_argument("--mb", type=int, default=64, help="gradient size in MB of fp32")
    p.add_argument("--fraction", type=float, default=0.01, help="kept fraction")
    p.add_argument("--ratio", type=float, default=50.0, help="dense fp32 bytes / sketch bytes")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    pin_one_core()  # before jax: XLA sizes its thread pool from the affinity
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxodc.ops.sketch import sketch_build, sketch_peel, sketch_sparsify, sketch_width

    n = args.mb * MB // 4
    rng = np.random.default_rng(0)
    grad = jnp.asarray(rng.standard_normal(n).astype(np.float32))
    residual = jnp.asarray((rng.standard_normal(n) * 0.1).astype(np.float32))
    k = int(np.ceil(args.fraction * n))
    width = sketch_width(n, args.ratio)
    sparsify = jax.jit(lambda g, r: sketch_sparsify(g, r, fraction=args.fraction))
    build = jax.jit(lambda v, b: sketch_build(v, b, width=width))
    peel = jax.jit(lambda s, b: sketch_peel(s, b, n=n))
    copy = jax.jit(lambda x: x + 0.0)  # one read and one write of the gradient, as XLA runs it
    kept, _, bits = jax.block_until_ready(sparsify(grad, residual))
    sk = jax.block_until_ready(build(kept, bits))
    values, counts = jax.block_until_ready(peel(sk, bits))
    jax.block_until_ready(copy(grad))
    stages = {
        "sparsify": lambda: jax.block_until_ready(sparsify(grad, residual)),
        "sketch": lambda: jax.block_until_ready(build(kept, bits)),
        "peel": lambda: jax.block_until_ready(peel(sk, bits)),
        "memcpy": lambda: jax.block_until_ready(copy(grad)),
    }
    nbytes = n * 4
    records = []
    for stage, fn in stages.items():
        t = median_time(fn, args.reps)
        records.append({"kind": "sketch", "stage": stage, "bytes": nbytes, "seconds": t, "gbps": nbytes / t / 1e9,
                        "fraction": args.fraction, "width": width})
    gbps = {r["stage"]: r["gbps"] for r in records}
    pipeline = 1.0 / sum(1.0 / gbps[s] for s in ("sparsify", "sketch", "peel"))
    records.append({"kind": "sketch", "stage": "pipeline", "bytes": nbytes, "seconds": nbytes / pipeline / 1e9,
                    "gbps": pipeline, "fraction": args.fraction, "width": width})
    print_table(records, ["stage", "bytes", "seconds", "gbps"])
    peeled, estimated = (int(x) for x in np.asarray(counts))
    wire = bits.size * 4 + sk.size * 4
    print(f"{args.mb} MB fp32, kept {k} ({args.fraction:g}), sketch 3 x {width}: peeled {peeled}, estimated "
          f"{estimated}; wire {wire / MB:.2f} MB (bitmap + sketch) vs {nbytes / MB:.0f} MB dense = "
          f"{nbytes / wire:.1f}x fewer bytes; max |decoded - kept| = {float(jnp.max(jnp.abs(values - kept))):.3g}")
    ratio = pipeline / gbps["memcpy"]
    print(f"pipeline / memcpy = {ratio:.3f} (bar >= 0.1) {'PASS' if ratio >= 0.1 else 'FAIL'}")
    write_records(args.json, records)
    return 0
