"""Load balancing of a global minibatch across W ranks and into microbatches (ODC paper, Sec. 4 and
App. C).

All balancers take the sample lengths of one global minibatch (all ranks' samples together) and
return a `Plan`: for every rank a list of microbatches, each a tuple of indices into `lengths`.
Everything is deterministic: ties are broken by sample index, so every rank computes the same plan
from the same lengths without talking to the others.

- `local_sort`: contiguous split of the minibatch, each rank sorts its samples longest-first, one
  sample per microbatch (no packing) -- the paper's LocalSort.
- `lb_micro`: Karmarkar-Karp across ranks with equal sample counts, then each rank's samples into
  the same number k of microbatches (k grows until every rank's microbatches fit `max_tokens`);
  microbatch step m pairs the m-th costliest microbatch of every rank -- all the collective
  baseline can do (its per-layer collectives need equal microbatch counts).
- `lb_mini`: Karmarkar-Karp across ranks on total cost only, then each rank packs its own samples
  with its own microbatch count (ODC only: counts differ across ranks).
- `lb_steal`: LB-Mini's microbatches, each rank's cheapest ones moved to a global queue, ordered
  costliest-first; at run time a rank that finished its own microbatches claims queue positions
  from a shared counter (`iter_steal`). Gradients accumulate at the owners, so which rank computes
  a microbatch does not change the result.
"""
from __future__ import annotations

import heapq
import itertools
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from jaxodc.train.cost import CostModel

BALANCERS = ("local_sort", "lb_micro", "lb_mini", "lb_steal")


# --------------------------------------------------------------------------- partitioning

