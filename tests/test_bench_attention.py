"""bench/attention.py --gpu and --sweep, run on the CPU at toy sizes (the Pallas kernel interpreted,
cuDNN absent): the records issue 32 asks for, the bars recomputed here from them, and a sweep's
tables written, loaded by a later run and followed by its "auto". Benchmark smoke runs: slow."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(*args, timeout=300):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "attention.py"), "--gpu", *args], env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_gpu_records_and_bars(tmp_path):
    out = tmp_path / "gpu.json"
    T, H, Dh = 128, 1, 16
    _bench("--T", str(T), "--samples", "1,2", "--H", str(H), "--Dh", str(Dh), "--reps", "1", "--json", str(out))
    rows = json.loads(out.read_text())
    recs = [r for r in rows if r["bench"] == "attention_gpu"]
    assert {(r["dtype"], r["samples"], r["impl"]) for r in recs} == {
        (d, n, i) for d in ("fp32", "bf16") for n in (1, 2) for i in ("pallas", "dense", "auto")} | {
        ("bf16", n, "cudnn") for n in (1, 2)}
    for r in recs:
        assert {"samples", "dtype", "impl", "fwd_s", "fwdbwd_s", "tflops"} <= set(r)
        assert r["mode"] == {"fp32": "tf32", "bf16": "bf16"}[r["dtype"]]
        assert r["auto_picks"] == "dense"  # no sweep entry for this device
        if r["impl"] == "cudnn":  # no cuDNN on a CPU: reported, left out
            assert r["fwd_s"] is None and r["tflops"] is None
            continue
        assert r["fwd_s"] > 0 and r["fwdbwd_s"] > 0
        s = T // r["samples"]  # causal: s(s+1)/2 pairs per sample, 2 products, 2 FLOPs each; bwd = 2.5 fwd
        flops = 3.5 * r["samples"] * 2 * 2 * H * Dh * s * (s + 1) / 2
        assert r["tflops"] == pytest.approx(flops / r["fwdbwd_s"] / 1e12)
    by = {(r["dtype"], r["samples"], r["impl"]): r["fwdbwd_s"] for r in recs}
    bars = {(b["dtype"], b["bar"]): b for b in rows if b["bench"] == "attention_gpu_bar"}
    for d in ("fp32", "bf16"):
        one = bars[(d, "auto/dense fwd+bwd, 1 samples")]
        assert one["value"] == pytest.approx(by[(d, 1, "auto")] / by[(d, 1, "dense")])
        assert one["limit"] == 1.0 and one["pass"] == (one["value"] <= 1.0)
        two = bars[(d, "pallas/dense fwd+bwd, 2 samples")]
        assert two["value"] == pytest.approx(by[(d, 2, "pallas")] / by[(d, 2, "dense")]) and two["limit"] is None
    peak = bars[("bf16", "auto fwd+bwd TFLOP/s / bf16 peak, 1 sample")]
    assert peak["limit"] == 0.35 and peak["value"] is None  # a CPU has no bf16 peak in the table


def test_sweep_tables_round_trip(tmp_path):
    tables = tmp_path / "sweep.json"
    text = _bench("--sweep", "--T", "256", "--H", "1", "--heads", "16", "--dtypes", "bf16", "--reps", "1",
                  "--tables-out", str(tables))
    found = json.loads(tables.read_text())
    timed = {tuple(r["blocks"]): r["fwdbwd_s"] for r in found["records"] if r["kind"] == "blocks"}
    assert len(timed) == 6 and all(t > 0 for t in timed.values())
    [[gen, Dp, mode, best, sec]] = found["blocks"]
    assert (gen, Dp, mode) == ("*", 16, "bf16") and tuple(best) == min(timed, key=timed.get) and sec == min(timed.values())
    [check] = [r for r in found["records"] if r["kind"] == "check"]  # the winner's gradients vs dense, bf16 dots
    assert check["blocks"] == best and 0 < check["grad_err_vs_dense"] <= 16 * 2.0 ** -9
    cross = {r["sample_len"]: r["pallas_s"] <= r["dense_s"] for r in found["records"] if r["kind"] == "crossover"}
    assert sorted(cross) == [128, 256]
    [[_, _, _, c]] = found["crossover"]
    want = 0 if not cross[128] else (128 if not cross[256] else float("inf"))
    assert c == want
    assert f"('*', 16, 'bf16'): Blocks{tuple(best)}" in text  # the line to paste
    # A later run with --tables: its "auto" picks Pallas exactly where the crossover allows.
    out = tmp_path / "gpu.json"
    _bench("--T", "256", "--samples", "1,2", "--H", "1", "--Dh", "16", "--reps", "1", "--dtypes", "bf16",
           "--tables", str(tables), "--json", str(out))
    for r in json.loads(out.read_text()):
        if r["bench"] == "attention_gpu":
            assert r["tables"] == str(tables)
            assert r["auto_picks"] == ("pallas" if r["sample_len"] <= c else "dense"), r
