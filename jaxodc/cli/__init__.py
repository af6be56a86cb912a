"""`jaxodc` command line: each subcommand lives in its own module and is imported on demand."""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module, function, one-line help). Each function takes argv (list[str]) and
# returns an exit status.
COMMANDS = {
    "launch": ("jaxodc.launch.launcher", "main", "start N ranks of a script (torchrun-like)"),
    "demo": ("jaxodc.cli.demo", "main", "train the small LM with ODC vs collective on 2 ranks"),
    "train": ("jaxodc.cli.train", "main", "train a model with the sharded trainer"),
    "simulate": ("jaxodc.cli.simulate", "main", "bubble-rate simulator for a length distribution"),
    "bench": ("jaxodc.cli.bench", "main", "benchmarks: primitives, train, allreduce"),
    "master": ("jaxodc.coord.service", "main", "run the coordination service standalone"),
    "cluster": ("jaxodc.launch.cluster", "main", "emulated hosts on this machine (root): up, exec, faults, down"),
}


def usage() -> str:
    lines = ["usage: jaxodc COMMAND [args]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"jaxodc: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module, func, _ = COMMANDS[name]
    try:
        return int(getattr(importlib.import_module(module), func)(rest) or 0)
    except KeyboardInterrupt:  # ^C before a command installed its own handling: one line
        print(f"jaxodc {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
