"""Tokenizers, chat templates and loss masks (jaxodc.modeling) against transformers' own rendering
and tokenisation of the same files; masks through packing and the global token count; bad data."""

import numpy as np
import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from support.tiny_tokenizer import CHATML, CHATML_GENERATION, write_jsonl, write_tokenizer

from jaxodc.balance.packing import Sample, empty, pack, sample_loss_tokens
from jaxodc.modeling.dataset import group_advantages, load_rollouts, load_sft
from jaxodc.modeling.rl import ADVANTAGE, OLD_LOGP, REF_LOGP
from jaxodc.modeling.tokenizer import ByteTokenizer, Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the quick brown fox"}],
    [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hello world, how are you?"},
     {"role": "assistant", "content": "the lazy dog"}, {"role": "user", "content": "2 + 2?"},
     {"role": "assistant", "content": "4; ünïcödé"}],
    [{"role": "user", "content": "def f(x):"}, {"role": "assistant", "content": "    return x * 2\n"},
     {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "Paris"}],
]


def _hf(directory):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(directory)


def _targets_trained(mask_per_token):
    """A per-token trained flag as the sample's loss mask: position i weighs token i + 1."""
    m = np.asarray(mask_per_token, np.float32)
    return np.r_[m[1:], 0.0]


def test_chat_masks_equal_transformers_generation_mask(tmp_path):
    d = write_tokenizer(str(tmp_path / "tok"), CHATML_GENERATION)
    hf = _hf(d)
    path = write_jsonl(str(tmp_path / "chat.jsonl"), [{"messages": m} for m in CONVERSATIONS])
    samples, report = load_sft(path, Tokenizer(d))
    assert report.samples == len(CONVERSATIONS) and report.truncated == report.dropped == 0
    for conv, s in zip(CONVERSATIONS, samples.tokens):
        ref = hf.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        np.testing.assert_array_equal(s.tokens, ref["input_ids"])
        np.testing.assert_array_equal(s.loss_mask, _targets_trained(ref["assistant_masks"]))
        assert s.loss_mask.sum() > 0


def test_chat_masks_equal_transformers_prefix_rendering(tmp_path):
    """A template without {% generation %}: each assistant turn is what rendering up to it adds to
    the render with the generation prompt, counted here in transformers' own tokens."""
    d = write_tokenizer(str(tmp_path / "tok"), CHATML)
    hf = _hf(d)
    path = write_jsonl(str(tmp_path / "chat.jsonl"), [{"messages": m} for m in CONVERSATIONS])
    samples, _ = load_sft(path, Tokenizer(d))
    n_tok = lambda text: len(hf(text, add_special_tokens=False)["input_ids"])
    for conv, s in zip(CONVERSATIONS, samples.tokens):
        text = hf.apply_chat_template(conv, tokenize=False)
        ids = hf(text, add_special_tokens=False)["input_ids"]
        np.testing.assert_array_equal(s.tokens, ids)
        want = np.zeros(len(ids))
        for k, m in enumerate(conv):
            if m["role"] == "assistant":
                a = n_tok(hf.apply_chat_template(conv[:k], add_generation_prompt=True, tokenize=False))
                b = n_tok(hf.apply_chat_template(conv[:k + 1], tokenize=False))
                want[a:b] = 1
        np.testing.assert_array_equal(s.loss_mask, _targets_trained(want))


