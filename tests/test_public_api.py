"""The package's public names: importing jaxodc stays light, and every exported name resolves."""
import subprocess
import sys


def test_import_is_light_and_every_name_resolves():
    code = ("import sys, jaxodc\n"
            "assert 'jax' not in sys.modules, 'import jaxodc pulled in jax'\n"
            "missing = [n for n in jaxodc.__all__ if getattr(jaxodc, n, None) is None]\n"
            "assert not missing, missing\n"
            "try:\n    jaxodc.no_such_name\nexcept AttributeError as e:\n    assert 'no_such_name' in str(e)\n"
            "else:\n    raise AssertionError('unknown attribute did not raise')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
