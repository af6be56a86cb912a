"""numpy / pure-Python reference of the gradient sketch (csrc/sketch/sketch.h is the spec): the
same hash, an independent selection (lexsort), np.add.at for the sketch and a set-based peeler."""
import math

import numpy as np

ROWS = 3
M64 = (1 << 64) - 1


def mix64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def element_hash(index: np.ndarray, row: int, seed: int) -> np.ndarray:
    i = np.asarray(index, np.uint64)
    with np.errstate(over="ignore"):
        return mix64(i * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed & M64)
                     + np.uint64((row * 0xD1B54A32D192ED03) & M64))


def bucket_of(index, row, seed, width) -> np.ndarray:
    return (((element_hash(index, row, seed) >> np.uint64(32)) * np.uint64(width)) >> np.uint64(32)).astype(np.int64)


def sign_of(index, row, seed) -> np.ndarray:
    return np.where(element_hash(index, row, seed) & np.uint64(1), np.float32(-1), np.float32(1))


def pack_bits(mask: np.ndarray) -> np.ndarray:
    """Bit i of word i // 32 (little-endian bit order within a word)."""
    words = np.zeros((mask.size + 31) // 32, np.uint32)
    idx = np.flatnonzero(mask)
    np.bitwise_or.at(words, idx // 32, (np.uint32(1) << (idx % 32).astype(np.uint32)))
    return words


def unpack_bits(words: np.ndarray, n: int) -> np.ndarray:
    bits = (words[:, None] >> np.arange(32, dtype=np.uint32)) & np.uint32(1)
    return bits.reshape(-1)[:n].astype(bool)


def sparsify(grad: np.ndarray, residual: np.ndarray, fraction: float):
    acc = grad.astype(np.float32) + residual.astype(np.float32)
    n = acc.size
    k = min(max(math.ceil(fraction * n), 1), n)
    order = np.lexsort((np.arange(n), -np.abs(acc)))  # |acc| descending, then index ascending
    mask = np.zeros(n, bool)
    mask[order[:k]] = True
    mask &= acc != 0  # exact zeros are never kept
    kept = np.where(mask, acc, np.float32(0))
    return kept, np.where(mask, np.float32(0), acc), pack_bits(mask)


def build(values: np.ndarray, bitmap: np.ndarray, width: int, seed: int = 0) -> np.ndarray:
    idx = np.flatnonzero(unpack_bits(bitmap, values.size))
    sketch = np.zeros((ROWS, width), np.float32)
    for r in range(ROWS):
        np.add.at(sketch[r], bucket_of(idx, r, seed, width), sign_of(idx, r, seed) * values[idx])
    return sketch


def peel(sketch: np.ndarray, bitmap: np.ndarray, n: int, seed: int = 0):
    """Peels until no bucket holds a single unresolved element, then median-estimates the rest."""
    width = sketch.shape[1]
    support = [int(i) for i in np.flatnonzero(unpack_bits(bitmap, n))]
    buckets = {i: [(r, int(bucket_of(np.array([i]), r, seed, width)[0])) for r in range(ROWS)] for i in support}
    signs = {i: [float(sign_of(np.array([i]), r, seed)[0]) for r in range(ROWS)] for i in support}
    members = {}
    for i in support:
        for rb in buckets[i]:
            members.setdefault(rb, set()).add(i)
    left = {rb: float(sketch[rb]) for rb in members}
    values = np.zeros(n, np.float32)
    unresolved = set(support)
    progress = True
    while progress:
        progress = False
        for rb, m in sorted(members.items()):
            if len(m) != 1:
                continue
            (i,) = m
            v = signs[i][rb[0]] * left[rb]
            values[i] = v
            unresolved.discard(i)
            for r, b in buckets[i]:
                left[(r, b)] -= signs[i][r] * v
                members[(r, b)].discard(i)
            progress = True
    for i in unresolved:
        est = [signs[i][r] * np.float32(left[(r, b)]) for r, b in buckets[i]]
        values[i] = np.median(est)
    return values, (len(support) - len(unresolved), len(unresolved))
