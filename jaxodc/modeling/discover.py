"""Units of any parameter pytree: which leaves are sharded together, found from the tree itself.

A *plan* says, for every leaf of a parameter pytree (any nesting: a linen `{"params": ...}` dict, an
nnx State as a pure dict, a user's dict of arrays), where it lives:

* in one unit (a `UnitSpec` of units.py whose leaves are the unit's leaves as a tuple),
* sliced over a stack axis into one unit per layer (leaves stacked by `nn.scan` / `lax.scan`: the
  unit `"<node>[i]"` holds layer i's slice of every leaf under `<node>`), or
* nowhere: a *constant* (non-float leaves, frozen leaves) that every rank keeps whole, gets no
  gradient and never travels.

Default policy (`discover_units(params, world)`):
  1. repeated layers: siblings named `<prefix><n>` / `<prefix>_<n>` (or list items), at least two with
     one prefix, each become a unit (flax names: `layers_0`, `Dense_1`, `blocks/3`);
  2. stacked leaves (`stacked={path pattern: axis}`, or found by `scanned_axes` in
     gather_on_use.py from how the loss uses them): the topmost node whose trainable leaves are all
     stacked with one length L gives L per-layer units;
  3. the rest: the largest subtrees of at most `max_unit_bytes` (fp32), neighbours in tree order
     merged while they fit.
Override with `units=`: {unit name: pattern(s)}, a sequence of patterns (each its own unit), or a
callable(path, leaf) -> unit name. A pattern is a glob over the "/"-joined path (`fnmatch`), or a
regex (`re.compile(...)` or a string "re:..."), matched against the whole path. Every trainable leaf
must land in exactly one unit; an error names the leaves that do not.
"""
from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxodc.modeling.units import SHARDINGS, Layout, UnitSpec, _path_str, flatten_unit, padded_size

# units= override: {unit name: pattern or patterns} | [pattern, ...] | callable(path, leaf) -> unit name,
# a pattern being a glob string, "re:<regex>" or a compiled re.Pattern.
UnitsPolicy = Any

DEFAULT_MAX_UNIT_BYTES = 64 << 20  # fp32 bytes of one grouped unit (repeated / stacked layers are never split)
_REPEATED = re.compile(r"^(.*?)_?(\d+)$")


@dataclass(frozen=True)
class LeafPlace:
    """Where one leaf of the parameter tree lives. kind "unit": leaf `index` of unit `units[0]`;
    "stacked": leaf `index` of each of `units` (one per layer), sliced at `axis`; "const": none."""

    path: str
    kind: str
    units: tuple[str, ...] = ()
    index: int = -1
    axis: int = -1


@dataclass(frozen=True)
class ParamPlan:
    """Units of a parameter pytree. `layout` is an ordinary units.Layout (each unit's leaves are a
    tuple, so flatten_unit / unflatten_unit / the trainers' shard dicts work unchanged); `places`
    has one entry per leaf of the tree, in jax tree order."""

    layout: Layout
    treedef: Any
    places: tuple[LeafPlace, ...]
    shapes: tuple[tuple[int, ...], ...]  # every leaf's full shape, tree order
    dtypes: tuple[Any, ...]              # every leaf's dtype (numpy or jax extended, e.g. PRNG keys)

    @property
    def const_paths(self) -> tuple[str, ...]:
        return tuple(p.path for p in self.places if p.kind == "const")

    def describe(self) -> list[dict]:
        return [u.describe() for u in self.layout.units]


def _is_pattern_match(pattern, path: str) -> bool:
    if isinstance(pattern, re.Pattern):
        return pattern.fullmatch(path) is not None
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], path) is not None
    return fnmatch.fnmatchcase(path, pattern)


def _unbox(tree):
    try:  # flax nn.Partitioned / nnx metadata boxes: keep the values only
        from flax.core import meta
        return meta.unbox(tree)
    except ImportError:
        return tree


