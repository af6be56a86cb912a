"""What equals one process beyond the optimizer, and what is refused (docs/any_model.md's table):
dropout keys per step and microbatch, a per-sample loss's normalisation, a per-rank token count,
ranks starting from different parameters, an nnx model drawing from its own stored key."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from harness import RankFailure, run_ranks

MAX_TOKENS, SEED, STEPS = 16, 7, 2


def net(dropout: float):
    """Embedding -> Dropout -> Linear over packed tokens."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.emb = nnx.Embed(20, 8, rngs=rngs)
            self.drop = nnx.Dropout(dropout, rngs=rngs)
            self.out = nnx.Linear(8, 1, rngs=rngs)

        def __call__(self, b):
            return self.out(self.drop(self.emb(b["tokens"])))[..., 0]  # [1, T]

    return Net(nnx.Rngs(0, dropout=1))


def token_loss(m, b):
    """Squared error per loss token, summed."""
    return jnp.sum((m(b) - 0.1 * b["targets"]) ** 2 * b["loss_mask"])


def sample_loss(m, b):
    """Per sample, the square of its tokens' mean output, summed over samples (a per-sample loss)."""
    seg, y = b["segment_ids"][0], m(b)[0] * b["loss_mask"][0]
    n = jax.ops.segment_sum(b["loss_mask"][0], seg, MAX_TOKENS + 1)[1:]
    means = jax.ops.segment_sum(y, seg, MAX_TOKENS + 1)[1:] / jnp.maximum(n, 1.0)
    return jnp.sum(jnp.where(n > 0, (means - 0.5) ** 2, 0.0))


CASES = {"dropout": (0.5, token_loss, ("dropout",), "tokens"), "per_sample": (0.0, sample_loss, (), "samples")}


def samples():
    rs = np.random.RandomState(3)
    return [rs.randint(1, 20, rs.randint(3, 12)).astype(np.int32) for _ in range(12)]


MINIBATCHES = [list(range(0, 6)), list(range(6, 12))]


def trainer_body(ctx, case, comm):
    if comm == "collective":
        from jaxodc.launch.context import init_jax_distributed
        init_jax_distributed(ctx)
    from jaxodc import Trainer
    from jaxodc.modeling.adapters import nnx_loss_fn
    rate, loss, rngs, normalize = CASES[case]
    loss_fn, tree = nnx_loss_fn(net(rate), loss, rngs=rngs)
    with Trainer(loss_fn, optax.adam(1e-2), comm=comm, balance="lb_micro", max_tokens=MAX_TOKENS, params=tree,
                 ctx=ctx, seed=SEED, normalize=normalize) as tr:
        losses = [r.loss for r in tr.fit(samples(), MINIBATCHES)]
        return losses, jax.tree_util.tree_map(np.asarray, tr.full_params()["params"])


def reference(case, world):
    """One process: the same plans' microbatches with their keys, summed, divided, Adam."""
    from jaxodc.balance.cost import CostModel
    from jaxodc.balance.plan import make_plan
    from jaxodc.modeling.adapters import nnx_loss_fn
    from jaxodc.train.core import microbatches_for, plan_divisor, with_key
    rate, loss, rngs, normalize = CASES[case]
    loss_fn, tree = nnx_loss_fn(net(rate), loss, rngs=rngs)
    grad = jax.jit(jax.value_and_grad(lambda p, b: loss_fn({"params": p, "state": tree["state"]}, b)))
    params, opt = tree["params"], optax.adam(1e-2)
    state, data, losses = opt.init(params), samples(), []
    for step, idx in enumerate(MINIBATCHES):
        sub = [data[i] for i in idx]
        plan = make_plan("lb_micro", [len(x) for x in sub], world, MAX_TOKENS, CostModel())
        div, total, g = plan_divisor(plan, sub, normalize), 0.0, jax.tree_util.tree_map(jnp.zeros_like, params)
        for r in range(world):
            for ids, mb in zip(plan.ranks[r], microbatches_for(plan, r, sub)):
                l, gi = grad(params, with_key(mb, SEED if rngs else None, step, ids))
                total, g = total + float(l) / div, jax.tree_util.tree_map(lambda a, b: a + b / div, g, gi)
        upd, state = opt.update(g, state, params)
        params = optax.apply_updates(params, upd)
        losses.append(total)
    return losses, params


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("comm", ["odc", "collective"])
def test_trainer_equals_one_process_with_dropout_keys_and_per_sample_loss(case, comm):
    """Dropout: each microbatch's mask from its own key (step, its samples), wherever it runs; a
    per-sample loss divided by the minibatch's samples, not its tokens."""
    ref_losses, ref_params = reference(case, 2)
    for losses, params in run_ranks(trainer_body, 2, args=(case, comm), timeout_s=240):
        np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
        for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref_params)):
            np.testing.assert_allclose(a, np.asarray(b), rtol=1e-4, atol=2e-6)


