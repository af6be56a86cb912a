"""`jaxodc bench optim-memory`: how many gathered leaves a whole-leaf optimizer keeps alive.

    python -m jaxodc bench optim-memory --json bench/out/optim_memory.json

Muon (optax.contrib.muon: Newton-Schulz on each matrix, a whole-leaf operation) on K matrices of
N x N at 2 ranks, per_leaf shards, compiled for the CPU and read from XLA's memory analysis, in
matrices: ODC's end-of-minibatch program (train.unitwise.EndStep, its exchanges an opaque identity
so that XLA cannot fold them) and the collective's per-unit optimizer programs
(train.unitwise.UnitwiseOptimizer inside shard_map over 2 CPU devices, psum), each with every matrix
its own unit and with all K in one unit (as a transformer layer's matrices are). One record
each: {"comm", "layout", "matrices", "temp_matrices"}. Bar (issue "Your Optax chain, unchanged"):
at most one gathered leaf at a time, i.e. temp_matrices at K = 8 within one matrix of K = 2 beyond,
for ODC's one unit, the 6 more matrices' update pieces (1/W of a matrix each: the unit's new shard,
which any optimizer makes, is a temporary of its program until written). The collective's per-unit
programs return each parameter's update piece as an output of its own (train.collective
update_cuts): nothing is subtracted there.
"""
from __future__ import annotations

import argparse
import os
import sys

from jaxodc.bench.common import print_table, write_records

KS = (2, 4, 8)


def _tree(k: int, n: int, one_unit: bool):
    import jax
    import jax.numpy as jnp
    leaf = jax.ShapeDtypeStruct((n, n), jnp.float32)
    if one_unit:
        return {"u0": {f"w{i}": leaf for i in range(k)}}
    return {f"u{i}": {"w": leaf} for i in range(k)}


def odc_temp_matrices(k: int, one_unit: bool = False, n: int = 256, world: int = 2) -> float:
    """Temporaries of ODC's end program for Muon on k matrices, in matrices."""
    import jax
    import jax.numpy as jnp
    import optax
    from jaxodc.modeling.units import make_layout
    from jaxodc.optim.placement import ParamTree, place
    from jaxodc.train.unitwise import ROUND_ELEMENTS, EndStep
    layout = make_layout(_tree(k, n, one_unit), world, sharding="per_leaf")
    opt = place(optax.contrib.muon(1e-2), ParamTree.of_layout(layout), layout, 0)
    shards = {u.name: jnp.zeros((u.shard,), jnp.float32) for u in layout.units}
    state = opt.init(shards)
    end = EndStep(opt, shards, state)
    assert sorted(set(end.levels)) == list(range(end.rounds)), end.levels
    assert n * n < ROUND_ELEMENTS or end.rounds >= k, (end.rounds, k)  # a big leaf: an exchange each
    # the trainer's program: the update applied where the head rows agree (train/odc.py)
    prog = end.exchanged(lambda head, part: (head[None], jax.lax.optimization_barrier(part)),
                         keep=lambda rows: jnp.all(rows[:, 2:4] == rows[:1, 2:4]))
    compiled = prog.lower(shards, jax.tree_util.tree_leaves(state), shards, jnp.zeros(4, jnp.uint32)).compile()
    return compiled.memory_analysis().temp_size_in_bytes / (n * n * 4)


def collective_temp_matrices(k: int, one_unit: bool, n: int = 256, world: int = 2) -> float:
    """The largest temporaries of the collective's per-unit optimizer programs for Muon on k
    matrices, in matrices (needs `world` devices: --xla_force_host_platform_device_count)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh, PartitionSpec as P
    from jaxodc.modeling.units import make_layout
    from jaxodc.optim.placement import ParamTree, place
    from jaxodc.train.collective import AXIS, unitwise_optimizer
    layout = make_layout(_tree(k, n, one_unit), world, sharding="per_leaf")
    mesh = Mesh(np.array(jax.devices()[:world]), (AXIS,))
    opt = place(optax.contrib.muon(1e-2), ParamTree.of_layout(layout), layout, None,
                rank_fn=lambda: jax.lax.axis_index(AXIS), serial_gathers=True)  # as the trainer
    shapes = opt.local_state_shapes()[0]
    state_specs = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes),
                                               [P(AXIS) if s else P() for s in opt.state_sharded])
    smap = lambda f, i, o: jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o, check_vma=False)  # noqa: E731
    uw = unitwise_optimizer(opt, layout, world, state_specs, {u.name: P(AXIS) for u in layout.units}, smap)
    whole = {u.name: jax.ShapeDtypeStruct((u.shard * world,), jnp.float32) for u in layout.units}
    state = [jax.ShapeDtypeStruct((s.shape[0] * world,) + s.shape[1:], s.dtype) if sharded else s
             for s, sharded in zip(jax.tree_util.tree_leaves(shapes), opt.state_sharded)]
    state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), state)
    temps = [fn.lower(*args).compile().memory_analysis().temp_size_in_bytes
             for _, fn, args in uw.calls(whole, state, whole, jax.ShapeDtypeStruct((), jnp.int32))]
    return max(temps) / (n * n * 4)


def run(n: int) -> list[dict]:
    records = []
    for comm, layout, fn in (("odc", "a unit each", lambda k: odc_temp_matrices(k, False, n)),
                             ("odc", "one unit", lambda k: odc_temp_matrices(k, True, n)),
                             ("collective", "a unit each", lambda k: collective_temp_matrices(k, False, n)),
                             ("collective", "one unit", lambda k: collective_temp_matrices(k, True, n))):
        for k in KS:
            records.append({"bench": "optim_memory", "comm": comm, "layout": layout, "matrices": k, "n": n,
                            "temp_matrices": fn(k)})
            print(records[-1], flush=True)
    return records


def bars(records: list[dict], world: int = 2) -> list[dict]:
    """Temporaries that grow with the matrices beyond their local pieces: at most one matrix. In
    ODC's end program each matrix's update piece (1/W of it, part of its unit's new shard, which
    every optimizer makes, elementwise ones too) is a temporary until the unit's shard is written;
    the collective returns them as outputs. A gathered whole matrix may not be alive beyond the
    one being worked on."""
    out = []
    for comm, layout in sorted({(r["comm"], r["layout"]) for r in records}):
        t = {r["matrices"]: r["temp_matrices"] for r in records if (r["comm"], r["layout"]) == (comm, layout)}
        hi, lo = max(t), min(t)
        # a unit each: written one by one; the collective: outputs
        pieces = (hi - lo) / world if (comm, layout) == ("odc", "one unit") else 0.0
        value = t[hi] - t[lo] - pieces
        out.append({"bench": "optim_memory_bar",
                    "bar": f"temp at K={hi} - temp at K={lo} - {pieces:g} matrices of pieces <= 1 matrix",
                    "comm": comm, "layout": layout, "value": value, "limit": 1.0, "met": value <= 1.0})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jaxodc bench optim-memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the records here")
    p.add_argument("--n", type=int, default=256, help="matrix size")
    a = p.parse_args(argv)
    if "jax" in sys.modules:
        raise SystemExit("bench optim-memory sets XLA_FLAGS before jax is imported: run it as its own process")
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=2"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    records = run(a.n)
    result = bars(records)
    write_records(a.json, records + result)
    print_table(records, ["comm", "layout", "matrices", "temp_matrices"])
    print_table(result, ["comm", "layout", "bar", "value", "limit", "met"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
