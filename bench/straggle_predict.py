"""What `bench train --straggle` could gain at most: the balance simulator replayed on the run's own
minibatches, plans and (pinned, deterministic) slowdowns, with the run's fitted ODC cost model.

Compute only (no optimizer phase, no waits), per injected spec and minibatch size, as ratios of
summed minibatch times over LB-Mini's: LB-Steal as iter_steal runs it (`steal_times`); the
clairvoyant bound (the best assignment of LB-Mini's or LB-Steal's microbatches to ranks, knowing
every slowdown in advance: what no online balancer beats without cutting the work otherwise); and
the fluid bound (the work divided over the ranks' speeds: no balancer beats it at all)."""
from __future__ import annotations

import itertools

import numpy as np

# fresh minibatches for the expectation, keyed on minibatch numbers far past any run's
EXPECT_MINIBATCHES = 2000
EXPECT_STEP0 = 1_000_000


def _best_assignment(costs: list[float], slow: np.ndarray) -> float:
    """Smallest makespan of indivisible jobs `costs` on ranks of times-per-unit `slow` (exhaustive
    up to 4096 assignments, else longest job first onto the rank that finishes it first)."""
    W = len(slow)
    if W ** len(costs) <= 4096:
        best = np.inf
        for a in itertools.product(range(W), repeat=len(costs)):
            load = np.zeros(W)
            for c, r in zip(costs, a):
                load[r] += c
            best = min(best, float((load * slow).max()))
        return best
    load = np.zeros(W)
    for c in sorted(costs, reverse=True):
        r = int(np.argmin((load + c) * slow))
        load[r] += c
    return float((load * slow).max())


def _replay(lens: list[int], straggle, W: int, cost, cfg, buckets) -> np.ndarray:
    """[LB-Mini, LB-Steal, clairvoyant, fluid] seconds of one minibatch of sample lengths `lens`
    under `straggle` (pinned to its minibatch), compute only."""
    from jaxodc.balance.packing import bucket
    from jaxodc.balance.plan import make_plan
    from jaxodc.balance.simulate import steal_times
    from jaxodc.train.straggle import microbatch_identity

    s, step = straggle, straggle.pinned
    slow = np.array([s.factor ** s.throttles(step, r) for r in range(W)])

    def work(m):  # compute follows the bucketed row (as the bench's busy_odc), slowed with the work
        t = cost.c + cost.b * bucket(sum(lens[i] for i in m), cfg.max_tokens, buckets) + \
            cost.a * sum(lens[i] ** 2 for i in m)
        return t * s.factor ** s.slowed(step, microbatch_identity(0, 0, [m]))

    plans = {b: make_plan(b, lens, W, cfg.max_tokens, cost) for b in ("lb_mini", "lb_steal")}
    mbs = {b: [work(m) for r in p.ranks for m in r] for b, p in plans.items()}
    mini = max(slow[r] * sum(work(m) for m in plans["lb_mini"].ranks[r]) for r in range(W))
    return np.array([mini, steal_times(plans["lb_steal"], work, slow).max(),
                     min(_best_assignment(c, slow) for c in mbs.values()),
                     min(sum(c) for c in mbs.values()) / float(np.sum(1.0 / slow))])


def predict(raw: dict, expect_minibatches: int = EXPECT_MINIBATCHES) -> list[dict]:
    """One dict per (spec, minibatch): "steal", "clairvoyant", "fluid" (ratios over LB-Mini) on the
    run's own minibatches, and "expected_steal", "expected_clairvoyant": the same over
    `expect_minibatches` fresh minibatches drawn from the run's pool under the same injection
    (slowdowns keyed on minibatch numbers the run never uses): what the run's few rare slowdowns
    estimate."""
    from jaxodc.balance.cost import CostModel
    from jaxodc.bench.train import _blocks, bucket_policy
    from jaxodc.data import sample_lengths
    from jaxodc.train.straggle import parse_straggle
    import argparse
    import dataclasses

    cfg = argparse.Namespace(**raw["config"])
    W = len({r["rank"] for r in raw["records"]})
    cost = CostModel(*raw["cost"])
    lengths = sample_lengths(cfg.preset, cfg.pool, cfg.max_tokens, cfg.seed + 1, 8)
    buckets = bucket_policy(cfg.max_tokens, cfg.min_bucket)
    specs = sorted({r["straggle"] for r in raw["records"] if r.get("straggle")})
    out = []
    for spec in specs:
        straggle = parse_straggle(spec)
        acc: dict = {}
        data_step = 0
        for _, mb, batches in _blocks(cfg, W, len(lengths)):
            for idx in batches:
                data_step += 1
                s = dataclasses.replace(straggle, pinned=data_step)
                acc[mb] = acc.get(mb, 0.0) + _replay(lengths[idx].tolist(), s, W, cost, cfg, buckets)
        for mb, (mini, steal, clair, fluid) in sorted(acc.items()):
            rng = np.random.default_rng([cfg.seed, mb, EXPECT_STEP0])
            fresh = sum(_replay(lengths[rng.choice(len(lengths), W * mb, replace=W * mb > len(lengths))].tolist(),
                                dataclasses.replace(straggle, pinned=EXPECT_STEP0 + k), W, cost, cfg, buckets)
                        for k in range(expect_minibatches))
            out.append({"straggle": spec, "minibatch": mb, "steal": float(mini / steal),
                        "clairvoyant": float(mini / clair), "fluid": float(mini / fluid),
                        "expected_steal": float(fresh[0] / fresh[1]),
                        "expected_clairvoyant": float(fresh[0] / fresh[2]),
                        "expected_minibatches": expect_minibatches})
    return out
