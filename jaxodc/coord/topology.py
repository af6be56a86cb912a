"""Ring order from measured point-to-point bandwidth: an asymmetric TSP.

Edge cost ``c[i][j] = 1 / bandwidth(i -> j)`` (seconds per byte; unmeasured or zero bandwidth is
infinite). Objective, compared lexicographically: **(bottleneck, total)**.

Why the bottleneck first: in a pipelined ring all W links carry the same number of bytes at the
same time, so the steady-state time of an all-reduce is set by the slowest link on the ring, not
by the sum of link costs. A pure sum objective can happily keep one very slow link if it saves a
little elsewhere, which is exactly the wrong trade for a ring. Among rings with the same
bottleneck the total cost (sum of per-byte times) breaks ties: it still reflects contention and
the per-hop latency of the other links.

Exact solver (``W <= EXACT_MAX``): binary search for the smallest threshold that admits a
Hamiltonian cycle (bitset DP), then Held-Karp on the edges at or below it. Above that a
time-limited heuristic: nearest neighbour from several starts, then or-opt (segment moves) and
2-opt (segment reversals, re-costed in full because the costs are asymmetric).
"""
from __future__ import annotations

import math
import time

import numpy as np

EXACT_MAX = 12


def cost_matrix(bandwidth: np.ndarray) -> np.ndarray:
    """Per-byte cost 1/bw; non-positive or non-finite bandwidth -> inf; diagonal 0."""
    bw = np.asarray(bandwidth, dtype=np.float64)
    if bw.ndim != 2 or bw.shape[0] != bw.shape[1]:
        raise ValueError(f"bandwidth matrix must be square, got shape {bw.shape}")
    with np.errstate(divide="ignore"):
        c = np.where((bw > 0) & np.isfinite(bw), 1.0 / np.where(bw > 0, bw, 1.0), np.inf)
    np.fill_diagonal(c, 0.0)
    return c


def ring_cost(order, cost: np.ndarray) -> tuple[float, float]:
    """(bottleneck, total) of the directed ring order[0] -> order[1] -> ... -> order[0]."""
    n = len(order)
    if n <= 1:
        return 0.0, 0.0
    edges = [cost[order[k], order[(k + 1) % n]] for k in range(n)]
    return float(max(edges)), float(sum(edges))


def _canonical(order) -> list[int]:
    """Rotate so the ring starts at node 0 (rings are rotation invariant)."""
    order = list(order)
    k = order.index(0)
    return order[k:] + order[:k]


def _hamiltonian_exists(adj: list[int], n: int) -> bool:
    """Is there a directed Hamiltonian cycle? adj[i] is the bitset of j with edge i->j.

    reach[mask] = bitset of end nodes j such that a path 0 -> ... -> j visits exactly
    {0} | mask (nodes 1..n-1 encoded as bits 0..n-2)."""
    if n <= 1:
        return True
    m = n - 1
    full = (1 << m) - 1
    reach = [0] * (1 << m)
    for j in range(m):
        if adj[0] >> (j + 1) & 1:
            reach[1 << j] |= 1 << j
    for mask in range(1, 1 << m):
        ends = reach[mask]
        if not ends:
            continue
        j = 0
        e = ends
        while e:
            if e & 1:
                nxt = (adj[j + 1] >> 1) & full & ~mask
                while nxt:
                    low = nxt & -nxt
                    k = low.bit_length() - 1
                    reach[mask | low] |= low
                    nxt ^= low
            e >>= 1
            j += 1
    ends = reach[full]
    return any((ends >> j) & 1 and (adj[j + 1] & 1) for j in range(m))


def _held_karp(cost: np.ndarray) -> list[int] | None:
    """Minimum total-cost directed Hamiltonian cycle from node 0 (None if none is finite)."""
    n = cost.shape[0]
    if n <= 2:
        return list(range(n))
    m = n - 1
    size = 1 << m
    c = cost[1:, 1:]  # c[i, j]: node i+1 -> node j+1
    dp = np.full((size, m), np.inf)
    parent = np.full((size, m), -1, dtype=np.int64)
    for j in range(m):
        dp[1 << j, j] = cost[0, j + 1]
    masks = np.arange(size)
    popcount = np.array([bin(x).count("1") for x in range(size)])
    for k in range(2, m + 1):
        layer = masks[popcount == k]
        for j in range(m):
            sel = layer[(layer >> j) & 1 == 1]
            prev = sel ^ (1 << j)
            cand = dp[prev] + c[:, j][None, :]  # dp[prev, i] is inf when i is not in prev
            best = np.argmin(cand, axis=1)
            dp[sel, j] = cand[np.arange(len(sel)), best]
            parent[sel, j] = best
    full = size - 1
    closing = dp[full] + cost[1:, 0]
    last = int(np.argmin(closing))
    if not np.isfinite(closing[last]):
        return None
    order, mask, j = [], full, last
    while j >= 0:
        order.append(j + 1)
        pj = int(parent[mask, j])
        mask ^= 1 << j
        j = pj
    return [0, *reversed(order)]


