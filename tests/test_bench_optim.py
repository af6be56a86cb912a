"""`jaxodc bench optim` on its smallest configuration: one chain with a global reduction (clipping),
ODC at 2 ranks, 2 minibatches: the record's fields, the comparison with single-process Optax, the bar
evaluated and printed."""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELDS = {"optimizer", "comm", "ranks", "max_abs_diff", "moved", "end_s", "peak_rss", "met"}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_smallest_run_writes_a_record_and_the_bar(tmp_path):
    out = tmp_path / "optim.json"
    cmd = [sys.executable, "-m", "jaxodc", "bench", "optim", "--optimizers", "clip_by_global_norm", "--comms", "odc",
           "--ranks", "2", "--steps", "2", "--json", str(out), "--timeout", "300"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (rec,) = json.loads(out.read_text())
    assert FIELDS <= set(rec), FIELDS - set(rec)
    assert (rec["optimizer"], rec["comm"], rec["ranks"]) == ("clip_by_global_norm", "odc", 2)
    assert math.isfinite(rec["max_abs_diff"]) and rec["moved"] > 0 and rec["end_s"] > 0 and rec["peak_rss"] > 0
    assert rec["met"] and rec["max_abs_diff"] <= 1e-3 * rec["moved"], rec
    assert "bar max_abs_diff <= 0.001 * moved: 1 of 1 met" in proc.stdout
