"""Mutable model state (BatchNorm's `batch_stats`) in the sharded trainers.

A loss with state returns `(summed loss, new state)`, the new state a dict keyed like the parameter
tree holding the leaves it updates (`linen_loss_fn(mutable=("batch_stats",))` returns
`{"batch_stats": ...}`, `nnx_loss_fn(mutable=nnx.BatchStat)` `{"state": ...}`). Those leaves are
constants: kept whole on every rank, never trained.

Ranks run uneven numbers of microbatches (under work stealing nobody knows in advance who runs
which), so a minibatch's new state must not depend on that: every microbatch computes its update
from the state at the start of the minibatch, and the new state is the mean of the microbatches'
returned states weighted by their count (the same count the loss is normalised by: loss tokens,
or samples). BatchNorm's running average is linear in the batch statistics, so this is one EMA
step with the count-weighted mean of the microbatch statistics.

The trainers sum `weighted(new state, batch)` = [count * leaf..., count] (fp32) over their
microbatches and over ranks, then `updated` divides by the summed count. Only float leaves are
averaged: a non-float leaf (an nnx RNG counter, a step count) is refused, naming it, because no
mean of it is meaningful.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxodc.modeling.discover import _leaves, _path_str


def default_count(batch) -> jax.Array:
    """The microbatch's count: sum of batch["loss_mask"] (packed tokens) or batch["mask"] (samples)."""
    for key in ("loss_mask", "mask"):
        if isinstance(batch, Mapping) and key in batch:
            return jnp.sum(jnp.asarray(batch[key], jnp.float32))
    raise ValueError("a loss with mutable state weights each microbatch's new state by its count; the batch has "
                     "neither 'loss_mask' nor 'mask': pass count_fn=(batch -> the count the loss sums over)")


def _flat(tree) -> dict[str, Any]:
    return {_path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def state_paths(out, params) -> tuple[str, ...] | None:
    """The parameter-tree paths of the state leaves a loss returns, None for a loss returning its
    scalar alone; raises for any other output, saying what to change.

    Args:
      out: the loss's output (arrays or jax.ShapeDtypeStruct, e.g. from jax.eval_shape).
      params: the parameter tree.
    """
    if _is_scalar(out):
        return None
    if not (isinstance(out, tuple) and len(out) == 2 and _is_scalar(out[0])):
        raise TypeError(
            f"loss_fn must return one float scalar, the SUM of its per-token (or per-sample) losses over the "
            f"microbatch, or (that sum, new state); got {_describe(out)}. jaxodc divides by the minibatch's global "
            "count (ranks run uneven microbatches, so a per-microbatch mean would weight them wrongly)")
    aux = out[1]
    known = {path: x for _, path, x in _leaves(params)[0]}
    leaves = _flat(aux) if isinstance(aux, Mapping) else {}
    missing = [p for p in leaves if p not in known]
    if not isinstance(aux, Mapping) or not leaves or missing:
        raise TypeError(
            "loss_fn returned (loss, aux) with aux not the new value of parameter-tree leaves "
            + (f"(no leaf of the tree at {missing[:3]}); " if missing else f"({_describe(aux)}); ")
            + "the sharded trainers take aux only as mutable state: a dict keyed like the parameter tree (linen: "
            "linen_loss_fn(mutable=('batch_stats',)); nnx: nnx_loss_fn(mutable=nnx.BatchStat)). Metrics are not "
            "summed across ranks: return the loss alone and compute metrics from the exported parameters")
    for path, x in leaves.items():
        ref = known[path]
        if tuple(np.shape(x)) != tuple(np.shape(ref)) or _dtype(x) != _dtype(ref):
            raise TypeError(f"state leaf {path!r}: loss_fn returns {_describe(x)}, the parameter tree "
                            f"holds {_dtype(ref)}{list(np.shape(ref))}; the new state must keep shape and dtype")
        if not jnp.issubdtype(_dtype(ref), jnp.floating):
            raise TypeError(f"state leaf {path!r} is {_dtype(ref)}: only float state is averaged over microbatches "
                            "(a count or RNG counter has no meaningful mean); return float leaves only (nnx: "
                            "mutable=nnx.BatchStat instead of True)")
    return tuple(leaves)


def _dtype(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def _is_scalar(x) -> bool:
    return hasattr(x, "shape") and tuple(x.shape) == () and jnp.issubdtype(_dtype(x), jnp.floating)


def _describe(x) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{_dtype(x)}{list(x.shape)}"
    return jax.tree_util.tree_structure(x).__repr__()[:200]


@dataclass(frozen=True)
class ModelState:
    """Where a loss's state leaves live among a Program's constants and how they are averaged.

    Attributes:
      paths: the state leaves' paths, in the order of the loss's returned state.
      consts: each one's position in Program.consts.
      shapes, dtypes: each one's shape and dtype.
      count_fn: batch -> the microbatch's count (traced).
    """

    paths: tuple[str, ...]
    consts: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    count_fn: Callable = default_count

    @property
    def size(self) -> int:
        """Elements of the weighted vector: every state element, then the count."""
        return sum(math.prod(s) for s in self.shapes) + 1

    def weighted(self, new_state, batch) -> jax.Array:
        """fp32 [size]: count * each new state leaf, flat, then the count (traced). A microbatch of
        count 0 (padding) adds zeros, whatever its statistics hold (0 * nan would not)."""
        count = jnp.asarray(self.count_fn(batch), jnp.float32)
        got = _flat(new_state)
        flat = jnp.concatenate([jnp.ravel(got[p]).astype(jnp.float32) for p in self.paths] + [jnp.ones(1)])
        return jnp.where(count > 0, count * flat, 0.0)

    def updated(self, consts: tuple, total: np.ndarray) -> tuple:
        """`consts` with the state leaves replaced by the mean in `total` (the weighted vectors
        summed over every microbatch of every rank); unchanged when the count is 0."""
        total = np.asarray(total, np.float64)[:self.size]
        if total[-1] <= 0:
            return consts
        out, at = list(consts), 0
        for i, shape, dtype in zip(self.consts, self.shapes, self.dtypes):
            n = math.prod(shape)
            out[i] = np.asarray((total[at:at + n] / total[-1]).reshape(shape), dtype)
            at += n
        return tuple(out)


def model_state(loss_fn, params, example_batch) -> tuple[str, ...] | None:
    """state_paths of `loss_fn`'s output on (params, example_batch), traced abstractly."""
    return state_paths(jax.eval_shape(loss_fn, params, example_batch), params)


def freeze_patterns(paths) -> tuple[str, ...]:
    """discover_units(frozen=...) patterns matching exactly `paths`."""
    return tuple("re:" + re.escape(p) for p in paths)
