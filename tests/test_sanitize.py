"""The native listeners under AddressSanitizer + UndefinedBehaviorSanitizer (slow: builds the extension
again): scripts/sanitize.sh builds jaxodc._C with JAXODC_SANITIZE=1 aside and runs the listener
fuzzer's native job (ODC tcp server, lock-step tcp links, ring endpoint) with libasan preloaded; it
fails on any sanitizer report, crash, admitted case or disturbed result."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the sanitized build alone takes minutes on two cores
def test_native_listener_fuzz_under_asan_and_ubsan(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, CASES="400", STEPS="6")
    p = subprocess.run([os.path.join(ROOT, "scripts", "sanitize.sh"), str(tmp_path)], cwd=ROOT, env=env,
                       text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=3600)
    assert p.returncode == 0, p.stdout[-4000:]
    recs = {r["listener"]: r for r in json.load(open(tmp_path / "fuzz.json"))}
    assert {"odc_tcp", "ring"} <= set(recs)
    for r in recs.values():
        assert r["cases"] > 0 and r["rejected"] == r["cases"] and r["crashes"] == 0 and r["same_params"], r
    assert not list(tmp_path.glob("asan.*")) and not list(tmp_path.glob("ubsan.*"))
