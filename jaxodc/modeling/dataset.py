"""Training data from JSONL in the formats people have, as packing.Sample's whose loss mask
covers only what is trained on.

SFT (`load_sft`), one object per line, formats mixable:

- {"text": str}: every token after the first is a target.
- {"prompt": str, "completion": str}: prompt (with the tokenizer's special tokens, e.g. BOS),
  then completion and EOS; only the completion and EOS are targets. A conversational prompt
  {"prompt": [messages], "completion": str | [assistant messages]} is rendered with the chat
  template (generation prompt after the prompt); only the completion's assistant text is trained.
- {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str}, ...]}: rendered with
  the chat template; the assistant turns (their text and end-of-turn marker, not the role header
  the generation prompt writes) are the targets (jaxodc.modeling.chat).

Rollouts for GRPO (`load_rollouts`): {"prompt", "completion"} as above, or the engine's own token
ids {"prompt_ids": [int], "completion_ids": [int]} (exact: no re-tokenisation, no EOS added), plus
"reward" (group-normalised over the rollouts of the same prompt) or "advantage" (used as is), and
optionally "logprobs" (the behaviour policy's log-probability of each completion token) and
"ref_logprobs" (the reference policy's). They travel as per-token fields (rl.FIELDS).

Truncation (`truncation=`), for a sample longer than `max_len` tokens (a microbatch's size):
"right" keeps the first max_len tokens (the prompt stays; a sample left with nothing to train on
is dropped), "drop" drops the sample, "error" stops naming the line. What happened is counted in
the returned LoadReport.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from jaxodc.balance.packing import Sample
from jaxodc.modeling.chat import ROLES, ChatTemplate

TRUNCATION = ("right", "drop", "error")


@dataclass
class LoadReport:
    """What loading a file did: samples kept, trained and total tokens, truncation."""

    path: str
    policy: str
    max_len: int | None
    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0
    tokens_cut: int = 0
    dropped: int = 0
    dropped_lines: list[int] = field(default_factory=list)

    def __str__(self) -> str:
        s = (f"{self.path}: {self.samples} samples, {self.tokens} tokens, {self.loss_tokens} trained on; "
             f"truncation {self.policy!r} at {self.max_len} tokens: {self.truncated} truncated "
             f"({self.tokens_cut} tokens cut), {self.dropped} dropped")
        if self.dropped_lines:
            s += f" (lines {', '.join(map(str, self.dropped_lines[:5]))}{', ...' if self.dropped > 5 else ''})"
        return s


def read_jsonl(path: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) per non-empty line; ValueError naming the file and line otherwise."""
    with open(path, "rb") as fh:
        for ln, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{ln}: not UTF-8 (byte {e.start} of the line: {raw[e.start:e.start + 1]!r})") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{ln}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{ln}: expected a JSON object, got {type(rec).__name__}")
            yield ln, rec


class _Encoder:
    """Token ids and the trained-token flags of one record (before truncation)."""

    def __init__(self, tokenizer, append_eos: bool = True):
        self.tok = tokenizer
        self.eos = tokenizer.eos_id if append_eos else None
        src = tokenizer.chat_template
        self.template = None if src is None else ChatTemplate(src, tokenizer.template_context())

    def chat(self, where: str, messages, train_from: int = 0, generation_prompt: bool = False):
        """(ids, trained flags) of a rendered conversation: the assistant messages from index
        `train_from` on are trained. `generation_prompt`: render a prompt (nothing trained)."""
        messages = _messages(where, messages)
        if self.template is None:
            raise ValueError(f"{where}: chat messages need a chat template, and the tokenizer ({self.tok.path}) has "
                             "none: use --tokenizer DIR with a tokenizer_config.json carrying chat_template")
        if generation_prompt:
            text, spans = self.template.render(messages, add_generation_prompt=True), []
        else:
            try:
                text, spans = self.template.render_spans(messages)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
            assistant = [k for k, m in enumerate(messages) if m["role"] == "assistant"]
            if len(spans) != len(assistant):
                raise ValueError(f"{where}: the chat template marks {len(spans)} assistant span(s) for "
                                 f"{len(assistant)} assistant message(s)")
            spans = [s for k, s in zip(assistant, spans) if k >= train_from]
        ids, offsets = self.tok.encode_with_offsets(text)
        trained = np.zeros(len(ids), bool)
        for a, b in spans:
            for j, (s, e) in enumerate(offsets):
                if (s < b and e > a) or (s == e and a <= s < b):
                    trained[j] = True
        return ids, trained

    def text(self, text: str, add_special_tokens: bool):
        return np.asarray(self.tok.encode(text, add_special_tokens=add_special_tokens), np.int32)

    def prompt(self, where: str, prompt):
        """A prompt's ids: text with the tokenizer's special tokens, or messages rendered with the
        generation prompt."""
        if isinstance(prompt, str):
            return self.text(prompt, True)
        return self.chat(where, prompt, generation_prompt=True)[0]


def _messages(where: str, messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'{where}: "messages" must be a non-empty list of {{"role", "content"}} objects')
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f'{where}: message {k} must be an object with string "role" and "content"')
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: message {k} has role {m['role']!r}; roles are {', '.join(ROLES)}")
    return messages


