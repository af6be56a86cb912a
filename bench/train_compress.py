"""`jaxodc bench train --compress SETTING`: TAGC compressed gradient exchange against dense, in
training, over an emulated slow link. Options and the rank launch are bench/train.py's.

    python -m jaxodc bench train --compress default --link-mbps 100 --json bench/out/train_compress_100.json \\
        [--link-ms 0] [--compress-steps 30] [--loss-png bench/out/train_compress_loss_100.png]

Four trainers run in the same processes, interleaved minibatch by minibatch on the same global
minibatches (the order rotates, so no run always goes first): ODC + LB-Mini dense and compressed,
each over the tcp transport with the emulated link (jaxodc.odc.Link: every connection and
direction capped, latency per message), and the collective + LB-Micro dense and compressed over
gloo, whose traffic the emulation cannot reach (their records say link_mbps null: loopback).

One record per run: samples/s (samples over the runs' minibatch spans, first two minibatches
left out: compiling), wire_bytes / wire_bytes_selected (gradient bytes sent per minibatch, summed
over ranks; selected = the pieces the default setting compresses, in the dense runs too),
kept_fraction, peeled / estimated per minibatch, final_loss (mean global loss of the last five
minibatches, the same samples for every run) and the loss per minibatch. Bars: odc compressed /
odc dense samples/s >= 1.15, dense / compressed selected bytes >= 4, final loss within 2%.
"""
from __future__ import annotations

import json
import statistics

import numpy as np

from jaxodc.bench.common import accumulate_of, print_table, write_records
from jaxodc.bench.train import _launch, _optimizer

RUNS = (("odc", "lb_mini", False), ("odc", "lb_mini", True), ("collective", "lb_micro", False),
        ("collective", "lb_micro", True))
SKIP = 2   # minibatches left out of samples/s (compiling)
TAIL = 5   # minibatches averaged into final_loss


def run(args) -> int:
    raw = _launch(args, args.ranks, "compress", compress_argv(args))
    rows, bar_rows = summarize(raw, args)
    write_records(args.json, rows + [dict(b, kind="bar") for b in bar_rows])
    print_report(rows, bar_rows, args)
    if args.loss_png:
        print(f"loss curves: {draw_losses(rows, args.loss_png, args)}")
    return 0


def compress_argv(args) -> list[str]:
    keys = ("compress", "link_mbps", "link_ms", "compress_steps", "compress_minibatch", "preset", "pool", "max_tokens",
            "d_model", "layers", "heads", "lr", "seed")
    return [x for k in keys for x in (f"--{k.replace('_', '-')}", str(getattr(args, k)))] + (
        ["--reproducible"] if args.reproducible else [])


def _name(comm: str, balance: str, compressed: bool) -> str:
    return f"{comm}+{balance}{' compressed' if compressed else ''}"


def worker(args) -> None:
    import jax
    import msgpack

    from jaxodc.balance.cost import CostModel
    from jaxodc.balance.plan import make_plan
    from jaxodc.compress import parse_compression
    from jaxodc.data import minibatches, synthetic_text
    from jaxodc.launch.context import init_from_env, init_jax_distributed, shutdown
    from jaxodc.models.lm import LM, LMConfig
    from jaxodc.odc import Link, Runtime
    from jaxodc.train.collective import CollectiveTrainer
    from jaxodc.train.odc import OdcTrainer
    from jaxodc.modeling.units import make_layout

    ctx = init_from_env()
    init_jax_distributed(ctx)
    W, rank = ctx.world, ctx.rank
    model = LM(LMConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads))
    params = model.init(jax.random.PRNGKey(args.seed))
    layout = make_layout(params, W, order=model.unit_names)
    plan = parse_compression(args.compress).plan(layout)
    mb = args.compress_minibatch
    samples = synthetic_text(args.preset, args.pool, args.max_tokens, seed=args.seed + 1, min_len=8)
    cost = CostModel.for_transformer(args.d_model)
    link = Link(args.link_mbps, args.link_ms) if args.link_mbps or args.link_ms else None

    trainers = {}
    for comm, balance, compressed in RUNS:
        c = plan if compressed else None
        if comm == "odc":
            rt = Runtime.create([u.padded for u in layout.units], ctx, transport="tcp", link=link, timeout_s=600.0,
                                accumulate=accumulate_of(args))
            tr = OdcTrainer(model, _optimizer(args.lr), params, rt, owns_runtime=True, compress=c)
        else:
            tr = CollectiveTrainer(model, _optimizer(args.lr), params, compress=c)
        trainers[_name(comm, balance, compressed)] = (tr, balance)
    stream = minibatches(len(samples), W * mb, seed=args.seed + 2, epochs=None)
    records = []
    for step in range(args.compress_steps):
        idx = next(stream)
        sub = [samples[int(i)] for i in idx]
        names = list(trainers)
        for name in names[step % len(names):] + names[:step % len(names)]:
            tr, balance = trainers[name]
            p = make_plan(balance, samples.lengths[idx].tolist(), W, args.max_tokens, cost)
            ctx.barrier("bench/compress/minibatch")
            res = tr.train_plan(p, sub)
            records.append({"run": name, "step": step, "rank": rank, "t_start": res.t_start, "t_end": res.t_end,
                            "samples": sum(len(m) for m in res.ran), "loss": res.loss, "wire_bytes": res.wire_bytes,
                            "wire_bytes_selected": res.wire_bytes_selected, "kept_fraction": res.kept_fraction,
                            "peeled": res.peeled, "estimated": res.estimated})
    for tr, _ in trainers.values():
        tr.close()
    blobs = ctx.allgather("bench/compress/records", msgpack.packb(records))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"records": [r for b in blobs for r in msgpack.unpackb(b)], "plan": plan.describe(),
                       "selected_elems": plan.selected_elems(), "params": sum(u.numel for u in layout.units)}, f)
    shutdown(ctx)


