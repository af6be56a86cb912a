"""Models that were not written for jaxodc, trained by the sharded trainers across processes: a
linen Llama (nn.scan stack, tied head), an nnx classifier, a plain-JAX loss (lax.scan, lax.cond,
custom_vjp, a frozen subtree, an int leaf), a linen CNN with BatchNorm (mutable batch_stats), an
nnx net with BatchNorm and dropout (mutable nnx.BatchStat) and a linen net with a frozen BatchNorm
(its statistics are no parameters: they must not move), against single-process
jax.value_and_grad training on the same data, at 1, 2 and 3 ranks."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from harness import run_ranks

STEPS = 3


def optimizer():
    # Adam divides by sqrt(v) + eps: with the default eps (1e-8) an element whose gradient is at the
    # level of fp32 summation noise moves by up to lr whichever way the noise points, and the
    # sharded sums add in another order than the reference's.
    return optax.adam(1e-2, eps=1e-5)


def llama_case():
    from jaxodc.models.llama import Llama, LlamaConfig
    from jaxodc.modeling.adapters import linen_loss_fn
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
    from jaxodc.modeling.adapters import nnx_loss_fn
    loss_fn, tree = nnx_loss_fn(Classifier(rngs=nnx.Rngs(0)), lambda m, b: jnp.sum(m(b)))

    def batch(step, rank, j):
        rs = np.random.RandomState([step, rank, j, 1])
        return {"x": rs.standard_normal((3, 8)).astype(np.float32), "y": rs.randint(0, 5, 3).astype(np.int32),
                "mask": np.ones(3, np.float32)}
    return loss_fn, tree, batch, lambda b: float(b["mask"].sum()), {}  # nnx_loss_fn freezes "state" itself


def plain_case():
    from test_any_model import plain_loss, plain_setup
    p, b0 = plain_setup()

    def batch(step, rank, j):
        rs = np.random.RandomState([step, rank, j, 2])
        return {"x": rs.standard_normal((6, 3)).astype(np.float32), "flag": np.int32((step + j) % 2)}
    return plain_loss, jax.tree_util.tree_map(np.asarray, p), batch, lambda b: 6.0, {"frozen": ("frozen/*",)}


def cnn_case():
    from jaxodc.models.cnn import CNN
    from jaxodc.modeling.adapters import linen_loss_fn
    model = CNN(features=(4, 8))
    loss_fn = linen_loss_fn(model, lambda apply, b: jnp.sum(apply(b)), mutable=("batch_stats",))
    x = np.asarray(load_digits_cached()[0], np.float32).reshape(-1, 8, 8, 1) / 16.0
    y = np.asarray(load_digits_cached()[1], np.int32)

    def batch(step, rank, j):
        # 2..4 images (the statistics' weights differ per microbatch); one slot of padding
        rs = np.random.RandomState([step, rank, j, 3])
        n = 2 + (step + rank + j) % 3
        idx = rs.randint(0, len(y), 5)
        mask = (np.arange(5) < n).astype(np.float32)
        return {"x": x[idx] * mask[:, None, None, None], "y": y[idx], "mask": mask}
    params = jax.jit(model.init)(jax.random.key(0), batch(0, 0, 0))
    return loss_fn, params, batch, lambda b: float(b["mask"].sum()), {}


def linen_frozen_bn_case():
    """Dense -> BatchNorm(use_running_average=True) -> Dense: the statistics are read, not
    updated, and get a gradient; one process trains only "params"."""
    import flax.linen as nn
    from jaxodc.modeling.adapters import linen_loss_fn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, b):
            h = nn.BatchNorm(use_running_average=True)(nn.Dense(6)(b["x"]))
            return jnp.sum((nn.Dense(2)(jax.nn.relu(h)) - b["t"]) ** 2)

    def batch(step, rank, j):
        rs = np.random.RandomState([step, rank, j, 5])
        return {"x": rs.standard_normal((4, 3)).astype(np.float32), "t": rs.standard_normal((4, 2)).astype(np.float32)}
    variables = jax.jit(Net().init)(jax.random.key(0), batch(0, 0, 0))
    variables = jax.tree_util.tree_map(np.asarray, variables)
    variables["batch_stats"] = {k: {"mean": np.full(6, 0.3, np.float32), "var": np.full(6, 2.0, np.float32)}
                                for k in variables["batch_stats"]}
    return linen_loss_fn(Net(), lambda apply, b: apply(b)), variables, batch, lambda b: 4.0, {}


def nnx_bn_model():
    """nnx: Linear -> BatchNorm (statistics over the real rows only: `mask=`) -> relu -> Dropout ->
    Linear, a masked squared-error sum. Its state holds float BatchNorm statistics (trained as
    mutable nnx.BatchStat) and the dropout stream's key and counter (constants)."""
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            # no bias before BatchNorm: it subtracts any bias, whose gradient is then 0 up to fp32
            # noise, which Adam would turn into steps of lr in either direction
            self.lin = nnx.Linear(3, 6, use_bias=False, rngs=rngs)
            self.bn = nnx.BatchNorm(6, momentum=0.8, rngs=rngs)
            self.drop = nnx.Dropout(0.25, rngs=rngs)
            self.out = nnx.Linear(6, 2, rngs=rngs)

        def __call__(self, b):
            valid = b["mask"] > 0
            rows = jnp.where(jnp.any(valid), valid, True)[:, None]  # an all-padding microbatch stays finite
            h = self.bn(self.lin(b["x"]), mask=jnp.broadcast_to(rows, (b["x"].shape[0], 6)))
            y = self.out(self.drop(jax.nn.relu(h)))
            return jnp.sum((y - b["t"]) ** 2 * b["mask"][:, None])

    return Net(nnx.Rngs(0, dropout=1))


