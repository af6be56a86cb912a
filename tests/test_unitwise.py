"""The per-unit optimizer step (jaxodc.train.unitwise) against today's whole-tree step
(core.optimizer_updates): the same updates and state after several steps, shared counts advanced
once per step, exact global-norm clipping, and the whole-tree fallback for transformations that mix
units."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxodc.optim.clipping import clip_by_global_norm
from jaxodc.train.core import optimizer_updates
from jaxodc.train.unitwise import UnitwiseOptimizer

SIZES = {"embed": 12, "block_0": 20, "block_1": 20, "head": 8}


def _sum_reducer(log):
    """A reduce_fn factory that records what it reduces (one process: the identity)."""
    return lambda v: (lambda x: (log.append(1), x)[1])


def _run(opt, unitwise: bool, steps=4):
    rs = np.random.RandomState(0)
    shards = {n: jnp.asarray(rs.standard_normal(k).astype(np.float32)) for n, k in SIZES.items()}
    state = opt.init(shards)
    log = []
    uw = UnitwiseOptimizer(opt, shards, state, _sum_reducer(log)) if unitwise else None
    whole = jax.jit(lambda s, st, g, v: optimizer_updates(opt, s, st, g, _sum_reducer(log)(v)))
    for step in range(steps):
        grads = {n: jnp.asarray(rs.standard_normal(k).astype(np.float32) * (step + 1)) for n, k in SIZES.items()}
        if unitwise:
            new = {}
            state = uw.step(shards, state, grads, jnp.int32(step), lambda n, u: new.__setitem__(n, shards[n] + u))
            shards = new
        else:
            upd, state = whole(shards, state, grads, jnp.int32(step))
            shards = optax.apply_updates(shards, upd)
    return shards, state, uw


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw_schedule": lambda: optax.adamw(optax.linear_schedule(1e-2, 1e-3, 3), weight_decay=0.1),
    "clip_adam": lambda: optax.chain(clip_by_global_norm(1.0), optax.adam(1e-2)),
    "clip_sgd_momentum": lambda: optax.chain(clip_by_global_norm(0.5), optax.sgd(1e-2, momentum=0.9)),
    "flatten_adam": lambda: optax.flatten(optax.adam(1e-2)),  # shared state: exact, no memory saved
}
# Outputs that read other units' parameters or (already updated) state: the whole-tree step.
MIXING = {
    "flatten_adamw": lambda: optax.flatten(optax.adamw(1e-2, weight_decay=0.1)),
    "clip_after_momentum": lambda: optax.chain(optax.sgd(1e-2, momentum=0.9), clip_by_global_norm(0.05)),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_unitwise_equals_whole_tree(name):
    ref_shards, ref_state, _ = _run(OPTIMIZERS[name](), False)
    shards, state, uw = _run(OPTIMIZERS[name](), True)
    assert uw.separable, uw.reason
    for n in SIZES:
        np.testing.assert_allclose(shards[n], ref_shards[n], rtol=1e-6, atol=1e-7, err_msg=n)
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(ref_state)):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)  # counts: advanced once per step


@pytest.mark.parametrize("name", sorted(MIXING))
def test_mixing_transformations_are_refused_with_the_reason(name):
    opt, shards = MIXING[name](), {n: jnp.zeros(k) for n, k in SIZES.items()}
    uw = UnitwiseOptimizer(opt, shards, opt.init(shards), lambda v: (lambda x: x))
    assert not uw.separable and "depend on other units" in uw.reason
    with pytest.raises(ValueError, match="cannot run per unit"):
        uw.step({}, None, {}, 0, lambda n, u: None)
