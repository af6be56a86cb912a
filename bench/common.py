"""Shared plumbing of the benchmarks: launching ranks, timing, JSON records and tables."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

# One compute thread per rank so that ranks sharing few cores do not fight over them.
RANK_ENV = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false", "OMP_NUM_THREADS": "1"}


def pin_one_core(index: int = 0) -> int | None:
    """Pin this process to one of its allowed cores (`index` modulo their count), before jax is
    imported: XLA sizes its intra-op thread pool from the CPU affinity, so without this a rank
    that asked for one compute thread still spreads work over every core and two ranks fight
    over them. Returns the core, or None where affinity is not supported."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    core = cores[index % len(cores)]
    os.sched_setaffinity(0, {core})
    return core


def launch_ranks(world: int, module: str, args: list[str], timeout_s: float, env: dict | None = None) -> None:
    """Runs `python -m module args` on `world` local ranks through `jaxodc launch` (`env` on top of
    RANK_ENV)."""
    from jaxodc.launch import main as launch
    os.environ.update(RANK_ENV)
    os.environ.update(env or {})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    status = launch(["-n", str(world), "--timeout", str(int(timeout_s)), "-m", module] + args)
    if status != 0:
        raise SystemExit(f"benchmark ranks of {module} failed with status {status}")


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
