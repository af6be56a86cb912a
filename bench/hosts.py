"""`jaxodc bench train --hosts H --link-gbps X[,Y]`: ODC + LB-Mini with and without the host gather
cache against collective@jaxodc + LB-Micro, on H emulated hosts (jaxodc.launch.cluster; root)
whose links are shaped to X Gbit/s, with each microbatch's compute emulated as in `bench scale`.

    python -m jaxodc bench train --hosts 2 --link-gbps 1,10 --json bench/out/hosts.json

Every rank runs the tiny LM for real and sleeps its microbatch's modelled accelerator seconds
(`Straggle.emulate`, the cost model of docs/scale.md). The modelled seconds are scaled, per link
rate, so that the ratio of (a host receiving its remote shards once over its link) to (one rank's
mean minibatch compute) equals that of a named cluster (`CLUSTER`: 2 DGX H100 nodes training
Llama-3-8B; docs/hosts.md gives the constants and what the emulation cannot show). Each global
minibatch is run by every combo in turn (rotating which goes first); one record per combo and link
rate: {"hosts", "ranks", "link_gbps", "comm", "balance", "cache", "samples_per_s",
"cross_host_bytes_per_minibatch", "remote_shard_bytes"} with 95% intervals (bootstrap over
minibatches), and ratio lines.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from jaxodc.bench.common import bootstrap, fmt_ratio, pooled_ratio, print_table, write_records

# (comm, balance, host gather cache); the collective has none.
COMBOS = (("collective@jaxodc", "lb_micro", None), ("odc", "lb_mini", True), ("odc", "lb_mini", False))
# The named cluster whose compute-to-link ratio the emulation keeps: 2 DGX H100 nodes (8 x H100 SXM
# each; 8 x ConnectX-7 at 400 Gbit/s = 400 GB/s per node, NVIDIA DGX H100 data sheet), Llama-3-8B
# (8.03e9 parameters, Meta's model card) gathered in bf16, at the H100 / MFU / preset of docs/scale.md.
CLUSTER = {"name": "2 x DGX H100, Llama-3-8B, bf16 gathers", "nodes": 2, "node_link_bytes_s": 400e9,
           "gather_bytes": 8.03e9 * 2}
BAR_VS_COLLECTIVE = 1.10


def _args(argv):
    p = argparse.ArgumentParser(prog="jaxodc bench train --hosts", description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2, help="ranks per host")
    p.add_argument("--link-gbps", default="1,10", help="emulated link rates (list), Gbit/s each direction")
    p.add_argument("--json", help="write the records here")
    p.add_argument("--preset", default="longalign")
    p.add_argument("--minibatch", type=int, default=4, help="samples per rank per minibatch")
    p.add_argument("--minibatches", type=int, default=8, help="global minibatches per link rate (each run by every combo)")
    p.add_argument("--max-len", type=int, default=128, help="real tokens of the longest sample (= microbatch cap)")
    p.add_argument("--d-model", type=int, default=64, help="the real model (its bytes set the link time)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--model", default="llama-8b", help="the emulated model (bench scale's --model)")
    p.add_argument("--accelerator", default="h100")
    p.add_argument("--mfu", type=float, default=0.4)
    p.add_argument("--pool", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gbps", type=float, default=1.0, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def cluster_ratio(args) -> float:
    """(seconds a node of CLUSTER takes to receive its remote shards once) / (one GPU's mean
    minibatch compute at the preset's lengths, bench scale's cost model)."""
    from jaxodc.bench.scale import accelerator_cost
    from jaxodc.data import synthetic_text
    full, _, per_token = accelerator_cost(_scale_args(args))
    lengths = synthetic_text(args.preset, args.pool, args.max_len, seed=args.seed + 1, min_len=min(8, args.max_len)).lengths
    mean_sample_s = float(np.mean(full(np.asarray(lengths) * per_token)))
    remote = CLUSTER["gather_bytes"] * (CLUSTER["nodes"] - 1) / CLUSTER["nodes"]
    return (remote / CLUSTER["node_link_bytes_s"]) / (args.minibatch * mean_sample_s)


def _scale_args(args):
    return argparse.Namespace(mfu=args.mfu, model=args.model, accelerator=args.accelerator, preset=args.preset,
                              max_len=args.max_len, longest_s=1.0)


def worker(args) -> None:
    import jax
    import msgpack
    import optax

    from jaxodc.balance.plan import make_plan
    from jaxodc.bench.scale import accelerator_cost
    from jaxodc.bench.train import warmup_odc
    from jaxodc.data import synthetic_text
    from jaxodc.launch.context import init_from_env, init_jax_distributed, shutdown
    from jaxodc.modeling.units import make_layout
    from jaxodc.models.lm import LM, LMConfig
    from jaxodc.odc import Runtime
    from jaxodc.optim.clipping import clip_by_global_norm
    from jaxodc.train.collective import CollectiveTrainer
    from jaxodc.train.odc import OdcTrainer
    from jaxodc.train.straggle import Straggle

    ctx = init_from_env()
    init_jax_distributed(ctx)
    W, rank = ctx.world, ctx.rank
    model = LM(LMConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads))
    params = model.init(jax.random.PRNGKey(args.seed))
    units = [u.padded for u in make_layout(params, W, order=model.unit_names).units]
    # Emulated seconds: bench scale's cost model, scaled so that the host's remote shards once over
    # the shaped link take CLUSTER's share of a rank's mean minibatch compute.
    link_s = sum(units) * 4 * (args.hosts - 1) / args.hosts / (args.gbps * 1e9 / 8)
    target_mb_s = link_s / cluster_ratio(args)
    _, unit_cost, _ = accelerator_cost(_scale_args(args))
    samples = synthetic_text(args.preset, args.pool, args.max_len, seed=args.seed + 1, min_len=min(8, args.max_len))
    lengths = samples.lengths
    cost = unit_cost.scaled(1.0, target_mb_s / (args.minibatch * float(np.mean(unit_cost(np.asarray(lengths))))))
    opt = lambda: optax.chain(clip_by_global_norm(1.0), optax.adam(1e-3))  # noqa: E731
    coll = CollectiveTrainer(model, opt(), params, transport="jaxodc")
    runtimes = {True: Runtime.create(units, ctx, host_cache=True),
                False: Runtime(units, rank=rank, world=W, rendezvous=ctx.rendezvous, job_id=ctx.job_id + "_nc",
                               secret=ctx.secret, listen_host=ctx.local_addr, host_cache=False)}
    odc = {c: OdcTrainer(model, opt(), params, rt) for c, rt in runtimes.items()}
    del params
    coll.warmup([args.max_len])
    for c, tr in odc.items():
        warmup_odc(tr, [args.max_len], 1, barrier=lambda: ctx.barrier(f"hosts/warmup/{c}"))
    rng = np.random.default_rng([args.seed, W])
    records = []
    for k in range(args.minibatches):
        idx = rng.choice(len(samples), size=W * args.minibatch, replace=False)
        lens = lengths[idx].tolist()
        sub = [samples[int(i)] for i in idx]
        emulate = tuple(float(x) for x in cost(np.asarray(lens)))
        for j in range(len(COMBOS)):
            comm, balance, cache = COMBOS[(k + j) % len(COMBOS)]
            tr = coll if cache is None else odc[cache]
            tr.straggle = Straggle(pinned=k, emulate=emulate)
            plan = make_plan(balance, lens, W, args.max_len, cost)
            ctx.barrier("hosts/minibatch")
            before = runtimes[cache].gather_wire_bytes if cache is not None else 0
            res = tr.train_plan(plan, sub)
            records.append({"comm": comm, "balance": balance, "cache": cache, "k": k, "rank": rank,
                            "host": rank // args.ranks, "t_start": res.t_start, "t_end": res.t_end,
                            "samples": sum(len(m) for m in res.ran), "emulated": float(sum(res.straggle_s or [])),
                            "gather_wire_bytes": (runtimes[cache].gather_wire_bytes - before) if cache is not None
                            else None})
    remote, cache_bytes = runtimes[True].remote_shard_bytes(), runtimes[True].host_cache_bytes
    for rt in runtimes.values():
        rt.close()
    coll.close()
    blobs = ctx.allgather("hosts/records", msgpack.packb({"records": records, "remote": remote,
                                                          "host_cache_bytes": cache_bytes}))
    if rank == 0:
        parts = [msgpack.unpackb(b) for b in blobs]
        with open(args.out, "w") as f:
            json.dump({"records": [r for p in parts for r in p["records"]], "target_minibatch_s": target_mb_s,
                       "link_s": link_s, "remote_shard_bytes": {str(r): p["remote"] for r, p in enumerate(parts)},
                       "host_cache_bytes": {str(r): p["host_cache_bytes"] for r, p in enumerate(parts)}}, f)
    shutdown(ctx)


# --------------------------------------------------------------------------- report

def summarize(args, gbps: float, raw: dict) -> tuple[list[dict], list[dict]]:
    """One record per combo at this link rate, and the ratio lines (pooled throughput ratios with
    95% intervals, bootstrap over minibatches)."""
    recs = raw["records"]
    ks = sorted({r["k"] for r in recs})
    per = {}
    for comm, balance, cache in COMBOS:
        mine = [r for r in recs if (r["comm"], r["balance"], r["cache"]) == (comm, balance, cache)]
        span = np.array([max(r["t_end"] for r in mine if r["k"] == k) - min(r["t_start"] for r in mine if r["k"] == k)
                         for k in ks])
        samples = np.array([sum(r["samples"] for r in mine if r["k"] == k) for k in ks], np.float64)
        point, lo, hi = bootstrap(lambda i: samples[i].sum() / span[i].sum(), len(ks))
        cross = None
        if cache is not None:  # per host and minibatch: the bytes its ranks received for gathers
            per_host = [sum(r["gather_wire_bytes"] for r in mine if r["k"] == k and r["host"] == h)
                        for k in ks for h in range(args.hosts)]
            cross = float(np.mean(per_host))
        remote = float(np.mean([raw["remote_shard_bytes"][str(h * args.ranks)] for h in range(args.hosts)]))
        per[(comm, balance, cache)] = (samples, span)
        label = "on" if cache else ("off" if cache is False else "-")
        per_row = {"kind": "combo", "hosts": args.hosts, "ranks": args.hosts * args.ranks, "link_gbps": gbps,
                   "comm": comm, "balance": balance, "cache": label, "samples_per_s": point,
                   "samples_per_s_ci95": [lo, hi], "cross_host_bytes_per_minibatch": cross,
                   "remote_shard_bytes": remote, "cross_over_remote": None if cross is None else cross / remote,
                   "minibatches": len(ks), "target_minibatch_s": raw["target_minibatch_s"], "link_s": raw["link_s"]}
        per.setdefault("rows", []).append(per_row)
    ratios = []
    cached = per[("odc", "lb_mini", True)]
    for other, name in (((("collective@jaxodc", "lb_micro", None)), "collective@jaxodc + LB-Micro"),
                        ((("odc", "lb_mini", False)), "odc + LB-Mini without the cache")):
        b = per[other]
        point, lo, hi = pooled_ratio(cached[0], cached[1], b[0], b[1])
        ratios.append({"kind": "ratio", "link_gbps": gbps, "what": f"odc + LB-Mini with the cache / {name}",
                       "ratio": point, "ci95": [lo, hi]})
    return per["rows"], ratios


def run_rate(args, gbps: float, forward: list[str]) -> dict:
    from jaxodc.launch.cluster import Cluster
    from jaxodc.launch.launcher import rank_env_defaults, rank_pythonpath
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("JAXODC_")}, **rank_env_defaults(),
           "PYTHONPATH": rank_pythonpath()}
    with tempfile.TemporaryDirectory(prefix="jaxodc_bench_hosts_") as tmp:
        secret, out = os.path.join(tmp, "job.secret"), os.path.join(tmp, "records.json")
        with open(secret, "wb") as f:
            f.write(os.urandom(32))
        with Cluster(args.hosts, gbps=gbps) as c:
            procs = [c.popen(h, [sys.executable, "-m", "jaxodc", "launch", "-n", str(args.ranks), "--nnodes",
                                 str(args.hosts), "--node-rank", str(h), "--coordinator", "host0:29500",
                                 "--secret-file", secret, "--timeout", str(int(args.timeout)), "-m",
                                 "jaxodc.bench.hosts", "--worker", "--out", out, "--gbps", str(gbps), *forward],
                             cwd=tmp, env=env) for h in range(args.hosts)]
            deadline = time.monotonic() + args.timeout + 60
            for h, p in enumerate(procs):
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(f"bench hosts: host {h}'s launcher still ran after {args.timeout + 60:.0f} s") from None
            bad = [(h, p.returncode) for h, p in enumerate(procs) if p.returncode != 0]
            if bad:
                raise RuntimeError(f"bench hosts at {gbps:g} Gbit/s: launchers failed (host, status): {bad}")
        with open(out) as f:
            return json.load(f)


def _forward(args) -> list[str]:
    keys = ("hosts", "ranks", "preset", "minibatch", "minibatches", "max_len", "d_model", "layers", "heads", "model",
            "accelerator", "mfu", "pool", "seed")
    return [x for k in keys for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))]


def main(argv: list[str]) -> int:
    args = _args(argv)
    if args.worker:
        from jaxodc.launch.launcher import pin_one_core
        pin_one_core(int(os.environ.get("JAXODC_LOCAL_RANK", "0")))
        worker(args)
        return 0
    from jaxodc.launch.cluster import unavailable
    why = unavailable()
    if why:
        print(f"jaxodc bench train --hosts: {why}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows, ratios = [], []
    for gbps in [float(x) for x in str(args.link_gbps).split(",") if x.strip()]:
        t = time.perf_counter()
        r, q = summarize(args, gbps, run_rate(args, gbps, _forward(args)))
        rows += r
        ratios += q
        print(f"{gbps:g} Gbit/s: {time.perf_counter() - t:.0f} s", flush=True)
    write_records(args.json, rows + ratios + [{"kind": "config", "cluster": CLUSTER, "cluster_ratio": cluster_ratio(args),
                                               **{k: v for k, v in vars(args).items() if k not in ("worker", "out")}}])
    table = [{**r, "samples/s [95%]": f"{r['samples_per_s']:.2f} [{r['samples_per_s_ci95'][0]:.2f}.."
                                      f"{r['samples_per_s_ci95'][1]:.2f}]",
              "cross/remote": "-" if r["cross_over_remote"] is None else f"{r['cross_over_remote']:.2f}x"} for r in rows]
    print_table(table, ["link_gbps", "comm", "balance", "cache", "samples/s [95%]", "cross/remote"])
    for q in ratios:
        print(f"{q['link_gbps']:g} Gbit/s: {q['what']}: {fmt_ratio(q['ratio'], *q['ci95'])}")
    print(f"compute scaled to {CLUSTER['name']}'s link/compute ratio {cluster_ratio(args):.2e}; "
          f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
