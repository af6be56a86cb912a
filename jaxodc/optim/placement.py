"""A user's Optax chain on this rank's shards, meaning what it means in one process.

A sharded trainer holds each parameter as pieces spread over ranks (units cut into shards,
modeling/units.py), but an Optax chain is written for the whole tree: masks and labels by path or
`ndim`, global-norm clipping, per-leaf norms (LAMB, LARS, AGC), row and column statistics
(Adafactor), matrix iterations (Muon). So the chain is traced once on the model's own tree of global
abstract parameters (`jax.make_jaxpr`), and the traced program is run on this rank's pieces with
every operation placed (`Placer`):

* elementwise operations run on the local piece;
* a reduction over a leaf, or over some of its axes, is a local partial (segment-reduced onto the
  kept axes) plus one global reduction: `optim.clipping.global_sum`, the hook the trainers bind to
  their minibatch agreement (ODC: `train.unitwise.EndStep`'s in-program exchange, one per level of
  reductions that read earlier ones; the collective: `psum`). Max, min, any and all travel as every
  rank's partial in its own row of a zero matrix, so the sum is exact and reduced after it. A sum
  stays a `Partial` through linear operations (adding sums, scaling by a replicated value), so a
  global norm over every leaf is one global sum, not one per leaf;
* a broadcast of a replicated value onto a leaf (Adafactor's row statistics, a clipping factor) is
  evaluated only at the local elements;
* an operation that needs a whole leaf (a matrix product over the leaf's own axes, a transpose, a
  loop over it, a sort) gets it gathered (the same hook: each rank adds its piece into zeros), runs
  on it replicated, and what later meets a local piece is cut back to it;
* an operation with side effects (a callback, a collective of the user's own) cannot be placed:
  `PlacementError` at start, naming the primitive and where the chain made it.

State leaves shaped like their parameter and found under its path (Adam's moments, Muon's momentum,
MultiSteps' accumulated gradients) are kept as local pieces; every other state leaf (counts,
Adafactor's factored statistics) is replicated.

Where each parameter lives and its local piece on a rank (`ParamTree`, `LeafLayout`) are
optim/pieces.py's; this module is the interpreter (`Placer`) and the transformation.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend.core import Literal

from jaxodc.optim.clipping import global_sum
from jaxodc.optim.pieces import (LeafLayout, ParamTree, PlacementError, cut, flat_of, gather,  # noqa: F401
                                  join_pieces, local_parts, segment_flat_index, segment_valid, split_parts,
                                  valid_mask)

PyTree = Any



# ------------------------------------------------------------------------------ the interpreter

@dataclass
class Local:
    """A value with a parameter's flat order, held as this rank's piece: `shape` is its view (any
    reshape of the parameter's shape). The local elements are either `parts`, one array per
    segment of `layout` (parameters and gradients: slices of the unit shards, never concatenated,
    since a piece of a scan-stacked leaf spans units and a concatenation read twice is a copy the
    program keeps), or `flat`, one array (a state leaf as kept: updated in place only if it stays
    one array)."""

    layout: LeafLayout
    shape: tuple[int, ...]
    parts: tuple | None
    dtype: Any
    flat: jax.Array | None = None

    def segments(self) -> tuple:
        """The local elements per segment (a flat value's as slices of it)."""
        return self.parts if self.flat is None else split_parts(self.flat, self.layout)


@dataclass
class Broadcast:
    """`lax.broadcast_in_dim(value, shape, dims)` not yet materialised (it may only ever be
    needed at the local elements)."""

    value: jax.Array
    shape: tuple[int, ...]
    dims: tuple[int, ...]


@dataclass
class Partial:
    """A sum over ranks not yet taken: this rank's term of a replicated value (the sum of every
    rank's `x`)."""

    x: jax.Array


# Linear in their Partial operands: (primitive, which operands may be partial).
_LINEAR = {"add": (0, 1), "sub": (0, 1), "neg": (0,), "mul": (0, 1), "reduce_sum": (0,), "reshape": (0,),
           "squeeze": (0,), "expand_dims": (0,), "convert_element_type": (0,)}  # (a broadcast would grow the sum)


ELEMENTWISE = frozenset("""
abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp clz convert_element_type copy copy_p cos
cosh digamma div eq erf erf_inv erfc exp exp2 expm1 floor ge gt igamma igammac imag integer_pow is_finite le
lgamma log log1p logistic lt max min mul ne neg nextafter not or polygamma population_count pow real
reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic shift_right_logical sign sin sinh
sqrt square sub tan tanh xor
""".split())
REDUCTIONS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min", "reduce_and": "and",
              "reduce_or": "or", "reduce_prod": "prod"}
_CALLS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# Primitives that call a jaxpr once on their own operands (loops and branches are not calls).
CALL_PRIMITIVES = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                             "custom_vjp_call_jaxpr", "checkpoint", "remat", "custom_lin"})


