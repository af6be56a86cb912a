"""`jaxodc bench train --memory`: the peak per-rank memory of both trainers against the bound
S/W + 3 x the largest unit + activations (accounting: bench/README.md). Options and the rank
launch are bench/train.py's."""
from __future__ import annotations

import gc
import json
import os
import re

import numpy as np

from jaxodc.bench.common import accumulate_of, print_table, write_records
from jaxodc.bench.train import MiB, _forward, _ints, _launch, _optimizer, warmup_odc


def run(args) -> int:
    """`--memory`: both trainers at every W of --memory-ranks; prints and writes the table."""
    # glibc hands freed large buffers back to the OS, so RSS follows live memory
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 << 10)
    per_rank = []
    for world in _ints(args.memory_ranks):
        for comm in ("collective", "odc"):
            per_rank += _launch(args, world, "memory", _forward(args) + ["--memory-comm", comm])["records"]
    rows = summarize_memory(per_rank)
    write_records(args.json, rows)
    print_memory(rows)
    return 0


def _status() -> dict[str, int]:
    """/proc/self/status memory lines, bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            m = re.match(r"(Vm\w+|Rss\w+):\s+(\d+) kB", line)
            if m:
                out[m.group(1)] = int(m.group(2)) * 1024
    return out


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset VmHWM to the current RSS
        f.write("5")


def _nbytes(tree) -> int:
    import jax
    return int(sum(np.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree)))


def _local_nbytes(tree) -> int:
    """Bytes this process holds of a tree of (possibly globally sharded) arrays."""
    import jax
    return int(sum(sum(s.data.nbytes for s in x.addressable_shards) if hasattr(x, "addressable_shards")
                   else np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(tree)))


def _compiled(jitted, *args):
    return jitted.lower(*args).compile()


def _analysis(jitted, *args) -> dict[str, int]:
    return _memory(_compiled(jitted, *args))


def host_cache_share(rt) -> int:
    """This rank's share of its host's gather cache (docs/hosts.md): the host's cache bytes over the
    host's ranks; 0 on one host, where no cache is made."""
    total = int(getattr(rt, "host_cache_bytes", 0) or 0)
    return total // max(1, int(os.environ.get("JAXODC_LOCAL_WORLD_SIZE", "1")))


def _memory(compiled) -> dict[str, int]:
    ma = compiled.memory_analysis()
    keys = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
            "peak_memory_in_bytes")
    return {k.replace("_size_in_bytes", "").replace("_in_bytes", ""): int(getattr(ma, k, 0) or 0) for k in keys}


