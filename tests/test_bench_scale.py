"""`jaxodc bench scale` at W = 8 in a tiny configuration (schema and completeness, not timings)."""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_scale_smoke_at_8_ranks(tmp_path):
    from jaxodc.bench.scale import COMBOS
    out, png = tmp_path / "scale.json", tmp_path / "scale.png"
    cmd = [sys.executable, "-m", "jaxodc", "bench", "scale", "--ranks", "8", "--minibatches", "2", "--longest-s",
           "0.05", "--json", str(out), "--png", str(png), "--timeout", "400"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=450)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads(out.read_text())
    rows = [r for r in records if r["kind"] == "scale"]
    assert sorted((r["comm"], r["balance"]) for r in rows) == sorted(COMBOS)
    for r in rows:
        assert {"ranks", "comm", "balance", "transport", "samples_per_s", "bubble", "sim_bubble", "preset"} <= set(r)
        assert r["ranks"] == 8 and r["transport"] == "jaxodc" and r["preset"] == "longalign"
        assert math.isfinite(r["samples_per_s"]) and r["samples_per_s"] > 0
        assert 0.0 <= r["sim_bubble"] < 1.0 and r["bubble"] < 1.0 and r["minibatches"] == 2
        # every rank slept its share of the modelled compute: the busy time is positive
        assert r["emulated_s_per_minibatch"] > 0
    ratios = [r for r in records if r["kind"] == "ratio"]
    assert len(ratios) == 2 and all(q["ci95"][0] <= q["value"] <= q["ci95"][1] and q["ceiling"] > 1 for q in ratios)
    bars = {b["bar"] for b in records if b["kind"] == "bar"}
    assert "odc+lb_mini / collective@jaxodc+lb_micro samples/s" in bars
    assert "odc+lb_mini bubble / collective@jaxodc+lb_micro bubble" in bars
    assert png.stat().st_size > 10_000
    assert "W=8: odc+lb_mini / collective@jaxodc+lb_micro samples/s" in proc.stdout


def test_longest_sample_default_grows_with_the_ranks():
    import argparse

    from jaxodc.bench.scale import longest_s_of
    default = argparse.Namespace(longest_s=None)
    assert [longest_s_of(default, w) for w in (2, 8, 16, 32, 64)] == [2.0, 2.0, 2.0, 4.0, 8.0]
    assert longest_s_of(argparse.Namespace(longest_s=0.5), 32) == 0.5  # given: kept at every W