def _sft_record(enc: _Encoder, where: str, rec: dict):
    """(ids, trained flags) of one SFT record."""
    if "messages" in rec:
        ids, trained = enc.chat(where, rec["messages"])
        if not trained.any():
            raise ValueError(f"{where}: the conversation has no assistant message to train on")
        return ids, trained
    if "prompt" in rec or "completion" in rec:
        prompt, completion = rec.get("prompt"), rec.get("completion")
        if prompt is None or completion is None:
            raise ValueError(f'{where}: a prompt / completion record needs both "prompt" and "completion"')
        if isinstance(prompt, list):
            comp = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else completion
            if not isinstance(comp, list):
                raise ValueError(f'{where}: "completion" must be a string or a list of messages')
            return enc.chat(where, prompt + comp, train_from=len(prompt))
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError(f'{where}: "prompt" and "completion" must be strings (or the prompt a list of messages)')
        p, c = enc.text(prompt, True), enc.text(completion, False)
        if enc.eos is not None:
            c = np.append(c, np.int32(enc.eos))
        if not len(c):
            raise ValueError(f"{where}: the completion is empty")
        return np.concatenate([p, c]).astype(np.int32), np.r_[np.zeros(len(p), bool), np.ones(len(c), bool)]
    if "text" in rec:
        if not isinstance(rec["text"], str):
            raise ValueError(f'{where}: "text" must be a string')
        ids = enc.text(rec["text"], True)
        trained = np.ones(len(ids), bool)
        trained[:1] = False  # the first token is no target
        return ids, trained
    raise ValueError(f'{where}: expected "messages", "prompt" + "completion" or "text" (got keys {sorted(rec)})')


def _truncate(where, report: LoadReport, ids, trained, max_len):
    """(ids, trained) within max_len under the report's policy, or None when dropped."""
    if max_len is None or len(ids) <= max_len:
        return ids, trained
    if report.policy == "error":
        raise ValueError(f"{where}: {len(ids)} tokens > max_len={max_len} (truncation='error'; use 'right' or 'drop')")
    if report.policy == "right" and trained[1:max_len].any():
        report.truncated += 1
        report.tokens_cut += len(ids) - max_len
        return ids[:max_len], trained[:max_len]
    return None


def _sample(ids, trained, fields=None) -> Sample:
    """A Sample: loss_mask[i] = trained[i + 1] (position i predicts token i + 1)."""
    mask = np.zeros(len(ids), np.float32)
    mask[:-1] = trained[1:]
    return Sample(np.asarray(ids, np.int32), mask, {k: np.asarray(v, np.float32) for k, v in (fields or {}).items()})


def _finish(report: LoadReport, samples: list[Sample]):
    from jaxodc.data import Samples
    if not samples:
        raise ValueError(f"{report.path}: no samples left to train on ({report})")
    report.samples = len(samples)
    report.tokens = int(sum(len(s) for s in samples))
    report.loss_tokens = int(sum(s.n_loss_tokens for s in samples))
    return Samples(samples), report


def load_sft(path: str, tokenizer, max_len: int | None = None, truncation: str = "right",
             append_eos: bool = True):
    """(jaxodc.data.Samples of packing.Sample, LoadReport) of an SFT JSONL file (module docstring).
    `append_eos`: end a text completion with the tokenizer's EOS (when it has one)."""
    if truncation not in TRUNCATION:
        raise ValueError(f"truncation must be one of {TRUNCATION}, got {truncation!r}")
    enc, report, out = _Encoder(tokenizer, append_eos), LoadReport(path, truncation, max_len), []
    for ln, rec in read_jsonl(path):
        where = f"{path}:{ln}"
        ids, trained = _sft_record(enc, where, rec)
        if len(ids) < 2:
            raise ValueError(f"{where}: {len(ids)} token(s); a sample needs >= 2")
        kept = _truncate(where, report, ids, trained, max_len)
        if kept is None:
            report.dropped += 1
            report.dropped_lines.append(ln)
            continue
        out.append(_sample(*kept))
    return _finish(report, out)


def _float_list(where, rec, key, n):
    v = rec[key]
    if not isinstance(v, list) or len(v) != n or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v):
        raise ValueError(f'{where}: "{key}" must be a list of {n} numbers (one per completion token), got '
                         f"{len(v) if isinstance(v, list) else type(v).__name__}")
    return np.asarray(v, np.float32)


def _id_list(where, rec, key, vocab):
    v = rec[key]
    if not isinstance(v, list) or not v or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ValueError(f'{where}: "{key}" must be a non-empty list of token ids')
    a = np.asarray(v, np.int64)
    if a.min() < 0 or a.max() >= vocab:
        raise ValueError(f'{where}: "{key}" holds id {int(a.max() if a.max() >= vocab else a.min())} outside the '
                         f"tokenizer's vocabulary of {vocab}")
    return a.astype(np.int32)


