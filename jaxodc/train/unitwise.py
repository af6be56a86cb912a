"""The optimizer step one unit at a time, when the transformation allows it exactly.

One jitted `optimizer.update` over all local shards holds every unit's updates (and XLA's
temporaries for all of them) at once: P/W of fp32 beside the masters, accumulators and optimizer
state, which is what put ODC's optimizer phase above its memory bound. Here the same update is
traced once, the dependencies of its outputs on its inputs are read off the jaxpr, and when every
unit's outputs (its updates and its part of the state) depend only on

  its own shard, its own state, the state shared by all units (Adam's count), any gradient,
  the state of a leaf lying in it and in other units too (written by the last of them),

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
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import Literal

from jaxodc.optim.clipping import global_reduction
from jaxodc.optim.placement import called_jaxpr
from jaxodc.train.core import optimizer_updates

def output_deps(jaxpr, in_deps: Sequence[frozenset]) -> list[frozenset]:
    """For each output of `jaxpr`, the union of `in_deps` of the inputs it is computed from.
    Called jaxprs are followed; any other op's outputs depend on all its operands (conservative)."""
    env = dict(zip(jaxpr.invars, in_deps))
    read = lambda a: frozenset() if isinstance(a, Literal) else env.get(a, frozenset())  # noqa: E731
    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        sub = called_jaxpr(eqn)
        outs = output_deps(sub[0], ins) if sub is not None else [frozenset().union(*ins)] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs))
    return [read(a) for a in jaxpr.outvars]