def nnx_bn_case():
    from flax import nnx
    from jaxodc.modeling.adapters import nnx_loss_fn
    loss_fn, tree = nnx_loss_fn(nnx_bn_model(), lambda m, b: m(b), rngs=("dropout",), mutable=nnx.BatchStat)

    def batch(step, rank, j):
        # 2..4 real rows of 5 (the statistics' weights differ per microbatch); the dropout key is in
        # the batch (raw key data: the collective trainer stacks batch leaves by rank)
        rs = np.random.RandomState([step, rank, j, 4])
        n = 2 + (step + rank + j) % 3
        mask = (np.arange(5) < n).astype(np.float32)
        return {"x": (rs.standard_normal((5, 3)) * mask[:, None]).astype(np.float32),
                "t": rs.standard_normal((5, 2)).astype(np.float32), "mask": mask,
                "rng": np.asarray(jax.random.key_data(jax.random.key(1000 * step + 10 * rank + j)))}
    # one unit per layer (the default groups this small net into one): BatchNorm in a stage of its own
    units = {name: (f"params/{name}/*",) for name in ("lin", "bn", "out")}
    return loss_fn, tree, batch, lambda b: float(b["mask"].sum()), {"units": units}


def load_digits_cached():
    from sklearn.datasets import load_digits
    d = load_digits()
    return d.data[:200], d.target[:200]


CASES = {"llama": llama_case, "nnx": nnx_case, "plain": plain_case, "cnn": cnn_case, "nnx_bn": nnx_bn_case,
         "linen_frozen_bn": linen_frozen_bn_case}


def host(x):
    """A leaf as numpy (PRNG keys as their key data)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def counts(world, comm):
    """Microbatches per rank: uneven under ODC (rank 0 runs one more; of 3 ranks the last runs
    none), equal under collective."""
    if comm == "odc" and world == 3:
        return [3, 2, 0]
    return [2 + (comm == "odc" and r == 0) for r in range(world)]


@functools.cache  # shared with tests/test_mixed_precision.py in one session (llama: ~10 s each)
def reference(case, comm, world):
    """Single-process training on the union of every rank's microbatches."""
    loss_fn, params, batch, count, policy = CASES[case]()
    return _reference(loss_fn, params, batch, count, comm, world, policy.get("frozen", ()) + NOT_PARAMS.get(case, ()))


# What one process does not train although the sharded trainers are told nothing: the adapters say it.
NOT_PARAMS = {"nnx": ("state/*",), "linen_frozen_bn": ("batch_stats/*",)}


