"""Parameter units: the granularity at which parameters are sharded, gathered and updated.

A Flax param tree of a staged model is a dict {unit name: subtree} (one unit per transformer block,
plus embedding and head; one per MLP layer). Each unit is flattened (leaves in jax tree order,
row-major) to K fp32 elements, zero-padded to Kp = a multiple of W, and rank d owns elements
[d*Kp/W, (d+1)*Kp/W). Padding elements stay exactly zero: their gradient is zero (unflatten ignores
them), so any elementwise optimizer leaves them at zero.

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

    @property
    def shard(self) -> int:
        return self.padded // self.world

    def shard_range(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.world:
            raise ValueError(f"unit {self.name!r}: rank {rank} outside world of {self.world}")
        return rank * self.shard, (rank + 1) * self.shard

    def leaf_pieces(self) -> tuple[tuple[int, int], ...]:
        """(offset, size) of every leaf in the flat unit, in leaf order."""
        out, o = [], 0
        for shp in self.shapes:
            n = math.prod(shp)
            out.append((o, n))
            o += n
        return tuple(out)

    def describe(self) -> dict:
        return {"name": self.name, "index": self.index, "numel": self.numel, "padded": self.padded,
                "leaves": [[p, list(s), d] for p, s, d in zip(self.paths, self.shapes, self.dtypes)]}


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

    def fingerprint(self) -> str:
        """Stable hex digest of world size, unit order, leaf paths, shapes and dtypes: equal on
        every rank iff all ranks built the same layout."""
        doc = {"world": self.world, "units": [u.describe() for u in self.units]}
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def make_layout(params: Mapping[str, Any], world: int, order: Sequence[str] | None = None,
                align: int = 1) -> Layout:
    """One unit per top-level key of `params` (in `order`, default: dict order). Kp is a multiple
    of world * align. Leaves may be arrays or jax.ShapeDtypeStruct (e.g. from jax.eval_shape), so
    a layout needs no materialised parameters."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
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
        m = world * align
        units.append(UnitSpec(name, i, paths, shapes, dtypes, treedef, K, -(-K // m) * m, world))
    return Layout(tuple(units), world)


def flatten_unit(spec: UnitSpec, tree) -> jax.Array:
    """Unit subtree -> fp32 vector of length Kp (zero padded). Traceable."""
    leaves = jax.tree_util.tree_leaves(tree)
    if len(leaves) != len(spec.shapes):
        raise ValueError(f"unit {spec.name!r}: got {len(leaves)} leaves, layout has {len(spec.shapes)}")
    for leaf, shp, path in zip(leaves, spec.shapes, spec.paths):
        if tuple(np.shape(leaf)) != shp:
            raise ValueError(f"unit {spec.name!r} leaf {path}: shape {tuple(np.shape(leaf))} != layout {shp}")
    flat = jnp.concatenate([jnp.ravel(jnp.asarray(x, jnp.float32)) for x in leaves])
    return jnp.pad(flat, (0, spec.padded - spec.numel))


def unflatten_unit(spec: UnitSpec, flat, dtype=None, compute_dtype=None) -> Any:
    """fp32 vector of length K or Kp -> unit subtree (leaves cast to `dtype` or their own; with
    `compute_dtype`, the float leaves to it instead -- mixed precision computes in it). `flat` may
    also be the unit already cut at `spec.leaf_pieces()` (a tuple of flat leaves)."""
    if isinstance(flat, (tuple, list)):
        sizes = [n for _, n in spec.leaf_pieces()]
        if [int(np.size(x)) for x in flat] != sizes:
            raise ValueError(f"unit {spec.name!r}: pieces of sizes {[int(np.size(x)) for x in flat]}, expected {sizes}")
        pieces = flat
    elif flat.shape not in ((spec.numel,), (spec.padded,)):
        raise ValueError(f"unit {spec.name!r}: flat shape {flat.shape}, expected ({spec.numel},) or ({spec.padded},)")
    else:
        pieces = [flat[o:o + n] for o, n in spec.leaf_pieces()]

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
