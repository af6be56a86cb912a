"""Cost model: a sample of length s costs a*s^2 + b*s (attention is quadratic in the length, the
rest linear), and every microbatch adds a fixed c (gathering and pushing each unit, dispatch), so
packing the same samples into more microbatches costs more. Balancers and the simulator only
compare costs, so the unit is arbitrary until `calibrate` fits it to seconds."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """cost(s) = a*s^2 + b*s per sample, plus c per microbatch. The default ratio b/a = 12*d
    corresponds to a causal transformer of hidden size d = 1536 (2*d*s^2 attention FLOPs vs
    24*d^2*s linear FLOPs per layer), the scale of the paper's 1.5B model; c defaults to 0 (the
    paper's model)."""

    a: float = 1.0
    b: float = 12.0 * 1536
    c: float = 0.0

    def __post_init__(self):
        if not all(np.isfinite(x) and x >= 0 for x in (self.a, self.b, self.c)):
            raise ValueError(f"CostModel needs finite a, b, c >= 0, got a={self.a}, b={self.b}, c={self.c}")

    @classmethod
    def for_transformer(cls, d_model: int) -> "CostModel":
        return cls(a=1.0, b=12.0 * d_model)

    @classmethod
    def for_flops(cls, params: float, layers: int, d_model: int, flops_per_s: float) -> "CostModel":
        """Seconds of one training step (forward + backward) of a dense causal decoder on a device
        sustaining `flops_per_s`: 6 FLOPs per parameter per token (b) and, per layer, 6*d*s per
        token of causal attention over a sample of length s (a = 6 * layers * d_model: QK^T and
        AV at 2*d FLOPs each per key, half the keys under the causal mask, x3 for backward)."""
        if not all(x > 0 for x in (params, layers, d_model, flops_per_s)):
            raise ValueError(f"for_flops needs positive params, layers, d_model, flops_per_s; got "
                             f"{params}, {layers}, {d_model}, {flops_per_s}")
        return cls(a=6.0 * layers * d_model / flops_per_s, b=6.0 * params / flops_per_s)

    def scaled(self, length: float = 1.0, time: float = 1.0) -> "CostModel":
        """The same costs with lengths measured in units of `length` tokens and times multiplied
        by `time`: cost'(s) = time * cost(length * s)."""
        return CostModel(self.a * time * length * length, self.b * time * length, self.c * time)

    def attention_share(self, length: float) -> float:
        """Fraction of a sample of `length` tokens' cost that is attention: a*s^2 / (a*s^2 + b*s)."""
        q, n = self.a * length * length, self.b * length
        return q / (q + n) if q + n > 0 else 0.0

    def __call__(self, lengths):
        s = np.asarray(lengths, dtype=np.float64)
        return self.a * s * s + self.b * s

    def costs(self, lengths: Sequence[int]) -> list[float]:
        return [float(c) for c in self(np.asarray(lengths, dtype=np.float64))]

    def microbatch(self, lengths: Sequence[int]) -> float:
        """Cost of a packed microbatch: packed samples do not attend to each other, so the cost is
        the sum of the samples' costs, plus the per-microbatch c (an empty one costs nothing: it
        is not run)."""
        return float(self.c + np.sum(self(np.asarray(lengths, dtype=np.float64)))) if len(lengths) else 0.0


def calibrate(step_fn: Callable, lengths: Sequence, *, repeats: int = 3, warmup: int = 1,
              clock: Callable[[], float] = time.perf_counter, overhead: bool = True) -> CostModel:
    """Fit a, b, c (seconds) by least squares from timing `step_fn` on a few microbatches.

    `lengths` items are ints (one sample of that length) or sequences of ints (one packed
    microbatch). `step_fn(item)` must run the work and block until it is done (e.g. call
    `.block_until_ready()`). Each item is timed `repeats` times after `warmup` untimed calls and
    the minimum is used (timing noise only adds). Coefficients are non-negative (`fit`).
    With `overhead=False` c stays 0 (the paper's two-term model)."""
    items = list(lengths)
    if len(items) < 2:
        raise ValueError(f"calibrate needs at least 2 microbatches to fit its coefficients, got {len(items)}")
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
        rows.append((np.sum(s * s), np.sum(s)))
        times.append(best)
    return fit([r[0] for r in rows], [r[1] for r in rows], times, overhead=overhead)


def fit(attention: Sequence[float], tokens: Sequence[float], seconds: Sequence[float],
        overhead: bool = True) -> CostModel:
    """Least-squares CostModel of measured microbatch times: microbatch i had attention work
    attention[i] (the sum of its samples' s^2), tokens[i] tokens through the linear layers (its
    row length, padding included) and took seconds[i]. Non-negative: of the fits with some
    coefficients pinned at 0, the best with none negative. `overhead=False` keeps c = 0."""
    if not len(attention) == len(tokens) == len(seconds) or len(seconds) < 2:
        raise ValueError(f"fit needs equally many attention, token and time entries (at least 2), got "
                         f"{len(attention)}, {len(tokens)}, {len(seconds)}")
    rows = [[float(q), float(n), 1.0] for q, n in zip(attention, tokens)]
    A, t = np.asarray(rows), np.asarray(seconds, dtype=np.float64)
    cols = [0, 1, 2] if overhead else [0, 1]
    best = None
    for k in range(len(cols), 0, -1):
        for subset in itertools.combinations(cols, k):
            x, *_ = np.linalg.lstsq(A[:, subset], t, rcond=None)
            if np.any(x < 0):
                continue
            res = float(np.sum((A[:, subset] @ x - t) ** 2))
            if best is None or res < best[0] - 1e-30:
                coef = [0.0, 0.0, 0.0]
                for j, v in zip(subset, x):
                    coef[j] = float(v)
                best = (res, coef)
    return CostModel(*best[1]) if best else CostModel(0.0, 0.0, 0.0)
