"""Ring-order solver (asymmetric TSP, bottleneck-then-total objective) and, over real rings with
emulated links, the measured speed-up of the optimised ring."""
import itertools
import math
import time

import numpy as np
import pytest

from jaxodc.coord import topology as T


def brute_force(cost: np.ndarray) -> tuple[list[int], tuple[float, float]]:
    """Reference solver over all (n-1)! rings starting at node 0 (tests, n <= 9)."""
    n = cost.shape[0]
    best, best_cost = list(range(n)), T.ring_cost(range(n), cost)
    for perm in itertools.permutations(range(1, n)):
        order = [0, *perm]
        c = T.ring_cost(order, cost)
        if c < best_cost:
            best, best_cost = order, c
    return best, best_cost


def _close(a, b):
    return all(math.isclose(x, y, rel_tol=1e-12) or (math.isinf(x) and math.isinf(y)) for x, y in zip(a, b))


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 8])
def test_exact_equals_brute_force(n):
    rng = np.random.default_rng(100 + n)
    for trial in range(12):
        bw = rng.uniform(1e6, 1e9, (n, n))
        if trial % 3 == 1:   # many ties in the bottleneck
            bw = np.round(bw / 3e8) * 3e8 + 1e6
        if trial % 4 == 2:   # missing links (infinite cost)
            bw[rng.random((n, n)) < 0.35] = 0.0
        cost = T.cost_matrix(bw)
        order, val = T.solve_exact(cost)
        ref_order, ref_val = brute_force(cost)
        assert sorted(order) == list(range(n)), order
        assert _close(val, T.ring_cost(order, cost))
        assert _close(val, ref_val), (n, trial, order, val, ref_order, ref_val)


def test_bottleneck_beats_sum_objective():
    """A ring with one very slow link loses to one with a slightly larger sum but no slow link."""
    n = 4
    c = np.full((n, n), 10.0)
    np.fill_diagonal(c, 0)
    c[0, 1] = c[1, 2] = c[2, 3] = 1.0
    c[3, 0] = 50.0           # ring 0123: sum 53, bottleneck 50
    order, (bott, total) = T.solve_exact(c)
    assert bott == 10.0 and T.ring_cost([0, 1, 2, 3], c) == (50.0, 53.0)
    assert total == 31.0  # best with bottleneck 10: one cheap link and three at 10


def test_asymmetric_reverse_ring():
    """Only the forward direction of the naive ring is slow: the optimum is the reverse ring."""
    n = 6
    bw = np.full((n, n), 100.0)
    for i in range(n):
        bw[i, (i + 1) % n] = 1.0
    order, (bott, _) = T.solve_ring(bw)
    assert bott == pytest.approx(1 / 100.0)
    assert order == [0, 5, 4, 3, 2, 1]


def test_heuristic_quality_and_time_limit():
    rng = np.random.default_rng(7)
    n = 10
    bw = rng.uniform(1, 100, (n, n))
    cost = T.cost_matrix(bw)
    exact = T.solve_exact(cost)[1]
    t0 = time.monotonic()
    order, val = T.solve_heuristic(cost, time_limit_s=0.5)
    assert time.monotonic() - t0 < 1.5
    assert sorted(order) == list(range(n))
    assert val[0] <= exact[0] * 1.5          # bottleneck within 50 % of optimal on this instance
    # larger than the exact limit: planted cheap ring must be found
    n = 40
    perm = rng.permutation(n)
    bw = rng.uniform(1, 10, (n, n))
    for k in range(n):
        bw[perm[k], perm[(k + 1) % n]] = 1000.0
    t0 = time.monotonic()
    order, (bott, _) = T.solve_ring(bw, time_limit_s=2.0)
    assert time.monotonic() - t0 < 4.0
    assert sorted(order) == list(range(n))
    naive = T.ring_cost(list(range(n)), T.cost_matrix(bw))
    assert bott < naive[0]


def test_cost_matrix_rejects_bad_shape():
    with pytest.raises(ValueError, match="square"):
        T.cost_matrix(np.ones((2, 3)))


# --- optimised ring over emulated links --------------------------------------------------------

def test_optimised_ring_is_faster_over_emulated_links(capsys):
    """Join order 0-1-2-3 crosses the two slow pairs {0,1} and {2,3} (10x slower, both
    directions); after optimize_topology + update_topology the ring avoids them."""
    from jaxodc.coord.service import CoordinatorService
    from comm_util import SECRET, close_all, make_group, run_threads

    svc = CoordinatorService("127.0.0.1", 0, SECRET, heartbeat_timeout_s=5.0).start()
    comms = make_group(svc.address, 4)
    try:
        fast, slow = 40e6, 4e6
        addrs = [c.ep.address for c in comms]
        slow_pairs = {(0, 1), (1, 0), (2, 3), (3, 2)}
        for i, c in enumerate(comms):
            for j, a in enumerate(addrs):
                if i != j:
                    c.ep.set_link(a, slow if (i, j) in slow_pairs else fast, 0.0)
        x = [np.full(1 << 18, float(i), np.float32) for i in range(4)]  # 1 MiB per peer

        def timed():
            t0 = time.perf_counter()
            outs = run_threads([lambda c=c, v=v: c.all_reduce(v, op="sum") for c, v in zip(comms, x)])
            dt = time.perf_counter() - t0
            assert all(np.array_equal(o, np.full(1 << 18, 6.0, np.float32)) for o in outs)
            return dt

        naive = min(timed() for _ in range(2))
        res = run_threads([lambda c=c: c.optimize_topology(nbytes=256 << 10) for c in comms])
        assert all(r["improved"] for r in res) and len({tuple(r["ring"]) for r in res}) == 1
        bw = np.array(res[0]["bandwidth"])
        # the measured matrix sees the emulated caps (slow pairs well below fast ones)
        assert max(bw[i, j] for i, j in slow_pairs) < 0.5 * min(bw[i, j] for i in range(4) for j in range(4)
                                                               if i != j and (i, j) not in slow_pairs)
        ring = res[0]["ring"]
        idx = [addrs.index(a) for a in ring]
        edges = {(idx[k], idx[(k + 1) % 4]) for k in range(4)}
        assert not edges & slow_pairs, idx
        run_threads([c.update_topology for c in comms])   # installs the better ring
        assert comms[0].ring == ring
        opt = min(timed() for _ in range(2))
        with capsys.disabled():
            print(f"\n[topology] all-reduce 1 MiB x 4 peers: naive ring {naive * 1e3:.0f} ms, "
                  f"optimised {opt * 1e3:.0f} ms, speed-up {naive / opt:.2f}x")
        assert naive / opt >= 1.3, (naive, opt)
    finally:
        close_all(comms)
        svc.stop()
