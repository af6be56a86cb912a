"""`jaxodc bench train`: ODC vs the collective baseline, end to end, on the small LM.

    python -m jaxodc bench train --json bench/out/train.json [--timeline bench/out/train_timeline.png]
    python -m jaxodc bench train --memory --json bench/out/train_memory.json    # peak memory at W = 2, 4
    python -m jaxodc bench train --memory --precision bf16 --json bench/out/train_memory_bf16.json
    python -m jaxodc bench train --compress default --link-mbps 100 --json bench/out/train_compress_100.json
    python -m jaxodc bench train --straggle default --json bench/out/train_straggle.json  # minibatch 4, 8
    python -m jaxodc bench train --task sft --json bench/out/train_sft.json     # chat SFT, masked loss
    python -m jaxodc bench train --task grpo --json bench/out/train_grpo.json   # GRPO on rollouts

(--task: a generated Llama-style HF checkpoint, loaded as `jaxodc train --model hf:DIR` does.)

The memory mode is bench/train_memory.py, the compression mode (TAGC vs dense over an emulated
link) bench/train_compress.py. With --straggle, every combo runs again under each injection
(slowdowns keyed on the data minibatch, the same for every combo), and bench/straggle_predict.py
replays the same minibatches and slowdowns in the simulator for what any balancer could gain, and
what LB-Steal gains on average over many fresh minibatches.
The report (rows, ratios, bars, table, timeline) is bench/train_report.py. Methodology
(interleaving, bubble accounting, memory accounting): bench/README.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from jaxodc.bench.common import accumulate_of, add_reproducible_argument, write_records
from jaxodc.launch.launcher import launch_ranks, pin_one_core

# "collective" runs jax's collectives (gloo on CPU); "collective@jaxodc" the same trainer over
# jaxodc's own lock-step collective (csrc/lockstep: the shm path ODC uses), so that odc against it
# measures ODC's scheduling, not a faster transport.
COMBOS = (("collective", "local_sort"), ("collective", "lb_micro"), ("collective@jaxodc", "lb_micro"), ("odc", "local_sort"),
          ("odc", "lb_micro"), ("odc", "lb_mini"), ("odc", "lb_steal"))
MiB = 1 << 20
# --straggle's defaults: the combos its bars compare, and enough minibatches that rare slowdowns
# (the default throttles a rank in one minibatch of twenty) show in every repetition's share
STRAGGLE_COMBOS = (("collective@jaxodc", "lb_micro"), ("odc", "lb_mini"), ("odc", "lb_steal"))
STRAGGLE_BLOCK_SAMPLES = 32
STRAGGLE_REPS = 48
# The model and lengths of the throughput modes (the paper's long-context SFT, attention-bound) and
# of --compress (TAGC's claim is about links that are the bottleneck: a model 16x larger and
# samples 4x shorter, so at 100 Mbit/s the dense run spends most of a minibatch on the wire, and
# enough minibatches that the loss curves settle; bench/README.md)
WORKLOAD = {"d_model": 64, "layers": 2, "max_tokens": 2048}
COMPRESS_WORKLOAD = {"d_model": 256, "layers": 3, "max_tokens": 512}


def sum_comm(accumulate: str) -> str:
    """--compare-sum's extra trainer: ODC over a runtime summing pushes by `accumulate`."""
    return f"odc/{accumulate}-sum"


TRANSPORT = {"collective": "gloo", "collective@jaxodc": "jaxodc", "odc": "jaxodc"}  # records' "transport"


