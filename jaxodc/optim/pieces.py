"""Where each parameter of a model's tree lives on a rank, and its local piece there.

`ParamTree` is the model's own parameter tree as an optimizer sees it and, per parameter, the unit
(and layer of a scan-stacked leaf) that holds it; `LeafLayout` is one parameter's piece on one rank
as segments of that rank's shards (modeling/units.py). A piece is handled as one part per segment.
The functions cut a piece out of the shards (`local_parts`), write pieces back (`join_pieces`),
cut a whole value to a piece (`cut`), gather a piece into the whole value over ranks (`gather`,
through `optim.clipping.global_sum`), and do the same on the host for checkpoints
(`assemble_host`, `cut_host`). The rank may be a traced value
(the collective's `axis_index` inside `shard_map`, one program for every rank): the per_leaf
sharding gives every rank segments of one length, whose positions follow the rank; the contiguous
one gives segments of the longest length over ranks, whose positions and real lengths a per-rank
table gives (the rest of each is padding).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxodc.optim.clipping import global_sum


class PlacementError(ValueError):
    """An optimizer operation that cannot run on shards (the message names it and where the chain made it)."""




# ----------------------------------------------------------------------------------------- layouts

@dataclass(frozen=True)
class LeafPlace:
    """Where one parameter lives: leaf `index` of unit `units[0]`, or (stacked) leaf `index` of
    each of `units`, one per position along `axis` of the parameter."""

    units: tuple[str, ...]
    index: int
    axis: int | None = None


@dataclass(frozen=True)
class Segment:
    """One contiguous run of a parameter's local piece: elements [offset, offset + length) of
    unit `unit`'s shard hold elements start + stride * rank + k of the unit's leaf (flat, of
    `numel`; those at or past `numel` are padding), which is `layer` along `axis` of the
    parameter when stacked. `ranks` (a traced rank over contiguous shards): per rank (offset,
    start, held), the segment's first `held` elements real, the rest padding (offset and start
    then come from the table)."""

    unit: str
    offset: int
    length: int
    start: int
    stride: int
    numel: int
    unit_shape: tuple[int, ...]
    layer: int | None = None
    axis: int | None = None
    ranks: tuple[tuple[int, int, int], ...] | None = None

    def held(self, rank: int) -> int:
        """Elements of this segment the shards of rank `rank` hold (the rest is padding)."""
        return self.length if self.ranks is None else self.ranks[rank][2]

    def _column(self, k: int, rank) -> jax.Array:
        return jnp.asarray([r[k] for r in self.ranks], jnp.int32)[jnp.asarray(rank, jnp.int32)]


@dataclass(frozen=True)
class LeafLayout:
    """A parameter's local piece on a rank: its global shape and its segments, in order."""

    shape: tuple[int, ...]
    segments: tuple[Segment, ...]
    world: int

    @property
    def length(self) -> int:
        return sum(s.length for s in self.segments)


class ParamTree:
    """The model's own parameter tree as the optimizer sees it, and where each leaf lives.

    Args:
      treedef: the tree's structure (constants, which are not trained, are None leaves).
      paths: each parameter's key path.
      shapes: each parameter's global shape.
      places: each parameter's `LeafPlace`.
    """

    def __init__(self, treedef, paths: Sequence[tuple], shapes: Sequence[tuple[int, ...]],
                 places: Sequence[LeafPlace]):
        self.treedef, self.paths = treedef, tuple(paths)
        self.shapes, self.places = tuple(tuple(s) for s in shapes), tuple(places)

    @classmethod
    def of_layout(cls, layout) -> "ParamTree":
        """A unit-staged model's tree: {unit: the unit's subtree}."""
        tree = {u.name: jax.tree_util.tree_unflatten(u.treedef, list(range(len(u.shapes)))) for u in layout.units}
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        paths, shapes, places = [], [], []
        for path, j in flat:
            unit = layout[path[0].key]
            paths.append(path)
            shapes.append(unit.shapes[j])
            places.append(LeafPlace((unit.name,), j))
        return cls(treedef, paths, shapes, places)

    @classmethod
    def of_plan(cls, plan) -> "ParamTree":
        """A discovered tree (modeling/discover.py's ParamPlan): constants become None."""
        full = jax.tree_util.tree_unflatten(plan.treedef, list(range(len(plan.places))))
        flat = jax.tree_util.tree_flatten_with_path(full)[0]
        leaves = [None if p.kind == "const" else i for i, p in enumerate(plan.places)]
        treedef = jax.tree_util.tree_structure(jax.tree_util.tree_unflatten(plan.treedef, leaves))
        paths, shapes, places = [], [], []
        for (path, i), p in zip(flat, plan.places):
            if p.kind == "const":
                continue
            paths.append(path)
            shapes.append(plan.shapes[i])
            places.append(LeafPlace(p.units, p.index, p.axis if p.kind == "stacked" else None))
        return cls(treedef, paths, shapes, places)

    def abstract(self, dtype=jnp.float32) -> PyTree:
        """The tree of global abstract parameters (fp32: the trainers' masters)."""
        return jax.tree_util.tree_unflatten(self.treedef, [jax.ShapeDtypeStruct(s, dtype) for s in self.shapes])

    def layouts(self, layout, rank: int | None) -> list[LeafLayout]:
        """Each parameter's local piece under the unit layout `layout`: on rank `rank` (an int),
        or on any rank (None: the traced rank; one length on every rank, module docstring)."""
        out = []
        for shape, place in zip(self.shapes, self.places):
            segs = []
            for layer, name in enumerate(place.units):
                spec = layout[name]
                segs += _segments(spec, place.index, rank, None if place.axis is None else layer, place.axis)
            out.append(LeafLayout(shape, tuple(segs), layout.world))
        return out


