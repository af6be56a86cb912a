"""Straggler injection (jaxodc.train.straggle): the spec and its parser, deterministic slowdowns
keyed on a microbatch's identity rather than the rank that runs it, and both trainers honouring it
across 2 processes -- ODC with LB-Steal trains the same parameters as without injection."""
import dataclasses
import types

import numpy as np
import pytest

from harness import run_ranks
from jaxodc.train.straggle import Straggle, compile_seconds, microbatch_identity, parse_straggle, stall

from test_odc_trainer import B, MAX_TOKENS, STEPS, W, _setup  # the same model and data as the ODC trainer tests

LR = 1e-2
# Rank 0 is throttled in minibatches 1-2 (where it holds every microbatch: rank 1 can only steal),
# half the microbatches are slowed wherever they run, and a rank is throttled at random in some.
ODC_STRAGGLE = Straggle(p=0.75, rank_p=0.3, factor=3.0, rank=0, window=(1, 3), seed=7)


# -- the spec ---------------------------------------------------------------------------------

def test_parse_round_trips():
    s = parse_straggle("p=0.2,factor=3,rank=1,window=2:5,seed=4")
    assert s == Straggle(p=0.2, factor=3.0, rank=1, window=(2, 5), seed=4)
    assert parse_straggle(s.spec()) == s
    assert parse_straggle(" p = 0.5 ") == Straggle(p=0.5)
    assert parse_straggle("none") is None and parse_straggle("") is None and parse_straggle(None) is None
    assert parse_straggle("default") == Straggle.default() == Straggle(p=0.05, rank_p=0.05, factor=3.0, seed=0)
    assert Straggle.default().spec() == "p=0.05,rank_p=0.05,factor=3,seed=0"
    assert parse_straggle(Straggle.default().spec()) == Straggle.default()
    both = parse_straggle("p=0.1,rank_p=0.2,factor=2")
    assert both == Straggle(p=0.1, rank_p=0.2, factor=2.0) and parse_straggle(both.spec()) == both


@pytest.mark.parametrize("spec, words", [
    ("p=1.5", ["p:", "[0, 1]", "1.5"]),
    ("rank_p=-0.1", ["rank_p:", "[0, 1]", "-0.1"]),
    ("rank_p=y", ["rank_p must be a number", "'y'"]),
    ("p=x", ["p must be a number", "'x'"]),
    ("factor=0.5", ["factor:", ">= 1", "0.5"]),
    ("factor=inf", ["factor:", "finite"]),
    ("rank=1", ["window:", "rank and window go together"]),
    ("window=1:3", ["rank:", "rank and window go together"]),
    ("rank=1,window=3:3", ["window:", "start < stop"]),
    ("rank=1,window=3", ["window must be start:stop"]),
    ("rank=-1,window=0:2", ["rank:", ">= 0"]),
    ("rank=1.5,window=0:2", ["rank must be an integer", "'1.5'"]),
    ("seed=-2", ["seed:", ">= 0"]),
    ("speed=2", ["key=value pairs over p, rank_p, factor, rank, window, seed", "'speed=2'"]),
    ("p=0.1,p=0.2", ["p given twice"]),
])
def test_parse_errors_name_the_field(spec, words):
    with pytest.raises(ValueError) as e:
        parse_straggle(spec)
    msg = str(e.value)
    assert msg.startswith(f"--straggle {spec!r}: "), msg
    assert all(w in msg for w in words), msg


def test_throttled_rank_must_exist():
    Straggle(rank=1, window=(0, 1)).check_world(2)
    with pytest.raises(ValueError, match="straggle rank: 2 is not a rank of this 2-rank job"):
        Straggle(rank=2, window=(0, 1)).check_world(2)


# -- determinism --------------------------------------------------------------------------------

def _slowed(spec, step, n=200):
    return [i for i in range(n) if spec.slowed(step, microbatch_identity(0, 0, [(i, i + 1)]))]


def test_random_slowdowns_are_seeded_and_ignore_the_rank():
    spec = Straggle(p=0.25, factor=2.0, seed=3)
    hits = _slowed(spec, 5)
    assert hits == _slowed(Straggle(p=0.25, factor=2.0, seed=3), 5)  # same seed, same microbatches
    assert hits != _slowed(Straggle(p=0.25, factor=2.0, seed=4), 5)  # another seed, others
    assert hits != _slowed(spec, 6)  # another minibatch, others
    assert 20 < len(hits) < 80  # about p of them
    # A stolen microbatch keeps its identity (its sample indices) and so its slowdown.
    ids = [(3, 9), (4,)]
    for m, sample_ids in enumerate(ids):
        on0 = microbatch_identity(0, m, ids)
        on1 = microbatch_identity(1, 5 - m, [(), (), (), (), (4,), (3, 9)])
        assert on0 == on1 == ("samples", sample_ids)
        assert spec.slowdown(5, 0, on0) == spec.slowdown(5, 1, on1)
    # Without sample indices (raw or all-padding microbatches) the rank and position identify it.
    assert microbatch_identity(1, 2) == microbatch_identity(1, 2, [(1,), (2,), ()]) == ("position", 1, 2)
    assert Straggle(p=0.0).slowdown(0, 0, ("position", 0, 0)) == 1.0
    assert Straggle(p=1.0, factor=2.5).slowdown(0, 0, ("position", 0, 0)) == 2.5


