"""Attention over packed rows on one CPU core: the variable-length kernel against the dense masked
reference (jaxodc.ops.segment_attention impl="kernel" / "dense"), forward + backward, for rows
holding 1, 2, 8 and 32 equal samples. The kernel's cost should follow sum(s^2), the dense one's T^2.
With --gpu, the same on the GPU with the Pallas flash kernel (impl="pallas") instead.

    python bench/attention.py --json bench/out/attention.json [--T 512,1024] [--samples 1,2,8,32] [--reps 15]
    python bench/attention.py --gpu --T 4096,16384 --samples 1,8,64 --reps 10

Variants are interleaved within each repetition; each record holds the median over repetitions.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxodc.bench.common import print_table, write_records  # noqa: E402
from jaxodc.launch.launcher import pin_one_core  # noqa: E402

GPU = "--gpu" in sys.argv
# One core, set before jax is imported (XLA reads the flags and the affinity once).
if not GPU:
    if "--no-pin" not in sys.argv:
        pin_one_core()
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1"]).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

IMPLS = ("pallas", "dense") if GPU else ("kernel", "dense")  # the fast one first


def _step(impl: str):
    import jax
    import jax.numpy as jnp

    from jaxodc.ops import segment_attention

    def loss(q, k, v, seg, do):
        return jnp.vdot(segment_attention(q, k, v, seg, impl=impl), do)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def run(Ts: list[int], samples: list[int], B: int, H: int, Dh: int, reps: int) -> list[dict]:
    import jax

    from jaxodc import _C

    steps = {impl: _step(impl) for impl in IMPLS}
    rng = np.random.default_rng(0)
    records = []
    for T in Ts:
        q, k, v, do = (rng.standard_normal((B, T, H, Dh)).astype(np.float32) for _ in range(4))
        cases = []
        for n in samples:
            if T % n:
                raise SystemExit(f"--samples {n} does not divide T={T}")
            seg = np.repeat(np.arange(1, n + 1, dtype=np.int32), T // n)[None].repeat(B, 0)
            args = [jax.device_put(x) for x in (q, k, v, seg, do)]
            for impl in IMPLS:
                jax.block_until_ready(steps[impl](*args))  # compile + warm up
            cases.append((n, args))
        times = {(n, impl): [] for n, _ in cases for impl in IMPLS}
        cpu_times = {key: [] for key in times}  # process CPU time: less sensitive to a busy machine
        for _ in range(reps):  # interleaved: every variant once per repetition
            for n, args in cases:
                for impl in IMPLS:
                    start, cpu = time.perf_counter(), time.process_time()
                    jax.block_until_ready(steps[impl](*args))
                    times[(n, impl)].append(time.perf_counter() - start)
                    cpu_times[(n, impl)].append(time.process_time() - cpu)
        for n, _ in cases:
            med = {impl: statistics.median(times[(n, impl)]) for impl in IMPLS}
            for impl in IMPLS:
                records.append({
                    "bench": "attention", "op": "fwd+bwd", "impl": impl, "B": B, "T": T, "H": H, "Dh": Dh,
                    "samples": n, "sample_len": T // n, "reps": reps, "median_ms": med[impl] * 1e3,
                    "min_ms": min(times[(n, impl)]) * 1e3,
                    "cpu_ms": statistics.median(cpu_times[(n, impl)]) * 1e3,
                    "kernel_over_dense": med[IMPLS[0]] / med["dense"],
                    "isa": _C.attention_isas()[-1] if impl == "kernel" else None,
                    "device": jax.devices()[0].device_kind,
                })
    return records


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/attention.py", description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the records here")
    p.add_argument("--T", default="512,1024", help="row lengths")
    p.add_argument("--samples", default="1,2,8,32", help="equal samples per row")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--Dh", type=int, default=64)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--no-pin", action="store_true", help="do not pin the process to one core")
    p.add_argument("--gpu", action="store_true", help="the Pallas kernel against dense on the GPU")
    a = p.parse_args(argv)
    records = run([int(t) for t in a.T.split(",")], [int(s) for s in a.samples.split(",")], a.B, a.H, a.Dh, a.reps)
    write_records(a.json, records)
    print_table(records, ["T", "samples", "sample_len", "impl", "median_ms", "min_ms", "cpu_ms", "kernel_over_dense", "isa"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
