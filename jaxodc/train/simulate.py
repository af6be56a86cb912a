"""Bubble-rate simulator (`jaxodc simulate`): replays a length distribution through the cost model.

For each global minibatch (W ranks x B samples per rank) a balancer makes a plan; then
- collective: microbatches run in lock-step (per-layer collectives), so microbatch step m takes the
  max over ranks of their m-th microbatch's cost, and the minibatch takes the sum of those steps;
- odc: each rank runs its own microbatches back to back; the minibatch takes the max over ranks of
  their totals (LB-Steal: work stealing replayed with the true costs, `steal_times`).
Bubble rate = idle / total device time = sum over ranks of (minibatch time - rank busy) /
(W x minibatch time), summed over all simulated minibatches -- the paper's Tables 4 and 6."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

import numpy as np

from jaxodc.train.balance import Plan, make_plan, steal_victims
from jaxodc.train.cost import CostModel
from jaxodc.train.data import PRESETS, load_lengths, sample_lengths

METHODS = ("collective/local_sort", "collective/lb_micro", "odc/local_sort", "odc/lb_micro",
           "odc/lb_mini", "odc/lb_steal")


def plan_times(plan: Plan, cost: CostModel, comm: str, actual: Sequence[float] | None = None) -> tuple[float, np.ndarray]:
    """(minibatch time, busy time per rank) of one plan under `comm`. `actual[i]`: the true cost
    of sample i when it differs from the model the plan was made with (plus the model's
    per-microbatch c)."""
    true = (lambda mb: (cost.c if mb else 0.0) + sum(actual[i] for i in mb)) if actual is not None else \
        (lambda mb: cost.microbatch([plan.lengths[i] for i in mb]))
    if plan.balance == "lb_steal" and comm == "odc":
        busy = steal_times(plan, true)
        return float(busy.max()), busy
    mb_cost = [[true(mb) for mb in r] for r in plan.ranks]
    busy = np.array([sum(c) for c in mb_cost])
    if comm == "collective":
        m = max(len(c) for c in mb_cost)
        steps = [max(c[j] if j < len(c) else 0.0 for c in mb_cost) for j in range(m)]
        return float(sum(steps)), busy
    if comm == "odc":
        return float(busy.max()), busy
    raise ValueError(f"unknown comm {comm!r}; choose 'collective' or 'odc'")


def steal_times(plan: Plan, true) -> np.ndarray:
    """Busy time per rank of an lb_steal plan run as iter_steal runs it, with microbatch m taking
    true(m): the rank that is free first claims next (its own deque's front, else the back of
    the first non-empty victim deque); a rank that finds every deque empty is done."""
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
        clock[r] += true(mb)
    return clock


def bubble_rate(times: Sequence[tuple[float, np.ndarray]]) -> float:
    idle = sum(float(T * len(b) - b.sum()) for T, b in times)
    total = sum(float(T * len(b)) for T, b in times)
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


def table(rows: list[dict], methods: Sequence[str]) -> str:
    head = f"| {'devices':>7} | {'minibs':>6} | " + " | ".join(f"{m:>21}" for m in methods) + " |"
    sep = "|" + "|".join("-" * (len(c) + 2) for c in head.strip("|").split("|")[1:-1]) + "|"
    sep = "|" + "-" * 9 + "|" + "-" * 8 + "|" + "|".join("-" * 23 for _ in methods) + "|"
    lines = [head, sep]
    for r in rows:
        lines.append(f"| {r['devices']:>7} | {r['minibatch']:>6} | "
                     + " | ".join(f"{100 * r['bubble'][m]:>20.2f}%" for m in methods) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jaxodc simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="longalign", choices=sorted(PRESETS))
    p.add_argument("--lengths-file", help="file of sample lengths (overrides --preset)")
    p.add_argument("--max-len", type=int, default=None,
                   help="max sequence length (default: the preset's paper maximum, or the file's max)")
    p.add_argument("--devices", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--minibatch", type=int, nargs="+", default=[1, 2, 4, 8], help="samples per rank per minibatch")
    p.add_argument("--packing-ratio", type=float, default=1.0, help="max_tokens / max_len")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--cost-a", type=float, default=CostModel.a)
    p.add_argument("--cost-b", type=float, default=CostModel.b)
    p.add_argument("--cost-noise", type=float, default=0.0,
                   help="true cost = model cost * exp(noise * N(0,1)) per sample (plans use the model)")
    p.add_argument("--steps", type=int, default=32, help="minibatches simulated per cell")
    p.add_argument("--pool", type=int, default=20000, help="preset lengths drawn into the pool")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", help="also write the results as JSON here ('-' = stdout)")
    a = p.parse_args(argv)
    cost = CostModel(a.cost_a, a.cost_b)
    if a.lengths_file:
        pool = load_lengths(a.lengths_file)
        max_len = a.max_len or int(pool.max())
        if pool.max() > max_len:
            print(f"jaxodc simulate: {a.lengths_file} has a length {pool.max()} > --max-len {max_len}", file=sys.stderr)
            return 2
        source = a.lengths_file
    else:
        max_len = a.max_len or PRESETS[a.preset]["paper_max"]
        pool = sample_lengths(a.preset, a.pool, max_len, a.seed)
        source = a.preset
    max_tokens = int(a.packing_ratio * max_len)
    if max_tokens < max_len:
        print(f"jaxodc simulate: packing ratio {a.packing_ratio} gives max_tokens {max_tokens} < max_len {max_len}",
              file=sys.stderr)
        return 2
    rows = []
    for w in a.devices:
        for b in a.minibatch:
            rows.append({"devices": w, "minibatch": b,
                         "bubble": simulate(pool, w, b, max_tokens, cost, a.methods, a.steps, a.seed, a.cost_noise)})
    print(f"bubble rate (idle / total device time), data={source}, max_len={max_len}, max_tokens={max_tokens}, "
          f"cost={cost.a:g}*s^2+{cost.b:g}*s, "
          f"cost noise {a.cost_noise:g}, {a.steps} minibatches per cell")
    print(table(rows, a.methods))
    if a.json_path:
        doc = {"source": source, "max_len": max_len, "max_tokens": max_tokens, "cost": {"a": cost.a, "b": cost.b}, "cost_noise": a.cost_noise,
               "steps": a.steps, "seed": a.seed, "rows": rows}
        if a.json_path == "-":
            print(json.dumps(doc, indent=1))
        else:
            with open(a.json_path, "w") as fh:
                json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
