"""Unit stages: how a model's loss runs over parameter shards, each unit gathered inside its own
rematerialised stage (FSDP memory semantics). Both trainers and every Program build on it; the
gather is the only thing a communication mode changes.

Loss of a microbatch = sum of per-token losses / global token count of the minibatch, so summing
the microbatch gradients of all ranks gives the exact minibatch gradient however it was split.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxodc.modeling.units import Layout, UnitSpec, gathered_params

# gather(local_shard [Kp/W] fp32, spec, gather_arg) -> full unit [Kp], or the unit cut into its flat leaves
# (spec.leaf_pieces()); differentiable, its VJP delivers the cotangent to the owners. gather_arg: per-call
# traced data the comm needs (ODC: the version), or None.
GatherFn = Callable[[jax.Array, UnitSpec, Any], jax.Array]


def remat_stage(fn: Callable) -> Callable:
    """fn(shard, carry, batch, gather_arg) -> carry, with FSDP memory semantics.

    Like jax.checkpoint (only the stage inputs are kept for the backward pass; the gathered unit
    is recomputed there), plus ordering: a gather depends only on a parameter shard, so XLA is
    free to hoist every unit's gather to the start of the program (it does, on CPU), keeping all
    gathered units alive at once. Optimization barriers tie the forward gather to the previous
    stage's output and the backward re-gather to the incoming cotangent, so at most a couple of
    gathered units are alive at any time."""

    @jax.custom_vjp
    def stage(shard, carry, batch, gather_arg):
        shard, carry = jax.lax.optimization_barrier((shard, carry))
        return fn(shard, carry, batch, gather_arg)

    def fwd(shard, carry, batch, gather_arg):
        return stage(shard, carry, batch, gather_arg), (shard, carry, batch, gather_arg)

    def bwd(res, ct):
        shard, carry, batch, gather_arg = res
        shard, carry, ct = jax.lax.optimization_barrier((shard, carry, ct))
        _, vjp = jax.vjp(lambda s, c: fn(s, c, batch, gather_arg), shard, carry)
        d_shard, d_carry = vjp(ct)
        zeros = lambda t: jax.tree_util.tree_map(
            lambda x: jnp.zeros(x.shape, jax.dtypes.float0) if not jnp.issubdtype(x.dtype, jnp.inexact)
            else jnp.zeros_like(x), t)
        return d_shard, d_carry, zeros(batch), zeros(gather_arg)

    stage.defvjp(fwd, bwd)
    return stage


def sharded_loss(model, layout: Layout, gather: GatherFn, shards: dict, batch: dict, global_tokens,
                 gather_arg=None) -> jax.Array:
    """Loss of one microbatch from local shards: each unit gathered inside its own remat'd stage."""
    carry = None
    for spec in layout.units:
        def stage(shard, carry, batch, gather_arg, spec=spec):
            return model.apply_unit(spec.name, gathered_params(spec, gather(shard, spec, gather_arg)), carry, batch)

        carry = remat_stage(stage)(shards[spec.name], carry, batch, gather_arg)
    return jnp.sum(carry) / global_tokens


def microbatch_grad(model, layout: Layout, gather: GatherFn):
    """fn(shards, batch, global_tokens, gather_arg) -> (loss, grads w.r.t. local shards)."""
    return jax.value_and_grad(lambda s, b, n, c: sharded_loss(model, layout, gather, s, b, n, c))
