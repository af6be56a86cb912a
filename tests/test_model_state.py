"""Mutable model state in the sharded trainers' programs (jaxodc/modeling/state.py), in process: which
outputs count as state, the refusals (metrics, non-float leaves, a runtime without the state
unit), the weighted sums, and an nnx BatchNorm model's state through the staged gradient. The
trainers themselves, across ranks: tests/test_any_model_training.py (the linen CNN, an nnx
BatchNorm + dropout net)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxodc.modeling.program import traced_program
from jaxodc.modeling.state import ModelState, state_paths


def params():
    return {"params": {"w": jnp.ones((3, 2))}, "batch_stats": {"mean": jnp.zeros(2)}, "step": jnp.int32(0)}


def test_outputs_that_are_state_and_those_refused():
    p = params()
    assert state_paths(jnp.float32(1), p) is None
    assert state_paths((jnp.float32(1), {"batch_stats": {"mean": jnp.ones(2)}}), p) == ("batch_stats/mean",)
    with pytest.raises(TypeError, match=r"aux only as mutable state.*Metrics are not summed"):
        state_paths((jnp.float32(1), {"accuracy": jnp.float32(0.5)}), p)
    with pytest.raises(TypeError, match=r"aux only as mutable state"):
        state_paths((jnp.float32(1), jnp.float32(0.5)), p)
    with pytest.raises(TypeError, match=r"or \(that sum, new state\); got float32\[3\]"):
        state_paths(jnp.zeros(3), p)
    with pytest.raises(TypeError, match=r"state leaf 'step' is int32: only float state is averaged"):
        state_paths((jnp.float32(1), {"step": jnp.int32(1)}), p)
    with pytest.raises(TypeError, match=r"state leaf 'batch_stats/mean'.*keep shape and dtype"):
        state_paths((jnp.float32(1), {"batch_stats": {"mean": jnp.ones(3)}}), p)


def test_weighted_sums_and_the_mean_written_back():
    st = ModelState(("a", "b"), (1, 0), ((2,), ()), (np.float32, np.float32))
    w1 = st.weighted({"a": jnp.array([1.0, 2.0]), "b": jnp.float32(3)}, {"mask": jnp.ones(2)})
    w0 = st.weighted({"a": jnp.array([np.nan, 1.0]), "b": jnp.float32(np.inf)}, {"mask": jnp.zeros(4)})
    w3 = st.weighted({"a": jnp.array([5.0, 6.0]), "b": jnp.float32(7)}, {"loss_mask": jnp.array([[1.0, 1.0, 0.0]])})
    np.testing.assert_array_equal(w0, np.zeros(4))  # padding adds nothing, whatever its statistics
    consts = ("b0", "a0", "other")
    new = st.updated(consts, np.asarray(w1 + w0 + w3))
    np.testing.assert_allclose(new[1], [(2 * 1 + 2 * 5) / 4, (2 * 2 + 2 * 6) / 4])
    np.testing.assert_allclose(new[0], (2 * 3 + 2 * 7) / 4)
    assert new[2] == "other" and new[1].dtype == np.float32
    assert st.updated(consts, np.zeros(4)) is consts
    with pytest.raises(ValueError, match=r"neither 'loss_mask' nor 'mask': pass count_fn="):
        st.weighted({"a": jnp.zeros(2), "b": jnp.float32(0)}, {"x": jnp.zeros(2)})


class BNDropNet:
    """An nnx model with BatchNorm and dropout (its RNG counter is non-float state)."""

    @staticmethod
    def make():
        from flax import nnx

        class Net(nnx.Module):
            def __init__(self, rngs):
                self.lin = nnx.Linear(3, 4, rngs=rngs)
                self.bn = nnx.BatchNorm(4, momentum=0.8, rngs=rngs)
                self.drop = nnx.Dropout(0.5, rngs=rngs)
                self.out = nnx.Linear(4, 2, rngs=rngs)

            def __call__(self, b):
                return jnp.sum(self.out(self.drop(jax.nn.relu(self.bn(self.lin(b["x"]))))) ** 2 * b["mask"][:, None])

        return Net(nnx.Rngs(0, dropout=1))


def test_nnx_batch_stats_through_the_staged_gradient():
    from flax import nnx
    from jaxodc.modeling.adapters import nnx_loss_fn
    loss_fn, tree = nnx_loss_fn(BNDropNet.make(), lambda m, b: m(b), rngs=("dropout",), mutable=nnx.BatchStat)
    b = {"x": jax.random.normal(jax.random.key(1), (5, 3)), "mask": jnp.array([1.0, 1, 1, 0, 0]),
         "rng": jax.random.key(2)}
    prog = traced_program(loss_fn, tree, b, 1)
    assert prog.state.paths == ("state/bn/mean", "state/bn/var")
    assert prog.runtime_units() == [u.padded for u in prog.layout.units] + [4 + 4 + 1]
    shards = {k: jnp.asarray(v) for k, v in prog.shard(tree, 0).items()}
    (loss, w), _ = jax.jit(prog.grad(lambda s, spec, arg: s))(shards, prog.consts, b, jnp.float32(3.0), None)
    want_loss, new = loss_fn(tree, b)
    np.testing.assert_allclose(loss, want_loss / 3.0, rtol=1e-6)
    want = np.concatenate([np.ravel(new["state"]["bn"][k]) for k in ("mean", "var")])
    np.testing.assert_allclose(np.asarray(w), 3.0 * np.append(want, 1.0), rtol=1e-6)
    # every non-parameter variable, the RNG counter included: refused, naming the leaf
    everything, _ = nnx_loss_fn(BNDropNet.make(), lambda m, b: m(b), rngs=("dropout",), mutable=True)
    with pytest.raises(TypeError, match=r"state leaf 'state/drop/rngs/count.*' is uint32.*mutable=nnx.BatchStat"):
        traced_program(everything, tree, b, 1)


def test_count_fn_needs_state_and_the_odc_runtime_needs_the_state_unit():
    from jaxodc.models.cnn import CNN
    from jaxodc.modeling.adapters import linen_loss_fn
    from jaxodc.train.odc import OdcTrainer
    b = {"x": jnp.ones((2, 8, 8, 1)), "y": jnp.array([1, 2]), "mask": jnp.ones(2)}
    model = CNN(features=(2, 2))
    variables = model.init(jax.random.key(0), b)
    with pytest.raises(ValueError, match=r"count_fn= weights a loss's new state"):
        traced_program(linen_loss_fn(model, lambda apply, b: jnp.sum(apply(b, train=False))), variables, b, 1,
                       count_fn=lambda b: 1.0)
    loss_fn = linen_loss_fn(model, lambda apply, b: jnp.sum(apply(b)), mutable=("batch_stats",))
    prog = traced_program(loss_fn, variables, b, 2, count_fn=lambda b: jnp.sum(b["mask"]))
    assert all(p.startswith("batch_stats/") for p in prog.state.paths) and len(prog.state.paths) == 4

    class Runtime:  # what OdcTrainer reads before it publishes anything
        rank, world, unit_sizes = 0, 2, [u.padded for u in prog.layout.units]

    with pytest.raises(ValueError, match=r"rank 0: the runtime has units .* then one for the mutable state"):
        OdcTrainer(prog, optax.sgd(0.1), variables, Runtime())
