"""Models that were not written for jaxodc, trained by the sharded trainers across processes: a
linen Llama (nn.scan stack, tied head), an nnx classifier and a plain-JAX loss (lax.scan,
lax.cond, custom_vjp, a frozen subtree, an int leaf), against single-process jax.value_and_grad
training on the same data."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from harness import run_ranks

STEPS = 3


def llama_case():
    from jaxodc.models.llama import Llama, LlamaConfig
    from jaxodc.train.adapters import linen_loss_fn
    cfg = LlamaConfig(n_layers=3, d_model=32, ffn=64, vocab=50, scan_axis=1, tie_embeddings=True)
    loss_fn = linen_loss_fn(Llama(cfg), lambda apply, b: jnp.sum(apply(b)))

    def batch(step, rank, j):
        rs = np.random.RandomState([step, rank, j])
        T = 8
        return {"tokens": rs.randint(1, 50, (1, T)).astype(np.int32),
                "targets": rs.randint(1, 50, (1, T)).astype(np.int32),
                "segment_ids": np.array([[1] * 5 + [2] * 3], np.int32),
                "positions": np.array([list(range(5)) + list(range(3))], np.int32),
                "loss_mask": np.ones((1, T), np.float32)}
    params = jax.jit(lambda k: Llama(cfg).init(k, batch(0, 0, 0)))(jax.random.key(0))
    return loss_fn, params, batch, lambda b: float(b["loss_mask"].sum()), {}


def nnx_case():
    from flax import nnx
    from jaxodc.models.nnx_mlp import Classifier
    from jaxodc.train.adapters import nnx_loss_fn
    loss_fn, tree = nnx_loss_fn(Classifier(rngs=nnx.Rngs(0)), lambda m, b: jnp.sum(m(b)))

    def batch(step, rank, j):
        rs = np.random.RandomState([step, rank, j, 1])
        return {"x": rs.standard_normal((3, 8)).astype(np.float32), "y": rs.randint(0, 5, 3).astype(np.int32),
                "mask": np.ones(3, np.float32)}
    return loss_fn, tree, batch, lambda b: float(b["mask"].sum()), {"frozen": ("state/*",)}


def plain_case():
    from test_any_model import plain_loss, plain_setup
    p, b0 = plain_setup()

    def batch(step, rank, j):
        rs = np.random.RandomState([step, rank, j, 2])
        return {"x": rs.standard_normal((6, 3)).astype(np.float32), "flag": np.int32((step + j) % 2)}
    return plain_loss, jax.tree_util.tree_map(np.asarray, p), batch, lambda b: 6.0, {"frozen": ("frozen/*",)}


CASES = {"llama": llama_case, "nnx": nnx_case, "plain": plain_case}


def host(x):
    """A leaf as numpy (PRNG keys as their key data)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def counts(world, comm):
    """Microbatches per rank: uneven under ODC (rank 0 runs one more), equal under collective."""
    return [2 + (comm == "odc" and r == 0) for r in range(world)]


def reference(case):
    """Single-process training on the union of every rank's microbatches."""
    loss_fn, params, batch, count, _ = CASES[case]()
    return {comm: _reference(loss_fn, params, batch, count, comm) for comm in ("odc", "collective")}


def _reference(loss_fn, params, batch, count, comm, world=2):
    """Adam on the float leaves; keys, ints and the like stay as they are."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    trained = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)]

    def loss_of(floats, b):
        full = list(leaves)
        for i, x in zip(trained, floats):
            full[i] = x
        return loss_fn(jax.tree_util.tree_unflatten(tree, full), b)

    grad = jax.jit(jax.value_and_grad(loss_of))
    floats = [jnp.asarray(leaves[i]) for i in trained]
    opt = optax.adam(1e-2)
    state = opt.init(floats)
    losses = []
    for step in range(STEPS):
        mbs = [batch(step, r, j) for r in range(world) for j in range(counts(world, comm)[r])]
        total = sum(count(b) for b in mbs)
        loss, g = 0.0, [jnp.zeros_like(x) for x in floats]
        for b in mbs:
            l, gi = grad(floats, b)
            loss += float(l) / total
            g = [a + c / total for a, c in zip(g, gi)]
        upd, state = opt.update(g, state, floats)
        floats = optax.apply_updates(floats, upd)
        losses.append(loss)
    full = list(leaves)
    for i, x in zip(trained, floats):
        full[i] = x
    return losses, jax.tree_util.tree_unflatten(tree, full)


def train_body(ctx, case, comm):
    if comm == "collective":
        from jaxodc.launch.context import init_jax_distributed
        init_jax_distributed(ctx)
    import jaxodc
    loss_fn, params, batch, count, policy = CASES[case]()
    step_fn = jaxodc.sharded_step(loss_fn, optax.adam(1e-2), comm=comm, unit_policy=policy)
    tr = step_fn.init(params, ctx=ctx, example_batch=batch(0, 0, 0))
    losses = []
    n = counts(ctx.world, comm)
    for step in range(STEPS):
        total = sum(count(batch(step, r, j)) for r in range(ctx.world) for j in range(n[r]))
        res = tr.train_minibatch([batch(step, ctx.rank, j) for j in range(n[ctx.rank])], total)
        losses.append(res.loss)
    shards = tr.local_shards()
    got = [{k: np.asarray(v) for k, v in d.items()} for d in tr.allgather_obj(
        {k: v.tobytes() for k, v in shards.items()})]
    full = tr.program.unshard([{k: np.frombuffer(v, np.float32) for k, v in d.items()} for d in got])
    units = tr.layout.names
    tr.close()
    return losses, jax.tree_util.tree_map(host, full), units


@pytest.mark.parametrize("case,comm", [("llama", "odc"), ("nnx", "odc"), ("plain", "odc"),
                                       ("llama", "collective"), ("nnx", "collective")])
def test_sharded_training_equals_single_process(case, comm):
    results = run_ranks(train_body, 2, args=(case, comm), timeout_s=240)
    ref_losses, ref_params = reference(case)[comm]
    for losses, full, units in results:
        np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(full), jax.tree_util.tree_leaves(ref_params)):
            np.testing.assert_allclose(a, host(b), rtol=1e-4, atol=2e-5, err_msg=jax.tree_util.keystr(path))
    assert len(results[0][2]) > 2  # the discovered units
