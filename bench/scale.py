"""`jaxodc bench scale`: ODC against the collective at W = 8, 16, 32 ranks on one machine, with
each microbatch's compute emulated (a sleep of its modelled accelerator time) and everything else
real: the ODC runtime and its transport, the balancers, work stealing, the collective's lock-step
transport (comm/lockstep.py), the barriers.

    python -m jaxodc bench scale --json bench/out/scale.json --png bench/out/scale.png
    python -m jaxodc bench scale --ranks 8 --minibatches 6 --json /tmp/scale8.json   # short

Every rank runs a tiny LM for real (its compute a few ms, kept small beside the emulated time) and
then sleeps its microbatch's modelled seconds through the straggler injection's sleep
(`jaxodc.train.straggle.Straggle.emulate`): a `--model` step on an `--accelerator` at `--mfu`
(`CostModel.for_flops`), for sample lengths at the paper's scale (the preset's maximum, e.g. 64K
for LongAlign), times a common scale factor so that the longest sample sleeps `--longest-s`.
Ratios and bubble rates do not depend on that factor. Each global minibatch is run by every combo
in turn (rotating which goes first), so combos see the same minibatches; the simulator replays
them with the same cost model (`balance.simulate.replay`). Constants, sources and what the
emulation cannot show: docs/scale.md; methodology: bench/README.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from jaxodc.bench.common import accumulate_of, add_reproducible_argument, fmt_ratio, pooled_ratio, print_table, write_records
from jaxodc.launch.launcher import launch_ranks, pin_one_core

COMBOS = (("collective@jaxodc", "lb_micro"), ("odc", "lb_mini"), ("odc", "lb_steal"))
SIM = {("collective@jaxodc", "lb_micro"): "collective/lb_micro", ("odc", "lb_mini"): "odc/lb_mini",
       ("odc", "lb_steal"): "odc/lb_steal"}
# Model sizes: (parameters, layers, d_model). Llama 3 8B: 8.03e9 parameters, 32 layers, d 4096.
MODELS = {"llama-8b": (8.03e9, 32, 4096), "qwen-1.5b": (1.78e9, 28, 1536), "qwen-32b": (32.8e9, 64, 5120)}
# Dense bf16 peak FLOP/s: H100 SXM 989.4 TFLOP/s, A100 312 TFLOP/s (vendor data sheets).
ACCELERATORS = {"h100": 989.4e12, "a100": 312e12}
# The paper's Tables 5 and 6 at minibatch 4 (per device): (model, collective LB-Micro bubble, ODC
# LB-Mini bubble, ODC LB-Mini speed-up over collective LB-Micro). Devices 8: 1.5B, 16: 14B, 32: 32B.
PAPER = {"longalign": {8: ("1.5B", 0.3528, 0.1481, 1.34), 16: ("14B", 0.3775, 0.1443, 1.36),
                       32: ("32B", 0.3559, 0.1067, 1.31)},
         "swe": {8: ("1.5B", 0.2000, 0.0071, 1.22), 16: ("14B", 0.1845, 0.0042, 1.19),
                 32: ("32B", 0.1669, 0.0030, 1.16)}}
BUBBLE_POINTS, SPEEDUP_BAR = 0.03, 1.20


def _args(argv):
    p = argparse.ArgumentParser(prog="jaxodc bench scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the records here")
    p.add_argument("--png", help="bubble and speed-up against W")
    p.add_argument("--ranks", default="8,16,32", help="world sizes (list)")
    p.add_argument("--preset", default="longalign", help="sample-length preset (jaxodc.data.PRESETS)")
    p.add_argument("--minibatch", type=int, default=4, help="samples per rank per minibatch (the paper's golden 4)")
    p.add_argument("--minibatches", type=int, default=12, help="global minibatches per world size (each run by every combo)")
    p.add_argument("--max-len", type=int, default=128, help="real tokens of the longest sample (= microbatch cap)")
    p.add_argument("--longest-s", type=float, default=None,
                   help="emulated seconds of a longest sample: large beside the real per-microbatch overhead, "
                        "which the bubble counts as idle and which grows with the ranks sharing the host's cores "
                        "(tens of ms with 32 ranks on 2 cores); default 2 s per 16 ranks, at least 2 s")
    p.add_argument("--model", default="llama-8b", choices=sorted(MODELS))
    p.add_argument("--accelerator", default="h100", choices=sorted(ACCELERATORS))
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation of the emulated device")
    p.add_argument("--d-model", type=int, default=16, help="the real (tiny) model")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--pool", type=int, default=4096, help="samples drawn from the preset")
    p.add_argument("--seed", type=int, default=0)
    add_reproducible_argument(p)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def longest_s_of(args, world: int) -> float:
    """--longest-s, or its default for `world` ranks: 2 s, and 2 s per 16 ranks above 16, so the
    host's own per-microbatch overhead (rank processes queueing for its cores) stays as small a
    share of the emulated compute at every W. A common factor on every modelled time changes no
    bubble or speed-up of the emulated device."""
    return args.longest_s if args.longest_s is not None else 2.0 * max(1.0, world / 16)


def accelerator_cost(args):
    """(CostModel in seconds at the paper's lengths, CostModel in seconds at the run's lengths scaled
    so the longest sample takes --longest-s, paper tokens per run token)."""
    from jaxodc.balance.cost import CostModel
    from jaxodc.data import PRESETS
    if not 0 < args.mfu <= 1:
        raise ValueError(f"--mfu must be in (0, 1], got {args.mfu}")
    params, layers, d = MODELS[args.model]
    full = CostModel.for_flops(params, layers, d, ACCELERATORS[args.accelerator] * args.mfu)
    paper_max = PRESETS[args.preset]["paper_max"]
    per_token = paper_max / args.max_len
    scale = longest_s_of(args, 1) / float(full(paper_max))
    return full, full.scaled(per_token, scale), per_token


def global_minibatches(args, world: int, n: int) -> list[np.ndarray]:
    """The run's global minibatches (sample indices), the same on every rank."""
    rng = np.random.default_rng([args.seed, world])
    g = world * args.minibatch
    return [rng.choice(n, size=g, replace=False) for _ in range(args.minibatches)]


