"""`jaxodc demo`: the ODC paper's workload on this machine. Long-context SFT: byte-level text
(Python's own library sources) with LongAlign-like long-tailed lengths up to --max-tokens (2048),
packed rows with segment attention (a sample attends only to itself, so a row's cost follows its
samples), a microbatch cap of the longest sample, and a model small enough (d_model 64) that
attention is most of a long sample's compute. It

1. calibrates the cost model a*s^2 + b*tokens + c by timing the model's step on this machine
   (one core, as a rank has) and prints attention's share of a longest sample;
2. trains on 2 local ranks with the collective baseline + LB-Micro (over jaxodc's own lock-step
   collective, the transport ODC uses, so the comparison measures ODC's scheduling), then with
   ODC + LB-Mini, the same minibatches (`jaxodc train`, jaxodc.cli.train), and prints loss,
   throughput and bubble rate of both, a timeline PNG and the per-minibatch records in --out;
3. runs 8 ranks with emulated accelerator compute (a short `jaxodc bench scale`, bench/scale.py).

It ends with two headline lines: the real run's speed-up beside the simulator's ceiling for the same
minibatches (compute only), and the 8-rank emulated run's beside its simulator figure; every
ratio with its 95% interval (paired bootstrap over minibatches).

    jaxodc demo [--steps 12] [--minibatch 4] [--max-tokens 2048] [--out DIR]

`jaxodc demo --sites` instead trains one job across 3 sites of 2 ODC ranks each, joined by
DiLoCo over emulated 100 Mbit/s, 20 ms links (jaxodc.optim.sites): it kills a rank of site 1 (the
site ends), starts a new site that joins the running job, and prints the loss per outer step and
every membership change; training never stops.

    jaxodc demo --sites [--outer-steps 30] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import re
import sys


def _args(argv):
    p = argparse.ArgumentParser(prog="jaxodc demo")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=12, help="timed minibatches per mode (after one warm-up)")
    p.add_argument("--minibatch", type=int, default=4, help="samples per rank per minibatch")
    p.add_argument("--max-tokens", type=int, default=2048, help="the longest sample = the microbatch's token cap")
    p.add_argument("--min-bucket", type=int, default=256, help="packed rows are this many tokens times a power of two")
    p.add_argument("--preset", default="longalign", help="sample-length preset (long-tailed)")
    p.add_argument("--samples", type=int, default=512, help="samples drawn from the preset")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--scale-minibatches", type=int, default=8,
                   help="global minibatches of the 8-rank emulated run (0: skip it)")
    p.add_argument("--out", default="jaxodc_demo", help="directory for demo_timeline.png and demo.json")
    p.add_argument("--sites", action="store_true", help="one job across 3 sites with a site killed and one joining")
    p.add_argument("--outer-steps", type=int, default=30, help="--sites: outer steps of the job")
    p.add_argument("--inner-steps", type=int, default=8, help="--sites: inner minibatches per outer step (H)")
    p.set_defaults(warm=1)  # warm-up minibatches: main sets it (warm_minibatches)
    return p.parse_args(argv)


def train_argv(args, cost=None) -> list[str]:
    """The `jaxodc train` invocation the demo runs (`cost`: the calibrated CostModel)."""
    out = ["--ranks", str(args.ranks), "--comm", "collective,odc", "--balance", "lb_micro,lb_mini",
           "--collective-transport", "jaxodc",
           "--steps", str(args.steps + args.warm), "--warmup", str(args.warm), "--minibatch", str(args.minibatch),
           "--max-tokens", str(args.max_tokens), "--min-bucket", str(args.min_bucket), "--preset", args.preset,
           "--samples", str(args.samples),
           "--d-model", str(args.d_model), "--layers", str(args.layers), "--lr", "3e-3", "--clip", "1.0",
           "--timeline", os.path.join(args.out, "demo_timeline.png"), "--json", os.path.join(args.out, "demo.json")]
    return out + (["--cost", f"{cost.a!r},{cost.b!r},{cost.c!r}"] if cost is not None else [])


def demo_minibatches(args, lengths, n: int) -> list:
    """The first n global minibatches (sample indices) `jaxodc train` runs (its seeded stream)."""
    import itertools

    from jaxodc.data import minibatches
    return list(itertools.islice(minibatches(len(lengths), args.ranks * args.minibatch, seed=2, epochs=None), n))


def row_shapes(args, lengths, idx, cost) -> set:
    """(run, rank, row length) of every microbatch one global minibatch compiles for: ODC packs each
    microbatch to its own bucket, the collective every step to the largest bucket of that step."""
    from jaxodc.balance.packing import bucket
    from jaxodc.balance.plan import make_plan
    out = set()
    lens = lengths[idx].tolist()
    for comm, bal in (("collective", "lb_micro"), ("odc", "lb_mini")):
        plan = make_plan(bal, lens, args.ranks, args.max_tokens, cost)
        size = lambda r, m: bucket(plan.microbatch_tokens(plan.ranks[r][m]) if m < len(plan.ranks[r]) else 0,  # noqa: E731
                                   args.max_tokens, args.min_bucket or None)
        for r in range(args.ranks):
            for m in range(len(plan.ranks[r])):
                T = max(size(q, m) for q in range(args.ranks)) if comm == "collective" else size(r, m)
                out.add((comm, r if comm == "odc" else 0, T))
    return out


def warm_minibatches(args, lengths, cost, limit: int = 40) -> int:
    """How many leading minibatches to leave out of the figures so that every row shape the timed
    ones use was compiled before them (compilation would otherwise land in a timed minibatch): the
    smallest such count, at least 1 (the optimizer compiles in the first)."""
    mbs = demo_minibatches(args, lengths, limit + args.steps)
    shapes = [row_shapes(args, lengths, idx, cost) for idx in mbs]
    seen: set = set()
    for warm in range(1, limit + 1):
        seen |= shapes[warm - 1]
        if set().union(*shapes[warm:warm + args.steps]) <= seen:
            return warm
    return limit


def calibration_items(max_tokens: int, min_bucket: int) -> list:
    """Microbatches to time: one sample per row length, and rows packed with equal samples (the
    same tokens, less attention), so a, b and c separate."""
    from jaxodc.balance.packing import bucket
    rows = sorted({bucket(t, max_tokens, min_bucket) for t in range(1, max_tokens + 1)})
    items: list = [int(T) for T in rows]
    items += [[int(T) // 4] * 4 for T in rows if T >= 8]
    return items


def calibrate_cost(args):
    """CostModel (seconds) of one rank's microbatch step on this machine: the model's forward +
    backward (ReferenceTrainer.timing_fn, packed like training) timed on one core, as each rank
    runs. The process's core set is restored afterwards, so ranks started later spread over all."""
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if cores:
        os.sched_setaffinity(0, {min(cores)})  # before jax starts: XLA sizes its thread pool from it
    try:
        import jax
        import optax

        from jaxodc.balance.cost import calibrate
        from jaxodc.models.lm import LM, LMConfig
        from jaxodc.train.reference import ReferenceTrainer
        model = LM(LMConfig(d_model=args.d_model, n_layers=args.layers, n_heads=4))
        ref = ReferenceTrainer(model, optax.adam(1e-3), model.init(jax.random.PRNGKey(0)))
        step = ref.timing_fn(args.max_tokens, min_bucket=args.min_bucket)
        return calibrate(step, calibration_items(args.max_tokens, args.min_bucket), repeats=3, warmup=1)
    finally:
        if cores:
            os.sched_setaffinity(0, cores)


