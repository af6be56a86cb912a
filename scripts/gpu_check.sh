#!/usr/bin/env bash
# The GPU check, run on a machine with a CUDA GPU from the repo root (logs go to $OUT, default
# ./gpu_check_out): versions, the extension built in place with CUDA by the machine's python3, the
# GPU tests of the paths that never ran on a GPU before (Pallas segment attention, gather_pieces /
# range push handlers), issue 32's attention sweep and benchmark, then the rest of tests/gpu. Every
# step runs under its own time limit and the script goes on past a failed step; summary.txt has
# each step's status. The whole fits GPU_CHECK_BUDGET_S (default 420 s): the older tests get what
# is left.
# Attention only (issue 32, about 8 minutes): GPU_CHECK_ATTENTION=only builds the extension without
# CUDA (the CPU kernel is the tests' reference) and runs the block / crossover sweep
# ($OUT/attention_sweep.json, the table entries to paste in attention_sweep.log), `bench/attention.py
# --gpu` with the sweep's tables ($OUT/attention_gpu.json, bars at the end of bench_attention.log),
# then tests/gpu/test_attention_gpu.py in what is left of GPU_CHECK_BUDGET_S.
# Knobs: GPU_CHECK_BUILD=0 skips the build (e.g. an extension carried in), GPU_CHECK_REST=0 the
# older GPU tests, GPU_CHECK_BENCH=0 the attention sweep and benchmark, GPU_CHECK_SWEEP_REPS the sweep's
# repetitions (default 5; 3 measured the H200 tables); JAXODC_NVSHMEM=0 skips the
# nvshmem plugin.
set -x
set -o pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the multi-process tests share the one GPU
unset JAX_PLATFORMS  # the attention tests compare the GPU with the CPU backend of the same process
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
START=$(date +%s)

step() {  # step NAME LIMIT_S CMD...: runs CMD, tees its output to $OUT/NAME.log, records its status
  local name=$1 limit=$2
  shift 2
  local t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "$name: rc=$rc ($(( $(date +%s) - t0 )) s$([ "$rc" = 124 ] && echo ", TIMED OUT after $limit s"))" | tee -a "$SUMMARY"
}

BUDGET="${GPU_CHECK_BUDGET_S:-420}"
left() { echo $(( BUDGET - ($(date +%s) - START) )); }

step versions 30 bash -c "nvidia-smi; $PY --version; $PY -c 'import jax, jaxlib; print(\"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__); print(jax.devices())'; $PY -m pip list 2>/dev/null | grep -i -E 'jax|nvidia|pytest|nanobind|flax|optax'"

ONLY_ATTENTION=$([ "${GPU_CHECK_ATTENTION:-}" = only ] && echo 1 || echo 0)
if [ "${GPU_CHECK_BUILD:-1}" != 0 ]; then
  if [ "$ONLY_ATTENTION" = 1 ]; then
    step build 150 env JAXODC_CUDA=0 "$PY" setup.py build_ext --inplace -j 16
  else
    # sm_90 only (H100 / H200): half the nvcc time of the default 80;90.
    step build 210 env JAXODC_CUDA=1 JAXODC_CUDA_ARCHS="${JAXODC_CUDA_ARCHS:-90}" "$PY" setup.py build_ext --inplace -j 16
  fi
fi
if [ "$ONLY_ATTENTION" = 1 ]; then
  :  # the sweep and the records first (the figures the issue asks for), the tests in what is left
else
  step extension 30 "$PY" -c "import jaxodc, jaxodc._C as c; print(jaxodc.__file__, 'with_cuda', c.with_cuda); assert c.with_cuda, 'the extension was built without CUDA'"
  # New paths first, without -x so one failure does not hide the others; -s shows the COST lines.
  step tests_new 200 "$PY" -m pytest -m gpu -v -s -rA --timeout 300 -p no:cacheprovider \
    --junitxml="$OUT/tests_new.xml" tests/gpu/test_attention_gpu.py tests/gpu/test_odc_pieces_gpu.py
fi

if [ "${GPU_CHECK_BENCH:-1}" != 0 ]; then
  # Issue 32: block sizes and the Pallas / dense crossover per head size and dot mode (prints the
  # attention_policy entries to paste), then the records and bars with those entries loaded.
  step attention_sweep 200 "$PY" bench/attention.py --gpu --sweep --T 8192 --H 8 --heads 64,128 --reps "${GPU_CHECK_SWEEP_REPS:-5}" \
    --tables-out "$OUT/attention_sweep.json"
  TABLES=$([ -s "$OUT/attention_sweep.json" ] && echo "--tables $OUT/attention_sweep.json")
  step bench_attention 150 "$PY" bench/attention.py --gpu --T 8192 --samples 1,8,64 --H 8 --Dh 64 --reps 5 \
    $TABLES --json "$OUT/attention_gpu.json"
fi

if [ "$ONLY_ATTENTION" = 1 ] && [ "$(left)" -le 10 ]; then
  echo "tests_attention: skipped ($(left) s of the budget left)" | tee -a "$SUMMARY"
elif [ "$ONLY_ATTENTION" = 1 ]; then
  step tests_attention "$(( $(left) < 180 ? $(left) : 180 ))" "$PY" -m pytest -m gpu -v -s -rA --timeout 300 \
    -p no:cacheprovider tests/gpu/test_attention_gpu.py  # no junit xml: 8 files come back from a lent GPU
  echo "tests_rest: skipped (GPU_CHECK_ATTENTION=only)" | tee -a "$SUMMARY"
elif [ "${GPU_CHECK_REST:-1}" != 0 ] && [ "$(left)" -gt 30 ]; then
  step tests_rest "$(left)" "$PY" -m pytest -m gpu -v -rA --timeout 300 -p no:cacheprovider \
    --junitxml="$OUT/tests_rest.xml" tests/gpu --ignore=tests/gpu/test_attention_gpu.py \
    --ignore=tests/gpu/test_odc_pieces_gpu.py
else
  echo "tests_rest: skipped ($(left) s of the budget left)" | tee -a "$SUMMARY"
fi

echo "total: $(( $(date +%s) - START )) s" | tee -a "$SUMMARY"
cat "$SUMMARY"
