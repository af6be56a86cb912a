"""The per_leaf sharding of train.units (FSDP2's per-parameter shards) against a numpy model."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxodc.modeling.units import (flat_from_pieces, flatten_unit, leaf_views, make_layout, shard_params,
                                unflatten_unit, unshard_params)

SHAPES = {"u": {"a": (3, 5), "b": (7,), "c": (2, 2, 2), "d": (1,)}, "v": {"w": (4, 4)}}


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {u: {k: rng.standard_normal(s).astype(np.float32) for k, s in leaves.items()} for u, leaves in SHAPES.items()}


def _numpy_shards(leaves, world, align=1):
    """Rank d's shard: every leaf padded to a multiple of world, its d-th 1/world slice, concatenated."""
    out = []
    for d in range(world):
        parts = []
        for x in leaves:
            n = x.size
            s = -(-n // world)
            parts.append(np.pad(x.ravel(), (0, world * s - n))[d * s:(d + 1) * s])
        cat = np.concatenate(parts)
        S = -(-cat.size // align) * align
        out.append(np.pad(cat, (0, S - cat.size)))
    return out


@pytest.mark.parametrize("world,align", [(1, 1), (2, 1), (3, 1), (4, 1), (3, 4)])
def test_per_leaf_roundtrip_against_numpy(world, align):
    params = _params()
    layout = make_layout(params, world, align=align, sharding="per_leaf")
    assert layout.sharding == "per_leaf"
    for u in layout.units:
        leaves = jax.tree_util.tree_leaves(params[u.name])
        want = _numpy_shards(leaves, world, align)
        flat = np.asarray(flatten_unit(u, params[u.name]))
        assert flat.shape == (u.padded,) and u.padded % (world * align) == 0
        np.testing.assert_array_equal(flat, np.concatenate(want))  # rank-major: shard d at [d*S, (d+1)*S)
        for d in range(world):
            a, b = u.shard_range(d)
            np.testing.assert_array_equal(flat[a:b], want[d])
        # padding: exactly the elements outside every leaf, all zero
        mask = np.zeros(u.padded, bool)
        for (off, s), x in zip(u.leaf_shards(), leaves):
            for d in range(world):
                k = min(s, max(0, x.size - d * s))
                mask[d * u.shard + off: d * u.shard + off + k] = True
        assert mask.sum() == u.numel and not flat[~mask].any()
        back = unflatten_unit(u, jnp.asarray(flat))
        for x, y in zip(leaves, jax.tree_util.tree_leaves(back)):
            np.testing.assert_array_equal(np.asarray(y), x)
        jback = jax.jit(lambda f: unflatten_unit(u, f))(jnp.asarray(flat))
        for x, y in zip(leaves, jax.tree_util.tree_leaves(jback)):
            np.testing.assert_array_equal(np.asarray(y), x)
        pieces = leaf_views(u, jnp.asarray(flat))
        np.testing.assert_array_equal(np.asarray(flat_from_pieces(u, pieces)), flat)
        # local_ranges: every leaf's elements found where the shard holds them
        for (o, n), x in zip(u.leaf_pieces(), leaves):
            got = np.concatenate([want[d][a:b] for d in range(world) for a, b in u.local_ranges(d, o, o + n)])
            np.testing.assert_array_equal(got, x.ravel())
    shards = [shard_params(layout, params, d) for d in range(world)]
    full = unshard_params(layout, shards)
    for name in params:
        for k in params[name]:
            np.testing.assert_array_equal(full[name][k], params[name][k])


def test_per_leaf_is_its_own_layout():
    params = _params()
    cont, per = make_layout(params, 2), make_layout(params, 2, sharding="per_leaf")
    assert cont.sharding == "contiguous" and cont.fingerprint() != per.fingerprint()
    assert "sharding" not in cont.units[0].describe()  # contiguous fingerprints unchanged
    assert per.fingerprint() == make_layout(_params(1), 2, sharding="per_leaf").fingerprint()
    u = per["u"]
    # per leaf padding: 15 -> 16, 7 -> 8, 8, 1 -> 2
    assert u.numel == 15 + 7 + 8 + 1 and u.padded == 16 + 8 + 8 + 2
    with pytest.raises(ValueError, match="per_leaf"):
        unflatten_unit(u, jnp.zeros(u.numel))
    with pytest.raises(ValueError, match="sharding must be one of"):
        make_layout(params, 2, sharding="rows")
    with pytest.raises(ValueError, match="per_leaf"):
        cont["u"].leaf_shards()


def test_discover_units_per_leaf():
    from jaxodc.modeling.discover import discover_units, shard_tree, unshard_tree
    tree = {"layers_0": {"w": np.arange(15, dtype=np.float32).reshape(3, 5), "b": np.ones(3, np.float32)},
            "layers_1": {"w": np.arange(15, dtype=np.float32).reshape(3, 5) + 1, "b": np.zeros(3, np.float32)}}
    plan = discover_units(tree, 2, sharding="per_leaf")
    assert plan.layout.sharding == "per_leaf"
    assert all(u.padded == 2 * sum(-(-math.prod(s) // 2) for s in u.shapes) for u in plan.layout.units)
    shards = [shard_tree(plan, tree, d) for d in range(2)]
    back = unshard_tree(plan, shards, [])
    for k in tree:
        for j in tree[k]:
            np.testing.assert_array_equal(back[k][j], tree[k][j])
