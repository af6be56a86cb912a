"""The wheel a user installs: `python -m build` gives one with the native extension inside and no
top-level package but `jaxodc`; installed into a fresh virtualenv, `jaxodc demo` runs from a
directory outside the repository and writes where it is told."""
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd, cwd, timeout, env=None):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_wheel_installs_alone_and_the_demo_runs_outside_the_repo(tmp_path):
    dist = tmp_path / "dist"
    # --no-isolation: the build uses this interpreter's setuptools, nanobind, jax and nvcc wheels.
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist)], ROOT, 900)
    (wheel,) = dist.glob("jaxodc-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"jaxodc"}, tops
    assert any(n.startswith("jaxodc/_C") and n.endswith(".so") for n in names), "no native extension in the wheel"
    for module in ("jaxodc/models/lm.py", "jaxodc/bench/train.py", "jaxodc/py.typed"):
        assert module in names, module

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, 120)
    py = str(venv / "bin" / "python")
    _run([py, "-m", "pip", "install", "-q", f"{wheel}[plots]"], tmp_path, 900)
    work = tmp_path / "elsewhere"
    work.mkdir()
    # The user's own `models` package must not shadow jaxodc's example models.
    (work / "models").mkdir()
    (work / "models" / "__init__.py").write_text("raise ImportError('the user models package was imported')\n")
    out = _run([str(venv / "bin" / "jaxodc"), "demo", "--steps", "1", "--minibatch", "2", "--max-tokens", "128",
                "--d-model", "32", "--layers", "1", "--out", "demo_out"], str(work), 600,
               env={"PYTHONPATH": "", "JAX_PLATFORMS": "cpu"})
    assert "samples/s" in out and "odc" in out, out
    assert (work / "demo_out" / "demo.json").stat().st_size > 0
    assert (work / "demo_out" / "demo_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
