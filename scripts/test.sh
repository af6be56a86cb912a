#!/usr/bin/env bash
# The test command: sets up .venv, runs the CPU test suite and the offline bazel build + test.
# Exits non-zero (and says so in the last line) if anything failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh || { echo "TESTS FAILED: environment setup failed"; exit 1; }
PY="$ROOT/.venv/bin/python"

start=$(date +%s)
"$PY" -m pytest tests -m "not gpu" -q -p no:cacheprovider --durations=15 "$@"
pytest_status=$?
echo "pytest finished with status $pytest_status in $(( $(date +%s) - start )) s"

JAXODC_PYTHON="$PY" bash bazel/ci.sh
bazel_status=$?

if [ $pytest_status -ne 0 ] || [ $bazel_status -ne 0 ]; then
  echo "TESTS FAILED: pytest status $pytest_status, bazel status $bazel_status"
  exit 1
fi
echo "ALL TESTS PASSED (pytest and bazel)"
