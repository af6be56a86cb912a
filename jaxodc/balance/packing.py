"""Sequence packing: samples concatenated into fixed-size microbatches of `max_tokens` tokens.

Per token: `tokens` (input id), `targets` (next token of the same sample), `segment_ids` (1, 2, ...
per packed sample, 0 = padding), `positions` (0-based within its sample) and `loss_mask` (1 where
the target belongs to the same sample). A sample of length s contributes s-1 loss tokens, so the
global token count of a minibatch is the sum of `loss_mask` over all its microbatches.

A `Sample` instead of a bare token array carries its own `loss_mask` (only the completion /
assistant targets, jaxodc.modeling.dataset) and per-token float `fields` (GRPO's advantages and
behaviour log-probabilities) that are packed beside it; its length -- what balancing costs -- is
still the whole sequence."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

PAD_ID = 0


@dataclass(frozen=True)
class Sample:
    """One training sequence with its own loss mask and per-token fields, all [L] and aligned to
    the input position: loss_mask[i] weighs predicting tokens[i + 1] (so loss_mask[L - 1] is 0),
    fields[name][i] belongs to that same target."""

    tokens: np.ndarray                                   # [L] int32
    loss_mask: np.ndarray                                # [L] float32
    fields: Mapping[str, np.ndarray] = field(default_factory=dict)  # name -> [L] float32

    def __post_init__(self):
        L = len(self.tokens)
        if np.shape(self.loss_mask) != (L,) or any(np.shape(v) != (L,) for v in self.fields.values()):
            raise ValueError(f"a sample of {L} tokens needs loss_mask and fields of shape ({L},), got "
                             f"{np.shape(self.loss_mask)} and { {k: np.shape(v) for k, v in self.fields.items()} }")
        if L and self.loss_mask[-1] != 0:
            raise ValueError("a sample's last token has no target: its loss_mask must be 0")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_loss_tokens(self) -> float:
        return float(np.sum(self.loss_mask))


def fields_of(samples: Sequence) -> tuple[str, ...]:
    """The per-token field names the samples carry (every Sample the same; bare arrays none), so
    every microbatch of a minibatch -- empty ones too -- has the same arrays."""
    names = {tuple(sorted(s.fields)) for s in samples if isinstance(s, Sample)}
    if len(names) > 1 or (names and any(not isinstance(s, Sample) for s in samples)):
        raise ValueError(f"samples of one minibatch carry different per-token fields: {sorted(names)}")
    return names.pop() if names else ()


@dataclass(frozen=True)
class Packed:
    tokens: np.ndarray       # [R, T] int32
    targets: np.ndarray      # [R, T] int32
    segment_ids: np.ndarray  # [R, T] int32, 0 = padding
    positions: np.ndarray    # [R, T] int32
    loss_mask: np.ndarray    # [R, T] float32
    fields: Mapping[str, np.ndarray] = field(default_factory=dict)  # [R, T] float32 each, 0 on padding

    def as_dict(self) -> dict[str, np.ndarray]:
        return {"tokens": self.tokens, "targets": self.targets, "segment_ids": self.segment_ids,
                "positions": self.positions, "loss_mask": self.loss_mask, **self.fields}

    @property
    def n_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def loss_tokens(lengths: Sequence[int]) -> int:
    """Loss-bearing tokens of a set of samples (each predicts its s-1 next tokens)."""
    return int(sum(max(int(s) - 1, 0) for s in lengths))


def sample_loss_tokens(samples: Sequence) -> float:
    """The loss tokens of these samples as pack() masks them: a Sample's mask sum, s-1 otherwise."""
    return float(sum(s.n_loss_tokens if isinstance(s, Sample) else max(len(s) - 1, 0) for s in samples))


def pack(samples: Sequence, max_tokens: int, rows: int = 1, fields: Sequence[str] | None = None) -> Packed:
    """Pack `samples` (1-D integer arrays or `Sample`s) into `rows` rows of `max_tokens` tokens,
    first-fit in the given order. `fields`: the per-token fields to lay out (default the
    samples' own, fields_of; give them for a microbatch that may be empty). Raises ValueError
    naming the sample that does not fit."""
    if max_tokens < 1 or rows < 1:
        raise ValueError(f"pack needs max_tokens >= 1 and rows >= 1, got {max_tokens}, {rows}")
    shape = (rows, max_tokens)
    tok = np.full(shape, PAD_ID, np.int32)
    tgt = np.full(shape, PAD_ID, np.int32)
    seg = np.zeros(shape, np.int32)
    pos = np.zeros(shape, np.int32)
    mask = np.zeros(shape, np.float32)
    names = fields_of(samples) if fields is None else tuple(fields)
    extra = {k: np.zeros(shape, np.float32) for k in names}
    fill = [0] * rows
    for n, s in enumerate(samples):
        sample, s = (s, s.tokens) if isinstance(s, Sample) else (None, s)
        s = np.asarray(s).reshape(-1)
        L = int(s.shape[0])
        if L == 0:
            raise ValueError(f"sample {n} is empty")
        r = next((r for r in range(rows) if fill[r] + L <= max_tokens), None)
        if r is None:
            raise ValueError(f"sample {n} of length {L} does not fit: {rows} row(s) of max_tokens={max_tokens}, "
                             f"free {[max_tokens - f for f in fill]}")
        a = fill[r]
        tok[r, a:a + L] = s
        tgt[r, a:a + L - 1] = s[1:]
        seg[r, a:a + L] = n + 1
        pos[r, a:a + L] = np.arange(L)
        if sample is None:
            mask[r, a:a + L - 1] = 1.0
        else:
            mask[r, a:a + L] = sample.loss_mask
        for k in names:
            if sample is None or k not in sample.fields:
                raise ValueError(f"sample {n} lacks the per-token field {k!r} the microbatch carries")
            extra[k][r, a:a + L] = sample.fields[k]
        fill[r] += L
    return Packed(tok, tgt, seg, pos, mask, extra)


def bucket(tokens: int, max_tokens: int, min_bucket: int | Sequence[int] = 64) -> int:
    """Row length for a microbatch of `tokens` tokens, capped at max_tokens: the smallest
    min_bucket * 2^k that holds them or, when `min_bucket` is a sequence of row lengths, the
    smallest of those that holds them. Compute follows the bucketed length (every padding token
    runs through the linear layers), so buckets make it follow the content with few distinct
    shapes (one compiled step each); finer buckets waste less on padding."""
    if tokens > max_tokens:
        raise ValueError(f"{tokens} tokens do not fit max_tokens={max_tokens}")
    if not isinstance(min_bucket, (int, np.integer)):
        fits = [int(b) for b in min_bucket if int(b) >= tokens]
        return min(min(fits), max_tokens) if fits else max_tokens
    b = max(1, min(int(min_bucket), max_tokens))
    while b < tokens:
        b *= 2
    return min(b, max_tokens)


def empty(max_tokens: int, rows: int = 1, fields: Sequence[str] = ()) -> Packed:
    """An all-padding microbatch (zero loss, zero gradient): fills a missing microbatch step.
    `fields`: the per-token fields the minibatch's other microbatches carry (fields_of)."""
    return pack([], max_tokens, rows, fields)
