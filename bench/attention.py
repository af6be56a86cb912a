"""Attention over packed rows on one CPU core: the variable-length kernel against the dense masked
reference (jaxodc.ops.segment_attention impl="kernel" / "dense"), forward + backward, for rows
holding 1, 2, 8 and 32 equal samples. The kernel's cost should follow sum(s^2), the dense one's T^2.

    python bench/attention.py --json bench/out/attention.json [--T 512,1024] [--samples 1,2,8,32] [--reps 15]

With --gpu (issue 32's check), on a GPU: rows of T = 8192 tokens holding 1, 8 and 64 equal samples,
fp32 inputs (TF32 dots, as XLA's default) and bf16 inputs, forward and fwd+bwd of "pallas" (the
Pallas kernel), "dense" (XLA), "auto" (segment_attention's choice, told the longest sample) and
"cudnn" (jax.nn.dot_product_attention on the row cut into its samples as a batch: exact for equal
samples filling the row; bf16 only), with useful TFLOP/s and the issue's bars (auto/dense fwd+bwd
<= 1.0 on one sample and <= 0.2 on 64; bf16 auto >= 35% of the GPU's bf16 peak on one sample).
--sweep times the Pallas kernel's block sizes per head size and dot mode, then its crossover
against dense, and prints the attention_policy.BLOCKS / CROSSOVER entries to paste (and writes them
to --tables-out, which --tables loads into a later run so its "auto" uses them):

    python3 bench/attention.py --gpu --sweep --heads 64,128 --tables-out sweep.json
    python3 bench/attention.py --gpu --T 8192 --samples 1,8,64 --tables sweep.json --json gpu.json

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
import functools  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

IMPLS = ("kernel", "dense")  # the fast one first


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


# ---- GPU (--gpu) ---------------------------------------------------------------------------------

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
BARS = {"samples=1": 1.0, "samples=64": 0.2, "bf16 share of peak": 0.35}  # issue 32's bars


def _timed(variants: dict, reps: int) -> dict:
    """{key: median seconds} of zero-argument callables, each warmed up (compiled) first, then run
    interleaved `reps` times. A variant that fails to compile or run is reported and left out."""
    import jax
    ok = {}
    for key, fn in variants.items():
        try:
            jax.block_until_ready(fn())
            ok[key] = fn
        except Exception as e:  # e.g. a block size Triton cannot fit in shared memory
            print(f"skip {key}: {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
    times = {key: [] for key in ok}
    for _ in range(reps):
        for key, fn in ok.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[key].append(time.perf_counter() - start)
    return {key: statistics.median(t) for key, t in times.items()}


@functools.lru_cache(maxsize=None)  # one compile per variant and shape, not per row layout
def _attention_fns(impl: str, n: int, longest=None, blocks=None):
    """(forward, fwd+bwd) jitted for one implementation; cudnn sees the row's n samples as a batch
    (the other implementations ignore n: pass 1 so rows of any layout share the compile)."""
    import jax
    import jax.numpy as jnp

    from jaxodc.ops.attention import _segment_attention

    def attend(q, k, v, seg):
        if impl == "cudnn":
            B, T, H, Dh = q.shape
            cut = lambda x: x.reshape(B * n, T // n, H, Dh)  # noqa: E731
            return jax.nn.dot_product_attention(cut(q), cut(k), cut(v), is_causal=True,
                                                implementation="cudnn").reshape(B, T, H, Dh)
        return _segment_attention(q, k, v, seg, impl=impl, longest=longest, blocks=blocks)

    def loss(q, k, v, seg, do):
        return jnp.sum(attend(q, k, v, seg).astype(jnp.float32) * do.astype(jnp.float32))

    return jax.jit(attend), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _row(T: int, n: int, B: int, H: int, Dh: int, dtype: str, seed: int = 0):
    import jax
    import jax.numpy as jnp
    if T % n:
        raise SystemExit(f"--samples {n} does not divide T={T}")
    rng = np.random.default_rng(seed)
    q, k, v, do = (jax.device_put(jnp.asarray(rng.standard_normal((B, T, H, Dh)), DTYPES[dtype])) for _ in range(4))
    seg = jax.device_put(np.repeat(np.arange(1, n + 1, dtype=np.int32), T // n)[None].repeat(B, 0))
    return q, k, v, seg, do


def run_gpu(T: int, samples: list[int], dtypes: list[str], B: int, H: int, Dh: int, reps: int, tables: str) -> list[dict]:
    """Issue 32's records: {"samples", "dtype", "impl", "fwd_s", "fwdbwd_s", "tflops", ...}."""
    import jax

    from jaxodc.ops import attention_policy as ap
    kind = jax.devices()[0].device_kind
    records = []
    for dtype in dtypes:
        mode = ap.dot_mode(DTYPES[dtype])
        for n in samples:
            q, k, v, seg, do = _row(T, n, B, H, Dh, dtype)
            impls = ["pallas", "dense", "auto"] + (["cudnn"] if dtype == "bf16" else [])
            fns = {impl: _attention_fns(impl, n if impl == "cudnn" else 1, longest=T // n if impl == "auto" else None)
                   for impl in impls}
            fwd = _timed({impl: (lambda f=f: f[0](q, k, v, seg)) for impl, f in fns.items()}, reps)
            fb = _timed({impl: (lambda f=f: f[1](q, k, v, seg, do)) for impl, f in fns.items()}, reps)
            flops = ap.useful_flops([T // n] * n, H, Dh, backward=True) * B
            for impl in impls:
                rec = {"bench": "attention_gpu", "samples": n, "sample_len": T // n, "dtype": dtype, "mode": mode,
                       "impl": impl, "fwd_s": fwd.get(impl), "fwdbwd_s": fb.get(impl), "T": T, "B": B, "H": H,
                       "Dh": Dh, "device": kind, "tables": tables, "reps": reps,
                       "auto_picks": ap.choose_impl(T, Dh, mode, kind, longest=T // n, B=B, H=H)}
                rec["tflops"] = flops / rec["fwdbwd_s"] / 1e12 if rec["fwdbwd_s"] else None
                records.append(rec)
                print(f"{dtype} samples={n} {impl}: fwd {rec['fwd_s']} s, fwd+bwd {rec['fwdbwd_s']} s, "
                      f"{rec['tflops']} TFLOP/s", flush=True)
    return records


def bars(records: list[dict], peak_tflops: float | None) -> list[dict]:
    """Issue 32's bars from run_gpu's records: per dtype, auto/dense fwd+bwd on one sample (<= 1.0)
    and on the most samples (<= 0.2, meant for 64 x 128); bf16 auto TFLOP/s on one sample over the
    GPU's bf16 peak (>= 0.35). The Pallas kernel's own ratios are listed too (no bar)."""
    by = {(r["dtype"], r["samples"], r["impl"]): r for r in records}
    out = []
    for dtype in sorted({r["dtype"] for r in records}):
        ns = sorted({r["samples"] for r in records if r["dtype"] == dtype})
        for n, bar in ((ns[0], "samples=1"), (ns[-1], "samples=64")):
            dense = by.get((dtype, n, "dense"), {}).get("fwdbwd_s")
            for impl in ("auto", "pallas"):
                t = by.get((dtype, n, impl), {}).get("fwdbwd_s")
                value = t / dense if t and dense else None
                limit = BARS[bar] if impl == "auto" and n in (1, 64) else None
                out.append({"bar": f"{impl}/dense fwd+bwd, {n} samples", "dtype": dtype, "value": value, "limit": limit,
                            "pass": None if limit is None or value is None else value <= limit})
        one = by.get((dtype, 1, "auto"), {}).get("tflops")
        if dtype == "bf16":
            value = one / peak_tflops if one and peak_tflops else None
            out.append({"bar": "auto fwd+bwd TFLOP/s / bf16 peak, 1 sample", "dtype": dtype, "value": value,
                        "limit": BARS["bf16 share of peak"],
                        "pass": None if value is None else value >= BARS["bf16 share of peak"]})
    return out


# Candidate tilings per padded head size: jax's defaults first, then larger query blocks, more warps
# or stages (Triton refuses what does not fit shared memory; those are skipped).
SWEEP_BLOCKS = {
    64: [(64, 64, 32, 4, 2), (128, 64, 32, 4, 2), (128, 64, 64, 8, 2), (128, 128, 64, 8, 2), (64, 64, 64, 4, 3),
         (128, 64, 32, 8, 3)],
    128: [(32, 32, 32, 4, 2), (64, 64, 32, 4, 2), (128, 64, 32, 8, 2), (64, 32, 32, 4, 3), (128, 32, 32, 8, 2),
          (64, 64, 64, 8, 2)],
}


def sweep(T: int, H: int, heads: list[int], dtypes: list[str], reps: int, tables_out: str | None = None) -> dict:
    """Per head size and dot mode: the fastest tiling's fwd+bwd on one T-token sample, then, with
    it, the longest sample length (T, T/2, ... 128) up to which Pallas fwd+bwd <= dense on rows of
    such samples (inf: never slower; 0: slower even at 128)."""
    import json

    import jax
    import jax.numpy as jnp

    from jaxodc.ops import attention_policy as ap
    kind = jax.devices()[0].device_kind
    gen, out = ap.generation(kind), {"device": kind, "T": T, "H": H, "blocks": [], "crossover": [], "records": []}
    for Dh in heads:
        for dtype in dtypes:
            mode, Dp = ap.dot_mode(DTYPES[dtype]), ap.padded_head(Dh)
            q, k, v, seg, do = _row(T, 1, 1, H, Dh, dtype)
            cands = [ap.Blocks(*c) for c in SWEEP_BLOCKS.get(Dp, SWEEP_BLOCKS[128])]
            fns = {c: _attention_fns("pallas", 1, blocks=c)[1] for c in cands}
            t = _timed({c: (lambda f=f: f(q, k, v, seg, do)) for c, f in fns.items()}, reps)
            for c in cands:
                out["records"].append({"kind": "blocks", "Dh": Dh, "dtype": dtype, "mode": mode, "blocks": list(c),
                                       "fwdbwd_s": t.get(c)})
            if not t:
                print(f"# Dh={Dh} {dtype}: no tiling compiled", flush=True)
                continue
            best = min(t, key=t.get)
            out["blocks"].append([gen, Dp, mode, list(best), t[best]])
            lens = [s for s in (T >> i for i in range(8)) if s >= 128]
            fb = {impl: _attention_fns(impl, 1, blocks=best)[1] for impl in ("pallas", "dense")}
            # The winner's gradients against dense's in the same mode (max |diff| / max |dense|),
            # for whoever pastes the entry: tests/test_attention.py allows 16 unit roundoffs.
            got, ref = fns[best](q, k, v, seg, do), fb["dense"](q, k, v, seg, do)
            err = max(float(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32)).max()
                            / jnp.abs(r.astype(jnp.float32)).max()) for g, r in zip(got, ref))
            out["records"].append({"kind": "check", "Dh": Dh, "dtype": dtype, "mode": mode, "blocks": list(best),
                                   "grad_err_vs_dense": err})
            wins = {}
            for s in lens:
                seg_s = jax.device_put(np.repeat(np.arange(1, T // s + 1, dtype=np.int32), s)[None])
                ts = _timed({impl: (lambda f=f: f(q, k, v, seg_s, do)) for impl, f in fb.items()}, reps)
                wins[s] = ts.get("pallas", float("inf")) <= ts.get("dense", float("inf"))
                out["records"].append({"kind": "crossover", "Dh": Dh, "dtype": dtype, "mode": mode, "sample_len": s,
                                       "pallas_s": ts.get("pallas"), "dense_s": ts.get("dense")})
            crossover = 0
            for s in sorted(lens):  # the longest length below which Pallas never lost
                if not wins[s]:
                    break
                crossover = s
            out["crossover"].append([gen, Dp, mode, float("inf") if crossover == max(lens) else crossover])
            if tables_out:  # after each head size and mode: a step that times out keeps what it found
                with open(tables_out, "w") as f:
                    json.dump(out, f, indent=1)
            print(f"# Dh={Dh} {dtype} ({mode}) on {kind}: best {best} {t[best] * 1e3:.2f} ms (gradients vs dense: "
                  f"{err:.1e} of max); pallas <= dense at "
                  f"{sorted(s for s in lens if wins[s])}", flush=True)
    day = time.strftime("%Y-%m-%d")
    print(f"# attention_policy entries, swept on {kind} {day} (T={T}, H={H}, bench/attention.py --gpu --sweep):")
    print("# BLOCKS:")
    for gen_, Dp, mode, b, sec in out["blocks"]:
        print(f"    ({gen_!r}, {Dp}, {mode!r}): Blocks{tuple(b)},  # {sec * 1e3:.2f} ms fwd+bwd, 1 x {T}, {kind}")
    print("# CROSSOVER:")
    for gen_, Dp, mode, c in out["crossover"]:
        c = 'float("inf")' if c == float("inf") else int(c)
        print(f"    ({gen_!r}, {Dp}, {mode!r}): {c},  # {kind} {day}")
    return out


def load_tables(path: str) -> None:
    """Put a sweep's entries (--tables-out) into attention_policy's tables for this process."""
    import json

    from jaxodc.ops import attention_policy as ap
    with open(path) as f:
        found = json.load(f)
    for gen, Dp, mode, b, _ in found["blocks"]:
        ap.BLOCKS[(gen, Dp, mode)] = ap.Blocks(*b)
    for gen, Dp, mode, c in found["crossover"]:
        ap.CROSSOVER[(gen, Dp, mode)] = float(c)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/attention.py", description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the records here")
    p.add_argument("--T", default=None, help="row lengths (CPU; default 512,1024) or the row length (--gpu; 8192)")
    p.add_argument("--samples", default=None, help="equal samples per row (default 1,2,8,32; --gpu 1,8,64)")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=None, help="heads (default 4; --gpu 8)")
    p.add_argument("--Dh", type=int, default=64)
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 15; --gpu 10)")
    p.add_argument("--no-pin", action="store_true", help="do not pin the process to one core")
    p.add_argument("--gpu", action="store_true", help="issue 32's GPU records and bars (see above)")
    p.add_argument("--dtypes", default="fp32,bf16", help="--gpu: input dtypes")
    p.add_argument("--sweep", action="store_true", help="--gpu: sweep block sizes and the crossover instead")
    p.add_argument("--heads", default="64,128", help="--sweep: head sizes")
    p.add_argument("--tables", help="--gpu: load a sweep's entries (--tables-out) first")
    p.add_argument("--tables-out", help="--sweep: write the entries found here")
    a = p.parse_args(argv)
    if not a.gpu:
        records = run([int(t) for t in (a.T or "512,1024").split(",")], [int(s) for s in (a.samples or "1,2,8,32").split(",")],
                      a.B, a.H or 4, a.Dh, a.reps or 15)
        write_records(a.json, records)
        print_table(records, ["T", "samples", "sample_len", "impl", "median_ms", "min_ms", "cpu_ms", "kernel_over_dense",
                              "isa"])
        return 0
    import jax

    from jaxodc.ops import attention_policy as ap
    T, H, reps, dtypes = int(a.T or 8192), a.H or 8, a.reps or 10, a.dtypes.split(",")
    if a.sweep:
        sweep(T, H, [int(h) for h in a.heads.split(",")], dtypes, reps, a.tables_out)
        return 0
    if a.tables:
        load_tables(a.tables)
    records = run_gpu(T, [int(s) for s in (a.samples or "1,8,64").split(",")], dtypes, a.B, H, a.Dh, reps,
                      a.tables or "code")
    kind = jax.devices()[0].device_kind
    result = bars(records, ap.bf16_peak_tflops(kind))
    write_records(a.json, records + [{"bench": "attention_gpu_bar", "device": kind, **b} for b in result])
    print_table(records, ["dtype", "samples", "impl", "auto_picks", "fwd_s", "fwdbwd_s", "tflops"])
    print_table(result, ["dtype", "bar", "value", "limit", "pass"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
