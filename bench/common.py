"""Shared plumbing of the benchmarks: timing, JSON records and tables."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np

def add_reproducible_argument(p) -> None:
    """--reproducible, for benches that create ODC runtimes (read it with `accumulate_of`)."""
    p.add_argument("--reproducible", action="store_true",
                   help="ODC owners sum pushes exactly (order-independent: bit-identical reruns; 16 bytes per owned "
                        "element instead of 4; CPU owners only). Default: the fp32 sum, or $JAXODC_ODC_ACCUMULATE")


def accumulate_of(args) -> str | None:
    """Runtime(accumulate=) for a bench's --reproducible: "exact", else None (the runtime's
    default: $JAXODC_ODC_ACCUMULATE or the fp32 sum)."""
    return "exact" if getattr(args, "reproducible", False) else None


def median_time(fn, reps: int, before=None) -> float:
    """Median wall time of fn() over `reps` runs; `before()` runs untimed ahead of each."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bootstrap(stat, n: int, n_boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(point, low, high): stat(all n repetitions) and its 95% interval by a paired bootstrap over
    repetitions. `stat(idx)` computes the statistic from the repetitions `idx` (an int array, with
    repeats), every compared quantity of a repetition taken together, so pairing is kept."""
    if n < 1:
        raise ValueError("bootstrap needs at least one repetition")
    point = float(stat(np.arange(n)))
    if n == 1:
        return point, point, point
    rng = np.random.default_rng(seed)
    boot = [stat(rng.integers(0, n, size=n)) for _ in range(n_boot)]
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return point, float(lo), float(hi)


def paired_ratio(a, b, n_boot: int = 2000, seed: int = 0, stat=np.median) -> tuple[float, float, float]:
    """`bootstrap` of `stat` (default the median) of the per-repetition ratios a[i] / b[i]
    (repetition i ran both on the same minibatches)."""
    r = np.asarray(a, np.float64) / np.asarray(b, np.float64)
    return bootstrap(lambda idx: stat(r[idx]), r.size, n_boot, seed)


def pooled_ratio(samples_a, time_a, samples_b, time_b, n_boot: int = 2000, seed: int = 0):
    """`bootstrap` of the whole-run throughput ratio (sum samples_a / sum time_a) / (sum samples_b /
    sum time_b) over paired repetitions."""
    sa, ta, sb, tb = (np.asarray(x, np.float64) for x in (samples_a, time_a, samples_b, time_b))
    return bootstrap(lambda i: (sa[i].sum() / ta[i].sum()) / (sb[i].sum() / tb[i].sum()), sa.size, n_boot, seed)


def fmt_ratio(point: float, low: float, high: float) -> str:
    """A ratio with its 95% interval, as the benchmarks print it."""
    return f"{point:.3f} [95% {low:.3f}..{high:.3f}]"


def write_records(path: str | None, records: list[dict]) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(records, f, indent=1)


def print_table(rows: list[dict], columns: list[str], file=sys.stdout) -> None:
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)), file=file)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)