def memory_schedule() -> dict | None:
    """Compiler options for the optimizer's programs: on XLA:CPU, the memory-minimising scheduler.
    A placed optimizer (optim.placement) reduces each parameter's piece, a slice of its unit's
    shard; XLA:CPU materialises a slice that feeds a reduction, and its default scheduler makes
    every such slice before the first reduction (at 2 ranks, the whole gradient again, 54 MiB on
    bench train --memory's model); the memory-minimising one keeps one alive at a time."""
    if jax.default_backend() != "cpu":
        return None
    return {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def state_writers(spans: Sequence[tuple[str, ...]], names: Sequence[str]) -> list[str | None]:
    """The unit whose part of the update writes each state leaf: the last of those it lies in. A
    leaf spanning several (beside a scan-stacked parameter) is read by each of them and written,
    in place (donated), by the last, so never read after it changed; before, the first wrote a
    new copy beside the old one that later units still read (bench models' llama under the
    collective: the stacked leaves' state twice). None: shared leaves (counts), written by the
    first unit's part from untouched inputs."""
    return [max(s, key=list(names).index) if s else None for s in spans]


def _state_spans(optimizer, paths, names: Sequence[str]) -> list[tuple[str, ...]]:
    """The units each state leaf's piece lies in: as a placed optimizer (optim.placement) says,
    else by path; () for shared leaves (counts), several beside a scan-stacked parameter."""
    spans = getattr(optimizer, "state_spans", None)
    if spans is None:
        spans = [(u,) if (u := _unit_of(p, frozenset(names))) is not None else () for p, _ in paths]
    return [tuple(s) for s in spans]


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
      cuts: {unit: [(offset, size)]} tiling its shard: the unit's updates are returned as those
        slices, each its own output buffer, and `apply` gets the tuple. A unit whose parameters'
        updates are made apart (Muon's matrices, one after another) then writes each into its
        output where it is made; returned whole, each is a temporary until the last is made and
        all are joined (bench optim-memory: the collective's one-unit Muon).
    """

    def __init__(self, optimizer: optax.GradientTransformation, shards: dict, opt_state,
                 reduce_for: Callable[[Any], Callable], *, axis_env=None, compile: Callable | None = None,
                 cuts: dict[str, Sequence[tuple[int, int]]] | None = None):
        self.names = tuple(shards)
        self._cuts = cuts or {}
        names = frozenset(self.names)
        spec = lambda t: jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)  # noqa: E731
        paths, self._state_def = jax.tree_util.tree_flatten_with_path(spec(opt_state))
        self._state_span = _state_spans(optimizer, paths, self.names)
        self._state_unit = state_writers(self._state_span, self.names)

        def update(shards, state_leaves, grads, v):
            state = jax.tree_util.tree_unflatten(self._state_def, state_leaves)
            upd, new = optimizer_updates(optimizer, shards, state, grads, reduce_for(v))
            return upd, jax.tree_util.tree_leaves(new)

        self._update = update
        # Inputs tagged by what they are; outputs' dependencies checked against the rule.
        args = (spec(shards), [x for _, x in paths], spec(shards), jax.ShapeDtypeStruct((), "int32"))
        self._compile = compile or (lambda step, mine, shared, first: jax.jit(
            step, donate_argnums=(0,), compiler_options=memory_schedule()))
        closed, out_shape = jax.make_jaxpr(update, axis_env=axis_env, return_shape=True)(*args)
        flat_names = [_unit_of(p, names) for p, _ in jax.tree_util.tree_flatten_with_path(args[0])[0]]
        tags = ([("shard", n) for n in flat_names] + [("state", i) for i in range(len(paths))]
                + [("grad", n) for n in flat_names] + [("version", None)])
        deps = output_deps(closed.jaxpr, [frozenset([t]) for t in tags])
        upd_paths = [_unit_of(p, names) for p, _ in jax.tree_util.tree_flatten_with_path(out_shape[0])[0]]
        self.reason = None
        if len(upd_paths) != len(self.names) or set(upd_paths) != set(self.names) or len(out_shape[1]) != len(paths):
            self.reason = "the updates are not one array per unit, or the state changed structure"
        else:
            self.reason = _separability(deps, upd_paths, self._state_unit, self._state_span)
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
                out = upd[unit]
                if unit in self._cuts:
                    out = tuple(jax.lax.slice_in_dim(out, o, o + n) for o, n in self._cuts[unit])
                return out, [new[i] for i in mine], ([new[i] for i in shared] if first else [])

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


def _separability(deps, upd_units: Sequence[str], state_units: Sequence[str | None],
                  state_spans: Sequence[tuple[str, ...]]) -> str | None:
    """Why the outputs (the updates, one per unit, then the state leaves; `state_units`: the unit
    writing each, None for shared) cannot run per unit, or None: each unit's outputs may depend on
    its own shard, the state leaves it lies in (its own; those spanning it, unchanged until their
    writer, the last of them, runs), shared state and anything global (gradients, fed values),
    never another unit's shard or state."""
    n_upd = len(upd_units)
    for i, d in enumerate(deps):
        unit = upd_units[i] if i < n_upd else state_units[i - n_upd]
        if unit is None:
            continue  # shared state: computed in the first unit's part, from untouched inputs
        bad = sorted({f"shard {x}" for k, x in d if k == "shard" and x != unit}
                     | {f"state of {'+'.join(state_spans[x])}" for k, x in d if k == "state"
                        and state_units[x] is not None and unit not in state_spans[x]})
        if bad:
            what = f"unit {unit!r}'s " + ("updates" if i < n_upd else "state")
            return f"{what} depend on other units' parameters or state ({', '.join(bad[:4])})"
    return None


# Elements one exchange of the end of a minibatch carries before the next site goes to a round of
# its own: a whole leaf gathered for an operation on it (Muon's Newton-Schulz) travels alone, so
# the program holds one gathered leaf at a time, not every one (norms and row statistics share).
ROUND_ELEMENTS = 1 << 16


def exchange_rounds(depth: Sequence[int], sizes: Sequence[int], cap: int = ROUND_ELEMENTS) -> list[int]:
    """Each site's exchange (its level): sites in order of `depth` (a site reads only shallower
    ones), those of one depth packed in order into exchanges of at most `cap` elements (a larger
    site alone)."""
    rounds, r = [0] * len(depth), -1
    for lv in sorted(set(depth)):
        r, used = r + 1, 0
        for i in (i for i, d in enumerate(depth) if d == lv):
            if used and used + sizes[i] > cap:
                r, used = r + 1, 0
            rounds[i], used = r, used + sizes[i]
    return rounds


class EndStep:
    """The optimizer's end of a minibatch as two kinds of compiled programs over this rank's
    shards, with every global reduction the optimizer makes exchanged between them.

    Where the reductions are: every cross-rank reduction an optimizer makes goes through
    `jaxodc.optim.clipping.global_sum` (the documented hook; `clip_by_global_norm` and any custom
    transform that needs a global quantity call it). A call's argument is this rank's partial sum
    and its result the sum over ranks. The hook, not a search of the jaxpr for reduction
    primitives, is what marks a site: a `jnp.sum` over a local shard is an ordinary local
    reduction (it may be meant per rank), and only the optimizer knows which sums are global. The
    jaxpr does decide the rest: the sites are the hook's calls while the update is traced (in
    order), and `output_deps` finds which sites' partial sums depend on other sites' results
    (depth 0: computable from the gradients, shards and state alone). `levels`: each site's
    exchange, in depth order, sites of one depth packed together up to `ROUND_ELEMENTS` (so a
    whole leaf gathered for an operation on it travels, and is alive, alone).

    The programs:
      `partials(k, ...)`: the partial sums of the sites of level k, one float32 vector (the
        update traced with the hook recording its arguments; the rest is dead code). The caller
        sums every rank's vectors (one exchange per level: one in all for independent small
        sites, e.g. clipping's norm, one per gathered leaf, none for elementwise optimizers).
      `apply(...)`: the whole update with the hook returning the fed sums, as one program. With a
        `store` (ODC's in-place masters, `jaxodc.ops.odc_store_master`) each unit's new shard is
        written where it lives from inside the program, unit after unit: when the update is
        separable (see `_separability`; adam, adamw, sgd, clipping with its norm fed in) every
        unit's part of the update is ordered after the previous unit's store, so one unit's new
        shard and temporaries are alive at a time, as `UnitwiseOptimizer`'s calls were, but in one
        program with no host callback. Without a store it returns the new shards (donated).

    Args:
      optimizer: any Optax transformation.
      shards: the local shards {unit: array or ShapeDtypeStruct}.
      opt_state: its state for them.
      store: (unit name, new fp32 shard, token) -> token, or None.
      token: () -> the first token (store's).
      agree: every rank's value of a msgpack-able list (the trainer's all-gather), so the levels
        are the same on every rank; None: this rank's alone (one rank, or tests).
    """

    def __init__(self, optimizer: optax.GradientTransformation, shards: dict, opt_state, *,
                 store: Callable | None = None, token: Callable | None = None,
                 agree: Callable[[list], list] | None = None):
        self.optimizer, self.names = optimizer, tuple(shards)
        names = frozenset(self.names)
        spec = lambda t: jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)  # noqa: E731
        paths, self._state_def = jax.tree_util.tree_flatten_with_path(spec(opt_state))
        self._state_span = _state_spans(optimizer, paths, self.names)
        self._state_unit = state_writers(self._state_span, self.names)
        self._store, self._token = store, token
        sh, leaves = spec(shards), [x for _, x in paths]
        # The sites: the hook's calls while the update is traced.
        found = []
        with global_reduction(lambda x: (found.append(jax.ShapeDtypeStruct(jnp.shape(x), x.dtype)), x)[1]):
            jax.eval_shape(lambda s, st, g: self.optimizer.update(g, st, s), sh,
                           jax.tree_util.tree_unflatten(self._state_def, leaves), sh)
        self.sites = found
        self._sizes = [int(np.prod(s.shape)) for s in found]
        red = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in found]
        closed, out_shape = jax.make_jaxpr(self._update, return_shape=True)(sh, leaves, sh, red)
        flat_names = [_unit_of(p, names) for p, _ in jax.tree_util.tree_flatten_with_path(sh)[0]]
        tags = ([("shard", n) for n in flat_names] + [("state", i) for i in range(len(paths))]
                + [("grad", n) for n in flat_names] + [("reduced", i) for i in range(len(red))])
        deps = output_deps(closed.jaxpr, [frozenset([t]) for t in tags])
        n_upd, n_state = len(jax.tree_util.tree_leaves(out_shape[0])), len(out_shape[1])
        # Which earlier sites each site reads. A rank that holds nothing of a parameter computes its
        # partials there from no input at all, so ranks can see fewer edges: `agree` gives every
        # rank's lists, and the levels come from all their edges, the same on every rank.
        self.site_deps = [sorted(i for k, i in d if k == "reduced") for d in deps[n_upd + n_state:]]
        every = [self.site_deps] if agree is None or not self.site_deps else agree(self.site_deps)
        if any(len(d) != len(self.site_deps) for d in every):
            raise ValueError(f"ranks traced different numbers of global reductions in the optimizer: "
                             f"{[len(d) for d in every]} (by rank)")
        depth = []
        for s in range(len(self.site_deps)):  # one more than the deepest site it reads
            depth.append(max((depth[i] + 1 for d in every for i in d[s]), default=0))
        self.levels = exchange_rounds(depth, self._sizes)
        self.rounds = max(self.levels) + 1 if self.levels else 0
        upd_units = [_unit_of(p, names) for p, _ in jax.tree_util.tree_flatten_with_path(out_shape[0])[0]]
        if len(upd_units) != len(self.names) or set(upd_units) != names or n_state != len(paths):
            self.reason = "the updates are not one array per unit, or the state changed structure"
        else:
            self.reason = _separability(deps[:n_upd + n_state], upd_units, self._state_unit, self._state_span)
        self.separable = self.reason is None
        self._partials = {}
        self._apply = jax.jit(self._apply_fn, donate_argnums=(1,) if store is not None else (0, 1),
                              compiler_options=memory_schedule())

    def _update(self, shards, state_leaves, grads, reduced):
        """(updates, new state leaves, the sites' arguments): the hook's i-th call returns
        reduced[i] (the sum over ranks, fed in) and records its argument (this rank's part)."""
        calls = []

        def site(x):
            i = len(calls)
            if i >= len(reduced):
                raise ValueError(f"the optimizer made more global reductions ({i + 1}) than when it was first "
                                 f"traced ({len(reduced)}): its global_sum calls must not depend on values")
            calls.append(x)
            return jnp.reshape(reduced[i], jnp.shape(x)).astype(x.dtype)

        state = jax.tree_util.tree_unflatten(self._state_def, state_leaves)
        with global_reduction(site):
            upd, new = self.optimizer.update(grads, state, shards)
        return upd, jax.tree_util.tree_leaves(new), calls

    def fill(self, known: Sequence) -> list:
        """The fed values: `known[i]` (the sum of site i over ranks) where known, zeros elsewhere
        (sites of later levels, which nothing of an earlier level reads)."""
        return [np.zeros(s.shape, s.dtype) if k is None else np.asarray(k, s.dtype).reshape(s.shape)
                for s, k in zip(self.sites, known)]

    def partials(self, level: int, shards: dict, state_leaves, grads: dict, reduced: Sequence) -> jax.Array:
        """This rank's partial sums of the sites of `level`, concatenated (float32)."""
        return self._partials_program(level)(shards, list(state_leaves), grads, list(reduced))

    def _partials_program(self, level: int):
        if level not in self._partials:
            def part(shards, leaves, grads, reduced):
                return self._level_part(level, self._update(shards, leaves, grads, reduced)[2])
            self._partials[level] = jax.jit(part, compiler_options=memory_schedule())
        return self._partials[level]

    def _level_part(self, level: int, calls: Sequence) -> jax.Array:
        """The sites of `level`: their arguments (this rank's parts) as one float32 vector."""
        return jnp.concatenate([jnp.ravel(calls[i]).astype(jnp.float32)
                                for i, lv in enumerate(self.levels) if lv == level])

    def split(self, level: int, total, known: list) -> None:
        """Writes the summed vector of `level` into `known` (site by site)."""
        at = 0
        for i, lv in enumerate(self.levels):
            if lv == level:
                known[i] = total[at:at + self._sizes[i]]
                at += self._sizes[i]

    def exchanged(self, exchange: Callable, keep: Callable | None = None):
        """The whole end of a minibatch as one program, the exchange an op inside it (ODC's
        `odc_allgather`): each level's partial sums, their exchange, the update and (with a store)
        the stores. No host round trip between them, and one dispatch. For an optimizer with
        global reductions (rounds >= 1); without, there is nothing to exchange before the update.

        Args:
          exchange: (head, part, *extra) -> (head rows, part summed over ranks), traced into the
            program; `head` goes with the first level's exchange (and an empty one with later
            levels').
          keep: head rows -> whether to apply the update (a traced bool); where not, the shards
            and the state stay as they were (a disagreement the caller then reports), and the
            exchanges after the first are not made (the rows are alike on every rank, and so is
            the decision).

        Returns:
          The jitted (shards, state leaves, grads, head, *extra) -> (apply's result, head rows),
          the state leaves donated as by `apply`.
        """
        def fn(shards, state_leaves, grads, head, *extra):
            def rounds(ks: range, reduced: list):
                """The exchanges of levels `ks`: (reduced with their sums, the head rows of level 0)."""
                rows = None
                for k in ks:
                    part = self._level_part(k, self._update(shards, state_leaves, grads, reduced)[2])
                    got, total = exchange(head if k == 0 else head[:0], part, *extra)
                    rows = got if k == 0 else rows
                    reduced = list(reduced)
                    self.split(k, total, reduced)
                    reduced = [jnp.reshape(r, s.shape).astype(s.dtype) for r, s in zip(reduced, self.sites)]
                return reduced, rows

            reduced = [jnp.asarray(r) for r in self.fill([None] * len(self.sites))]
            if keep is None:
                reduced, rows = rounds(range(self.rounds), reduced)
                return self._apply_fn(shards, state_leaves, grads, reduced), rows
            # The first exchange carries the head rows, which every rank then decides on alike;
            # the later ones run with the update under a cond, so that a leaf gathered in one of
            # them is used and freed before the next (outside, every exchange's result would be
            # an operand of the cond, all alive at once). A cond rather than a select of new or
            # old values: a select reads the old state after the update wrote it in place, so
            # XLA copies every donated state leaf first (bench models' nnx_mlp: 3.9 MB, not 0.6).
            reduced, rows = rounds(range(1), reduced)

            def go(first):
                return self._apply_fn(shards, state_leaves, grads, rounds(range(1, self.rounds), first)[0])

            def skip(_):
                return (dict(shards), list(state_leaves)) if self._store is None else (list(state_leaves), self._token())
            return jax.lax.cond(keep(rows), go, skip, reduced), rows

        return jax.jit(fn, donate_argnums=(1,) if self._store is not None else (0, 1), compiler_options=memory_schedule())

    @property
    def partial_size(self) -> list[int]:
        """Elements of each level's vector."""
        return [sum(n for n, lv in zip(self._sizes, self.levels) if lv == k) for k in range(self.rounds)]

    def state_tree(self, leaves) -> Any:
        """The optimizer state from its leaves."""
        return jax.tree_util.tree_unflatten(self._state_def, leaves)

    def _apply_fn(self, shards, state_leaves, grads, reduced):
        if self._store is None:
            upd, new, _ = self._update(shards, state_leaves, grads, reduced)
            return optax.apply_updates(shards, upd), list(new)
        token = self._token()
        if not self.separable:  # whole-tree updates, then the stores in order
            upd, new, _ = self._update(shards, state_leaves, grads, reduced)
            for name in self.names:
                token = self._store(name, optax.apply_updates(shards[name], upd[name]), token)
            return list(new), token
        out = [None] * len(state_leaves)
        for j, name in enumerate(self.names):
            # The whole update traced once per unit, all but this unit's outputs dead code. Its
            # own inputs (state, shard, gradient) pass a barrier with the previous store's token,
            # so nothing of this unit is computed before that store; only they do, so the donated
            # state of stored units is never read again and is updated in place.
            mine = [i for i, u in enumerate(self._state_unit) if u == name]
            leaves, sh, g = list(state_leaves), dict(shards), dict(grads)
            if j:
                own, sh[name], g[name], token = jax.lax.optimization_barrier(
                    ([state_leaves[i] for i in mine], shards[name], grads[name], token))
                for i, x in zip(mine, own):
                    leaves[i] = x
            upd, new, _ = self._update(sh, leaves, g, reduced)
            for i, u in enumerate(self._state_unit):
                if u == name or (u is None and j == 0):  # shared state (counts): the first unit's
                    out[i] = new[i]
            token = self._store(name, optax.apply_updates(sh[name], upd[name]), token)
        return out, token

    def apply(self, shards: dict, state_leaves, grads: dict, reduced: Sequence):
        """With a store: (new state leaves, the last store's token; the shards written in place);
        without: (new shards, new state leaves). The state leaves are donated (and the shards,
        without a store)."""
        return self._apply(shards, list(state_leaves), grads, list(reduced))

    def programs(self, shards: dict, state_leaves, grads: dict):
        """(name, jitted program, its arguments) of one end of a minibatch, for compiled-memory
        reports (nothing runs)."""
        reduced = self.fill([None] * len(self.sites))
        for k in range(self.rounds):
            yield f"partials{k}", self._partials_program(k), (shards, list(state_leaves), grads, reduced)
        yield "apply", self._apply, (shards, list(state_leaves), grads, reduced)
