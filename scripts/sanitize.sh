#!/usr/bin/env bash
# The native listeners under AddressSanitizer + UndefinedBehaviorSanitizer: builds jaxodc._C with
# JAXODC_SANITIZE=1 into a scratch copy of the package (the checkout's module stays as it is) and runs
# the listener fuzzer's native job (ODC tcp server, lock-step tcp links, ring endpoint) and
# tests/test_native_auth.py under it, with libasan preloaded into the python processes. Exits non-zero on a sanitizer report, a crash, a case a
# listener let in, or a disturbed result.
#
#   scripts/sanitize.sh [OUT_DIR]        CASES=2000 STEPS=30 JOBS=2 PYTHON=.venv/bin/python
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
OUT=${1:-$(mktemp -d /tmp/jaxodc_sanitize.XXXXXX)}
CASES=${CASES:-2000}
STEPS=${STEPS:-30}
CXX=${CXX:-g++}
mkdir -p "$OUT/lib"
cd "$ROOT"
echo "sanitize: building jaxodc._C with ASan + UBSan into $OUT/lib (log: $OUT/build.log)"
JAXODC_SANITIZE=1 JAXODC_CUDA=0 "$PY" setup.py build_ext --build-lib "$OUT/lib" --build-temp "$OUT/temp" -j "${JOBS:-2}" \
  > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
# The Python package beside the sanitized module (links followed: jaxodc/bench is ../bench).
tar --exclude='_C*.so' --exclude='_nvshmem_plugin.so' --exclude='__pycache__' -chf - jaxodc | tar -C "$OUT/lib" -xf -
LIBASAN=$($CXX -print-file-name=libasan.so)
LIBUBSAN=$($CXX -print-file-name=libubsan.so)
echo "sanitize: fuzzing the native listeners ($CASES cases per listener) under $LIBASAN"
set +e
LD_PRELOAD="$LIBASAN $LIBUBSAN" \
ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0:abort_on_error=1:log_path="$OUT/asan" \
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:log_path="$OUT/ubsan" \
JAX_PLATFORMS=cpu PYTHONPATH="$OUT/lib" "$PY" -m jaxodc bench fuzz --jobs native --cases "$CASES" --steps "$STEPS" \
  --json "$OUT/fuzz.json" 2>&1 | tee "$OUT/fuzz.log"
rc=${PIPESTATUS[0]}
set -e
# The listener tests too (wrong secrets, the offset-wrap and huge-version pushes of an authenticated
# rank, idle and truncated connections at close), their ranks inheriting the preload.
mkdir -p "$OUT/tests"
cp -r tests/conftest.py tests/test_native_auth.py tests/support "$OUT/tests/"
set +e
(cd "$OUT" && LD_PRELOAD="$LIBASAN $LIBUBSAN" \
  ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0:abort_on_error=1:log_path="$OUT/asan" \
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:log_path="$OUT/ubsan" \
  JAX_PLATFORMS=cpu PYTHONPATH="$OUT/lib" "$PY" -m pytest -q -p no:cacheprovider tests/test_native_auth.py) \
  2>&1 | tee "$OUT/tests.log"
trc=${PIPESTATUS[0]}
set -e
reports=$(ls "$OUT"/asan.* "$OUT"/ubsan.* 2>/dev/null || true)
if [ -n "$reports" ]; then
  echo "sanitize: sanitizer reports:"; cat $reports; exit 1
fi
[ "$rc" -eq 0 ] || { echo "sanitize: the fuzzer exited $rc"; exit 1; }
[ "$trc" -eq 0 ] || { echo "sanitize: tests/test_native_auth.py failed under the sanitizers"; exit 1; }
"$PY" - "$OUT/fuzz.json" <<'PYEOF'
import json, sys
recs = json.load(open(sys.argv[1]))
bad = [r for r in recs if r["crashes"] or r["rejected"] != r["cases"] or not r["same_params"]]
for r in recs:
    print(f"  {r['listener']}: {r['cases']} cases, {r['rejected']} rejected, {r['crashes']} crashes, same: {r['same_params']}")
sys.exit(1 if bad or not recs else 0)
PYEOF
echo "sanitize: no report, no crash, every case rejected, results unchanged"
