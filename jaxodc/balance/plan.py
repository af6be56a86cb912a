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
- `lb_mini`: Karmarkar-Karp across ranks on total cost only, refined by moving or swapping
  samples between the most and least loaded rank with each rank's per-microbatch overhead counted
  (`refine_partition`), then each rank packs its own samples with its own microbatch count (ODC
  only: counts differ across ranks).
- `lb_steal`: LB-Mini's plan, run as work stealing: every rank's microbatches (LB-Mini's own,
  the same tuples in the same order) sit in a deque at that rank; the rank takes them from the
  front (costliest first), and a rank that ran out takes the cheapest not yet started microbatch
  from the back of a loaded peer's deque (`iter_steal`). A steal only happens while the victim
  still has unstarted work, so it never lengthens the minibatch (the thief was idle), and with an
  exact cost model nothing is stolen: LB-Steal is LB-Mini plus the correction of whatever the
  model mispredicted, so when nothing straggles it runs LB-Mini's schedule and costs only its
  deque claims. Gradients accumulate at the owners, so which rank computes a microbatch does not
  change the result.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import numpy as np

from jaxodc.balance.cost import CostModel

BALANCERS = ("local_sort", "lb_micro", "lb_mini", "lb_steal")
COMMS = ("odc", "collective")  # the trainers' communication modes, as far as planning cares


def validate_run(comm: str, balance: str | None, option: str = "{name}={value!r}") -> str:
    """The balancer for a run under `comm` (default: lb_mini for odc, lb_micro for collective).

    Args:
      comm: "odc" or "collective".
      balance: a name from BALANCERS, or None for the default.
      option: how messages spell a setting (the CLI passes "--{name} {value}").

    Raises:
      ValueError: an unknown comm or balancer, or lb_steal without odc (the collective's
        lock-step microbatches cannot be claimed at run time).
    """
    def say(name, value):
        return option.format(name=name, value=value)

    if comm not in COMMS:
        raise ValueError(f"unknown {say('comm', comm)}; choose one of {', '.join(COMMS)}")
    balance = balance or ("lb_mini" if comm == "odc" else "lb_micro")
    if balance not in BALANCERS:
        raise ValueError(f"unknown {say('balance', balance)}; choose one of {', '.join(BALANCERS)}")
    if comm == "collective" and balance == "lb_steal":
        raise ValueError(f"{say('balance', 'lb_steal')} claims microbatches at run time; it needs {say('comm', 'odc')}")
    return balance


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


def spread(parts: Sequence[Sequence[int]], costs: Sequence[float]) -> float:
    sums = [sum(float(costs[i]) for i in p) for p in parts]
    return max(sums) - min(sums)


# --------------------------------------------------------------------------- plan

@dataclass(frozen=True)
class Plan:
    """Assignment of one global minibatch to ranks and microbatches.

    ranks[r][m] is the tuple of sample indices (into `lengths`) of rank r's m-th microbatch, in run
    order. An empty tuple is an all-padding microbatch (kept only where equal counts demand it).
    For `lb_steal`, ranks[r] is rank r's deque: what it runs unless a peer steals from its back
    (`iter_steal`)."""

    balance: str
    world: int
    max_tokens: int
    lengths: tuple[int, ...]
    ranks: tuple[tuple[tuple[int, ...], ...], ...]
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
                    tuple(r + ((),) * (m - len(r)) for r in self.ranks))

    def rank_tokens(self, rank: int) -> int:
        return sum(self.microbatch_tokens(mb) for mb in self.ranks[rank])

    def validate(self) -> None:
        """Every sample exactly once; every microbatch within max_tokens."""
        seen = []
        for mb in (mb for r in self.ranks for mb in r):
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