def worker(args) -> None:
    import jax
    import msgpack
    import optax

    from jaxodc.balance.plan import make_plan
    from jaxodc.bench.train import warmup_odc
    from jaxodc.data import synthetic_text
    from jaxodc.launch.context import init_from_env, init_jax_distributed, shutdown
    from jaxodc.models.lm import LM, LMConfig
    from jaxodc.odc import Runtime
    from jaxodc.optim.clipping import clip_by_global_norm
    from jaxodc.train.collective import CollectiveTrainer
    from jaxodc.train.odc import OdcTrainer
    from jaxodc.train.straggle import Straggle
    from jaxodc.modeling.units import make_layout

    ctx = init_from_env()
    init_jax_distributed(ctx)
    W, rank = ctx.world, ctx.rank
    _, cost, _ = accelerator_cost(args)
    model = LM(LMConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads))
    params = model.init(jax.random.PRNGKey(args.seed))
    samples = synthetic_text(args.preset, args.pool, args.max_len, seed=args.seed + 1, min_len=min(8, args.max_len))
    lengths = samples.lengths
    opt = lambda: optax.chain(clip_by_global_norm(1.0), optax.adam(1e-3))  # noqa: E731
    coll = CollectiveTrainer(model, opt(), params, transport="jaxodc")
    rt = Runtime.create([u.padded for u in make_layout(params, W, order=model.unit_names).units], ctx,
                        accumulate=accumulate_of(args))
    odc = OdcTrainer(model, opt(), params, rt)
    del params
    coll.warmup([args.max_len])
    warmup_odc(odc, [args.max_len], 1, barrier=lambda: ctx.barrier("scale/warmup"))
    trainers = {"collective@jaxodc": coll, "odc": odc}
    records = []
    for k, idx in enumerate(global_minibatches(args, W, len(samples))):
        lens = lengths[idx].tolist()
        sub = [samples[int(i)] for i in idx]
        emulate = tuple(float(x) for x in cost(np.asarray(lens)))
        for j in range(len(COMBOS)):
            comm, balance = COMBOS[(k + j) % len(COMBOS)]
            tr = trainers[comm]
            tr.straggle = Straggle(pinned=k, emulate=emulate)
            plan = make_plan(balance, lens, W, args.max_len, cost)
            ctx.barrier("scale/minibatch")
            res = tr.train_plan(plan, sub)
            records.append({"comm": comm, "balance": balance, "k": k, "rank": rank, "t_start": res.t_start,
                            "t_end": res.t_end, "samples": sum(len(m) for m in res.ran),
                            "emulated": float(sum(res.straggle_s or [])),
                            "compute": float(sum(b - a for a, b in res.microbatches)),
                            "opt": float(res.opt[1] - res.opt[0]), "end_s": getattr(res, "end_s", None),
                            "n_micro": sum(1 for m in res.ran if m),
                            "stolen": sum(1 for m in res.ran if m and m not in set(plan.ranks[rank]))})
    rt.close()
    coll.close()
    blobs = ctx.allgather("scale/records", msgpack.packb(records))
    if rank == 0:
        merged = [r for b in blobs for r in msgpack.unpackb(b)]
        with open(args.out, "w") as f:
            json.dump({"world": W, "records": merged}, f)
    shutdown(ctx)


