"""A user's Optax chain on shards means what it means on the whole tree (optim.placement): every
transformation of the table at 3 ranks (so that shards cut leaves and rows unevenly; a few at 2 as
well), the ODC way (contiguous shards, EndStep's exchanges) and the collective's (the rank traced
inside shard_map, psum; per_leaf shards, and contiguous ones for five chains), against single-process Optax on the
same gradients, every element; an operation that cannot be placed is refused at start, naming it.
The chains are `jaxodc.bench.optim.chains()`."""

import numpy as np
import pytest

from harness import run_ranks

STEPS = 3
AT_TWO = ("adam", "clip_by_global_norm", "adafactor", "muon", "multi_steps")  # also at 2 ranks, and contiguous


def table_body(ctx):
    import jax
    import jax.numpy as jnp
    import optax
    from placement_ranks import collective_way, max_diff, odc_way, params0, reference
    from jaxodc.bench.optim import chains
    from jaxodc.modeling.units import make_layout
    from jaxodc.optim.placement import ParamTree, PlacementError, place

    def own_vdot():  # an inner product of values whose padding is not zero (x + 1)
        def update(u, state, params=None):
            d = sum(jnp.vdot(x + 1.0, x + 1.0) for x in jax.tree.leaves(u))
            return jax.tree.map(lambda x: 1e-2 * x / jnp.sqrt(d), u), state
        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

    out = {}
    for name, tx in {**chains(), "own_vdot": own_vdot()}.items():
        inf = name == "apply_if_finite"  # a gradient with an inf in step 1: skipped everywhere (a global any)
        ref = reference(tx, STEPS, inf)
        moved = max_diff(ref, params0())
        for world in (2, 3) if name in AT_TWO else (3,):
            diffs = {"odc": max_diff(odc_way(tx, world, STEPS, inf), ref),
                     "collective": max_diff(collective_way(tx, world, STEPS, inf), ref)}
            if world == 3 and name in AT_TWO:  # the same placement with per-rank tables of pieces
                diffs["collective contiguous"] = max_diff(collective_way(tx, world, STEPS, inf, "contiguous"), ref)
            out[name, world] = (moved, diffs)

    def peek():  # a callback on a parameter-sized value: cannot run on shards
        def update(u, state, params=None):
            jax.debug.callback(lambda x: None, u["block"]["dense"]["kernel"])
            return u, state
        return optax.GradientTransformation(lambda p: optax.EmptyState(), update)

    layout = make_layout(params0(), 2)
    try:
        place(optax.chain(peek(), optax.adam(1e-2)), ParamTree.of_layout(layout), layout, 0)
        out["refused"] = None
    except PlacementError as e:
        out["refused"] = str(e)
    return out


pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]  # about 100 programs compiled: minutes on 2 cores


@pytest.fixture(scope="module")
def table():
    (res,) = run_ranks(table_body, 1, timeout_s=1500,
                       env={"XLA_FLAGS": "--xla_force_host_platform_device_count=3"})
    return res


NAMES = ["adam", "adamw_mask_ndim", "adamw_mask_path", "clip_by_global_norm", "clip", "adaptive_grad_clip", "lamb",
         "lars", "adafactor", "muon", "schedule_free_adamw", "multi_transform_path", "multi_steps", "apply_if_finite",
         "own_norms",  # jaxodc.bench.optim.chains(): the table bench optim runs on the example Llama
         "own_vdot"]


@pytest.mark.parametrize("name,world", [(n, 3) for n in NAMES] + [(n, 2) for n in AT_TWO])
def test_chain_on_shards_equals_whole_tree(table, name, world):
    moved, diffs = table[name, world]
    assert moved > 1e-4, f"{name}: the reference hardly moved ({moved})"
    for way, diff in diffs.items():
        assert diff <= 1e-4 * moved, f"{name}, {way}, {world} ranks: max |sharded - whole| {diff} vs moved {moved}"


def test_unplaceable_operation_is_refused_naming_it(table):
    msg = table["refused"]
    assert msg is not None and "debug_callback" in msg and "cannot run on shards" in msg, msg