def _zero(x) -> bool:
    """Whether `x` is known (not traced) to be all zeros."""
    if isinstance(x, (jax.core.Tracer, Local, Broadcast, Partial)):
        return False
    return bool(np.all(np.asarray(x) == 0))


def called_jaxpr(eqn):
    """(jaxpr, consts) that a call eqn (jit, custom_jvp / custom_vjp, remat) runs on its own
    operands, or None (any other eqn)."""
    if eqn.primitive.name not in CALL_PRIMITIVES:
        return None
    for key in _CALLS:
        sub = eqn.params.get(key)
        if sub is None:
            continue
        jaxpr, consts = (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (sub, ())
        if hasattr(jaxpr, "eqns") and len(jaxpr.invars) == len(eqn.invars) and len(jaxpr.outvars) == len(eqn.outvars):
            return jaxpr, consts
    return None


def _identity(op: str, dtype):
    """The identity of reduction `op` in `dtype`."""
    if op in ("max", "min"):
        if jnp.issubdtype(dtype, jnp.inexact):
            return -jnp.inf if op == "max" else jnp.inf
        if dtype == jnp.bool_:
            return op == "min"
        return jnp.iinfo(dtype).min if op == "max" else jnp.iinfo(dtype).max
    return {"sum": 0, "prod": 1, "and": True, "or": False}[op]


def _dtype(x):
    """The element type of an operand, placed or not."""
    if isinstance(x, Local):
        return x.dtype
    return (x.value if isinstance(x, Broadcast) else jnp.asarray(x)).dtype


def _where(eqn) -> str:
    try:
        from jax._src import source_info_util
        return source_info_util.summarize(eqn.source_info)
    except Exception:  # noqa: BLE001 - only a message
        return "an unknown place"


class Placer:
    """Runs a jaxpr traced on global values with some inputs given as local pieces (module
    docstring). `rank`: this rank (an int, or traced); `world`: ranks.

    `serial_gathers`: a leaf of some units is gathered only once the previous gathered leaf of
    the same units is done with: the latest whole value made from it (Muon: its Newton-Schulz
    result) is cut to that leaf's piece there and then, and the cut and the next gather pass one
    optimization barrier. Where the gathers are collectives inside one program (the collective
    trainer's psum), XLA:CPU's scheduler otherwise runs every gather first, or every cut last,
    holding every leaf whole while it works on one (bench optim-memory, Muon on a unit's 8
    matrices: 16 matrices of temporaries where one's Newton-Schulz needs 9). Same units only: a
    unit's program must not read another's (train.unitwise). Later readers of the cut value get
    the piece: elementwise ones work on it; one that needs it whole gathers it again."""

    def __init__(self, rank, world: int, serial_gathers: bool = False):
        self.rank, self.world = rank, world
        self.serial_gathers = serial_gathers
        self._from_gather: dict[int, tuple] = {}  # id -> (units, value): whole values made from a gathered leaf
        self._latest: dict[frozenset, tuple] = {}  # units -> (the latest such value, its leaf's layout)
        self._gathered: list[tuple] = []  # (units, layout) of each leaf gathered so far
        self._renamed: dict[int, tuple] = {}  # id -> (value, what reads of it get from then on)

    def _derived(self, ins: Sequence, outs: Sequence, gathered: Sequence[tuple]) -> None:
        """Marks `outs` as made from a gathered leaf where some of `ins` were, or the operation
        gathered some (`gathered`), all of one leaf."""
        keys = {self._from_gather[id(x)][0] for x in ins if self._from_gather.get(id(x), (None, None))[1] is x}
        keys |= set(gathered)
        if len(keys) != 1:
            return
        key = keys.pop()
        for y in outs:
            if not isinstance(y, (Local, Broadcast, Partial)):
                self._mark(y, key)

    def _mark(self, y, key: tuple) -> None:
        """`y`, a whole value, made from the gathered leaf `key` (units, layout): the latest one."""
        self._from_gather[id(y)] = (key, y)
        self._latest[key[0]] = (y, key[1])

    def _after_previous(self, parts: tuple, units: frozenset) -> tuple:
        """`parts` (a leaf of `units` about to be gathered) once the previous gathered leaf of those
        units is cut (see the class docstring)."""
        if units not in self._latest:
            return parts
        prev, layout = self._latest.pop(units)
        if math.prod(prev.shape) != math.prod(layout.shape) or not jnp.issubdtype(prev.dtype, jnp.floating):
            # not the leaf's values (a statistic of it, a mask): only ordered; both barrier outputs are read
            # from then on, else XLA drops the one nothing reads
            parts, after = lax.optimization_barrier((parts, prev))
            self._renamed[id(prev)] = (prev, after)
            return parts
        piece = cut(jnp.reshape(prev, layout.shape), layout, self.rank)
        parts, piece = lax.optimization_barrier((parts, piece))
        self._renamed[id(prev)] = (prev, Local(layout, tuple(prev.shape), piece, prev.dtype))
        return parts

    # -- conversions
    def whole(self, v):
        """The value whole on this rank (gathered or materialised)."""
        if isinstance(v, Partial):
            return global_sum(v.x)
        if isinstance(v, Local):
            parts = v.segments()
            if self.serial_gathers:
                key = (frozenset(s.unit for s in v.layout.segments), v.layout)
                parts = self._after_previous(parts, key[0])
            out = jnp.reshape(gather(parts, v.layout, self.rank, v.dtype), v.shape)
            if self.serial_gathers:
                self._mark(out, key)
                self._gathered.append(key)
            return out
        if isinstance(v, Broadcast):
            return lax.broadcast_in_dim(v.value, v.shape, v.dims)
        return v

    def local(self, v, layout: LeafLayout) -> tuple:
        """The value's elements at `layout`'s local elements (per segment)."""
        v = self.taken(v)
        if isinstance(v, Local):
            if v.layout == layout:
                return v.segments()
            return self._cut(self.whole(v), layout)
        if isinstance(v, Broadcast):
            if math.prod(v.value.shape) == 1:
                return tuple(jnp.broadcast_to(jnp.reshape(v.value, ()), (s.length,)) for s in layout.segments)
            flat = jnp.reshape(v.value, (-1,))
            out = []
            for s in layout.segments:
                coords = jnp.unravel_index(segment_flat_index(s, layout, self.rank), v.shape)
                src = tuple(jnp.zeros_like(coords[d]) if n == 1 else coords[d] for d, n in zip(v.dims, v.value.shape))
                out.append(flat[jnp.ravel_multi_index(src, v.value.shape, mode="clip")])
            return tuple(out)
        v = jnp.asarray(v)
        if v.ndim == 0:
            return tuple(jnp.broadcast_to(v, (s.length,)) for s in layout.segments)
        return self._cut(v, layout)

    def _cut(self, whole: jax.Array, layout: LeafLayout) -> tuple:
        """A whole value's local piece, materialised on its own: else XLA fuses the last
        operations on the whole leaf (Newton-Schulz's last step) into whatever reads the piece,
        often the unit's new shard, which then holds every leaf's whole values alive at once."""
        return lax.optimization_barrier(cut(whole, layout, self.rank))

    def local_flat(self, v, layout: LeafLayout, dtype) -> jax.Array:
        """The value's elements at `layout`'s local elements as one flat array (a replicated
        scalar broadcast once, not per segment: a concatenation of broadcasts is materialised)."""
        v = self.taken(v)
        if isinstance(v, Local) and v.flat is not None and v.layout == layout:
            return v.flat
        if isinstance(v, Broadcast) and math.prod(v.value.shape) == 1:
            return jnp.broadcast_to(jnp.reshape(v.value, ()), (layout.length,))
        if not isinstance(v, (Local, Broadcast)) and jnp.ndim(v) == 0:
            return jnp.broadcast_to(jnp.asarray(v), (layout.length,))
        return flat_of(self.local(v, layout), dtype)

    # -- reductions
    def global_reduce(self, partial: jax.Array, op: str) -> jax.Array:
        """`partial` combined over ranks by `op` (sum, max, min, and, or, prod)."""
        dtype = partial.dtype
        if op == "sum":
            return global_sum(partial.astype(jnp.float32) if dtype == jnp.bool_ else partial).astype(dtype)
        rows = jnp.arange(self.world, dtype=jnp.int32) == jnp.asarray(self.rank, jnp.int32)
        rows = jnp.reshape(rows, (self.world,) + (1,) * partial.ndim)
        every = global_sum(jnp.where(rows, partial[None].astype(jnp.float32), 0.0))  # one row each, exact
        fn = {"max": jnp.max, "min": jnp.min, "and": jnp.all, "or": jnp.any, "prod": jnp.prod}[op]
        return fn(every, axis=0).astype(dtype)

    def _partial_op(self, eqn, ins: list):
        """Outputs of a linear operation on sums not yet taken, still not taken; None when the
        operation is not linear in them (then they are taken first)."""
        name, dtype = eqn.primitive.name, eqn.outvars[0].aval.dtype
        which = _LINEAR.get(name)
        partial = [i for i, x in enumerate(ins) if isinstance(x, Partial)]
        if which is None or not jnp.issubdtype(dtype, jnp.floating) or not set(partial) <= set(which):
            return None
        if any(isinstance(x, (Local, Broadcast)) for x in ins):
            return None
        if name == "mul" and len(partial) != 1:  # a product of two sums is not a sum
            return None
        if name in ("add", "sub") and len(partial) != 2 and not _zero(ins[1 - partial[0]]):
            return None  # a replicated addend would count W times (but Python's sum() starts at 0)
        out = self._bind(eqn, [x.x if isinstance(x, Partial) else x for x in ins])
        return [Partial(y) for y in out]

    def reduce(self, v: Local, axes: Sequence[int], op: str):
        kept = [d for d in range(len(v.shape)) if d not in axes]
        dtype = v.dtype
        ident = _identity(op, dtype)
        out_shape = tuple(v.shape[d] for d in kept)
        combine = {"sum": jnp.add, "max": jnp.maximum, "min": jnp.minimum, "prod": jnp.multiply,
                   "and": jnp.logical_and, "or": jnp.logical_or}[op]
        partial = jnp.full(out_shape, ident, jnp.bool_ if op in ("and", "or") else dtype)
        for s, x in zip(v.layout.segments, v.segments()):  # a partial per segment, combined
            valid = segment_valid(s, self.rank, v.layout.world)
            if valid is not None:
                x = jnp.where(valid, x, jnp.asarray(ident, dtype))
            if not kept:
                if op in ("and", "or"):
                    part = jnp.all(x) if op == "and" else jnp.any(x)
                else:
                    part = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "prod": jnp.prod}[op](x, initial=ident)
            else:
                coords = jnp.unravel_index(segment_flat_index(s, v.layout, self.rank), v.shape)
                seg = jnp.ravel_multi_index(tuple(coords[d] for d in kept), out_shape, mode="clip")
                n = math.prod(out_shape)
                if op in ("and", "or"):  # empty segments: and -> True (int max), or -> False (int min)
                    fn = jax.ops.segment_min if op == "and" else jax.ops.segment_max
                    part = fn(x.astype(jnp.int32), seg, n) > 0
                else:
                    fn = {"sum": jax.ops.segment_sum, "max": jax.ops.segment_max, "min": jax.ops.segment_min,
                          "prod": jax.ops.segment_prod}[op]
                    part = fn(x, seg, n)
                part = jnp.reshape(part, out_shape)
            partial = combine(partial, part)
        partial = partial.astype(dtype)
        if op == "sum" and jnp.issubdtype(dtype, jnp.floating):
            return Partial(partial)  # taken where something other than a linear operation reads it
        return self.global_reduce(partial, op)

    # -- the jaxpr
    def run(self, jaxpr, consts: Sequence, args: Sequence) -> list:
        env: dict = {}

        def read(a):
            if isinstance(a, Literal):
                return a.val
            x = env[a]
            renamed = self._renamed.get(id(x))
            return renamed[1] if renamed is not None and renamed[0] is x else x

        for var, c in zip(jaxpr.constvars, consts):
            env[var] = c
        for var, x in zip(jaxpr.invars, args):
            env[var] = x
        for eqn in jaxpr.eqns:
            ins, before = [read(a) for a in eqn.invars], len(self._gathered)
            outs = self.eqn(eqn, ins)
            if self.serial_gathers:
                self._derived(ins, outs, self._gathered[before:])
            for var, x in zip(eqn.outvars, outs):
                env[var] = x
        return [read(a) for a in jaxpr.outvars]

    def taken(self, v):
        """`v` with a sum not yet taken taken."""
        return self.whole(v) if isinstance(v, Partial) else v

    def eqn(self, eqn, ins: list) -> list:
        name = eqn.primitive.name
        if any(isinstance(x, Partial) for x in ins):
            outs = self._partial_op(eqn, ins)
            if outs is not None:
                return outs
            if called_jaxpr(eqn) is None:
                ins = [self.taken(x) for x in ins]
        placed = [isinstance(x, (Local, Broadcast)) for x in ins]
        if not any(placed):
            return self._bind(eqn, ins)
        if eqn.effects:
            raise PlacementError(f"the optimizer's `{name}` (at {_where(eqn)}) has side effects ({eqn.effects}) "
                                 f"and reads parameter-sized values: it cannot run on shards")
        sub = called_jaxpr(eqn)
        if sub is not None:
            jaxpr, consts = sub
            return self.run(jaxpr, consts, ins)
        out_avals = [v.aval for v in eqn.outvars]
        if name in ELEMENTWISE:
            return [self._elementwise(eqn, ins, out_avals[0])]
        if name == "broadcast_in_dim":
            return [self._broadcast(eqn, ins)]
        if name in ("reshape", "squeeze", "expand_dims") and isinstance(ins[0], Local):
            return [dataclasses.replace(ins[0], shape=tuple(out_avals[0].shape))]
        if name in REDUCTIONS and isinstance(ins[0], Local):
            return [self.reduce(ins[0], tuple(eqn.params["axes"]), REDUCTIONS[name])]
        if name == "dot_general" and self._is_inner_product(eqn, ins):
            a, b = ins
            pref = eqn.params.get("preferred_element_type")
            x = jnp.zeros((), pref or a.dtype)
            for s, pa, pb in zip(a.layout.segments, a.segments(), b.segments()):
                prod = pa.astype(pref or pa.dtype) * pb.astype(pref or pb.dtype)
                valid = segment_valid(s, self.rank, a.layout.world)  # padding may hold anything by now
                x = x + jnp.sum(prod if valid is None else jnp.where(valid, prod, jnp.zeros_like(prod)))
            return [self.global_reduce(x, "sum").astype(out_avals[0].dtype)]
        if name == "cond":
            return self._cond(eqn, ins)
        # a whole-leaf operation: on the gathered leaf, replicated
        return self._bind(eqn, [self.whole(x) for x in ins])

    @staticmethod
    def _bind(eqn, ins):
        out = eqn.primitive.bind(*ins, **eqn.params)
        return list(out) if eqn.primitive.multiple_results else [out]

    def _elementwise(self, eqn, ins, aval):
        shape = tuple(aval.shape)
        layouts = [x.layout for x in ins if isinstance(x, Local) and x.shape == shape]
        if not layouts:  # only lazy broadcasts: materialised
            return self._bind(eqn, [self.whole(x) for x in ins])[0]
        layout, args = layouts[0], []
        bind = lambda xs: self._bind(eqn, xs)[0]  # noqa: E731
        divisor = ins[1] if eqn.primitive.name == "div" else None
        if (divisor is not None and not isinstance(divisor, Local) and jnp.issubdtype(aval.dtype, jnp.floating)
                and math.prod(jnp.shape(divisor.value if isinstance(divisor, Broadcast) else divisor)) == 1):
            # A piece over a replicated scalar (clipping's t / norm) as a product with its inverse:
            # XLA counts a divide as expensive and will not recompute it in each of its consumers
            # (Adam's two moments), so it would keep the quotient of every leaf alive.
            inverse = 1 / jnp.reshape(divisor.value if isinstance(divisor, Broadcast) else divisor, ())
            ins = [ins[0], inverse.astype(aval.dtype)]
            bind = lambda xs: lax.mul(*xs)  # noqa: E731
        flat = any(isinstance(x, Local) and x.flat is not None and x.layout == layout for x in ins)
        for x in ins:
            if isinstance(x, (Local, Broadcast)) and tuple(x.shape) != shape:
                x = self.whole(x)  # an operand the op broadcasts (a scalar, or unit axes)
            if not isinstance(x, (Local, Broadcast)) and 0 < jnp.ndim(x) and tuple(jnp.shape(x)) != shape:
                x = Broadcast(jnp.asarray(x), shape, tuple(range(len(shape))))
            # scalars too: select_n takes no scalar cases
            args.append(self.local_flat(x, layout, _dtype(x)) if flat else self.local(x, layout))
        if flat:  # meets a state leaf: flat, so that the state is updated in place
            return Local(layout, shape, None, aval.dtype, bind(args))
        return Local(layout, shape, tuple(bind(list(xs)) for xs in zip(*args)), aval.dtype)

    def _broadcast(self, eqn, ins):
        x = ins[0]
        shape, dims = tuple(eqn.params["shape"]), tuple(eqn.params["broadcast_dimensions"])
        if isinstance(x, Local):
            if math.prod(shape) == math.prod(x.shape):  # only unit axes added: the same flat order
                return dataclasses.replace(x, shape=shape)
            return self._bind(eqn, [self.whole(x)] + list(ins[1:]))[0]
        if isinstance(x, Broadcast):  # a broadcast of a broadcast: one broadcast of the value
            return Broadcast(x.value, shape, tuple(dims[d] for d in x.dims))
        return Broadcast(jnp.asarray(x), shape, dims)

    @staticmethod
    def _is_inner_product(eqn, ins) -> bool:
        a, b = ins
        if not (isinstance(a, Local) and isinstance(b, Local) and a.layout == b.layout and a.shape == b.shape):
            return False
        (ca, cb), (ba, bb) = eqn.params["dimension_numbers"]
        full = tuple(range(len(a.shape)))
        return not ba and not bb and tuple(ca) == full and tuple(cb) == full

    def _cond(self, eqn, ins):
        index = ins[0]
        if isinstance(index, (Local, Broadcast)):
            index = self.whole(index)
        branches = [self.run(br.jaxpr, br.consts, ins[1:]) for br in eqn.params["branches"]]
        out = []
        for k, aval in enumerate(eqn.outvars):
            vals = [br[k] for br in branches]
            layouts = [v.layout for v in vals if isinstance(v, Local) and v.shape == tuple(aval.aval.shape)]
            if layouts:
                lay, shape, dtype = layouts[0], tuple(aval.aval.shape), aval.aval.dtype
                if any(isinstance(v, Local) and v.flat is not None and v.layout == lay for v in vals):
                    xs = [self.local_flat(v, lay, dtype) for v in vals]
                    out.append(Local(lay, shape, None, dtype, lax.select_n(index, *xs) if len(xs) > 1 else xs[0]))
                    continue
                xs = [self.local(v, lay) for v in vals]
                out.append(Local(lay, shape, tuple(lax.select_n(index, *p) for p in zip(*xs)) if len(xs) > 1
                                 else xs[0], dtype))
            else:
                xs = [self.whole(v) for v in vals]
                out.append(lax.select_n(index, *xs) if len(xs) > 1 else xs[0])
        return out