def karmarkar_karp(costs: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Largest differencing method for k-way number partitioning (Karmarkar & Karp 1982).

    Returns k lists of indices into `costs` (each sorted ascending; lists ordered by descending
    sum). With `equal_size`, part sizes differ by at most one (zero-cost phantom items pad n up to
    a multiple of k and are dropped afterwards). The spread (max - min part sum) never exceeds the
    largest cost: merging two states never increases the larger of their spreads."""
    if k < 1:
        raise ValueError(f"karmarkar_karp: k must be >= 1, got {k}")
    n = len(costs)
    items = sorted(range(n), key=lambda i: (float(costs[i]), i))
    vals = [float(c) for c in costs]
    heap: list = []
    tick = itertools.count()

    def push(sets):
        sets.sort(key=lambda s: -s[0])  # stable: deterministic order among equal sums
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), next(tick), sets))

    if equal_size:
        pad = (-n) % k
        seq = [-1] * pad + items  # phantoms (index -1) are the smallest items
        for off in range(0, len(seq), k):
            push([[0.0 if i < 0 else vals[i], [] if i < 0 else [i]] for i in seq[off:off + k]])
    else:
        for i in items:
            push([[vals[i], [i]]] + [[0.0, []] for _ in range(k - 1)])
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        push([[a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]] for j in range(k)])
    return [sorted(s[1]) for s in heap[0][2]]


def greedy_partition(costs: Sequence[float], k: int) -> list[list[int]]:
    """Longest-processing-time greedy (costliest item to the least-loaded part); the comparison
    baseline for `karmarkar_karp`."""
    loads = [0.0] * k
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i)):
        j = min(range(k), key=lambda j: (loads[j], j))
        loads[j] += float(costs[i])
        parts[j].append(i)
    return [sorted(p) for p in parts]


def spread(parts: Sequence[Sequence[int]], costs: Sequence[float]) -> float:
    sums = [sum(float(costs[i]) for i in p) for p in parts]
    return max(sums) - min(sums)


# --------------------------------------------------------------------------- plan

@dataclass(frozen=True)
class Plan:
    """Assignment of one global minibatch to ranks and microbatches.

    ranks[r][m] is the tuple of sample indices (into `lengths`) of rank r's m-th microbatch, in run
    order. An empty tuple is an all-padding microbatch (kept only where equal counts demand it).
    For `lb_steal`, rank r first runs its fixed microbatches ranks[r][:n_static[r]], then claims
    from `queue` (shared, in order) with `iter_steal`; ranks[r][n_static[r]:] are the claims the
    cost model predicts (what the simulator uses)."""

    balance: str
    world: int
    max_tokens: int
    lengths: tuple[int, ...]
    ranks: tuple[tuple[tuple[int, ...], ...], ...]
    queue: tuple[tuple[int, ...], ...] | None = None
    n_static: tuple[int, ...] | None = None  # lb_steal: ranks[r][:n_static[r]] are fixed, the rest predicted claims
    total_tokens: int = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "total_tokens", int(sum(self.lengths)))

    def counts(self) -> list[int]:
        return [len(r) for r in self.ranks]

    def microbatch_tokens(self, mb: Sequence[int]) -> int:
        return int(sum(self.lengths[i] for i in mb))

    def rank_cost(self, rank: int, cost: CostModel) -> float:
        return sum(cost.microbatch([self.lengths[i] for i in mb]) for mb in self.ranks[rank])

    def padded(self) -> "Plan":
        """The same plan with every rank padded to the largest microbatch count by empty
        (all-padding) microbatches -- what the collective trainer runs."""
        m = max(self.counts(), default=0)
        return Plan(self.balance, self.world, self.max_tokens, self.lengths,
                    tuple(r + ((),) * (m - len(r)) for r in self.ranks), self.queue, self.n_static)

    def static(self, rank: int) -> tuple[tuple[int, ...], ...]:
        """Microbatches fixed to `rank` before any run-time claims (all of them unless lb_steal)."""
        r = self.ranks[rank]
        return r if self.n_static is None else r[:self.n_static[rank]]

    def validate(self) -> None:
        """Every sample exactly once; every microbatch within max_tokens."""
        seen = []
        mbs = [mb for r in range(self.world) for mb in self.static(r)] + list(self.queue or ())
        for mb in mbs:
            t = self.microbatch_tokens(mb)
            if t > self.max_tokens:
                raise ValueError(f"plan {self.balance}: microbatch {list(mb)} holds {t} tokens > max_tokens={self.max_tokens}")
            seen += list(mb)
        if sorted(seen) != list(range(len(self.lengths))):
            raise ValueError(f"plan {self.balance}: samples not covered exactly once")


def _check_minibatch(lengths: Sequence[int], world: int, max_tokens: int) -> list[int]:
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    ls = [int(x) for x in lengths]
    if not ls:
        raise ValueError("empty minibatch: no samples to balance")
    for i, s in enumerate(ls):
        if s <= 0:
            raise ValueError(f"sample {i} has length {s}; lengths must be positive")
        if s > max_tokens:
            raise ValueError(f"sample {i} has length {s} > max_tokens={max_tokens}; it cannot fit any microbatch")
    return ls


def fit_microbatches(idx: Sequence[int], lengths: Sequence[int], cost: CostModel, max_tokens: int,
                     k: int | None = None, keep_empty: bool = False) -> list[tuple[int, ...]]:
    """Karmarkar-Karp of samples `idx` into microbatches balanced by cost, growing the count from
    ceil(tokens / max_tokens) (or `k`) until every microbatch fits `max_tokens` (paper, Listing 1).
    Terminates: at k >= len(idx) every sample sits alone and each fits. Returns microbatches sorted
    costliest first; empty ones only with `keep_empty`."""
    idx = list(idx)
    tok = sum(lengths[i] for i in idx)
    k = max(k or 1, -(-tok // max_tokens), 1)
    c = [float(cost(lengths[i])) for i in idx]
    while True:
        parts = karmarkar_karp(c, k)
        if all(sum(lengths[idx[j]] for j in p) <= max_tokens for p in parts):
            break
        k += 1
    mbs = [tuple(sorted(idx[j] for j in p)) for p in parts if keep_empty or p]
    return _by_cost(mbs, lengths, cost)


def _by_cost(mbs, lengths, cost):
    return sorted(mbs, key=lambda mb: (-cost.microbatch([lengths[i] for i in mb]), mb))


def local_sort(lengths: Sequence[int], world: int, max_tokens: int, cost: CostModel | None = None) -> Plan:
    ls = _check_minibatch(lengths, world, max_tokens)
    ranks = []
    for chunk in np.array_split(np.arange(len(ls)), world):
        order = sorted(chunk.tolist(), key=lambda i: (-ls[i], i))
        ranks.append(tuple((i,) for i in order))
    return Plan("local_sort", world, max_tokens, tuple(ls), tuple(ranks))


def lb_micro(lengths: Sequence[int], world: int, max_tokens: int, cost: CostModel | None = None) -> Plan:
    cost = cost or CostModel()
    ls = _check_minibatch(lengths, world, max_tokens)
    per_rank = karmarkar_karp(cost.costs(ls), world, equal_size=True)
    k = max(max(-(-sum(ls[i] for i in p) // max_tokens) for p in per_rank), 1)
    while True:  # one k for all ranks (the paper all-reduces the OOM flag)
        ranks = [fit_microbatches(p, ls, cost, max_tokens, k=k, keep_empty=True) for p in per_rank]
        m = max(len(r) for r in ranks)
        if m == k:
            break
        k = m
    return Plan("lb_micro", world, max_tokens, tuple(ls), tuple(tuple(r) for r in ranks))


def lb_mini(lengths: Sequence[int], world: int, max_tokens: int, cost: CostModel | None = None) -> Plan:
    cost = cost or CostModel()
    ls = _check_minibatch(lengths, world, max_tokens)
    per_rank = karmarkar_karp(cost.costs(ls), world, equal_size=False)
    ranks = [tuple(fit_microbatches(p, ls, cost, max_tokens)) if p else () for p in per_rank]
    # KK returns parts by descending sum; rank order follows it, deterministic either way.
    return Plan("lb_mini", world, max_tokens, tuple(ls), tuple(ranks))


def lb_steal(lengths: Sequence[int], world: int, max_tokens: int, cost: CostModel | None = None,
             steal_fraction: float = 0.3) -> Plan:
    """LB-Mini's microbatches, with each rank's cheapest ones (together at most `steal_fraction`
    of its predicted load; every rank keeps at least one) moved to a shared queue, costliest
    first. A rank runs its static microbatches, then claims queue entries until the queue is
    drained, so the queue absorbs whatever the cost model mispredicted. The microbatches are
    exactly LB-Mini's, so stealing adds no per-microbatch overhead (splitting the held-back work
    finer would). `ranks` holds the static microbatches followed by the claims the cost model
    predicts (the first-free rank takes the next entry)."""
    cost = cost or CostModel()
    if not 0.0 <= steal_fraction <= 1.0:
        raise ValueError(f"steal_fraction must be in [0, 1], got {steal_fraction}")
    mini = lb_mini(lengths, world, max_tokens, cost)
    mb_cost = lambda mb: cost.microbatch([mini.lengths[i] for i in mb])  # noqa: E731
    ranks: list[list[tuple[int, ...]]] = []
    queue: list[tuple[int, ...]] = []
    loads = []
    for mbs in mini.ranks:
        mbs = list(mbs)  # costliest first
        load = sum(mb_cost(mb) for mb in mbs)
        budget = steal_fraction * load
        while len(mbs) > 1 and mb_cost(mbs[-1]) <= budget:
            budget -= mb_cost(mbs[-1])
            queue.append(mbs.pop())
        ranks.append(mbs)
        loads.append(sum(mb_cost(mb) for mb in mbs))
    queue = _by_cost(queue, mini.lengths, cost)
    n_static = tuple(len(r) for r in ranks)
    for mb in queue:  # predicted claims
        r = min(range(world), key=lambda j: (loads[j], j))
        loads[r] += mb_cost(mb)
        ranks[r].append(mb)
    return Plan("lb_steal", world, max_tokens, mini.lengths, tuple(tuple(r) for r in ranks), tuple(queue), n_static)


def make_plan(balance: str, lengths: Sequence[int], world: int, max_tokens: int,
              cost: CostModel | None = None) -> Plan:
    fns = {"local_sort": local_sort, "lb_micro": lb_micro, "lb_mini": lb_mini, "lb_steal": lb_steal}
    if balance not in fns:
        raise ValueError(f"unknown balancer {balance!r}; choose one of {BALANCERS}")
    return fns[balance](lengths, world, max_tokens, cost)


# --------------------------------------------------------------------------- run-time stealing

def iter_steal(plan: Plan, next_task: Callable[[int], int], version: int) -> Iterator[tuple[int, ...]]:
    """Yield the microbatches this rank claims from `plan.queue` for minibatch `version`.
    `next_task(version)` returns a fresh queue position on every call, shared by all ranks (ODC:
    `runtime.next_task`); positions past the queue end mean the queue is drained."""
    if plan.queue is None:
        raise ValueError(f"iter_steal needs an lb_steal plan, got {plan.balance!r}")
    if not plan.queue:  # nothing pooled: no claim round trip
        return
    while True:
        i = int(next_task(version))
        if i < 0 or i >= len(plan.queue):
            return
        yield plan.queue[i]


class LocalCounter:
    """In-process claim counter with the `next_task(version) -> int` signature (tests, threads)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._next: dict[int, int] = {}

    def next_task(self, version: int) -> int:
        with self._lock:
            i = self._next.get(version, 0)
            self._next[version] = i + 1
            return i