def _leaves(params):
    flat, treedef = jax.tree_util.tree_flatten_with_path(_unbox(params))
    if not flat:
        raise ValueError("the parameter tree has no leaves")
    return [(p, _path_str(p), x) for p, x in flat], treedef


def _dtype(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype  # jax key dtypes are not numpy dtypes


def _trainable(x) -> bool:
    return jnp.issubdtype(_dtype(x), jnp.inexact)


def _nbytes(shape) -> int:
    return 4 * math.prod(shape)


def _key_str(k) -> str:
    return str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))


def _default_assignment(entries, stack_len: dict[int, int], max_unit_bytes: int) -> dict[int, str]:
    """leaf number -> unit name for trainable leaves (stacked ones map to their stack's node name)."""
    out: dict[int, str] = {}

    def name(prefix) -> str:
        return "/".join(_key_str(k) for k in prefix) or "<root>"

    def children(prefix, members):
        kids: dict[Any, list[int]] = {}
        for i in members:
            if len(entries[i][0]) > len(prefix):
                kids.setdefault(entries[i][0][len(prefix)], []).append(i)
        return kids

    def layers(prefix, members):
        """Assign repeated layers and stacks under this node (top-down: the outermost wins)."""
        lens = {stack_len.get(i) for i in members}
        if len(lens) == 1 and None not in lens:
            out.update((i, name(prefix)) for i in members)
            return
        kids = children(prefix, members)
        prefixes: dict[str, int] = {}
        for k in kids:
            m = _REPEATED.match(_key_str(k))
            if m:
                prefixes[m.group(1)] = prefixes.get(m.group(1), 0) + 1
        for k, ms in kids.items():
            m = _REPEATED.match(_key_str(k))
            if m and prefixes[m.group(1)] >= 2 and not any(i in stack_len for i in ms):
                out.update((i, name(prefix + (k,))) for i in ms)
            else:
                layers(prefix + (k,), ms)

    def chunks(prefix, members) -> list[tuple[str, list[int]]]:
        """The rest: the largest subtrees free of layers that fit the bound, as (name, leaves)."""
        if (all(i not in out for i in members)
                and sum(_nbytes(np.shape(entries[i][2])) for i in members) <= max_unit_bytes):
            return [(name(prefix), members)]
        found = [(entries[i][1], [i]) for i in members if len(entries[i][0]) == len(prefix) and i not in out]
        for k, ms in children(prefix, members).items():
            found += chunks(prefix + (k,), ms)
        return found

    trainable = [i for i, (_, _, x) in enumerate(entries) if _trainable(x)]
    layers((), trainable)
    run: list[tuple[str, list[int]]] = []  # neighbouring chunks merged while they fit

    def close():
        label = run[0][0] if len(run) == 1 else f"{run[0][0]}+{len(run) - 1}"
        out.update((i, label) for _, ms in run for i in ms)
        run.clear()

    for chunk in sorted(chunks((), trainable), key=lambda c: min(c[1])):
        size = sum(_nbytes(np.shape(entries[i][2])) for _, ms in run + [chunk] for i in ms)
        if run and size > max_unit_bytes:
            close()
        run.append(chunk)
    if run:
        close()
    return out


def _policy_assignment(entries, units, trainable: list[int]) -> dict[int, str]:
    out: dict[int, str] = {}
    if callable(units):
        for i in trainable:
            name = units(entries[i][1], entries[i][2])
            if name is not None:
                out[i] = str(name)
    else:
        table = ({str(p) if not isinstance(p, re.Pattern) else p.pattern: [p] for p in units}
                 if not isinstance(units, Mapping) else
                 {n: [ps] if isinstance(ps, (str, re.Pattern)) else list(ps) for n, ps in units.items()})
        for i in trainable:
            path = entries[i][1]
            hits = [n for n, ps in table.items() if any(_is_pattern_match(p, path) for p in ps)]
            if len(hits) > 1:
                raise ValueError(f"parameter {path!r} is assigned to units {hits} by the policy; each parameter "
                                 f"must match exactly one unit's patterns (make the patterns disjoint)")
            if hits:
                out[i] = hits[0]
    missing = [entries[i][1] for i in trainable if i not in out]
    if missing:
        shown = ", ".join(repr(p) for p in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"the unit policy leaves {len(missing)} parameter(s) in no unit: {shown}; add a pattern "
                         f"that matches them (e.g. a catch-all '*' unit), or pass units=None for the default policy")
    return out