def solve_exact(cost: np.ndarray) -> tuple[list[int], tuple[float, float]]:
    """Exact lexicographic (bottleneck, total) optimum; practical up to ~12 nodes."""
    cost = np.asarray(cost, dtype=np.float64)
    n = cost.shape[0]
    if n <= 3:  # for n <= 3 there are at most two rings: try both
        cands = [list(range(n)), [0, *reversed(range(1, n))]]
        best = min(cands, key=lambda o: ring_cost(o, cost))
        return best, ring_cost(best, cost)
    off = cost[~np.eye(n, dtype=bool)]
    levels = np.unique(off[np.isfinite(off)])

    def adj_at(th: float) -> list[int]:
        return [sum(1 << j for j in range(n) if j != i and cost[i, j] <= th) for i in range(n)]

    if len(levels) == 0 or not _hamiltonian_exists(adj_at(levels[-1]), n):
        order = list(range(n))  # no finite ring: every ring is infinitely bad
        return order, ring_cost(order, cost)
    lo, hi = 0, len(levels) - 1  # smallest feasible level index
    while lo < hi:
        mid = (lo + hi) // 2
        if _hamiltonian_exists(adj_at(levels[mid]), n):
            hi = mid
        else:
            lo = mid + 1
    th = levels[lo]
    restricted = np.where(cost <= th, cost, np.inf)
    order = _held_karp(restricted)
    assert order is not None, "Held-Karp found no cycle although one exists below the threshold"
    return order, ring_cost(order, cost)


def _nearest_neighbour(cost: np.ndarray, start: int) -> list[int]:
    n = cost.shape[0]
    order, left = [start], set(range(n)) - {start}
    while left:
        cur = order[-1]
        nxt = min(left, key=lambda j: (cost[cur, j], j))
        order.append(nxt)
        left.remove(nxt)
    return order


def _local_search(order: list[int], cost: np.ndarray, deadline: float) -> list[int]:
    n = len(order)
    best_c = ring_cost(order, cost)
    improved = True
    while improved and time.monotonic() < deadline:
        improved = False
        # or-opt: move a segment of 1..3 nodes to another gap (keeps its direction)
        for seg in (1, 2, 3):
            for i in range(n):
                if time.monotonic() >= deadline:
                    return order
                if i + seg > n:
                    break
                piece, rest = order[i:i + seg], order[:i] + order[i + seg:]
                for k in range(len(rest) + 1):
                    if k == i:
                        continue
                    cand = rest[:k] + piece + rest[k:]
                    c = ring_cost(cand, cost)
                    if c < best_c:
                        order, best_c, improved = cand, c, True
                        break
        # 2-opt: reverse order[i..j]; asymmetric costs, so the whole ring is re-costed
        for i in range(1, n - 1):
            if time.monotonic() >= deadline:
                return order
            for j in range(i + 1, n):
                cand = order[:i] + order[i:j + 1][::-1] + order[j + 1:]
                c = ring_cost(cand, cost)
                if c < best_c:
                    order, best_c, improved = cand, c, True
    return order


def solve_heuristic(cost: np.ndarray, time_limit_s: float = 1.0, seed: int = 0) -> tuple[list[int], tuple[float, float]]:
    """Nearest neighbour from several starts + or-opt/2-opt, stopped at the time limit."""
    cost = np.asarray(cost, dtype=np.float64)
    n = cost.shape[0]
    deadline = time.monotonic() + time_limit_s
    starts = list(range(n))
    np.random.default_rng(seed).shuffle(starts)
    best = list(range(n))
    best_c = ring_cost(best, cost)
    for s in starts:
        if time.monotonic() >= deadline:
            break
        cand = _local_search(_nearest_neighbour(cost, s), cost, deadline)
        c = ring_cost(cand, cost)
        if c < best_c:
            best, best_c = cand, c
    best = _canonical(best)
    return best, ring_cost(best, cost)


def solve_ring(bandwidth: np.ndarray, time_limit_s: float = 1.0) -> tuple[list[int], tuple[float, float]]:
    """Best ring for a bandwidth matrix (bytes/s, [i, j] = i sends to j): exact up to EXACT_MAX."""
    cost = cost_matrix(bandwidth)
    if cost.shape[0] <= EXACT_MAX:
        return solve_exact(cost)
    return solve_heuristic(cost, time_limit_s)


def is_better(new: tuple[float, float], old: tuple[float, float], rel: float = 1e-9) -> bool:
    """Strictly better in the (bottleneck, total) order, ignoring float noise."""
    if not math.isclose(new[0], old[0], rel_tol=rel):
        return new[0] < old[0]
    return new[1] < old[1] and not math.isclose(new[1], old[1], rel_tol=rel)
