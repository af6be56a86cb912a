import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxodc.optim.clipping import clip_by_global_norm, global_norm, global_reduction
from jaxodc.modeling.staging import microbatch_grad, sharded_loss
from jaxodc.balance.packing import pack
from jaxodc.modeling.units import flatten_unit, make_layout, shard_params, unflatten_unit, unshard_params
from jaxodc.models.lm import LM, LMConfig
from jaxodc.models.mlp import MLP

CFG = LMConfig(d_model=32, n_layers=2, n_heads=2)


@pytest.fixture(scope="module")
def lm():
    m = LM(CFG)
    return m, m.init(jax.random.PRNGKey(1))


def _samples(seed, lens):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, size=L).astype(np.int32) for L in lens]


def test_packed_equals_alone(lm):
    model, params = lm
    f = jax.jit(model.token_losses)
    samples = _samples(0, [9, 17, 5, 20])
    p = pack(samples, 64)
    tl = np.asarray(f(params, p.as_dict()))
    for n, s in enumerate(samples):
        alone = pack([s], len(s))  # no padding at all: plain causal attention over one sequence
        want = np.asarray(f(params, alone.as_dict()))[0]
        got = tl[0][p.segment_ids[0] == n + 1]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert want[:-1].min() > 0  # real losses, the last token has no target
    assert not tl[0][p.segment_ids[0] == 0].any()
    # No cross-contamination: changing another sample leaves this one's losses bit-identical.
    other = [samples[0], samples[1][::-1].copy(), samples[2], samples[3]]
    tl2 = np.asarray(f(params, pack(other, 64).as_dict()))
    m0 = p.segment_ids[0] == 1
    assert np.array_equal(tl[0][m0], tl2[0][m0])
    assert not np.array_equal(tl[0][p.segment_ids[0] == 2], tl2[0][p.segment_ids[0] == 2])


def test_packed_grad_is_sum_of_alone(lm):
    model, params = lm
    g = jax.jit(jax.grad(model.loss_sum))
    samples = _samples(1, [12, 7, 30])
    gp = g(params, pack(samples, 64).as_dict())
    ga = [g(params, pack([s], 64).as_dict()) for s in samples]  # alone, padded: one compile
    gs = jax.tree_util.tree_map(lambda *x: sum(x), *ga)
    for a, b in zip(jax.tree_util.tree_leaves(gp), jax.tree_util.tree_leaves(gs)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_units_roundtrip_and_layout(lm):
    model, params = lm
    for world in (1, 2, 3, 4):
        layout = make_layout(params, world, order=model.unit_names)
        assert layout.names == model.unit_names
        for u in layout.units:
            assert u.padded % world == 0 and u.padded - u.numel < world
            flat = flatten_unit(u, params[u.name])
            assert flat.dtype == jnp.float32 and flat.shape == (u.padded,)
            assert not np.asarray(flat[u.numel:]).any()
            back = unflatten_unit(u, flat)
            for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params[u.name])):
                assert np.array_equal(a, b)
        if world == 2:  # the static spec is usable inside jit
            u = layout["block_0"]
            back = jax.jit(lambda x: unflatten_unit(u, x))(flatten_unit(u, params[u.name]))
            for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params[u.name])):
                assert np.array_equal(a, b)
        shards = [shard_params(layout, params, r) for r in range(world)]
        full = unshard_params(layout, shards)
        for a, b in zip(jax.tree_util.tree_leaves(full), jax.tree_util.tree_leaves(params)):
            assert np.array_equal(a, b)
    fp = make_layout(params, 2).fingerprint()
    assert fp == make_layout(LM(CFG).init(jax.random.PRNGKey(7)), 2).fingerprint()  # values do not matter
    assert fp != make_layout(params, 4).fingerprint()
    assert fp != make_layout(LM(LMConfig(d_model=32, n_layers=3, n_heads=2)).init(jax.random.PRNGKey(1)), 2).fingerprint()
    u = make_layout(params, 2)["embed"]
    with pytest.raises(ValueError, match="unit 'embed'"):
        unflatten_unit(u, jnp.zeros(u.numel + 5))
    with pytest.raises(ValueError, match="rank 2 outside world of 2"):
        u.shard_range(2)


def test_sharded_loss_core_matches_model(lm):
    # World 1 with an identity gather: the remat'd unit-by-unit core equals the plain model.
    model, params = lm
    layout = make_layout(params, 1, order=model.unit_names)
    shards = {n: jnp.asarray(s) for n, s in shard_params(layout, params, 0).items()}
    batch = pack(_samples(2, [10, 20, 15]), 64).as_dict()
    fn = jax.jit(microbatch_grad(model, layout, lambda s, spec, ctx: s))
    loss, g = fn(shards, batch, jnp.float32(40.0), None)
    want_l, want_g = jax.jit(jax.value_and_grad(lambda p: model.loss_sum(p, batch) / 40.0))(params)
    np.testing.assert_allclose(loss, want_l, rtol=1e-6)
    for u in layout.units:
        np.testing.assert_allclose(g[u.name], flatten_unit(u, want_g[u.name]), rtol=1e-5, atol=1e-7)


def test_global_norm_uses_the_reduction_and_clip_is_optax():
    rng = np.random.default_rng(0)
    g = {"a": jnp.asarray(rng.normal(size=7), jnp.float32), "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32)}
    assert clip_by_global_norm is optax.clip_by_global_norm
    n = float(optax.tree.norm(g))
    np.testing.assert_allclose(global_norm(g), n, rtol=1e-6)
    # Pretend 4 ranks hold identical shards: the global norm doubles.
    with global_reduction(lambda x: 4.0 * x):
        np.testing.assert_allclose(global_norm(g), 2 * n, rtol=1e-6)


def test_mlp_units():
    m = MLP((6, 16, 5))
    p = m.init(jax.random.PRNGKey(0))
    assert list(p) == ["layer_0", "layer_1"]
    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.normal(size=(4, 6)), jnp.float32), "y": jnp.asarray([0, 1, 4, 2]),
             "mask": jnp.asarray([1.0, 1.0, 0.0, 1.0])}
    tl = m.token_losses(p, batch)
    assert tl.shape == (4,) and float(tl[2]) == 0.0 and float(tl.min()) >= 0.0
    logits = jnp.maximum(batch["x"] @ p["layer_0"]["Dense_0"]["kernel"] + p["layer_0"]["Dense_0"]["bias"], 0)
    logits = logits @ p["layer_1"]["Dense_0"]["kernel"] + p["layer_1"]["Dense_0"]["bias"]
    want = -jax.nn.log_softmax(logits)[jnp.arange(4), batch["y"]] * batch["mask"]
    np.testing.assert_allclose(tl, want, rtol=1e-5)
    layout = make_layout(p, 2, order=m.unit_names)
    assert [u.numel for u in layout.units] == [6 * 16 + 16, 16 * 5 + 5]


def test_reference_timing_fn_calibrates(lm):
    from jaxodc.balance.cost import calibrate
    from jaxodc.train.reference import ReferenceTrainer
    model, params = lm
    ref = ReferenceTrainer(model, optax.sgd(0.1), params)
    cm = calibrate(ref.timing_fn(64), [8, 32, 64, [32, 32]], repeats=2)
    assert min(cm.a, cm.b, cm.c) >= 0 and cm.microbatch([64]) > 0
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(ref.numpy_params()),
                                                    jax.tree_util.tree_leaves(params)))  # timing does not train