# ----------------------------------------------------------------------------- the transformation

def _state_params(tree: ParamTree, state_shapes) -> list[int | None]:
    """For each state leaf, the parameter it is kept beside as a local piece: one whose path ends
    the leaf's path and whose shape it has; None for replicated leaves."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state_shapes)[0]:
        hit = None
        for i, (p, s) in enumerate(zip(tree.paths, tree.shapes)):
            if len(path) >= len(p) and tuple(path[len(path) - len(p):]) == tuple(p) and tuple(leaf.shape) == s:
                hit = i if hit is None or len(tree.paths[hit]) < len(p) else hit
        out.append(hit)
    return out


class PlacedOptimizer:
    """`optimizer` over the trainer's shards {unit: flat shard}, meaning what it means on the whole
    tree (module docstring); `init` and `update` as an Optax transformation's. Its state is the
    optimizer's own state tree, with parameter-shaped leaves as this rank's pieces (flat) and the
    rest whole.

    Args:
      optimizer: any Optax transformation, written for the model's own tree.
      tree: the model's tree (`ParamTree`).
      layout: the unit layout (modeling/units.py).
      rank: this rank, or None for "traced" (then `rank_fn` gives it while tracing: the
        collective's `axis_index`; one program for every rank, pieces of one length, those of
        contiguous shards padded to the longest: see `held` / `padded`).
      rank_fn: () -> the traced rank, with rank=None.
      serial_gathers: a unit's whole leaves gathered one after another (Placer), for gathers
        that are collectives inside one program.
    """

    def __init__(self, optimizer, tree: ParamTree, layout, rank: int | None, rank_fn: Callable | None = None,
                 serial_gathers: bool = False):
        if rank is None and rank_fn is None:
            raise ValueError("PlacedOptimizer needs rank= or rank_fn=")
        self.optimizer, self.tree, self.unit_layout = optimizer, tree, layout
        self.serial_gathers = serial_gathers
        self._rank, self._rank_fn = rank, rank_fn
        self.layouts = tree.layouts(layout, rank)
        self._sizes = {u.name: u.shard for u in layout.units}
        params = tree.abstract()
        state_shapes = jax.eval_shape(optimizer.init, params)
        self._state_def = jax.tree_util.tree_structure(state_shapes)
        self.state_param = _state_params(tree, state_shapes)
        self._init = jax.make_jaxpr(optimizer.init)(params)
        self._update = jax.make_jaxpr(lambda g, s, p: optimizer.update(g, s, p))(params, state_shapes, params)

    def __repr__(self):
        return f"PlacedOptimizer({self.optimizer!r})"

    @property
    def rank(self):
        return self._rank if self._rank is not None else self._rank_fn()

    @property
    def state_sharded(self) -> list[bool]:
        """Per state leaf (tree order): whether it is held as this rank's piece."""
        return [i is not None for i in self.state_param]

    @property
    def state_spans(self) -> list[tuple[str, ...]]:
        """Per state leaf: the units its piece lies in (several beside a scan-stacked parameter;
        none for a replicated leaf)."""
        return [tuple(self.tree.places[i].units) if i is not None else () for i in self.state_param]

    def held(self, leaves: Sequence, rank: int) -> list:
        """State leaves (host arrays, tree order) of rank `rank` with each piece's padding rows of a
        traced rank's table cut away: the pieces as `tree.layouts(layout, rank)` places them, which
        checkpoints keep."""
        return [x if i is None else np.concatenate([np.zeros(0, np.asarray(x).dtype)] + [
            np.asarray(x)[at:at + s.held(rank)] for s, at in _starts(self.layouts[i])]) for x, i in
            zip(leaves, self.state_param)]

    def padded(self, leaves: Sequence, rank: int) -> list:
        """The inverse of `held`: pieces padded with zeros to this optimizer's local lengths."""
        out = []
        for x, i in zip(leaves, self.state_param):
            if i is not None:
                x, parts, at = np.asarray(x), [], 0
                for s, _ in _starts(self.layouts[i]):
                    parts.append(np.pad(x[at:at + s.held(rank)], (0, s.length - s.held(rank))))
                    at += s.held(rank)
                x = np.concatenate([np.zeros(0, x.dtype)] + parts)
            out.append(x)
        return out

    def _pieces(self, shards: dict) -> list[Local]:
        rank = self.rank
        return [Local(lay, lay.shape, local_parts(lay, shards, rank),
                      shards[lay.segments[0].unit].dtype if lay.segments else jnp.float32) for lay in self.layouts]

    def _state_in(self, leaves) -> list:
        """State leaves as kept: flat pieces."""
        return [Local(self.layouts[i], self.layouts[i].shape, None, x.dtype, x) if i is not None else x
                for x, i in zip(leaves, self.state_param)]

    def _state_out(self, placer: Placer, outs, dtypes) -> list:
        res = []
        for v, i, dtype in zip(outs, self.state_param, dtypes):
            if i is None:
                res.append(placer.whole(v))
            else:
                x = placer.local_flat(v, self.layouts[i], dtype)
                valid = valid_mask(self.layouts[i], placer.rank)
                res.append(x if valid is None else jnp.where(valid, x, jnp.zeros_like(x)))
        return res

    def _clean(self, placer: Placer, parts: tuple, i) -> tuple:
        """`parts` with the padding of parameter `i`'s piece zeroed."""
        out = []
        for s, x in zip(self.layouts[i].segments, parts):
            valid = segment_valid(s, placer.rank, self.layouts[i].world)
            out.append(x if valid is None else jnp.where(valid, x, jnp.zeros_like(x)))
        return tuple(out)

    def init(self, shards):
        """The optimizer's state for this rank's shards {unit: flat shard}."""
        placer = Placer(self.rank, self.unit_layout.world)
        outs = placer.run(self._init.jaxpr, self._init.consts, self._pieces(shards))
        dtypes = [v.aval.dtype for v in self._init.jaxpr.outvars]
        return jax.tree_util.tree_unflatten(self._state_def, self._state_out(placer, outs, dtypes))

    def update(self, updates, state, params=None):
        """(updates as shards, new state) from the gradients' shards, as the optimizer's update on
        the whole tree would give them at this rank's elements."""
        if params is None:
            raise ValueError("the placed optimizer needs params (the trainers always pass their shards)")
        placer = Placer(self.rank, self.unit_layout.world, self.serial_gathers)
        grads, ps = self._pieces(updates), self._pieces(params)
        leaves = jax.tree_util.tree_leaves(state)
        outs = placer.run(self._update.jaxpr, self._update.consts, grads + self._state_in(leaves) + ps)
        n = len(self.layouts)
        upd = [tuple(x.astype(jnp.float32) for x in self._clean(placer, placer.local(v, lay), i))
               for i, (v, lay) in enumerate(zip(outs[:n], self.layouts))]
        new = self._state_out(placer, outs[n:], [v.aval.dtype for v in self._update.jaxpr.outvars[n:]])
        return (join_pieces(self.layouts, upd, self._sizes, rank=placer.rank),
                jax.tree_util.tree_unflatten(self._state_def, new))

    def local_state_shapes(self, rank: int = 0):
        """The state's local shapes on a rank (a traced rank: one length on every rank)."""
        shards = {n: jax.ShapeDtypeStruct((k,), jnp.float32) for n, k in self._sizes.items()}
        probe = PlacedOptimizer.__new__(PlacedOptimizer)
        probe.__dict__.update(self.__dict__)
        # a traced rank's layouts have one length on every rank: probe them with a concrete one
        probe._rank = rank
        probe.layouts = self.layouts if self._rank is None else self.tree.layouts(self.unit_layout, rank)
        return jax.eval_shape(probe.init, shards), shards, probe

    def check(self) -> None:
        """Raises PlacementError now if some operation of the update cannot be placed (every
        operation is tried on abstract local pieces, with `global_sum` the identity)."""
        state, shards, probe = self.local_state_shapes(self._rank if self._rank is not None else 0)
        jax.eval_shape(probe.update, shards, state, shards)


def _starts(layout: LeafLayout) -> list:
    """(segment, its first local element) of each of the layout's segments."""
    out, at = [], 0
    for s in layout.segments:
        out.append((s, at))
        at += s.length
    return out


def place(optimizer: optax.GradientTransformation, tree: ParamTree, layout, rank: int | None,
          rank_fn: Callable | None = None, serial_gathers: bool = False) -> PlacedOptimizer:
    """`optimizer` on this rank's shards (PlacedOptimizer), checked: an operation that cannot be
    placed raises PlacementError here, before training starts."""
    placed = PlacedOptimizer(optimizer, tree, layout, rank, rank_fn, serial_gathers)
    placed.check()
    return placed
