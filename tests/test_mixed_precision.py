"""Mixed precision (`precision="bf16"`: fp32 master shards and optimizer, units gathered and
computed in bf16, the batch's float inputs cast to bf16, gradients sent in bf16 and summed in fp32)
tracks fp32 training; and `program.cast_inputs`, the cast of the batch's float leaves.

Across processes (2 ranks, odc and collective): the linen Llama (nn.scan stack, tied head) and the
linen CNN with BatchNorm (mutable batch_stats: bf16 together with mutable state), trained in bf16,
against the single-process fp32 reference of tests/test_any_model_training.py (which the fp32
sharded runs equal to 2e-5 there)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness import run_ranks
from test_any_model_training import CASES, STEPS, counts, host, optimizer, reference

# Tolerances, from bf16's 8 significant bits: one rounding is off by up to u = 2^-9 ~ 2e-3
# relative, and the weights, the float inputs and every intermediate of the forward and backward
# pass are rounded so.
# - Losses: a loss is a sum of per-token / per-image losses, each a chain of rounded ops whose
#   errors partly cancel, so it moves by a few u; after the first step the parameters differ too
#   (Adam, lr 1e-2, moves an element by about lr whatever its gradient's size, so bf16 gradients
#   of the same sign move it alike; those of tiny gradients whose sign flips do not), which adds a
#   little more. We allow 4u = 2^-7 ~ 7.8e-3 relative per step; measured: at most 1.3e-3 (the CNN
#   under collective, step 3), llama at most 6.5e-4 (its first loss is log(vocab) up to ~1e-5
#   whatever the weights: the initial logits are near 0).
# - BatchNorm running statistics: an EMA of the means and variances of bf16 activations (flax
#   reduces in fp32 from the bf16 inputs), so a few u again, plus the conv kernels' drift. Variances
#   to 2^-6 relative (measured: 1.7e-3); a mean near 0 has no relative scale of its own, so means to
#   2^-6 of the activations' standard deviation sqrt(var), the scale they are measured on
#   (measured: 1.7e-3 absolute with sqrt(var) ~ 0.9).
LOSS_RTOL = 2.0 ** -7
STATS_TOL = 2.0 ** -6
# bf16 really ran: besides the dtypes traced, some step's loss differs from fp32's by more than the
# fp32 sharded runs do (equal to the reference within 2e-5 relative, test_any_model_training).
FP32_NOISE = 5e-5

MODELS = ("llama", "cnn")


def recording(loss_fn, seen):
    """loss_fn, appending the dtypes of every parameter and batch leaf to `seen` at each trace."""
    def loss(params, batch):
        seen.append(({jax.tree_util.keystr(p, simple=True, separator="/"): str(x.dtype)
                      for p, x in jax.tree_util.tree_flatten_with_path(params)[0]},
                     {k: str(v.dtype) for k, v in batch.items()}))
        return loss_fn(params, batch)
    return loss


def bf16_body(ctx, comm, precision):
    if comm == "collective":
        from jaxodc.launch.context import init_jax_distributed
        init_jax_distributed(ctx)
    import jaxodc
    from jaxodc.train.export import full_params
    out = {}
    for case in MODELS:  # both models in the same processes: one start-up for both
        loss_fn, params, batch, count, policy = CASES[case]()
        seen = []
        step_fn = jaxodc.sharded_step(recording(loss_fn, seen), optimizer(), comm=comm, unit_policy=policy,
                                      precision=precision)
        tr = step_fn.init(params, ctx=ctx, example_batch=batch(0, 0, 0))
        n = counts(ctx.world, comm)
        losses = []
        for step in range(STEPS):
            total = sum(count(batch(step, r, j)) for r in range(ctx.world) for j in range(n[r]))
            losses.append(tr.train_minibatch([batch(step, ctx.rank, j) for j in range(n[ctx.rank])], total).loss)
        full = jax.tree_util.tree_map(host, full_params(tr))
        tr.close()
        out[case] = (losses, full, seen)
    return out


def leaves_by_path(tree):
    return {jax.tree_util.keystr(p, simple=True, separator="/"): host(x)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("comm, precision", [("odc", "bf16"), ("collective", "bf16"),
                                             ("collective", "bf16,reduce=fp32")])
def test_bf16_training_tracks_fp32(comm, precision):
    """(The collective also with its reduce-scatter in fp32: MixedPrecision.reduce_dtype.)"""
    results = run_ranks(bf16_body, 2, args=(comm, precision), timeout_s=300)
    for case in MODELS:
        ref_losses, ref_params = reference(case, comm, 2)
        ref = leaves_by_path(ref_params)
        batch = CASES[case]()[2](0, 0, 0)
        float_inputs = {k for k, v in batch.items() if np.issubdtype(v.dtype, np.floating)}
        assert float_inputs and len(float_inputs) < len(batch)  # both kinds of input are checked
        for rank, got in enumerate(results):
            losses, full, seen = got[case]
            where = f"{case} {comm} rank {rank}"
            # bf16 happened: the loss was traced with every trained leaf (gathered) and every float
            # input in bf16, integer inputs (tokens, labels) as they were, constants (the BatchNorm
            # statistics) in fp32 ...
            trained = {p for p in ref if not p.startswith("batch_stats/")
                       and np.issubdtype(ref[p].dtype, np.floating)}
            bf16_traces = [(p, b) for p, b in seen if all(p[k] == "bfloat16" for k in trained)]
            assert bf16_traces, f"{where}: no trace saw the gathered leaves in bf16"
            for p, b in bf16_traces:
                assert all(b[k] == ("bfloat16" if k in float_inputs else str(batch[k].dtype)) for k in b), (where, b)
                assert all(p[k] == "float32" for k in ref if k.startswith("batch_stats/")), (where, p)
            # ... and its losses are not fp32's
            rel = np.abs(np.asarray(losses) - ref_losses) / np.abs(ref_losses)
            assert rel.max() > FP32_NOISE, f"{where}: bf16 losses equal fp32's to {rel.max():.1e}"
            # it tracks fp32 training
            np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL, err_msg=where)
            # masters stay fp32, finite; the BatchNorm statistics too, and near fp32's
            params = leaves_by_path(full)
            assert params.keys() == ref.keys()
            for path, x in params.items():
                assert x.dtype == ref[path].dtype and x.shape == ref[path].shape, (where, path)
                if np.issubdtype(x.dtype, np.floating):
                    assert np.isfinite(x).all(), (where, path)
                if path.endswith("/var"):
                    assert x.dtype == np.float32
                    np.testing.assert_allclose(x, ref[path], rtol=STATS_TOL, err_msg=f"{where} {path}")
                elif path.startswith("batch_stats/"):  # the mean: to STATS_TOL standard deviations
                    assert x.dtype == np.float32 and path.endswith("/mean")
                    scale = np.sqrt(ref[path[:-len("mean")] + "var"])
                    err = np.abs(x - ref[path]) / scale
                    assert err.max() <= STATS_TOL, f"{where} {path}: off by {err.max():.2e} standard deviations"
            # every rank holds the same parameters and statistics
            if rank:
                for path, x in params.items():
                    np.testing.assert_array_equal(x, leaves_by_path(results[0][case][1])[path], err_msg=path)
        if case == "cnn":  # the statistics moved: the comparison above is not between initial values
            stats = {p: x for p, x in ref.items() if p.startswith("batch_stats/")}
            assert len(stats) == 4 and all(np.abs(x - (1.0 if p.endswith("var") else 0.0)).max() > 1e-2
                                           for p, x in stats.items())


# -- cast_inputs: the batch's float leaves in the compute dtype ------------------------------------

def _program(stateful: bool):
    from jaxodc.modeling.program import program_of
    params = {"w": jnp.asarray(np.random.RandomState(0).standard_normal((3, 2)), jnp.float32),
              "stats": jnp.zeros(2, jnp.float32)}
    seen = []

    def loss_fn(p, b):
        seen.append({k: v.dtype for k, v in b.items()} | {"w": p["w"].dtype})
        h = b["x"] @ p["w"]
        loss = jnp.sum(h[jnp.arange(4), b["y"]] * b["mask"])
        return (loss, {"stats": jnp.mean(h, axis=0).astype(jnp.float32)}) if stateful else loss

    batch = {"x": np.random.RandomState(1).standard_normal((4, 3)).astype(np.float32),
             "y": np.array([0, 1, 1, 0], np.int32),
             # a weight bf16 cannot hold (its spacing at 1 is 2^-7): the state's weight must be
             # computed from the batch as given
             "mask": np.array([1.0, 1.0, 1.0, 1.0009765625], np.float32)}
    prog = program_of(loss_fn, params, 1, example_batch=batch, frozen=("stats",))
    return prog, params, batch, seen


@pytest.mark.parametrize("stateful", [False, True])
def test_float_inputs_cast_under_bf16_and_untouched_under_fp32(stateful):
    from jaxodc.modeling.program import cast_inputs
    prog, params, batch, seen = _program(stateful)
    shards = {k: jnp.asarray(v) for k, v in prog.shard(params, 0).items()}
    for dtype in (jnp.bfloat16, jnp.float32):
        del seen[:]
        fn = jax.jit(prog.grad(lambda s, spec, ctx, dtype=dtype: s.astype(dtype), dtype))
        out, grads = fn(shards, prog.consts, batch, jnp.float32(2.0), None)
        # the loss saw the float leaves (x, mask) in the compute dtype, the int labels as int32
        assert seen and all(s == {"x": dtype, "mask": dtype, "y": jnp.int32, "w": dtype} for s in seen), seen
        x, w, mask = (np.asarray(jnp.asarray(a, dtype), np.float64) for a in (batch["x"], params["w"], batch["mask"]))
        h = x @ w
        want = np.sum(h[np.arange(4), batch["y"]] * mask) / 2.0
        loss = out[0] if stateful else out
        # fp32: the same math; bf16: from bf16-rounded inputs, the product and the sum rounded too
        np.testing.assert_allclose(loss, want, rtol=1e-6 if dtype == jnp.float32 else 2 ** -6)
        assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads))  # fp32 to the owners
        if stateful:  # the state's weight: the uncast mask's sum (bf16 would make it 4.0)
            count = float(np.sum(batch["mask"], dtype=np.float32))
            assert count != 4.0
            np.testing.assert_array_equal(np.asarray(out[1])[-1], np.float32(count))
            np.testing.assert_allclose(np.asarray(out[1])[:-1], count * h.mean(axis=0),
                                       rtol=1e-6 if dtype == jnp.float32 else 2 ** -6)
    # directly: fp32 leaves the batch as it is; bf16 casts float leaves only, of any float dtype
    assert cast_inputs(batch, jnp.float32) is batch
    mixed = {"a": np.ones(2, np.float64), "b": np.ones(2, np.float16), "i": np.ones(2, np.int64),
             "u": np.ones(2, np.uint8), "f": np.ones(2, bool), "nested": [np.ones(1, np.float32)]}
    got = jax.tree_util.tree_map(lambda v: v.dtype, cast_inputs(mixed, jnp.bfloat16))
    assert got == {"a": jnp.bfloat16, "b": jnp.bfloat16, "i": np.int64, "u": np.uint8, "f": np.bool_,
                   "nested": [jnp.bfloat16]}
