"""Which elements of which leaf a rank's shard of a unit holds, and where (train.units' two
shardings), so a checkpoint can be read into a shard, or written from one, range by range
without ever forming the flat unit."""
from __future__ import annotations

from typing import NamedTuple

from jaxodc.modeling.units import UnitSpec


class Piece(NamedTuple):
    leaf: int       # leaf index in the unit
    lo: int         # the leaf's row-major elements [lo, hi)
    hi: int
    at: int         # their offset in the rank's shard


def owned_pieces(spec: UnitSpec, rank: int) -> list[Piece]:
    """The pieces of rank `rank`'s shard of `spec`, in shard order; the rest of the shard is
    padding (zeros)."""
    a0, b0 = spec.shard_range(rank)
    out = []
    if spec.per_leaf:  # leaf i's elements [rank*s_i, (rank+1)*s_i) at its slot in the shard
        for j, ((_, n), (off, s)) in enumerate(zip(spec.leaf_pieces(), spec.leaf_shards())):
            lo, hi = rank * s, min((rank + 1) * s, n)
            if lo < hi:
                out.append(Piece(j, lo, hi, off))
        return out
    for j, (o, n) in enumerate(spec.leaf_pieces()):
        x, y = max(o, a0), min(o + n, b0)
        if x < y:
            out.append(Piece(j, x - o, y - o, x - a0))
    return out