def accounted(tr, batch: dict) -> dict:
    """The trainer's accounted peak per rank: live state (shards, optimizer state, the ODC
    runtime's memory) + the larger of its two phases' compiled step peaks (a microbatch of `batch`;
    the optimizer step). Also `mb_compiled`, the compiled microbatch step."""
    import jax.numpy as jnp
    state = _local_nbytes(tr.shards) + _local_nbytes(tr.opt_state)
    opt_bytes = _local_nbytes(tr.opt_state)
    native = {}
    if tr.comm == "collective":
        gb = {k: tr._global(v) for k, v in batch.items()}
        acc = {n: tr._global(np.zeros(tr.layout[n].shard, np.float32)) for n in tr.layout.names}
        counts = tr._global(np.zeros(3, np.int32))
        state_acc = tr._global(np.zeros(tr._state_size, np.float32))  # the mutable state's weighted sums
        mb_c = _compiled(tr._mb_step, tr.shards, tr.residuals, acc, counts, tr.consts, gb, jnp.float32(1.0),
                         state_acc)
        mb = _memory(mb_c)
        if getattr(tr, "unitwise", None) is None:
            opt = _analysis(tr._opt_step, tr.shards, tr.opt_state, acc)
        else:  # one call per unit (its updates then added into its shard in place): the largest counts
            opt = max((_analysis(fn, *a) for _, fn, a in tr.unitwise.calls(tr.shards, tr.opt_state, acc,
                                                                             jnp.int32(0))),
                      key=lambda m: m["temp"] + m["output"] - m["alias"])
        # transport="jaxodc": the lock-step group's buffers, outside XLA, alive all the time
        outside = lockstep_bytes(tr.group) if tr.group is not None else 0
        if tr.group is not None:
            native = {"lockstep_bytes": outside}
        mb_phase = outside + opt_bytes + _step_peak(mb)    # args: shards, accumulator, batch
        if getattr(tr, "unitwise", None) is None:
            opt_phase = outside + _step_peak(opt)          # args: shards, optimizer state, accumulator (donated)
        else:
            # A unit's call takes only what it reads (jit drops unused arguments), but every shard,
            # state leaf and gradient stays alive through the step: count them, then the call's
            # temporaries and its outputs (the unit's updates, added into its shard in place).
            opt_phase = (outside + state + _local_nbytes(acc) + opt["temp"] + opt["output"] - opt["alias"])
    else:
        st = tr.rt.stats()
        native = {k: int(st[k]) for k in ("master_bytes", "accum_bytes", "slot_bytes", "segment_bytes")}
        native["host_cache_bytes"] = host_cache_share(tr.rt)
        # the runtime's memory, outside XLA (and this rank's share of its host's gather cache)
        outside = native["segment_bytes"] + native["accum_bytes"] + native["host_cache_bytes"]
        jb = {k: jnp.asarray(v) for k, v in batch.items()}
        grads = {u.name: jnp.zeros(u.shard, jnp.float32) for u in tr.layout.units}
        mb_c = _compiled(tr._mb_step, tr.shards, tr.consts, jb, jnp.float32(1.0), jnp.int32(tr.version))
        mb = _memory(mb_c)
        # the end of a minibatch (OdcTrainer.end_programs): its programs run one after the other
        opt = max((_analysis(fn, *a) for _, fn, a in tr.end_programs(grads)),
                  key=lambda m: m["temp"] + m["output"] - m["alias"])
        mb_phase = outside + opt_bytes + _step_peak(mb)   # args: shards, batch
        if tr._masters is None:
            opt_phase = outside + _step_peak(opt)         # args: shards, optimizer state, fetched gradients
        else:
            # The shards are the runtime's masters and the gradients its accumulators (both in
            # `outside`); the program writes each unit's new shard into its master from inside
            # (one unit's alive at a time when the update is separable) and donates the state.
            mb_phase -= _local_nbytes(tr.shards)
            opt_phase = outside + opt_bytes + opt["temp"] + opt["output"] - opt["alias"]
    return {"state": state, "mb_step": mb, "opt_step": opt, "native": native, "mb_phase": mb_phase,
            "opt_phase": opt_phase, "peak_xla": max(mb_phase, opt_phase), "mb_compiled": mb_c}


def lockstep_bytes(group) -> int:
    """This rank's memory in a `LockstepGroup`, as the group reports it (csrc/lockstep/group.cc):
    its shm segment (header, post table, two staging areas shared by every channel, each of the
    largest single post) and, per tcp peer, receive double buffers of every channel's n elements."""
    return group.native_bytes


def _step_peak(ma: dict) -> int:
    """Bytes a step holds while it runs: its arguments, its temp buffer (allocated whole for the
    execution on CPU) and outputs not aliased to donated arguments. (XLA's `peak_memory_in_bytes`
    leaves the temp buffer out on CPU, so it is not used.)"""
    return ma["argument"] + ma["temp"] + ma["output"] - ma["alias"]


def activation_bytes(model, params_shape, tokens: int, compute_dtype=None) -> dict[str, int]:
    """Activations of one microbatch of `tokens` tokens of a unit-staged model (program_activations
    with packed token rows of `tokens` and of 1 token)."""
    from jaxodc.balance.packing import pack
    from jaxodc.modeling.program import staged_program
    return program_activations(staged_program(model, params_shape, 1), pack([], tokens).as_dict(),
                               pack([], 1).as_dict(), compute_dtype)


def program_activations(program, batch: dict, small: dict, compute_dtype=None) -> dict[str, int]:
    """Activations of microbatch `batch`, measured from the compiled program: the trainers'
    remat'd per-unit program (`program` built for one rank) with identity gathers (no
    communication), temp size at `batch` less temp size at the smallest batch `small`
    (parameter-sized buffers, which do not scale with the batch)."""
    import jax
    import jax.numpy as jnp
    shards = {u.name: jax.ShapeDtypeStruct((u.padded,), jnp.float32) for u in program.layout.units}
    dtype = compute_dtype or jnp.float32  # units arrive in it (bf16 under mixed precision)
    f = jax.jit(program.grad(lambda s, spec, ctx: s.astype(dtype), dtype))
    temp = [_analysis(f, shards, program.consts, b, jnp.float32(1.0), None)["temp"] for b in (batch, small)]
    return {"activations": max(temp[0] - temp[1], 0), "temp_w1": temp[0], "temp_w1_1token": temp[1]}


