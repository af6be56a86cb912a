"""`jaxodc bench NAME`: dispatches to the benchmark modules in the `bench` package."""
from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "primitives": "bench.primitives",
    "train": "bench.train",
    "allreduce": "bench.allreduce",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: jaxodc bench {{{','.join(BENCHMARKS)}}} [--json PATH] [options]", file=sys.stderr)
        return 2
    return int(importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:]) or 0)