# --------------------------------------------------------------------------- report

def summarize(args, world: int, records: list[dict]) -> tuple[list[dict], list[dict]]:
    """(one record per combo, ratio lines) for one world size. Bubble = 1 - emulated busy seconds /
    (W x summed minibatch spans): the real compute, the exchanges, the optimizer and the barrier all
    count as idle (a device would be idle through them too, past what overlaps)."""
    from jaxodc.balance.simulate import ceiling, replay
    from jaxodc.data import synthetic_text
    _, cost, _ = accelerator_cost(args)
    lengths = synthetic_text(args.preset, args.pool, args.max_len, seed=args.seed + 1,
                             min_len=min(8, args.max_len)).lengths
    mbs = [lengths[idx].tolist() for idx in global_minibatches(args, world, len(lengths))]
    sim = replay(mbs, world, args.max_len, cost, methods=tuple(SIM.values()))
    rows, per_mb = [], {}
    for comm, balance in COMBOS:
        by_k: dict = {}
        for r in records:
            if (r["comm"], r["balance"]) == (comm, balance):
                by_k.setdefault(r["k"], []).append(r)
        spans = {k: max(r["t_end"] for r in g) - min(r["t_start"] for r in g) for k, g in by_k.items()}
        busy = sum(r["emulated"] for g in by_k.values() for r in g)
        samples = sum(r["samples"] for g in by_k.values() for r in g)
        per_mb[(comm, balance)] = {k: (sum(r["samples"] for r in g), spans[k]) for k, g in by_k.items()}
        ends = [r["end_s"] for g in by_k.values() for r in g if r["end_s"] is not None]
        rows.append({"kind": "scale", "ranks": world, "comm": comm, "balance": balance, "transport": "jaxodc",
                     "preset": args.preset, "minibatch": args.minibatch, "minibatches": len(by_k),
                     "samples_per_s": samples / sum(spans.values()),
                     "bubble": 1.0 - busy / (world * sum(spans.values())), "sim_bubble": sim[SIM[(comm, balance)]]["bubble"],
                     "emulated_s_per_minibatch": busy / world / len(by_k),
                     "real_compute_share": sum(r["compute"] - r["emulated"] for g in by_k.values() for r in g)
                     / max(busy, 1e-12),
                     "end_s": statistics.median(ends) if ends else None,
                     "microbatches_per_rank": sum(r["n_micro"] for g in by_k.values() for r in g) / (world * len(by_k)),
                     "steals": sum(r["stolen"] for g in by_k.values() for r in g)})
    base = ("collective@jaxodc", "lb_micro")
    ratios = []
    for combo in COMBOS[1:]:
        ks = sorted(set(per_mb[combo]) & set(per_mb[base]))
        a, b = [per_mb[combo][k] for k in ks], [per_mb[base][k] for k in ks]
        point, lo, hi = pooled_ratio([x[0] for x in a], [x[1] for x in a], [x[0] for x in b], [x[1] for x in b])
        ratios.append({"kind": "ratio", "ranks": world, "ratio": f"{combo[0]}+{combo[1]} / {base[0]}+{base[1]} samples/s",
                       "value": point, "ci95": [lo, hi], "ceiling": ceiling(sim, SIM[combo], SIM[base]),
                       "preset": args.preset})
    return rows, ratios


