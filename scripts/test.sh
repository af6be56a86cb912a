#!/usr/bin/env bash
# The test command: sets up .venv, runs the CPU test suite and the offline bazel build + test.
# Exits non-zero (and says so in the last line) if anything failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup_env.sh || { echo "TESTS FAILED: environment setup failed"; exit 1; }
PY="$ROOT/.venv/bin/python"

# The tests on emulated hosts (test_cluster, test_faults, test_multihost: network namespaces, veth
# links, tc, iptables) need root and these tools; installed here as bazel/ci.sh installs bazel, and
# those tests then fail rather than skip if hosts still cannot be made (tests/support/emulated_hosts.py).
if [ "$(id -u)" = 0 ]; then
  missing=()
  for tool in ip:iproute2 tc:iproute2 iptables:iptables nsenter:util-linux unshare:util-linux mount:mount; do
    command -v "${tool%%:*}" >/dev/null || missing+=("${tool##*:}")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "jaxodc tests: installing ${missing[*]} (emulated hosts)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && \
      apt-get install -y -q "${missing[@]}" >/dev/null 2>&1; } || {
      echo "TESTS FAILED: apt-get install ${missing[*]} failed (needed by the tests on emulated hosts)"; exit 1; }
  fi
  export JAXODC_REQUIRE_HOSTS=1
fi

# One jax compilation cache for the whole run, fresh each time: the tests' processes compile many
# of the same programs (the same small models on 1-3 ranks), and a hit skips XLA's compile.
CACHE="$(mktemp -d "${TMPDIR:-/tmp}/jaxodc-test-cache.XXXXXX")"
trap 'rm -rf "$CACHE"' EXIT
export JAX_COMPILATION_CACHE_DIR="$CACHE" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
       JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0

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
