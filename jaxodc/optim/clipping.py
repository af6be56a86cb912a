"""Exact global quantities for optimizers that run on local parameter shards.

A sharded trainer runs its Optax optimizer on each rank's shards, so anything that reduces over the
whole parameter tree must also reduce over ranks. `global_sum` is the hook that marks such a
reduction: while a trainer traces its optimizer step it binds it (collective: `lax.psum` inside the
step; ODC: `train.unitwise.EndStep` finds every call while tracing, computes the arguments of all of
them in one program and sums them in the minibatch's one exchange, then feeds the sums to the
optimizer's program); outside a trainer it is the identity. Elementwise transformations (adam, sgd,
weight decay, schedules) need nothing; clipping by the global norm needs `clip_by_global_norm` from
here (`optax.clip_by_global_norm` would clip each rank by its local norm), and a transformation of
your own that needs a global quantity calls `global_sum` on this rank's partial sum.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import optax

_LOCAL = threading.local()  # per thread: ranks run as threads in tests, each traces its own step


def _reducers() -> list:
    if not hasattr(_LOCAL, "stack"):
        _LOCAL.stack = []
    return _LOCAL.stack


@contextlib.contextmanager
def global_reduction(fn: Callable[[jax.Array], jax.Array]):
    """Binds `global_sum` to `fn` while tracing inside this context.

    Args:
      fn: a traceable all-sum of a scalar over the ranks.
    """
    _reducers().append(fn)
    try:
        yield
    finally:
        _reducers().pop()


def global_sum(x: jax.Array) -> jax.Array:
    """Sum of scalar `x` over all ranks (the identity outside a trainer's optimizer step). The
    number of calls in one update must not depend on values."""
    st = _reducers()
    return st[-1](x) if st else x


def global_norm(tree) -> jax.Array:
    """L2 norm of a tree of local shards over all ranks (padding elements are zero).

    Args:
      tree: this rank's shards (any pytree of arrays).

    Returns:
      A float32 scalar, the same on every rank.
    """
    sq = sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree_util.tree_leaves(tree))
    return jnp.sqrt(global_sum(sq))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm` with the norm taken over all ranks' shards (same arithmetic).

    Args:
      max_norm: updates whose global norm exceeds it are scaled down to it.

    Returns:
      An `optax.GradientTransformation` (stateless).

    Example:
      >>> opt = optax.chain(clip_by_global_norm(1.0), optax.adam(3e-4))
    """

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates, state, params=None):
        del params
        g = global_norm(updates)
        trigger = jnp.squeeze(g < max_norm)
        return jax.tree_util.tree_map(
            lambda t: jax.lax.select(trigger, t, (t / g.astype(t.dtype)) * max_norm), updates), state

    return optax.GradientTransformation(init, update)
