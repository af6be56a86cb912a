"""`jaxodc bench models` on its smallest configuration (record fields, bars evaluated -- not the
bar values: memory bars are the benchmark's), and the gathered-units count on a hand-made schedule."""
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = {"model", "comm", "precision", "ranks", "steps", "loss_single", "loss_sharded", "max_param_diff",
          "peak_bytes", "bound_bytes", "gathered_peak_units"}


def test_smallest_run_writes_records_and_bars(tmp_path):
    out = tmp_path / "models.json"
    cmd = [sys.executable, "-m", "jaxodc", "bench", "models", "--models", "mlp", "--comms", "odc",
           "--precisions", "fp32,bf16", "--steps", "1", "--microbatches", "1", "--json", str(out), "--timeout", "240"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)  # generous: two cores shared with other work
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads(out.read_text())
    runs = [r for r in records if r.get("kind") != "bar"]
    assert sorted((r["model"], r["comm"], r["precision"]) for r in runs) == [("mlp", "odc", "bf16"), ("mlp", "odc", "fp32")]
    for r in runs:
        assert FIELDS <= set(r), FIELDS - set(r)
        assert r["ranks"] == 2 and r["steps"] == 1
        assert all(math.isfinite(r[k]) for k in ("loss_single", "loss_sharded", "max_param_diff"))
        assert r["peak_bytes"] > 0 and r["bound_bytes"] > 0 and r["gathered_peak_units"] >= 1
    bars = {(b["bar"], b["precision"]) for b in records if b.get("kind") == "bar"}
    assert bars == {("fp32 loss = single-process (relative)", "fp32"), ("bf16 peak <= bound (bytes)", "bf16"),
                    ("gathered units alive <= 2", "fp32"), ("gathered units alive <= 2", "bf16")}
    assert all(isinstance(b["met"], bool) and b["ratio"] >= 0 for b in records if b.get("kind") == "bar")
    assert proc.stdout.count("bar ") == 3 and ("-> met" in proc.stdout or "NOT met" in proc.stdout)


HLO = """HloModule m, is_scheduled=true

ENTRY %main (s0: f32[4], s1: f32[4], x: f32[2,8], v: s32[]) -> f32[2,8] {
  %s0 = f32[4]{0} parameter(0)
  %s1 = f32[4]{0} parameter(1)
  %x = f32[2,8]{1,0} parameter(2)
  %v = s32[] parameter(3)
  %g0 = f32[8]{0} custom-call(%s0, %v), custom_call_target="jaxodc_odc_gather"
  %w0 = f32[8]{0} fusion(%g0, %v), kind=kLoop, calls=%f0
  %h0 = f32[2,8]{1,0} fusion(%x, %w0), kind=kLoop, calls=%f1
  %g1 = f32[8]{0} custom-call(%s1, %v), custom_call_target="jaxodc_odc_gather"
  %g2 = f32[8]{0} custom-call(%s1, %v), custom_call_target="jaxodc_odc_gather"
  %h1 = f32[2,8]{1,0} fusion(%h0, %g1), kind=kLoop, calls=%f2
  %c2 = f32[8]{0} convert(%g2)
  ROOT %out = f32[2,8]{1,0} fusion(%h1, %c2, %h0), kind=kLoop, calls=%f3
}
"""


def test_gathered_units_follow_the_schedule():
    from jaxodc.bench.models import gathered_peak_units
    # g0 ends at h0 (h0 mixes in an activation, so it is not the unit); g1 and g2 overlap.
    assert gathered_peak_units(HLO) == (2, 3)
    late = HLO.replace("%out = f32[2,8]{1,0} fusion(%h1, %c2, %h0)", "%out = f32[2,8]{1,0} fusion(%h1, %c2, %w0)")
    assert gathered_peak_units(late) == (3, 3)  # g0's slice kept to the end: all three alive there
    # a gather into one buffer per parameter: a tuple, its elements held until their last use
    pieces = HLO.replace('%g1 = f32[8]{0} custom-call(%s1, %v), custom_call_target="jaxodc_odc_gather"',
                         '%t1 = (f32[4]{0}, f32[4]{0}) custom-call(%s1, %v), custom_call_target="jaxodc_odc_gather_pieces"\n'
                         '  %g1 = f32[4]{0} get-tuple-element(%t1), index=1')
    assert gathered_peak_units(pieces) == (2, 3)


def test_lockstep_gathers_are_counted():
    from jaxodc.bench.models import gathered_peak_units
    # jaxodc's lock-step collective (one custom call for every kind): a gather is larger out than in
    lock = HLO.replace('custom_call_target="jaxodc_odc_gather"', 'custom_call_target="jaxodc_lockstep"')
    assert gathered_peak_units(lock) == (2, 3)
    scatter = lock + '%fused { %r = f32[4]{0} custom-call(%g), custom_call_target="jaxodc_lockstep" }\n'
    try:  # a lock-step call outside ENTRY: refused, not undercounted
        gathered_peak_units(scatter)
        raise AssertionError("expected a refusal")
    except RuntimeError as e:
        assert "outside the step's ENTRY" in str(e)


def test_lockstep_bytes_is_the_segment_mapped():
    from jaxodc.bench.train_memory import lockstep_bytes
    from jaxodc.comm.lockstep import Channel, LockstepGroup
    chs = [Channel("gather", 1000, "a"), Channel("scatter", 777, "b"), Channel("reduce", 1, "c")]
    with LockstepGroup(chs, rank=0, world=1, allgather=lambda b: [b], job_id=f"t{os.getpid()}") as g:
        sizes = [int(b, 16) - int(a, 16) for a, b in
                 (line.split()[0].split("-") for line in open("/proc/self/maps") if f"t{os.getpid()}_lockstep" in line)]
        assert sizes == [lockstep_bytes(g)], (sizes, lockstep_bytes(g))
