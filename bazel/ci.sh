#!/bin/bash
# CI's bazel half: builds jaxodc's extension and runs the bazel tests offline with Debian's
# bazel-bootstrap. Usage: JAXODC_PYTHON=/path/to/venv/bin/python bazel/ci.sh
#   JAXODC_PYTHON   interpreter with jax and nanobind (default: python3 on PATH)
#   JAXODC_CUDA     0 builds without CUDA, 1 requires nvcc (default: CUDA when nvcc is found)
#   JAXODC_BAZEL_OUTPUT_USER_ROOT  bazel's --output_user_root (default: bazel's own, ~/.cache/bazel)
# Exits non-zero on the first failure; always shuts the bazel server down.
set -uo pipefail

cd "$(dirname "$0")/.."

say() { printf '\n=== bazel ci: %s\n' "$*"; }
die() { printf '\n=== bazel ci: FAILED: %s\n' "$*" >&2; exit 1; }

as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; elif command -v sudo >/dev/null; then sudo -n "$@"; else
    die "need root to run: $*"; fi
}

# Debian's bazel-bootstrap; `apt-get update` only when the package is not installable as is.
if ! command -v bazel >/dev/null; then
  say "installing bazel-bootstrap"
  export DEBIAN_FRONTEND=noninteractive
  if ! as_root apt-get install -y -q bazel-bootstrap; then
    as_root apt-get update -q || die "apt-get update"
    as_root apt-get install -y -q bazel-bootstrap || die "apt-get install bazel-bootstrap"
  fi
fi

if [ -z "${JAXODC_PYTHON:-}" ]; then
  JAXODC_PYTHON="$(command -v python3)" || die "set JAXODC_PYTHON or put python3 on PATH"
fi
export JAXODC_PYTHON
"$JAXODC_PYTHON" -c 'import jax, nanobind' || die "$JAXODC_PYTHON lacks jax or nanobind"
say "bazel $(dpkg-query -W -f='${Version}' bazel-bootstrap 2>/dev/null || echo '?'), python $JAXODC_PYTHON"

startup=()
if [ -n "${JAXODC_BAZEL_OUTPUT_USER_ROOT:-}" ]; then
  startup+=("--output_user_root=$JAXODC_BAZEL_OUTPUT_USER_ROOT")
fi
trap 'bazel "${startup[@]}" shutdown >/dev/null 2>&1 || true' EXIT
flags=(--color=no --curses=no "--repo_env=JAXODC_PYTHON=$JAXODC_PYTHON")

t0=$SECONDS
say "bazel build //..."
bazel "${startup[@]}" build "${flags[@]}" //... || die "bazel build //... (exit $?)"
say "build took $((SECONDS - t0)) s"

t1=$SECONDS
say "bazel test //..."
bazel "${startup[@]}" test "${flags[@]}" //... || die "bazel test //... (exit $?)"
say "tests took $((SECONDS - t1)) s"

say "OK (total $((SECONDS - t0)) s)"
