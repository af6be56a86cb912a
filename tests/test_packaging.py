"""What a user installs: `python -m build` gives a wheel with the native extension inside and no
top-level package but `jaxodc`; installed into a fresh virtualenv it gives a `jaxodc` command whose
demo runs from a directory outside the repository and writes where it is told."""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cmd, cwd, timeout, env=None):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_wheel_holds_only_jaxodc_and_installs_in_a_fresh_venv_where_the_demo_runs(tmp_path):
    """`python -m build` through the same setuptools backend `pip install .` uses (--no-isolation:
    this interpreter's setuptools and nanobind; pip's isolated build environment is pyproject's
    build requirements, not rebuilt here), on a copy of the tracked tree, then that wheel installed
    into a fresh virtualenv. The extension is the one scripts/setup_env.sh compiled from the same
    sources with the same setup.py: placed in the copy's build directory, newer than its sources,
    setuptools finds it up to date and packages it rather than compiling it again (minutes)."""
    src = tmp_path / "src"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, tracked.decode().split("\0")):
        path = os.path.join(ROOT, rel)
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        if os.path.islink(path):  # jaxodc/models and jaxodc/bench
            os.symlink(os.readlink(path), src / rel)
        elif os.path.isfile(path):
            shutil.copy2(path, src / rel)
    built = src / "build" / f"lib.{sysconfig.get_platform()}-{sys.implementation.cache_tag}" / "jaxodc"
    built.mkdir(parents=True)
    for so in glob.glob(os.path.join(ROOT, "jaxodc", "*.so")):
        shutil.copyfile(so, built / os.path.basename(so))
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist)], str(src), 900,
         env={"JAXODC_CUDA": "0"})
    (wheel,) = dist.glob("jaxodc-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert tops == {"jaxodc"}, tops
    assert any(n.startswith("jaxodc/_C") and n.endswith(".so") for n in names), "no native extension in the wheel"
    for module in ("jaxodc/models/lm.py", "jaxodc/bench/train.py", "jaxodc/py.typed"):
        assert module in names, module

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, 120)
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"{wheel}[plots]"], tmp_path, 900)
    work = tmp_path / "elsewhere"
    work.mkdir()
    # The user's own `models` package must not shadow jaxodc's example models.
    (work / "models").mkdir()
    (work / "models" / "__init__.py").write_text("raise ImportError('the user models package was imported')\n")
    out = _run([str(venv / "bin" / "jaxodc"), "demo", "--steps", "1", "--minibatch", "2", "--max-tokens", "128",
                "--d-model", "32", "--layers", "1", "--scale-minibatches", "1", "--out", "demo_out"], str(work), 600,
               env={"PYTHONPATH": "", "JAX_PLATFORMS": "cpu"})
    assert "samples/s" in out and "odc" in out, out
    assert "ODC + LB-Mini vs collective + LB-Micro:" in out and "(ceiling " in out, out
    assert "8 ranks, emulated compute: ODC + LB-Mini vs collective + LB-Micro:" in out, out
    assert (work / "demo_out" / "demo.json").stat().st_size > 0
    assert (work / "demo_out" / "demo_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_setup_env_installs_the_console_script(tmp_path):
    """scripts/setup_env.sh puts the checkout on the venv's path with a .pth, so no pip install
    writes `jaxodc` into .venv/bin: its last block does (idempotently). Run that block alone on a
    stand-in venv whose python is this interpreter (a path with a space in it)."""
    text = open(os.path.join(ROOT, "scripts", "setup_env.sh")).read()
    block = text[text.index("# The console script"):]
    venv = tmp_path / "a venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    script = ["bash", "-euc", f'ROOT={ROOT!r}; VENV={str(venv)!r}\n{block}']
    _run(script, tmp_path, 30)
    jaxodc = venv / "bin" / "jaxodc"
    stamp = jaxodc.stat().st_mtime_ns
    _run(script, tmp_path, 30)  # the second run leaves it as it is
    assert jaxodc.stat().st_mtime_ns == stamp and os.access(jaxodc, os.X_OK)
    out = _run([str(jaxodc), "train", "--help"], tmp_path, 60, env={"PYTHONPATH": ROOT})
    assert out.startswith("usage: jaxodc train") and "--reproducible" in out, out[:500]
