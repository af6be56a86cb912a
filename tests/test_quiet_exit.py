"""A process that dies of a Python exception while it still holds native objects (here kept alive
by a daemon thread, as a communicator peer's are when it times out) prints the exception and
nothing from nanobind about leaked objects."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import os, threading, time
from jaxodc.comm.ring import RingEndpoint
from jaxodc.odc import Runtime

endpoint = RingEndpoint(secret=b"quiet", timeout_s=5)
runtime = Runtime([10], rank=0, world=1, rendezvous=None, job_id="quiet%d" % os.getpid())
threading.Thread(target=lambda *held: time.sleep(60), args=(endpoint, runtime), daemon=True).start()
raise RuntimeError("peer 3 timed out")
"""


def test_exception_exit_prints_traceback_without_leak_reports():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback (most recent call last)" in proc.stderr, proc.stderr
    assert proc.stderr.rstrip().endswith("RuntimeError: peer 3 timed out"), proc.stderr
    assert "leaked" not in proc.stderr, proc.stderr