def _segments(spec, j: int, rank: int | None, layer, axis) -> list[Segment]:
    shape = spec.shapes[j]
    o, n = spec.leaf_pieces()[j]
    if spec.per_leaf:
        off, s = spec.leaf_shards()[j]
        if s == 0:
            return []
        if rank is None:
            return [Segment(spec.name, off, s, 0, s, n, shape, layer, axis)]
        return [Segment(spec.name, off, s, rank * s, 0, n, shape, layer, axis)]
    if rank is None:  # per rank (offset in the shard, start in the leaf, held), padded to the longest
        table = []
        for r in range(spec.world):
            a0, b0 = spec.shard_range(r)
            x, y = max(o, a0), min(o + n, b0)
            table.append((x - a0, x - o, y - x) if x < y else (0, n, 0))
        longest = max(t[2] for t in table)
        return [Segment(spec.name, 0, longest, 0, 0, n, shape, layer, axis, tuple(table))] if longest else []
    a0, b0 = spec.shard_range(rank)
    x, y = max(o, a0), min(o + n, b0)
    return [Segment(spec.name, x - a0, y - x, x - o, 0, n, shape, layer, axis)] if x < y else []


# ------------------------------------------------------------------- local pieces of a parameter

def _element_index(seg: Segment, rank) -> jax.Array:
    """The unit-leaf flat index of each of the segment's local elements (int32; `numel` or past
    for padding)."""
    k = jnp.arange(seg.length, dtype=jnp.int32)
    if seg.ranks is not None:
        return jnp.where(k < seg._column(2, rank), seg._column(1, rank) + k, seg.numel)
    return seg.start + seg.stride * jnp.asarray(rank, jnp.int32) + k


def _global_flat(seg: Segment, shape: tuple[int, ...], rank) -> jax.Array:
    """The parameter's flat index of each local element (clipped into range for padding)."""
    e = jnp.minimum(_element_index(seg, rank), max(seg.numel - 1, 0))
    if seg.layer is None:
        return e
    coords = list(jnp.unravel_index(e, seg.unit_shape)) if seg.unit_shape else []
    coords.insert(seg.axis, jnp.full_like(e, seg.layer))
    return jnp.ravel_multi_index(tuple(coords), shape, mode="clip")


def segment_valid(seg: Segment, rank, world: int) -> jax.Array | None:
    """Which of the segment's local elements are real (None: all are, on every rank)."""
    if seg.ranks is None and seg.start + seg.stride * (world - 1) + seg.length <= seg.numel:
        return None
    return _element_index(seg, rank) < seg.numel


def valid_mask(layout: LeafLayout, rank) -> jax.Array | None:
    """Which of a flat piece's local elements are real (None: all are)."""
    masks = [segment_valid(s, rank, layout.world) for s in layout.segments]
    if all(m is None for m in masks):
        return None
    return jnp.concatenate([jnp.ones((s.length,), bool) if m is None else m for s, m in zip(layout.segments, masks)])


def segment_flat_index(seg: Segment, layout: LeafLayout, rank) -> jax.Array:
    """The parameter's flat index of each of the segment's local elements (int32; padding clipped)."""
    return _global_flat(seg, layout.shape, rank)


def local_parts(layout: LeafLayout, shards: dict, rank=None) -> tuple:
    """One parameter's local piece out of this rank's shards, one part per segment: slices of
    the shards, never concatenated (a piece of a scan-stacked leaf spans units, and a
    concatenation read twice is a copy the program keeps alive). A table's padding holds whatever
    follows the real elements."""
    parts = []
    for s in layout.segments:
        if s.ranks is None:
            parts.append(lax.slice_in_dim(shards[s.unit], s.offset, s.offset + s.length))
        else:
            src = jnp.pad(shards[s.unit], (0, s.length))
            parts.append(lax.dynamic_slice_in_dim(src, s._column(0, rank), s.length))
    return tuple(parts)


def split_parts(flat: jax.Array, layout: LeafLayout) -> tuple:
    """A flat local piece (a state leaf as kept) as per-segment parts."""
    out, at = [], 0
    for s in layout.segments:
        out.append(lax.slice_in_dim(flat, at, at + s.length))
        at += s.length
    return tuple(out)


