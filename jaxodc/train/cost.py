"""Cost model of one sample: cost(s) = a*s^2 + b*s (attention is quadratic in the length, the rest
linear). Balancers and the simulator only compare costs, so the unit is arbitrary until
`calibrate` fits it to seconds."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """cost(s) = a*s^2 + b*s. The default ratio b/a = 12*d corresponds to a causal transformer of
    hidden size d = 1536 (2*d*s^2 attention FLOPs vs 24*d^2*s linear FLOPs per layer), the scale
    of the paper's 1.5B model."""

    a: float = 1.0
    b: float = 12.0 * 1536

    def __post_init__(self):
        if not (np.isfinite(self.a) and np.isfinite(self.b)) or self.a < 0 or self.b < 0:
            raise ValueError(f"CostModel needs finite a >= 0 and b >= 0, got a={self.a}, b={self.b}")

    @classmethod
    def for_transformer(cls, d_model: int) -> "CostModel":
        return cls(a=1.0, b=12.0 * d_model)

    def __call__(self, lengths):
        s = np.asarray(lengths, dtype=np.float64)
        return self.a * s * s + self.b * s

    def costs(self, lengths: Sequence[int]) -> list[float]:
        return [float(c) for c in self(np.asarray(lengths, dtype=np.float64))]

    def microbatch(self, lengths: Sequence[int]) -> float:
        """Cost of a packed microbatch: packed samples do not attend to each other, so the cost is
        the sum of the samples' costs."""
        return float(np.sum(self(np.asarray(lengths, dtype=np.float64)))) if len(lengths) else 0.0


def calibrate(step_fn: Callable, lengths: Sequence, *, repeats: int = 3, warmup: int = 1,
              clock: Callable[[], float] = time.perf_counter) -> CostModel:
    """Fit a, b (seconds) by least squares from timing `step_fn` on a few microbatches.

    `lengths` items are ints (one sample of that length) or sequences of ints (one packed
    microbatch). `step_fn(item)` must run the work and block until it is done (e.g. call
    `.block_until_ready()`). Each item is timed `repeats` times after `warmup` untimed calls and
    the minimum is used (timing noise only adds). Negative fitted coefficients are refitted with
    that term removed (non-negative least squares on two columns)."""
    items = list(lengths)
    if len(items) < 2:
        raise ValueError(f"calibrate needs at least 2 microbatches to fit 2 coefficients, got {len(items)}")
    rows, times = [], []
    for item in items:
        ls = [int(item)] if np.isscalar(item) else [int(x) for x in item]
        if not ls or min(ls) <= 0:
            raise ValueError(f"calibrate: microbatch {item!r} has no positive lengths")
        for _ in range(warmup):
            step_fn(item)
        best = np.inf
        for _ in range(max(1, repeats)):
            t0 = clock()
            step_fn(item)
            best = min(best, clock() - t0)
        s = np.asarray(ls, dtype=np.float64)
        rows.append([np.sum(s * s), np.sum(s)])
        times.append(best)
    A, t = np.asarray(rows), np.asarray(times)
    return CostModel(*_nnls2(A, t))


def _nnls2(A: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    (a, b), *_ = np.linalg.lstsq(A, t, rcond=None)
    if a >= 0 and b >= 0:
        return float(a), float(b)
    # Best fit with one coefficient pinned at zero; pick whichever leaves less residual.
    best = None
    for col in (0, 1):
        x = A[:, col]
        c = max(0.0, float(x @ t / (x @ x))) if x @ x > 0 else 0.0
        res = float(np.sum((x * c - t) ** 2))
        coef = (c, 0.0) if col == 0 else (0.0, c)
        if best is None or res < best[0]:
            best = (res, coef)
    return best[1]