def test_random_throttle_follows_the_rank_and_pins():
    spec = Straggle(rank_p=0.3, factor=2.0, seed=5)
    draws = [[spec.throttles(step, r) for r in range(4)] for step in range(200)]
    assert draws == [[Straggle(rank_p=0.3, factor=2.0, seed=5).throttles(s, r) for r in range(4)] for s in range(200)]
    assert 150 < sum(map(sum, draws)) < 330  # about rank_p of 800
    assert any(row[0] != row[1] for row in draws)  # ranks drawn on their own
    for step, row in enumerate(draws):  # the whole minibatch on that rank, whatever the microbatch
        for r, hit in enumerate(row):
            assert {spec.slowdown(step, r, ("samples", (i,))) for i in range(5)} == {2.0 if hit else 1.0}
    # pinned: every caller's step reads as the pinned minibatch (bench train: the data minibatch)
    pinned = dataclasses.replace(spec, pinned=17)
    assert [pinned.throttles(step, 1) for step in range(5)] == [spec.throttles(17, 1)] * 5
    assert pinned.spec() == spec.spec()
    assert dataclasses.replace(Straggle(p=0.5), pinned=3).slowed(9, ("position", 0, 0)) == \
        Straggle(p=0.5).slowed(3, ("position", 0, 0))
    assert dataclasses.replace(Straggle(rank=1, window=(2, 4)), pinned=3).throttles(0, 1) == 1


def test_throttle_window_and_composition():
    spec = Straggle(p=1.0, factor=2.0, rank=1, window=(2, 4))
    ident = ("position", 0, 0)
    assert [spec.slowdown(step, 1, ident) for step in range(6)] == [2.0, 2.0, 4.0, 4.0, 2.0, 2.0]
    assert [spec.slowdown(step, 0, ident) for step in range(6)] == [2.0] * 6


def test_stall_sleeps_factor_minus_one_times_the_compute():
    import time
    res = types.SimpleNamespace(straggle_s=[])
    spec = Straggle(p=1.0, factor=3.0)
    t0, compiled0 = time.perf_counter(), compile_seconds()
    time.sleep(0.02)  # the "compute"
    stall(spec, res, 0, 0, ("position", 0, 0), t0, compiled0)
    took = time.perf_counter() - t0
    assert len(res.straggle_s) == 1 and 0.04 <= res.straggle_s[0] < 0.1, res.straggle_s
    assert took >= 3 * 0.02
    stall(Straggle(p=0.0), res, 0, 0, ("position", 0, 0), time.perf_counter(), compile_seconds())
    assert res.straggle_s[1] == 0.0
    stall(None, res, 0, 0, ("position", 0, 0), time.perf_counter(), compile_seconds())  # no spec: nothing recorded
    assert len(res.straggle_s) == 2
    # jax compilation inside the microbatch is not compute: a first call does not sleep 2x its compile time
    import jax
    import jax.numpy as jnp
    t0, compiled0 = time.perf_counter(), compile_seconds()
    jax.jit(lambda x: jnp.tanh(x) @ x + 0.5)(jnp.ones((32, 32))).block_until_ready()
    wall = time.perf_counter() - t0
    stall(spec, res, 0, 0, ("position", 0, 0), t0, compiled0)
    assert compile_seconds() > compiled0 and res.straggle_s[2] < 2 * wall, (res.straggle_s, wall)


# -- the trainers -------------------------------------------------------------------------------

def _steal_plans(samples, mbs):
    """LB-Steal plans; from minibatch 1 on, every microbatch sits in rank 0's deque."""
    from jaxodc.balance.cost import CostModel
    from jaxodc.balance.plan import Plan, lb_steal
    plans = []
    for step, idx in enumerate(mbs):
        plan = lb_steal(samples.lengths[idx].tolist(), W, MAX_TOKENS, CostModel.for_transformer(32))
        if step >= 1:
            plan = Plan(plan.balance, W, MAX_TOKENS, plan.lengths, (plan.ranks[0] + plan.ranks[1], ()))
        plans.append(plan)
    return plans


def odc_body(ctx):
    import optax
    from jaxodc.data import Samples
    from jaxodc.odc import Runtime
    from jaxodc.train.odc import OdcTrainer
    from jaxodc.modeling.units import make_layout
    model, params, samples, mbs = _setup()
    layout = make_layout(params, W, order=model.unit_names)
    rt = Runtime.create([u.padded for u in layout.units], ctx)
    tr = OdcTrainer(model, optax.adam(LR), params, rt, straggle=ODC_STRAGGLE)
    steps = []
    for plan, idx in zip(_steal_plans(samples, mbs), mbs):
        res = tr.train_plan(plan, Samples([samples[i] for i in idx]).tokens)
        steps.append({"ran": res.ran, "straggle_s": res.straggle_s, "intervals": res.microbatches})
    shards = tr.local_shards()
    rt.close()
    return steps, shards


