"""Sequence packing: samples concatenated into fixed-size microbatches of `max_tokens` tokens.

Per token: `tokens` (input id), `targets` (next token of the same sample), `segment_ids` (1, 2, ...
per packed sample, 0 = padding), `positions` (0-based within its sample) and `loss_mask` (1 where
the target belongs to the same sample). A sample of length s contributes s-1 loss tokens, so the
global token count of a minibatch is the sum of `loss_mask` over all its microbatches."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

PAD_ID = 0


@dataclass(frozen=True)
class Packed:
    tokens: np.ndarray       # [R, T] int32
    targets: np.ndarray      # [R, T] int32
    segment_ids: np.ndarray  # [R, T] int32, 0 = padding
    positions: np.ndarray    # [R, T] int32
    loss_mask: np.ndarray    # [R, T] float32

    def as_dict(self) -> dict[str, np.ndarray]:
        return {"tokens": self.tokens, "targets": self.targets, "segment_ids": self.segment_ids,
                "positions": self.positions, "loss_mask": self.loss_mask}

    @property
    def n_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def loss_tokens(lengths: Sequence[int]) -> int:
    """Loss-bearing tokens of a set of samples (each predicts its s-1 next tokens)."""
    return int(sum(max(int(s) - 1, 0) for s in lengths))


def pack(samples: Sequence[np.ndarray], max_tokens: int, rows: int = 1) -> Packed:
    """Pack `samples` (1-D integer arrays) into `rows` rows of `max_tokens` tokens, first-fit in
    the given order. Raises ValueError naming the sample that does not fit."""
    if max_tokens < 1 or rows < 1:
        raise ValueError(f"pack needs max_tokens >= 1 and rows >= 1, got {max_tokens}, {rows}")
    shape = (rows, max_tokens)
    tok = np.full(shape, PAD_ID, np.int32)
    tgt = np.full(shape, PAD_ID, np.int32)
    seg = np.zeros(shape, np.int32)
    pos = np.zeros(shape, np.int32)
    mask = np.zeros(shape, np.float32)
    fill = [0] * rows
    for n, s in enumerate(samples):
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
        mask[r, a:a + L - 1] = 1.0
        fill[r] += L
    return Packed(tok, tgt, seg, pos, mask)


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


def empty(max_tokens: int, rows: int = 1) -> Packed:
    """An all-padding microbatch (zero loss, zero gradient): fills a missing microbatch step."""
    return pack([], max_tokens, rows)
