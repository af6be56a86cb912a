"""`jaxodc bench optim`: a user's Optax chain on shards against the same chain in one process.

    python -m jaxodc bench optim --json bench/out/optim.json

The example Llama (models/llama.py, scan-stacked layers: each layer's slice of a stacked parameter
is its own unit, so a parameter's piece on a rank is several segments) trains a few minibatches of
samples of uneven lengths under every chain of `chains()`, with both sharded trainers at 2 and 3
ranks; rank 0 then runs the same chain in one process with plain Optax on the whole tree, fed the
gradients the sharded run's chain was given (recorded by a transformation in front of it, read back
from the ranks' optimizer states): the comparison is of the optimizer alone, not of two gradient
computations whose fp32 roundings Adam's division by sqrt(v) would magnify on near-zero elements. One launch per (comm, ranks) runs every chain, each with a fresh trainer;
its peak RSS is measured over its own run (the kernel's high-water mark, reset before each chain).

One record each: {"optimizer", "comm", "ranks", "max_abs_diff", "moved", "end_s", "peak_rss"}:
`moved` is the largest change of the reference's parameters from their start, `end_s` the median
end of a minibatch (StepResult.end_s) after the first, `peak_rss` the largest peak RSS of the ranks
(bytes). Bar: max_abs_diff <= 1e-3 * moved for every record.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

import numpy as np

from jaxodc.bench.common import print_table, write_records
from jaxodc.launch.launcher import launch_ranks, pin_one_core

BAR = 1e-3  # max_abs_diff <= BAR * moved


def chains(lr: float = 1e-2) -> dict:
    """name -> an Optax chain as users write them for the whole tree."""
    import jax
    import jax.numpy as jnp
    import optax

    def own_norms():
        """A transformation of the user's own: per-leaf `jnp.linalg.norm`, `jnp.max` over the tree."""
        def update(u, state, params=None):
            top = jnp.max(jnp.stack([jnp.max(jnp.abs(x)) for x in jax.tree.leaves(u)]))
            return jax.tree.map(lambda x: lr * x / (jnp.linalg.norm(x) + 1.0) / top, u), state
        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

    def path_has(word):
        return lambda p: jax.tree_util.tree_map_with_path(lambda path, x: word in jax.tree_util.keystr(path), p)

    return {
        "adam": optax.adam(lr),
        "adamw_mask_ndim": optax.adamw(lr, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
        "adamw_mask_path": optax.adamw(lr, weight_decay=0.1,
                                       mask=lambda p: jax.tree.map(lambda b: not b, path_has("bias")(p))),
        "clip_by_global_norm": optax.chain(optax.clip_by_global_norm(0.5), optax.adam(lr)),
        "clip": optax.chain(optax.clip(0.3), optax.sgd(lr)),
        "adaptive_grad_clip": optax.chain(optax.adaptive_grad_clip(0.01), optax.sgd(lr)),
        "lamb": optax.lamb(lr),
        "lars": optax.lars(lr),
        "adafactor": optax.adafactor(lr, min_dim_size_to_factor=2),
        "muon": optax.contrib.muon(lr),
        "schedule_free_adamw": optax.contrib.schedule_free_adamw(lr),
        "multi_transform_path": optax.multi_transform(
            {"fast": optax.adam(lr), "slow": optax.sgd(lr / 10)},
            lambda p: jax.tree.map(lambda b: "fast" if b else "slow", path_has("block")(p))),
        "multi_steps": optax.MultiSteps(optax.adam(lr), 2),
        "apply_if_finite": optax.apply_if_finite(optax.adam(lr), 3),
        "own_norms": own_norms(),
    }


def _args(argv):
    p = argparse.ArgumentParser(prog="jaxodc bench optim", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the records here")
    p.add_argument("--optimizers", default=",".join(chains()), help="of: " + ", ".join(chains()))
    p.add_argument("--comms", default="odc,collective")
    p.add_argument("--ranks", default="2,3")
    p.add_argument("--steps", type=int, default=3, help="minibatches")
    p.add_argument("--microbatches", type=int, default=2, help="per rank per minibatch")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--comm", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _list(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def _case():
    """The example Llama with microbatches of uneven samples (bench models' packing)."""
    from jaxodc.bench.models import llama
    return llama(tiny=False)


def _reset_peak_rss() -> None:
    """Starts a new peak-RSS interval (Linux: VmHWM is reset by writing 5 to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss() -> int:
    """This process's peak RSS (bytes) since `_reset_peak_rss`."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def _recorded(tx):
    """`tx` after a transformation that keeps the latest gradients as its state: a parameter-shaped
    state, so it is held as pieces like Adam's moments, and the bench reads back exactly the
    gradients the sharded run's chain was given."""
    import jax
    import jax.numpy as jnp
    import optax
    record = optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), lambda u, s, p=None: (u, u))
    return optax.chain(record, tx)


def _gradients(tr) -> list:
    """The recorded gradients (`_recorded`) of the last minibatch, whole, in the model's tree
    order of parameters; collective over ranks."""
    import jax
    from jaxodc.optim.pieces import assemble_host
    leaves = jax.tree.leaves(tr.local_opt_state())
    params = tr.optimizer.state_param
    tree = tr.program.param_tree()
    n = len(tree.shapes)  # the record's leaves come first, one per parameter, in tree order
    if params[:n] != list(range(n)):
        raise RuntimeError(f"the recorded gradients are not the state's first leaves: {params[:n]}")
    got = tr.allgather_obj([np.asarray(x, np.float32).tobytes() for x in leaves[:n]])
    return [assemble_host(tree, tr.layout, i, [np.frombuffer(g[i], np.float32) for g in got]) for i in range(n)]


