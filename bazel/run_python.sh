#!/bin/bash
# Runs a Python script with the interpreter found by //bazel:configure.bzl: run_python.sh PYTHON SCRIPT ARGS...
set -euo pipefail
python="$1"
shift
export JAX_PLATFORMS=cpu PYTHONNOUSERSITE=1 PYTHONDONTWRITEBYTECODE=1
exec "$python" "$@"
