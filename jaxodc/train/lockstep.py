"""The collective trainer's gather and scalar sums over jaxodc's lock-step transport
(`comm.lockstep.LockstepGroup`, `CollectiveTrainer(transport="jaxodc")`): what gloo's all-gather,
reduce-scatter and psum are to `train.collective.collective_gather`."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxodc.modeling.staging import GatherFn

GATHER_SCOPE = "jaxodc_gather_u"  # + the unit's index: the name scope of a per_leaf unit's all-gathers
# (gloo's or the lock-step transport's)


def lockstep_gather(group, channels: dict[str, list[tuple[int, int, int]]]) -> GatherFn:
    """`collective_gather` over a `LockstepGroup`: unit name -> its channels, one (forward gather,
    backward re-gather, reduce-scatter) triple per leaf of a per_leaf unit (train.units), one for a
    contiguous unit; all-gather forward, reduce-scatter (the sum over ranks, in rank order)
    backward. A per_leaf unit travels one leaf at a time, as `collective_gather`'s does (neither the
    flat unit nor its flat gradient is built). The unit travels and is returned in the channels'
    dtype (bfloat16 under mixed precision, as `collective_gather`'s compute dtype); the shard's
    gradient comes back in float32.

    The forward pass's gather (the custom_vjp's primal) and the backward pass's re-gather (its fwd
    rule, which staging.remat_stage's backward runs) use separate channels: nothing orders them (the last
    unit's re-gather needs nothing from its forward), and calls on one channel must not overlap."""
    from jaxodc.ops.lockstep import lockstep_collective

    def unit_gather(spec, chs):
        dtype = jnp.dtype(group.channels[chs[0][0]].dtype)
        cuts = spec.leaf_shards() if spec.per_leaf else ((0, spec.shard),)
        sizes = [n for _, n in spec.leaf_pieces()] if spec.per_leaf else [spec.padded]

        def gather_with(which, shard):
            x, out = shard.astype(dtype), []
            with jax.named_scope(f"{GATHER_SCOPE}{spec.index}"):  # as collective_gather's (bench models)
                for (off, s), n, ch in zip(cuts, sizes, chs):
                    if n == 0:  # an empty parameter: nothing travels
                        out.append(jnp.zeros((0,), dtype))
                        continue
                    g = lockstep_collective(x[off:off + s], group=group, channel=ch[which])
                    out.append(g if g.shape[0] == n else g[:n])
            return tuple(out) if spec.per_leaf else out[0]

        @jax.custom_vjp
        def gather(shard):
            return gather_with(0, shard)

        def fwd(shard):
            return gather_with(1, shard), None

        def bwd(_, cts):
            parts = []
            for ct, (_, s), n, ch in zip(cts if spec.per_leaf else (cts,), cuts, sizes, chs):
                if n == 0:
                    continue
                ct = ct if ct.shape[0] == spec.world * s else jnp.pad(ct, (0, spec.world * s - n))
                parts.append(lockstep_collective(ct.astype(dtype), group=group, channel=ch[2]).astype(jnp.float32))
            tail = spec.shard - sum(s for _, s in cuts)
            if tail:
                parts.append(jnp.zeros((tail,), jnp.float32))
            return (jnp.concatenate(parts) if len(parts) > 1 else parts[0] if parts else jnp.zeros((0,), jnp.float32),)

        gather.defvjp(fwd, bwd)
        return gather

    per_unit: dict = {}

    def gather(shard, spec, ctx):
        if spec.name not in per_unit:  # built per unit at trace time (the spec is static)
            per_unit[spec.name] = unit_gather(spec, channels[spec.name])
        return per_unit[spec.name](shard)

    return gather


LOCKSTEP_SUM_MAX = 4096  # elements of one global sum over the lock-step transport (one call each)


def lockstep_sum(group, channel: int) -> Callable[[jax.Array], jax.Array]:
    """A scalar all-sum over `group`'s reduce channel `channel` (psum's replacement; the channel
    has two elements). Calls on one channel must not overlap, so each call of one traced function
    takes the previous one's result as its second element, a data dependency (XLA's CPU runtime
    drops optimization barriers' ordering): make a fresh one per trace."""
    from jaxodc.ops.lockstep import lockstep_collective

    prev = [jnp.zeros((1,), jnp.float32)]

    def scalar(x):
        y = lockstep_collective(jnp.concatenate([jnp.reshape(x, (1,)).astype(jnp.float32), prev[-1]]),
                                group=group, channel=channel)[:1]
        prev.append(y)
        return y

    def total(x):
        n = int(np.prod(jnp.shape(x)))
        if n > LOCKSTEP_SUM_MAX:
            raise ValueError(f"the lock-step transport sums scalars, one call each; the optimizer needs a global "
                             f"sum of {n} elements (row statistics or a whole parameter gathered): use "
                             f"transport='gloo' for this optimizer")
        flat = jnp.reshape(x, (-1,)).astype(jnp.float32)
        y = jnp.concatenate([scalar(flat[i]) for i in range(n)]) if n else flat
        return jnp.reshape(y, jnp.shape(x)).astype(x.dtype)

    return total
