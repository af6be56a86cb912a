"""Gather-on-use for a plain `loss_fn(params, batch)`: a loss over parameter *shards* in which each
unit is gathered where the loss first uses it and rematerialised in the backward pass.

Mechanism (docs/any_model.md says why): trace `loss_fn` once per batch signature to a jaxpr, flatten
it into a list of ops (inlining `jit` and `checkpoint` calls, unrolling every `lax.scan` that iterates
over a parameter stacked by layers into per-layer ops that read that layer's unit), cut the list
into stages at each first use of a unit, and evaluate each stage inside staging.remat_stage:
`gather(shard) -> unflatten -> the stage's ops`. Ops are re-bound primitives (as in
jax.core.eval_jaxpr), so the result is ordinary traceable JAX: jit, grad, shard_map all apply, and
the gather's VJP (collective psum_scatter, ODC push) delivers each stage's parameter cotangent. A
unit read again later (tied embedding, a block used twice) is gathered again where it is read; its
two cotangents add up at the owners.

Supported inside the loss: any primitive, `lax.cond` / `while` / `custom_vjp` / `custom_jvp` (a unit
they read is gathered around the whole construct), scans over stacked layers whose parameter reaches
the scan through transposes and dtype casts (flax nn.scan with `variable_axes={"params": 0 or 1}`).
A stacked parameter used any other way is refused with its path.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jaxodc.modeling.staging import GatherFn, remat_stage
from jaxodc.modeling.discover import ParamPlan, _trainable, discover_units
from jaxodc.modeling.units import gathered_params

# Call-like primitives whose body is spliced into the op list: a scan over stacked layers, or a
# parameter use, may sit inside them. Our stages remat anyway, so an inner checkpoint adds nothing.
_INLINE = {"jit", "pjit", "closed_call", "core_call", "remat2", "checkpoint"}
_VIEWS = {"transpose", "convert_element_type", "copy", "copy_p"}


class Lit:
    """A literal operand (jaxpr Literal or a closed-over constant)."""

    def __init__(self, val):
        self.val = val


@dataclass
class _Op:
    fn: Callable
    ins: list
    outs: list
    units: frozenset = frozenset()
    name: str = ""
    effects: bool = False


@dataclass(frozen=True)
class _Param:
    """Key of one leaf of one unit, gathered inside a stage."""
    unit: str
    index: int


@dataclass(frozen=True)
class _StackView:
    """A stacked parameter leaf after a chain of view ops. `perm[d]`: the original dim at view dim d."""
    leaf: int
    perm: tuple[int, ...]
    dtype: Any


@dataclass
class _Stage:
    units: list
    ops: list = field(default_factory=list)
    ins: list = field(default_factory=list)
    outs: list = field(default_factory=list)


def _binder(eqn) -> Callable:
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    subfuns = []
    if isinstance(bind_params, tuple):  # jax < 0.9.2 returned (subfuns, params)
        subfuns, bind_params = bind_params
    prim, ctx = eqn.primitive, eqn.ctx

    def fn(*args):
        with ctx.manager:
            out = prim.bind(*subfuns, *args, **bind_params)
        return list(out) if prim.multiple_results else [out]
    return fn


def _scan_split(eqn):
    """(num_consts, num_carry) of a scan eqn, across jax's parameter spellings."""
    p = eqn.params
    if "num_consts" in p:
        return p["num_consts"], p["num_carry"]
    consts, carry, _ = p["ft_in"].update(list(eqn.invars)).unpack()
    return len(list(consts)), len(list(carry))


