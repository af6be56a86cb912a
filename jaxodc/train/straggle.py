"""Straggler injection: slowdowns that no balancing plan foresees, for benchmarks and tests.

Three kinds, each multiplying a microbatch's compute time by `factor`:

- a throttled rank, at random (`rank_p`): in each minibatch, each rank is throttled with
  probability `rank_p` and runs all its microbatches of that minibatch `factor` x slower (a
  device slowed for a while: thermal or power throttling, a co-located job, a busy host). The
  slowdown follows the device: a microbatch another rank steals from it runs at normal speed.
- random microbatches (`p`): with probability `p` a microbatch is slowed, on whichever rank runs
  it. The draw hashes (seed, minibatch, the microbatch's identity) and nothing else -- not the
  rank, not the clock -- so a microbatch that LB-Steal moves to another rank is slowed there too:
  the slowdown follows the work (what the cost model mispredicts), and stealing can only
  rebalance the rest around it.
- a throttled rank for a window: `rank` runs every microbatch `factor` x slower during minibatches
  [window[0], window[1]).

Each kind that hits a microbatch multiplies its time by `factor` again. A microbatch's identity is
its sample indices within the minibatch (what `train_plan` knows); microbatches given to
`train_minibatch` directly are identified by (rank, position). Minibatches count the trainer's
steps (checkpoint restores keep them) unless the spec is `pinned` to a minibatch number (bench
train runs every combo on the same data through the same trainers, and pins each data minibatch's
number so that every combo sees the same slowdowns). Every draw is deterministic for the seed.

The extra time is a sleep after the microbatch's compute, not busy work: the ranks of a test or
benchmark share a host's few cores (one compute thread each, plus the ODC daemon threads that
accumulate peers' pushes), and busy work would slow the other ranks and this rank's own daemon --
the very things a straggler experiment measures -- where a real slow device slows only itself. A
sleep is also exact in length. The microbatch's recorded interval includes the sleep (a straggler
is busy, not idle: bubble figures count it as compute); `StepResult.straggle_s` holds each
microbatch's injected seconds. "Compute time" is the microbatch's measured wall time without jax's
compilation (a first call would otherwise sleep (factor-1) x its compile time); under
comm="collective" it includes waiting inside the lock-step collectives, as its intervals do.

Emulated compute (`emulate`): bench scale runs W = 8..32 ranks on a host of a few cores, where a
microbatch's compute is its modelled accelerator time. `emulate[i]` holds the modelled seconds of
sample i of the minibatch (per-minibatch, like `pinned`); a microbatch identified by its samples
then also sleeps their sum (plus `emulate_c` per microbatch), on whichever rank runs it, and the
slowdowns above multiply that as they multiply the measured compute. All-padding microbatches
(identified by position) add nothing. The sleep is the same one: the recorded interval and
`straggle_s` include it.

Injection changes only timing (and, under LB-Steal, which rank runs what), never the math: the
trained result stays the same up to fp32 summation order.
"""
from __future__ import annotations

import hashlib
import math
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import jax

FIELDS = ("p", "rank_p", "factor", "rank", "window", "seed")
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")