def test_prompt_completion_and_text(tmp_path):
    d = write_tokenizer(str(tmp_path / "tok"), CHATML)
    hf = _hf(d)
    conv_prompt = CONVERSATIONS[1][:4]
    path = write_jsonl(str(tmp_path / "pc.jsonl"), [
        {"prompt": "hello world", "completion": " the lazy dog"},
        {"prompt": conv_prompt, "completion": "4"},
        {"text": "Paris is the capital of France."}])
    samples, report = load_sft(path, Tokenizer(d))
    s0, s1, s2 = samples.tokens
    p, c = hf("hello world")["input_ids"], hf(" the lazy dog", add_special_tokens=False)["input_ids"]
    eos = hf.convert_tokens_to_ids("<|im_end|>")
    np.testing.assert_array_equal(s0.tokens, p + c + [eos])
    np.testing.assert_array_equal(s0.loss_mask, _targets_trained([0] * len(p) + [1] * (len(c) + 1)))
    # conversational prompt: only the completion's assistant turn is trained, not the earlier one
    full = conv_prompt + [{"role": "assistant", "content": "4"}]
    ids = hf(hf.apply_chat_template(full, tokenize=False), add_special_tokens=False)["input_ids"]
    a = len(hf(hf.apply_chat_template(conv_prompt, add_generation_prompt=True, tokenize=False),
               add_special_tokens=False)["input_ids"])
    np.testing.assert_array_equal(s1.tokens, ids)
    np.testing.assert_array_equal(s1.loss_mask, _targets_trained([0] * a + [1] * (len(ids) - a)))
    t = hf("Paris is the capital of France.")["input_ids"]
    np.testing.assert_array_equal(s2.tokens, t)
    np.testing.assert_array_equal(s2.loss_mask, np.r_[np.ones(len(t) - 1), 0.0])
    assert report.loss_tokens == int(sum(s.loss_mask.sum() for s in samples.tokens))


def test_byte_tokenizer_chat_needs_template_and_text_works(tmp_path):
    path = write_jsonl(str(tmp_path / "a.jsonl"), [{"prompt": "ab", "completion": "cd"}])
    (s,), _ = load_sft(path, ByteTokenizer())
    np.testing.assert_array_equal(s.tokens, [97, 98, 99, 100])
    np.testing.assert_array_equal(s.loss_mask, [0, 1, 1, 0])  # targets "c", "d"; no EOS in bytes
    path = write_jsonl(str(tmp_path / "b.jsonl"), [{"messages": CONVERSATIONS[0]}])
    with pytest.raises(ValueError, match=r"b\.jsonl:1: chat messages need a chat template"):
        load_sft(path, ByteTokenizer())
    (s,), _ = load_sft(path, ByteTokenizer(chat_template=CHATML))  # bytes with a template of its own
    text = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\nthe quick brown fox<|im_end|>\n"
    assert bytes(s.tokens.astype(np.uint8)) == text.encode()
    trained = np.zeros(len(text))
    trained[text.index("the quick"):] = 1  # the turn's text, end-of-turn marker and newline; not its header
    np.testing.assert_array_equal(s.loss_mask, _targets_trained(trained))


def test_truncation_policies_are_reported(tmp_path):
    d = write_tokenizer(str(tmp_path / "tok"), CHATML)
    tok = Tokenizer(d)
    recs = [{"prompt": "hello world", "completion": " the quick brown fox jumps over the lazy dog"},
            {"prompt": "the quick brown fox jumps over the lazy dog " * 3, "completion": " ok"},
            {"text": "hi"}]
    path = write_jsonl(str(tmp_path / "t.jsonl"), recs)
    full, rep = load_sft(path, tok)
    lens = [len(s) for s in full.tokens]
    max_len = lens[0] - 3
    assert lens[1] > max_len > lens[2]
    right, rep = load_sft(path, tok, max_len=max_len, truncation="right")
    # the first keeps its prompt and part of the completion; the second has nothing left to train on
    assert [len(s) for s in right.tokens] == [max_len, lens[2]]
    np.testing.assert_array_equal(right.tokens[0].tokens, full.tokens[0].tokens[:max_len])
    np.testing.assert_array_equal(right.tokens[0].loss_mask[:-1], full.tokens[0].loss_mask[:max_len - 1])
    assert right.tokens[0].loss_mask[-1] == 0
    assert (rep.truncated, rep.tokens_cut, rep.dropped, rep.dropped_lines) == (1, 3, 1, [2])
    assert "1 truncated (3 tokens cut), 1 dropped (lines 2)" in str(rep)
    drop, rep = load_sft(path, tok, max_len=max_len, truncation="drop")
    assert [len(s) for s in drop.tokens] == [lens[2]] and rep.dropped_lines == [1, 2] and rep.truncated == 0
    with pytest.raises(ValueError, match=rf"t\.jsonl:1: {lens[0]} tokens > max_len={max_len}"):
        load_sft(path, tok, max_len=max_len, truncation="error")


