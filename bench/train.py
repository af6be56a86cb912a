"""`jaxodc bench train`: ODC vs the collective baseline, end to end, on the small LM.

    python -m jaxodc bench train --json bench/out/train.json [--timeline bench/out/train_timeline.png]
    python -m jaxodc bench train --memory --json bench/out/train_memory.json    # peak memory at W = 2, 4
    python -m jaxodc bench train --memory --precision bf16 --json bench/out/train_memory_bf16.json
    python -m jaxodc bench train --compress default --link-mbps 100 --json bench/out/train_compress_100.json
    python -m jaxodc bench train --minibatch 4,8 --block-samples 32 --straggle default \
        --json bench/out/train_straggle.json
    python -m jaxodc bench train --task sft --json bench/out/train_sft.json     # chat SFT, masked loss
    python -m jaxodc bench train --task grpo --json bench/out/train_grpo.json   # GRPO on rollouts

(--task: a generated Llama-style HF checkpoint, loaded as `jaxodc train --model hf:DIR` does.)

The memory mode is bench/train_memory.py, the compression mode (TAGC vs dense over an emulated
link) bench/train_compress.py. With --straggle, every combo runs again under each injection
(slowdowns keyed on the data minibatch, the same for every combo), and bench/straggle_predict.py
replays the same minibatches and slowdowns in the simulator for what any balancer could gain.
Methodology (interleaving, bubble accounting, memory accounting): bench/README.md.
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

from jaxodc.bench.common import paired_ratio, pooled_ratio, print_table, write_records
from jaxodc.launch.launcher import launch_ranks, pin_one_core

# "collective" runs jax's collectives (gloo on CPU); "collective@jaxodc" the same trainer over
# jaxodc's own lock-step collective (csrc/lockstep: the shm path ODC uses), so that odc against it
# measures ODC's scheduling, not a faster transport.
COMBOS = (("collective", "local_sort"), ("collective", "lb_micro"), ("collective@jaxodc", "lb_micro"), ("odc", "local_sort"),
          ("odc", "lb_micro"), ("odc", "lb_mini"), ("odc", "lb_steal"))
MiB = 1 << 20


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
    p.add_argument("--minibatch", default="1,2,4,8", help="samples per rank per minibatch (list)")
    p.add_argument("--reps", type=int, default=16,
                   help="interleaved repetitions (medians over these; 16 keeps the barred ratios' 95%% "
                        "intervals within about +-5%% on the 2-core machine)")
    p.add_argument("--block-samples", type=int, default=8,
                   help="samples per rank per minibatch size per repetition (minibatch 4: 2 minibatches)")
    p.add_argument("--calib-reps", type=int, default=3, help="timings per bucket per calibration")
    p.add_argument("--preset", default="longalign", help="sample-length preset (long-tailed)")
    p.add_argument("--pool", type=int, default=512, help="samples drawn from the preset")
    p.add_argument("--max-tokens", type=int, default=2048,
                   help="the longest sample's tokens, and the packed microbatch's cap (the paper's setting)")
    p.add_argument("--min-bucket", type=int, default=256,
                   help="row lengths are the multiples of this up to --max-tokens (0: powers of two from 64)")
    p.add_argument("--d-model", type=int, default=64, help="small beside --max-tokens: attention dominates long samples")
    p.add_argument("--layers", type=int, default=2)
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
    p.add_argument("--compress-steps", type=int, default=30, help="--compress: minibatches per run")
    p.add_argument("--compress-minibatch", type=int, default=4, help="--compress: samples per rank per minibatch")
    p.add_argument("--loss-png", help="--compress: loss-vs-samples plot of the four runs")
    p.add_argument("--task", choices=("sft", "grpo"), default=None,
                   help="train a generated Llama-style HF checkpoint (--d-model, --layers, --heads) on a generated "
                        "chat JSONL (sft: loss on the assistant turns) or rollout JSONL (grpo: the clipped objective) "
                        "with long-tailed lengths instead of the small LM on plain text (task_workload)")
    p.add_argument("--compare-sum", action="store_true",
                   help="also run odc+lb_mini with the other accumulation of pushes (exact <-> fp32; "
                        "$JAXODC_ODC_ACCUMULATE picks the main one), interleaved, and print their ratio")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--worker", choices=("train", "memory", "compress"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


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
    rt = Runtime.create(runtime_units, ctx)
    odc = OdcTrainer(model_odc, _optimizer(args.lr), params, rt)
    combos, trainers = COMBOS, {"collective": coll, "collective@jaxodc": coll_j, "odc": odc}
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


# --------------------------------------------------------------------------- throughput report

def _minibatch_records(recs: list[dict], busy: str | None, step_of=lambda r: (r["rep"], r["k"])):
    """MinibatchRecords with busy time from record field `busy` ("busy_est", "cpu"), or None:
    the measured microbatch + optimizer intervals."""
    from jaxodc.train.metrics import MinibatchRecord
    steps = {}
    out = []
    for r in recs:
        s = steps.setdefault(step_of(r), len(steps))
        out.append(MinibatchRecord(r["rank"], s, r["t_start"], r["t_end"], [tuple(c) for c in r["compute"]],
                                   tuple(r["opt"]), r["samples"], r["tokens"], r["loss"], r["comm"], r["balance"],
                                   r[busy] if busy else None))
    return out


def _busy_span(recs: list[dict]) -> float:
    """Sum over minibatches of (last rank's end - first rank's start): the time the combo ran,
    without the barriers between minibatches."""
    by: dict = {}
    for r in recs:
        by.setdefault(r["k"], []).append(r)
    return sum(max(r["t_end"] for r in g) - min(r["t_start"] for r in g) for g in by.values())


def _median_or_none(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ceilings(raw: dict) -> dict[int, float]:
    """Per minibatch size, the simulator's odc+lb_mini / collective+lb_micro samples/s ratio on the
    run's own minibatches (every repetition's), with the run's calibrated ODC cost model: compute
    only, no injection."""
    from jaxodc.balance.cost import CostModel
    from jaxodc.balance.simulate import ceiling, replay
    from jaxodc.data import synthetic_text
    if "config" not in raw or "cost" not in raw:  # records alone (tests): no run to replay
        return {}
    cfg = argparse.Namespace(**raw["config"])
    W = len({r["rank"] for r in raw["records"]})
    if "lengths" in raw:  # the run's own samples (--task: the generated JSONL's, tokenized)
        lengths = np.asarray(raw["lengths"])
    else:
        lengths = synthetic_text(cfg.preset, cfg.pool, cfg.max_tokens, seed=cfg.seed + 1, min_len=8).lengths
    cost = CostModel(*raw["cost"])
    by_mb: dict = {}
    for _, mb, batches in _blocks(cfg, W, len(lengths)):
        by_mb.setdefault(mb, []).extend(lengths[idx].tolist() for idx in batches)
    return {mb: ceiling(replay(mbs, W, cfg.max_tokens, cost)) for mb, mbs in by_mb.items()}


def attention_share(raw: dict) -> float:
    """Attention's share of a longest (max_tokens) sample's microbatch compute under the run's
    calibrated ODC cost model (a*s^2 over a*s^2 + b*s + c)."""
    a, b, c = raw["cost"]
    s = float(raw["config"]["max_tokens"])
    return a * s * s / (a * s * s + b * s + c) if a * s * s + b * s + c > 0 else 0.0


def summarize(raw: dict) -> tuple[list[dict], list[dict]]:
    """(one record per (combo, minibatch, injection), bar lines) from the ranks' raw minibatch
    records: the plain runs' bars, then, with --straggle, the injected runs'."""
    rows, bar_rows = [], []
    ceil = ceilings(raw)
    for straggle in sorted({r.get("straggle") for r in raw["records"]}, key=lambda x: x is not None):
        recs = [r for r in raw["records"] if r.get("straggle") == straggle]
        out, per_rep = _summarize_cells(recs)
        for r in out:
            r["straggle"] = straggle
            r["ceiling"] = ceil.get(r["minibatch"])
        rows += out
        bar_rows += bars(out, per_rep) if straggle is None else injected_bars(out, per_rep, straggle)
    return rows, bar_rows


def _summarize_cells(records: list[dict]) -> tuple[list[dict], dict]:
    from jaxodc.train.metrics import records_bubble_rate as bubble_rate
    W = len({r["rank"] for r in records})
    cells: dict = {}
    for r in records:
        cells.setdefault((r["comm"], r["balance"], r["minibatch"]), {}).setdefault(r["rep"], []).append(r)
    per_rep: dict = {}  # (comm, balance, mb) -> {rep: (samples, seconds)}
    out = []
    for (comm, balance, mb), reps in cells.items():
        sps, tps, bub_meas, bub_est, bub_cpu = {}, {}, [], [], []
        for rep, recs in sorted(reps.items()):
            span = _busy_span(recs)
            sps[rep] = sum(r["samples"] for r in recs) / span
            tps[rep] = sum(r["tokens"] for r in recs) / span
            meas = bubble_rate(_minibatch_records(recs, None))
            est = bubble_rate(_minibatch_records(recs, "busy_est"))
            bub_cpu.append(bubble_rate(_minibatch_records(recs, "cpu")))
            bub_meas.append(meas)
            bub_est.append(est)
        per_rep[(comm, balance, mb)] = {rep: (sum(r["samples"] for r in recs), _busy_span(recs))
                                        for rep, recs in reps.items()}
        allrecs = [r for recs in reps.values() for r in recs]
        steps = {(r["rep"], r["k"]) for r in allrecs}
        last = max(allrecs, key=lambda r: (r["rep"], r["k"]))
        v = list(sps.values())
        out.append({
            "kind": "train", "comm": comm, "balance": balance, "minibatch": mb, "ranks": W,
            "transport": TRANSPORT[comm.split("/")[0]],
            "samples_per_s": statistics.median(v), "bubble_rate": statistics.median(bub_cpu),
            "tokens_per_s": statistics.median(tps.values()),
            "samples_per_s_min": min(v), "samples_per_s_max": max(v),
            "bubble_intervals": statistics.median(bub_meas), "bubble_model": statistics.median(bub_est),
            "bubble_source": "cpu time",
            "reps": len(v), "steps": len(steps),
            # the whole run's samples over its time: every minibatch weighted by its length
            "samples_per_s_pooled": sum(r["samples"] for r in allrecs) / sum(_busy_span(g) for g in reps.values()),
            "steals": sum(r.get("stolen", 0) for r in allrecs),
            "minibatches_with_steals": len({(r["rep"], r["k"]) for r in allrecs if r.get("stolen", 0)}),
            "microbatches_per_rank": sum(r["n_micro"] for r in allrecs) / (W * len(steps)),
            "loss": last["loss"],
            "straggle_s_per_minibatch": sum(r.get("straggle_s", 0.0) for r in allrecs) / len(steps),
            "stolen_s_per_minibatch": sum(r.get("stolen_s", 0.0) for r in allrecs) / len(steps),
            "minibatches_throttled": len({(r["rep"], r["k"]) for r in allrecs if r.get("throttled")}),
            # the end of a minibatch (StepResult.end_s): the median over ranks and minibatches
            "end_s": _median_or_none([r.get("end_s") for r in allrecs]),
        })
    order = {c: i for i, c in enumerate(COMBOS)}
    out.sort(key=lambda r: (r["minibatch"], order.get((r["comm"], r["balance"]), len(order))))
    return out, per_rep


def _paired(per_rep, a, b, mb):
    """Combo a over combo b at minibatch mb, repetitions paired (same repetition = same
    minibatches): {"median": median of per-repetition samples/s ratios, "ci95": its paired
    bootstrap interval, "range": (min, max) per repetition, "pooled": whole-run ratio (samples over
    summed spans), "pooled_ci95"}; None when either is missing."""
    ra, rb = per_rep.get((*a, mb)), per_rep.get((*b, mb))
    if not ra or not rb:
        return None
    ks = [k for k in ra if k in rb]
    A, B = [ra[k] for k in ks], [rb[k] for k in ks]
    r = [(x[0] / x[1]) / (y[0] / y[1]) for x, y in zip(A, B)]
    med, lo, hi = paired_ratio([x[0] / x[1] for x in A], [y[0] / y[1] for y in B])
    pooled, plo, phi = pooled_ratio([x[0] for x in A], [x[1] for x in A], [y[0] for y in B], [y[1] for y in B])
    return {"median": med, "ci95": [lo, hi], "range": [min(r), max(r)], "pooled": pooled, "pooled_ci95": [plo, phi]}


def _bar(name, mb, p, threshold=None, passed=None, **extra) -> dict:
    return {"bar": name, "minibatch": mb, "value": p["median"], "ci95": p["ci95"], "range": p["range"],
            "threshold": threshold, "pass": passed, **extra}


def gain_share(value: float, ceiling: float | None) -> float | None:
    """Fraction of the simulator's gain a measured ratio realises: (value - 1) / (ceiling - 1)."""
    if ceiling is None or not ceiling > 1.0:
        return None
    return (value - 1.0) / (ceiling - 1.0)


