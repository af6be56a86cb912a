"""The owners' exact accumulation (csrc/odc/accumulator.h), the opt-in of reproducible runs
(accumulate="exact", reproducible=True): pushes in any order, and from any rank, give the same
bits, and those bits are the correctly rounded sum of the pushed values (each value on the 2^-80
grid, as designed), checked against an exact rational reference. The default is the fp32 sum;
`reproducible=` of sharded_step / Trainer reaches the runtime; GPU owners refuse the exact sum."""
import os
from fractions import Fraction

import numpy as np
import pytest

from harness import run_ranks
from odc_checks import wait_zeroed

FRAC_BITS = 80  # Accumulator::kFracBits
SIZES = [1000, 37]


def pushes(seed, count=8, sizes=SIZES):
    """`count` pushes per unit, magnitudes spread over 10^-12 .. 10^3 so that fp32 sums depend on
    their order; unit 1 also holds values below the grid's exact range (2^-57)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        p = {}
        for u, n in enumerate(sizes):
            x = rng.standard_normal(n) * 10.0 ** rng.uniform(-12, 3, n)
            if u == 1:
                x[::3] = rng.standard_normal(len(x[::3])) * 2.0 ** rng.uniform(-90, -50, len(x[::3]))
            p[u] = x.astype(np.float32)
        out.append(p)
    return out


def round_f32(q: Fraction) -> np.float32:
    """The fp32 nearest to q, ties to even."""
    f = np.float32(float(q))
    cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    def key(c):
        return (abs(Fraction(float(c)) - q), int(np.asarray(c).view(np.uint32)) & 1)
    return min(cands, key=key)


def reference(values) -> np.ndarray:
    """Each fp32 value put on the 2^-80 grid (nearest, ties to even: Python's round), summed
    exactly, rounded once to fp32."""
    scale = Fraction(2) ** FRAC_BITS
    n = len(values[0])
    out = np.empty(n, np.float32)
    for i in range(n):
        s = sum(round(Fraction(float(v[i])) * scale) for v in values)
        out[i] = round_f32(Fraction(s) / scale)
    return out


def bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def local_runtime(sizes, accumulate="exact"):
    from jaxodc.odc import Runtime
    return Runtime(sizes, rank=0, world=1, rendezvous=None, job_id=f"ex{os.getpid()}", device=None,
                   accumulate=accumulate)


def sums_in_order(order, data, sizes=SIZES, accumulate="exact"):
    """Every unit's summed gradient after pushing data[j] for j in `order` (one minibatch)."""
    with local_runtime(sizes, accumulate) as rt:
        for j in order:
            for u in range(len(sizes)):
                rt.scatter_accumulate(u, 0, data[j][u])
        rt.done(0)
        rt.wait_complete(0)
        return [rt.fetch_grad(u) for u in range(len(sizes))]


def test_permuted_pushes_give_identical_bits_equal_to_the_exact_reference():
    data = pushes(1)
    orders = [list(range(8)), list(range(7, -1, -1))] + [list(np.random.default_rng(s).permutation(8)) for s in (2, 3)]
    exact = [sums_in_order(o, data) for o in orders]
    for other in exact[1:]:
        for u in range(len(SIZES)):
            np.testing.assert_array_equal(bits(other[u]), bits(exact[0][u]))
    for u in range(len(SIZES)):
        np.testing.assert_array_equal(bits(exact[0][u]), bits(reference([p[u] for p in data])))
    # The same data summed in fp32 does depend on the order (else this test could not fail) ...
    plain = [sums_in_order(o, data, accumulate="fp32") for o in orders]
    assert any(np.any(bits(p[0]) != bits(plain[0][0])) for p in plain[1:])
    # ... and is never closer to the true sum than the exact accumulator (unit 0: all on the grid).
    true = np.sum([p[0].astype(np.float64) for p in data], axis=0)  # within 1e-16 relative: enough here
    for p in plain:
        assert np.all(np.abs(exact[0][0] - true) <= np.abs(p[0] - true) * (1 + 1e-6) + 1e-30)


def test_ties_round_to_even_and_cancellation_is_exact():
    one, half_ulp, ulp = np.float32(1), np.float32(2.0 ** -24), np.float32(2.0 ** -23)
    cases = [  # (pushed values, expected sum)
        ([one, half_ulp], one),                                      # tie -> even (1.0)
        ([one + ulp, half_ulp], np.float32(1 + 2.0 ** -22)),         # tie -> even (up)
        ([-one, -half_ulp], -one),
        ([one, half_ulp, np.float32(2.0 ** -60)], one + ulp),       # just past the tie
        ([np.float32(3e7), np.float32(1e-7), np.float32(-3e7)], np.float32(1e-7)),  # fp32 loses 1e-7 in order
    ]
    for vals, want in cases:
        for order in (vals, vals[::-1]):
            got = sums_in_order(range(len(order)), [{0: np.array([v], np.float32)} for v in order], sizes=[1])
            assert bits(got[0])[0] == bits(want), (order, got[0][0], want)


def test_values_outside_the_fixed_point_range():
    """inf, NaN and |x| >= 2^46 go to the double spill: IEEE results, the same in any order."""
    big = np.float32(2.0 ** 50)
    cols = [  # per element: pushed values, expected sum
        ([big, np.float32(1.0), -big], np.float32(1.0)),
        ([np.float32(np.inf), np.float32(1.0), np.float32(2.0)], np.float32(np.inf)),
        ([np.float32(np.inf), np.float32(-np.inf), np.float32(1.0)], np.float32(np.nan)),
        ([np.float32(np.nan), np.float32(1.0), np.float32(1.0)], np.float32(np.nan)),
        ([np.float32(0.5), np.float32(0.25), np.float32(-1.0)], np.float32(-0.25)),  # in-range beside them
    ]
    data = [{0: np.array([c[0][k] for c in cols], np.float32)} for k in range(3)]
    want = np.array([c[1] for c in cols], np.float32)
    for order in ([0, 1, 2], [2, 1, 0], [1, 0, 2]):
        got = sums_in_order(order, data, sizes=[len(cols)])[0]
        np.testing.assert_array_equal(got, want)  # NaN == NaN here


def test_accumulator_memory_and_the_switch(monkeypatch):
    monkeypatch.delenv("JAXODC_ODC_ACCUMULATE", raising=False)
    with local_runtime([1000], accumulate=None) as rt:  # the default: the fp32 sum, FSDP's memory
        assert rt.accumulate == "fp32" and rt.stats()["accum_bytes"] == 4032  # 4 B/element (64-B rounded)
    with local_runtime([1000]) as rt:
        assert rt.accumulate == "exact" and rt.stats()["accum_bytes"] == 16 * 1000  # 16 B/element
    monkeypatch.setenv("JAXODC_ODC_ACCUMULATE", "exact")
    with local_runtime([1000], accumulate=None) as rt:
        assert rt.accumulate == "exact" and rt.stats()["accum_bytes"] == 16 * 1000
    with local_runtime([1000], accumulate="fp32") as rt:  # an explicit argument wins over the env
        assert rt.accumulate == "fp32"
    monkeypatch.setenv("JAXODC_ODC_ACCUMULATE", "fast")
    with pytest.raises(ValueError, match="JAXODC_ODC_ACCUMULATE='fast'"):
        local_runtime([10], accumulate=None)


def test_exact_sum_is_refused_for_gpu_owners(monkeypatch):
    """Pushes into a device accumulator are summed in fp32 in arrival order: "exact" there is
    refused, naming the rank (no GPU needed: the check is on the resolved device ordinal)."""
    from jaxodc.odc.runtime import accumulate_mode
    with pytest.raises(ValueError, match=r"rank 3: accumulate='exact' \(reproducible=True\) is implemented for "
                                         r"CPU owners only: .*CUDA device 1"):
        accumulate_mode("exact", 3, 1)
    monkeypatch.setenv("JAXODC_ODC_ACCUMULATE", "exact")
    with pytest.raises(ValueError, match="rank 0: JAXODC_ODC_ACCUMULATE='exact'.*CPU owners only"):
        accumulate_mode(None, 0, 0)
    assert accumulate_mode("fp32", 0, 0) == "fp32" and accumulate_mode(None, 0, None) == "exact"


def _trainer_sum(monkeypatch, env, **kw):
    """The accumulate mode of the runtime sharded_step(...).init(ctx=) creates for one rank."""
    from types import SimpleNamespace
    import jax
    import optax
    from jaxodc.models.mlp import MLP
    from jaxodc.train.api import sharded_step
    if env is None:
        monkeypatch.delenv("JAXODC_ODC_ACCUMULATE", raising=False)
    else:
        monkeypatch.setenv("JAXODC_ODC_ACCUMULATE", env)
    model = MLP((4, 8, 2))
    ctx = SimpleNamespace(rank=0, world=1, rendezvous=None, job_id=f"rp{os.getpid()}", secret=b"")
    runtime_kw = {"accumulate": kw.pop("accumulate")} if "accumulate" in kw else {}
    step = sharded_step(model, optax.sgd(0.1), comm="odc", **kw)
    tr = step.init(model.init(jax.random.PRNGKey(0)), ctx=ctx, device=None, **runtime_kw)
    try:
        return tr.rt.accumulate, step.config(model.init(jax.random.PRNGKey(0)), 1)["reproducible"]
    finally:
        tr.close()


@pytest.mark.parametrize("env,kw,want", [
    (None, {}, ("fp32", None)),                              # the default: fp32
    (None, {"reproducible": True}, ("exact", True)),          # the opt-in
    ("exact", {}, ("exact", None)),                          # the env still picks when reproducible is not given
    ("exact", {"reproducible": False}, ("fp32", False)),      # an explicit argument wins over the env
    ("fp32", {"reproducible": True}, ("exact", True)),
])
def test_reproducible_reaches_the_runtime(monkeypatch, env, kw, want):
    assert _trainer_sum(monkeypatch, env, **kw) == want


def test_reproducible_conflicts_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="reproducible=True sums pushes with accumulate='exact', but "
                                         "accumulate='fp32' was passed too"):
        _trainer_sum(monkeypatch, None, reproducible=True, accumulate="fp32")
    with pytest.raises(TypeError, match="reproducible must be True, False or None"):
        _trainer_sum(monkeypatch, None, reproducible="yes")
    import jax
    import optax
    from jaxodc.models.mlp import MLP
    from jaxodc.train.api import sharded_step
    model = MLP((4, 8, 2))
    params = model.init(jax.random.PRNGKey(0))
    step = sharded_step(model, optax.sgd(0.1), comm="odc", reproducible=True)
    with local_runtime([u.padded for u in step.layout(params, 1).units], accumulate="fp32") as rt:
        with pytest.raises(ValueError, match="rank 0: reproducible=True, but the runtime passed sums pushes with "
                                             "accumulate='fp32'"):
            step.init(params, runtime=rt)


