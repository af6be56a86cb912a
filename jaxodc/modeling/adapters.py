"""Flax linen and nnx models reduced to a plain `loss_fn(tree, batch)` over one pytree, which
discover.py plans and gather_on_use.py stages. Only the "params" collection (linen) / nnx.Param
variables (nnx) train; every other collection or variable (BatchNorm statistics, RNG keys and
counters, buffers) is planned as a constant: kept whole on every rank, no gradient. The loss
function says so itself (its `frozen` attribute: path patterns that discover_units freezes, which
the sharded trainers add to any `frozen=` of their own), so nothing outside the parameters trains
whatever the caller passes.

Dropout and other randomness: the batch carries one key under "rng", split over the named streams
(`rngs=`). `microbatch_key` is the key of one microbatch of one step, which `Trainer` puts in every
packed batch of a loss that names streams: the same wherever the microbatch runs (any rank, a
steal, the collective), so the masks are those one process draws for it. An nnx model that draws
from its own stored key instead (no `rngs=`: the same mask on every call) is refused when traced.
Mutable state (BatchNorm in training): the loss
returns (output, new state) with the state keyed like the tree ({"batch_stats": ...} / {"state":
...}); the sharded trainers write the count-weighted mean over the minibatch's microbatches back
(train.state; `axis_name` cannot span processes, so statistics are per microbatch).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np

RNG_KEY = "rng"


def microbatch_key(seed: int, step: int, sample_ids: Sequence[int]) -> np.ndarray:
    """The key data (uint32[2], a raw PRNG key) of the microbatch of minibatch `step` that holds the
    samples `sample_ids` (indices within the minibatch; none: an all-padding microbatch): it
    depends on which samples, not on the rank or position that runs them."""
    first = min(sample_ids) if len(sample_ids) else -1
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), step), first & 0xFFFFFFFF)
    return np.asarray(key, np.uint32)


def _stream_keys(batch, streams: Sequence[str], who: str) -> dict:
    if not streams:
        return {}
    if not isinstance(batch, Mapping) or RNG_KEY not in batch:
        raise ValueError(f"{who} draws random numbers from streams {list(streams)}: put a PRNG key in the batch "
                         f"under {RNG_KEY!r}, one per step and microbatch (microbatch_key; Trainer does); it is "
                         f"split per stream")
    return {s: jax.random.fold_in(batch[RNG_KEY], i) for i, s in enumerate(streams)}


# Path patterns (discover_units(frozen=...)) of every linen collection but "params", and of nnx's
# non-parameter variables.
LINEN_FROZEN = ("re:(?!params/).*",)
NNX_FROZEN = ("state/*",)


def frozen_collections(variables: Mapping) -> tuple[str, ...]:
    """Path patterns (discover_units(frozen=...)) of every linen collection but "params"."""
    return tuple(f"{c}/*" for c in variables if c != "params")


def linen_loss_fn(module, loss: Callable[[Callable, Any], Any], *, rngs: Sequence[str] = (),
                  mutable: Sequence[str] = ()) -> Callable:
    """A linen module's loss as loss_fn(variables, batch), the module unchanged.

    Args:
      module: any flax.linen Module (nn.compact or setup, nn.scan / nn.remat inside, shared
        submodules).
      loss: loss(apply, batch) -> loss or any pytree (e.g. (loss, aux)); `apply(*args, **kwargs)`
        stands for `module.apply(variables, *args, **kwargs)` and may be called more than once
        (mutable state threads through the calls; `method=` passes through).
      rngs: the rng streams the module draws in training (e.g. ("dropout",)); from batch["rng"].
      mutable: collections the module updates (e.g. ("batch_stats",)); loss_fn then returns
        (loss's output, {collection: new value}).

    Returns:
      loss_fn(variables, batch): `variables` is the module's whole variables dict; plan it with
      discover_units(variables, world, frozen=frozen_collections(variables)).
    """
    import flax.errors

    def loss_fn(variables, batch):
        state = {c: v for c, v in variables.items()}
        keys = _stream_keys(batch, rngs, f"linen module {type(module).__name__}")

        def apply(*args, **kwargs):
            try:
                out = module.apply(state, *args, rngs=keys or None, mutable=list(mutable) or False, **kwargs)
            except flax.errors.InvalidRngError as e:
                raise ValueError(f"linen module {type(module).__name__} needs an rng stream it was not given; pass "
                                 f"its name in rngs=(...) and a key in batch[{RNG_KEY!r}] ({e})") from e
            except flax.errors.ModifyScopeVariableError as e:
                raise ValueError(f"linen module {type(module).__name__} updates a collection that is not mutable; "
                                 f"name it in mutable=(...) and write the returned value back ({e})") from e
            if mutable:
                out, updates = out
                state.update(updates)
            return out

        out = loss(apply, batch)
        return (out, {c: state[c] for c in mutable}) if mutable else out

    loss_fn.frozen, loss_fn.rng_streams = LINEN_FROZEN, tuple(rngs)
    return loss_fn


def nnx_loss_fn(model, loss: Callable[[Any, Any], Any], *, rngs: Sequence[str] = (),
                mutable: Any = False) -> tuple[Callable, dict]:
    """An nnx model's loss as loss_fn(tree, batch), the model unchanged.

    Args:
      model: any flax.nnx Module (its current values become the initial tree).
      loss: loss(model, batch) -> loss or any pytree; `model` is a fresh merge of the tree.
      rngs: nnx.Rngs streams to reseed from batch["rng"] on every call (e.g. ("dropout",));
        without it a functional call would draw the same dropout mask every step.
      mutable: return (loss's output, {"state": new values}): True for every non-parameter
        variable (BatchNorm statistics, rng counters), or an nnx filter of the ones to return
        (nnx.BatchStat: the statistics only, what the sharded trainers average).

    Returns:
      (loss_fn, tree) with tree = {"params": nnx.Param values, "state": every other variable} as
      pure dicts; plan it with discover_units(tree, world, frozen=("state/*",)).
    """
    from flax import nnx

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tree = {"params": nnx.to_pure_dict(params), "state": nnx.to_pure_dict(rest)}

    def loss_fn(tree, batch):
        p, r = jax.tree_util.tree_map(lambda x: x, (params, rest))  # fresh States to fill
        nnx.replace_by_pure_dict(p, tree["params"])
        nnx.replace_by_pure_dict(r, tree["state"])
        m = nnx.merge(graphdef, p, r)
        keys = _stream_keys(batch, rngs, f"nnx model {type(model).__name__}")
        if keys:
            nnx.reseed(m, **keys)
        counts = jax.tree_util.tree_leaves_with_path(nnx.state(m, nnx.RngCount))
        out = loss(m, batch)
        drawn = [jax.tree_util.keystr(p, simple=True, separator="/") for (p, x), y in
                 zip(counts, jax.tree_util.tree_leaves(nnx.state(m, nnx.RngCount))) if x is not y]
        if drawn and not keys:  # its stored key, the same on every call: the same mask every time
            raise ValueError(f"nnx model {type(model).__name__} draws random numbers from its own stored key "
                             f"({', '.join(drawn)}): every call, microbatch, step and rank would get the same "
                             f"dropout mask. Name the streams in nnx_loss_fn(rngs=(...)), e.g. rngs=('dropout',), "
                             f"and put a key in batch[{RNG_KEY!r}] (Trainer does: microbatch_key)")
        if mutable is True:
            return out, {"state": nnx.to_pure_dict(nnx.split(m, nnx.Param, ...)[2])}
        if mutable is not False:
            return out, {"state": nnx.to_pure_dict(nnx.state(m, mutable))}
        return out

    loss_fn.frozen, loss_fn.rng_streams = NNX_FROZEN, tuple(rngs)
    return loss_fn, tree