def _args(argv):
    p = argparse.ArgumentParser(prog="jaxodc bench train", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the records here")
    p.add_argument("--timeline", help="per-rank Gantt chart (PNG) of one repetition at minibatch 4")
    p.add_argument("--raw", help="also write every rank's raw minibatch records and calibrations here (JSON)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--minibatch", default=None,
                   help="samples per rank per minibatch (list; default 1,2,4,8, with --straggle 4,8)")
    p.add_argument("--reps", type=int, default=None,
                   help="interleaved repetitions (medians over these; 16 keeps the barred ratios' 95%% "
                        f"intervals within about +-5%% on the 2-core machine; with --straggle {STRAGGLE_REPS})")
    p.add_argument("--combos", default=None,
                   help="comma-separated comm+balance pairs to run (default: all of "
                        + ", ".join(f"{c}+{b}" for c, b in COMBOS) + "; with --straggle: "
                        + ", ".join(f"{c}+{b}" for c, b in STRAGGLE_COMBOS) + ")")
    p.add_argument("--block-samples", type=int, default=None,
                   help="samples per rank per minibatch size per repetition (default 8: 2 minibatches at minibatch 4; "
                        f"with --straggle {STRAGGLE_BLOCK_SAMPLES}: injected slowdowns are rare events, and a few "
                        "minibatches hold one or two of them)")
    p.add_argument("--calib-reps", type=int, default=3, help="timings per bucket per calibration")
    p.add_argument("--preset", default="longalign", help="sample-length preset (long-tailed)")
    p.add_argument("--pool", type=int, default=512, help="samples drawn from the preset")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="the longest sample's tokens, and the packed microbatch's cap (default 2048, the paper's "
                        "setting; with --compress 512)")
    p.add_argument("--min-bucket", type=int, default=256,
                   help="row lengths are the multiples of this up to --max-tokens (0: powers of two from 64)")
    p.add_argument("--d-model", type=int, default=None,
                   help="default 64, small beside --max-tokens: attention dominates long samples (with --compress 256)")
    p.add_argument("--layers", type=int, default=None, help="default 2 (with --compress 3)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--memory", action="store_true", help="measure peak per-rank memory instead")
    p.add_argument("--memory-ranks", default="2,4")
    p.add_argument("--memory-d-model", type=int, default=768)
    p.add_argument("--memory-layers", type=int, default=4)
    p.add_argument("--memory-tokens", type=int, default=64, help="row length of the memory run's microbatches")
    p.add_argument("--memory-steps", type=int, default=3)
    p.add_argument("--memory-slot-mib", type=float, default=1.0,
                   help="ODC receive slot per client, MiB (pushes travel in chunks of it; 0: a whole shard)")
    p.add_argument("--memory-comm", default="odc", help=argparse.SUPPRESS)
    p.add_argument("--memory-collective-transport", default="gloo", choices=("gloo", "jaxodc"),
                   help="--memory: the collective trainer's transport (jaxodc: the lock-step collective over "
                        "jaxodc's shm / tcp paths; its buffers are counted in the accounted peak)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                   help="--memory: the trainers' precision (bf16: gather, compute and send gradients in bf16)")
    p.add_argument("--straggle", action="append", default=[],
                   help="also run every combo with this straggler injection (jaxodc.train.straggle: default or "
                        "key=value pairs), in the same processes; repeatable (one pass per spec)")
    p.add_argument("--compress", help="compare TAGC compression (this setting: default or key=value pairs) "
                                      "with dense training instead (bench/train_compress.py)")
    p.add_argument("--link-mbps", type=float, default=0.0, help="--compress: emulated link of ODC's tcp transport")
    p.add_argument("--link-ms", type=float, default=0.0, help="--compress: emulated one-way latency, ms")
    p.add_argument("--compress-steps", type=int, default=60, help="--compress: minibatches per run")
    p.add_argument("--compress-minibatch", type=int, default=4, help="--compress: samples per rank per minibatch")
    p.add_argument("--loss-png", help="--compress: loss-vs-samples plot of the four runs")
    p.add_argument("--task", choices=("sft", "grpo"), default=None,
                   help="train a generated Llama-style HF checkpoint (--d-model, --layers, --heads) on a generated "
                        "chat JSONL (sft: loss on the assistant turns) or rollout JSONL (grpo: the clipped objective) "
                        "with long-tailed lengths instead of the small LM on plain text (task_workload)")
    add_reproducible_argument(p)
    p.add_argument("--compare-sum", action="store_true",
                   help="also run odc+lb_mini with the other accumulation of pushes (exact <-> fp32; "
                        "--reproducible or $JAXODC_ODC_ACCUMULATE picks the main one), interleaved, and print "
                        "their ratio")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--worker", choices=("train", "memory", "compress"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for k, v in (COMPRESS_WORKLOAD if args.compress else WORKLOAD).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.reps is None:
        args.reps = STRAGGLE_REPS if args.straggle else 16
    if args.combos is None:
        args.combos = ",".join(f"{c}+{b}" for c, b in (STRAGGLE_COMBOS if args.straggle else COMBOS))
    known = {f"{c}+{b}" for c, b in COMBOS}
    bad = [c for c in args.combos.split(",") if c.strip() not in known]
    if bad:
        p.error(f"--combos: {bad[0]!r} is not one of {', '.join(sorted(known))}")
    if args.minibatch is None:
        args.minibatch = "4,8" if args.straggle else "1,2,4,8"
    if args.block_samples is None:
        args.block_samples = STRAGGLE_BLOCK_SAMPLES if args.straggle else 8
    return args


def _ints(s: str) -> list[int]:
    return [int(x) for x in str(s).split(",") if x.strip()]


def bucket_policy(max_tokens: int, min_bucket: int):
    """packing.bucket's `min_bucket` for the benchmark: every multiple of `min_bucket` up to
    max_tokens (fine buckets: compute follows a row's content, and a lock-step rank computing
    padding to match a longer peer counts as waiting); 0 = doubling from 64."""
    return 64 if min_bucket <= 0 else tuple(sorted(set(range(min_bucket, max_tokens + 1, min_bucket)) | {max_tokens}))


def row_buckets(max_tokens: int, min_bucket) -> list[int]:
    """Every row length packing.bucket can return for these settings."""
    from jaxodc.balance.packing import bucket
    return sorted({bucket(t, max_tokens, min_bucket) for t in range(1, max_tokens + 1)})


def _optimizer(lr):
    import optax
    from jaxodc.optim.clipping import clip_by_global_norm
    return optax.chain(clip_by_global_norm(1.0), optax.adam(lr))


# --------------------------------------------------------------------------- warm-up and calibration

def time_collective(trainer, rows, repeats: int, fields=()) -> dict[int, float]:
    """Median seconds of the collective microbatch step per row length, all ranks in lock-step on
    the same all-padding shape (dense compute does not depend on content), gradients discarded.
    Every rank must call it with the same arguments."""
    from jaxodc.balance.packing import pack
    out = {}
    for T in rows:
        batch = pack([], int(T), fields=fields).as_dict()  # fields: the task's per-token arrays
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            trainer.discard_microbatch(batch)
            ts.append(time.perf_counter() - t0)
        out[int(T)] = statistics.median(ts)
    return out


def warmup_odc(trainer, rows, repeats: int, barrier=lambda: None, fields=()) -> tuple[dict[int, float], dict[int, float]]:
    """Compile the ODC microbatch step for every row length and the optimizer step, and time the
    microbatch step (median seconds per row length) on an all-padding row and on a row holding one
    sample of the row's length, inside one discarded minibatch: the pushed gradients are fetched
    and dropped; the optimizer runs on copies; the unchanged shards are republished for the next
    version. Parameters and optimizer state are untouched. Returns (padding, full) tables. Every
    rank must call it with the same arguments (it completes a minibatch); `barrier()` (all
    ranks) runs between compiling and timing, so no rank times while a peer compiles."""
    import jax
    import jax.numpy as jnp
    from jaxodc.balance.packing import Sample, pack
    v, rt = trainer.version, trainer.rt
    ntok, ver = jnp.float32(1.0), jnp.int32(v)
    pad, full = {}, {}
    for T in rows:
        row = np.arange(int(T), dtype=np.int32) % 251 + 1
        if fields:  # a task's sample: every target trained, its per-token fields zero
            row = Sample(row, np.r_[np.ones(int(T) - 1), 0.0].astype(np.float32),
                         {k: np.zeros(int(T), np.float32) for k in fields})
        for table, content in ((pad, []), (full, [row])):
            batch = {k: jnp.asarray(x) for k, x in pack(content, int(T), fields=fields).as_dict().items()}
            jax.block_until_ready(trainer._mb_step(trainer.shards, trainer.consts, batch, ntok, ver))  # compile
            barrier()
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(trainer._mb_step(trainer.shards, trainer.consts, batch, ntok, ver))
                ts.append(time.perf_counter() - t0)
            table[int(T)] = statistics.median(ts)
    rt.done(v)
    rt.wait_complete(v)
    trainer.warm_end()  # the end-of-minibatch programs; this minibatch's gradients dropped
    trainer._publish(trainer.shards, v + 1)
    trainer.version = v + 1
    return pad, full


def fit_cost(pads: list[dict[int, float]], fulls: list[dict[int, float]] | None = None):
    """CostModel (seconds, cost.fit: a per s^2, b per row token, c per microbatch) of the mean
    over ranks of per-row-length step times: `pads` time all-padding rows (no attention work),
    `fulls` rows holding one sample of the row's length. Without `fulls`, a = 0."""
    from jaxodc.balance.cost import fit
    rows = sorted(pads[0])
    sq, tok, sec = [], [], []
    for tables, attn in ((pads, False), (fulls or [], True)):
        if not tables:
            continue
        for T in rows:
            sq.append(float(T * T) if attn else 0.0)
            tok.append(float(T))
            sec.append(float(np.mean([t[T] for t in tables])))
    if len(sec) < 2:  # one bucket, no content timing: a linear model through its time
        from jaxodc.balance.cost import CostModel
        return CostModel(0.0, sec[0] / tok[0])
    return fit(sq, tok, sec)


# --------------------------------------------------------------------------- throughput worker

def _blocks(args, W: int, n: int):
    """[(rep, mb, [minibatch index arrays])] in run order; the same on every rank."""
    out = []
    for rep in range(args.reps):
        for mb in _ints(args.minibatch):
            k = max(1, math.ceil(args.block_samples / mb))
            rng = np.random.default_rng([args.seed, rep, mb])
            idx = rng.choice(n, size=k * W * mb, replace=k * W * mb > n)
            out.append((rep, mb, [idx[i * W * mb:(i + 1) * W * mb] for i in range(k)]))
    return out


def train_worker(args) -> None:
    import jax
    import msgpack

    from jaxodc.launch.context import init_from_env, init_jax_distributed, shutdown
    from jaxodc.balance.plan import make_plan
    from jaxodc.train.collective import CollectiveTrainer
    from jaxodc.train.odc import OdcTrainer
    from jaxodc.data import synthetic_text
    from jaxodc.odc import Runtime
    from jaxodc.balance.packing import bucket
    from jaxodc.modeling.units import make_layout
    from jaxodc.models.lm import LM, LMConfig
    from jaxodc.train.straggle import parse_straggle

    ctx = init_from_env()
    init_jax_distributed(ctx)
    W, rank = ctx.world, ctx.rank
    # every combo without, then with each injection
    variants = [None] + [s for s in map(parse_straggle, args.straggle) if s is not None]
    fields, tmp = (), None
    if args.task:  # a generated HF checkpoint, each rank reading its own ranges of it
        tmp = tempfile.TemporaryDirectory(prefix="jaxodc-bench-task-")
        programs, params, samples, fields = task_workload(args, W, tmp.name)
        model_gloo = model_odc = programs["contiguous"]
        model_lockstep = programs["per_leaf"]
        runtime_units = model_odc.runtime_units()
    else:
        model_gloo = model_odc = model_lockstep = LM(LMConfig(d_model=args.d_model, n_layers=args.layers,
                                                              n_heads=args.heads))
        params = model_odc.init(jax.random.PRNGKey(args.seed))
        samples = synthetic_text(args.preset, args.pool, args.max_tokens, seed=args.seed + 1, min_len=8)
        runtime_units = [u.padded for u in make_layout(params, W, order=model_odc.unit_names).units]
    lengths = samples.lengths
    buckets = bucket_policy(args.max_tokens, args.min_bucket)
    rows = row_buckets(args.max_tokens, buckets)

    # Over gloo the baseline runs its fastest layout: one all-gather per unit ("contiguous"). The
    # memory-lean default, one per parameter ("per_leaf"), pays gloo's per-call cost on every leaf
    # (about half the samples/s at minibatch 1; bench/RESULTS.md). The lock-step transport's calls
    # are cheap, so it keeps the default.
    # (a Program keeps the sharding it was built with: task_workload builds both kinds)
    coll = CollectiveTrainer(model_gloo, _optimizer(args.lr), params, sharding="contiguous")
    coll_j = CollectiveTrainer(model_lockstep, _optimizer(args.lr), params, transport="jaxodc")
    rt = Runtime.create(runtime_units, ctx, accumulate=accumulate_of(args))
    odc = OdcTrainer(model_odc, _optimizer(args.lr), params, rt)
    chosen = {c.strip() for c in args.combos.split(",")}
    combos = tuple(c for c in COMBOS if f"{c[0]}+{c[1]}" in chosen)
    trainers = {"collective": coll, "collective@jaxodc": coll_j, "odc": odc}
    if args.compare_sum:  # the same trainer over a runtime summing pushes the other way
        other = "fp32" if rt.accumulate == "exact" else "exact"
        rt_other = Runtime(runtime_units, rank=ctx.rank, world=ctx.world, rendezvous=ctx.rendezvous,
                           job_id=f"{ctx.job_id}_{other}", secret=ctx.secret, accumulate=other)
        trainers[sum_comm(other)] = OdcTrainer(model_odc, _optimizer(args.lr), params, rt_other)
        combos += ((sum_comm(other), "lb_mini"),)
    del params
    coll.warmup(rows, fields)
    coll_j.warmup(rows, fields)
    t_odc, t_odc_full = warmup_odc(odc, rows, args.calib_reps, barrier=lambda: ctx.barrier("bench/warmup"), fields=fields)
    t_coll0 = time_collective(coll, rows, args.calib_reps, fields)
    calib0 = [msgpack.unpackb(b, strict_map_key=False)
              for b in ctx.allgather("bench/calib", msgpack.packb([t_coll0, t_odc, t_odc_full]))]
    tables = [[{int(k): v for k, v in t.items()} for t in c] for c in calib0]
    # Every rank plans with the same models (means over ranks). Each trainer plans with its own:
    # ODC's from its step times with and without content; the collective's lock-step times have
    # no content, so it takes ODC's attention coefficient.
    cost_odc = fit_cost([t[1] for t in tables], [t[2] for t in tables])
    att = cost_odc.a
    fit = fit_cost([t[0] for t in tables])
    cost_coll = type(fit)(att, fit.b, fit.c)
    costs = {"collective": cost_coll, "collective@jaxodc": cost_coll}
    costs.update({c: cost_odc for c in trainers if c.startswith("odc")})
    for c in trainers:
        if c.startswith("odc/"):
            warmup_odc(trainers[c], rows, 1, barrier=lambda: ctx.barrier("bench/warmup_sum"), fields=fields)

    def bk(plan, mbs, m):
        return bucket(plan.microbatch_tokens(mbs[m]) if m < len(mbs) else 0, args.max_tokens, buckets)

    def sq(plan, mbs, m):  # attention work of microbatch m: sum of its samples' s^2
        return float(sum(plan.lengths[i] ** 2 for i in mbs[m])) if m < len(mbs) else 0.0

    def busy_collective(res, plan, table):
        """Lock-step step m runs the largest bucket of any rank's m-th microbatch, and takes as long
        as its slowest rank: t(step bucket) + a * max over ranks of their attention work. Of its
        measured interval, this rank's own work is the share (t(own bucket) + a * own attention
        work) / that (empty: 0); the rest is waiting, or computing padding for the lock-step shape."""
        own = plan.ranks[rank]
        busy = 0.0
        for m, (a, b) in enumerate(res.microbatches):
            if m < len(own) and own[m]:
                step = max(bk(plan, plan.ranks[r], m) for r in range(W))
                slowest = table[step] + att * max(sq(plan, plan.ranks[r], m) for r in range(W))
                busy += (b - a) * (table[bk(plan, own, m)] + att * sq(plan, own, m)) / slowest
        return busy

    def busy_odc(res, plan):
        """ODC's cost-model busy time (bubble_model): its microbatches by the ODC model, with
        linear work following the bucketed row length."""
        return sum(cost_odc.c + cost_odc.b * bucket(plan.microbatch_tokens(m), args.max_tokens, buckets)
                   + att * sum(plan.lengths[i] ** 2 for i in m) for m in res.ran if m)

    records, calib = [], [{"rep": -1, "rank": rank, "collective": t_coll0, "odc": t_odc, "odc_full": t_odc_full,
                            "attention": att}]
    rep_now, turn = None, 0
    t_coll = {"collective": t_coll0}
    data_step = 0  # the data minibatch: what injection keys on, the same for every combo that runs it
    for rep, mb, batches in _blocks(args, W, len(samples)):
        if rep != rep_now:  # re-time the collective buckets: its busy estimate follows the load
            rep_now = rep
            ctx.barrier("bench/calib")
            t_coll = {c: time_collective(trainers[c], rows, args.calib_reps, fields) for c in ("collective", "collective@jaxodc")}
            calib.append({"rep": rep, "rank": rank, **t_coll})
        for k, idx in enumerate(batches):
            sub, data_step = [samples[int(i)] for i in idx], data_step + 1
            start, turn = turn % len(combos), turn + 1
            for straggle, ci in [(v, c) for v in variants for c in list(range(start, len(combos))) + list(range(start))]:
                comm, balance = combos[ci]
                tr = trainers[comm]
                tr.straggle = straggle and dataclasses.replace(straggle, pinned=data_step)
                plan = make_plan(balance, lengths[idx].tolist(), W, args.max_tokens, costs[comm])
                ctx.barrier("bench/minibatch")
                res = tr.train_plan(plan, sub, min_bucket=buckets)
                mine = [i for m in res.ran for i in m]
                own = set(plan.ranks[rank])
                mine_own = [m for m in range(len(res.ran)) if res.ran[m] in own]
                opt_s = res.opt[1] - res.opt[0]
                busy = busy_odc(res, plan) if comm.startswith("odc") else busy_collective(res, plan, t_coll[comm])
                records.append({
                    "comm": comm, "balance": balance, "minibatch": mb, "rep": rep, "k": k, "rank": rank,
                    "t_start": res.t_start, "t_end": res.t_end, "compute": [list(c) for c in res.microbatches],
                    "opt": list(res.opt), "samples": len(mine), "tokens": int(sum(plan.lengths[i] for i in mine)),
                    "loss": res.loss, "n_micro": sum(1 for m in res.ran if m), "busy_est": busy + opt_s,
                    "cpu": res.cpu, "stolen": sum(1 for m in res.ran if m and m not in own),
                    # where stealing could act: when this rank drained its own deque (s after the
                    # start), the seconds it spent on others' microbatches, whether it was throttled
                    "own_done": (res.microbatches[mine_own[-1]][1] - res.t_start) if mine_own else 0.0,
                    "stolen_s": sum(b - a for m, (a, b) in zip(res.ran, res.microbatches) if m and m not in own),
                    "throttled": bool(straggle and straggle.throttles(data_step, rank)),
                    "straggle": straggle.spec() if straggle else None, "straggle_s": sum(res.straggle_s or []),
                    "end_s": res.end_s})
    for c, tr in trainers.items():
        if c.startswith("odc"):
            tr.rt.close()
    coll_j.close()
    if tmp is not None:
        tmp.cleanup()
    blobs = ctx.allgather("bench/records", msgpack.packb({"records": records, "calib": calib}))
    if rank == 0:
        merged = {"records": [], "calib": [], "cost": [cost_odc.a, cost_odc.b, cost_odc.c],
                  "cost_collective": [cost_coll.a, cost_coll.b, cost_coll.c], "attention_coefficient": att, "rows": rows,
                  "lengths": [int(x) for x in lengths],  # what the simulator's ceiling replays
                  "config": {k: v for k, v in vars(args).items() if k not in ("worker", "out")}}
        for b in blobs:
            d = msgpack.unpackb(b, strict_map_key=False)
            merged["records"] += d["records"]
            merged["calib"] += d["calib"]
        with open(args.out, "w") as f:
            json.dump(merged, f)
    shutdown(ctx)


# --------------------------------------------------------------------------- post-training workloads

def task_workload(args, world: int, tmp: str):
    """--task: ({sharding: program} of a generated Llama-style HF checkpoint, its abstract
    params, the samples, their per-token fields). The checkpoint (vocab 256: byte tokens;
    --d-model, --layers, --heads) is written to `tmp` and loaded with jaxodc.modeling.load_hf the
    way `jaxodc train --model hf:DIR --task` does (cli/train_models.py's hf_model_of, with_reference):
    "contiguous" (ODC, and the collective over gloo: one all-gather per unit) and "per_leaf"
    (the collective over the lock-step transport), each rank reading only its own ranges. The
    data: a generated chat JSONL (sft; the ChatML template, loss on the assistant turns) or
    rollout JSONL (grpo; groups of 4 completions per prompt with rewards and behaviour
    log-probs, GRPO's default objective), --pool samples with --preset's long-tailed lengths in
    words, read by jaxodc.modeling.dataset (truncated at --max-tokens). Every rank writes and
    reads the same files."""
    from jaxodc.cli.train import parser
    from jaxodc.cli.train_models import hf_model_of, with_reference
    from jaxodc.modeling import synthetic, synthetic_data
    from jaxodc.modeling.chat import CHATML
    from jaxodc.modeling.dataset import load_rollouts, load_sft
    from jaxodc.modeling.tokenizer import ByteTokenizer
    from jaxodc.balance.packing import fields_of
    ckpt = os.path.join(tmp, "model")
    synthetic.write_checkpoint(ckpt, synthetic.tiny_config(
        vocab=ByteTokenizer.vocab_size, hidden=args.d_model, layers=args.layers, heads=args.heads,
        kv_heads=max(1, args.heads // 2), ffn=4 * args.d_model, max_position_embeddings=max(256, args.max_tokens)),
        seed=args.seed)
    # the train CLI's own settings for `--model hf:DIR --task` (GRPO: its defaults)
    cli = parser().parse_args(["--model", f"hf:{ckpt}", "--task", args.task, "--max-tokens", str(args.max_tokens)])
    words = max(8, args.max_tokens // 6)  # ~6 bytes a word
    path = os.path.join(tmp, f"{args.task}.jsonl")
    if args.task == "sft":
        tok = ByteTokenizer(chat_template=CHATML)
        samples, _ = load_sft(synthetic_data.write_chat(path, args.pool, words, args.seed, args.preset), tok,
                              args.max_tokens)
    else:
        tok = ByteTokenizer()
        synthetic_data.write_rollouts(path, tok, max(1, args.pool // 4), 4, words, args.seed, args.preset)
        samples, _ = load_rollouts(path, tok, args.max_tokens)
    programs = {}
    for sharding, comm in (("contiguous", "odc"), ("per_leaf", "collective")):  # hf_model_of: comm's sharding
        programs[sharding], params = hf_model_of(cli, world, comm)
    samples = with_reference(cli, programs["contiguous"], params, samples)
    return programs, params, samples, fields_of(samples.tokens)


# --------------------------------------------------------------------------- main

def _launch(args, world: int, mode: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"{mode}_w{world}.json")
        argv = ["--worker", mode, "--out", out] + extra
        launch_ranks(world, "jaxodc.bench.train", argv, timeout_s=args.timeout)
        with open(out) as f:
            return json.load(f)


def _forward(args) -> list[str]:
    keys = ("minibatch", "reps", "combos", "block_samples", "calib_reps", "preset", "pool", "max_tokens", "min_bucket",
            "d_model", "layers", "heads", "lr", "seed", "memory_d_model", "memory_layers", "memory_tokens",
            "memory_steps", "memory_slot_mib", "memory_collective_transport", "precision")
    out = [x for k in keys for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    out += ["--task", args.task] if args.task else []
    out += ["--compare-sum"] if args.compare_sum else []
    out += ["--reproducible"] if args.reproducible else []
    return out + [x for s in args.straggle for x in ("--straggle", s)]


def main(argv: list[str]) -> int:
    if any(a == "--hosts" or a.startswith("--hosts=") for a in argv):  # across emulated hosts (bench/hosts.py)
        from jaxodc.bench import hosts
        return hosts.main(argv)
    args = _args(argv)
    if args.worker:  # one core per rank (before jax is imported): "one compute thread each"
        pin_one_core(int(os.environ.get("JAXODC_LOCAL_RANK", "0")))
    if args.worker == "train":
        train_worker(args)
        return 0
    if args.worker == "compress" or args.compress:
        from jaxodc.bench import train_compress
        return train_compress.worker(args) or 0 if args.worker else train_compress.run(args)
    if args.worker == "memory" or args.memory:
        from jaxodc.bench import train_memory
        return train_memory.worker(args) if args.worker else train_memory.run(args)
    from jaxodc.bench.train_report import draw_timeline, print_report, summarize
    t0 = time.perf_counter()
    raw = _launch(args, args.ranks, "train", _forward(args))
    from jaxodc.bench.straggle_predict import predict
    predicted = predict(raw) if args.straggle else []
    rows, bar_rows = summarize(raw, predicted)
    if args.raw:
        write_records(args.raw, raw)
    write_records(args.json, rows + [dict(b, kind="bar") for b in bar_rows]
                  + [dict(p, kind="prediction") for p in predicted]
                  + [{"kind": "calibration", "cost_odc": raw["cost"], "cost_collective": raw["cost_collective"],
                      "rows": raw["rows"], "tables": raw["calib"], "config": raw["config"]}])
    print_report(rows, bar_rows, raw)
    for p in predicted:
        print(f"minibatch {p['minibatch']}, straggle {p['straggle']}: simulator on the same minibatches and slowdowns, "
              f"compute only, over odc+lb_mini: lb_steal {p['steal']:.3f}, clairvoyant {p['clairvoyant']:.3f}, "
              f"fluid {p['fluid']:.3f}; expected over {p['expected_minibatches']} fresh minibatches: "
              f"lb_steal {p['expected_steal']:.3f}, clairvoyant {p['expected_clairvoyant']:.3f}")
    if args.timeline:
        os.makedirs(os.path.dirname(os.path.abspath(args.timeline)) or ".", exist_ok=True)
        print(f"timeline: {os.path.abspath(draw_timeline(raw, args.timeline))}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
