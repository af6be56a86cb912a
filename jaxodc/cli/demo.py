"""`jaxodc demo`: trains the small decoder LM on long-tailed byte-level text (Python's own library
sources) on 2 local ranks, first with the collective baseline + LB-Micro (over jaxodc's own
lock-step collective, the transport ODC uses, so the comparison measures ODC's scheduling), then
with ODC + LB-Mini, in the same processes, and prints loss, throughput and bubble rate of both plus a timeline PNG
and the per-minibatch records in --out. It is `jaxodc train` (jaxodc.cli.train) with both runs and
one warm-up minibatch each.

    jaxodc demo [--steps 6] [--minibatch 4] [--max-tokens 256] [--out DIR]
"""
from __future__ import annotations

import argparse
import os
import sys


def _args(argv):
    p = argparse.ArgumentParser(prog="jaxodc demo")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed minibatches per mode (after one warm-up)")
    p.add_argument("--minibatch", type=int, default=4, help="samples per rank per minibatch")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per packed microbatch")
    p.add_argument("--preset", default="longalign", help="sample-length preset (long-tailed)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--out", default="jaxodc_demo", help="directory for demo_timeline.png and demo.json")
    return p.parse_args(argv)


def train_argv(args) -> list[str]:
    """The `jaxodc train` invocation the demo runs."""
    return ["--ranks", str(args.ranks), "--comm", "collective,odc", "--balance", "lb_micro,lb_mini",
            "--collective-transport", "jaxodc",
            "--steps", str(args.steps + 1), "--warmup", "1", "--minibatch", str(args.minibatch),
            "--max-tokens", str(args.max_tokens), "--preset", args.preset, "--d-model", str(args.d_model),
            "--layers", str(args.layers), "--lr", "3e-3", "--clip", "1.0", "--timeline", os.path.join(args.out, "demo_timeline.png"),
            "--json", os.path.join(args.out, "demo.json")]


def main(argv: list[str]) -> int:
    from jaxodc.cli.train import main as train
    return train(train_argv(_args(argv)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
