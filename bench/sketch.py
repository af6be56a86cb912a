"""`jaxodc bench sketch`: the gradient-sketch kernels (jaxodc.ops.sketch) on one core against a
memcpy of the same gradient, one record per stage: sparsify (exact top-fraction selection with
error feedback; it also writes the index bitmap), sketch (count-sketch build), peel (decode), and
the pipeline of the three (1 / sum of 1 / gbps). Bar: pipeline >= 0.1 x memcpy.

    python -m jaxodc bench sketch --json bench/out/sketch.json [--mb 64] [--fraction 0.01] [--ratio 50]

`--owner` measures instead how an ODC owner should decode the many pushes of one minibatch (every
microbatch of every rank): peel each push as it arrives, or sum the pushes' sketches, OR their
bitmaps and peel once -- with the ratio's sketch (`summed`), or one widened to peel the union of
the pushes' supports as the collective's reduce-scatter sizes it for its W senders (`summed_wide`:
compress.collective.UnitExchange.width). One record per (mode, pushes): decode seconds, sketch
width, peeled / estimated counts and the relative L2 error of the decoded sum against the sum of
what the senders kept.

    python -m jaxodc bench sketch --owner --json bench/out/sketch_owner.json [--owner-mb 4] [--fraction 0.05] [--ratio 10]
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
    p.add_argument("--owner", action="store_true", help="per-push vs per-minibatch decoding at an ODC owner")
    p.add_argument("--owner-mb", type=int, default=4, help="--owner: the owner's slice, MB of fp32")
    p.add_argument("--pushes", default="1,2,4,8,16", help="--owner: pushes per minibatch (list)")
    args = p.parse_args(argv)
    pin_one_core()  # before jax: XLA sizes its thread pool from the affinity
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
    import jax
    if args.owner:
        return owner_decode(args)
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


def owner_decode(args) -> int:
    """Per-push vs summed decoding at an owner (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import math

    from jaxodc.ops.sketch import peel_width, sketch_build, sketch_peel, sketch_sparsify, sketch_width

    n = args.owner_mb * MB // 4
    width = sketch_width(n, args.ratio)
    sparsify = jax.jit(lambda g: sketch_sparsify(g, jnp.zeros_like(g), fraction=args.fraction))
    build = jax.jit(lambda v, b, w: sketch_build(v, b, width=w), static_argnums=2)
    peel = jax.jit(lambda s, b: sketch_peel(s, b, n=n))
    records = []
    for pushes in (int(x) for x in args.pushes.split(",")):
        rng = np.random.default_rng(pushes)
        # the collective's width for `pushes` senders (UnitExchange.width)
        wide = max(width, peel_width(min(n, pushes * math.ceil(args.fraction * n))))
        sent = []  # (kept, bitmap, sketch, wide sketch) of each push: heavy-tailed gradients, like a transformer's
        for _ in range(pushes):
            g = jnp.asarray((rng.standard_normal(n) * rng.lognormal(0, 1, n)).astype(np.float32))
            kept, _, bits = sparsify(g)
            sent.append((kept, bits, build(kept, bits, width), build(kept, bits, wide)))
        jax.block_until_ready(sent)
        truth = np.sum([np.asarray(k, np.float64) for k, _, _, _ in sent], axis=0)
        norm = float(np.linalg.norm(truth))
        jax.block_until_ready((peel(sent[0][2], sent[0][1]), peel(sent[0][3], sent[0][1])))  # compiled before timing
        for mode in ("per_push", "summed", "summed_wide"):
            def decode():
                if mode == "per_push":
                    outs = [peel(s, b) for _, b, s, _ in sent]
                    return jax.block_until_ready((sum(v for v, _ in outs), sum(c for _, c in outs)))
                bits = sent[0][1]
                for _, b, _, _ in sent[1:]:
                    bits = jnp.bitwise_or(bits, b)
                return jax.block_until_ready(peel(sum(x[2 if mode == "summed" else 3] for x in sent), bits))
            t = median_time(decode, args.reps)
            values, counts = decode()
            peeled, estimated = (int(x) for x in np.asarray(counts))
            records.append({"kind": "owner_decode", "mode": mode, "pushes": pushes, "elements": n,
                            "fraction": args.fraction, "ratio": args.ratio, "seconds": t, "peeled": peeled,
                            "width": wide if mode == "summed_wide" else width,
                            "estimated": estimated,
                            "rel_error": float(np.linalg.norm(np.asarray(values, np.float64) - truth)) / norm})
    print_table(records, ["mode", "pushes", "width", "seconds", "peeled", "estimated", "rel_error"])
    write_records(args.json, records)
    return 0