def refine_partition(parts: list[list[int]], lengths: Sequence[int], cost: CostModel, max_tokens: int,
                     rounds: int | None = None) -> list[list[int]]:
    """Local search after Karmarkar-Karp on whole-rank loads, which KK cannot see: a rank's
    microbatch count (each adds cost.c) follows its tokens, not its samples' costs. A rank's
    load is its samples' costs plus c times the fewest microbatches that hold its tokens (where
    fit_microbatches starts). Each round moves one sample, or swaps two, between the most and the
    least loaded rank when that lowers the larger of their loads; stops when nothing does (at
    most `rounds`, default 4 x world). Deterministic: candidates are tried in index order and
    only strict gains are taken."""
    sample_cost = cost.costs(lengths)

    def load_of(cost_sum: float, tokens: int) -> float:
        return cost_sum + cost.c * -(-tokens // max_tokens) if tokens else 0.0

    parts = [sorted(p) for p in parts]
    sums = [[sum(sample_cost[i] for i in p), sum(lengths[i] for i in p)] for p in parts]
    load = [load_of(*x) for x in sums]
    for _ in range(rounds if rounds is not None else 4 * len(parts)):
        hi = max(range(len(parts)), key=lambda r: (load[r], -r))
        lo = min(range(len(parts)), key=lambda r: (load[r], r))
        if hi == lo:
            break
        (ch, th), (cl, tl) = sums[hi], sums[lo]
        best, pick = max(load[hi], load[lo]) * (1 - 1e-9), None
        for i in parts[hi]:
            for j in [None] + parts[lo]:
                dc = sample_cost[i] - (sample_cost[j] if j is not None else 0.0)
                dt = lengths[i] - (lengths[j] if j is not None else 0)
                m = max(load_of(ch - dc, th - dt), load_of(cl + dc, tl + dt))
                if m < best:
                    best, pick = m, (i, j, dc, dt)
        if pick is None:
            break
        i, j, dc, dt = pick
        parts[hi] = sorted([x for x in parts[hi] if x != i] + ([j] if j is not None else []))
        parts[lo] = sorted([x for x in parts[lo] if x != j] + [i])
        sums[hi], sums[lo] = [ch - dc, th - dt], [cl + dc, tl + dt]
        load[hi], load[lo] = load_of(*sums[hi]), load_of(*sums[lo])
    return parts


def _mini_partition(ls: list[int], world: int, max_tokens: int, cost: CostModel) -> list[list[int]]:
    """LB-Mini's samples per rank: KK on total cost, refined with the per-microbatch overhead.
    KK returns parts by descending sum; rank order follows it, deterministic either way."""
    return refine_partition(karmarkar_karp(cost.costs(ls), world, equal_size=False), ls, cost, max_tokens)


def lb_mini(lengths: Sequence[int], world: int, max_tokens: int, cost: CostModel | None = None) -> Plan:
    cost = cost or CostModel()
    ls = _check_minibatch(lengths, world, max_tokens)
    ranks = [tuple(fit_microbatches(p, ls, cost, max_tokens)) if p else ()
             for p in _mini_partition(ls, world, max_tokens, cost)]
    return Plan("lb_mini", world, max_tokens, tuple(ls), tuple(ranks))


def lb_steal(lengths: Sequence[int], world: int, max_tokens: int, cost: CostModel | None = None) -> Plan:
    """LB-Mini's plan, each rank's microbatches a deque for work stealing (`iter_steal`)."""
    mini = lb_mini(lengths, world, max_tokens, cost)
    return Plan("lb_steal", world, max_tokens, mini.lengths, mini.ranks)


def make_plan(balance: str, lengths: Sequence[int], world: int, max_tokens: int,
              cost: CostModel | None = None) -> Plan:
    fns = {"local_sort": local_sort, "lb_micro": lb_micro, "lb_mini": lb_mini, "lb_steal": lb_steal}
    if balance not in fns:
        raise ValueError(f"unknown balancer {balance!r}; choose one of {BALANCERS}")
    return fns[balance](lengths, world, max_tokens, cost)


# --------------------------------------------------------------------------- run-time stealing

# claim(version, owner, count, steal) -> index into owner's `count` microbatches of minibatch
# `version`, or -1 when none is left: the owner takes from the front, a thief (steal=True) from the
# back; shared by all ranks (ODC: `Runtime.claim`, a deque word in the owner's segment).
ClaimFn = Callable[[int, int, int, bool], int]


def steal_victims(plan: Plan, rank: int) -> list[int]:
    """The peers `rank` steals from, most planned tokens first (ties by rank)."""
    return sorted((r for r in range(plan.world) if r != rank and plan.ranks[r]),
                  key=lambda r: (-plan.rank_tokens(r), r))


def iter_steal(plan: Plan, rank: int, claim: ClaimFn, version: int) -> Iterator[tuple[int, ...]]:
    """The microbatches `rank` runs in minibatch `version` of an lb_steal plan: its own deque from
    the front, then steals from the back of its peers' deques (`steal_victims` order) until every
    deque is drained. Each claim happens when the previous microbatch is done (a generator), so
    a microbatch is taken only when this rank is free to start it."""
    if plan.balance != "lb_steal":
        raise ValueError(f"iter_steal needs an lb_steal plan, got {plan.balance!r}")
    own = plan.ranks[rank]
    while own:
        i = int(claim(version, rank, len(own), False))
        if i < 0:
            break
        yield own[i]
    victims = steal_victims(plan, rank)
    while victims:
        v = victims[0]
        i = int(claim(version, v, len(plan.ranks[v]), True))
        if i < 0:
            victims.pop(0)  # drained for good: deques only shrink within a minibatch
            continue
        yield plan.ranks[v][i]