@pytest.mark.parametrize("n", [100, 1037])  # 1037: odd, and the finish's blocks (512) end mid-shard
def test_grad_view_is_the_exact_sum_in_place_and_clears(n):
    with local_runtime([n]) as rt:
        for v in range(3):  # later minibatches start from a cleared accumulator (the finish zeroed its limbs)
            data = pushes(4 + v, count=3, sizes=[n])
            for p in data:
                rt.scatter_accumulate(0, v, p[0])
            rt.done(v)
            rt.wait_complete(v)
            view = rt.grad_view(0)
            assert view.ctypes.data % 64 == 0 and view.dtype == np.float32 and view.shape == (n,)
            np.testing.assert_array_equal(bits(view), bits(reference([p[0] for p in data])))
            rt.clear_grad(0)  # O(1): the owner's daemon zeroes the sum soon after, off the trainer's path
            wait_zeroed(view)
            rt.publish(0, np.zeros(n, np.float32), v + 1)


# -- across processes: arrival order and the pushing rank vary ------------------------------------

def ranks_body(ctx, transport, seed):
    """Two minibatches push the same microbatches' gradients, split across the ranks differently
    and in other orders (as LB-Steal and timing make them); every owner's sums must be the same
    bits both times, and the reference's."""
    import time
    from jaxodc.odc import Runtime
    data = pushes(seed, count=6)
    rt = Runtime.create(SIZES, ctx, transport=transport, timeout_s=60.0, device=None, accumulate="exact")
    for u in range(len(SIZES)):
        rt.publish(u, np.zeros(rt.shard_size(u), np.float32), 0)
    got = []
    for v, assign in enumerate([lambda j: j % ctx.world, lambda j: (5 * j + 1) % ctx.world]):
        mine = [j for j in range(len(data)) if assign(j) == ctx.rank]
        for j in (mine if v == 0 else mine[::-1]):
            time.sleep(0.01 * ((j * 7 + v) % 3))  # shuffles the arrivals
            for u in range(len(SIZES)):
                rt.scatter_accumulate(u, v, data[j][u])
        rt.done(v)
        rt.wait_complete(v)
        got.append([rt.fetch_grad(u) for u in range(len(SIZES))])
        for u in range(len(SIZES)):
            rt.publish(u, np.zeros(rt.shard_size(u), np.float32), v + 1)
            rt.gather(u, v + 1)  # every owner is at v + 1 before anyone pushes to it
    for u in range(len(SIZES)):
        np.testing.assert_array_equal(bits(got[0][u]), bits(got[1][u]))
        lo, hi = rt.shard_range(u)
        ref = reference([p[u][lo:hi] for p in data])
        np.testing.assert_array_equal(bits(got[0][u][: hi - lo]), bits(ref))
    rt.close()
    return True


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sums_do_not_depend_on_arrival_order_or_pushing_rank(transport):
    assert run_ranks(ranks_body, 3, args=(transport, 5), timeout_s=120) == [True, True, True]


def test_large_sums_and_many_pushes():
    """Sums past 2^25 (the wide conversion at the end) and more pushes than the lo limbs hold
    between carries (2^11) are still the correctly rounded sum, in any order."""
    rng = np.random.default_rng(9)
    signs = np.r_[np.ones(8), -np.ones(4), rng.choice([-1, 1], 4)]  # the first 12 sum past 2^25 in magnitude
    big = [{0: (rng.uniform(2.0 ** 22, 2.0 ** 23, 16) * signs + rng.uniform(0, 1, 16)).astype(np.float32)}
           for _ in range(12)]
    many = [{0: (rng.standard_normal(4) * 10.0 ** rng.uniform(-6, 2, 4)).astype(np.float32)} for _ in range(2100)]
    assert np.all(np.abs(np.sum([p[0][:12] for p in big], axis=0, dtype=np.float64)) > 2.0 ** 25)
    for data in (big, many):
        ref = reference([p[0] for p in data])
        for order in (range(len(data)), range(len(data) - 1, -1, -1)):
            got = sums_in_order(order, data, sizes=[len(data[0][0])])[0]
            np.testing.assert_array_equal(bits(got), bits(ref))
