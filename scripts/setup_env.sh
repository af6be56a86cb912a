#!/usr/bin/env bash
# Creates/updates .venv with everything jaxodc needs and builds its native extension.
# Idempotent: a second run only checks stamps (a few seconds). Source it or run it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"

pick_python() {
  for cand in python3.12 "$HOME/.pyenv/versions/"3.12*/bin/python3.12 /usr/bin/python3.12 python3.13 python3.11 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$cand"; return 0
    fi
  done
  echo "jaxodc: no Python >= 3.11 found" >&2; return 1
}

if [ ! -x "$VENV/bin/python" ]; then
  PY="$(pick_python)"
  echo "jaxodc setup: creating .venv with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"

# Python packages (CUDA 13.0 compiler wheels, versions matched, so CUDA code always compiles).
REQS="$ROOT/scripts/requirements.txt"
STAMP="$VENV/.jaxodc-reqs"
if ! cmp -s "$REQS" "$STAMP" 2>/dev/null; then
  echo "jaxodc setup: installing Python packages"
  $PIP install -q --upgrade pip
  $PIP install -q -r "$REQS"
  cp "$REQS" "$STAMP"
fi

# Native extension (and the nvshmem plugin): rebuilt when any source, the build script or the
# requirements (which bring the nvcc and NVSHMEM wheels) changed; --force, because setuptools
# compares the sources alone and would skip a change to a header.
SRC_HASH=$(cd "$ROOT" && find csrc setup.py bazel/discover.py scripts/requirements.txt -type f \( -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.inc' -o -name 'setup.py' -o -name 'discover.py' -o -name 'requirements.txt' \) -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
BUILD_STAMP="$VENV/.jaxodc-build"
if [ "$(cat "$BUILD_STAMP" 2>/dev/null)" != "$SRC_HASH" ] || ! ls "$ROOT"/jaxodc/_C*.so >/dev/null 2>&1; then
  echo "jaxodc setup: building the native extension"
  (cd "$ROOT" && "$VENV/bin/python" setup.py -q build_ext --inplace --force -j 2 >/tmp/jaxodc-build.log 2>&1) || {
    tail -50 /tmp/jaxodc-build.log; echo "jaxodc setup: native build FAILED" >&2; exit 1; }
  echo "$SRC_HASH" > "$BUILD_STAMP"
fi
# The checkout itself is the installed package (in-place build): put it on the venv's path.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[ -f "$SITE/jaxodc-checkout.pth" ] && [ "$(cat "$SITE/jaxodc-checkout.pth")" = "$ROOT" ] || echo "$ROOT" > "$SITE/jaxodc-checkout.pth"
# The console script [project.scripts] declares (jaxodc = jaxodc.cli:main): pip writes it when it
# installs the package, but the checkout is on the path through the .pth above, so write it here
# (only when it differs), so that README's `jaxodc ...` commands run once .venv/bin is on the PATH.
# -P: the working directory is not put on sys.path, as with pip's scripts.
SCRIPT="$VENV/bin/jaxodc"
WANT="$(printf '#!/usr/bin/env bash\n# jaxodc console script, written by scripts/setup_env.sh (checkout: %s)\nexec %q -P -m jaxodc "$@"\n' "$ROOT" "$VENV/bin/python")"
if [ "$(cat "$SCRIPT" 2>/dev/null)" != "$WANT" ]; then
  printf '%s\n' "$WANT" > "$SCRIPT"
fi
[ -x "$SCRIPT" ] || chmod +x "$SCRIPT"