@pytest.mark.parametrize("line, message", [
    (b'{"prompt": "a"}', r"bad\.jsonl:2: a prompt / completion record needs both"),
    (b'{"foo": 1}', r'bad\.jsonl:2: expected "messages", "prompt" \+ "completion" or "text"'),
    (b'{"text": "caf\xe9"}', r"bad\.jsonl:2: not UTF-8 \(byte 13"),
    (b'{"messages": [{"role": "robot", "content": "x"}]}', r"bad\.jsonl:2: message 0 has role 'robot'"),
    (b'{"messages": [{"role": "user"}]}', r'bad\.jsonl:2: message 0 must be an object with string "role" and "content"'),
    (b'{"messages": [{"role": "user", "content": "x"}]}', r"bad\.jsonl:2: the conversation has no assistant message"),
    (b'{"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}, '
     b'{"role": "assistant", "content": "z"}]}', r"bad\.jsonl:2: the chat template rejected .*system message must come first"),
    (b'{"text": "x"', r"bad\.jsonl:2: not valid JSON"),
    (b'[1, 2]', r"bad\.jsonl:2: expected a JSON object, got list"),
])
def test_bad_sft_data_names_file_and_line(tmp_path, line, message):
    d = write_tokenizer(str(tmp_path / "tok"), CHATML_GENERATION)
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "hello world"}\n' + line + b"\n")
    with pytest.raises(ValueError, match=message):
        load_sft(str(path), Tokenizer(d))


def test_rollouts_fields_and_group_advantages(tmp_path):
    d = write_tokenizer(str(tmp_path / "tok"), CHATML)
    tok = Tokenizer(d)
    rng = np.random.default_rng(0)
    recs, want_adv = [], []
    prompts = ["hello world", "2 + 2 =", "Paris is"]
    for g, p in enumerate(prompts):
        for j in range(4):
            c = [" the lazy dog", " 4", " the capital", " fox"][(g + j) % 4]
            n = len(tok.encode(c))
            recs.append({"prompt": p, "completion": c, "reward": float(rng.integers(0, 3)),
                         "logprobs": rng.normal(-1, 0.3, n).round(4).tolist(),
                         "ref_logprobs": rng.normal(-1, 0.3, n).round(4).tolist()})
    recs.append({"prompt_ids": [5, 6, 7], "completion_ids": [8, 9], "reward": 1.0, "logprobs": [-0.5, -0.25],
                 "ref_logprobs": [-0.1, -0.2]})
    path = write_jsonl(str(tmp_path / "r.jsonl"), recs)
    samples, report = load_rollouts(path, tok)
    r = np.asarray([x["reward"] for x in recs])
    for g in range(3):
        x = r[4 * g:4 * g + 4]
        want_adv += list((x - x.mean()) / (x.std() + 1e-4))
    want_adv.append(0.0)  # a group of one
    np.testing.assert_allclose(group_advantages(r, [x.get("prompt", "ids") for x in recs]), want_adv, rtol=1e-12)
    for rec, s, adv in zip(recs, samples.tokens, want_adv):
        p = tok.encode(rec["prompt"], True) if "prompt" in rec else np.asarray(rec["prompt_ids"])
        c = tok.encode(rec["completion"]) if "completion" in rec else np.asarray(rec["completion_ids"])
        np.testing.assert_array_equal(s.tokens, np.r_[p, c])
        n = len(p)
        mask = np.r_[np.zeros(n - 1), np.ones(len(c)), 0.0]
        np.testing.assert_array_equal(s.loss_mask, mask)
        np.testing.assert_allclose(s.fields[ADVANTAGE], mask * np.float32(adv), rtol=1e-6)
        np.testing.assert_array_equal(s.fields[OLD_LOGP], np.r_[np.zeros(n - 1), np.float32(rec["logprobs"]), 0.0])
        np.testing.assert_array_equal(s.fields[REF_LOGP], np.r_[np.zeros(n - 1), np.float32(rec["ref_logprobs"]), 0.0])
    assert report.loss_tokens == sum(len(tok.encode(x["completion"])) if "completion" in x else 2 for x in recs)
    # "advantage" is used as it is
    path = write_jsonl(str(tmp_path / "a.jsonl"), [{"prompt": "hello", "completion": " fox", "advantage": 0.75}] * 2)
    s, _ = load_rollouts(path, tok)
    assert set(s.tokens[0].fields) == {ADVANTAGE} and s.tokens[0].fields[ADVANTAGE].max() == 0.75