def bars(rows: list[dict], per_rep: dict) -> list[dict]:
    """The issue's bars, one dict each: {"bar", "minibatch", "value", "ci95", "threshold", "pass", ...}."""
    out = []
    mbs = sorted({r["minibatch"] for r in rows})
    cell = {(r["comm"], r["balance"], r["minibatch"]): r for r in rows}
    base, mini, steal = ("collective", "lb_micro"), ("odc", "lb_mini"), ("odc", "lb_steal")
    fair, micro = ("collective@jaxodc", "lb_micro"), ("odc", "lb_micro")
    for mb in mbs:  # the same transport: what ODC's decoupled microbatches and LB-Mini buy
        p = _paired(per_rep, mini, fair, mb)
        if p:
            ceil = cell[(*mini, mb)].get("ceiling")
            share = gain_share(p["median"], ceil)
            gated = mb in (4, 8)
            ok = p["median"] >= 1.07 and share is not None and share >= 0.75
            out.append(_bar("odc+lb_mini / collective@jaxodc+lb_micro samples/s", mb, p, 1.07 if gated else None,
                            ok if gated else None, ceiling=ceil, gain_share=share))
    p = _paired(per_rep, micro, fair, 1) if 1 in mbs else None
    if p:  # identical schedules on the same transport: the two trainers' own overheads
        out.append(_bar("odc+lb_micro / collective@jaxodc+lb_micro samples/s (identical schedules)", 1, p, 1.0,
                        p["median"] >= 1.0))
    for mb in mbs:
        p = _paired(per_rep, mini, base, mb)
        if p:
            out.append(_bar("odc+lb_mini / collective+lb_micro samples/s", mb, p))
    for mb in mbs:
        p = _paired(per_rep, steal, mini, mb)
        if p:
            s = cell[(*steal, mb)]
            # Context for a ratio near 1: how often a steal changed the schedule at all (the
            # other minibatches run LB-Mini's partition), and the whole run's ratio.
            # stealing must cost (almost) nothing when nothing is uneven
            out.append(_bar("odc+lb_steal / odc+lb_mini samples/s", mb, p, 0.97, p["median"] >= 0.97,
                            pooled=p["pooled"], minibatches_with_steals=s["minibatches_with_steals"],
                            minibatches=s["steps"]))
    for mb in mbs:
        if mb < 4:
            continue
        b = cell.get((*fair, mb))
        for odc in (mini, steal):
            o = cell.get((*odc, mb))
            if b and o:
                val = o["bubble_rate"] / b["bubble_rate"] if b["bubble_rate"] > 0 else float("inf")
                out.append({"bar": f"{odc[0]}+{odc[1]} bubble / collective@jaxodc+lb_micro bubble", "minibatch": mb,
                            "value": val, "threshold": None, "pass": None,
                            "odc_bubble": o["bubble_rate"], "collective_bubble": b["bubble_rate"]})
    for other in ("fp32", "exact"):  # --compare-sum: the exact sum over fp32 arrival order
        exact, fp32 = (mini, (sum_comm(other), "lb_mini")) if other == "fp32" else ((sum_comm(other), "lb_mini"), mini)
        for mb in mbs:
            p = _paired(per_rep, exact, fp32, mb)
            if p:
                out.append(_bar("odc+lb_mini exact sum / fp32 sum samples/s (reproducible accumulation)", mb, p, 0.97,
                                p["median"] >= 0.97, pooled=p["pooled"], pooled_ci95=p["pooled_ci95"]))
    o, c = cell.get((*mini, 4)), cell.get((*fair, 4))
    if o and c and o.get("end_s") is not None and c.get("end_s"):
        val = o["end_s"] / c["end_s"]
        out.append({"bar": "odc+lb_mini end_s / collective@jaxodc+lb_micro end_s (median end of minibatch)",
                    "minibatch": 4, "value": val, "threshold": 1.2, "pass": val <= 1.2,
                    "odc_end_s": o["end_s"], "collective_end_s": c["end_s"]})
    return out


