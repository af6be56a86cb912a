"""Training data that needs no download: byte-level text from Python's own stdlib sources, with
sample lengths drawn from long-tailed presets resembling the ODC paper's datasets (Figure 7), from
a user file of lengths, or real samples from a user jsonl file.

Presets are fractions of a maximum length, scaled to `max_len` (so a CPU run with max_len=512
keeps the shape of a 64K distribution). Each is a mixture; f = length / max_len, and a lognormal
component draws f = shift + median * exp(sigma * N(0, 1)):

- "longalign" (LongAlign SFT, max 64K): shift 0.12, median 0.16, sigma 1.0 -- nothing very short
  (LongAlign starts near 8K), most mass at 10K-35K, a heavy tail; ~3% of samples reach 64K.
- "swe" (SWE-Smith agent trajectories, max 32K): shift 0.2, median 0.12, sigma 0.9 -- a lighter tail.
- "aime" (GRPO on AIME prompts, max 16K, RL responses): median 0.2, sigma 0.3 -- narrow, barely
  long-tailed (the paper notes RL lengths are less skewed).

All draws are clipped to [min_len, max_len]. The parameters were fitted (grid search) so that the
simulator's collective LB-Micro / ODC LB-Mini bubble rates at 8 devices under the default cost
model land near the paper's Tables 4 and 6 (longalign, 8 devices, minibatch 1/2/4/8:
collective LB-Micro 68/51/31/19 %, ODC LB-Mini 68/46/8.7/0.4 %, vs the paper's 67/53/35/22 and
67/49/15/0.02; at 32 devices and minibatch 4: 36 % vs 13 %, paper 36 % vs 11 %). They are
stand-ins for the real datasets, not fits to them.

`jaxodc demo` and `bench train` scale them to max_len 2048 (longalign: median ~570 tokens, mean
~730, ~4% of samples at 2048; swe: median ~660), long enough that with their d_model 64 model
attention is most of a longest sample's compute (b/a = 12 d = 768 < 2048); `bench scale` keeps the
paper's lengths (`paper_max`) for its cost model and runs rows of at most 128 real tokens."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

VOCAB = 256  # byte-level; id 0 doubles as padding (masked by segment id 0)

PRESETS: dict[str, dict] = {
    # component: ("lognormal", weight, median, sigma[, shift]) | ("pareto", weight, f_min, alpha) | ("max", weight)
    "longalign": {"paper_max": 65536, "mix": [("lognormal", 1.0, 0.16, 1.0, 0.12)]},
    "swe": {"paper_max": 32768, "mix": [("lognormal", 1.0, 0.12, 0.9, 0.2)]},
    "aime": {"paper_max": 16384, "mix": [("lognormal", 1.0, 0.2, 0.3)]},
}


def sample_lengths(preset: str, n: int, max_len: int, seed: int = 0, min_len: int = 8) -> np.ndarray:
    """n sample lengths (int64) from a preset, scaled to max_len, deterministic by seed."""
    if preset not in PRESETS:
        raise ValueError(f"unknown length preset {preset!r}; choose one of {sorted(PRESETS)}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    rng = np.random.default_rng(seed)
    mix = PRESETS[preset]["mix"]
    w = np.array([c[1] for c in mix])
    comp = rng.choice(len(mix), size=n, p=w / w.sum())
    f = np.empty(n)
    for j, c in enumerate(mix):
        sel = comp == j
        m = int(sel.sum())
        if c[0] == "lognormal":
            f[sel] = (c[4] if len(c) > 4 else 0.0) + c[2] * np.exp(c[3] * rng.standard_normal(m))
        elif c[0] == "pareto":
            f[sel] = c[2] * (1.0 - rng.random(m)) ** (-1.0 / c[3])
        else:
            f[sel] = 1.0
    return np.clip(np.rint(f * max_len), min_len, max_len).astype(np.int64)


def load_lengths(path: str) -> np.ndarray:
    """Whitespace/comma separated positive integers (e.g. one per line); '#' starts a comment."""
    vals = []
    with open(path) as fh:
        for ln, line in enumerate(fh, 1):
            line = line.split("#", 1)[0].replace(",", " ")
            for tok in line.split():
                try:
                    v = int(tok)
                except ValueError:
                    raise ValueError(f"{path}:{ln}: {tok!r} is not an integer length") from None
                if v <= 0:
                    raise ValueError(f"{path}:{ln}: length {v} must be positive")
                vals.append(v)
    if not vals:
        raise ValueError(f"{path}: no lengths found")
    return np.asarray(vals, np.int64)


def stdlib_corpus(max_bytes: int | None = 4 << 20) -> np.ndarray:
    """Bytes of the top-level *.py files of Python's stdlib (sorted by name; site-packages and
    subpackages excluded so the text is the same on every machine with the same Python)."""
    root = os.path.dirname(os.__file__)
    chunks, total = [], 0
    for name in sorted(os.listdir(root)):
        p = os.path.join(root, name)
        if not name.endswith(".py") or not os.path.isfile(p):
            continue
        with open(p, "rb") as fh:
            b = fh.read()
        chunks.append(b)
        total += len(b)
        if max_bytes is not None and total >= max_bytes:
            break
    if not chunks:
        raise RuntimeError(f"no stdlib sources found under {root}")
    data = np.frombuffer(b"".join(chunks), np.uint8)
    return data[:max_bytes] if max_bytes is not None else data


def encode(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def load_jsonl(path: str, max_len: int | None = None, truncate: bool = True,
               counts: dict | None = None) -> list[np.ndarray]:
    """One sample per line: {"text": ...}, byte-level tokens. Samples longer than max_len are
    truncated (or rejected with truncate=False); empty lines are skipped. `counts`, when given,
    receives "records" and "truncated" (how many were cut)."""
    out, cut = [], 0
    with open(path, "rb") as fh:
        for ln, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{ln}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                 "re-encode the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{ln}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                raise ValueError(f'{path}:{ln}: expected an object with a string "text" field')
            t = encode(rec["text"])
            if len(t) < 2:
                raise ValueError(f"{path}:{ln}: text has {len(t)} byte(s); a sample needs >= 2 tokens")
            if max_len is not None and len(t) > max_len:
                if not truncate:
                    raise ValueError(f"{path}:{ln}: sample of {len(t)} tokens > max_len={max_len}")
                t = t[:max_len]
                cut += 1
            out.append(t)
    if not out:
        raise ValueError(f"{path}: no samples")
    if counts is not None:
        counts.update(records=len(out), truncated=cut)
    return out


@dataclass
class Samples:
    """A fixed list of token arrays (int32)."""

    tokens: list[np.ndarray]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray([len(t) for t in self.tokens], np.int64)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[i]

    @classmethod
    def from_corpus(cls, corpus: np.ndarray, lengths: Sequence[int], seed: int = 0) -> "Samples":
        """Sample i = `lengths[i]` consecutive bytes of `corpus` at a seeded random offset."""
        rng = np.random.default_rng(seed)
        corpus = np.asarray(corpus, np.uint8)
        toks = []
        for L in lengths:
            L = int(L)
            if L <= len(corpus):
                o = int(rng.integers(0, len(corpus) - L + 1))
                toks.append(corpus[o:o + L].astype(np.int32))
            else:
                toks.append(np.resize(corpus, L).astype(np.int32))
        return cls(toks)


def synthetic_text(preset: str, n: int, max_len: int, seed: int = 0, min_len: int = 8) -> Samples:
    """n stdlib-text samples with preset lengths: the default training data."""
    return Samples.from_corpus(stdlib_corpus(), sample_lengths(preset, n, max_len, seed, min_len), seed + 1)


def minibatches(n_samples: int, global_batch: int, seed: int = 0, epochs: int | None = 1) -> Iterator[np.ndarray]:
    """Global minibatches of sample indices (global_batch = world * per-rank minibatch size),
    reshuffled every epoch from (seed, epoch); a last partial minibatch is dropped."""
    if global_batch < 1 or n_samples < global_batch:
        raise ValueError(f"need 1 <= global_batch <= n_samples, got global_batch={global_batch}, n_samples={n_samples}")
    ep = 0
    while epochs is None or ep < epochs:
        perm = np.random.default_rng([seed, ep]).permutation(n_samples)
        for i in range(0, n_samples - global_batch + 1, global_batch):
            yield perm[i:i + global_batch]
        ep += 1


# --------------------------------------------------------------------------- images

# An image travels through the token trainers (balancing, packing, Trainer, `jaxodc train`) as a
# fixed-length sample: its pixel intensities, then its label. Every image then has IMAGE_TOKENS - 1
# loss tokens, so the minibatch's global token count is that times its image count and a loss
# returning the sum over loss tokens of each image's loss (`decode_images`' weight) is normalised
# to the mean over images. Microbatch rows of a multiple of IMAGE_TOKENS tokens hold whole images.
DIGITS_SHAPE = (8, 8, 1)
IMAGE_TOKENS = 8 * 8 + 1


def load_digits() -> Samples:
    """scikit-learn's 8x8 handwritten digits (1797 images, intensities 0..16, shipped inside the
    scikit-learn package: no download), each as IMAGE_TOKENS tokens (pixels, then the label)."""
    try:
        from sklearn.datasets import load_digits as sk_digits
    except ImportError as e:
        raise ImportError("the digits data set ships with scikit-learn: pip install scikit-learn") from e
    d = sk_digits()
    rows = np.concatenate([d.data.astype(np.int32), d.target.astype(np.int32)[:, None]], axis=1)
    return Samples(list(rows))


def decode_images(batch, shape: Sequence[int] = DIGITS_SHAPE, scale: float = 16.0):
    """A packed microbatch of image samples ({"tokens", "loss_mask", ...: [1, T]}, T a multiple of
    prod(shape) + 1) as ({"x": [T // (prod + 1), *shape] float in [0, 1], "y": [n] int, "mask": [n]},
    weight [n]): weight is each image's loss-token count (0 for an empty slot), the factor of its
    loss in the microbatch's summed loss. Traceable (jax.numpy)."""
    import jax.numpy as jnp
    per = int(np.prod(shape)) + 1
    T = batch["tokens"].shape[-1]
    if T % per:
        raise ValueError(f"a row of {T} tokens does not hold whole images of {per} tokens (pixels + label); "
                         f"use max_tokens a multiple of {per} and no buckets")
    rows = jnp.reshape(batch["tokens"], (-1, per))
    weight = jnp.sum(jnp.reshape(batch["loss_mask"], (-1, per)), axis=1)
    x = jnp.reshape(rows[:, :-1].astype(jnp.float32) / scale, (-1, *shape))
    return {"x": x, "y": rows[:, -1], "mask": (weight > 0).astype(jnp.float32)}, weight