@dataclass(frozen=True)
class Straggle:
    """Where and how much to slow microbatches (see the module docstring).

    Args:
      p: probability that a microbatch is slowed (wherever it runs), in [0, 1].
      rank_p: probability that a rank is throttled for a whole minibatch, per rank and
        minibatch, in [0, 1].
      factor: a slowed microbatch takes `factor` x its compute time (>= 1).
      rank: the throttled rank (None: none); needs `window`.
      window: the minibatches [start, stop) during which `rank` is throttled.
      seed: the seed of the random slowdowns (>= 0).
      pinned: the minibatch number the slowdowns key on instead of the trainer's step (None:
        the step); not part of `spec()`.
      emulate: modelled compute seconds of each sample of the minibatch (indexed like a
        microbatch identity's sample ids), slept on top of the measured compute; None: none.
        Not part of `spec()`.
      emulate_c: modelled seconds added per emulated microbatch.
    """

    p: float = 0.0
    rank_p: float = 0.0
    factor: float = 3.0
    rank: int | None = None
    window: tuple[int, int] | None = None
    seed: int = 0
    pinned: int | None = None
    emulate: tuple[float, ...] | None = None
    emulate_c: float = 0.0

    def __post_init__(self):
        bad = lambda field, why: ValueError(f"straggle {field}: {why}")  # noqa: E731
        for field in ("p", "rank_p"):
            if not 0.0 <= getattr(self, field) <= 1.0:
                raise bad(field, f"a probability in [0, 1], got {getattr(self, field)!r}")
        if not 1.0 <= self.factor < math.inf:
            raise bad("factor", f"a finite slowdown >= 1, got {self.factor!r}")
        if (self.rank is None) != (self.window is None):
            raise bad("rank" if self.rank is None else "window", "rank and window go together (a rank is "
                      "throttled for a window of minibatches)")
        if self.rank is not None and self.rank < 0:
            raise bad("rank", f"a rank >= 0, got {self.rank!r}")
        if self.window is not None and not (len(self.window) == 2 and 0 <= self.window[0] < self.window[1]):
            raise bad("window", f"minibatches start:stop with 0 <= start < stop, got {self.window!r}")
        if self.seed < 0:
            raise bad("seed", f"an integer >= 0, got {self.seed!r}")
        if self.emulate is not None and not all(math.isfinite(x) and x >= 0 for x in self.emulate):
            raise bad("emulate", "finite seconds >= 0 per sample")
        if not (math.isfinite(self.emulate_c) and self.emulate_c >= 0):
            raise bad("emulate_c", f"finite seconds >= 0, got {self.emulate_c!r}")

    @classmethod
    def default(cls) -> "Straggle":
        """`--straggle default`: both kinds of unforeseen slowdown at once, each at half the rate:
        one microbatch in twenty runs 3x slower wherever it runs (it follows the work: slow
        content), and in one minibatch in twenty a rank runs 3x slower (it follows the device: a
        throttled or shared GPU). A mean slowdown of 1.2x. Neither kind is foreseen by the plan's
        cost model; the first leaves little to a run-time balancer (a microbatch is slow only once
        it runs), the second is what stealing relieves (bench/RESULTS.md, straggler section)."""
        return cls(p=0.05, rank_p=0.05, factor=3.0, seed=0)

    def spec(self) -> str:
        """The `--straggle` value that parses back to this spec."""
        parts = ([f"p={self.p:g}"] if self.p or not self.rank_p else []) + (
            [f"rank_p={self.rank_p:g}"] if self.rank_p else []) + [f"factor={self.factor:g}"]
        if self.rank is not None:
            parts += [f"rank={self.rank}", f"window={self.window[0]}:{self.window[1]}"]
        return ",".join(parts + [f"seed={self.seed}"])

    def check_world(self, world: int) -> None:
        """Raises ValueError when the throttled rank is not one of `world` ranks."""
        if self.rank is not None and self.rank >= world:
            raise ValueError(f"straggle rank: {self.rank} is not a rank of this {world}-rank job")

    def _draw(self, step: int, key: tuple, p: float) -> bool:
        if p <= 0.0:
            return False
        digest = hashlib.blake2b(repr((self.seed, self._step(step), key)).encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") / 2.0 ** 64 < p

    def _step(self, step: int) -> int:
        return int(self.pinned if self.pinned is not None else step)

    def slowed(self, step: int, identity: tuple) -> bool:
        """Whether the random slowdown hits microbatch `identity` of minibatch `step`."""
        return self._draw(step, identity, self.p)

    def throttles(self, step: int, rank: int) -> int:
        """How many of the rank-level kinds (at random, the window) throttle `rank` in minibatch `step`."""
        window = self.rank == rank and self.window[0] <= self._step(step) < self.window[1]
        return int(window) + self._draw(step, ("rank", int(rank)), self.rank_p)

    def emulated(self, identity: tuple) -> float:
        """Modelled seconds of microbatch `identity` (0 without `emulate`, or for an all-padding
        one). Raises IndexError naming the sample when `emulate` does not cover it."""
        if self.emulate is None or identity[0] != "samples":
            return 0.0
        bad = [i for i in identity[1] if not 0 <= i < len(self.emulate)]
        if bad:
            raise IndexError(f"straggle emulate: sample {bad[0]} of microbatch {identity[1]} is not among the "
                             f"minibatch's {len(self.emulate)} samples")
        return self.emulate_c + sum(self.emulate[i] for i in identity[1])

    def slowdown(self, step: int, rank: int, identity: tuple) -> float:
        """How many times its compute time microbatch `identity` of minibatch `step` takes on `rank`."""
        return self.factor ** (self.slowed(step, identity) + self.throttles(step, rank))


def microbatch_identity(rank: int, position: int, sample_ids: Sequence[Sequence[int]] | None = None) -> tuple:
    """What the random slowdown keys on: the microbatch's sample indices within the minibatch when
    known and non-empty (the same on whichever rank runs it), else (rank, position) (raw
    microbatches, and the collective trainer's all-padding ones)."""
    if sample_ids is not None and position < len(sample_ids) and len(sample_ids[position]):
        return ("samples", tuple(int(i) for i in sample_ids[position]))
    return ("position", int(rank), int(position))


def parse_straggle(spec: str | None) -> Straggle | None:
    """`--straggle` values: "none" (or None / ""), "default" (`Straggle.default`), or key=value
    pairs over p, rank_p, factor, rank, window (start:stop), seed, e.g. "p=0.2,factor=3,rank=1,window=2:5"."""
    if spec is None or spec.strip() in ("", "none"):
        return None
    if spec.strip() == "default":
        return Straggle.default()
    kwargs = {}
    for part in spec.split(","):
        key, eq, value = (s.strip() for s in part.partition("="))
        if not eq or key not in FIELDS:
            raise ValueError(f"--straggle {spec!r}: expected 'none', 'default' or key=value pairs over "
                             f"{', '.join(FIELDS)}; got {part!r}")
        if key in kwargs:
            raise ValueError(f"--straggle {spec!r}: {key} given twice")
        try:
            if key == "window":
                start, colon, stop = value.partition(":")
                if not colon:
                    raise ValueError
                kwargs[key] = (int(start), int(stop))
            else:
                kwargs[key] = float(value) if key in ("p", "rank_p", "factor") else int(value)
        except ValueError:
            want = "start:stop (minibatches)" if key == "window" else "a number" if key in ("p", "rank_p", "factor") \
                else "an integer"
            raise ValueError(f"--straggle {spec!r}: {key} must be {want}, got {value!r}") from None
    try:
        return Straggle(**kwargs)
    except ValueError as e:
        raise ValueError(f"--straggle {spec!r}: {str(e).removeprefix('straggle ')}") from None


class _CompileClock(threading.local):
    seconds = 0.0


_compile_clock = _CompileClock()


def _count_compile(event: str, duration: float, **_) -> None:
    if event in _COMPILE_EVENTS:  # reported on the compiling thread
        _compile_clock.seconds += duration


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compile_seconds() -> float:
    """Seconds this thread has spent in jax compilation (monotonic): subtracted from a
    microbatch's measured time."""
    return _compile_clock.seconds


def stall(straggle: Straggle | None, res, step: int, rank: int, identity: tuple, t0: float,
          compiled0: float) -> None:
    """Called by the trainers right after a microbatch's compute, which began at perf_counter `t0`
    with `compile_seconds()` at `compiled0`: sleeps its injected delay and records it in
    `res.straggle_s` (nothing without a spec)."""
    if straggle is None:
        return
    compute = max(time.perf_counter() - t0 - (compile_seconds() - compiled0), 0.0)
    emulated = straggle.emulated(identity)
    delay = straggle.slowdown(step, rank, identity) * (compute + emulated) - compute
    if delay > 0:
        time.sleep(delay)
    res.straggle_s.append(delay)