def bars(rows: list[dict], ratios: list[dict]) -> list[dict]:
    out = []
    for W in sorted({r["ranks"] for r in rows}):
        cell = {(r["comm"], r["balance"]): r for r in rows if r["ranks"] == W}
        for (comm, balance), r in cell.items():
            d = r["bubble"] - r["sim_bubble"]
            out.append({"kind": "bar", "ranks": W, "bar": f"{comm}+{balance} bubble - simulator's (points)",
                        "value": 100 * d, "threshold": 100 * BUBBLE_POINTS, "pass": abs(d) <= BUBBLE_POINTS})
        coll = cell[("collective@jaxodc", "lb_micro")]["bubble"]
        for odc in (("odc", "lb_mini"), ("odc", "lb_steal")):
            v = cell[odc]["bubble"] / coll if coll > 0 else float("inf")
            out.append({"kind": "bar", "ranks": W, "bar": f"{odc[0]}+{odc[1]} bubble / collective@jaxodc+lb_micro bubble",
                        "value": v, "threshold": 0.5, "pass": v <= 0.5})
        for q in ratios:
            if q["ranks"] == W and q["ratio"].startswith("odc+lb_mini"):
                gated = q["preset"] == "longalign"
                out.append({"kind": "bar", "ranks": W, "bar": q["ratio"], "value": q["value"], "ci95": q["ci95"],
                            "ceiling": q["ceiling"], "threshold": SPEEDUP_BAR if gated else None,
                            "pass": q["value"] >= SPEEDUP_BAR if gated else None})
    return out


def print_report(args, rows, ratios, bar_rows, file=sys.stdout) -> None:
    full, _, per_token = accelerator_cost(args)
    from jaxodc.data import PRESETS
    paper_max = PRESETS[args.preset]["paper_max"]
    print(f"emulated: {args.model} on {args.accelerator} at MFU {args.mfu:g}: a={full.a:.3g} s/token^2, "
          f"b={full.b:.3g} s/token; a {paper_max}-token sample {float(full(paper_max)):.2f} s "
          f"(attention {full.attention_share(paper_max):.0%}), slept as "
          f"{'2 s per 16 ranks (at least 2 s)' if args.longest_s is None else f'{args.longest_s:g} s'}; "
          f"1 real token = {per_token:g} modelled tokens", file=file)
    print_table(rows, ["ranks", "comm", "balance", "samples_per_s", "bubble", "sim_bubble", "microbatches_per_rank",
                       "steals", "real_compute_share", "end_s"], file=file)
    print(file=file)
    for q in ratios:
        print(f"W={q['ranks']}: {q['ratio']} = {fmt_ratio(q['value'], *q['ci95'])} (simulator {q['ceiling']:.3f})",
              file=file)
    paper = PAPER.get(args.preset, {})
    for W in sorted({r["ranks"] for r in rows}):
        if W in paper and args.minibatch == 4:
            m, cb, ob, sp = paper[W]
            print(f"W={W}: paper ({m}, minibatch 4): collective LB-Micro bubble {cb:.1%}, ODC LB-Mini {ob:.1%}, "
                  f"speed-up {sp:.2f}", file=file)
    for b in bar_rows:
        verdict = "" if b["pass"] is None else (" PASS" if b["pass"] else " FAIL")
        thr = "" if b["threshold"] is None else (
            f" (bar |x| <= {b['threshold']:g})" if "points" in b["bar"] else
            f" (bar {'<=' if 'bubble' in b['bar'] else '>='} {b['threshold']:g})")
        val = fmt_ratio(b["value"], *b["ci95"]) if "ci95" in b else f"{b['value']:.3f}"
        print(f"W={b['ranks']}: {b['bar']} = {val}{thr}{verdict}", file=file)