def injected_bars(rows: list[dict], per_rep: dict, straggle: str) -> list[dict]:
    """The bars under straggler injection: ODC's balancing against the collective on the same
    transport, and stealing against LB-Mini, at minibatch 4 and 8. The value is the whole run's
    throughput ratio (samples over the summed minibatch spans): slowdowns are rare events that
    hit a minority of repetitions, and the median of per-repetition ratios would look past them
    (the median is kept as "median")."""
    out = []
    fair, mini, steal = ("collective@jaxodc", "lb_micro"), ("odc", "lb_mini"), ("odc", "lb_steal")
    cell = {(r["comm"], r["balance"], r["minibatch"]): r for r in rows}
    for mb in sorted({r["minibatch"] for r in rows}):
        gated = mb in (4, 8)
        for (a, b, thr) in ((mini, fair, 1.15), (steal, mini, 1.10)):
            p = _paired(per_rep, a, b, mb)
            if p:
                row = {"bar": f"{a[0]}+{a[1]} / {b[0]}+{b[1]} samples/s (straggle {straggle})", "minibatch": mb,
                       "value": p["pooled"], "ci95": p["pooled_ci95"], "median": p["median"], "range": p["range"],
                       "threshold": thr if gated else None, "pass": p["pooled"] >= thr if gated else None,
                       "minibatches_throttled": cell[(*a, mb)]["minibatches_throttled"]}
                if a == steal:
                    s = cell[(*steal, mb)]
                    row.update(minibatches_with_steals=s["minibatches_with_steals"], minibatches=s["steps"])
                out.append(row)
    return out


