"""`jaxodc bench NAME`: dispatches to the benchmarks in jaxodc.bench (the repository's bench/)."""
from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "primitives": "jaxodc.bench.primitives",
    "train": "jaxodc.bench.train",
    "scale": "jaxodc.bench.scale",
    "models": "jaxodc.bench.models",
    "allreduce": "jaxodc.bench.allreduce",
    "sketch": "jaxodc.bench.sketch",
    "diloco": "jaxodc.bench.diloco",
    "compile": "jaxodc.bench.compile",
    "load": "jaxodc.bench.load",
    "fuzz": "jaxodc.bench.fuzz",
    "optim": "jaxodc.bench.optim",
    "optim-memory": "jaxodc.bench.optim_memory",
    "faults": "jaxodc.bench.faults",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: jaxodc bench {{{','.join(BENCHMARKS)}}} [--json PATH] [options]", file=sys.stderr)
        return 2
    return int(importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:]) or 0)