def load_rollouts(path: str, tokenizer, max_len: int | None = None, truncation: str = "right",
                  scale_rewards: bool = True, eps: float = 1e-4):
    """(jaxodc.data.Samples of packing.Sample with rl.FIELDS, LoadReport) of a rollout JSONL file
    (module docstring). Rewards become advantages (r - mean) / (std + eps) over the rollouts of
    the same prompt (std over the group, ddof 0; without `scale_rewards` only r - mean)."""
    from jaxodc.modeling.rl import ADVANTAGE, OLD_LOGP, REF_LOGP
    if truncation not in TRUNCATION:
        raise ValueError(f"truncation must be one of {TRUNCATION}, got {truncation!r}")
    enc, report = _Encoder(tokenizer, append_eos=False), LoadReport(path, truncation, max_len)
    rows = []  # (line, prompt ids, completion ids, group key, score, logprobs, ref_logprobs)
    kinds: dict[str, tuple[int, object]] = {}
    for ln, rec in read_jsonl(path):
        where = f"{path}:{ln}"
        if "prompt_ids" in rec or "completion_ids" in rec:
            for k in ("prompt_ids", "completion_ids"):
                if k not in rec:
                    raise ValueError(f'{where}: a token-id rollout needs "prompt_ids" and "completion_ids" (no "{k}")')
            p = _id_list(where, rec, "prompt_ids", tokenizer.vocab_size)
            c = _id_list(where, rec, "completion_ids", tokenizer.vocab_size)
            key = ("ids", tuple(p.tolist()))
        else:
            for k in ("prompt", "completion"):
                if k not in rec:
                    raise ValueError(f'{where}: a rollout needs "prompt" and "completion" (or "prompt_ids" and '
                                     f'"completion_ids"); no "{k}"')
            if not isinstance(rec["completion"], str) or not isinstance(rec["prompt"], (str, list)):
                raise ValueError(f'{where}: "completion" must be a string and "prompt" a string or a list of messages')
            p, c = enc.prompt(where, rec["prompt"]), enc.text(rec["completion"], False)
            if not len(c):
                raise ValueError(f"{where}: the completion is empty")
            key = ("prompt", json.dumps(rec["prompt"], sort_keys=True))
        has = [k for k in ("reward", "advantage") if k in rec]
        if len(has) != 1:
            raise ValueError(f'{where}: a rollout needs exactly one of "reward" and "advantage" (has {has or "neither"})')
        score = rec[has[0]]
        if not isinstance(score, (int, float)) or isinstance(score, bool) or not np.isfinite(score):
            raise ValueError(f'{where}: "{has[0]}" must be a finite number, got {score!r}')
        shape = (has[0], "logprobs" in rec, "ref_logprobs" in rec)
        first = kinds.setdefault("shape", (ln, shape))
        if first[1] != shape:
            raise ValueError(f'{where}: rollouts must all carry the same fields; line {first[0]} has '
                             f'{first[1][0]!r}, logprobs={first[1][1]}, ref_logprobs={first[1][2]}, this line '
                             f'{shape[0]!r}, logprobs={shape[1]}, ref_logprobs={shape[2]}')
        lp = _float_list(where, rec, "logprobs", len(c)) if shape[1] else None
        ref = _float_list(where, rec, "ref_logprobs", len(c)) if shape[2] else None
        rows.append((ln, p, c, key, float(score), lp, ref))
    if not rows:
        raise ValueError(f"{path}: no rollouts")
    scores = np.asarray([r[4] for r in rows], np.float64)
    if kinds["shape"][1][0] == "reward":
        scores = group_advantages(scores, [r[3] for r in rows], scale_rewards, eps)
    out = []
    for (ln, p, c, _, _, lp, ref), adv in zip(rows, scores):
        ids = np.concatenate([p, c]).astype(np.int32)
        trained = np.r_[np.zeros(len(p), bool), np.ones(len(c), bool)]
        fields = {ADVANTAGE: np.where(trained, adv, 0.0)}
        for name, vals in ((OLD_LOGP, lp), (REF_LOGP, ref)):
            if vals is not None:
                fields[name] = np.r_[np.zeros(len(p)), vals]
        kept = _truncate(f"{path}:{ln}", report, ids, trained, max_len)
        if kept is None:
            report.dropped += 1
            report.dropped_lines.append(ln)
            continue
        n = len(kept[0])
        # fields follow the target: position i carries token i + 1's values
        out.append(_sample(kept[0], kept[1], {k: np.r_[v[1:n], 0.0] for k, v in fields.items()}))
    return _finish(report, out)


def group_advantages(rewards, groups, scale: bool = True, eps: float = 1e-4) -> np.ndarray:
    """GRPO's group-normalised advantages: (r - mean_g) / (std_g + eps) over each group g of
    equal keys (std with ddof 0; scale=False: r - mean_g only)."""
    rewards = np.asarray(rewards, np.float64)
    out = np.empty_like(rewards)
    index: dict = {}
    for i, g in enumerate(groups):
        index.setdefault(g, []).append(i)
    for idx in index.values():
        r = rewards[idx]
        out[idx] = (r - r.mean()) / (r.std() + eps) if scale else r - r.mean()
    return out