def unsharded_peak(model, params_shape, optimizer, tokens: int) -> int:
    """Accounted peak of plain single-process training (jaxodc.train.reference: full parameters,
    no units, no remat) on one microbatch of `tokens` tokens: optimizer state + the compiled
    gradient step's arguments (parameters, batch), temp buffer and outputs (loss, gradients)."""
    import jax
    import jax.numpy as jnp
    from jaxodc.balance.packing import pack
    f = jax.jit(jax.value_and_grad(lambda p, b, n: model.loss_sum(p, b) / n))
    ma = _analysis(f, params_shape, pack([], tokens).as_dict(), jnp.float32(1.0))
    return _nbytes(jax.eval_shape(optimizer.init, params_shape)) + _step_peak(ma)


def worker(args) -> int:
    import jax
    import jax.numpy as jnp
    import msgpack

    from jaxodc.launch.context import init_from_env, init_jax_distributed, shutdown
    from jaxodc.balance.plan import Plan
    from jaxodc.train.collective import CollectiveTrainer
    from jaxodc.train.odc import OdcTrainer
    from jaxodc.data import synthetic_text
    from jaxodc.odc import Runtime
    from jaxodc.balance.packing import pack
    from jaxodc.modeling.units import make_layout
    from jaxodc.models.lm import LM, LMConfig

    ctx = init_from_env()
    init_jax_distributed(ctx)
    W, rank, comm, T = ctx.world, ctx.rank, args.memory_comm, args.memory_tokens
    jnp.zeros(8).block_until_ready()
    base = _status()  # private memory of an initialised process with no model

    model = LM(LMConfig(d_model=args.memory_d_model, n_layers=args.memory_layers, n_heads=args.heads))
    params = model.init(jax.random.PRNGKey(args.seed))
    layout = make_layout(params, W, order=model.unit_names)
    shape = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    from jaxodc.modeling.precision import compute_dtype_of
    act = activation_bytes(model, shape, T, compute_dtype_of(args.precision))
    optimizer = _optimizer(args.lr)
    unsharded = unsharded_peak(model, shape, optimizer, T)
    S = _nbytes(params) + _nbytes(jax.eval_shape(optimizer.init, params))  # parameters + Adam state, unsharded
    unit = layout.largest * 4
    rt = None
    if comm == "collective":
        tr = CollectiveTrainer(model, optimizer, params, precision=args.precision,
                               transport=args.memory_collective_transport)
    else:
        rt = Runtime.create([u.padded for u in layout.units], ctx, slot_elems=int(args.memory_slot_mib * MiB) // 4,
                            accumulate=accumulate_of(args))
        tr = OdcTrainer(model, optimizer, params, rt, precision=args.precision)
    del params
    gc.collect()

    # One microbatch of T tokens per rank per minibatch (samples from the usual data).
    data = synthetic_text(args.preset, W * (args.memory_steps + 1), T, seed=args.seed + 1, min_len=T)
    def minibatch(step):
        idx = list(range(step * W, (step + 1) * W))
        plan = Plan("lb_micro", W, T, tuple(T for _ in idx), tuple(((i,),) for i in range(W)))
        return plan, [data[i] for i in idx]

    if comm == "collective":
        tr.warmup([T])
    else:
        warmup_odc(tr, [T], 1)
    tr.train_plan(*minibatch(0))  # first real minibatch: touches every buffer and peer segment
    gc.collect()
    # Arrays that are the runtime's own masters or accumulators (OdcTrainer on CPU: its shards and
    # its zero-copy gradient arrays) are counted once, as native.
    masters = {rt.master_view(u.index).ctypes.data for u in layout.units} if rt else set()
    masters |= {a.unsafe_buffer_pointer() for a in (getattr(tr, "_grads", None) or {}).values()}
    live = sum(sum(sh.data.nbytes for sh in a.addressable_shards) for a in jax.live_arrays()
               if not (masters and a.unsafe_buffer_pointer() in masters))
    # The ODC runtime's segment and accumulators, or the lock-step group's segment (transport
    # "jaxodc"): shm pages, which the transient below leaves out with the peers' mapped segments.
    native_live = ((rt.stats()["segment_bytes"] + rt.stats()["accum_bytes"] + host_cache_share(rt)) if rt else
                   lockstep_bytes(tr.group) if tr.group is not None else 0)
    _reset_peak()
    before = _status()
    for step in range(1, args.memory_steps + 1):
        tr.train_plan(*minibatch(step))
    after = _status()
    # Transient: the window's peak private memory over its private memory at the start (shared
    # file / shm pages are subtracted: peers' segments are mapped here too).
    shared = max(after["RssFile"], before["RssFile"]) + max(after["RssShmem"], before["RssShmem"])
    private_before = before["VmRSS"] - before["RssFile"] - before["RssShmem"]
    transient = max(after["VmHWM"] - shared - private_before, 0)
    peak_rss = live + native_live + transient
    overhead = private_before - base["RssAnon"] - live - (rt.stats()["accum_bytes"] if rt else 0)

    # Accounted: live state + the larger of the two phases' XLA step peaks.
    acc = accounted(tr, pack([data[0]], T).as_dict())
    state, mb, opt, native = acc["state"], acc["mb_step"], acc["opt_step"], acc["native"]
    mb_phase, opt_phase, peak_xla = acc["mb_phase"], acc["opt_phase"], acc["peak_xla"]
    bound = S / W + 3 * unit + act["activations"]
    rec = {"kind": "memory", "comm": comm, "transport": "jaxodc" if rt else args.memory_collective_transport,
           "ranks": W, "rank": rank, "precision": args.precision, "accumulate": rt.accumulate if rt else None, "S": S, "S_over_W": S / W,
           "unsharded_peak": unsharded,
           "largest_unit": unit, "tokens": T, **act, "bound": bound, "peak_rss": peak_rss, "peak_xla": peak_xla,
           "state": state, "mb_phase": mb_phase, "opt_phase": opt_phase,
           "opt_unitwise": comm == "odc" and tr.end.separable, "mb_step": mb, "opt_step": opt, **native,
           "live_arrays": live, "native_live": native_live, "transient_rss": transient,
           "process_overhead": overhead, "d_model": args.memory_d_model, "layers": args.memory_layers}
    if rt:
        rt.close()
    blobs = ctx.allgather("bench/memory", msgpack.packb(rec))
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"records": [msgpack.unpackb(b) for b in blobs]}, f)
    shutdown(ctx)
    return 0


