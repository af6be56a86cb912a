"""`jaxodc bench train` in a tiny configuration (schema and completeness, not timings), plus the
report arithmetic on hand-made records and the memory helpers."""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MBS = (1, 2, 4, 8)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_run_has_every_combo_and_minibatch(tmp_path):
    from jaxodc.bench.train import COMBOS, sum_comm
    combos = COMBOS + ((sum_comm("exact"), "lb_mini"),)  # --compare-sum: the default fp32 sum against exact
    out = tmp_path / "train.json"
    cmd = [sys.executable, "-m", "jaxodc", "bench", "train", "--json", str(out), "--d-model", "16", "--layers", "1",
           "--heads", "2", "--max-tokens", "32", "--min-bucket", "32", "--reps", "1", "--block-samples", "1",
           "--calib-reps", "1", "--pool", "32", "--straggle", "default", "--compare-sum", "--timeout", "400",
           "--minibatch", ",".join(map(str, MBS)), "--combos", ",".join(f"{c}+{b}" for c, b in COMBOS)]
    env = {k: v for k, v in os.environ.items() if k != "JAXODC_ODC_ACCUMULATE"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=450, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads(out.read_text())
    injected = [r for r in records if r["kind"] == "train" and r["straggle"]]
    assert sorted((r["comm"], r["balance"], r["minibatch"]) for r in injected) == sorted(
        (c, b, mb) for c, b in combos for mb in MBS)  # every combo again, under injection
    assert all(r["straggle"] == "p=0.05,rank_p=0.05,factor=3,seed=0" for r in injected)
    assert {(b["bar"].split(" (straggle")[0], b["minibatch"]) for b in records
            if b["kind"] == "bar" and "straggle" in b["bar"]} >= {
        ("odc+lb_steal / odc+lb_mini samples/s", 4), ("odc+lb_mini / collective@jaxodc+lb_micro samples/s", 8)}
    train = [r for r in records if r["kind"] == "train" and not r["straggle"]]
    got = sorted((r["comm"], r["balance"], r["minibatch"]) for r in train)
    assert got == sorted((c, b, mb) for c, b in combos for mb in MBS)
    for r in train:
        assert r["ranks"] == 2
        assert math.isfinite(r["samples_per_s"]) and r["samples_per_s"] > 0, r
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > r["samples_per_s"], r
        for k in ("bubble_rate", "bubble_intervals", "bubble_model"):
            assert 0.0 <= r[k] <= 1.0, (k, r)
        assert 0.0 < r["end_s"] < 5.0, r  # the end of a minibatch (StepResult.end_s), median
        assert r["steps"] == max(1, math.ceil(1 / r["minibatch"])) and r["reps"] == 1
        assert math.isfinite(r["loss"]) and r["loss"] > 0
    bars = [r for r in records if r["kind"] == "bar"]
    names = {(b["bar"], b["minibatch"]) for b in bars}
    for mb in MBS:
        assert ("odc+lb_mini / collective+lb_micro samples/s", mb) in names
        assert ("odc+lb_mini / collective@jaxodc+lb_micro samples/s", mb) in names
        assert ("odc+lb_steal / odc+lb_mini samples/s", mb) in names
        assert ("odc+lb_mini exact sum / fp32 sum samples/s (reproducible accumulation)", mb) in names
    if 1 in MBS:
        assert ("odc+lb_micro / collective@jaxodc+lb_micro samples/s (identical schedules)", 1) in names
    assert {r["transport"] for r in train} == {"gloo", "jaxodc"}
    for mb in (4, 8):
        assert ("odc+lb_mini bubble / collective@jaxodc+lb_micro bubble", mb) in names
    assert all(isinstance(b["pass"], bool) for b in bars if b["threshold"] is not None)
    (cal,) = [r for r in records if r["kind"] == "calibration"]
    assert cal["rows"] == [32]
    for model in (cal["cost_odc"], cal["cost_collective"]):  # a, b, c of each trainer's fitted model
        assert len(model) == 3 and min(model) >= 0 and sum(model) > 0, cal
    assert "PASS" in proc.stdout or "FAIL" in proc.stdout


def _rec(comm, balance, rep, k, rank, t0, t1, compute, cpu, busy_est=0.0, samples=1, tokens=10, stolen=0,
         throttled=False):
    return {"comm": comm, "balance": balance, "minibatch": 1, "rep": rep, "k": k, "rank": rank, "t_start": t0,
            "t_end": t1, "compute": compute, "opt": [t1, t1], "samples": samples, "tokens": tokens, "loss": 1.0,
            "n_micro": len(compute), "busy_est": busy_est, "cpu": cpu, "stolen": stolen, "throttled": throttled}


def test_summarize_arithmetic():
    from jaxodc.bench.train_report import summarize
    recs = []
    for rep, scale in ((0, 1.0), (1, 2.0)):  # repetition 1 runs on a machine twice as slow
        # collective: both ranks' intervals cover the whole 4 s (lock-step); rank 1 used the CPU for
        # 2 s of it (blocked in the collectives the rest), the cost model says 3 s.
        # ODC: rank 0 busy 2 of 2 s, rank 1 busy 1 of 2 s (CPU time and intervals agree).
        for rank, cpu, est in ((0, 4.0, 4.0), (1, 2.0, 3.0)):
            recs.append(_rec("collective", "lb_micro", rep, 0, rank, 0.0, 4.0 * scale, [[0.0, 4.0 * scale]],
                             cpu * scale, est * scale))
        recs.append(_rec("odc", "lb_mini", rep, 0, 0, 10.0, 10.0 + 2.0 * scale, [[10.0, 10.0 + 2.0 * scale]], 2.0 * scale))
        recs.append(_rec("odc", "lb_mini", rep, 0, 1, 10.0, 10.0 + 2.0 * scale, [[10.0, 10.0 + scale]], scale))
        recs.append(_rec("odc", "lb_steal", rep, 0, 0, 20.0, 20.0 + 1.0 * scale, [[20.0, 21.0]], scale, stolen=rep))
        recs.append(_rec("odc", "lb_steal", rep, 0, 1, 20.0, 20.0 + 1.0 * scale, [[20.0, 21.0]], scale))
    rows, bars = summarize({"records": recs})
    cell = {(r["comm"], r["balance"]): r for r in rows}
    coll, mini, steal = cell[("collective", "lb_micro")], cell[("odc", "lb_mini")], cell[("odc", "lb_steal")]
    # 2 samples per block; spans 4 and 8 s -> 0.5 and 0.25 samples/s, median 0.375
    assert coll["samples_per_s"] == pytest.approx(0.375)
    assert coll["bubble_rate"] == pytest.approx(0.25) and coll["bubble_source"] == "cpu time"
    assert coll["bubble_intervals"] == pytest.approx(0.0)  # waiting inside the collectives looks busy
    assert coll["bubble_model"] == pytest.approx(0.125)
    assert mini["bubble_rate"] == pytest.approx(0.25) and mini["bubble_intervals"] == pytest.approx(0.25)
    # ratios are per repetition (paired): 2x in both repetitions
    by = {(b["bar"], b["minibatch"]): b for b in bars}
    assert by[("odc+lb_mini / collective+lb_micro samples/s", 1)]["value"] == pytest.approx(2.0)
    assert by[("odc+lb_steal / odc+lb_mini samples/s", 1)]["value"] == pytest.approx(2.0)
    assert by[("odc+lb_steal / odc+lb_mini samples/s", 1)]["pass"] is True
    # the whole run: 4 samples in 1 + 2 s against 2 + 4 s; a steal in repetition 1 only
    assert steal["samples_per_s_pooled"] == pytest.approx(4 / 3) and mini["samples_per_s_pooled"] == pytest.approx(4 / 6)
    assert by[("odc+lb_steal / odc+lb_mini samples/s", 1)]["pooled"] == pytest.approx(2.0)
    assert (steal["steals"], steal["minibatches_with_steals"], mini["minibatches_with_steals"]) == (1, 1, 0)
    assert by[("odc+lb_mini / collective+lb_micro samples/s", 1)]["pass"] is None  # bar only at minibatch 4
    # 2x in every repetition: the paired bootstrap's 95% interval collapses onto it
    assert by[("odc+lb_mini / collective+lb_micro samples/s", 1)]["ci95"] == pytest.approx([2.0, 2.0])
    assert all(r["end_s"] is None and r["ceiling"] is None for r in rows)  # records without end_s, no run config


def test_injected_bars_take_the_whole_run():
    """Under injection the bar is the whole run's throughput ratio: a slowdown in one repetition
    of three moves it, where the median of per-repetition ratios would not."""
    from jaxodc.bench.train_report import summarize
    recs = []
    for rep, slow in ((0, 1.0), (1, 1.0), (2, 4.0)):  # repetition 2: LB-Mini's minibatch 4x longer
        for rank in (0, 1):
            for (comm, bal), span in ((("odc", "lb_mini"), slow), (("odc", "lb_steal"), 1.0),
                                      (("collective@jaxodc", "lb_micro"), 1.0)):
                r = _rec(comm, bal, rep, 0, rank, 0.0, span, [[0.0, span]], span, throttled=rank == 0 and rep == 2)
                recs.append(dict(r, minibatch=4, straggle="rank_p=0.1,factor=3,seed=0"))
    spec = "rank_p=0.1,factor=3,seed=0"
    _, bars = summarize({"records": recs}, [{"straggle": spec, "minibatch": 4, "expected_steal": 2.4}])
    (steal,) = [b for b in bars if b["bar"].startswith("odc+lb_steal / odc+lb_mini") and b["minibatch"] == 4]
    assert steal["median"] == pytest.approx(1.0) and steal["value"] == pytest.approx(6 / 3)
    # the bar: 75% of the simulator's expected gain, 1 + 0.75 * (2.4 - 1) = 2.05 > 2.0
    assert steal["threshold"] == pytest.approx(2.05) and steal["pass"] is False
    assert steal["minibatches_throttled"] == 1
    _, bars = summarize({"records": recs}, [{"straggle": spec, "minibatch": 4, "expected_steal": 2.2}])
    (steal,) = [b for b in bars if b["bar"].startswith("odc+lb_steal / odc+lb_mini") and b["minibatch"] == 4]
    assert steal["threshold"] == pytest.approx(1.9) and steal["pass"] is True
    _, bars = summarize({"records": recs})  # no prediction, no bar
    (steal,) = [b for b in bars if b["bar"].startswith("odc+lb_steal / odc+lb_mini") and b["minibatch"] == 4]
    assert steal["threshold"] is None and steal["pass"] is None


def test_activation_bytes_scale_with_tokens():
    import jax
    from jaxodc.bench.train import row_buckets
    from jaxodc.bench.train_memory import activation_bytes
    from jaxodc.models.lm import LM, LMConfig
    model = LM(LMConfig(d_model=32, n_layers=2, n_heads=2))
    shape = jax.eval_shape(model.init, jax.random.PRNGKey(0))
    a64, a256 = activation_bytes(model, shape, 64), activation_bytes(model, shape, 256)
    # at least one [T, d] fp32 carry per unit boundary, and growing with T (attention: faster than T)
    assert a64["activations"] >= 64 * 32 * 4 * 3
    assert a256["activations"] > 4 * a64["activations"]
    assert a64["temp_w1_1token"] == a256["temp_w1_1token"]
    assert row_buckets(512, 64) == [64, 128, 256, 512] and row_buckets(100, 64) == [64, 100]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_memory_run_reports_both_trainers(tmp_path):
    out = tmp_path / "memory.json"
    cmd = [sys.executable, "-m", "jaxodc", "bench", "train", "--memory", "--memory-ranks", "2", "--memory-d-model", "64",
           "--memory-layers", "2", "--memory-steps", "1", "--json", str(out), "--timeout", "400"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=450)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert sorted((r["comm"], r["ranks"]) for r in rows) == [("collective", 2), ("odc", 2)]
    for r in rows:
        assert r["peak"] == max(r["peak_rss"], r["peak_xla"]) > 0 and r["bound"] > r["S_over_W"] > 0, r


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_compress_run_records_every_run_and_bar(tmp_path):
    out, png = tmp_path / "compress.json", tmp_path / "loss.png"
    cmd = [sys.executable, "-m", "jaxodc", "bench", "train", "--compress", "default", "--link-mbps", "400",
           "--compress-steps", "3", "--d-model", "128", "--layers", "1", "--max-tokens", "128", "--json", str(out),
           "--loss-png", str(png),
           "--timeout", "400"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=450)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    runs = [r for r in rows if r["kind"] == "train"]
    assert sorted((r["comm"], r["compress"] or "") for r in runs) == [
        ("collective", ""), ("collective", "default"), ("odc", ""), ("odc", "default")]
    for r in runs:
        assert r["steps"] == 3 and r["samples_per_s"] > 0 and 0 < r["wire_bytes_selected"] < r["wire_bytes"]
        assert r["link_mbps"] == (400.0 if r["comm"] == "odc" else None)
        assert (r["kept_fraction"] is None) == (r["compress"] is None)
    odc = {r["compress"]: r for r in runs if r["comm"] == "odc"}
    assert odc[None]["wire_bytes_selected"] > 4 * odc["default"]["wire_bytes_selected"]
    assert len([r for r in rows if r["kind"] == "bar"]) == 8 and png.stat().st_size > 0
    (cfg,) = [r for r in rows if r["kind"] == "config"]
    assert cfg["workload"]["minibatches"] == 3 and cfg["workload"]["max_tokens"] == 128
    assert cfg["config"]["d_model"] == 128 and cfg["workload"]["params"] > cfg["workload"]["selected_elems"] > 0


def test_compress_has_its_own_workload_and_wire_share():
    """--compress resolves its own model and lengths (explicit options still win); the ODC rows' wire
    share is the slowest rank's gathered + pushed bytes at the link's rate over the minibatch span."""
    from jaxodc.bench import train_compress as tc
    from jaxodc.bench.train import COMPRESS_WORKLOAD, WORKLOAD, _args
    plain, comp = _args([]), _args(["--compress", "default", "--layers", "1"])
    assert {k: getattr(plain, k) for k in WORKLOAD} == WORKLOAD
    assert (comp.d_model, comp.layers, comp.max_tokens) == (COMPRESS_WORKLOAD["d_model"], 1,
                                                           COMPRESS_WORKLOAD["max_tokens"])
    args = _args(["--compress", "default", "--link-mbps", "8", "--compress-steps", "12"])  # 1 MB/s
    recs = []
    for name in ("odc+lb_mini", "odc+lb_mini compressed", "collective+lb_micro", "collective+lb_micro compressed"):
        push = 100_000 if name == "odc+lb_mini" else 40_000
        for step in range(12):
            for rank in (0, 1):  # rank 1: 2 microbatches, 2 s span per minibatch
                recs.append({"run": name, "step": step, "rank": rank, "t_start": 10.0 * step, "t_end": 10.0 * step + 2,
                             "samples": 4, "loss": 3.0 - 0.1 * step, "wire_bytes": push, "wire_bytes_selected": push // 2,
                             "kept_fraction": None if "compressed" not in name else 0.05, "peeled": 7, "estimated": 0,
                             "n_micro": 1 + rank})
    rows, bars = tc.summarize({"records": recs, "gather_bytes_per_microbatch": 500_000}, args)
    odc = {r["compress"]: r for r in rows if r["comm"] == "odc"}
    assert odc[None]["wire_share"] == pytest.approx((2 * 500_000 + 100_000) / 1e6 / 2)
    assert odc[None]["gather_bytes"] == 3 * 500_000 and odc["default"]["wire_share"] < odc[None]["wire_share"]
    assert all(r["wire_share"] is None and r["gather_bytes"] is None for r in rows if r["comm"] == "collective")
    got = {b["bar"]: b for b in bars}
    assert got["odc dense / compressed bytes on the wire (gathers + gradients)"]["value"] == pytest.approx(
        (1_500_000 + 200_000) / (1_500_000 + 80_000))
    assert got["collective |final loss compressed / dense - 1|"]["pass"] is True  # barred for both comms


def test_straggle_predict_orders_its_bounds():
    """The simulator's replay of a run's minibatches: LB-Steal <= the clairvoyant assignment <=
    the fluid bound (ratios over LB-Mini), on the run's minibatches and in expectation over fresh ones;
    with a rank throttled in every minibatch, stealing gains in both."""
    from jaxodc.bench.straggle_predict import predict
    from jaxodc.bench.train import _args
    cfg = {k: v for k, v in vars(_args(["--minibatch", "4", "--reps", "2", "--block-samples", "8"])).items()
           if k not in ("worker", "out")}
    specs = ["rank_p=0.1,factor=3,seed=0", "p=0.2,factor=3,seed=1", "factor=2,rank=1,window=0:100,seed=0"]
    raw = {"config": cfg, "cost": [2.1e-7, 3.1e-4, 0.019],
           "records": [{"rank": r, "straggle": s} for r in (0, 1) for s in specs]}
    got = {p["straggle"]: p for p in predict(raw, expect_minibatches=50)}
    assert sorted(got) == sorted(specs) and all(p["minibatch"] == 4 for p in got.values())
    for p in got.values():
        assert p["steal"] <= p["clairvoyant"] * (1 + 1e-9) <= p["fluid"] * (1 + 1e-9), p
        assert p["expected_steal"] <= p["expected_clairvoyant"] * (1 + 1e-9) and p["expected_minibatches"] == 50, p
    throttled = got["factor=2,rank=1,window=0:100,seed=0"]
    assert throttled["steal"] > 1.1
    # the window covers the run's minibatch numbers only: the fresh ones, far past it, see no throttle
    assert throttled["expected_steal"] == pytest.approx(1.0, abs=0.05)
    assert got["rank_p=0.1,factor=3,seed=0"]["expected_steal"] > 1.02  # one minibatch in five throttled


@pytest.mark.parametrize("own_lengths", [False, True])
def test_ceilings_replay_the_runs_own_minibatches(own_lengths):
    """`ceiling` is the simulator's odc+lb_mini / collective+lb_micro time ratio over exactly the
    minibatches the run drew (every repetition's), with the run's calibrated ODC cost model, on
    the run's recorded sample lengths (--task: the tokenized JSONL's), else the preset's."""
    import numpy as np
    from jaxodc.balance.cost import CostModel
    from jaxodc.balance.plan import make_plan
    from jaxodc.balance.simulate import plan_times
    from jaxodc.bench.train import _args
    from jaxodc.bench.train_report import ceilings
    from jaxodc.data import synthetic_text
    cfg = {k: v for k, v in vars(_args(["--reps", "2", "--minibatch", "2,4", "--pool", "64", "--max-tokens", "256",
                                        "--block-samples", "4"])).items() if k not in ("worker", "out")}
    cost = [1e-9, 2e-6, 1e-4]
    raw = {"config": cfg, "cost": cost, "records": [{"rank": 0}, {"rank": 1}]}
    if own_lengths:
        lengths = np.random.default_rng(7).integers(4, 257, 64)
        raw["lengths"] = lengths.tolist()
    else:
        lengths = synthetic_text("longalign", 64, 256, seed=1, min_len=8).lengths
    got = ceilings(raw)
    model = CostModel(*cost)
    for mb in (2, 4):
        t = {"odc": 0.0, "collective": 0.0}
        for rep in range(2):  # bench train's draw: ceil(block / mb) minibatches of W * mb samples
            k = -(-4 // mb)
            idx = np.random.default_rng([0, rep, mb]).choice(64, size=k * 2 * mb, replace=False)
            for i in range(k):
                lens = lengths[idx[i * 2 * mb:(i + 1) * 2 * mb]].tolist()
                t["odc"] += plan_times(make_plan("lb_mini", lens, 2, 256, model), model, "odc")[0]
                t["collective"] += plan_times(make_plan("lb_micro", lens, 2, 256, model), model, "collective")[0]
        assert got[mb] == pytest.approx(t["collective"] / t["odc"]) and got[mb] >= 1.0


TASK_ARGS = ["--d-model", "16", "--layers", "1", "--heads", "2", "--max-tokens", "256", "--min-bucket", "256",
             "--reps", "1", "--block-samples", "1", "--calib-reps", "1", "--pool", "32", "--minibatch", "1,4"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("task", ["sft", "grpo"])
def test_tiny_task_run_trains_the_generated_checkpoint(tmp_path, task):
    """--task: every combo trains the generated HF checkpoint (each rank reading its own ranges)
    with the task's objective. The first minibatch's loss of each trainer's first run (nothing
    trained yet) equals the task loss computed here from the whole checkpoint on those samples."""
    import numpy as np
    from jaxodc.balance.packing import pack
    from jaxodc.bench.train import COMBOS, _args, task_workload
    from jaxodc.modeling.hf_load import load_hf
    from jaxodc.modeling.rl import GRPO
    out = tmp_path / "train.json"
    cmd = [sys.executable, "-m", "jaxodc", "bench", "train", "--task", task, "--json", str(out), "--timeout", "400"]
    proc = subprocess.run(cmd + TASK_ARGS, cwd=ROOT, capture_output=True, text=True, timeout=450)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads(out.read_text())
    train = [r for r in records if r["kind"] == "train"]
    assert sorted((r["comm"], r["balance"], r["minibatch"]) for r in train) == sorted(
        (c, b, mb) for c, b in COMBOS for mb in (1, 4))
    assert {r["transport"] for r in train} == {"gloo", "jaxodc"}
    for r in train:
        assert math.isfinite(r["samples_per_s"]) and r["samples_per_s"] > 0 and math.isfinite(r["loss"]), r
        assert r["ceiling"] is not None and r["ceiling"] >= 1.0, r
    names = {(b["bar"], b["minibatch"]) for b in records if b["kind"] == "bar"}
    assert ("odc+lb_mini / collective@jaxodc+lb_micro samples/s", 4) in names

    # the reference: the same checkpoint and samples, the whole model in this process
    args = _args(["--task", task] + TASK_ARGS)
    _, _, samples, fields = task_workload(args, 1, str(tmp_path))
    ck = load_hf(str(tmp_path / "model"))
    params = ck.params()
    idx = np.random.default_rng([0, 0, 1]).choice(len(samples), size=2, replace=False)  # bench's first minibatch
    total = count = 0.0
    for i in idx:
        batch = pack([samples.tokens[int(i)]], 256, fields=fields).as_dict()
        apply = lambda b: ck.model.apply(params, b)  # noqa: E731 - per-token cross entropy x loss_mask
        total += float(GRPO().linen_loss(apply, batch) if task == "grpo" else apply(batch).sum())
        count += float(batch["loss_mask"].sum())
    first = {(r["comm"], r["balance"]): r["loss"] for r in train if r["minibatch"] == 1}
    for combo in (("collective", "local_sort"), ("collective@jaxodc", "lb_micro"), ("odc", "local_sort")):
        assert first[combo] == pytest.approx(total / count, rel=1e-4), (combo, first, total / count)
