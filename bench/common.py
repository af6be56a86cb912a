"""Shared plumbing of the benchmarks: timing, JSON records and tables."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

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
