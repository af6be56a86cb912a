"""Per-rank Gantt chart of compute vs idle per minibatch, several runs side by side (e.g. ODC vs
collective), so a stall is visible at a glance. Where a record's busy time (`busy_s`, e.g. CPU
time) is below its measured intervals -- a collective microbatch interval includes waiting for the
peer -- each interval is drawn shortened in that proportion and the rest shows as idle. `draw({"odc + lb_mini": recs, ...}, "out.png")`
or `python -m jaxodc.cli.timeline out.png RUNS.json` (the --json of `jaxodc train`)."""
from __future__ import annotations

import json
import sys
from typing import Mapping, Sequence

from jaxodc.train.metrics import MinibatchRecord, records_bubble_rate

_COLORS = ("#1f77b4", "#2ca02c")  # alternate per minibatch so neighbours stay distinguishable


def draw(runs: Mapping[str, Sequence[MinibatchRecord]], path: str, title: str | None = None) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not runs:
        raise ValueError("timeline: no runs to draw")
    n = len(runs)
    tmax = max((max(r.t_end for r in recs) - min(r.t_start for r in recs)) for recs in runs.values() if recs)
    world = max(max(r.rank for r in recs) + 1 for recs in runs.values() if recs)
    fig, axes = plt.subplots(n, 1, figsize=(11, 1.1 + 0.55 * world * n + 0.4 * n), squeeze=False, sharex=True)
    for ax, (name, recs) in zip(axes[:, 0], runs.items()):
        if not recs:
            raise ValueError(f"timeline: run {name!r} has no records")
        t0 = min(r.t_start for r in recs)
        steps: dict[int, list[MinibatchRecord]] = {}
        for r in recs:
            steps.setdefault(r.step, []).append(r)
        for k, (step, rs) in enumerate(sorted(steps.items())):
            a = min(r.t_start for r in rs) - t0
            b = max(r.t_end for r in rs) - t0
            for r in rs:
                ax.broken_barh([(a, b - a)], (r.rank - 0.4, 0.8), facecolors="#f4cccc", edgecolor="none")
                spans = sum(y - x for x, y in r.compute) + (r.opt[1] - r.opt[0] if r.opt else 0.0)
                f = min(1.0, r.busy / spans) if spans > 0 else 1.0
                ax.broken_barh([(x - t0, (y - x) * f) for x, y in r.compute], (r.rank - 0.4, 0.8),
                               facecolors=_COLORS[k % 2], edgecolor="white", linewidth=0.3)
                if r.opt:
                    ax.broken_barh([(r.opt[0] - t0, (r.opt[1] - r.opt[0]) * f)], (r.rank - 0.4, 0.8), facecolors="#ff7f0e")
            ax.axvline(b, color="grey", linewidth=0.5, linestyle=":")
        ax.set_yticks(range(world))
        ax.set_yticklabels([f"rank {i}" for i in range(world)])
        ax.set_ylim(world - 0.5, -0.5)
        ax.set_xlim(0, tmax * 1.01)
        ends = sorted(r.end_s for r in recs if r.end_s is not None)
        end = f", end of minibatch {1e3 * ends[len(ends) // 2]:.2f} ms (median)" if ends else ""
        ax.set_title(f"{name}: bubble {100 * records_bubble_rate(recs):.1f}%, {len(steps)} minibatches, "
                     f"{max(r.t_end for r in recs) - t0:.2f} s{end}", fontsize=10)
    axes[-1, 0].set_xlabel("seconds")
    fig.legend(handles=[Patch(color=_COLORS[0], label="compute (microbatches; colour alternates per minibatch)"), Patch(color="#ff7f0e", label="end of minibatch (exchange, optimizer)"),
                        Patch(color="#f4cccc", label="idle")], loc="upper right", fontsize=8, ncol=3)
    if title:
        fig.suptitle(title, x=0.02, ha="left", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_runs(path: str) -> dict[str, list[MinibatchRecord]]:
    """The runs `jaxodc train --json PATH` wrote: {run name: every rank's records}."""
    with open(path) as f:
        raw = json.load(f)
    return {name: [MinibatchRecord.from_dict(r) for r in recs] for name, recs in raw.items()}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2 or argv[0] in ("-h", "--help"):
        print("usage: python -m jaxodc.cli.timeline OUT.png RUNS.json   (RUNS.json: jaxodc train --json)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    print(draw(load_runs(argv[1]), argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
