"""`jaxodc bench models`: every example model (models/) trained by both sharded trainers, in fp32
and bf16, against single-process training of the same model on the same data.

    python -m jaxodc bench models --json bench/out/models.json
    python -m jaxodc bench models --collective-transports gloo,jaxodc --json bench/out/models.json

The models have a few MiB of parameters each (`--tiny`: kilobytes, where fixed buffers outweigh a
unit and the memory bound says little). The collective runs over gloo and/or jaxodc's lock-step
transport (records' `transport`; the lock-step group's buffers are counted in the peak).

One record per (model, comm, precision, ranks): the final loss of single-process
`jax.value_and_grad` training (fp32, jaxodc.train.reference) and of the sharded run, the largest
parameter difference after the steps, the accounted peak memory per rank against the bound
S/W + 3 x largest unit + activations (bench/train_memory.accounted), and the largest number of
gathered units alive at once in the compiled microbatch step (`gathered_peak_units`). A new example
model is one entry in MODELS.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from jaxodc.bench.common import add_reproducible_argument, print_table, write_records
from jaxodc.launch.launcher import launch_ranks, pin_one_core

MiB = 1 << 20
LOSS_RTOL = 1e-4  # bar: fp32 sharded losses equal single-process training within this, relative
SLOT_DIVISOR = 8


@dataclass
class Case:
    """An example model ready to train. `model`: a unit-staged model or a loss_fn(params, batch)
    returning the summed loss; `batch(step, rank, j, size)`: microbatch j of a rank at a step (`size`
    tokens or samples; size 1 gives the smallest batch, for the activation measurement);
    `count(batch)`: what its loss is summed over."""

    model: Any
    params: Any
    batch: Callable[..., dict]
    count: Callable[[dict], float]
    size: int
    policy: dict = field(default_factory=dict)

    def loss_sum(self, params, batch):
        return self.model.loss_sum(params, batch) if hasattr(self.model, "loss_sum") else self.model(params, batch)


def _tokens(vocab: int):
    """Packed token microbatches (balance.packing): two samples per row, random tokens."""
    from jaxodc.balance.packing import pack

    def batch(step, rank, j, size):
        rs = np.random.RandomState([step, rank, j])
        first = max(1, (2 * size) // 3)
        return pack([rs.randint(1, vocab, n).astype(np.int32) for n in (first, size - first) if n], size).as_dict()
    return batch


def _features(d_in: int, classes: int):
    def batch(step, rank, j, size):
        rs = np.random.RandomState([step, rank, j, 1])
        return {"x": rs.standard_normal((size, d_in)).astype(np.float32),
                "y": rs.randint(0, classes, size).astype(np.int32), "mask": np.ones(size, np.float32)}
    return batch


def _loss_tokens(b):
    return float(np.sum(b["loss_mask"]))


def _samples(b):
    return float(np.sum(b["mask"]))


# Sizes: a few MiB of parameters per model (bench train --memory's LM has 110 MiB), so that the
# parameters dominate what does not scale with them (the batch and the loss's buffers, page
# rounding of the runtime's segment, receive slots), as in real use; at a few kilobytes (the sizes
# before, `--tiny`) those fixed buffers weigh as much as a unit and the memory bar measures them
# rather than the sharding. Batches stay small: runs take seconds.

def mlp(tiny: bool = False) -> Case:
    import jax
    from jaxodc.models.mlp import MLP
    d_in, sizes = (16, (16, 64, 64, 10)) if tiny else (256, (256, 1024, 1024, 10))
    model = MLP(sizes)
    return Case(model, model.init(jax.random.PRNGKey(0)), _features(d_in, 10), _samples, 8)


def lm(tiny: bool = False) -> Case:
    import jax
    from jaxodc.models.lm import LM, LMConfig
    model = LM(LMConfig(vocab=256, d_model=64 if tiny else 256, n_layers=2, attention="dense"))
    return Case(model, model.init(jax.random.PRNGKey(0)), _tokens(256), _loss_tokens, 32)


def llama(tiny: bool = False) -> Case:
    import jax
    import jax.numpy as jnp
    from jaxodc.models.llama import Llama, LlamaConfig
    from jaxodc.modeling.adapters import linen_loss_fn
    cfg = (LlamaConfig(vocab=64, d_model=32, n_layers=3, ffn=64, scan_axis=1, tie_embeddings=True) if tiny else
           LlamaConfig(vocab=256, d_model=192, n_layers=3, ffn=768, scan_axis=1, tie_embeddings=True))
    batch = _tokens(cfg.vocab)
    params = jax.jit(lambda k: Llama(cfg).init(k, batch(0, 0, 0, 16)))(jax.random.key(0))
    return Case(linen_loss_fn(Llama(cfg), lambda apply, b: jnp.sum(apply(b))), params, batch, _loss_tokens, 16)


def nnx_mlp(tiny: bool = False) -> Case:
    import jax.numpy as jnp
    from flax import nnx
    from jaxodc.models.nnx_mlp import Classifier
    from jaxodc.modeling.adapters import nnx_loss_fn
    d_in, width = (8, 16) if tiny else (64, 512)
    loss_fn, tree = nnx_loss_fn(Classifier(d_in, width, rngs=nnx.Rngs(0)), lambda m, b: jnp.sum(m(b)))
    return Case(loss_fn, tree, _features(d_in, 5), _samples, 4, {"frozen": ("state/*",)})


def cnn(tiny: bool = False) -> Case:
    """linen conv + BatchNorm on scikit-learn's 8x8 digits, its `batch_stats` mutable: the trainers
    (and the reference) make a minibatch's new statistics the image-weighted mean of its
    microbatches' (docs/any_model.md, "Mutable state"). Microbatches hold 8 slots of which 6 to 8 are
    images (the rest padding, masked out of the statistics), so the weights differ."""
    import jax
    import jax.numpy as jnp
    from sklearn.datasets import load_digits
    from jaxodc.models.cnn import CNN
    from jaxodc.modeling.adapters import linen_loss_fn
    model = CNN(features=(4, 8) if tiny else (128, 256, 256))
    digits = load_digits()
    x, y = np.asarray(digits.data, np.float32).reshape(-1, 8, 8, 1) / 16.0, np.asarray(digits.target, np.int32)

    def batch(step, rank, j, size):
        rs = np.random.RandomState([step, rank, j, 3])
        idx = rs.randint(0, len(y), size)
        mask = (np.arange(size) < max(1, size - (step + rank + j) % 3)).astype(np.float32)
        return {"x": x[idx] * mask[:, None, None, None], "y": y[idx], "mask": mask}
    params = jax.jit(model.init)(jax.random.key(0), batch(0, 0, 0, 8))
    loss_fn = linen_loss_fn(model, lambda apply, b: jnp.sum(apply(b)), mutable=("batch_stats",))
    return Case(loss_fn, params, batch, _samples, 8)


# name -> Case builder (a new example model is one line here).
MODELS: dict[str, Callable[..., Case]] = {"mlp": mlp, "lm": lm, "llama": llama, "nnx_mlp": nnx_mlp, "cnn": cnn}


# XLA:CPU's default kernels compute a bf16 convolution in fp32 (bf16 operands converted to fp32
# copies, an fp32 result cast back), so a bf16 convolution unit costs its step about three fp32 units;
# its oneDNN path computes it in bf16, as a GPU does. The bench runs with it (records' `xla_flags`).
ONEDNN = "--xla_cpu_use_onednn=true"


def _args(argv):
    p = argparse.ArgumentParser(prog="jaxodc bench models", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the records here")
    p.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    p.add_argument("--comms", default="odc,collective")
    p.add_argument("--collective-transports", default="gloo",
                   help="comm=collective over these: gloo (jax's collectives) and/or jaxodc (the lock-step "
                        "collective over jaxodc's shm / tcp paths), e.g. gloo,jaxodc")
    p.add_argument("--tiny", action="store_true", help="the models at their former sizes (kilobytes)")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="minibatches")
    p.add_argument("--microbatches", type=int, default=2, help="per rank per minibatch")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--no-onednn", dest="onednn", action="store_false",
                   help="run XLA:CPU's default kernels, which compute bf16 convolutions in fp32 (see ONEDNN)")
    add_reproducible_argument(p)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--comm", help=argparse.SUPPRESS)
    p.add_argument("--transport", default="gloo", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _list(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def _optimizer(lr, clip):
    """Global-norm clipping + Adam: `clip` is jaxodc's (sharded) or optax's (single process)."""
    import optax
    return optax.chain(clip(1.0), optax.adam(lr))


def main(argv: list[str]) -> int:
    args = _args(argv)
    unknown = sorted(set(_list(args.models)) - set(MODELS))
    if unknown:
        raise SystemExit(f"jaxodc bench models: unknown models {unknown}; known: {sorted(MODELS)}")
    if args.worker:
        pin_one_core(int(os.environ.get("JAXODC_LOCAL_RANK", "0")))  # one core per rank, before jax
        return worker(args)
    if args.onednn:  # the ranks inherit it (launcher.rank_env_defaults keeps the caller's flags)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {ONEDNN}".strip()
    records = []
    runs = [(comm, t) for comm in _list(args.comms)
            for t in (_list(args.collective_transports) if comm == "collective" else ["jaxodc"])]
    for comm, transport in runs:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, f"models_{comm}.json")
            fwd = ["--models", args.models, "--precisions", args.precisions, "--steps", str(args.steps),
                   "--microbatches", str(args.microbatches), "--lr", str(args.lr)] + ["--tiny"] * args.tiny + [
                       "--reproducible"] * args.reproducible
            launch_ranks(args.ranks, "jaxodc.bench.models",
                         ["--worker", "--comm", comm, "--transport", transport, "--out", out] + fwd,
                         timeout_s=args.timeout)
            with open(out) as f:
                records += json.load(f)
    records.sort(key=lambda r: (list(MODELS).index(r["model"]), r["comm"], r["transport"], r["precision"]))
    bars = evaluate_bars(records)
    write_records(args.json, records + [dict(b, kind="bar") for b in bars])
    print_report(records, bars)
    return 0


# ---- gathered units alive at once, from the compiled step's schedule ----

# Ops that forward or copy a value (a view, a reshape, a cast): their results still hold the gathered
# unit. So does an elementwise loop fusion computed from the unit alone (a slice, a cast); one that
# also reads an activation makes something else, as do dots and reductions.
_HOLDERS = {"get-tuple-element", "bitcast", "copy", "convert", "reshape", "transpose", "slice", "tuple",
            "opt-barrier", "all-gather-done", "copy-start", "copy-done", "dynamic-slice", "concatenate"}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = ")
# ODC's gathers (whole unit, into a buffer, one buffer per parameter); XLA's all-gathers by opcode.
_ODC_GATHER = re.compile(r'custom_call_target="jaxodc_odc_gather(_pieces|_into)?"')
_ALL_GATHER = ("all-gather", "all-gather-start")
# The collective over jaxodc's transport (ops.lockstep_collective): one custom call for every kind;
# a gather is the one whose output is larger than its input (world x its shard).
_LOCKSTEP = 'custom_call_target="jaxodc_lockstep"'


# The collective's per_leaf units gather one parameter at a time (over gloo or the lock-step
# transport), each all-gather inside the name
# scope train.lockstep.GATHER_SCOPE + the unit's index: consecutive all-gathers of one scope
# (forward and backward re-gathers differ in their jvp / transpose prefix) are one gathered unit,
# alive from the first of them to the last use of any.
_SCOPE = re.compile(r'op_name="([^"]*?jaxodc_gather_u\d+)(?!\d)')


def _gather_scope(attrs: str) -> str | None:
    m = _SCOPE.search(attrs)
    return m.group(1) if m else None


def _numel(typ: str) -> int:
    m = re.match(r"\w+\[([\d,]*)\]", typ)
    return int(np.prod([int(d) for d in m.group(1).split(",") if d])) if m else 0


def _parse_entry(hlo: str) -> list[tuple[str, str, str, list[str], str]]:
    """(name, type, opcode, operand names, attributes) of the ENTRY computation's instructions, in
    the scheduled order of the compiled module."""
    lines = hlo.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("ENTRY"))
    out = []
    for line in lines[start + 1:]:
        if line.startswith("}"):
            break
        m = _INSTR.match(line)
        if not m:
            continue
        rest = line[m.end():]
        depth, k = 0, 0
        while k < len(rest) and not (depth == 0 and rest[k] == " "):  # the type, tuples included
            depth += (rest[k] == "(") - (rest[k] == ")")
            k += 1
        typ, rest = rest[:k], rest[k:].lstrip()
        op, _, args = rest.partition("(")
        depth, k = 1, 0
        while k < len(args) and depth:
            depth += (args[k] == "(") - (args[k] == ")")
            k += 1
        out.append((m.group(1), typ, op.strip(), re.findall(r"%([\w.\-]+)", args[:k]), args[k:]))
    return out


def gathered_peak_units(hlo: str) -> tuple[int, int]:
    """(largest number of gathers whose unit is alive at once, number of gathers) in the compiled
    step `hlo` (`compiled.as_text()`, scheduled). A gather (ODC's `jaxodc_odc_gather` custom call,
    an all-gather, or a lock-step collective whose output is larger than its input) is alive from
    its instruction to the last use of any value still holding its unit (_HOLDERS). XLA assigns
    buffers by this schedule, so this counts the gathered units the step's memory holds at once,
    whatever the model code intended."""
    instrs = _parse_entry(hlo)
    types = {name: typ for name, typ, *_ in instrs}
    scalar = lambda a: re.fullmatch(r"\w+\[\](\{\})?", types.get(a, "")) is not None  # noqa: E731
    holds: dict[str, set[int]] = {}  # value -> the gathers whose unit it holds
    born, last, lockstep, lockstep_gathers, instrs_of_gathers = [], [], 0, 0, 0
    prev_scope = None  # the unit scope of the latest gather (per_leaf units: a run of them is one unit)
    for i, (name, typ, op, operands, attrs) in enumerate(instrs):
        for a in operands:
            for g in holds.get(a, ()):
                last[g] = i
        is_lockstep = op == "custom-call" and _LOCKSTEP in attrs
        step_gather = is_lockstep and bool(operands) and _numel(typ) > _numel(types.get(operands[0], ""))
        lockstep += is_lockstep
        lockstep_gathers += step_gather
        if (op == "custom-call" and _ODC_GATHER.search(attrs)) or op in _ALL_GATHER or step_gather:
            instrs_of_gathers += 1
            scope = _gather_scope(attrs) if op in _ALL_GATHER or step_gather else None
            if scope is None or scope != prev_scope:  # a new gathered unit
                born.append(i)
                last.append(i)
            holds[name] = {len(born) - 1}
            prev_scope = scope
            continue
        src = set().union(*(holds.get(a, set()) for a in operands)) if operands else set()
        pure = all(a in holds or scalar(a) for a in operands)
        if src and (op in ("tuple", "opt-barrier", "get-tuple-element") or
                    (pure and (op in _HOLDERS or (op == "fusion" and "kind=kLoop" in attrs)))):
            holds[name] = src
    total = sum(1 for line in hlo.splitlines()
                if _ODC_GATHER.search(line) or re.search(r"= \S+ (%s)\(" % "|".join(_ALL_GATHER), line))
    outside = hlo.count(_LOCKSTEP) - lockstep  # lockstep calls (of any kind) outside ENTRY
    if outside or total != instrs_of_gathers - lockstep_gathers:
        raise RuntimeError(f"{max(outside, total + lockstep_gathers - instrs_of_gathers)} gathers or lock-step collectives "
                           "sit outside the step's ENTRY computation (inside a loop or call); their lifetimes "
                           "are not read")
    peak = max((sum(b <= i <= l for b, l in zip(born, last)) for i in range(len(instrs))), default=0)
    return peak, len(born)


# ---- the ranks ----

def _reference(case: Case, steps: int, counts: list[int], lr: float, optimizer=None):
    """Single-process training (jaxodc.train.reference) of the float leaves on every rank's
    microbatches of each step; other leaves (int, PRNG keys) stay. A loss returning (loss, new
    state) (BatchNorm's batch_stats): the state's leaves are not trained; every microbatch starts
    from the minibatch's state and the minibatch's new state is the count-weighted mean of its
    microbatches' (docs/any_model.md, "Mutable state"). `optimizer`: default clipping + Adam at `lr`.
    Returns (last loss, params)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jaxodc.train.reference import ReferenceTrainer
    example = jax.tree_util.tree_map(jnp.asarray, case.batch(0, 0, 0, case.size))
    stateful = isinstance(jax.eval_shape(case.loss_sum, case.params, example), tuple)
    paths = [jax.tree_util.keystr(p, simple=True, separator="/")
             for p, _ in jax.tree_util.tree_flatten_with_path(case.params)[0]]
    state_keys = tuple(f"{k}/" for k in jax.eval_shape(case.loss_sum, case.params, example)[1]) if stateful else ()
    leaves, tree = jax.tree_util.tree_flatten(case.params)
    trained = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)
               and not paths[i].startswith(state_keys)]
    rest = list(leaves)  # the untrained leaves (the state among them, updated per minibatch)

    def full_of(floats, rest):
        full = list(rest)
        for i, x in zip(trained, floats):
            full[i] = x
        return jax.tree_util.tree_unflatten(tree, full)

    class Floats:  # the loss over the trained leaves only; with state, the batch carries the rest
        @staticmethod
        def loss_sum(floats, batch):
            if stateful:
                return case.loss_sum(full_of(floats, batch["rest"]), batch["mb"])[0]
            return case.loss_sum(full_of(floats, rest), batch)

    ref = ReferenceTrainer(Floats, optimizer or _optimizer(lr, optax.clip_by_global_norm), [leaves[i] for i in trained])
    new_state = jax.jit(lambda floats, rest, b: case.loss_sum(full_of(floats, rest), b)[1]) if stateful else None
    loss = None
    for step in range(steps):
        mbs = [jax.tree_util.tree_map(jnp.asarray, case.batch(step, r, j, case.size))
               for r in range(len(counts)) for j in range(counts[r])]
        total_count = sum(case.count(b) for b in mbs)
        if stateful:  # each microbatch's new state from the minibatch's state, before the update
            sums = None
            for b in mbs:
                w = jax.tree_util.tree_map(lambda x: case.count(b) * np.asarray(x, np.float64),
                                           new_state(ref.params, rest, b))
                sums = w if sums is None else jax.tree_util.tree_map(np.add, sums, w)
            weight = sum(case.count(b) for b in mbs)
        loss = ref.step([{"mb": b, "rest": rest} for b in mbs] if stateful else mbs, total_count)
        if stateful:
            full = {**jax.tree_util.tree_unflatten(tree, rest),
                    **jax.tree_util.tree_map(lambda x: np.float32(x / weight), sums)}
            rest = jax.tree_util.tree_leaves(full)
    return loss, full_of(ref.params, rest)