def print_report(rows: list[dict], bar_rows: list[dict], raw: dict | None = None) -> None:
    print_table([dict(r, combo=f"{r['comm']}+{r['balance']}" + (f" ({r['straggle']})" if r.get("straggle") else ""))
                 for r in rows],
                ["minibatch", "combo", "samples_per_s", "samples_per_s_min", "samples_per_s_max", "tokens_per_s",
                 "bubble_rate", "bubble_intervals", "bubble_model", "microbatches_per_rank", "end_s", "ceiling", "reps"])
    print("(bubble_rate: busy = each rank's process CPU time in the minibatch, every combo alike; bubble_intervals:"
          " busy = microbatch + optimizer intervals; bubble_model: busy from the cost model)")
    if raw:
        a, b, c = raw["cost"]
        ca, cb, cc = raw["cost_collective"]
        warm = next(c for c in raw["calib"] if c["rep"] == -1 and c["rank"] == 0)
        step = lambda mode, T: warm[mode][str(T)]  # noqa: E731 - JSON object keys are strings
        print(f"cost models (s; a*sum(s^2) + b*tokens + c per microbatch): odc a={a:.3g} b={b:.3g} c={c:.3g}, "
              f"collective a={ca:.3g} b={cb:.3g} c={cc:.3g}; microbatch step seconds per row length "
              "(rank 0, warm-up, collective / odc): "
              + ", ".join(f"{T}: {step('collective', T):.4f} / {step('odc', T):.4f}" for T in raw["rows"]))
        print(f"attention share of a {raw['config']['max_tokens']}-token sample (calibrated): {attention_share(raw):.0%}")
    print()
    for b in bar_rows:
        rng = f" (per-rep {b['range'][0]:.2f}..{b['range'][1]:.2f})" if "range" in b else ""
        if "median" in b:
            rng = f" (whole run; median of per-rep {b['median']:.3f}, {b['range'][0]:.2f}..{b['range'][1]:.2f})"
        if "ci95" in b:
            rng = f" [95% {b['ci95'][0]:.3f}..{b['ci95'][1]:.3f}]" + rng
        if b.get("ceiling") is not None:
            share = "" if b.get("gain_share") is None else f", {b['gain_share']:.0%} of its gain"
            rng += f" (ceiling {b['ceiling']:.3f}{share})"
        extra = (f" [odc {b['odc_bubble']:.1%}, collective {b['collective_bubble']:.1%}]"
                 if "odc_bubble" in b else "")
        if "minibatches_with_steals" in b and "pooled" not in b:
            extra += f" [steals in {b['minibatches_with_steals']} of {b['minibatches']} minibatches]"
        if "pooled" in b and "median" not in b:
            steals = (f"; steals in {b['minibatches_with_steals']} of {b['minibatches']} minibatches"
                      if "minibatches_with_steals" in b else "")
            extra += f" [whole run {b['pooled']:.3f}{steals}]"
        verdict = "" if b["pass"] is None else (" PASS" if b["pass"] else " FAIL")
        if isinstance(b["threshold"], list):
            thr = f" (bar within {b['threshold'][0]}..{b['threshold'][1]})"
        else:
            thr = "" if b["threshold"] is None else (f" (bar {'<=' if 'bubble' in b['bar'] or 'end_s' in b['bar'] else '>='} {b['threshold']})")
        print(f"minibatch {b['minibatch']}: {b['bar']} = {b['value']:.3f}{rng}{extra}{thr}{verdict}")


