"""The optimizer step one unit at a time, when the transformation allows it exactly.

One jitted `optimizer.update` over all local shards holds every unit's updates (and XLA's
temporaries for all of them) at once: P/W of fp32 beside the masters, accumulators and optimizer
state, which is what put ODC's optimizer phase above its memory bound. Here the same update is
traced once, the dependencies of its outputs on its inputs are read off the jaxpr, and when every
unit's outputs (its updates and its part of the state) depend only on

  its own shard, its own state, the state shared by all units (Adam's count), any gradient,

the step runs as one jitted call per unit: the whole update traced, all but that unit's outputs
dropped by XLA's dead-code elimination, the unit's state donated. Global reductions (our
`clip_by_global_norm`) still see every gradient -- the gradients are read, never written, during
the step -- so clipping stays exact, at the price of one scalar all-sum per unit instead of one per
step. Each call computes that unit's outputs with the ops of the whole-tree step; the shared state
(counts) is taken from the first call, i.e. advanced once per step.

Each unit's call traces the whole update, so compiling a step costs about units² of the
whole-tree step's tracing (fine for tens of units).

Transformations whose outputs mix units otherwise (`optax.flatten`, anything reading another
unit's parameters or state) are not separable: `UnitwiseOptimizer.separable` is False with the
reason, and the caller keeps the whole-tree step.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import optax
from jax.extend.core import Literal

from jaxodc.train.core import optimizer_updates

_CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")  # eqn params holding a called jaxpr (jit, custom_jvp/vjp, remat)


def _inner(eqn):
    """The jaxpr an eqn calls with its own operands, or None (then it is treated as one op)."""
    for key in _CALLS:
        sub = eqn.params.get(key)
        sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
        if sub is not None and hasattr(sub, "eqns") and len(sub.invars) == len(eqn.invars) \
                and len(sub.outvars) == len(eqn.outvars):
            return sub
    return None


def output_deps(jaxpr, in_deps: Sequence[frozenset]) -> list[frozenset]:
    """For each output of `jaxpr`, the union of `in_deps` of the inputs it is computed from.
    Called jaxprs are followed; any other op's outputs depend on all its operands (conservative)."""
    env = dict(zip(jaxpr.invars, in_deps))
    read = lambda a: frozenset() if isinstance(a, Literal) else env.get(a, frozenset())  # noqa: E731
    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        sub = _inner(eqn)
        outs = output_deps(sub, ins) if sub is not None else [frozenset().union(*ins)] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs))
    return [read(a) for a in jaxpr.outvars]


def _unit_of(path, names: frozenset) -> str | None:
    """The unit a state leaf belongs to: a dict key on its path that names a unit (optax states
    mirror the parameters' structure: mu[unit], nu[unit]); None for shared leaves (counts)."""
    for k in path:
        if isinstance(k, jax.tree_util.DictKey) and k.key in names:
            return k.key
    return None


