"""`jaxodc bench train`'s report: the ranks' raw minibatch records (bench/train.py's worker) read
into one row per (combo, minibatch size, injection), the paired ratios with their bootstrap
intervals and the simulator's ceiling, the issue's bars, the table and the timeline PNG.
Methodology: bench/README.md."""
from __future__ import annotations

import argparse
import statistics

import numpy as np

from jaxodc.bench.common import paired_ratio, pooled_ratio, print_table
from jaxodc.bench.train import COMBOS, TRANSPORT, _blocks, sum_comm


def _minibatch_records(recs: list[dict], busy: str | None, step_of=lambda r: (r["rep"], r["k"])):
    """MinibatchRecords with busy time from record field `busy` ("busy_est", "cpu"), or None:
    the measured microbatch + optimizer intervals."""
    from jaxodc.train.metrics import MinibatchRecord
    steps = {}
    out = []
    for r in recs:
        s = steps.setdefault(step_of(r), len(steps))
        out.append(MinibatchRecord(r["rank"], s, r["t_start"], r["t_end"], [tuple(c) for c in r["compute"]],
                                   tuple(r["opt"]), r["samples"], r["tokens"], r["loss"], r["comm"], r["balance"],
                                   r[busy] if busy else None))
    return out


def _busy_span(recs: list[dict]) -> float:
    """Sum over minibatches of (last rank's end - first rank's start): the time the combo ran,
    without the barriers between minibatches."""
    by: dict = {}
    for r in recs:
        by.setdefault(r["k"], []).append(r)
    return sum(max(r["t_end"] for r in g) - min(r["t_start"] for r in g) for g in by.values())


