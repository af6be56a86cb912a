"""Bubble-rate simulator: replays a length distribution through the cost model.

For each global minibatch (W ranks x B samples per rank) a balancer makes a plan; then
- collective: microbatches run in lock-step (per-layer collectives), so microbatch step m takes the
  max over ranks of their m-th microbatch's cost, and the minibatch takes the sum of those steps;
- odc: each rank runs its own microbatches back to back; the minibatch takes the max over ranks of
  their totals (LB-Steal: work stealing replayed with the true costs, `steal_times`).
Bubble rate = idle / total device time = sum over ranks of (minibatch time - rank busy) /
(W x minibatch time), summed over all simulated minibatches -- the paper's Tables 4 and 6."""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from jaxodc.balance.plan import Plan, make_plan, steal_victims
from jaxodc.balance.cost import CostModel

METHODS = ("collective/local_sort", "collective/lb_micro", "odc/local_sort", "odc/lb_micro",
           "odc/lb_mini", "odc/lb_steal")


def plan_times(plan: Plan, cost: CostModel, comm: str, actual: Sequence[float] | None = None,
               slow: Sequence[float] | None = None) -> tuple[float, np.ndarray]:
    """(minibatch time, busy time per rank) of one plan under `comm`. `actual[i]`: the true cost
    of sample i when it differs from the model the plan was made with (plus the model's
    per-microbatch c). `slow[r]`: rank r runs everything that many times slower (a throttled
    device, which no plan foresees)."""
    slow = np.ones(plan.world) if slow is None else np.asarray(slow, np.float64)
    true = (lambda mb: (cost.c if mb else 0.0) + sum(actual[i] for i in mb)) if actual is not None else \
        (lambda mb: cost.microbatch([plan.lengths[i] for i in mb]))
    if plan.balance == "lb_steal" and comm == "odc":
        busy = steal_times(plan, true, slow)
        return float(busy.max()), busy
    mb_cost = [[true(mb) * slow[r] for mb in mbs] for r, mbs in enumerate(plan.ranks)]
    busy = np.array([sum(c) for c in mb_cost])
    if comm == "collective":
        m = max(len(c) for c in mb_cost)
        steps = [max(c[j] if j < len(c) else 0.0 for c in mb_cost) for j in range(m)]
        return float(sum(steps)), busy
    if comm == "odc":
        return float(busy.max()), busy
    raise ValueError(f"unknown comm {comm!r}; choose 'collective' or 'odc'")


def steal_times(plan: Plan, true, slow: Sequence[float] | None = None) -> np.ndarray:
    """Busy time per rank of an lb_steal plan run as iter_steal runs it, with microbatch m taking
    true(m) (times slow[r] on rank r): the rank that is free first claims next (its own deque's
    front, else the back of the first non-empty victim deque); a rank that finds every deque
    empty is done."""
    W = plan.world
    ends = [[0, len(r)] for r in plan.ranks]
    victims = [steal_victims(plan, r) for r in range(W)]
    clock = np.zeros(W)
    active = set(range(W))
    while active:
        r = min(active, key=lambda j: (clock[j], j))
        if ends[r][0] < ends[r][1]:
            mb = plan.ranks[r][ends[r][0]]
            ends[r][0] += 1
        else:
            v = next((v for v in victims[r] if ends[v][0] < ends[v][1]), None)
            if v is None:
                active.discard(r)
                continue
            ends[v][1] -= 1
            mb = plan.ranks[v][ends[v][1]]
        clock[r] += true(mb) * (1.0 if slow is None else slow[r])
    return clock


def bubble_rate(times: Iterable[tuple[float, Sequence[float]]]) -> float:
    """Idle / total device time over minibatches given as (minibatch time, busy time per rank)."""
    idle = total = 0.0
    for span, busy in times:
        idle += sum(max(span - float(b), 0.0) for b in busy)
        total += span * len(busy)
    return idle / total if total > 0 else 0.0


def simulate(pool: np.ndarray, world: int, minibatch: int, max_tokens: int, cost: CostModel,
             methods: Sequence[str] = METHODS, steps: int = 32, seed: int = 0,
             cost_noise: float = 0.0) -> dict[str, float]:
    """Bubble rate per method over `steps` global minibatches drawn from the length pool.
    `cost_noise` > 0: every sample's true cost is the model's times exp(cost_noise * N(0, 1)),
    so plans are made with an imperfect cost model (what run-time stealing absorbs)."""
    pool = np.asarray(pool, np.int64)
    g = world * minibatch
    rng = np.random.default_rng([seed, world, minibatch])
    order = np.concatenate([rng.permutation(len(pool)) for _ in range(-(-steps * g // len(pool)))])
    acc: dict[str, list] = {m: [] for m in methods}
    plans: dict[str, Plan] = {}
    for s in range(steps):
        lens = pool[order[s * g:(s + 1) * g]].tolist()
        plans.clear()
        actual = None
        if cost_noise > 0:
            actual = cost(np.asarray(lens)) * np.exp(cost_noise * rng.standard_normal(len(lens)))
        for m in methods:
            comm, bal = m.split("/")
            if bal not in plans:
                plans[bal] = make_plan(bal, lens, world, max_tokens, cost)
            acc[m].append(plan_times(plans[bal], cost, comm, actual))
    return {m: bubble_rate(v) for m, v in acc.items()}


def replay(minibatches: Iterable[Sequence[int]], world: int, max_tokens: int, cost: CostModel,
           methods: Sequence[str] = ("collective/lb_micro", "odc/lb_mini")) -> dict[str, dict[str, float]]:
    """The simulator on given global minibatches (each a list of sample lengths) instead of draws
    from a pool: per method {"time": summed minibatch times, "bubble": bubble rate}, in the cost
    model's unit, compute only. What a benchmark prints beside its measurement of the same
    minibatches; the ceiling of a ratio is `ceiling(out)`."""
    acc: dict[str, list] = {m: [] for m in methods}
    for lens in minibatches:
        plans: dict[str, Plan] = {}
        for m in methods:
            comm, bal = m.split("/")
            if bal not in plans:
                plans[bal] = make_plan(bal, [int(x) for x in lens], world, max_tokens, cost)
            acc[m].append(plan_times(plans[bal], cost, comm))
    return {m: {"time": float(sum(t for t, _ in v)), "bubble": bubble_rate(v)} for m, v in acc.items()}


def ceiling(replayed: dict[str, dict[str, float]], method: str = "odc/lb_mini",
            baseline: str = "collective/lb_micro") -> float:
    """Speed-up of `method` over `baseline` the simulator predicts (compute only): the ratio of
    their summed minibatch times on the same minibatches."""
    t = replayed[method]["time"]
    return replayed[baseline]["time"] / t if t > 0 else float("nan")