def _train(ctx, case, name: str, args):
    """One chain's sharded run: (its full parameters, the gradients of every minibatch (rank 0),
    median end_s after the first minibatch, peak RSS of the ranks)."""
    import jaxodc
    W = ctx.world
    _reset_peak_rss()
    example = case.batch(0, 0, 0, case.size)
    tr = jaxodc.sharded_step(case.model, _recorded(chains()[name]), comm=args.comm).init(
        case.params, ctx=ctx, example_batch=example)
    ends, grads = [], []
    for step in range(args.steps):
        mbs = [case.batch(step, r, j, case.size) for r in range(W) for j in range(args.microbatches)]
        mine = mbs[ctx.rank * args.microbatches:(ctx.rank + 1) * args.microbatches]
        ends.append(tr.train_minibatch(mine, sum(case.count(b) for b in mbs)).end_s)
        grads.append(_gradients(tr))
    shards = tr.local_shards()
    got = tr.allgather_obj({"shards": {k: v.tobytes() for k, v in shards.items()}, "rss": _peak_rss()})
    full = tr.program.unshard([{k: np.frombuffer(v, np.float32) for k, v in d["shards"].items()} for d in got],
                              tr.local_consts())
    tree = tr.program.param_tree()
    tr.close()
    return full, grads, tree, statistics.median(ends[1:] or ends), max(d["rss"] for d in got)


def _reference(case, tree, name: str, grads: list):
    """Single-process Optax on the whole tree, fed the sharded run's gradients: the parameters it
    ends with (the model's own tree, constants as they were)."""
    import jax
    import jax.numpy as jnp
    import optax
    tx = chains()[name]
    full = jax.tree.map(lambda x: np.asarray(x, np.float32) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)
                        else np.asarray(x), case.params)
    flat, treedef = jax.tree_util.tree_flatten_with_path(full)
    where = {jax.tree_util.keystr(p): i for i, (p, _) in enumerate(flat)}
    index = [where[jax.tree_util.keystr(p)] for p in tree.paths]  # each parameter's leaf in the full tree
    params = jax.tree_util.tree_unflatten(tree.treedef, [jnp.asarray(flat[i][1]) for i in index])
    state = tx.init(params)
    update = jax.jit(lambda g, s, p: tx.update(g, s, p))
    for g in grads:
        upd, state = update(jax.tree_util.tree_unflatten(tree.treedef, [jnp.asarray(x) for x in g]), state, params)
        params = optax.apply_updates(params, upd)
    leaves = [x for _, x in flat]
    for i, x in zip(index, jax.tree.leaves(params)):
        leaves[i] = np.asarray(x)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def worker(args) -> int:
    import jax
    from jaxodc.bench.models import _max_diff
    from jaxodc.launch.context import init_from_env, init_jax_distributed, shutdown
    ctx = init_from_env()
    if args.comm == "collective":
        init_jax_distributed(ctx)
    case, records = _case(), []
    start = jax.tree.map(lambda x: np.asarray(x), case.params)
    for name in _list(args.optimizers):
        full, grads, tree, end_s, rss = _train(ctx, case, name, args)
        if ctx.rank == 0:
            ref = _reference(case, tree, name, grads)
            diff, leaf = _max_diff(full, ref)
            records.append({"optimizer": name, "comm": args.comm, "ranks": ctx.world, "max_abs_diff": diff,
                            "max_abs_diff_leaf": leaf, "moved": _max_diff(start, ref)[0], "end_s": end_s,
                            "peak_rss": rss, "steps": args.steps})
            print(json.dumps(records[-1]), flush=True)
    if ctx.rank == 0:
        with open(args.out, "w") as f:
            json.dump(records, f)
    shutdown(ctx)
    return 0


def main(argv: list[str]) -> int:
    args = _args(argv)
    unknown = sorted(set(_list(args.optimizers)) - set(chains()))
    if unknown:
        raise SystemExit(f"jaxodc bench optim: unknown optimizers {unknown}; known: {sorted(chains())}")
    if args.worker:
        pin_one_core(int(os.environ.get("JAXODC_LOCAL_RANK", "0")))  # one core per rank, before jax
        return worker(args)
    records = []
    for comm in _list(args.comms):
        for ranks in map(int, _list(args.ranks)):
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "records.json")
                launch_ranks(ranks, "jaxodc.bench.optim",
                             ["--worker", "--comm", comm, "--out", out, "--optimizers", args.optimizers,
                              "--steps", str(args.steps), "--microbatches", str(args.microbatches)],
                             timeout_s=args.timeout)
                with open(out) as f:
                    got = json.load(f)
            for rec in got:
                rec["met"] = rec["max_abs_diff"] <= BAR * rec["moved"]
            records += got
    write_records(args.json, records)
    print_table(records, ["optimizer", "comm", "ranks", "max_abs_diff", "moved", "end_s", "peak_rss", "met"])
    bad = [r for r in records if not r["met"]]
    print(f"bar max_abs_diff <= {BAR} * moved: {len(records) - len(bad)} of {len(records)} met"
          + ("" if not bad else " -- FAIL: " + ", ".join(f"{r['optimizer']}/{r['comm']}/{r['ranks']}" for r in bad)))
    return 0


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