def test_odc_lb_steal_with_injection_trains_the_same_parameters():
    import jax
    from jaxodc.balance.packing import pack
    from jaxodc.data import Samples
    from jaxodc.train.core import plan_global_tokens
    from jaxodc.train.reference import ReferenceTrainer
    from jaxodc.modeling.units import make_layout, unshard_params
    import optax

    results = run_ranks(odc_body, W, timeout_s=240)
    model, params, samples, mbs = _setup()
    plans = _steal_plans(samples, mbs)
    for step, plan in enumerate(plans):
        ran = [mb for r in range(W) for mb in results[r][0][step]["ran"]]
        assert sorted(ran) == sorted(mb for r in plan.ranks for mb in r)  # each microbatch ran once
        for r in range(W):
            rec = results[r][0][step]
            assert len(rec["straggle_s"]) == len(rec["ran"]) == len(rec["intervals"])
            for mb, delay, (t0, t1) in zip(rec["ran"], rec["straggle_s"], rec["intervals"]):
                slowdown = ODC_STRAGGLE.slowdown(step, r, ("samples", tuple(mb)))
                # slowed exactly where the spec says, wherever the microbatch ran; the interval holds the sleep
                assert (delay > 0) == (slowdown > 1), (step, r, mb, delay, slowdown)
                assert t1 - t0 >= delay
    stolen = [d for rec in results[1][0][1:] for d in rec["straggle_s"]]
    assert stolen, "rank 1 stole nothing from the throttled rank 0"
    assert any(d > 0 for d in stolen), stolen  # a slowed microbatch stays slowed on the thief

    # The run without injection: the single-process reference (test_odc_trainer checks the
    # un-injected ODC LB-Steal run against it with the same tolerance). Owners add microbatch
    # gradients in arrival order, which injection reorders; Adam magnifies that last-bit
    # difference for near-zero gradients, hence atol (as in test_odc_trainer).
    ref = ReferenceTrainer(model, optax.adam(LR), params)
    for plan, idx in zip(plans, mbs):
        sub = Samples([samples[i] for i in idx])
        ref.step([pack([sub.tokens[i] for i in mb], MAX_TOKENS).as_dict() for r in plan.ranks for mb in r],
                 plan_global_tokens(plan))
    got = unshard_params(make_layout(params, W, order=model.unit_names), [r[1] for r in results])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(ref.numpy_params())):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1.5e-5, err_msg=jax.tree_util.keystr(path))


COLLECTIVE_STRAGGLE = Straggle(p=0.5, factor=2.0, rank=1, window=(0, 2), seed=1)


def collective_body(ctx):
    import optax
    from jaxodc.balance.cost import CostModel
    from jaxodc.balance.plan import lb_micro
    from jaxodc.launch.context import init_jax_distributed
    init_jax_distributed(ctx)
    from jaxodc.data import Samples
    from jaxodc.train.api import Trainer
    model, params, samples, mbs = _setup()
    tr = Trainer(model, optax.adam(LR), comm="collective", balance="lb_micro", max_tokens=MAX_TOKENS, params=params,
                 ctx=ctx, straggle=COLLECTIVE_STRAGGLE)
    steps = []
    for idx in mbs[:2]:
        plan = lb_micro(samples.lengths[idx].tolist(), W, MAX_TOKENS, CostModel.for_transformer(32))
        res = tr.state.train_plan(plan, Samples([samples[i] for i in idx]).tokens)
        steps.append({"plan": plan.ranks[ctx.rank], "straggle_s": res.straggle_s, "intervals": res.microbatches})
    record = tr.fit(samples.tokens, mbs[2:3])[0]  # records carry the delays too
    tr.close()
    return steps, record.straggle_s, len(record.compute)


def test_collective_trainer_honours_injection():
    results = run_ranks(collective_body, W, timeout_s=240)
    for r, (steps, record_delays, record_mbs) in enumerate(results):
        for step, rec in enumerate(steps):
            assert len(rec["straggle_s"]) == len(rec["intervals"]) > 0
            for m, (delay, (t0, t1)) in enumerate(zip(rec["straggle_s"], rec["intervals"])):
                slowdown = COLLECTIVE_STRAGGLE.slowdown(step, r, microbatch_identity(r, m, rec["plan"]))
                assert (delay > 0) == (slowdown > 1), (step, r, m, delay, slowdown)
                assert t1 - t0 >= delay
        assert len(record_delays) == record_mbs > 0  # minibatch 2: outside rank 1's window
    assert all(d > 0 for rec in results[1][0] for d in rec["straggle_s"])  # rank 1 throttled throughout
    assert any(d == 0 for rec in results[0][0] for d in rec["straggle_s"])  # rank 0: only the random ones
