"""`jaxodc bench diloco`: one job across 2 sites of 2 ODC ranks (jaxodc.optim.sites) on the small
LM, the same token budget per mode, the links between sites emulated (--wan-mbps / --wan-ms):

- ddp: hybrid sharding, every minibatch's gradient averaged across the sites;
- diloco: DiLoCo, the pseudo-gradient averaged every H inner minibatches;
- async_diloco: the same, each outer all-reduce overlapped with the next H inner minibatches.

One record per run: mode, H, groups, ranks, wan_mbps, tokens (every site's), bytes_per_token
(cross-site bytes sent by every rank / tokens), final_loss (θ_global evaluated on held-out
samples), outer_step_s and compute_s (per outer step, the slowest site's wall time and inner
compute; the first step left out: it compiles). Bars:
DiLoCo sends >= 15x fewer cross-site bytes per token than ddp with a final loss within 5 % of
ddp's; async DiLoCo's outer step <= 1.10x its inner compute (the all-reduce hidden). --png draws
the training loss against tokens for each mode.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

from bench.common import print_table, write_records

MODES = ("ddp", "diloco", "async_diloco")


def _args(argv):
    p = argparse.ArgumentParser(prog="jaxodc bench diloco")
    p.add_argument("--json", metavar="PATH", help="records (one per run)")
    p.add_argument("--png", metavar="PATH", help="training loss against tokens, one line per mode")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--H", type=int, default=16, help="inner minibatches per outer step")
    p.add_argument("--outer-steps", type=int, default=16, help="DiLoCo outer steps (the token budget: H x this)")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--wan-mbps", type=float, default=100.0)
    p.add_argument("--wan-ms", type=float, default=10.0)
    p.add_argument("--minibatch", type=int, default=4, help="samples per rank per minibatch")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3, help="inner Adam learning rate")
    # plain averaging (lr 1, no momentum) by default: at 2 sites the paper's Nesterov 0.7 / 0.9
    # trails ddp by 11 % (8 outer steps) and async diverges (bench/RESULTS.md, "Across sites")
    p.add_argument("--outer-lr", type=float, default=1.0, help="DiLoCo's outer SGD learning rate")
    p.add_argument("--outer-momentum", type=float, default=0.0, help="DiLoCo's outer Nesterov momentum (0: plain SGD)")
    p.add_argument("--quantize", default="none", choices=("none", "uint8", "uint16"),
                   help="the DiLoCo modes' pseudo-gradient transfer format")
    p.add_argument("--timeout", type=float, default=1200.0)
    return p.parse_args(argv)


def train_argv(a, mode: str, json_path: str) -> list[str]:
    steps = a.H * a.outer_steps
    across = ["--hybrid"] if mode == "ddp" else (["--diloco", str(a.H), "--quantize", a.quantize, "--outer-lr",
                                                  str(a.outer_lr), "--outer-momentum", str(a.outer_momentum)]
                                                 + (["--async"] if mode == "async_diloco" else []))
    return ["--groups", str(a.groups), "--ranks", str(a.ranks), *across, "--steps", str(steps),
            "--minibatch", str(a.minibatch), "--max-tokens", str(a.max_tokens), "--d-model", str(a.d_model),
            "--layers", str(a.layers), "--lr", str(a.lr), "--wan-mbps", str(a.wan_mbps), "--wan-ms", str(a.wan_ms),
            "--timeout", str(a.timeout), "--json", json_path]


def held_out_loss(targs, shards: list[dict], n: int = 64) -> float:
    """Mean token loss of θ_global (rank shards of one site) on samples no site trained on."""
    import jax

    from jaxodc.balance.packing import loss_tokens, pack
    from jaxodc.cli.train_models import model_of
    from jaxodc.data import synthetic_text
    from jaxodc.modeling.program import program_of
    model, params = model_of(targs)
    program = program_of(model, params, targs.ranks)
    full = program.unshard([{k: np.asarray(v, np.float32) for k, v in s.items()} for s in shards])
    held = synthetic_text("longalign", n, targs.max_tokens, seed=12345, min_len=8).tokens
    loss = jax.jit(model.loss_sum)
    total = sum(float(loss(full, pack([t], targs.max_tokens).as_dict())) for t in held)
    return total / loss_tokens([len(t) for t in held])


def run_mode(a, mode: str, workdir: str) -> tuple[dict, list]:
    import json

    from jaxodc.cli import sites
    from jaxodc.cli.train import parser, worker_argv
    path = os.path.join(workdir, mode)
    targs = parser().parse_args(train_argv(a, mode, path))
    status = sites.run_local(targs, worker_argv(targs))
    if status:
        raise SystemExit(f"bench diloco: the {mode} run failed with status {status}")
    recs = [r for s in range(a.groups) for r in sites.read_records(path, s)]
    final = []
    for s in range(a.groups):
        with open(path + sites.JSON_SUFFIX.format(s)) as f:
            final.append(json.load(f))
    tokens = sum(r["tokens"] for r in recs if r["rank"] == 0)
    # The job's outer step lasts as long as its slowest site's, and its compute is the slowest
    # site's inner minibatches: what is left over is what communication did not hide.
    steps = sorted({r["outer_step"] for r in recs if r["outer_step"] > 0})  # step 0 compiles
    slowest = lambda key, k: max(r[key] for r in recs if r["outer_step"] == k)
    rec = {"mode": mode, "H": 1 if mode == "ddp" else a.H, "quantize": None if mode == "ddp" or a.quantize == "none"
           else a.quantize, "outer_lr": None if mode == "ddp" else a.outer_lr,
           "outer_momentum": None if mode == "ddp" else a.outer_momentum, "groups": a.groups, "ranks": a.ranks,
           "wan_mbps": a.wan_mbps, "tokens": tokens,
           "bytes_per_token": sum(sum(f["bytes_sent"]) for f in final) / tokens,
           "final_loss": held_out_loss(targs, final[0]["shards"]),
           "outer_step_s": float(np.mean([slowest("seconds", k) for k in steps])),
           "compute_s": float(np.mean([slowest("compute_s", k) for k in steps]))}
    # the loss curve: the sites' mean training loss per outer step, against the job's tokens
    curve, seen = [], 0
    for k in sorted({r["outer_step"] for r in recs}):
        at = [r for r in recs if r["rank"] == 0 and r["outer_step"] == k]
        seen += sum(r["tokens"] for r in at)
        curve.append((seen, float(np.mean([r["loss"] for r in at]))))
    return rec, curve


def bars(records: list[dict]) -> list[tuple[str, float, str, bool]]:
    by = {r["mode"]: r for r in records}
    out = []
    if "ddp" in by and "diloco" in by:
        d, l = by["ddp"], by["diloco"]
        ratio = d["bytes_per_token"] / l["bytes_per_token"]
        out.append((f"ddp / DiLoCo H={l['H']} cross-site bytes per token", ratio, ">= 15", ratio >= 15))
        rel = abs(l["final_loss"] - d["final_loss"]) / d["final_loss"]
        out.append(("|DiLoCo - ddp| / ddp held-out loss", rel, "<= 0.05", rel <= 0.05))
    if "async_diloco" in by:
        r = by["async_diloco"]
        ratio = r["outer_step_s"] / r["compute_s"]
        out.append((f"async DiLoCo outer step / inner compute at {r['wan_mbps']:g} Mbit/s", ratio, "<= 1.10",
                    ratio <= 1.10))
    return out


def plot(curves: dict, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for mode, pts in curves.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=mode)
    ax.set_xlabel("tokens trained (all sites)")
    ax.set_ylabel("training loss (mean of sites, per outer step)")
    ax.set_title("2 sites x 2 ODC ranks, emulated WAN")
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    a = _args(argv)
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"bench diloco: unknown modes {bad}; choose from {MODES}", file=sys.stderr)
        return 2
    records, curves = [], {}
    with tempfile.TemporaryDirectory(prefix="jaxodc_bench_diloco_") as work:
        for mode in modes:
            rec, curves[mode] = run_mode(a, mode, work)
            records.append(rec)
    print()
    print_table(records, ["mode", "H", "quantize", "groups", "ranks", "wan_mbps", "tokens", "bytes_per_token", "final_loss",
                          "outer_step_s", "compute_s"])
    print()
    for name, value, bar, met in bars(records):
        print(f"{name}: {value:.3f} (bar {bar}: {'met' if met else 'NOT met'})")
    write_records(a.json, records)
    if a.png:
        print(f"loss curves: {plot(curves, a.png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
