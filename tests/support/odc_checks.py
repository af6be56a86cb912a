"""Checks shared by the CPU and GPU ODC tests (a plain module, so CI never imports tests/gpu)."""
import numpy as np


def grad_loss(w1, w2, x):
    import jax.numpy as jnp
    return jnp.sum((jnp.tanh(x @ w1.reshape(5, 9)) @ w2.reshape(9, 3)) ** 2)


def check_grad_reaches_owners(ctx, rt, shards, full, version, pieces=False):
    """Units 0 (45 elements) and 1 (27) hold `full` at `version`. Every rank takes jax.grad of a
    small loss through odc_gather (`pieces`: odc_gather_pieces, unit 0 cut in three, so each piece's
    cotangent is pushed on its own) with its own input, so the backward pass pushes the cotangents
    to the owners. Checks that the local shard gradients are zero and that each owner's summed
    gradient equals the single-process sum over all ranks' inputs (rtol 1e-5)."""
    import jax
    import jax.numpy as jnp
    from jaxodc.ops import odc_gather, odc_gather_pieces

    def gather(s, v, unit, numel):
        if not pieces:
            return odc_gather(s, v, runtime=rt, unit=unit, numel=numel)
        cut = ((0, 9), (9, 30), (39, 6)) if unit == 0 else ((0, 27),)
        return jnp.concatenate(odc_gather_pieces(s, v, runtime=rt, unit=unit, numel=numel, pieces=cut))

    def loss(s1, s2, x, v):
        return grad_loss(gather(s1, v, 0, 45), gather(s2, v, 1, 27), x)

    xs = [np.random.default_rng([r, 5]).standard_normal((4, 5)).astype(np.float32) for r in range(ctx.world)]
    local = jax.block_until_ready(jax.jit(jax.grad(loss, argnums=(0, 1)))(shards[0], shards[1], xs[ctx.rank], version))
    assert all(np.all(np.asarray(g) == 0) for g in local), "the local shard cotangent must be zero"
    rt.done(version)
    rt.wait_complete(version)
    ref = [np.zeros(45, np.float32), np.zeros(27, np.float32)]
    for x in xs:
        g1, g2 = jax.grad(grad_loss, argnums=(0, 1))(full[0], full[1], x)
        ref[0] += np.asarray(g1)
        ref[1] += np.asarray(g2)
    for u in range(2):
        lo, hi = rt.shard_range(u)
        np.testing.assert_allclose(rt.fetch_grad(u)[: hi - lo], ref[u][lo:hi], rtol=1e-5, atol=1e-5,
                                   err_msg=f"rank {ctx.rank} unit {u}")


def wait_zeroed(view, timeout_s: float = 10.0) -> None:
    """A summed gradient handed back by clear_grad is zeroed by the owner's daemon soon after,
    off the trainer's path (Accumulator::release): wait for it, bounded."""
    import time
    deadline = time.monotonic() + timeout_s
    while view.any() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not view.any(), f"the released gradient was not zeroed within {timeout_s} s"