def summarize_memory(per_rank: list[dict]) -> list[dict]:
    """One record per (comm, ranks): the largest rank's figures."""
    out = {}
    for r in per_rank:
        key = (r["comm"], r["ranks"])
        if key not in out or max(r["peak_rss"], r["peak_xla"]) > max(out[key]["peak_rss"], out[key]["peak_xla"]):
            out[key] = r
    rows = []
    for key in sorted(out, key=lambda k: (k[1], k[0])):
        r = {k: v for k, v in out[key].items() if k != "rank"}
        peak = max(r["peak_rss"], r["peak_xla"])
        r.update(peak=peak, peak_over_bound=peak / r["bound"], peak_over_S=peak / r["S"], below_bound=peak < r["bound"])
        rows.append(r)
    return rows


def print_memory(rows: list[dict]) -> None:
    tab = [{"comm": r["comm"], "W": r["ranks"], "precision": r["precision"], **{k: r[k] / MiB for k in (
        "S", "S_over_W", "largest_unit", "activations", "bound", "peak_rss", "peak_xla", "unsharded_peak")},
        "peak/bound": r["peak_over_bound"], "peak/S": r["peak_over_S"]} for r in rows]
    print("peak per-rank memory, MiB (S = parameters + Adam state, unsharded; bound = S/W + 3 x largest unit + activations)")
    print_table(tab, ["comm", "W", "precision", "S", "S_over_W", "largest_unit", "activations", "bound", "peak_rss", "peak_xla",
                      "peak/bound", "peak/S", "unsharded_peak"])
    print("(unsharded_peak: plain single-process training of the same model and microbatch, accounted)")
    for r in rows:
        verdict = "PASS" if r["below_bound"] else "FAIL"
        print(f"W={r['ranks']} {r['comm']}: peak {max(r['peak_rss'], r['peak_xla']) / MiB:.1f} MiB "
              f"(measured {r['peak_rss'] / MiB:.1f}, accounted {r['peak_xla'] / MiB:.1f}) vs bound {r['bound'] / MiB:.1f} MiB "
              f"-> {verdict}; {r['peak_over_S']:.2f} x unsharded S")
