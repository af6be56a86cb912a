"""Parameter units: the granularity at which parameters are sharded, gathered and updated.

A Flax param tree of a staged model is a dict {unit name: subtree} (one unit per transformer block,
plus embedding and head; one per MLP layer). Each unit is flattened (leaves in jax tree order,
row-major) to K fp32 elements, zero-padded to Kp = a multiple of W, and rank d owns elements
[d*Kp/W, (d+1)*Kp/W). Padding elements stay exactly zero: their gradient is zero (unflatten ignores
them), so any elementwise optimizer leaves them at zero.

Two shardings of a unit (`UnitSpec.sharding`), both with that flat vector of Kp elements in which
rank d owns [d*S, (d+1)*S), S = Kp/W (so `shard_range`, `shard`, `padded` and every consumer of
them hold for both; only `flatten_unit` / `unflatten_unit` / `leaf_shards` know the order):

* "contiguous" (ODC's): the leaves concatenated, then padded; a leaf may straddle two ranks' shards.
* "per_leaf" (FSDP2's per-parameter sharding; the collective trainer's): leaf i of n_i elements is
  padded to W*s_i, s_i = ceil(n_i/W), and rank d's shard is the concatenation over leaves of their
  d-th slices [d*s_i, (d+1)*s_i) (then zeros up to S when `align` asks for more). The flat vector
  is the ranks' shards one after the other. Why: a collective can then gather each parameter into
  a buffer of its own (`all_gather` of the shard's [off_i, off_i + s_i)) and reduce-scatter each
  parameter's cotangent on its own, never materialising the flat unit or its concatenated
  gradient -- on XLA:CPU, cutting leaves out of a gathered flat unit at non-zero offsets copies
  them, so the flat form costs about one more unit of temporaries per stage than ODC's one buffer
  per parameter (bench/RESULTS.md, "Every example model"). The two kinds
  have different fingerprints, so checkpoints of one cannot be loaded into the other unnoticed.

`UnitSpec` and `Layout` hold only static Python data (names, shapes, sizes), so they can be closed
over inside `jax.jit`; `flatten_unit` / `unflatten_unit` are traceable."""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np


class StagedModel:
    """The unit protocol the trainer runs: `unit_names` (run order) and
    `apply_unit(name, params, carry, batch) -> carry`, the first unit receiving carry None and the
    last returning per-token losses. Subclasses get the unsharded forms used by references."""

    unit_names: tuple[str, ...]

    def apply_unit(self, name: str, params, carry, batch):
        raise NotImplementedError

    def token_losses(self, params: Mapping[str, Any], batch) -> jax.Array:
        carry = None
        for name in self.unit_names:
            carry = self.apply_unit(name, params[name], carry, batch)
        return carry

    def loss_sum(self, params: Mapping[str, Any], batch) -> jax.Array:
        return jnp.sum(self.token_losses(params, batch))