def discover_units(params, world: int, *, units: UnitsPolicy = None,
                   stacked: Mapping[str, int] | None = None, frozen: Sequence[str] = (),
                   max_unit_bytes: int = DEFAULT_MAX_UNIT_BYTES, align: int = 1,
                   sharding: str = "contiguous") -> ParamPlan:
    """The units of `params` (arrays or jax.ShapeDtypeStruct leaves, flax metadata boxes allowed).

    Args:
      params: any pytree of parameters.
      world: ranks the units are sharded over (each unit padded to a multiple of world * align).
      units: None for the default policy, or an override (module docstring).
      stacked: {path pattern: stack axis} of leaves stacked over layers (axis 0 or 1 in flax
        nn.scan, `variable_axes={"params": axis}`); every matched leaf is sliced per layer.
      frozen: path patterns of float leaves kept whole and untrained (constants), like non-float ones.
      max_unit_bytes: fp32 bytes bound for grouping the non-layer rest.
      sharding: how a unit is cut into shards, "contiguous" or "per_leaf" (train.units).
    """
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    entries, treedef = _leaves(params)
    stacked = dict(stacked or {})
    const = [not _trainable(x) or any(_is_pattern_match(p, path) for p in frozen) for _, path, x in entries]
    stack_axis: dict[int, int] = {}
    for i, (_, path, x) in enumerate(entries):
        axes = {a for p, a in stacked.items() if _is_pattern_match(p, path)}
        if len(axes) > 1:
            raise ValueError(f"parameter {path!r} matches stacked patterns with different axes {sorted(axes)}")
        if axes and not const[i]:
            (a,) = axes
            if a is None:
                continue
            if not 0 <= a < len(np.shape(x)):
                raise ValueError(f"parameter {path!r} of shape {tuple(np.shape(x))} has no stack axis {a}")
            stack_axis[i] = a
    stack_len = {i: int(np.shape(entries[i][2])[a]) for i, a in stack_axis.items()}
    trainable = [i for i in range(len(entries)) if not const[i]]
    if not trainable:
        raise ValueError("no trainable parameter: every leaf is non-float or frozen")
    assign = (_default_assignment(entries, stack_len, max_unit_bytes) if units is None
              else _policy_assignment(entries, units, trainable))

    # unit name -> member leaves; a unit is all stacked (one length) or all plain
    members: dict[str, list[int]] = {}
    for i in trainable:
        members.setdefault(assign[i], []).append(i)
    specs, places = [], [LeafPlace(path, "const") for _, path, _ in entries]
    for name in sorted(members, key=lambda n: min(members[n])):
        ms = members[name]
        lens = {stack_len.get(i) for i in ms}
        if len(lens) > 1:
            detail = ", ".join(f"{entries[i][1]!r}: {stack_len.get(i, 'not stacked')}" for i in ms)
            raise ValueError(f"unit {name!r} mixes leaves stacked over different numbers of layers ({detail}); "
                             f"put stacked and plain leaves in separate units")
        (L,) = lens
        layer_names = [name] if L is None else [f"{name}[{l}]" for l in range(L)]
        for j, i in enumerate(ms):
            path = entries[i][1]
            places[i] = (LeafPlace(path, "unit", (name,), j) if L is None
                         else LeafPlace(path, "stacked", tuple(layer_names), j, stack_axis[i]))
        shapes = []
        for i in ms:
            s = list(np.shape(entries[i][2]))
            if L is not None:
                del s[stack_axis[i]]
            shapes.append(tuple(int(d) for d in s))
        for uname in layer_names:
            specs.append(_spec(uname, len(specs), tuple(entries[i][1] for i in ms), tuple(shapes),
                               tuple(str(_dtype(entries[i][2])) for i in ms), world, align, sharding))
    return ParamPlan(Layout(tuple(specs), world), treedef, tuple(places),
                     tuple(tuple(int(d) for d in np.shape(x)) for _, _, x in entries),
                     tuple(_dtype(x) for _, _, x in entries))


