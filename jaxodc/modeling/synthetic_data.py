"""Generated chat and rollout JSONL files with long-tailed lengths (jaxodc.data's presets), for
benchmarks, tests and the README's copy-paste run: words drawn from Python's stdlib sources."""
from __future__ import annotations

import contextlib
import json
import os
import re

import numpy as np

from jaxodc.data import sample_lengths, stdlib_corpus


def _words(seed: int):
    text = bytes(stdlib_corpus(1 << 18)).decode("utf-8", "replace")
    words = re.findall(r"[A-Za-z]+", text)
    rng = np.random.default_rng(seed)
    return lambda n: " ".join(words[i] for i in rng.integers(0, len(words), max(int(n), 1)))


@contextlib.contextmanager
def _replacing(path: str):
    """A text file written whole, then put in place: several ranks writing the same generated data
    never let a reader see it half written."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            yield fh
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_chat(path: str, n: int, max_words: int, seed: int = 0, preset: str = "longalign") -> str:
    """n {"messages": [...]} conversations (system, then 1-3 user / assistant exchanges) whose
    word counts follow `preset` up to max_words; the assistant turns take most of them."""
    rng = np.random.default_rng(seed)
    words = _words(seed)
    with _replacing(path) as fh:
        for total in sample_lengths(preset, n, max_words, seed, min_len=min(8, max_words)):
            turns = int(rng.integers(1, 4))
            msgs = [{"role": "system", "content": words(2)}]
            for _ in range(turns):
                msgs.append({"role": "user", "content": words(max(1, total // (4 * turns)))})
                msgs.append({"role": "assistant", "content": words(max(1, 3 * total // (4 * turns)))})
            fh.write(json.dumps({"messages": msgs}) + "\n")
    return path


def write_rollouts(path: str, tokenizer, n_prompts: int, group: int, max_words: int, seed: int = 0,
                   preset: str = "aime", logprobs: bool = True, prompt_words: tuple[int, int] = (4, 16)) -> str:
    """n_prompts x group rollouts {"prompt", "completion", "reward"[, "logprobs"]}: completions with
    `preset`'s word counts, rewards uniform in [0, 1), and (`logprobs`) behaviour log-probabilities
    near a uniform policy's over the tokenizer's vocabulary (one per completion token)."""
    rng = np.random.default_rng(seed)
    words = _words(seed + 1)
    lengths = sample_lengths(preset, n_prompts * group, max_words, seed, min_len=min(4, max_words))
    uniform = -float(np.log(tokenizer.vocab_size))
    with _replacing(path) as fh:
        for p in range(n_prompts):
            prompt = words(int(rng.integers(*prompt_words)))
            for g in range(group):
                comp = " " + words(int(lengths[p * group + g]))
                rec = {"prompt": prompt, "completion": comp, "reward": round(float(rng.random()), 3)}
                if logprobs:
                    k = len(tokenizer.encode(comp))
                    rec["logprobs"] = np.round(uniform + 0.3 * rng.standard_normal(k), 4).tolist()
                fh.write(json.dumps(rec) + "\n")
    return path
