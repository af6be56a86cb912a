"""The Trainer / sharded_step API on 2 processes (comm="odc"; the collective Trainer runs in
test_train_cli): ranks configured differently are refused with an error naming each field and
every rank's value; bad input (empty minibatch, a sample longer than max_tokens) fails clearly; a
Trainer's fit matches the single-process reference; a Trainer restored from a checkpoint continues
the minibatch stream bit-identically to the uninterrupted run; the per-unit-function form of
sharded_step computes what the model form does.

Samples are at most 32 tokens and a microbatch holds 128, so every rank packs its part of a
minibatch into at most one microbatch: each owner adds at most two pushes per unit (which commute
exactly), so the ODC run is deterministic and resumption can be checked bit for bit."""
import os

import numpy as np
import pytest

from harness import error_text, run_ranks

W, B, MAX_LEN, MAX_TOKENS, LR, CLIP, EPS = 2, 2, 32, 128, 1e-2, 0.05, 1e-5
# Adam's g / (sqrt(v) + eps) magnifies fp32 rounding of near-zero gradients (owners sum in another
# order than the reference); eps = 1e-5 keeps that below atol while every parameter still moves.


def _setup(n_layers=1):
    import jax
    from jaxodc.data import synthetic_text
    from jaxodc.models.lm import LM, LMConfig
    model = LM(LMConfig(d_model=16, n_layers=n_layers, n_heads=2))
    return model, model.init(jax.random.PRNGKey(0)), synthetic_text("longalign", 16, MAX_LEN, seed=3, min_len=4)


def _optimizer(clip):
    import optax
    return optax.chain(clip(CLIP), optax.adam(LR, eps=EPS))


def api_body(ctx, root):
    import jax
    import optax
    from jaxodc.train.api import Trainer, sharded_step
    from jaxodc.optim.clipping import clip_by_global_norm
    model, params, samples = _setup()
    opt = lambda: _optimizer(clip_by_global_norm)  # noqa: E731
    r = ctx.rank
    out = {}

    # -- configs that differ across ranks are refused before anything starts
    def make(**kw):
        args = dict(comm="odc", balance="lb_mini", max_tokens=MAX_TOKENS, params=params, ctx=ctx)
        args.update(kw)
        m = args.pop("model", model)
        return Trainer(m, args.pop("optimizer", opt()), **args)

    out["cfg_balance"] = error_text(lambda: make(balance=["lb_mini", "lb_steal"][r], max_tokens=[32, 64][r]))
    # (the comm check runs before the collective trainer would need jax.distributed)
    out["cfg_comm"] = error_text(lambda: make(comm=["odc", "collective"][r], balance="lb_micro"))
    out["cfg_opt"] = error_text(lambda: make(optimizer=[opt(), optax.sgd(0.1)][r]))
    other, other_params, _ = _setup(n_layers=1 + r)
    out["cfg_layout"] = error_text(lambda: make(model=other, params=other_params))

    # -- bad input, then training that the reference checks; save after the first minibatch
    ck = os.path.join(root, "ck")
    with make() as tr:
        long = np.arange(MAX_TOKENS + 8, dtype=np.int32) % 200 + 1
        out["empty"] = error_text(lambda: tr.train_minibatch([]))
        out["too_long"] = error_text(lambda: tr.train_minibatch([samples[0], long]))
        recs = tr.fit(samples.tokens, minibatch=B, steps=1, seed=2)
        tr.save(ck)
        recs += tr.fit(samples.tokens, minibatch=B, steps=3, seed=2)
        out["records"] = [(x.step, x.samples, x.loss, len(x.compute)) for x in recs]
        out["summary"] = tr.summary()
        out["params"] = tr.full_params()
    # -- a new trainer (and runtime) resumes from the checkpoint
    with make() as t2:
        out["restored_step"] = t2.restore(ck)
        recs = t2.fit(samples.tokens, minibatch=B, steps=3, seed=2)
        out["resumed"] = ([(x.step, x.loss) for x in recs], t2.full_params())

    # -- sharded_step as a decorator over a per-unit function == over the model
    from jaxodc.models.mlp import MLP
    mlp = MLP((4, 8, 3))

    @sharded_step(optimizer=opt(), units=mlp.unit_names, comm="odc")
    def by_unit(name, p, carry, batch):
        return mlp.apply_unit(name, p, carry, batch)

    rng = np.random.default_rng(r)
    mb = {"x": rng.normal(size=(5, 4)).astype(np.float32), "y": rng.integers(0, 3, 5).astype(np.int32),
          "mask": np.ones(5, np.float32)}
    ntok = 10.0
    losses = []
    for step in (by_unit, sharded_step(mlp, opt(), comm="odc")):
        st = step.init(mlp.init(jax.random.PRNGKey(1)), ctx=ctx)
        losses.append([st.train_minibatch([mb], ntok).loss for _ in range(2)] + [st.local_shards()])
        st.close()
    out["decorated"] = losses
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(api_body, W, args=(str(tmp_path_factory.mktemp("api")),), timeout_s=240)