@dataclass(frozen=True)
class UnitSpec:
    name: str
    index: int
    paths: tuple[str, ...]              # leaf paths inside the unit, jax tree order
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    treedef: Any
    numel: int                          # K
    padded: int                         # Kp, multiple of world
    world: int
    sharding: str = "contiguous"        # or "per_leaf" (module docstring)

    @property
    def shard(self) -> int:
        return self.padded // self.world

    def shard_range(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world:
            raise ValueError(f"unit {self.name!r}: rank {rank} outside world of {self.world}")
        return rank * self.shard, (rank + 1) * self.shard

    @property
    def per_leaf(self) -> bool:
        return self.sharding == "per_leaf"

    def leaf_pieces(self) -> tuple[tuple[int, int], ...]:
        """(offset, size) of every leaf in the leaves' concatenation (K elements), in leaf order:
        under the contiguous sharding, where each leaf lies in the flat unit; under per_leaf, the
        leaf's identity only (the pieces a gather may return, what compression plans address)."""
        out, o = [], 0
        for shp in self.shapes:
            n = math.prod(shp)
            out.append((o, n))
            o += n
        return tuple(out)

    def leaf_shards(self) -> tuple[tuple[int, int], ...]:
        """per_leaf: (offset, size s_i) of every leaf's slice in each rank's shard, in leaf order;
        rank d's slice holds elements [d*s_i, (d+1)*s_i) of the leaf (zeros past its end)."""
        if not self.per_leaf:
            raise ValueError(f"unit {self.name!r}: leaf_shards needs the per_leaf sharding, this one is {self.sharding!r}")
        out, o = [], 0
        for shp in self.shapes:
            s = -(-math.prod(shp) // self.world)
            out.append((o, s))
            o += s
        return tuple(out)

    def local_ranges(self, rank: int, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
        """[a, b) ranges of rank `rank`'s shard holding elements [lo, hi) of the leaves'
        concatenation (leaf_pieces' coordinates), in increasing order."""
        a0, b0 = self.shard_range(rank)
        if not self.per_leaf:
            a, b = max(lo, a0), min(hi, b0)
            return ((a - a0, b - a0),) if a < b else ()
        out = []
        for (o, n), (off, s) in zip(self.leaf_pieces(), self.leaf_shards()):
            # the leaf's elements [x, y) that are in [lo, hi), then those that rank holds
            x, y = max(lo, o) - o, min(hi, o + n) - o
            x, y = max(x, rank * s), min(y, (rank + 1) * s)
            if x < y:
                out.append((off + x - rank * s, off + y - rank * s))
        return tuple(out)

    def describe(self) -> dict:
        d = {"name": self.name, "index": self.index, "numel": self.numel, "padded": self.padded,
             "leaves": [[p, list(s), d] for p, s, d in zip(self.paths, self.shapes, self.dtypes)]}
        if self.per_leaf:  # contiguous layouts keep the fingerprints they always had
            d["sharding"] = self.sharding
        return d


@dataclass(frozen=True)
class Layout:
    units: tuple[UnitSpec, ...]
    world: int

    def __getitem__(self, name: str) -> UnitSpec:
        for u in self.units:
            if u.name == name:
                return u
        raise KeyError(f"no unit named {name!r}; units: {self.names}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(u.name for u in self.units)

    @property
    def largest(self) -> int:
        return max(u.padded for u in self.units)

    @property
    def sharding(self) -> str:
        """The units' sharding ("contiguous", "per_leaf", or "mixed")."""
        kinds = {u.sharding for u in self.units}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def fingerprint(self) -> str:
        """Stable hex digest of world size, unit order, leaf paths, shapes and dtypes: equal on
        every rank iff all ranks built the same layout."""
        doc = {"world": self.world, "units": [u.describe() for u in self.units]}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


SHARDINGS = ("contiguous", "per_leaf")


def padded_size(shapes: Sequence[tuple[int, ...]], world: int, align: int = 1, sharding: str = "contiguous") -> int:
    """Kp of a unit of leaves `shapes`: a multiple of world * align; under per_leaf, at least the
    sum of the leaves each padded to a multiple of world."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    m = world * align
    if sharding == "per_leaf":
        K = world * sum(-(-math.prod(s) // world) for s in shapes)
    else:
        K = sum(math.prod(s) for s in shapes)
    return int(-(-K // m) * m)


def make_layout(params: Mapping[str, Any], world: int, order: Sequence[str] | None = None,
                align: int = 1, sharding: str = "contiguous") -> Layout:
    """One unit per top-level key of `params` (in `order`, default: dict order). Kp is a multiple
    of world * align. Leaves may be arrays or jax.ShapeDtypeStruct (e.g. from jax.eval_shape), so
    a layout needs no materialised parameters. `sharding`: "contiguous" or "per_leaf" (module
    docstring)."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding must be one of {SHARDINGS}, got {sharding!r}")
    order = list(order if order is not None else params.keys())
    missing = [n for n in order if n not in params]
    if missing or len(set(order)) != len(order):
        raise ValueError(f"unit order {order} does not match param keys {list(params.keys())}")
    units = []
    for i, name in enumerate(order):
        flat, treedef = jax.tree_util.tree_flatten_with_path(params[name])
        if not flat:
            raise ValueError(f"unit {name!r} has no parameters")
        paths = tuple(_path_str(p) for p, _ in flat)
        shapes = tuple(tuple(int(d) for d in np.shape(x)) for _, x in flat)
        dtypes = tuple(str(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype) for _, x in flat)
        K = int(sum(math.prod(s) for s in shapes))
        units.append(UnitSpec(name, i, paths, shapes, dtypes, treedef, K,
                              padded_size(shapes, world, align, sharding), world, sharding))
    return Layout(tuple(units), world)


def flatten_unit(spec: UnitSpec, tree) -> jax.Array:
    """Unit subtree -> fp32 vector of length Kp (zero padded). Traceable."""
    leaves = jax.tree_util.tree_leaves(tree)
    if len(leaves) != len(spec.shapes):
        raise ValueError(f"unit {spec.name!r}: got {len(leaves)} leaves, layout has {len(spec.shapes)}")
    for leaf, shp, path in zip(leaves, spec.shapes, spec.paths):
        if tuple(np.shape(leaf)) != shp:
            raise ValueError(f"unit {spec.name!r} leaf {path}: shape {tuple(np.shape(leaf))} != layout {shp}")
    return flat_from_pieces(spec, [jnp.ravel(jnp.asarray(x, jnp.float32)) for x in leaves])


def flat_from_pieces(spec: UnitSpec, pieces: Sequence[jax.Array]) -> jax.Array:
    """The unit's flat vector [Kp] (in the pieces' dtype) from its leaves as flat pieces
    (leaf_pieces' sizes), in the spec's sharding order. Traceable."""
    if not spec.per_leaf:
        return jnp.pad(jnp.concatenate(pieces), (0, spec.padded - spec.numel))
    W, S = spec.world, spec.shard
    cols = [jnp.pad(x, (0, W * s - n)).reshape(W, s) for x, (_, n), (_, s) in zip(pieces, spec.leaf_pieces(), spec.leaf_shards())]
    tail = S - sum(s for _, s in spec.leaf_shards())
    if tail:
        cols.append(jnp.zeros((W, tail), pieces[0].dtype))
    return jnp.concatenate(cols, axis=1).reshape(-1)


def leaf_views(spec: UnitSpec, flat: jax.Array) -> list[jax.Array]:
    """The flat unit [Kp] (or, contiguous only, [K]) cut into its leaves as flat pieces."""
    if not spec.per_leaf:
        return [flat[o:o + n] for o, n in spec.leaf_pieces()]
    rows = flat.reshape(spec.world, spec.shard)
    return [rows[:, off:off + s].reshape(-1)[:n] for (_, n), (off, s) in zip(spec.leaf_pieces(), spec.leaf_shards())]


def unflatten_unit(spec: UnitSpec, flat, dtype=None, compute_dtype=None) -> Any:
    """fp32 vector of length Kp (or K, contiguous sharding only) -> unit subtree (leaves cast to
    `dtype` or their own; with `compute_dtype`, the float leaves to it instead -- mixed precision
    computes in it). `flat` may also be the unit already cut at `spec.leaf_pieces()` (a tuple of
    flat leaves), whatever the sharding."""
    if isinstance(flat, (tuple, list)):
        sizes = [n for _, n in spec.leaf_pieces()]
        if [int(np.size(x)) for x in flat] != sizes:
            raise ValueError(f"unit {spec.name!r}: pieces of sizes {[int(np.size(x)) for x in flat]}, expected {sizes}")
        pieces = flat
    elif spec.per_leaf and flat.shape != (spec.padded,):
        raise ValueError(f"unit {spec.name!r} (per_leaf sharding): flat shape {flat.shape}, expected ({spec.padded},)")
    elif flat.shape not in ((spec.numel,), (spec.padded,)):
        raise ValueError(f"unit {spec.name!r}: flat shape {flat.shape}, expected ({spec.numel},) or ({spec.padded},)")
    else:
        pieces = leaf_views(spec, flat)

    def cast(dt):
        if compute_dtype is not None and jnp.issubdtype(jnp.dtype(dt), jnp.floating):
            return compute_dtype
        return dtype or dt
    return jax.tree_util.tree_unflatten(
        spec.treedef, [x.reshape(shp).astype(cast(dt)) for x, shp, dt in zip(pieces, spec.shapes, spec.dtypes)])


def gathered_params(spec: UnitSpec, gathered) -> Any:
    """A gather's result (flat, or cut into leaves) as the unit's subtree, its float leaves in the
    dtype the unit was gathered in (the compute dtype: fp32, or bf16 under mixed precision)."""
    first = gathered[0] if isinstance(gathered, (tuple, list)) else gathered
    return unflatten_unit(spec, gathered, compute_dtype=first.dtype)


def shard_params(layout: Layout, params: Mapping[str, Any], rank: int) -> dict[str, np.ndarray]:
    """This rank's fp32 shard of every unit (numpy)."""
    out = {}
    for u in layout.units:
        a, b = u.shard_range(rank)
        out[u.name] = np.asarray(flatten_unit(u, params[u.name]))[a:b].copy()
    return out


def unshard_params(layout: Layout, shards: Sequence[Mapping[str, np.ndarray]]) -> dict[str, Any]:
    """Reassemble full params from every rank's shards (shards[rank][unit])."""
    if len(shards) != layout.world:
        raise ValueError(f"need shards from {layout.world} ranks, got {len(shards)}")
    out = {}
    for u in layout.units:
        parts = []
        for r, s in enumerate(shards):
            x = np.asarray(s[u.name])
            if x.shape != (u.shard,):
                raise ValueError(f"rank {r} unit {u.name!r}: shard shape {x.shape} != ({u.shard},)")
            parts.append(x)
        out[u.name] = jax.tree_util.tree_map(np.asarray, unflatten_unit(u, jnp.asarray(np.concatenate(parts))))
    return out