def summarize(raw: dict, args) -> tuple[list[dict], list[dict]]:
    by: dict = {}
    for r in raw["records"]:
        by.setdefault(r["run"], {}).setdefault(r["step"], []).append(r)
    rows = []
    for comm, balance, compressed in RUNS:
        name = _name(comm, balance, compressed)
        steps = by[name]
        timed = [recs for s, recs in sorted(steps.items()) if s >= SKIP]
        span = sum(max(r["t_end"] for r in recs) - min(r["t_start"] for r in recs) for recs in timed)
        per_step = lambda key: [sum(r[key] for r in recs) for _, recs in sorted(steps.items())]  # noqa: E731
        losses = [recs[0]["loss"] for _, recs in sorted(steps.items())]
        kept = [r["kept_fraction"] for recs in steps.values() for r in recs if r["kept_fraction"] is not None]
        rows.append({
            "kind": "train", "comm": comm, "balance": balance, "minibatch": args.compress_minibatch,
            "ranks": len(steps[0]), "compress": args.compress if compressed else None,
            "link_mbps": args.link_mbps if comm == "odc" else None, "link_ms": args.link_ms if comm == "odc" else None,
            "transport": "tcp" if comm == "odc" else "gloo",
            "samples_per_s": sum(r["samples"] for recs in timed for r in recs) / span,
            "wire_bytes": statistics.mean(per_step("wire_bytes")),
            "wire_bytes_selected": statistics.mean(per_step("wire_bytes_selected")),
            "kept_fraction": statistics.mean(kept) if kept else None,
            "peeled": statistics.mean(per_step("peeled")) if compressed else None,
            "estimated": statistics.mean(per_step("estimated")) if compressed else None,
            "final_loss": statistics.mean(losses[-TAIL:]), "losses": losses, "steps": len(losses),
            "samples_per_minibatch": sum(r["samples"] for r in steps[0]),
        })
    return rows, bars(rows)


def bars(rows: list[dict]) -> list[dict]:
    cell = {(r["comm"], r["compress"] is not None): r for r in rows}
    out = []
    for comm in ("odc", "collective"):
        dense, comp = cell[(comm, False)], cell[(comm, True)]
        speed = comp["samples_per_s"] / dense["samples_per_s"]
        shrink = dense["wire_bytes_selected"] / comp["wire_bytes_selected"]
        loss = abs(comp["final_loss"] / dense["final_loss"] - 1)
        gated = comm == "odc"  # the collective's traffic is loopback gloo: reported, not a bar
        out += [
            {"bar": f"{comm} compressed / dense samples/s", "value": speed, "threshold": 1.15 if gated else None,
             "pass": speed >= 1.15 if gated else None, "link_mbps": dense["link_mbps"]},
            {"bar": f"{comm} dense / compressed bytes on the selected pieces", "value": shrink,
             "threshold": 4.0 if gated else None, "pass": shrink >= 4.0 if gated else None},
            {"bar": f"{comm} |final loss compressed / dense - 1|", "value": loss, "threshold": 0.02 if gated else None,
             "pass": loss <= 0.02 if gated else None,
             "final_loss": [dense["final_loss"], comp["final_loss"]]},
        ]
    return out


def print_report(rows: list[dict], bar_rows: list[dict], args) -> None:
    for r in rows:
        r["run"] = _name(r["comm"], r["balance"], r["compress"] is not None)
        r["wire_MB"] = r["wire_bytes"] / 1e6
        r["selected_MB"] = r["wire_bytes_selected"] / 1e6
    print_table(rows, ["run", "transport", "link_mbps", "samples_per_s", "wire_MB", "selected_MB", "kept_fraction",
                       "peeled", "estimated", "final_loss"])
    print(f"(setting {args.compress!r}; wire bytes per minibatch summed over ranks; the collective runs over loopback "
          "gloo, which the link emulation does not reach)")
    for b in bar_rows:
        verdict = "" if b["pass"] is None else (" PASS" if b["pass"] else " FAIL")
        thr = "" if b["threshold"] is None else f" (bar {'<=' if 'loss' in b['bar'] else '>='} {b['threshold']})"
        print(f"{b['bar']} = {b['value']:.3f}{thr}{verdict}")


def draw_losses(rows: list[dict], path: str, args) -> str:
    import os

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        x = np.arange(1, len(r["losses"]) + 1) * r["samples_per_minibatch"]
        ax.plot(x, r["losses"], label=r["run"], linestyle="-" if r["compress"] is None else "--")
    link = f"{args.link_mbps:g} Mbit/s" if args.link_mbps else "no link cap"
    ax.set(xlabel="samples", ylabel="minibatch loss", title=f"dense vs TAGC ({args.compress}), ODC over {link}")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.path.abspath(path)
