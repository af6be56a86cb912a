"""`jaxodc bench compile` runs and writes one record per depth, one unit per layer plus the rest."""
import json
import subprocess
import sys


def test_bench_compile_records(tmp_path):
    out = tmp_path / "compile.json"
    subprocess.run([sys.executable, "-m", "jaxodc", "bench", "compile", "--layers", "2,3", "--d-model", "16",
                    "--tokens", "4", "--json", str(out)], check=True, timeout=300)
    records = json.loads(out.read_text())
    assert [r["layers"] for r in records] == [2, 3]
    assert [r["units"] for r in records] == [3, 4]  # one unit per layer, one for the rest (embedding = tied head, final norm)
    assert all(r["sharded_compile_s"] > 0 and r["plain_compile_s"] > 0 for r in records)