class UnitwiseOptimizer:
    """`optimizer_updates` split per unit (see the module docstring).

    Args:
      optimizer: any Optax transformation.
      shards: the local shards {unit: array} (arrays or ShapeDtypeStruct).
      opt_state: its state for them.
      reduce_for: version -> the scalar all-sum `global_sum` is bound to (the trainer's reduce_fn).
      axis_env: [(axis name, size)] the all-sum's collectives need to be traced (a psum meant for
        a shard_map; the collective trainer).
      compile: (step, mine, shared, first) -> the callable running `step` (default: jax.jit
        donating its first argument, the unit's state leaves); `mine` / `shared`: the indices of
        the unit's and the shared state leaves; `first`: whether the call returns the shared ones.
    """

    def __init__(self, optimizer: optax.GradientTransformation, shards: dict, opt_state,
                 reduce_for: Callable[[Any], Callable], *, axis_env=None, compile: Callable | None = None):
        self.names = tuple(shards)
        names = frozenset(self.names)
        spec = lambda t: jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)  # noqa: E731
        paths, self._state_def = jax.tree_util.tree_flatten_with_path(spec(opt_state))
        self._state_unit = [_unit_of(p, names) for p, _ in paths]

        def update(shards, state_leaves, grads, v):
            state = jax.tree_util.tree_unflatten(self._state_def, state_leaves)
            upd, new = optimizer_updates(optimizer, shards, state, grads, reduce_for(v))
            return upd, jax.tree_util.tree_leaves(new)

        self._update = update
        # Inputs tagged by what they are; outputs' dependencies checked against the rule.
        args = (spec(shards), [x for _, x in paths], spec(shards), jax.ShapeDtypeStruct((), "int32"))
        self._compile = compile or (lambda step, mine, shared, first: jax.jit(step, donate_argnums=(0,)))
        closed, out_shape = jax.make_jaxpr(update, axis_env=axis_env, return_shape=True)(*args)
        flat_names = [_unit_of(p, names) for p, _ in jax.tree_util.tree_flatten_with_path(args[0])[0]]
        tags = ([("shard", n) for n in flat_names] + [("state", u) for u in self._state_unit]
                + [("grad", n) for n in flat_names] + [("version", None)])
        deps = output_deps(closed.jaxpr, [frozenset([t]) for t in tags])
        upd_paths = [_unit_of(p, names) for p, _ in jax.tree_util.tree_flatten_with_path(out_shape[0])[0]]
        n_upd = len(upd_paths)
        self.reason = None
        if len(upd_paths) != len(self.names) or set(upd_paths) != set(self.names) or len(out_shape[1]) != len(paths):
            self.reason = "the updates are not one array per unit, or the state changed structure"
        for i, d in enumerate(deps if self.reason is None else ()):
            unit = upd_paths[i] if i < n_upd else self._state_unit[i - n_upd]
            if unit is None:
                continue  # shared state: computed in the first call, from untouched inputs
            bad = sorted(f"{k} {u}" for k, u in d if (k in ("shard", "state") and u not in (unit, None)))
            if bad and self.reason is None:
                what = f"unit {unit!r}'s " + ("updates" if i < n_upd else "state")
                self.reason = f"{what} depend on other units' parameters or state ({', '.join(bad[:4])})"
        self.separable = self.reason is None
        self._steps = {}

    def _step(self, unit: str, first: bool):
        key = (unit, first)
        if key not in self._steps:
            mine = [i for i, u in enumerate(self._state_unit) if u == unit]
            shared = [i for i, u in enumerate(self._state_unit) if u is None]

            def step(own, others, shards, grads, v):
                leaves = list(others)
                for i, x in zip(mine, own):
                    leaves[i] = x
                upd, new = self._update(shards, leaves, grads, v)
                return upd[unit], [new[i] for i in mine], ([new[i] for i in shared] if first else [])

            self._steps[key] = (self._compile(step, mine, shared, first), mine, shared)
        return self._steps[key]

    def calls(self, shards: dict, opt_state, grads: dict, version):
        """(unit, jitted call, its arguments) of one step, for compiled-memory reports."""
        leaves = jax.tree_util.tree_leaves(opt_state)
        for j, unit in enumerate(self.names):
            fn, mine, _ = self._step(unit, j == 0)
            yield unit, fn, ([leaves[i] for i in mine], [None if i in mine else x for i, x in enumerate(leaves)],
                             shards, grads, version)

    def step(self, shards: dict, opt_state, grads: dict, version, apply: Callable[[str, jax.Array], None]):
        """Runs the update unit by unit, handing each unit's updates to `apply(unit, updates)`
        before the next unit's call (so one unit's updates are alive at a time). `apply` may
        write the unit's shard in place: no later call reads it. Returns the new state; the old
        state's per-unit leaves are donated."""
        if not self.separable:
            raise ValueError(f"the optimizer cannot run per unit: {self.reason}")
        leaves = jax.tree_util.tree_leaves(opt_state)
        new_shared = None
        for j, unit in enumerate(self.names):
            fn, mine, shared = self._step(unit, j == 0)
            # `others` holds the current leaves; this unit's are donated, and none of the
            # others it reads (shared) have changed yet.
            others = [None if i in mine else x for i, x in enumerate(leaves)]
            upd, own, sh = fn([leaves[i] for i in mine], others, shards, grads, version)
            for i in mine:
                leaves[i] = None
            for i, x in zip(mine, own):
                leaves[i] = x
            if j == 0:
                new_shared = list(zip(shared, sh))
            apply(unit, upd)
            del upd
        for i, x in new_shared or []:
            leaves[i] = x
        return jax.tree_util.tree_unflatten(self._state_def, leaves)