def _max_diff(a, b) -> tuple[float, str]:
    """(largest absolute difference over the float leaves, the path of the leaf holding it)."""
    import jax
    import jax.numpy as jnp
    diffs = [(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))),
              jax.tree_util.keystr(p, simple=True, separator="/"))
             for (p, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves(b))
             if jnp.issubdtype(jnp.asarray(y).dtype, jnp.floating) and np.size(y)]
    return max(diffs, default=(0.0, ""))


def _run(ctx, name: str, case: Case, comm: str, precision: str, args) -> dict:
    """One sharded run of `case`; rank 0's record (the ranks' peaks: the largest)."""
    import jax
    import jax.numpy as jnp
    import jaxodc
    from jaxodc.bench.train_memory import _nbytes, accounted, program_activations
    from jaxodc.optim.clipping import clip_by_global_norm
    from jaxodc.modeling.precision import compute_dtype_of
    from jaxodc.modeling.program import program_of

    W, counts = ctx.world, [args.microbatches] * ctx.world
    example = case.batch(0, 0, 0, case.size)
    optimizer = _optimizer(args.lr, clip_by_global_norm)
    step = jaxodc.sharded_step(case.model, optimizer, comm=comm, unit_policy=case.policy or None, precision=precision,
                               reproducible=True if args.reproducible else None)
    # ODC's receive slots at 1/SLOT_DIVISOR of the largest shard, as `bench train --memory` sizes
    # them (1 MiB of a 13.5 MiB shard): pushes go in chunks, the slots stay small beside the bound.
    shard = step.layout(case.params, W, example).largest // W
    kw = {"slot_elems": max(1, shard // SLOT_DIVISOR)} if comm == "odc" else {"transport": args.transport}
    tr = step.init(case.params, ctx=ctx, example_batch=example, **kw)
    loss = None
    for step in range(args.steps):
        total = sum(case.count(case.batch(step, r, j, case.size)) for r in range(W) for j in range(counts[r]))
        res = tr.train_minibatch([case.batch(step, ctx.rank, j, case.size) for j in range(counts[ctx.rank])], total)
        loss = res.loss
    acc = accounted(tr, example)
    hlo_peak, gathers = gathered_peak_units(acc.pop("mb_compiled").as_text())
    one = program_of(case.model, case.params, 1, example_batch=example, **case.policy)  # identity gathers
    act = program_activations(one, example, case.batch(0, 0, 0, 1), compute_dtype_of(precision))
    # the trained parameters (the layout's leaves: not constants such as BatchNorm's statistics)
    floats = [jax.ShapeDtypeStruct(shape, jnp.float32) for u in tr.layout.units for shape in u.shapes]
    S = _nbytes(floats) + _nbytes(jax.eval_shape(optimizer.init, floats))  # trained parameters + Adam, unsharded
    unit = tr.layout.largest * 4
    shards = tr.local_shards()
    got = tr.allgather_obj({"shards": {k: v.tobytes() for k, v in shards.items()}, "peak": acc["peak_xla"],
                            "gathered": hlo_peak, "rank": ctx.rank,
                            "breakdown": {k: acc[k] for k in ("mb_phase", "opt_phase", "state", "mb_step", "opt_step",
                                                              "native")}})
    top = max(got, key=lambda d: d["peak"])  # the record's breakdown: the rank at the peak
    full = tr.program.unshard([{k: np.frombuffer(v, np.float32) for k, v in d["shards"].items()} for d in got],
                              tr.local_consts())  # with the current mutable state (batch_stats)
    tr.close()
    return {"model": name, "comm": comm, "transport": "jaxodc" if comm == "odc" else args.transport,
            "precision": precision, "ranks": W, "steps": args.steps, "params_bytes": _nbytes(floats),
            "loss_sharded": float(loss), "peak_bytes": top["peak"], "peak_rank": top["rank"],
            "bound_bytes": S / W + 3 * unit + act["activations"],
            "gathered_peak_units": max(d["gathered"] for d in got), "gathers": gathers,
            "units": len(tr.layout.units), "largest_unit": unit, "activations": act["activations"], "S": S,
            "mb_phase": top["breakdown"]["mb_phase"], "opt_phase": top["breakdown"]["opt_phase"],
            "state_bytes": top["breakdown"]["state"], "mb_step": top["breakdown"]["mb_step"],
            "opt_step": top["breakdown"]["opt_step"], **top["breakdown"]["native"],
            "opt_unitwise": (getattr(tr, "unitwise", None) is not None if comm == "collective" else tr.end.separable),
            "_full": full}


def worker(args) -> int:
    from jaxodc.launch.context import init_from_env, init_jax_distributed, shutdown
    ctx = init_from_env()
    if args.comm == "collective":
        init_jax_distributed(ctx)
    records, refs = [], {}
    for name in _list(args.models):
        case = MODELS[name](args.tiny)
        for precision in _list(args.precisions):
            rec = _run(ctx, name, case, args.comm, precision, args)
            full = rec.pop("_full")
            if ctx.rank == 0:
                if name not in refs:
                    refs[name] = _reference(case, args.steps, [args.microbatches] * ctx.world, args.lr)
                rec["loss_single"] = float(refs[name][0])
                rec["xla_flags"] = os.environ.get("XLA_FLAGS", "")
                rec["max_param_diff"], rec["max_param_diff_leaf"] = _max_diff(full, refs[name][1])
                records.append(rec)
    if ctx.rank == 0:
        with open(args.out, "w") as f:
            json.dump(records, f)
    shutdown(ctx)
    return 0


# ---- bars and report ----

def evaluate_bars(records: list[dict]) -> list[dict]:
    """The three bars, one row per record they apply to: value, limit, ratio, met."""
    bars = []
    for r in records:
        who = {k: r[k] for k in ("model", "comm", "transport", "precision", "ranks")}
        if r["precision"] == "fp32":
            rel = abs(r["loss_sharded"] - r["loss_single"]) / max(abs(r["loss_single"]), 1e-30)
            bars.append({"bar": "fp32 loss = single-process (relative)", **who, "value": rel, "limit": LOSS_RTOL})
        if r["precision"] == "bf16" and r["ranks"] == 2:
            bars.append({"bar": "bf16 peak <= bound (bytes)", **who, "value": r["peak_bytes"], "limit": r["bound_bytes"]})
        bars.append({"bar": "gathered units alive <= 2", **who, "value": r["gathered_peak_units"], "limit": 2})
    for b in bars:
        b["ratio"] = b["value"] / b["limit"]
        b["met"] = bool(b["value"] <= b["limit"])
    return bars


def print_report(records: list[dict], bars: list[dict]) -> None:
    tab = [{**{k: r[k] for k in ("model", "comm", "transport", "precision", "ranks", "steps", "loss_single",
                                  "loss_sharded", "max_param_diff", "gathered_peak_units", "units")},
            "peak_MiB": r["peak_bytes"] / MiB, "bound_MiB": r["bound_bytes"] / MiB,
            "peak/bound": r["peak_bytes"] / r["bound_bytes"]} for r in records]
    print("every example model, sharded vs single-process training (peak: accounted per rank, bound = S/W + 3 x "
          "largest unit + activations)")
    print_table(tab, ["model", "comm", "transport", "precision", "ranks", "steps", "loss_single", "loss_sharded",
                      "max_param_diff", "peak_MiB", "bound_MiB", "peak/bound", "gathered_peak_units", "units"])
    print()
    for title in dict.fromkeys(b["bar"] for b in bars):
        rows = [b for b in bars if b["bar"] == title]
        met = all(b["met"] for b in rows)
        worst = max(rows, key=lambda b: b["ratio"])
        print(f"bar {title}: worst {worst['model']}/{worst['comm']}/{worst['transport']}/{worst['precision']} "
              f"{worst['value']:.4g} vs {worst['limit']:.4g} (ratio {worst['ratio']:.3f}) -> {'met' if met else 'NOT met'}"
              + ("" if met else f" ({sum(not b['met'] for b in rows)} of {len(rows)} records over)"))


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