def _spec(name, index, paths, shapes, dtypes, world, align, sharding="contiguous") -> UnitSpec:
    K = int(sum(math.prod(s) for s in shapes))
    treedef = jax.tree_util.tree_structure(tuple(range(len(shapes))))
    return UnitSpec(name, index, paths, shapes, dtypes, treedef, K, padded_size(shapes, world, align, sharding),
                    world, sharding)


def unit_leaves(plan: ParamPlan, params) -> dict[str, tuple]:
    """{unit name: tuple of its leaves} of a full parameter tree (stacked leaves sliced per layer)."""
    leaves = jax.tree_util.tree_leaves(_unbox(params))
    if len(leaves) != len(plan.places):
        raise ValueError(f"parameter tree has {len(leaves)} leaves, the plan {len(plan.places)}")
    out: dict[str, list] = {u.name: [None] * len(u.shapes) for u in plan.layout.units}
    for place, x in zip(plan.places, leaves):
        if place.kind == "unit":
            out[place.units[0]][place.index] = x
        elif place.kind == "stacked":
            for l, u in enumerate(place.units):
                out[u][place.index] = jnp.take(x, l, axis=place.axis) if isinstance(x, jax.Array) \
                    else np.take(np.asarray(x), l, axis=place.axis)
    return {u: tuple(v) for u, v in out.items()}


def const_leaves(plan: ParamPlan, params) -> tuple:
    """The constant (non-float / frozen) leaves of a full parameter tree, tree order."""
    leaves = jax.tree_util.tree_leaves(_unbox(params))
    return tuple(x for p, x in zip(plan.places, leaves) if p.kind == "const")


def assemble(plan: ParamPlan, units: Mapping[str, Sequence], consts: Sequence) -> Any:
    """The full parameter tree from each unit's leaves (stacked ones re-stacked) and the constants.
    Traceable when its inputs are traced."""
    consts = list(consts)
    leaves = []
    for place in plan.places:
        if place.kind == "unit":
            leaves.append(units[place.units[0]][place.index])
        elif place.kind == "stacked":
            leaves.append(jnp.stack([units[u][place.index] for u in place.units], axis=place.axis))
        else:
            leaves.append(consts.pop(0))
    return jax.tree_util.tree_unflatten(plan.treedef, leaves)


def shard_tree(plan: ParamPlan, params, rank: int) -> dict[str, np.ndarray]:
    """This rank's fp32 shard of every unit of a full parameter tree (numpy)."""
    out = {}
    for u, leaves in unit_leaves(plan, params).items():
        spec = plan.layout[u]
        a, b = spec.shard_range(rank)
        out[u] = np.asarray(flatten_unit(spec, leaves))[a:b].copy()
    return out


def unshard_tree(plan: ParamPlan, shards: Sequence[Mapping[str, np.ndarray]], consts: Sequence) -> Any:
    """The full parameter tree (numpy leaves) from every rank's shards (shards[rank][unit]) and
    the constants."""
    from jaxodc.modeling.units import unflatten_unit
    if len(shards) != plan.layout.world:
        raise ValueError(f"need shards from {plan.layout.world} ranks, got {len(shards)}")
    units = {}
    for u in plan.layout.units:
        flat = np.concatenate([np.asarray(s[u.name]) for s in shards])
        units[u.name] = tuple(np.asarray(x) for x in unflatten_unit(u, jnp.asarray(flat)))
    leaves = jax.tree_util.tree_leaves(assemble(plan, units, consts))
    return jax.tree_util.tree_unflatten(plan.treedef, [x if p.kind == "const" else np.asarray(x)
                                                       for p, x in zip(plan.places, leaves)])