def _reference(loss_fn, params, batch, count, comm, world, frozen=()):
    """Adam on the float leaves (not those under a `frozen` prefix); keys, ints and the like stay
    as they are. A loss returning (loss, {collection: state}) (BatchNorm): every microbatch starts
    from the minibatch's state, whose new value is the count-weighted mean of theirs."""
    paths = [jax.tree_util.keystr(p, simple=True, separator="/")
             for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    leaves, tree = jax.tree_util.tree_flatten(params)
    out = jax.eval_shape(loss_fn, params, batch(0, 0, 0))
    stateful = isinstance(out, tuple)
    state_at = {jax.tree_util.keystr(p, simple=True, separator="/")
                for p, _ in jax.tree_util.tree_flatten_with_path(out[1])[0]} if stateful else set()
    kept = tuple(f.rstrip("*") for f in frozen)
    trained = [i for i, x in enumerate(leaves) if jnp.issubdtype(x.dtype, jnp.floating)
               and not paths[i].startswith(kept) and paths[i] not in state_at]

    def loss_of(floats, rest, b):
        full = list(rest)
        for i, x in zip(trained, floats):
            full[i] = x
        return loss_fn(jax.tree_util.tree_unflatten(tree, full), b)

    grad = jax.jit(jax.value_and_grad(loss_of, has_aux=stateful))
    floats = [jnp.asarray(leaves[i]) for i in trained]
    rest = list(leaves)
    opt = optimizer()
    state = opt.init(floats)
    losses = []
    for step in range(STEPS):
        mbs = [batch(step, r, j) for r in range(world) for j in range(counts(world, comm)[r])]
        total = sum(count(b) for b in mbs)
        loss, g, new = 0.0, [jnp.zeros_like(x) for x in floats], None
        for b in mbs:
            l, gi = grad(floats, rest, b)
            if stateful:
                l, st = l
                w = jax.tree_util.tree_map(lambda x: count(b) * np.asarray(x, np.float64), st)
                new = w if new is None else jax.tree_util.tree_map(np.add, new, w)
            loss += float(l) / total
            g = [a + c / total for a, c in zip(g, gi)]
        upd, state = opt.update(g, state, floats)
        floats = optax.apply_updates(floats, upd)
        losses.append(loss)
        if stateful:  # write the mean state back into its leaves
            mean = {jax.tree_util.keystr(p, simple=True, separator="/"): np.float32(x / total)
                    for p, x in jax.tree_util.tree_flatten_with_path(new)[0]}
            rest = [mean.get(path, x) for path, x in zip(paths, rest)]
    full = list(rest)
    for i, x in zip(trained, floats):
        full[i] = x
    return losses, jax.tree_util.tree_unflatten(tree, full)


def train_body(ctx, case, comm):
    if comm == "collective":
        from jaxodc.launch.context import init_jax_distributed
        init_jax_distributed(ctx)
    import jaxodc
    loss_fn, params, batch, count, policy = CASES[case]()
    step_fn = jaxodc.sharded_step(loss_fn, optimizer(), comm=comm, unit_policy=policy)
    tr = step_fn.init(params, ctx=ctx, example_batch=batch(0, 0, 0))
    losses = []
    n = counts(ctx.world, comm)

    def train(step):
        total = sum(count(batch(step, r, j)) for r in range(ctx.world) for j in range(n[r]))
        return tr.train_minibatch([batch(step, ctx.rank, j) for j in range(n[ctx.rank])], total).loss

    for step in range(STEPS):
        losses.append(train(step))
    from jaxodc.train.export import full_params
    full = full_params(tr)  # with the trainer's current constants (the BatchNorm statistics)
    units = tr.layout.names
    if tr.program.state is not None:  # the state is checkpointed: a restored step repeats bit-exactly
        import os
        import tempfile
        path = os.path.join(tempfile.gettempdir(), f"jaxodc_state_ckpt_{ctx.job_id}")
        tr.save(path)
        once = (train(STEPS), [host(c) for c in tr.local_consts()])
        tr.restore(path)
        flat = {jax.tree_util.keystr(p, simple=True, separator="/"): x
                for p, x in jax.tree_util.tree_flatten_with_path(full)[0]}
        state = tr.program.state
        assert all(np.array_equal(tr.local_consts()[i], flat[p]) for i, p in zip(state.consts, state.paths))
        again = (train(STEPS), [host(c) for c in tr.local_consts()])
        assert once[0] == again[0] and all(np.array_equal(a, b) for a, b in zip(once[1], again[1]))
    tr.close()
    if tr.program.state is not None and ctx.rank == 0:
        import shutil
        shutil.rmtree(path, ignore_errors=True)
    return losses, jax.tree_util.tree_map(host, full), units


# Every model at 2 ranks on both trainers, at 1 and 3 ranks on one of them (marked slow: CI runs
# them) and the CNN on both at 1, 2 and 3. The plain loss has a scalar batch leaf, which the collective's
# batch-sharded shard_map cannot take.
RUNS = [("llama", "odc", 2), ("nnx", "odc", 2), ("plain", "odc", 2), ("llama", "collective", 2),
        ("nnx", "collective", 2)]
RUNS += [pytest.param(*run, marks=pytest.mark.slow) for run in [
    ("llama", "odc", 3), ("nnx", "collective", 3), ("plain", "odc", 3),
    ("llama", "collective", 1), ("nnx", "odc", 1), ("plain", "odc", 1)]]
RUNS += [("cnn", comm, world) for world in (1, 2, 3) for comm in ("odc", "collective")]
RUNS += [("nnx_bn", comm, 2) for comm in ("odc", "collective")]
RUNS += [("linen_frozen_bn", comm, 2) for comm in ("odc", "collective")]


@pytest.mark.parametrize("case,comm,world", RUNS)
def test_sharded_training_equals_single_process(case, comm, world):
    results = run_ranks(train_body, world, args=(case, comm), timeout_s=240)
    ref_losses, ref_params = reference(case, comm, world)
    for losses, full, units in results:
        np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
        assert jax.tree_util.tree_structure(full) == jax.tree_util.tree_structure(ref_params)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(full), jax.tree_util.tree_leaves(ref_params)):
            np.testing.assert_allclose(a, host(b), rtol=1e-4, atol=2e-5, err_msg=jax.tree_util.keystr(path))
    assert len(results[0][2]) > 2  # the discovered units
    if case == "linen_frozen_bn":  # the statistics stayed as they were
        for (_, full, _) in results:
            assert all(np.array_equal(s["mean"], np.full(6, 0.3, np.float32)) and np.array_equal(s["var"], np.full(6, 2.0, np.float32))
                       for s in full["batch_stats"].values())
    if case == "nnx_bn":  # the statistics moved from their initial zeros and ones
        stats = ref_params["state"]["bn"]
        assert np.abs(np.asarray(stats["mean"])).min() > 1e-3 and np.abs(np.asarray(stats["var"]) - 1).min() > 1e-3