def test_mismatched_configs_name_field_and_every_rank(results):
    for r, out in enumerate(results):
        msg = out["cfg_balance"]
        assert msg.startswith(f"ConfigMismatchError: rank {r}: ranks disagree on the trainer config"), msg
        assert "balance (rank 0: 'lb_mini', rank 1: 'lb_steal')" in msg and "max_tokens (rank 0: 32, rank 1: 64)" in msg, msg
        assert "comm (rank 0: 'odc', rank 1: 'collective')" in out["cfg_comm"], out["cfg_comm"]
        assert "optimizer-state structure (rank 0: '" in out["cfg_opt"] and "balance" not in out["cfg_opt"], out["cfg_opt"]
        assert "layout fingerprint (rank 0: '" in out["cfg_layout"], out["cfg_layout"]


def test_bad_input_is_reported(results):
    for r, out in enumerate(results):
        assert out["empty"] == f"ValueError: rank {r}: empty minibatch: no samples to train on", out["empty"]
        assert f"sample 1 has length {MAX_TOKENS + 8} > max_tokens={MAX_TOKENS}" in out["too_long"], out["too_long"]


def test_odc_trainer_fit_matches_reference(results):
    import jax
    import optax
    from jaxodc.balance.plan import make_plan
    from jaxodc.train.core import microbatches_for, plan_global_tokens
    from jaxodc.balance.cost import CostModel
    from jaxodc.data import minibatches
    from jaxodc.train.reference import ReferenceTrainer
    model, params, samples = _setup()
    ref = ReferenceTrainer(model, _optimizer(optax.clip_by_global_norm), params)
    losses = []
    for _, idx in zip(range(3), minibatches(len(samples), W * B, seed=2)):
        sub = [samples[i] for i in idx]
        plan = make_plan("lb_mini", [len(x) for x in sub], W, MAX_TOKENS, CostModel())
        losses.append(ref.step([m for r in range(W) for m in microbatches_for(plan, r, sub)], plan_global_tokens(plan)))
    for out in results:
        recs = out["records"]
        assert [x[0] for x in recs] == [0, 1, 2]
        assert all(x[3] <= 1 for x in recs)  # at most one microbatch per rank (see the docstring)
        np.testing.assert_allclose([x[2] for x in recs], losses, rtol=1e-5)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(out["params"]),
                                jax.tree_util.tree_leaves(ref.numpy_params())):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=5e-6, err_msg=jax.tree_util.keystr(path))
        s = out["summary"]
        assert s["steps"] == 3 and s["ranks"] == W and s["samples_per_s"] > 0 and 0 <= s["bubble_rate"] < 1
        assert s["loss"] == recs[-1][2]
    assert sum(x[1] for out in results for x in out["records"]) == 3 * W * B  # every sample once


def test_resumed_trainer_continues_bit_exactly(results):
    import jax
    for out in results:
        assert out["restored_step"] == 1
        full_recs, full = [(x[0], x[2]) for x in out["records"][1:]], out["params"]
        res_recs, resumed = out["resumed"]
        assert [s for s, _ in full_recs] == [s for s, _ in res_recs] == [1, 2]
        assert [l for _, l in full_recs] == [l for _, l in res_recs]
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(full), jax.tree_util.tree_leaves(resumed)):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes(), jax.tree_util.keystr(path)


def test_sharded_step_decorator_equals_model_form(results):
    for out in results:
        (l1, l2, s1), (m1, m2, s2) = out["decorated"]
        assert [l1, l2] == [m1, m2] and l2 != l1
        for n in s1:
            assert s1[n].tobytes() == s2[n].tobytes(), n


def test_sharded_step_argument_errors():
    import optax
    from jaxodc.train.api import Trainer, sharded_step
    model, _, _ = _setup()
    with pytest.raises(ValueError, match="needs units="):
        sharded_step(lambda n, p, c, b: c, optax.sgd(0.1))
    with pytest.raises(ValueError, match="unknown comm='nccl'"):
        sharded_step(model, optax.sgd(0.1), comm="nccl")
    with pytest.raises(ValueError, match="needs optimizer="):
        sharded_step(model)
    with pytest.raises(ValueError, match="'lb_steal' .* needs comm='odc'"):
        Trainer(model, optax.sgd(0.1), comm="collective", balance="lb_steal", max_tokens=32)
    with pytest.raises(ValueError, match="unknown balance='kk'"):
        Trainer(model, optax.sgd(0.1), balance="kk", max_tokens=32)