def test_microbatch_keys_follow_the_samples():
    from jaxodc.modeling.adapters import microbatch_key
    a, b = microbatch_key(SEED, 3, (4, 9)), microbatch_key(SEED, 3, (9, 4))
    assert np.array_equal(a, b) and a.dtype == np.uint32 and a.shape == (2,)
    assert not np.array_equal(a, microbatch_key(SEED, 3, (5,))) and not np.array_equal(a, microbatch_key(SEED, 4, (4,)))


def test_nnx_dropout_from_its_stored_key_is_refused():
    """Without rngs=, an nnx model draws from the key stored in it: the same mask every call."""
    from jaxodc.modeling.adapters import nnx_loss_fn
    loss_fn, tree = nnx_loss_fn(net(0.5), token_loss)
    batch = {"tokens": np.ones((1, 4), np.int32), "targets": np.ones((1, 4), np.int32),
             "loss_mask": np.ones((1, 4), np.float32)}
    with pytest.raises(ValueError, match="its own stored key .*drop.*rngs=\\('dropout',\\)"):
        jax.make_jaxpr(loss_fn)(tree, batch)
    ok, tree = nnx_loss_fn(net(0.0), token_loss)  # a rate of 0 draws nothing
    jax.make_jaxpr(ok)(tree, batch)


def token_count_body(ctx, comm, clip):
    """Ranks pass their own token counts (4 and 6): refused, nothing applied."""
    if comm == "collective":
        from jaxodc.launch.context import init_jax_distributed
        init_jax_distributed(ctx)
    import jaxodc
    from jaxodc.models.lm import LM, LMConfig
    model = LM(LMConfig(d_model=16, n_layers=1, n_heads=2))
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)) if clip else optax.adam(1e-2)
    tr = jaxodc.sharded_step(model, opt, comm=comm).init(model.init(jax.random.PRNGKey(0)), ctx=ctx)
    from jaxodc.balance.packing import pack
    mb = pack([np.arange(1, 5, dtype=np.int32)], 8).as_dict()
    before = tr.local_shards()
    def local_state():  # this process's part (the collective's arrays span processes), copied: it is donated
        return [np.array(x.addressable_data(0) if hasattr(x, "addressable_data") else x)
                for x in jax.tree_util.tree_leaves(tr.opt_state)]
    state = local_state()
    try:
        tr.train_minibatch([mb], 4.0 + 2 * ctx.rank)
        err = None
    except ValueError as e:
        err = str(e)
    same = all(np.array_equal(before[n], x) for n, x in tr.local_shards().items())
    same = same and all(np.array_equal(a, b) for a, b in zip(state, local_state()))
    if comm == "collective":
        tr.close()
    return err, same


@pytest.mark.parametrize("comm,clip", [("odc", False), ("odc", True), ("collective", True)])
def test_per_rank_token_counts_are_refused_before_any_update(comm, clip):
    for err, same in run_ranks(token_count_body, 2, args=(comm, clip), timeout_s=180):
        assert err is not None and "rank 0: 4" in err and "rank 1: 6" in err, err
        assert same, "the minibatch's update was applied (to the shards or the optimizer state)"


def different_init_body(ctx):
    import jaxodc
    from jaxodc.models.lm import LM, LMConfig
    model = LM(LMConfig(d_model=16, n_layers=1, n_heads=2))
    jaxodc.sharded_step(model, optax.adam(1e-2), comm="odc").init(model.init(jax.random.PRNGKey(ctx.rank)), ctx=ctx)


def test_ranks_starting_from_different_parameters_are_refused():
    with pytest.raises(RankFailure, match="initial parameter values"):
        run_ranks(different_init_body, 2, timeout_s=120)