class _Flattener:
    """jaxpr -> flat op list. `stack_axis[leaf]` is each stacked leaf's axis; in detection mode
    (`detect` a dict) every trainable leaf is a candidate and uses are recorded instead."""

    def __init__(self, plan: ParamPlan | None, leaf_paths, detect: dict | None = None):
        self.plan, self.paths, self.detect = plan, leaf_paths, detect
        self.ops: list[_Op] = []
        self.consts: dict = {}
        self._ids = itertools.count()

    def key(self):
        return ("v", next(self._ids))

    def read_views(self, ins, eqn_name):
        """Stacked views read whole by a non-scan op: an error (or a record, when detecting)."""
        for x in ins:
            if isinstance(x, _StackView):
                if self.detect is not None:
                    self.detect.setdefault(x.leaf, []).append(None)
                    continue
                place = self.plan.places[x.leaf]
                raise NotImplementedError(
                    f"parameter {place.path!r} is stacked over layers (axis {place.axis}, units "
                    f"{place.units[0]!r}...) but `{eqn_name}` uses it whole; jaxodc slices a stacked parameter "
                    f"only where a lax.scan / nn.scan iterates over it. Scan over it, or declare it unstacked "
                    f"(stacked={{{place.path!r}: None}}).")

    def emit(self, jaxpr, consts, in_keys) -> list:
        env = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = Lit(c)
        for v, k in zip(jaxpr.invars, in_keys):
            env[v] = k
        read = lambda v: Lit(v.val) if isinstance(v, jcore.Literal) else env[v]
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            views = [x for x in ins if isinstance(x, _StackView)]
            if name in _INLINE:
                sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                sub_jaxpr, sub_consts = (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (sub, ())
                outs = self.emit(sub_jaxpr, sub_consts, ins)
            elif views and name in _VIEWS and len(ins) == 1:
                (x,) = views
                if name == "transpose":
                    q = eqn.params["permutation"]
                    x = _StackView(x.leaf, tuple(x.perm[d] for d in q), x.dtype)
                elif name == "convert_element_type":
                    x = _StackView(x.leaf, x.perm, eqn.params["new_dtype"])
                outs = [x]
            elif views and name == "scan":
                outs = self.scan(eqn, ins)
            else:
                self.read_views(ins, name)
                outs = [self.key() for _ in eqn.outvars]
                units = frozenset(x.unit for x in ins if isinstance(x, _Param))
                self.ops.append(_Op(_binder(eqn), ins, outs, units, name, bool(eqn.effects)))
            for v, k in zip(eqn.outvars, outs):
                env[v] = k
        return [read(v) for v in jaxpr.outvars]

    def scan(self, eqn, ins):
        n_consts, n_carry = _scan_split(eqn)
        length, body = eqn.params["length"], eqn.params["jaxpr"]
        consts, carry, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
        self.read_views(consts + carry, "scan (as a constant or carry)")
        if self.detect is not None:  # record each scanned leaf's stack axis; emit the scan whole
            for x in xs:
                if isinstance(x, _StackView):
                    self.detect.setdefault(x.leaf, []).append((x.perm[0], length))
            outs = [self.key() for _ in eqn.outvars]
            self.ops.append(_Op(_binder(eqn), [x for x in ins], outs, frozenset(), "scan"))
            return outs
        ys_per_layer = {}
        for l in (range(length - 1, -1, -1) if eqn.params["reverse"] else range(length)):
            xs_l = [self.layer_slice(x, l) for x in xs]
            outs = self.emit(body.jaxpr, body.consts, consts + carry + xs_l)
            carry, ys_per_layer[l] = outs[:n_carry], outs[n_carry:]
        ys = []
        for j in range(len(eqn.outvars) - n_carry):
            k = self.key()
            self.ops.append(_Op(lambda *y: [jnp.stack(y)], [ys_per_layer[l][j] for l in range(length)], [k],
                                frozenset(), "stack"))
            ys.append(k)
        return carry + ys

    def layer_slice(self, x, l):
        k = self.key()
        if isinstance(x, _StackView):
            place = self.plan.places[x.leaf]
            a = place.axis
            if x.perm[0] != a:
                raise NotImplementedError(f"parameter {place.path!r}: a scan iterates over its axis {x.perm[0]}, "
                                          f"but the plan stacks it on axis {a}; pass stacked={{{place.path!r}: "
                                          f"{x.perm[0]}}} (or let scanned_axes find it)")
            perm = tuple(d - (d > a) for d in x.perm[1:])
            src = _Param(place.units[l], place.index)

            def view(p, perm=perm, dtype=x.dtype):
                p = p if perm == tuple(range(len(perm))) else jnp.transpose(p, perm)
                return [p.astype(dtype)]
            self.ops.append(_Op(view, [src], [k], frozenset([src.unit]), "layer slice"))
        else:
            self.ops.append(_Op(lambda v, l=l: [v[l]], [x], [k], frozenset(), "scan slice"))
        return k


def _dce(ops: list[_Op], out_keys) -> list[_Op]:
    live = {k for k in out_keys if not isinstance(k, Lit)}
    kept = []
    for op in reversed(ops):
        if op.effects or any(k in live for k in op.outs):
            kept.append(op)
            live.update(k for k in op.ins if not isinstance(k, (Lit, _Param)))
    return kept[::-1]


def _stages(ops: list[_Op], order: Mapping[str, int]) -> tuple[list[_Op], list[_Stage]]:
    """Prologue (ops before any parameter use) and stages: a new stage starts at each op that reads
    a unit the current stage has not gathered."""
    prologue, stages = [], []
    for op in ops:
        if not op.units:
            (stages[-1].ops if stages else prologue).append(op)
        elif stages and op.units <= set(stages[-1].units):
            stages[-1].ops.append(op)
        else:
            stages.append(_Stage(sorted(op.units, key=order.__getitem__), [op]))
    return prologue, stages


def _liveness(stages: list[_Stage], out_keys) -> None:
    later_reads = {k for k in out_keys if not isinstance(k, Lit)}
    for st in reversed(stages):
        made = {k for op in st.ops for k in op.outs}
        st.outs = [k for op in st.ops for k in op.outs if k in later_reads]
        reads = [k for op in st.ops for k in op.ins if not isinstance(k, (Lit, _Param)) and k not in made]
        st.ins = list(dict.fromkeys(reads))
        later_reads |= set(st.ins)


def _run_ops(ops, env, params=None):
    def read(k):
        if isinstance(k, Lit):
            return k.val
        if isinstance(k, _Param):
            return params[k.unit][k.index]
        return env[k]
    for op in ops:
        for k, v in zip(op.outs, op.fn(*map(read, op.ins))):
            env[k] = v
    return read


@dataclass
class _Program:
    prologue: list
    stages: list
    in_keys: list        # per parameter leaf (a key, a _StackView, or None for unit leaves), then batch leaves
    out_keys: list
    out_tree: Any


def _trace(loss_fn, plan: ParamPlan, batch_avals, batch_tree, detect: dict | None = None,
           compute_dtype=None) -> _Program:
    # Gathered leaves arrive in the compute dtype (mixed precision): the loss is traced with them so.
    avals = [jax.ShapeDtypeStruct(s, compute_dtype if compute_dtype is not None and p.kind != "const"
                                  and jnp.issubdtype(jnp.dtype(d), jnp.floating) else d)
             for s, d, p in zip(plan.shapes, plan.dtypes, plan.places)]

    def flat_loss(leaves, batch_leaves):
        params = jax.tree_util.tree_unflatten(plan.treedef, leaves)
        return loss_fn(params, jax.tree_util.tree_unflatten(batch_tree, batch_leaves))

    closed, out_shape = jax.make_jaxpr(flat_loss, return_shape=True)(avals, list(batch_avals))
    fl = _Flattener(plan, [p.path for p in plan.places], detect)
    in_keys = []
    for i, place in enumerate(plan.places):
        if detect is not None and _trainable(avals[i]):
            in_keys.append(_StackView(i, tuple(range(len(avals[i].shape))), avals[i].dtype))
        elif place.kind == "unit":
            in_keys.append(_Param(place.units[0], place.index))
        elif place.kind == "stacked":
            in_keys.append(_StackView(i, tuple(range(len(avals[i].shape))), avals[i].dtype))
        else:
            in_keys.append(fl.key())
    batch_keys = [fl.key() for _ in batch_avals]
    out_keys = fl.emit(closed.jaxpr, closed.consts, in_keys + batch_keys)
    if detect is not None:
        return None
    fl.read_views(out_keys, "the loss's output")
    ops = _dce(fl.ops, out_keys)
    prologue, stages = _stages(ops, {u.name: u.index for u in plan.layout.units})
    _liveness(stages, out_keys)
    const_keys = [k for k, p in zip(in_keys, plan.places) if p.kind == "const"]
    return _Program(prologue, stages, const_keys + batch_keys, out_keys, jax.tree_util.tree_structure(out_shape))


def scanned_axes(loss_fn, params, batch) -> dict[str, int]:
    """{leaf path: axis} of the float leaves that `loss_fn(params, batch)` uses only as scanned-over
    operands of lax.scan (through transposes and casts), each always over one axis and length: the
    leaves to stack per layer. `params` / `batch` may hold jax.ShapeDtypeStruct leaves."""
    plan = discover_units(params, 1, units=lambda path, leaf: "all")
    batch_leaves, batch_tree = jax.tree_util.tree_flatten(batch)
    uses: dict[int, list] = {}
    _trace(loss_fn, plan, [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in batch_leaves], batch_tree, uses)
    return {plan.places[i].path: u[0][0] for i, u in uses.items() if None not in u and len(set(u)) == 1}


def plan_for(loss_fn, params, batch, world: int, **policy) -> ParamPlan:
    """discover_units with the stacked leaves found by `scanned_axes` (unless `stacked=` is given)."""
    if policy.get("stacked") is None:
        policy["stacked"] = scanned_axes(loss_fn, params, batch)
    return discover_units(params, world, **policy)


def gather_on_use(loss_fn: Callable, plan: ParamPlan, gather: GatherFn, compute_dtype=None) -> Callable:
    """loss_fn(params, batch) -> fn(shards, consts, batch, gather_arg) with the same outputs.

    Args:
      loss_fn: any JAX function of (params pytree, batch pytree) (its output may be any pytree,
        e.g. (loss, aux)); traced once per batch shape signature.
      plan: discover_units / plan_for of the params' structure.
      gather: the trainer's GatherFn, gather(shard [Kp/W], UnitSpec, gather_arg) -> unit.
      compute_dtype: the dtype `gather` returns units in, when not their own (mixed precision).

    The returned fn takes `shards` {unit name: fp32 shard} (the layout's), `consts` the plan's
    constant leaves (discover.const_leaves), the batch and the gather_arg (ODC: the version).
    Differentiate it w.r.t. `shards` (jax.value_and_grad, has_aux as usual).
    """
    cache: dict = {}
    specs = {u.name: u for u in plan.layout.units}

    def program(batch_leaves, batch_tree) -> _Program:
        sig = (batch_tree, tuple((tuple(np.shape(x)), jax.typeof(x).dtype) for x in batch_leaves))
        if sig not in cache:
            cache[sig] = _trace(loss_fn, plan, [jax.ShapeDtypeStruct(s, d) for s, d in sig[1]], batch_tree,
                                compute_dtype=compute_dtype)
        return cache[sig]

    def fn(shards, consts, batch, gather_arg=None):
        batch_leaves, batch_tree = jax.tree_util.tree_flatten(batch)
        prog = program(batch_leaves, batch_tree)
        env = dict(zip(prog.in_keys, list(consts) + batch_leaves))
        _run_ops(prog.prologue, env)
        for st in prog.stages:
            def stage(shard, carry, _batch, garg, st=st):
                params = {u: gathered_params(specs[u], gather(s, specs[u], garg)) for u, s in zip(st.units, shard)}
                local = dict(zip(st.ins, carry))
                _run_ops(st.ops, local, params)
                return tuple(local[k] for k in st.outs)

            outs = remat_stage(stage)(tuple(shards[u] for u in st.units), tuple(env[k] for k in st.ins), (),
                                      gather_arg)
            env.update(zip(st.outs, outs))
        read = _run_ops([], env)
        return jax.tree_util.tree_unflatten(prog.out_tree, [read(k) for k in prog.out_keys])

    def stage_units(batch) -> list[tuple[str, ...]]:
        """The units each stage gathers, in forward order (for a batch of this signature)."""
        return [tuple(st.units) for st in program(*jax.tree_util.tree_flatten(batch)).stages]

    fn.plan, fn.stage_units = plan, stage_units
    return fn


def microbatch_grad_any(loss_fn: Callable, plan: ParamPlan, gather: GatherFn, has_aux: bool = False,
                        compute_dtype=None) -> Callable:
    """staging.microbatch_grad for any loss_fn: fn(shards, consts, batch, global_tokens, gather_arg) ->
    (loss / global_tokens, grads w.r.t. the local shards), or ((loss, aux), grads) with has_aux.
    `loss_fn` returns the microbatch's *sum* of per-token losses (jaxodc's loss contract)."""
    staged = gather_on_use(loss_fn, plan, gather, compute_dtype)

    def loss(shards, consts, batch, global_tokens, gather_arg):
        out = staged(shards, consts, batch, gather_arg)
        if has_aux:
            return out[0].astype(jnp.float32) / global_tokens, out[1]
        return out.astype(jnp.float32) / global_tokens

    return jax.value_and_grad(loss, has_aux=has_aux)
