"""TAGC's compressed reduce-scatter over jax collectives (comm="collective").

One unit's cotangent ct [Kp] on every rank, in the unit's flat order (either sharding of
train.units); rank d owns [d*S, (d+1)*S). In owner slice d, the
elements of the plan's compressed pieces form a static set sel_d (n_d elements, in order); the
rest travel densely. Per call, on every rank:

- dense: each owner's dense elements, stacked (padded to the largest owner's count), psum_scatter;
- compressed, per owner slice d: acc = ct[sel_d] + residual_d, exact top-`fraction` selection
  (`sketch_sparsify`: residual_d <- acc - kept), the kept positions as a bitmap and a count sketch
  of the kept values (the same width for every slice so they stack: `UnitExchange.width`, wide
  enough to peel the union of the W senders' supports, not only one sender's). The bitmaps go to their owner (all_to_all) and are combined there by a true bitwise OR;
  the sketches are summed by psum_scatter (count sketches are additive). The owner peels the summed
  sketch over the OR'ed bitmap and places the decoded sums at its own sel positions.

Building each sender's sketch over its own bitmap (not TAGC's all-reduced index) gives the same sum:
a sketch ignores off-support elements and a sender's kept values are zero off its own support.
Everything about the layout is static (numpy at trace time); only the owner's own rank is traced,
so its placement is a `lax.switch` over static slices rather than an index table as large as the unit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxodc.compress.policy import CompressionPlan
from jaxodc.ops.sketch import (ROWS, bitmap_words, peel_width, sketch_build, sketch_peel, sketch_sparsify,
                               sketch_width)

if TYPE_CHECKING:  # the trainers' layouts, only described here: compress sits below train
    from jaxodc.modeling.units import UnitSpec

__all__ = ["UnitExchange", "WireBytes", "compressed_reduce_scatter", "dense_wire_bytes", "or_scatter", "unit_exchange"]

_F32 = 4


class WireBytes(NamedTuple):
    """Bytes one rank sends for one unit's gradient per call. A reduce-scatter or all_to_all of W
    blocks of b bytes sends (W - 1) * b per rank (the volume of the bandwidth-optimal algorithms);
    what the collective library adds on top (headers, a tree's extra hops) is not counted."""

    compressed: int      # bitmaps + sketches
    dense: int           # the rest of the unit, fp32
    selected_dense: int  # what the compressed elements would have cost sent densely (fp32)

    @property
    def total(self) -> int:
        return self.compressed + self.dense


def dense_wire_bytes(spec: UnitSpec) -> int:
    """Bytes one rank sends for an uncompressed unit's psum_scatter (see WireBytes)."""
    return (spec.world - 1) * spec.shard * _F32


@dataclass(frozen=True)
class UnitExchange:
    """The static plan of one unit's compressed reduce-scatter (`unit_exchange` builds it)."""

    unit: str
    world: int
    shard: int                                   # S
    selected: tuple[tuple[tuple[int, int], ...], ...]  # per owner: [lo, hi) ranges in its slice, sorted
    fraction: float
    ratio: float
    seed: int
    union: bool = True  # widen the sketch to peel the union of every sender's support (`width`)

    @property
    def counts(self) -> tuple[int, ...]:
        """n_d: compressed elements of every owner slice."""
        return tuple(sum(hi - lo for lo, hi in rs) for rs in self.selected)

    @property
    def n_max(self) -> int:
        return max(self.counts)

    @property
    def dense_max(self) -> int:
        return self.shard - min(self.counts)

    @property
    def words(self) -> int:
        return bitmap_words(self.n_max)

    @property
    def width(self) -> int:
        """Buckets per row: the ratio's width, widened (with `union`) to peel the summed sketch.
        The owner peels the sum of W senders' sketches, whose supports' union holds up to W x the
        kept count; a sketch sized by the ratio for one sender's support (ratio 10 holds 2 x 5% of a
        slice at 1.0 bucket per element, below the 1.22 peeling threshold) leaves most of the union
        to the median estimate (bench/RESULTS.md, TAGC)."""
        if not self.n_max:
            return 0
        width = sketch_width(self.n_max, self.ratio)
        if self.union:
            kept = math.ceil(self.fraction * self.n_max)  # sketch_sparsify's k (at least one)
            width = max(width, peel_width(min(self.n_max, self.world * max(1, kept))))
        return width

    @property
    def residual_size(self) -> int:
        """Elements of this rank's residual: every owner slice's compressed elements, concatenated."""
        return sum(self.counts)

    @property
    def wire(self) -> WireBytes:
        w = self.world - 1
        return WireBytes(w * (self.words + ROWS * self.width) * _F32, w * self.dense_max * _F32,
                         w * self.n_max * _F32)


def _ranges(unit: str, pieces, numel: int) -> list[tuple[int, int]]:
    out = sorted((int(o), int(o) + int(n)) for o, n in pieces if int(n) > 0)
    for (a, b), (c, _) in zip(out, out[1:]):
        if c < b:
            raise ValueError(f"unit {unit!r}: compressed pieces overlap ([{a}, {b}) and one at {c})")
    if out and (out[0][0] < 0 or out[-1][1] > numel):
        raise ValueError(f"unit {unit!r}: compressed pieces {out} fall outside its {numel} elements")
    return out


def unit_exchange(spec: UnitSpec, plan: CompressionPlan, *, union: bool = True) -> UnitExchange:
    """The exchange of unit `spec` under `plan`: its compressed pieces cut at the owner slices.
    `union=False` keeps the ratio's sketch width even where the summed supports cannot peel (tests
    of the median estimate)."""
    if not plan.ratio > 0 or not 0 < plan.fraction <= 1:
        raise ValueError(f"unit {spec.name!r}: compression needs 0 < fraction <= 1 and ratio > 0, "
                         f"got fraction={plan.fraction}, ratio={plan.ratio}")
    ranges, S = _ranges(spec.name, plan.selected(spec.name), spec.numel), spec.shard
    # The plan's pieces are in leaf_pieces' coordinates; local_ranges places them in each owner's
    # slice (a range straddling owners under the contiguous sharding; a leaf's 1/W slice under
    # per_leaf, its padding left out).
    per_owner = [tuple(r for lo, hi in ranges for r in spec.local_ranges(d, lo, hi)) for d in range(spec.world)]
    return UnitExchange(spec.name, spec.world, S, tuple(per_owner), float(plan.fraction), float(plan.ratio),
                        int(plan.seed), bool(union))


def _split(x: jax.Array, selected: tuple[tuple[int, int], ...], size: int) -> tuple[jax.Array, jax.Array]:
    """(compressed, dense) elements of one owner slice `x` [size], each in slice order."""
    sel, dense, at = [], [], 0
    for lo, hi in selected:
        dense.append(x[at:lo])
        sel.append(x[lo:hi])
        at = hi
    dense.append(x[at:size])
    cat = lambda parts: jnp.concatenate(parts) if parts else x[:0]
    return cat(sel), cat(dense)


def _merge(sel: jax.Array, dense: jax.Array, selected: tuple[tuple[int, int], ...], size: int) -> jax.Array:
    """The inverse of `_split` (reads only the prefixes of `sel` and `dense` it needs)."""
    parts, at, i, j = [], 0, 0, 0
    for lo, hi in selected:
        parts += [dense[j:j + lo - at], sel[i:i + hi - lo]]
        j, i, at = j + lo - at, i + hi - lo, hi
    parts.append(dense[j:j + size - at])
    return jnp.concatenate(parts)


def or_scatter(bitmaps: jax.Array, axis: str) -> jax.Array:
    """bitmaps uint32 [W, words] (row d: this rank's bitmap of owner d's slice) -> the bitwise OR
    over all ranks of their row for my slice, uint32 [words]. Inside shard_map over `axis`."""
    got = jax.lax.all_to_all(bitmaps, axis, split_axis=0, concat_axis=0, tiled=True)  # row s: from rank s
    return jax.lax.reduce(got, np.uint32(0), jax.lax.bitwise_or, (0,))


def compressed_reduce_scatter(ct: jax.Array, residual: jax.Array, ex: UnitExchange, axis: str):
    """The unit's summed gradient on my shard, with TAGC on the compressed pieces.

    Inside shard_map over the 1-D `axis` of `ex.world` devices.

    Args:
      ct: this rank's cotangent of the whole unit, [W * S].
      residual: float32 [ex.residual_size], what this rank has not yet sent of every owner slice's
        compressed elements (owner 0's first; zeros at first).

    Returns:
      ``(shard, residual, counts)``: the sum over ranks of my slice, float32 [S] (compressed
      elements decoded from the summed sketch); this rank's next residual; int32 [3]: elements of my
      slice decoded by peeling and by the median estimate, and elements this rank kept (sent) of
      all owner slices.
    """
    W, S, n = ex.world, ex.shard, ex.counts
    if ct.shape != (W * S,):
        raise ValueError(f"unit {ex.unit!r}: cotangent of shape {ct.shape}, the exchange wants ({W * S},)")
    if residual.shape != (ex.residual_size,):
        raise ValueError(f"unit {ex.unit!r}: residual of shape {residual.shape}, the exchange wants "
                         f"({ex.residual_size},)")
    N, M = ex.n_max, ex.dense_max
    dense_rows, bitmaps, sketches, residuals, at = [], [], [], [], 0
    kept_n = jnp.zeros((), jnp.int32)
    for d in range(W):
        sel, dense = _split(ct[d * S:(d + 1) * S], ex.selected[d], S)
        dense_rows.append(jnp.pad(dense, (0, M - dense.size)))
        if n[d]:
            kept, res, bm = sketch_sparsify(sel, residual[at:at + n[d]], fraction=ex.fraction)
            kept_n = kept_n + jnp.sum(jax.lax.population_count(bm)).astype(jnp.int32)
            sketches.append(sketch_build(kept, bm, width=ex.width, seed=ex.seed))
            bitmaps.append(jnp.pad(bm, (0, ex.words - bm.size)))
            residuals.append(res)
            at += n[d]
        elif N:
            sketches.append(jnp.zeros((ROWS, ex.width), jnp.float32))
            bitmaps.append(jnp.zeros((ex.words,), jnp.uint32))
    dense_sum = (jax.lax.psum_scatter(jnp.stack(dense_rows), axis, scatter_dimension=0, tiled=True)[0]
                 if M else jnp.zeros((0,), ct.dtype)).astype(jnp.float32)
    if not N:
        return dense_sum, residual, jnp.zeros((3,), jnp.int32)
    index = or_scatter(jnp.stack(bitmaps), axis)
    sketch = jax.lax.psum_scatter(jnp.stack(sketches), axis, scatter_dimension=0, tiled=True)[0]
    decoded, counts = sketch_peel(sketch, index, n=N, seed=ex.seed)
    shard = jax.lax.switch(jax.lax.axis_index(axis),
                           [lambda v, g, d=d: _merge(v, g, ex.selected[d], S) for d in range(W)],
                           decoded, dense_sum)
    return shard, jnp.concatenate(residuals), jnp.concatenate([counts, kept_n[None]])