def flat_of(parts: Sequence[jax.Array], dtype=jnp.float32) -> jax.Array:
    """Per-segment parts as one flat local piece."""
    if not parts:
        return jnp.zeros((0,), dtype)
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def join_pieces(layouts: Sequence[LeafLayout], pieces: Sequence[Sequence[jax.Array]], shard_sizes: dict,
                dtype=jnp.float32, rank=None) -> dict:
    """This rank's shards {unit: [size]} holding the parameters' local pieces, each given as its
    per-segment parts (zeros elsewhere; a table's padding is dropped)."""
    runs: dict[str, list] = {u: [] for u in shard_sizes}
    tabled: list = []
    for layout, parts in zip(layouts, pieces):
        for s, x in zip(layout.segments, parts):
            if s.ranks is None:
                runs[s.unit].append((s.offset, x))
            else:
                tabled.append((s, x))
    out = {}
    for unit, size in shard_sizes.items():
        parts, pos = [], 0
        for off, x in sorted(runs[unit], key=lambda r: r[0]):
            if off > pos:
                parts.append(jnp.zeros((off - pos,), dtype))
            parts.append(x.astype(dtype))
            pos = off + x.shape[0]
        if pos < size:
            parts.append(jnp.zeros((size - pos,), dtype))
        out[unit] = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    for s, x in tabled:  # real elements added at the rank's offset (padding adds zeros, or falls off)
        k = jnp.arange(s.length, dtype=jnp.int32)
        x = jnp.where(k < s._column(2, rank), x.astype(dtype), jnp.zeros((), dtype))
        out[s.unit] = out[s.unit].at[s._column(0, rank) + k].add(x, mode="drop")
    return out


def cut(full: jax.Array, layout: LeafLayout, rank) -> tuple:
    """A whole parameter-shaped value's local piece (by the same flat order), per segment."""
    flat = jnp.reshape(full, (-1,))
    parts = []
    for s in layout.segments:
        src = flat
        if s.layer is not None:
            src = jnp.reshape(lax.index_in_dim(jnp.reshape(full, layout.shape), s.layer, s.axis, keepdims=False), (-1,))
        if s.ranks is not None:
            parts.append(lax.dynamic_slice_in_dim(jnp.pad(src, (0, s.length)), s._column(1, rank), s.length))
            continue
        if s.stride == 0 and s.start + s.length <= s.numel:
            parts.append(lax.slice_in_dim(src, s.start, s.start + s.length))
            continue
        need = s.start + s.stride * (layout.world - 1) + s.length  # every rank's window in range
        src = jnp.pad(src, (0, max(need - s.numel, 0)))
        parts.append(lax.dynamic_slice_in_dim(src, s.start + s.stride * jnp.asarray(rank, jnp.int32), s.length))
    return tuple(parts)


def gather(parts: Sequence[jax.Array], layout: LeafLayout, rank, dtype) -> jax.Array:
    """The whole parameter on every rank, from every rank's local piece (per-segment parts): each
    adds its piece into zeros and `global_sum` sums them (exact: every element has one non-zero
    term)."""
    full = jnp.zeros((math.prod(layout.shape),), jnp.float32)
    for s, x in zip(layout.segments, parts):
        valid = segment_valid(s, rank, layout.world)
        x = x if valid is None else jnp.where(valid, x, jnp.zeros_like(x))
        full = full.at[segment_flat_index(s, layout, rank)].add(x.astype(jnp.float32), mode="drop")
    return global_sum(full).astype(dtype).reshape(layout.shape)


def assemble_host(tree: ParamTree, layout, param: int, pieces: Sequence[np.ndarray]) -> np.ndarray:
    """Parameter `param`'s whole value (numpy) from every rank's local piece under `layout`
    (checkpoints: state saved by one sharding, restored into another)."""
    shape = tree.shapes[param]
    full = np.zeros(math.prod(shape), np.asarray(pieces[0]).dtype)
    for r, x in enumerate(pieces):
        at = 0
        for s in tree.layouts(layout, r)[param].segments:
            e = s.start + np.arange(s.length)
            ok = e < s.numel
            full[_host_flat(s, shape, e[ok])] = np.asarray(x)[at:at + s.length][ok]
            at += s.length
    return full.reshape(shape)


def cut_host(tree: ParamTree, layout, param: int, rank: int, full: np.ndarray) -> np.ndarray:
    """Rank `rank`'s local piece of parameter `param` (numpy; padding zero) under `layout`."""
    parts = []
    flat = np.asarray(full).reshape(-1)
    for s in tree.layouts(layout, rank)[param].segments:
        e = s.start + np.arange(s.length)
        ok = e < s.numel
        part = np.zeros(s.length, flat.dtype)
        part[ok] = flat[_host_flat(s, tree.shapes[param], e[ok])]
        parts.append(part)
    return np.concatenate(parts) if parts else np.zeros(0, flat.dtype)


def _host_flat(s: Segment, shape, e: np.ndarray) -> np.ndarray:
    if s.layer is None:
        return e
    coords = list(np.unravel_index(e, s.unit_shape)) if s.unit_shape else []
    coords.insert(s.axis, np.full_like(e, s.layer))
    return np.ravel_multi_index(tuple(coords), shape)
