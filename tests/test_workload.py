"""The paper's workload as the benchmarks run it: preset lengths at the default scale, packed rows
whose cost follows the samples, the accelerator cost model, the simulator's replay of given
minibatches, emulated compute through the straggler sleep, and the paired bootstrap."""
import time
import types

import numpy as np
import pytest

from jaxodc.balance.cost import CostModel
from jaxodc.balance.plan import make_plan
from jaxodc.balance.simulate import bubble_rate, ceiling, plan_times, replay
from jaxodc.data import PRESETS, sample_lengths

MAX = 2048  # the default longest sample of `jaxodc demo` and `bench train`


@pytest.mark.parametrize("preset,floor,at_max", [("longalign", 0.12, (0.02, 0.06)), ("swe", 0.2, (0.0, 0.03))])
def test_preset_lengths_at_the_default_scale(preset, floor, at_max):
    L = sample_lengths(preset, 20000, MAX, seed=3)
    assert L.dtype == np.int64 and L.min() >= round(floor * MAX) and L.max() == MAX
    lo, hi = at_max
    assert lo <= np.mean(L == MAX) <= hi  # the long tail that reaches the cap (data.py's docstring)
    # lognormal shift + median * exp(sigma N): the median sample is shift + median of the cap
    shift, median = PRESETS[preset]["mix"][0][4], PRESETS[preset]["mix"][0][2]
    assert np.median(L) == pytest.approx((shift + median) * MAX, rel=0.03)
    assert np.array_equal(L, sample_lengths(preset, 20000, MAX, seed=3))  # seeded
    assert not np.array_equal(L, sample_lengths(preset, 20000, MAX, seed=4))


def test_attention_dominates_a_long_sample_of_the_default_model():
    # d_model 64 (the demo's and bench train's model): a*s^2 against b*s with b/a = 12*d
    cost = CostModel.for_transformer(64)
    assert cost.attention_share(MAX) == pytest.approx(MAX / (MAX + 12 * 64))
    assert cost.attention_share(MAX) > 0.5 > cost.attention_share(0.12 * MAX)


def test_for_flops_by_hand():
    # Llama-3-8B on an H100 at 40% MFU: 6 FLOPs per parameter-token, 6*L*d per token^2
    f = 989.4e12 * 0.4
    cost = CostModel.for_flops(8.03e9, 32, 4096, f)
    s = 65536
    assert float(cost(s)) == pytest.approx((6 * 8.03e9 * s + 6 * 32 * 4096 * s * s) / f)
    assert cost.attention_share(s) == pytest.approx(6 * 32 * 4096 * s / (6 * 32 * 4096 * s + 6 * 8.03e9))
    sc = cost.scaled(512, 1e-2)  # run tokens of 512 modelled tokens each, times scaled by 1/100
    assert float(sc(128)) == pytest.approx(1e-2 * float(cost(128 * 512)))
    with pytest.raises(ValueError, match="positive"):
        CostModel.for_flops(0, 32, 4096, f)


def test_packed_row_cost_follows_the_samples():
    from jaxodc.balance.packing import pack
    cost = CostModel(2.0, 3.0, 5.0)
    lens = [100, 7, 300]
    p = pack([np.arange(L, dtype=np.int32) % 200 + 1 for L in lens], 512)
    # each sample is its own segment (attention within it only): cost = sum of the samples' a*s^2 + b*s, + c
    segs = [int(np.sum(p.segment_ids[0] == n + 1)) for n in range(len(lens))]
    assert segs == lens and int(np.sum(p.segment_ids[0] == 0)) == 512 - sum(lens)
    assert cost.microbatch(lens) == pytest.approx(5.0 + sum(2.0 * s * s + 3.0 * s for s in lens))
    assert cost.microbatch(lens) < CostModel(2.0, 3.0, 5.0).microbatch([sum(lens)])  # not one long sample


