"""samples/s of the collective trainer per transport (gloo; jaxodc over shm; jaxodc over tcp) and of
ODC (its shm runtime), on the small LM at minibatch 1 (one sample per rank per minibatch, equal
lengths: every trainer runs the same schedule), ranks pinned to one core each as `bench train` does.
A quick check of the fair baseline; `bench train` is where the full comparison lives.

    python -m jaxodc.bench.collective_transports [--steps 20] [--tokens 256]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

MODES = ("collective/gloo", "collective/jaxodc-shm", "collective/jaxodc-tcp", "odc/shm")


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m jaxodc.bench.collective_transports")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="timed minibatches per mode and round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians over these)")
    p.add_argument("--tokens", type=int, default=256, help="length of every sample (one row each)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args) -> None:
    import jax
    import numpy as np
    import optax

    from jaxodc.balance.cost import CostModel
    from jaxodc.balance.plan import make_plan
    from jaxodc.launch.context import init_from_env, init_jax_distributed, shutdown
    from jaxodc.models.lm import LM, LMConfig
    from jaxodc.odc import Runtime
    from jaxodc.optim.clipping import clip_by_global_norm
    from jaxodc.train.collective import CollectiveTrainer
    from jaxodc.train.odc import OdcTrainer
    from jaxodc.modeling.units import make_layout

    ctx = init_from_env()
    init_jax_distributed(ctx)
    W = ctx.world
    model = LM(LMConfig(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads))
    params = model.init(jax.random.PRNGKey(0))
    opt = lambda: optax.chain(clip_by_global_norm(1.0), optax.adam(1e-3))  # noqa: E731
    trainers = {
        "collective/gloo": CollectiveTrainer(model, opt(), params),
        "collective/jaxodc-shm": CollectiveTrainer(model, opt(), params, transport="jaxodc", lockstep={"link": "shm"}),
        "collective/jaxodc-tcp": CollectiveTrainer(model, opt(), params, transport="jaxodc", lockstep={"link": "tcp"}),
    }
    rt = Runtime.create([u.padded for u in make_layout(params, W, order=model.unit_names).units], ctx, transport="shm")
    trainers["odc/shm"] = OdcTrainer(model, opt(), params, rt)
    rng = np.random.default_rng(0)
    T = args.tokens
    samples = [rng.integers(1, 250, T).astype(np.int32) for _ in range(W)]
    plan = make_plan("lb_micro", [T] * W, W, T, CostModel(0.0, 1e-6))

    def run(mode, steps):
        ctx.barrier(f"bench/{mode}")
        t0 = time.perf_counter()
        for _ in range(steps):
            trainers[mode].train_plan(plan, samples, min_bucket=T)
        ctx.barrier(f"bench/{mode}/end")
        return time.perf_counter() - t0

    for mode in MODES:  # compile
        run(mode, 2)
    sps = {m: [] for m in MODES}
    for rnd in range(args.rounds):
        for i in range(len(MODES)):
            mode = MODES[(i + rnd) % len(MODES)]
            sps[mode].append(W * args.steps / run(mode, args.steps))
    for tr in trainers.values():
        tr.close()
    rt.close()
    if ctx.rank == 0:
        with open(args.out, "w") as f:
            json.dump(sps, f)
    shutdown(ctx)


def main(argv: list[str]) -> int:
    args = _args(argv)
    if args.worker:
        from jaxodc.launch.launcher import pin_one_core
        pin_one_core(int(os.environ.get("JAXODC_LOCAL_RANK", "0")))
        worker(args)
        return 0
    from jaxodc.launch.launcher import launch_ranks
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "sps.json")
        launch_ranks(args.ranks, "jaxodc.bench.collective_transports", ["--worker", "--out", out] + argv,
                     timeout_s=1800)
        with open(out) as f:
            sps = json.load(f)
    med = {m: statistics.median(v) for m, v in sps.items()}
    for m in MODES:
        print(f"{m:24s} {med[m]:8.2f} samples/s  (rounds: {', '.join(f'{x:.2f}' for x in sps[m])})")
    # Paired per round (the modes of one round ran back to back): robust to load that comes and goes.
    for m in MODES[:3]:
        r = [o / c for o, c in zip(sps["odc/shm"], sps[m])]
        print(f"odc/shm / {m}: median {statistics.median(r):.3f} over rounds ({', '.join(f'{x:.2f}' for x in r)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
