import json

import numpy as np
import pytest

from jaxodc.data import (PRESETS, Samples, VOCAB, load_jsonl, load_lengths, minibatches, sample_lengths,
                               stdlib_corpus, synthetic_text)
from jaxodc.balance.packing import bucket, empty, loss_tokens, pack


def test_pack_layout_by_hand():
    a, b = np.array([5, 6, 7]), np.array([9, 8])
    p = pack([a, b], 8)
    assert p.tokens.tolist() == [[5, 6, 7, 9, 8, 0, 0, 0]]
    assert p.targets.tolist() == [[6, 7, 0, 8, 0, 0, 0, 0]]
    assert p.segment_ids.tolist() == [[1, 1, 1, 2, 2, 0, 0, 0]]
    assert p.positions.tolist() == [[0, 1, 2, 0, 1, 0, 0, 0]]
    assert p.loss_mask.tolist() == [[1, 1, 0, 1, 0, 0, 0, 0]]
    assert p.n_loss_tokens == loss_tokens([3, 2]) == 3
    e = empty(8)
    assert e.n_loss_tokens == 0 and not e.segment_ids.any()


def test_pack_rows_and_errors():
    p = pack([np.arange(1, 5), np.arange(1, 4), np.arange(1, 3)], 5, rows=2)
    assert p.segment_ids.tolist() == [[1, 1, 1, 1, 0], [2, 2, 2, 3, 3]]
    with pytest.raises(ValueError, match="sample 1 of length 6 does not fit"):
        pack([np.arange(3), np.arange(6)], 5)
    with pytest.raises(ValueError, match="sample 0 is empty"):
        pack([np.array([], np.int32)], 5)


def test_presets_deterministic_long_tailed_and_bounded():
    for name in PRESETS:
        a = sample_lengths(name, 5000, 1024, seed=3)
        assert np.array_equal(a, sample_lengths(name, 5000, 1024, seed=3))
        assert not np.array_equal(a, sample_lengths(name, 5000, 1024, seed=4))
        assert a.min() >= 8 and a.max() <= 1024
    la = sample_lengths("longalign", 20000, 65536, 0)
    aime = sample_lengths("aime", 20000, 65536, 0)
    # long tail: mean well above median, and heavier than the RL preset's
    assert la.mean() > 1.2 * np.median(la)
    assert np.percentile(la, 99) / np.median(la) > 1.5 * np.percentile(aime, 99) / np.median(aime)
    with pytest.raises(ValueError, match="unknown length preset"):
        sample_lengths("nope", 3, 10)


def test_stdlib_text_samples():
    c = stdlib_corpus(1 << 16)
    assert c.dtype == np.uint8 and len(c) == 1 << 16
    assert b"def " in c.tobytes() or b"import" in c.tobytes()
    s = synthetic_text("swe", 10, 256, seed=1)
    assert len(s) == 10 and all(t.dtype == np.int32 and t.max() < VOCAB for t in s.tokens)
    assert s.lengths.tolist() == sample_lengths("swe", 10, 256, 1).tolist()
    s2 = synthetic_text("swe", 10, 256, seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(s.tokens, s2.tokens))


def test_user_files(tmp_path):
    f = tmp_path / "l.txt"
    f.write_text("# lengths\n10 20\n30,40\n")
    assert load_lengths(str(f)).tolist() == [10, 20, 30, 40]
    f.write_text("10\nabc\n")
    with pytest.raises(ValueError, match=r"l.txt:2: 'abc'"):
        load_lengths(str(f))
    j = tmp_path / "d.jsonl"
    j.write_text(json.dumps({"text": "hello world"}) + "\n\n" + json.dumps({"text": "é" * 10}) + "\n")
    out = load_jsonl(str(j), max_len=8)
    assert out[0].tolist() == list(b"hello wo") and len(out[1]) == 8
    with pytest.raises(ValueError, match="d.jsonl:1: sample of 11 tokens > max_len=8"):
        load_jsonl(str(j), max_len=8, truncate=False)
    j.write_text('{"txt": 1}\n')
    with pytest.raises(ValueError, match='d.jsonl:1: expected an object with a string "text"'):
        load_jsonl(str(j))


def test_minibatches_deterministic_cover_epoch():
    a = list(minibatches(20, 6, seed=2))
    assert len(a) == 3 and all(len(x) == 6 for x in a)
    assert len(set(np.concatenate(a).tolist())) == 18
    b = list(minibatches(20, 6, seed=2))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError):
        next(minibatches(3, 6))


def test_bucket():
    assert [bucket(t, 512, 64) for t in (0, 1, 64, 65, 128, 129, 300, 512)] == [64, 64, 64, 128, 128, 256, 512, 512]
    assert bucket(100, 100, 64) == 100 and bucket(10, 48, 64) == 48  # capped at max_tokens
    rows = tuple(range(64, 513, 64))  # explicit row lengths
    assert [bucket(t, 512, rows) for t in (0, 1, 64, 65, 130, 300, 512)] == [64, 64, 64, 128, 192, 320, 512]
    assert bucket(600, 700, rows) == 700  # nothing listed holds it: the cap
    with pytest.raises(ValueError, match="513 tokens do not fit max_tokens=512"):
        bucket(513, 512)