def draw(args, rows, ratios, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    Ws = sorted({r["ranks"] for r in rows})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"collective@jaxodc+lb_micro": "tab:red", "odc+lb_mini": "tab:blue", "odc+lb_steal": "tab:green"}
    for comm, balance in COMBOS:
        name = f"{comm}+{balance}"
        sel = sorted((r for r in rows if (r["comm"], r["balance"]) == (comm, balance)), key=lambda r: r["ranks"])
        ax1.plot([r["ranks"] for r in sel], [100 * r["bubble"] for r in sel], "o-", color=colors[name], label=f"{name} measured")
        ax1.plot([r["ranks"] for r in sel], [100 * r["sim_bubble"] for r in sel], "x--", color=colors[name],
                 label=f"{name} simulator")
    paper = PAPER.get(args.preset, {})
    pw = [W for W in Ws if W in paper] if args.minibatch == 4 else []
    if pw:
        ax1.plot(pw, [100 * paper[W][1] for W in pw], "s", mfc="none", color="tab:red", label="paper collective LB-Micro")
        ax1.plot(pw, [100 * paper[W][2] for W in pw], "s", mfc="none", color="tab:blue", label="paper ODC LB-Mini")
    ax1.set(xlabel="ranks W", ylabel="bubble rate (%)", title=f"bubble, {args.preset}, minibatch {args.minibatch}")
    ax1.legend(fontsize=7)
    for name in ("odc+lb_mini", "odc+lb_steal"):
        sel = sorted((q for q in ratios if q["ratio"].startswith(name)), key=lambda q: q["ranks"])
        x = [q["ranks"] for q in sel]
        y = [q["value"] for q in sel]
        err = [[q["value"] - q["ci95"][0] for q in sel], [q["ci95"][1] - q["value"] for q in sel]]
        ax2.errorbar(x, y, yerr=err, fmt="o-", color=colors[name], capsize=3, label=f"{name} measured (95%)")
        ax2.plot(x, [q["ceiling"] for q in sel], "x--", color=colors[name], label=f"{name} simulator")
    if pw:
        ax2.plot(pw, [paper[W][3] for W in pw], "s", mfc="none", color="tab:blue", label="paper ODC LB-Mini")
    ax2.axhline(1.0, color="gray", lw=0.8)
    ax2.set(xlabel="ranks W", ylabel="samples/s over collective@jaxodc+LB-Micro", title="speed-up")
    ax2.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(Ws, [str(W) for W in Ws])
    fig.suptitle(f"emulated {args.model} on {args.accelerator} (MFU {args.mfu:g}); real ranks, transports, barriers",
                 fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_world(args, world: int, argv: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"scale_w{world}.json")
        launch_ranks(world, "jaxodc.bench.scale", ["--worker", "--out", out] + argv, timeout_s=args.timeout)
        with open(out) as f:
            return json.load(f)


def _forward(args) -> list[str]:
    keys = ("preset", "minibatch", "minibatches", "max_len", "longest_s", "model", "accelerator", "mfu", "d_model",
            "layers", "heads", "pool", "seed")
    return [x for k in keys for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))] + (
        ["--reproducible"] if args.reproducible else [])


def run(args, say=print) -> tuple[list[dict], list[dict], list[dict]]:
    """Every world size in turn; (combo rows, ratios, bars)."""
    accelerator_cost(args)  # bad settings fail before any rank starts
    rows, ratios = [], []
    for W in [int(x) for x in str(args.ranks).split(",") if x.strip()]:
        if W * args.minibatch > args.pool:
            raise ValueError(f"--pool {args.pool} cannot fill a minibatch of {args.minibatch} x {W} ranks")
        t0 = time.perf_counter()
        at_w = argparse.Namespace(**{**vars(args), "longest_s": longest_s_of(args, W)})
        raw = run_world(at_w, W, _forward(at_w))
        r, q = summarize(at_w, W, raw["records"])
        for row in r:
            row["longest_s"] = at_w.longest_s
        rows += r
        ratios += q
        say(f"W={W}: {time.perf_counter() - t0:.0f} s")
    return rows, ratios, bars(rows, ratios)


def main(argv: list[str]) -> int:
    args = _args(argv)
    if args.worker:  # one core per rank, before jax is imported
        pin_one_core(int(os.environ.get("JAXODC_LOCAL_RANK", "0")))
        worker(args)
        return 0
    t0 = time.perf_counter()
    rows, ratios, bar_rows = run(args)
    write_records(args.json, rows + ratios + bar_rows + [{"kind": "config", **{k: v for k, v in vars(args).items()
                                                                               if k not in ("worker", "out")}}])
    print_report(args, rows, ratios, bar_rows)
    if args.png:
        print(f"figure: {os.path.abspath(draw(args, rows, ratios, args.png))}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
