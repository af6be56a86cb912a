"""`jaxodc simulate`: the bubble-rate simulator (jaxodc.balance.simulate) over a length
distribution, as a table of devices x minibatch sizes per method."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from jaxodc.balance.cost import CostModel
from jaxodc.balance.simulate import METHODS, simulate
from jaxodc.balance.simulate import __doc__ as simulate_doc
from jaxodc.data import PRESETS, load_lengths, sample_lengths


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
    p = argparse.ArgumentParser(prog="jaxodc simulate", description=simulate_doc.split("\n\n")[0])
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
