"""W ranks of a placed optimizer (optim.placement) in one process, against Optax on the whole tree:
ODC's way (contiguous shards, a static rank each, EndStep's partial sums summed by hand level by
level) and the collective's (the rank traced inside shard_map, global_sum = psum; per_leaf shards,
or contiguous ones, whose pieces are padded to one length).
Run in a process with at least 3 CPU devices (XLA_FLAGS)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, PartitionSpec as P

from jaxodc.modeling.units import make_layout, shard_params, unshard_params
from jaxodc.optim.clipping import global_reduction
from jaxodc.optim.placement import ParamTree, place
from jaxodc.train.unitwise import EndStep


def params0():
    """A small model's tree: leaves that shards cut (rows too, at 3 ranks), vectors, a scalar."""
    k = jax.random.split(jax.random.PRNGKey(0), 5)
    return {"embed": {"w": jax.random.normal(k[0], (7, 5))},
            "block": {"dense": {"kernel": jax.random.normal(k[1], (5, 6)), "bias": jax.random.normal(k[2], (6,))},
                      "ln": {"scale": jnp.ones(6)}},
            "head": {"kernel": jax.random.normal(k[3], (6, 4)), "bias": jnp.zeros(4), "temp": jnp.float32(1.5)}}


def grads(step: int, inject_inf: bool = False):
    leaves, treedef = jax.tree.flatten(params0())
    ks = jax.random.split(jax.random.PRNGKey(100 + step), len(leaves))
    out = [jax.random.normal(k, jnp.shape(x)) * (1 + i) for i, (k, x) in enumerate(zip(ks, leaves))]
    if inject_inf and step == 1:
        out[1] = out[1].at[2, 3].set(jnp.inf)
    return jax.tree.unflatten(treedef, out)


def reference(tx, steps: int, inject_inf=False):
    p = params0()
    s = tx.init(p)
    for t in range(steps):
        u, s = tx.update(grads(t, inject_inf), s, p)
        p = optax.apply_updates(p, u)
    return p


def _host(tree):
    return {n: np.asarray(x) for n, x in tree.items()}


def odc_way(tx, world: int, steps: int, inject_inf=False):
    p = params0()
    layout = make_layout(p, world)
    tree = ParamTree.of_layout(layout)
    opts = [place(tx, tree, layout, r) for r in range(world)]
    shards = [{n: jnp.asarray(x) for n, x in shard_params(layout, p, r).items()} for r in range(world)]
    states = [opts[r].init(shards[r]) for r in range(world)]
    for t in range(steps):
        g = grads(t, inject_inf)
        gs = [{n: jnp.asarray(x) for n, x in shard_params(layout, g, r).items()} for r in range(world)]
        deps = [EndStep(opts[r], shards[r], states[r]).site_deps for r in range(world)]
        ends = [EndStep(opts[r], shards[r], states[r], agree=lambda d: deps) for r in range(world)]
        known = [[None] * len(e.sites) for e in ends]
        for k in range(ends[0].rounds):
            parts = [np.asarray(ends[r].partials(k, shards[r], jax.tree.leaves(states[r]), gs[r],
                                                 ends[r].fill(known[r])), np.float64) for r in range(world)]
            for r in range(world):
                ends[r].split(k, np.sum(parts, axis=0).astype(np.float32), known[r])
        for r in range(world):
            shards[r], leaves = ends[r].apply(shards[r], jax.tree.leaves(states[r]), gs[r], ends[r].fill(known[r]))
            states[r] = ends[r].state_tree(leaves)
    return unshard_params(layout, [_host(s) for s in shards])


def collective_way(tx, world: int, steps: int, inject_inf=False, sharding="per_leaf"):
    p = params0()
    layout = make_layout(p, world, sharding=sharding)
    axis = "ranks"
    mesh = Mesh(np.array(jax.devices()[:world]), (axis,))
    opt = place(tx, ParamTree.of_layout(layout), layout, None, rank_fn=lambda: jax.lax.axis_index(axis),
                serial_gathers=True)  # as the collective trainer places it
    shapes = opt.local_state_shapes()[0]
    state_spec = jax.tree.unflatten(jax.tree.structure(shapes), [P(axis) if s else P() for s in opt.state_sharded])
    names = layout.names
    spec = {n: P(axis) for n in names}

    def whole(t):
        return {n: jnp.concatenate([jnp.asarray(shard_params(layout, t, r)[n]) for r in range(world)]) for n in names}

    def smap(f, i, o):
        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=i, out_specs=o, check_vma=False))

    def init(sh):
        with global_reduction(lambda x: jax.lax.psum(x, axis)):
            return opt.init(sh)

    def step(sh, st, g):
        with global_reduction(lambda x: jax.lax.psum(x, axis)):
            u, st = opt.update(g, st, sh)
        return optax.apply_updates(sh, u), st

    sh = whole(p)
    st = smap(init, (spec,), state_spec)(sh)
    run = smap(step, (spec, state_spec, spec), (spec, state_spec))
    for t in range(steps):
        sh, st = run(sh, st, whole(grads(t, inject_inf)))
    return unshard_params(layout, [{n: np.asarray(sh[n]).reshape(world, -1)[r] for n in names} for r in range(world)])


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