def _median_or_none(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ceilings(raw: dict) -> dict[int, float]:
    """Per minibatch size, the simulator's odc+lb_mini / collective+lb_micro samples/s ratio on the
    run's own minibatches (every repetition's), with the run's calibrated ODC cost model: compute
    only, no injection."""
    from jaxodc.balance.cost import CostModel
    from jaxodc.balance.simulate import ceiling, replay
    from jaxodc.data import synthetic_text
    if "config" not in raw or "cost" not in raw:  # records alone (tests): no run to replay
        return {}
    cfg = argparse.Namespace(**raw["config"])
    W = len({r["rank"] for r in raw["records"]})
    if "lengths" in raw:  # the run's own samples (--task: the generated JSONL's, tokenized)
        lengths = np.asarray(raw["lengths"])
    else:
        lengths = synthetic_text(cfg.preset, cfg.pool, cfg.max_tokens, seed=cfg.seed + 1, min_len=8).lengths
    cost = CostModel(*raw["cost"])
    by_mb: dict = {}
    for _, mb, batches in _blocks(cfg, W, len(lengths)):
        by_mb.setdefault(mb, []).extend(lengths[idx].tolist() for idx in batches)
    return {mb: ceiling(replay(mbs, W, cfg.max_tokens, cost)) for mb, mbs in by_mb.items()}


def attention_share(raw: dict) -> float:
    """Attention's share of a longest (max_tokens) sample's microbatch compute under the run's
    calibrated ODC cost model (a*s^2 over a*s^2 + b*s + c)."""
    a, b, c = raw["cost"]
    s = float(raw["config"]["max_tokens"])
    return a * s * s / (a * s * s + b * s + c) if a * s * s + b * s + c > 0 else 0.0


def summarize(raw: dict, predicted: list[dict] | None = None) -> tuple[list[dict], list[dict]]:
    """(one record per (combo, minibatch, injection), bar lines) from the ranks' raw minibatch
    records: the plain runs' bars, then, with --straggle, the injected runs' (their LB-Steal bar
    set by `predicted`, bench.straggle_predict's expectations)."""
    rows, bar_rows = [], []
    ceil = ceilings(raw)
    for straggle in sorted({r.get("straggle") for r in raw["records"]}, key=lambda x: x is not None):
        recs = [r for r in raw["records"] if r.get("straggle") == straggle]
        out, per_rep = _summarize_cells(recs)
        for r in out:
            r["straggle"] = straggle
            r["ceiling"] = ceil.get(r["minibatch"])
        rows += out
        bar_rows += bars(out, per_rep) if straggle is None else injected_bars(
            out, per_rep, straggle, [p for p in predicted or [] if p["straggle"] == straggle])
    return rows, bar_rows


def _summarize_cells(records: list[dict]) -> tuple[list[dict], dict]:
    from jaxodc.train.metrics import records_bubble_rate as bubble_rate
    W = len({r["rank"] for r in records})
    cells: dict = {}
    for r in records:
        cells.setdefault((r["comm"], r["balance"], r["minibatch"]), {}).setdefault(r["rep"], []).append(r)
    per_rep: dict = {}  # (comm, balance, mb) -> {rep: (samples, seconds)}
    out = []
    for (comm, balance, mb), reps in cells.items():
        sps, tps, bub_meas, bub_est, bub_cpu = {}, {}, [], [], []
        for rep, recs in sorted(reps.items()):
            span = _busy_span(recs)
            sps[rep] = sum(r["samples"] for r in recs) / span
            tps[rep] = sum(r["tokens"] for r in recs) / span
            meas = bubble_rate(_minibatch_records(recs, None))
            est = bubble_rate(_minibatch_records(recs, "busy_est"))
            bub_cpu.append(bubble_rate(_minibatch_records(recs, "cpu")))
            bub_meas.append(meas)
            bub_est.append(est)
        per_rep[(comm, balance, mb)] = {rep: (sum(r["samples"] for r in recs), _busy_span(recs))
                                        for rep, recs in reps.items()}
        allrecs = [r for recs in reps.values() for r in recs]
        steps = {(r["rep"], r["k"]) for r in allrecs}
        last = max(allrecs, key=lambda r: (r["rep"], r["k"]))
        v = list(sps.values())
        out.append({
            "kind": "train", "comm": comm, "balance": balance, "minibatch": mb, "ranks": W,
            "transport": TRANSPORT[comm.split("/")[0]],
            "samples_per_s": statistics.median(v), "bubble_rate": statistics.median(bub_cpu),
            "tokens_per_s": statistics.median(tps.values()),
            "samples_per_s_min": min(v), "samples_per_s_max": max(v),
            "bubble_intervals": statistics.median(bub_meas), "bubble_model": statistics.median(bub_est),
            "bubble_source": "cpu time",
            "reps": len(v), "steps": len(steps),
            # the whole run's samples over its time: every minibatch weighted by its length
            "samples_per_s_pooled": sum(r["samples"] for r in allrecs) / sum(_busy_span(g) for g in reps.values()),
            "steals": sum(r.get("stolen", 0) for r in allrecs),
            "minibatches_with_steals": len({(r["rep"], r["k"]) for r in allrecs if r.get("stolen", 0)}),
            "microbatches_per_rank": sum(r["n_micro"] for r in allrecs) / (W * len(steps)),
            "loss": last["loss"],
            "straggle_s_per_minibatch": sum(r.get("straggle_s", 0.0) for r in allrecs) / len(steps),
            "stolen_s_per_minibatch": sum(r.get("stolen_s", 0.0) for r in allrecs) / len(steps),
            "minibatches_throttled": len({(r["rep"], r["k"]) for r in allrecs if r.get("throttled")}),
            # the end of a minibatch (StepResult.end_s): the median over ranks and minibatches
            "end_s": _median_or_none([r.get("end_s") for r in allrecs]),
        })
    order = {c: i for i, c in enumerate(COMBOS)}
    out.sort(key=lambda r: (r["minibatch"], order.get((r["comm"], r["balance"]), len(order))))
    return out, per_rep


def _paired(per_rep, a, b, mb):
    """Combo a over combo b at minibatch mb, repetitions paired (same repetition = same
    minibatches): {"median": median of per-repetition samples/s ratios, "ci95": its paired
    bootstrap interval, "range": (min, max) per repetition, "pooled": whole-run ratio (samples over
    summed spans), "pooled_ci95"}; None when either is missing."""
    ra, rb = per_rep.get((*a, mb)), per_rep.get((*b, mb))
    if not ra or not rb:
        return None
    ks = [k for k in ra if k in rb]
    A, B = [ra[k] for k in ks], [rb[k] for k in ks]
    r = [(x[0] / x[1]) / (y[0] / y[1]) for x, y in zip(A, B)]
    med, lo, hi = paired_ratio([x[0] / x[1] for x in A], [y[0] / y[1] for y in B])
    pooled, plo, phi = pooled_ratio([x[0] for x in A], [x[1] for x in A], [y[0] for y in B], [y[1] for y in B])
    return {"median": med, "ci95": [lo, hi], "range": [min(r), max(r)], "pooled": pooled, "pooled_ci95": [plo, phi]}


def _bar(name, mb, p, threshold=None, passed=None, **extra) -> dict:
    return {"bar": name, "minibatch": mb, "value": p["median"], "ci95": p["ci95"], "range": p["range"],
            "threshold": threshold, "pass": passed, **extra}


def gain_share(value: float, ceiling: float | None) -> float | None:
    """Fraction of the simulator's gain a measured ratio realises: (value - 1) / (ceiling - 1)."""
    if ceiling is None or not ceiling > 1.0:
        return None
    return (value - 1.0) / (ceiling - 1.0)


def bars(rows: list[dict], per_rep: dict) -> list[dict]:
    """The issue's bars, one dict each: {"bar", "minibatch", "value", "ci95", "threshold", "pass", ...}."""
    out = []
    mbs = sorted({r["minibatch"] for r in rows})
    cell = {(r["comm"], r["balance"], r["minibatch"]): r for r in rows}
    base, mini, steal = ("collective", "lb_micro"), ("odc", "lb_mini"), ("odc", "lb_steal")
    fair, micro = ("collective@jaxodc", "lb_micro"), ("odc", "lb_micro")
    for mb in mbs:  # the same transport: what ODC's decoupled microbatches and LB-Mini buy
        p = _paired(per_rep, mini, fair, mb)
        if p:
            ceil = cell[(*mini, mb)].get("ceiling")
            share = gain_share(p["median"], ceil)
            gated = mb in (4, 8)
            ok = p["median"] >= 1.07 and share is not None and share >= 0.75
            out.append(_bar("odc+lb_mini / collective@jaxodc+lb_micro samples/s", mb, p, 1.07 if gated else None,
                            ok if gated else None, ceiling=ceil, gain_share=share))
    p = _paired(per_rep, micro, fair, 1) if 1 in mbs else None
    if p:  # identical schedules on the same transport: the two trainers' own overheads
        out.append(_bar("odc+lb_micro / collective@jaxodc+lb_micro samples/s (identical schedules)", 1, p, 1.0,
                        p["median"] >= 1.0))
    for mb in mbs:
        p = _paired(per_rep, mini, base, mb)
        if p:
            out.append(_bar("odc+lb_mini / collective+lb_micro samples/s", mb, p))
    for mb in mbs:
        p = _paired(per_rep, steal, mini, mb)
        if p:
            s = cell[(*steal, mb)]
            # LB-Steal runs LB-Mini's plan: calm, it may cost only its deque claims. Context for a
            # ratio near 1: how often a steal changed the schedule at all, and the whole run's ratio.
            gated = mb in (1, 2, 4, 8)
            out.append(_bar("odc+lb_steal / odc+lb_mini samples/s", mb, p, 0.99 if gated else None,
                            p["median"] >= 0.99 if gated else None,
                            pooled=p["pooled"], minibatches_with_steals=s["minibatches_with_steals"],
                            minibatches=s["steps"]))
    for mb in mbs:
        if mb < 4:
            continue
        b = cell.get((*fair, mb))
        for odc in (mini, steal):
            o = cell.get((*odc, mb))
            if b and o:
                val = o["bubble_rate"] / b["bubble_rate"] if b["bubble_rate"] > 0 else float("inf")
                out.append({"bar": f"{odc[0]}+{odc[1]} bubble / collective@jaxodc+lb_micro bubble", "minibatch": mb,
                            "value": val, "threshold": None, "pass": None,
                            "odc_bubble": o["bubble_rate"], "collective_bubble": b["bubble_rate"]})
    for other in ("fp32", "exact"):  # --compare-sum: the exact sum over fp32 arrival order
        exact, fp32 = (mini, (sum_comm(other), "lb_mini")) if other == "fp32" else ((sum_comm(other), "lb_mini"), mini)
        for mb in mbs:
            p = _paired(per_rep, exact, fp32, mb)
            if p:
                out.append(_bar("odc+lb_mini exact sum / fp32 sum samples/s (reproducible accumulation)", mb, p, 0.97,
                                p["median"] >= 0.97, pooled=p["pooled"], pooled_ci95=p["pooled_ci95"]))
    o, c = cell.get((*mini, 4)), cell.get((*fair, 4))
    if o and c and o.get("end_s") is not None and c.get("end_s"):
        val = o["end_s"] / c["end_s"]
        out.append({"bar": "odc+lb_mini end_s / collective@jaxodc+lb_micro end_s (median end of minibatch)",
                    "minibatch": 4, "value": val, "threshold": None, "pass": None,  # a figure, no longer a bar
                    "odc_end_s": o["end_s"], "collective_end_s": c["end_s"]})
    return out


def injected_bars(rows: list[dict], per_rep: dict, straggle: str, predicted: list[dict] = ()) -> list[dict]:
    """The bars under straggler injection: ODC's balancing against the collective on the same
    transport (>= 1.15), and stealing against LB-Mini (>= 75% of the gain the simulator expects
    over fresh minibatches under the same injection, `predicted`'s "expected_steal"; no bar
    without a prediction), at minibatch 4 and 8. The value is the whole run's
    throughput ratio (samples over the summed minibatch spans): slowdowns are rare events that
    hit a minority of repetitions, and the median of per-repetition ratios would look past them
    (the median is kept as "median")."""
    out = []
    fair, mini, steal = ("collective@jaxodc", "lb_micro"), ("odc", "lb_mini"), ("odc", "lb_steal")
    cell = {(r["comm"], r["balance"], r["minibatch"]): r for r in rows}
    for mb in sorted({r["minibatch"] for r in rows}):
        expected = next((x["expected_steal"] for x in predicted if x["minibatch"] == mb), None)
        steal_bar = None if expected is None else 1.0 + 0.75 * (expected - 1.0)
        for (a, b, thr) in ((mini, fair, 1.15), (steal, mini, steal_bar)):
            p = _paired(per_rep, a, b, mb)
            gated = mb in (4, 8) and thr is not None
            if p:
                row = {"bar": f"{a[0]}+{a[1]} / {b[0]}+{b[1]} samples/s (straggle {straggle})", "minibatch": mb,
                       "value": p["pooled"], "ci95": p["pooled_ci95"], "median": p["median"], "range": p["range"],
                       "threshold": thr if gated else None, "pass": p["pooled"] >= thr if gated else None,
                       "minibatches_throttled": cell[(*a, mb)]["minibatches_throttled"]}
                if a == steal:
                    s = cell[(*steal, mb)]
                    row.update(minibatches_with_steals=s["minibatches_with_steals"], minibatches=s["steps"],
                               expected_steal=expected)
                out.append(row)
    return out


def print_report(rows: list[dict], bar_rows: list[dict], raw: dict | None = None) -> None:
    print_table([dict(r, combo=f"{r['comm']}+{r['balance']}" + (f" ({r['straggle']})" if r.get("straggle") else ""))
                 for r in rows],
                ["minibatch", "combo", "samples_per_s", "samples_per_s_min", "samples_per_s_max", "tokens_per_s",
                 "bubble_rate", "bubble_intervals", "bubble_model", "microbatches_per_rank", "end_s", "ceiling", "reps"])
    print("(bubble_rate: busy = each rank's process CPU time in the minibatch, every combo alike; bubble_intervals:"
          " busy = microbatch + optimizer intervals; bubble_model: busy from the cost model)")
    if raw:
        a, b, c = raw["cost"]
        ca, cb, cc = raw["cost_collective"]
        warm = next(c for c in raw["calib"] if c["rep"] == -1 and c["rank"] == 0)
        step = lambda mode, T: warm[mode][str(T)]  # noqa: E731 - JSON object keys are strings
        print(f"cost models (s; a*sum(s^2) + b*tokens + c per microbatch): odc a={a:.3g} b={b:.3g} c={c:.3g}, "
              f"collective a={ca:.3g} b={cb:.3g} c={cc:.3g}; microbatch step seconds per row length "
              "(rank 0, warm-up, collective / odc): "
              + ", ".join(f"{T}: {step('collective', T):.4f} / {step('odc', T):.4f}" for T in raw["rows"]))
        print(f"attention share of a {raw['config']['max_tokens']}-token sample (calibrated): {attention_share(raw):.0%}")
    print()
    for b in bar_rows:
        rng = f" (per-rep {b['range'][0]:.2f}..{b['range'][1]:.2f})" if "range" in b else ""
        if "median" in b:
            rng = f" (whole run; median of per-rep {b['median']:.3f}, {b['range'][0]:.2f}..{b['range'][1]:.2f})"
        if "ci95" in b:
            rng = f" [95% {b['ci95'][0]:.3f}..{b['ci95'][1]:.3f}]" + rng
        if b.get("ceiling") is not None:
            share = "" if b.get("gain_share") is None else f", {b['gain_share']:.0%} of its gain"
            rng += f" (ceiling {b['ceiling']:.3f}{share})"
        extra = (f" [odc {b['odc_bubble']:.1%}, collective {b['collective_bubble']:.1%}]"
                 if "odc_bubble" in b else "")
        if "minibatches_with_steals" in b and "pooled" not in b:
            extra += f" [steals in {b['minibatches_with_steals']} of {b['minibatches']} minibatches]"
        if "pooled" in b and "median" not in b:
            steals = (f"; steals in {b['minibatches_with_steals']} of {b['minibatches']} minibatches"
                      if "minibatches_with_steals" in b else "")
            extra += f" [whole run {b['pooled']:.3f}{steals}]"
        verdict = "" if b["pass"] is None else (" PASS" if b["pass"] else " FAIL")
        if isinstance(b["threshold"], list):
            thr = f" (bar within {b['threshold'][0]}..{b['threshold'][1]})"
        else:
            thr = "" if b["threshold"] is None else (f" (bar {'<=' if 'bubble' in b['bar'] or 'end_s' in b['bar'] else '>='} {b['threshold']})")
        print(f"minibatch {b['minibatch']}: {b['bar']} = {b['value']:.3f}{rng}{extra}{thr}{verdict}")


def draw_timeline(raw: dict, path: str, mb: int = 4) -> str:
    from jaxodc.cli.timeline import draw
    recs = raw["records"]
    mbs = sorted({r["minibatch"] for r in recs})
    mb = mb if mb in mbs else mbs[-1]
    rep = max(r["rep"] for r in recs)
    runs = {}
    for comm, balance in COMBOS:
        sel = [r for r in recs if (r["comm"], r["balance"], r["minibatch"], r["rep"]) == (comm, balance, mb, rep)
               and r.get("straggle") is None]
        if sel:
            # bars are the measured intervals; idle and the titles' bubble follow CPU time
            runs[f"{comm}+{balance} (minibatch {mb})"] = _minibatch_records(sel, "cpu", lambda r: r["k"])
    return draw(runs, path, title=f"per-rank compute (bars) and idle, repetition {rep}, minibatch {mb} per rank")