def demo_lengths(args):
    """Sample lengths of the data `jaxodc train` builds for the demo's options."""
    from jaxodc.cli.train import check_args, load_samples, parser
    targs = parser().parse_args(train_argv(args))
    check_args(targs)
    return load_samples(targs, args.ranks).lengths


def real_run_figures(args, cost) -> dict:
    """From the demo's records: ODC + LB-Mini over collective + LB-Micro samples/s (whole run) with
    its 95% interval (paired bootstrap over minibatches: both runs train the same ones), and the
    simulator's ceiling for the same minibatches under the calibrated cost model."""
    from jaxodc.balance.simulate import ceiling, replay
    from jaxodc.bench.common import pooled_ratio
    from jaxodc.cli.timeline import load_runs
    runs = load_runs(os.path.join(args.out, "demo.json"))
    span = {}
    for name, recs in runs.items():
        by: dict = {}
        for r in recs:
            by.setdefault(r.step, []).append(r)
        # a minibatch's time runs to the next one's start (the last: to its end), so the times add up
        # to the run's wall time, which `jaxodc train`'s report divides by
        ks = sorted(by)
        start = [min(r.t_start for r in by[k]) for k in ks] + [max(r.t_end for r in by[ks[-1]])]
        span[name] = {k: (sum(r.samples for r in by[k]), start[i + 1] - start[i]) for i, k in enumerate(ks)}
    odc, coll = span["odc + lb_mini"], span["collective + lb_micro"]
    ks = sorted(set(odc) & set(coll))
    ratio = pooled_ratio([odc[k][0] for k in ks], [odc[k][1] for k in ks], [coll[k][0] for k in ks],
                         [coll[k][1] for k in ks])
    lengths = demo_lengths(args)
    mbs = [lengths[idx].tolist() for k, idx in enumerate(demo_minibatches(args, lengths, args.warm + args.steps))
           if k in set(ks)]
    return {"ratio": ratio, "ceiling": ceiling(replay(mbs, args.ranks, args.max_tokens, cost)), "minibatches": len(ks)}


