"""Per-rank, per-minibatch records and the measured bubble rate.

Times are seconds from `time.perf_counter()` (CLOCK_MONOTONIC on Linux: one clock for all
processes of a host, so ranks' records can be compared directly). A rank's busy time in a
minibatch is the sum of its microbatch compute intervals plus its optimizer step; for the collective baseline those
intervals include waiting inside the collectives, so callers may set `busy_s` to an estimate of
pure compute (e.g. a calibrated cost model) -- `busy` uses it when present.

bubble rate = sum over minibatches and ranks of (minibatch span - rank busy) / (W x span), where
the span runs from the first rank's start to the last rank's end of that minibatch."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from jaxodc.balance.simulate import bubble_rate


@dataclass
class MinibatchRecord:
    """One rank's view of one minibatch: its span, compute and optimizer intervals, the samples and
    tokens it ran and the global loss (times: perf_counter seconds)."""

    rank: int
    step: int
    t_start: float
    t_end: float
    compute: list[tuple[float, float]] = field(default_factory=list)  # microbatch intervals
    opt: tuple[float, float] | None = None                          # optimizer interval
    samples: int = 0
    tokens: int = 0
    loss: float = float("nan")
    comm: str = ""
    balance: str = ""
    busy_s: float | None = None
    # this rank's gradient exchange (StepResult's fields of the same names; None where not counted)
    wire_bytes: int | None = None
    wire_bytes_selected: int | None = None
    wire_bytes_units: dict | None = None
    kept_fraction: float | None = None
    peeled: int | None = None
    estimated: int | None = None
    straggle_s: list | None = None  # injected seconds per microbatch (StepResult's; None: no injection)
    params_sha256: str | None = None  # `jaxodc train --json`: hash of the run's final full parameters
    end_s: float | None = None  # the end of the minibatch (StepResult's): complete gradients -> published
    transports: list | None = None  # `jaxodc train`: this rank's link to each rank ("self", "shm", "tcp", "gloo", ...)
    gather_wire_bytes: int | None = None  # `jaxodc train`, odc: bytes of gathered pieces this rank received over the network

    @property
    def busy(self) -> float:
        """Compute + optimizer seconds (or `busy_s`): everything but waiting."""
        if self.busy_s is not None:
            return self.busy_s
        return sum(b - a for a, b in self.compute) + (self.opt[1] - self.opt[0] if self.opt else 0.0)

    @classmethod
    def from_dict(cls, d: dict) -> "MinibatchRecord":
        """From `dataclasses.asdict` of a record (JSON / msgpack round trips turn tuples into lists)."""
        return cls(**{**d, "compute": [tuple(x) for x in d["compute"]], "opt": tuple(d["opt"]) if d.get("opt") else None})

    @classmethod
    def from_result(cls, res, rank: int, samples: int = 0, tokens: int = 0, comm: str = "", balance: str = ""):
        """From a trainer's StepResult (jaxodc.train.collective)."""
        return cls(rank, res.version, res.t_start, res.t_end, list(res.microbatches), tuple(res.opt),
                   samples, tokens, res.loss, comm, balance, None, res.wire_bytes, res.wire_bytes_selected,
                   res.wire_bytes_units, res.kept_fraction, res.peeled, res.estimated, res.straggle_s,
                   end_s=getattr(res, "end_s", None))


def _by_step(records: Iterable[MinibatchRecord]) -> dict[int, list[MinibatchRecord]]:
    out: dict[int, list[MinibatchRecord]] = {}
    for r in records:
        out.setdefault(r.step, []).append(r)
    return out


def records_bubble_rate(records: Sequence[MinibatchRecord]) -> float:
    """The measured bubble rate (balance.simulate.bubble_rate over each minibatch's span)."""
    return bubble_rate((max(r.t_end for r in recs) - min(r.t_start for r in recs), [r.busy for r in recs])
                       for recs in _by_step(records).values())


def summarize(records: Sequence[MinibatchRecord]) -> dict:
    """Throughput and bubble over all records. samples/tokens are summed over ranks (each rank
    records what it processed)."""
    if not records:
        raise ValueError("no records to summarize")
    steps = _by_step(records)
    wall = max(r.t_end for r in records) - min(r.t_start for r in records)
    ranks = sorted({r.rank for r in records})
    last = steps[max(steps)]
    return {
        "steps": len(steps), "ranks": len(ranks), "wall_s": wall,
        "samples_per_s": sum(r.samples for r in records) / wall if wall > 0 else 0.0,
        "tokens_per_s": sum(r.tokens for r in records) / wall if wall > 0 else 0.0,
        "bubble_rate": records_bubble_rate(records),
        "compute_s": {rk: sum(r.busy for r in records if r.rank == rk) for rk in ranks},
        "idle_s": {rk: sum(max(max(x.t_end for x in steps[r.step]) - min(x.t_start for x in steps[r.step]) - r.busy, 0.0)
                           for r in records if r.rank == rk) for rk in ranks},
        "loss": last[0].loss,
        "end_s": _median([r.end_s for r in records if r.end_s is not None]),
    }


def _median(xs: Sequence[float]) -> float | None:
    return float(sorted(xs)[len(xs) // 2]) if xs else None


class Progress:
    """Minimal progress bar on a stream: `[#####.....] 5/10 loss 2.31 12.0 samples/s`."""

    def __init__(self, total: int, desc: str = "", width: int = 30, stream=None, enabled: bool = True):
        self.total, self.desc, self.width, self.n = total, desc, width, 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.t0 = time.perf_counter()

    def update(self, n: int = 1, **info) -> None:
        self.n += n
        if not self.enabled:
            return
        fill = int(self.width * self.n / max(self.total, 1))
        extra = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items())
        self.stream.write(f"\r{self.desc} [{'#' * fill}{'.' * (self.width - fill)}] {self.n}/{self.total} {extra}")
        if self.n >= self.total:
            self.stream.write("\n")
        self.stream.flush()
