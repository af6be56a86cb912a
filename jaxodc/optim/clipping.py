"""Global reductions of an optimizer that runs on local parameter shards.

The trainers run a user's Optax chain traced on the whole tree and placed on each rank's shards
(optim.placement): every reduction over a parameter or the tree becomes a local partial plus
`global_sum`, the hook that marks a reduction over ranks. While a trainer traces its optimizer step
it binds it (collective: `lax.psum` inside the step; ODC: `train.unitwise.EndStep` finds every call
while tracing, computes the arguments of all of them in one program and sums them in the
minibatch's one exchange, then feeds the sums to the optimizer's program); outside a trainer it is
the identity. Users write plain Optax (`optax.clip_by_global_norm`; `clip_by_global_norm` here is
the same transformation under its old name).
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


# The trainers place the optimizer on shards (optim.placement), so Optax's own clipping means on
# shards what it means on the whole tree; this name is kept for code written before that.
clip_by_global_norm = optax.clip_by_global_norm
