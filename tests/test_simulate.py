import dataclasses
import io
import json

import numpy as np
import pytest

from jaxodc.balance.cost import CostModel
from jaxodc.data import sample_lengths
from jaxodc.train.metrics import MinibatchRecord, Progress, records_bubble_rate, summarize
from jaxodc.balance.simulate import METHODS, simulate
from jaxodc.cli.simulate import main
from jaxodc.cli.timeline import draw


def test_cli_table_and_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    rc = main(["--preset", "longalign", "--devices", "8", "16", "--minibatch", "1", "4", "--steps", "6",
               "--pool", "3000", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "collective/lb_micro" in text and "odc/lb_mini" in text
    assert len([l for l in text.splitlines() if l.startswith("|")]) == 2 + 4
    doc = json.loads(out.read_text())
    assert doc["max_len"] == 65536 and doc["max_tokens"] == 65536
    assert [(r["devices"], r["minibatch"]) for r in doc["rows"]] == [(8, 1), (8, 4), (16, 1), (16, 4)]
    for r in doc["rows"]:
        b = r["bubble"]
        assert set(b) == set(METHODS) and all(0.0 <= v < 1.0 for v in b.values())
        if r["minibatch"] == 1:  # one sample per rank: every method is the same assignment
            assert len({round(v, 12) for k, v in b.items() if "steal" not in k}) == 1
        else:
            assert b["odc/lb_mini"] < b["collective/lb_micro"]
            assert b["odc/lb_micro"] <= b["collective/lb_micro"] and b["odc/local_sort"] <= b["collective/local_sort"]
        assert f"{100 * b['odc/lb_mini']:.2f}%" in text


def test_cli_lengths_file_and_errors(tmp_path, capsys):
    f = tmp_path / "lens.txt"
    f.write_text("\n".join(str(x) for x in [100] * 64))
    assert main(["--lengths-file", str(f), "--devices", "4", "--minibatch", "4", "--steps", "3", "--json", "-"]) == 0
    text = capsys.readouterr().out
    doc = json.loads(text[text.index("\n{") + 1:])
    # equal lengths, 16 samples over 4 ranks, max_tokens 100: perfectly balanced everywhere
    assert all(v == 0.0 for v in doc["rows"][0]["bubble"].values())
    assert main(["--lengths-file", str(f), "--max-len", "50"]) == 2
    assert main(["--packing-ratio", "0.5", "--devices", "2"]) == 2


def test_simulate_by_hand():
    # 2 ranks x 1 sample, lengths 10 and 20, cost s^2: the short rank idles 300 of 400.
    pool = np.array([10, 20])
    r = simulate(pool, 2, 1, 20, CostModel(1.0, 0.0), ["collective/lb_micro", "odc/lb_mini"], steps=1)
    assert r["collective/lb_micro"] == pytest.approx(300 / 800)
    assert r["odc/lb_mini"] == pytest.approx(300 / 800)


def test_stealing_absorbs_cost_model_error():
    pool = sample_lengths("longalign", 4000, 4096, 0)
    r = simulate(pool, 8, 8, 4096, CostModel.for_transformer(128), ["odc/lb_mini", "odc/lb_steal"], steps=12,
                 seed=0, cost_noise=0.4)
    assert r["odc/lb_steal"] < r["odc/lb_mini"]


def _recs():
    # step 0: rank 0 busy 3 + 0.5 (optimizer) of 4 s, rank 1 busy 1 + 0.5 of 4 s; step 1: both busy 2 of 2 s
    return [MinibatchRecord(0, 0, 0.0, 4.0, [(0.0, 1.0), (1.0, 3.0)], (3.5, 4.0), samples=3, tokens=30, loss=2.0),
            MinibatchRecord(1, 0, 0.0, 4.0, [(0.0, 1.0)], (3.5, 4.0), samples=1, tokens=10, loss=2.0),
            MinibatchRecord(0, 1, 4.0, 6.0, [(4.0, 6.0)], None, samples=2, tokens=20, loss=1.5),
            MinibatchRecord(1, 1, 4.0, 6.0, [(4.0, 6.0)], None, samples=2, tokens=20, loss=1.5)]


def test_metrics_by_hand(tmp_path):
    recs = _recs()
    assert records_bubble_rate(recs) == pytest.approx((0.5 + 2.5) / (8 + 4))
    s = summarize(recs)
    assert s["samples_per_s"] == pytest.approx(8 / 6) and s["tokens_per_s"] == pytest.approx(80 / 6)
    assert s["compute_s"] == {0: 5.5, 1: 3.5} and s["idle_s"] == {0: 0.5, 1: 2.5} and s["loss"] == 1.5
    recs[1].busy_s = 4.0  # estimated compute overrides the intervals
    assert records_bubble_rate(recs) == pytest.approx(0.5 / 12)
    assert [MinibatchRecord.from_dict(dataclasses.asdict(r)) for r in recs] == recs
    buf = io.StringIO()
    pr = Progress(2, "train", width=4, stream=buf)
    pr.update(loss=2.5)
    pr.update(loss=1.25)
    assert buf.getvalue().endswith("[####] 2/2 loss 1.25\n")


def test_timeline_png(tmp_path):
    recs = _recs()
    path = draw({"odc + lb_mini": recs, "collective + lb_micro": recs[:2]}, str(tmp_path / "t.png"), title="x")
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    with pytest.raises(ValueError, match="run 'empty' has no records"):
        draw({"a": recs, "empty": []}, str(tmp_path / "u.png"))