@pytest.mark.parametrize("recs, message", [
    ([{"prompt": "a", "completion": "b", "reward": 1}, {"prompt": "a", "completion": "b", "advantage": 1}],
     r"r\.jsonl:2: rollouts must all carry the same fields"),
    ([{"prompt": "a", "completion": "b"}], r'r\.jsonl:1: a rollout needs exactly one of "reward" and "advantage"'),
    ([{"prompt": "a", "reward": 1}], r'r\.jsonl:1: a rollout needs "prompt" and "completion".*no "completion"'),
    ([{"prompt": "a", "completion": " fox", "reward": 1, "logprobs": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]}],
     r'r\.jsonl:1: "logprobs" must be a list of \d+ numbers \(one per completion token\), got 7'),
    ([{"prompt_ids": [1], "completion_ids": [99999], "reward": 1}], r"r\.jsonl:1: \"completion_ids\" holds id 99999"),
    ([{"prompt": "a", "completion": "b", "reward": "high"}], r'r\.jsonl:1: "reward" must be a finite number'),
])
def test_bad_rollouts_name_file_and_line(tmp_path, recs, message):
    d = write_tokenizer(str(tmp_path / "tok"), CHATML)
    path = write_jsonl(str(tmp_path / "r.jsonl"), recs)
    with pytest.raises(ValueError, match=message):
        load_rollouts(path, Tokenizer(d))


def test_masks_and_fields_through_packing_and_global_tokens():
    from jaxodc.balance.plan import make_plan
    from jaxodc.train.core import microbatches_for, plan_global_tokens
    rng = np.random.default_rng(1)
    samples = []
    for L in rng.integers(3, 40, size=12):
        m = (rng.random(L) < 0.5).astype(np.float32)
        m[-1] = 0
        samples.append(Sample(rng.integers(0, 256, L).astype(np.int32), m,
                              {ADVANTAGE: rng.normal(size=L).astype(np.float32) * m}))
    plan = make_plan("lb_micro", [len(s) for s in samples], 2, 64)
    assert list(plan.lengths) == [len(s) for s in samples]  # balancing costs the whole sequence
    assert plan_global_tokens(plan, samples) == float(sum(s.loss_mask.sum() for s in samples))
    seen = 0.0
    for r in range(2):
        mbs = microbatches_for(plan, r, samples, pad_to=max(plan.counts()) + 1)
        assert all(set(mb) == {"tokens", "targets", "segment_ids", "positions", "loss_mask", ADVANTAGE} for mb in mbs)
        for mb, ids in zip(mbs, list(plan.ranks[r]) + [()] * 9):
            seen += mb["loss_mask"].sum()
            for n, i in enumerate(ids):  # each sample's mask and field land under its segment
                at = mb["segment_ids"][0] == n + 1
                np.testing.assert_array_equal(mb["tokens"][0][at], samples[i].tokens)
                np.testing.assert_array_equal(mb["loss_mask"][0][at], samples[i].loss_mask)
                np.testing.assert_array_equal(mb[ADVANTAGE][0][at], samples[i].fields[ADVANTAGE])
            np.testing.assert_array_equal(mb[ADVANTAGE][0][mb["segment_ids"][0] == 0], 0)
    assert seen == plan_global_tokens(plan, samples) == sample_loss_tokens(samples)
    assert set(empty(16, fields=(ADVANTAGE,)).as_dict()) == {"tokens", "targets", "segment_ids", "positions",
                                                              "loss_mask", ADVANTAGE}
    with pytest.raises(ValueError, match="different per-token fields"):
        pack([samples[0], samples[1].tokens], 128)
    with pytest.raises(ValueError, match="loss_mask must be 0"):
        Sample(np.arange(3, dtype=np.int32), np.ones(3, np.float32))