def draw_timeline(raw: dict, path: str, mb: int = 4) -> str:
    from jaxodc.cli.timeline import draw
    recs = raw["records"]
    mbs = sorted({r["minibatch"] for r in recs})
    mb = mb if mb in mbs else mbs[-1]
    rep = max(r["rep"] for r in recs)
    runs = {}
    for comm, balance in COMBOS:
        sel = [r for r in recs if (r["comm"], r["balance"], r["minibatch"], r["rep"]) == (comm, balance, mb, rep)
               and r.get("straggle") is None]
        if sel:
            # bars are the measured intervals; idle and the titles' bubble follow CPU time
            runs[f"{comm}+{balance} (minibatch {mb})"] = _minibatch_records(sel, "cpu", lambda r: r["k"])
    return draw(runs, path, title=f"per-rank compute (bars) and idle, repetition {rep}, minibatch {mb} per rank")


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
    keys = ("minibatch", "reps", "block_samples", "calib_reps", "preset", "pool", "max_tokens", "min_bucket",
            "d_model", "layers", "heads", "lr", "seed", "memory_d_model", "memory_layers", "memory_tokens",
            "memory_steps", "memory_slot_mib", "memory_collective_transport", "precision")
    out = [x for k in keys for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]
    out += ["--task", args.task] if args.task else []
    out += ["--compare-sum"] if args.compare_sum else []
    return out + [x for s in args.straggle for x in ("--straggle", s)]