def test_lm_uses_segment_attention_on_packed_rows():
    import jax
    from jaxodc.balance.packing import pack
    from jaxodc.models.lm import LM, LMConfig
    model = LM(LMConfig(d_model=16, n_layers=1, n_heads=2))
    params = model.init(jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    a, b = rng.integers(1, 256, 40).astype(np.int32), rng.integers(1, 256, 25).astype(np.int32)

    def losses(samples, T):
        batch = pack(samples, T).as_dict()
        carry = None
        for name in model.unit_names:
            carry = model.apply_unit(name, params[name], carry, batch)
        return np.asarray(carry)[0]

    both = losses([a, b], 80)
    np.testing.assert_allclose(both[:40], losses([a], 40), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(both[40:65], losses([b], 25), rtol=2e-5, atol=2e-6)


def test_replay_and_ceiling_by_hand():
    # 2 ranks, one minibatch of lengths 4, 3, 2, 1 with cost s^2, cap 4 tokens.
    cost = CostModel(1.0, 0.0)
    lens = [4, 3, 2, 1]
    out = replay([lens], 2, 4, cost)
    for method in ("collective/lb_micro", "odc/lb_mini"):
        comm, bal = method.split("/")
        span, busy = plan_times(make_plan(bal, lens, 2, 4, cost), cost, comm)
        assert out[method]["time"] == pytest.approx(span)
        assert out[method]["bubble"] == pytest.approx(bubble_rate([(span, busy)]))
    # LB-Mini: {4} vs {3,2,1} = 16 vs 14 -> 16; LB-Micro: 2 samples each, equal microbatch counts
    assert out["odc/lb_mini"]["time"] == pytest.approx(16.0)
    assert ceiling(out) == pytest.approx(out["collective/lb_micro"]["time"] / 16.0)
    two = replay([lens, lens], 2, 4, cost)
    assert two["odc/lb_mini"]["time"] == pytest.approx(32.0) and ceiling(two) == pytest.approx(ceiling(out))


def test_emulated_compute_sleeps_the_samples_seconds():
    from jaxodc.train.straggle import Straggle, compile_seconds, microbatch_identity, stall
    spec = Straggle(pinned=0, emulate=(0.01, 0.02, 0.03), emulate_c=0.005)
    ident = microbatch_identity(0, 0, [(0, 2)])
    assert spec.emulated(ident) == pytest.approx(0.045)
    assert spec.emulated(microbatch_identity(1, 3)) == 0.0  # an all-padding microbatch
    assert spec.slowdown(0, 0, ident) == 1.0
    res = types.SimpleNamespace(straggle_s=[])
    t0 = time.perf_counter()
    stall(spec, res, 0, 0, ident, t0, compile_seconds())
    took = time.perf_counter() - t0
    assert res.straggle_s[0] == pytest.approx(0.045, abs=2e-3) and took >= 0.045
    # a slowdown multiplies the emulated compute too: factor 3 -> 3 x 0.045 (+ 2 x the real, ~0)
    slow = Straggle(p=1.0, factor=3.0, emulate=(0.01, 0.02, 0.03), emulate_c=0.005)
    stall(slow, res, 0, 0, ident, time.perf_counter(), compile_seconds())
    assert res.straggle_s[1] == pytest.approx(0.135, abs=3e-3)
    with pytest.raises(IndexError, match="sample 5"):
        spec.emulated(("samples", (5,)))
    with pytest.raises(ValueError, match="emulate"):
        Straggle(emulate=(0.1, -1.0))


def test_paired_bootstrap_against_a_direct_resampling():
    from jaxodc.bench.common import bootstrap, paired_ratio, pooled_ratio
    rng = np.random.default_rng(1)
    b = rng.uniform(1.0, 2.0, 12)
    a = b * rng.uniform(1.1, 1.3, 12)
    point, lo, hi = paired_ratio(a, b, n_boot=500, seed=7)
    r = a / b
    assert point == pytest.approx(np.median(r))
    g = np.random.default_rng(7)
    idx = [g.integers(0, 12, size=12) for _ in range(500)]  # the same draws, in order
    want = np.percentile([np.median(r[i]) for i in idx], [2.5, 97.5])
    assert (lo, hi) == pytest.approx(tuple(want))
    assert r.min() <= lo <= point <= hi <= r.max()
    # constant ratios: a degenerate interval
    assert paired_ratio(2 * b, b) == pytest.approx((2.0, 2.0, 2.0))
    # pooled: (sum samples / sum time) ratio; reps paired
    sa, ta, sb, tb = [4, 4, 4], [1.0, 2.0, 1.0], [4, 4, 4], [2.0, 2.0, 2.0]
    p, plo, phi = pooled_ratio(sa, ta, sb, tb)
    assert p == pytest.approx((12 / 4.0) / (12 / 6.0)) and plo <= p <= phi
    assert bootstrap(lambda i: 1.0, 1) == (1.0, 1.0, 1.0)


def test_demo_warm_up_compiles_every_timed_row_shape():
    from jaxodc.cli import demo
    args = demo._args(["--steps", "6", "--max-tokens", "1024", "--min-bucket", "128", "--samples", "256"])
    lengths = demo.demo_lengths(args)
    assert len(lengths) == 256 and lengths.max() <= 1024
    cost = CostModel(1e-9, 1e-6, 1e-3)
    warm = demo.warm_minibatches(args, lengths, cost)
    mbs = demo.demo_minibatches(args, lengths, warm + args.steps)
    shapes = [demo.row_shapes(args, lengths, idx, cost) for idx in mbs]
    timed = set().union(*shapes[warm:])
    assert timed <= set().union(*shapes[:warm])
    assert warm == 1 or not timed <= set().union(*shapes[:warm - 1])  # the fewest that do
    # ODC rows follow each microbatch's own bucket; the collective's the step's largest
    assert {T for _, _, T in timed} <= {128, 256, 512, 1024}
    args.warm = warm
    argv = demo.train_argv(args, cost)
    assert argv[argv.index("--warmup") + 1] == str(warm) and argv[argv.index("--steps") + 1] == str(warm + 6)
    assert argv[argv.index("--cost") + 1] == "1e-09,1e-06,0.001"


def test_train_cli_cost_option():
    import argparse
    from jaxodc.cli.train import cost_of
    assert cost_of(argparse.Namespace(cost="1e-9,2e-6,0.001", d_model=64)) == CostModel(1e-9, 2e-6, 1e-3)
    assert cost_of(argparse.Namespace(cost="", d_model=64)) == CostModel.for_transformer(64)
    for bad in ("x,1,2", "1,2,3,4", "1,-2,3"):
        with pytest.raises(ValueError, match="--cost|CostModel"):
            cost_of(argparse.Namespace(cost=bad, d_model=64))