def scale_line(args) -> str | None:
    """The 8-rank emulated run (bench scale, one world size, short): its headline line."""
    if args.scale_minibatches <= 0:
        return None
    from jaxodc.bench import scale
    sargs = scale._args(["--ranks", "8", "--minibatches", str(args.scale_minibatches), "--preset", args.preset,
                         "--longest-s", "1.0", "--json", os.path.join(args.out, "demo_scale.json")])
    rows, ratios, bars = scale.run(sargs, say=lambda *a: None)
    from jaxodc.bench.common import write_records
    write_records(sargs.json, rows + ratios + bars)
    q = next(q for q in ratios if q["ratio"].startswith("odc+lb_mini"))
    bub = {r["comm"]: r for r in rows if r["balance"] in ("lb_mini", "lb_micro")}
    return (f"8 ranks, emulated compute: ODC + LB-Mini vs collective + LB-Micro: {q['value']:.2f}x "
            f"(simulator {q['ceiling']:.2f}) [95% {q['ci95'][0]:.2f}..{q['ci95'][1]:.2f}; bubble "
            f"{bub['odc']['bubble']:.1%} vs {bub['collective@jaxodc']['bubble']:.1%}, simulator "
            f"{bub['odc']['sim_bubble']:.1%} vs {bub['collective@jaxodc']['sim_bubble']:.1%}]")


def sites_train_argv(args) -> list[str]:
    """The `jaxodc train` options of every site in the --sites demo."""
    return ["--groups", "3", "--ranks", "2", "--diloco", str(args.inner_steps), "--wan-mbps", "100",
            "--wan-ms", "20", "--steps", str(args.outer_steps * args.inner_steps), "--minibatch", str(2 * args.minibatch),
            "--max-tokens", str(args.max_tokens), "--preset", args.preset, "--d-model", str(args.d_model), "--layers",
            str(args.layers), "--lr", "3e-3", "--json", os.path.join(os.path.abspath(args.out), "sites")]


def sites_demo(args) -> int:
    """3 founding sites; a site 3 started after the first outer step (it joins when ready) and a
    rank of site 1 killed at a quarter of the run; every site's lines echoed; a summary at the end."""
    from jaxodc.cli import sites
    from jaxodc.cli.train import parser, worker_argv
    os.makedirs(args.out, exist_ok=True)
    targs = parser().parse_args(sites_train_argv(args))
    sites.remove_records(targs.json, 4)
    job = sites.LocalJob(targs, worker_argv(targs))
    T = args.outer_steps
    try:
        for s in range(3):
            job.start(s)
        job.wait_outer(1, timeout_s=600)
        job.start(3, join=True)  # starting up takes a while: it joins at the outer step after it is ready
        print(f"demo: started site 3 after outer step {job.outer_done - 1}; it joins the running job when ready",
              flush=True)
        job.wait_outer(max(2, T // 4), timeout_s=600)
        pid = job.kill_rank(1)
        print(f"demo: killed rank 1 of site 1 (pid {pid}) after outer step {job.outer_done - 1}", flush=True)
        status = job.wait(timeout_s=900)
    finally:
        job.close()
    survivors = [s for s in (0, 2, 3) if status.get(s) == 0]
    print(f"\ndemo: site 1 ended with status {status.get(1)} (killed); sites {survivors} finished the job")
    sites.report(targs.json, 4)
    changes = [line.split("] ", 1)[-1] for _, line in job.lines if re.search(r"site \d+: (sites|joined)", line)]
    print("demo: membership changes, in order: " + "; ".join(changes))
    hashes = sites.final_hashes(targs.json, survivors)
    same = all(len(set(h)) == 1 for h in hashes.values())
    print(f"demo: final shared-state hash per ring {hashes}: {'identical on every site' if same else 'DIFFER'}")
    return 0 if same and len(survivors) == 3 else 1


def main(argv: list[str]) -> int:
    args = _args(argv)
    if args.sites:
        return sites_demo(args)
    from jaxodc.cli.train import main as train
    os.makedirs(args.out, exist_ok=True)
    cost = calibrate_cost(args)
    print(f"demo: calibrated cost (s): a={cost.a:.3g} per s^2, b={cost.b:.3g} per token, c={cost.c:.3g} per "
          f"microbatch; attention is {cost.attention_share(args.max_tokens):.0%} of a {args.max_tokens}-token "
          f"sample's compute (without c)", flush=True)
    args.warm = warm_minibatches(args, demo_lengths(args), cost)
    status = train(train_argv(args, cost))
    if status:
        return status
    fig = real_run_figures(args, cost)
    point, lo, hi = fig["ratio"]
    line = scale_line(args)
    print(f"\nODC + LB-Mini vs collective + LB-Micro: {point:.2f}x samples/s (ceiling {fig['ceiling']:.2f}) "
          f"[95% {lo:.2f}..{hi:.2f}, {fig['minibatches']} minibatches]")
    if line:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