def main(argv: list[str]) -> int:
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
    t0 = time.perf_counter()
    raw = _launch(args, args.ranks, "train", _forward(args))
    rows, bar_rows = summarize(raw)
    if args.raw:
        write_records(args.raw, raw)
    from jaxodc.bench.straggle_predict import predict
    predicted = predict(raw) if args.straggle else []
    write_records(args.json, rows + [dict(b, kind="bar") for b in bar_rows]
                  + [dict(p, kind="prediction") for p in predicted]
                  + [{"kind": "calibration", "cost_odc": raw["cost"], "cost_collective": raw["cost_collective"],
                      "rows": raw["rows"], "tables": raw["calib"], "config": raw["config"]}])
    print_report(rows, bar_rows, raw)
    for p in predicted:
        print(f"minibatch {p['minibatch']}, straggle {p['straggle']}: simulator on the same minibatches and slowdowns, "
              f"compute only, over odc+lb_mini: lb_steal {p['steal']:.3f}, clairvoyant {p['clairvoyant']:.3f}, "
              f"fluid {p['fluid']:.3f}")
    if args.timeline:
        os.makedirs(os.path.dirname(os.path.abspath(args.timeline)) or ".", exist_ok=True)
        print(f"timeline: {os.path.abspath(draw_timeline(raw, args.timeline))}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
