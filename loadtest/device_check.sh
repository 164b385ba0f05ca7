#!/usr/bin/env bash
# Issue 18's device check, for a lent GPU machine; everything it measures goes under $OUT.
#
#   here:   bash loadtest/device_wheels.sh    # once: the wheels the device's image lacks, into .whl/
#   there:  the device tool's run, command "bash loadtest/device_check.sh", carry [".whl"], timeout 600
#
# Steps, each bounded in time (510 s together, inside the device's 600 s a run), each logged to $OUT/STEP.log with its exit code in $OUT/summary.txt:
#   1. the engine's exactness tests on the GPU (against transformers on the CPU), and the KV cache sized by
#      --gpu-memory-utilization with CUDA's own memory measure;
#   2. bench_engine at 100m (the launch-bound size last measured) and at 1b (a step reads ~3.9 GB of float32
#      weights: the decode roofline, achieved bytes/s against the GPU's peak, in $OUT/roofline.json).
# DEVICE=cpu QUICK=1 runs the same steps small on the CPU, to try the script anywhere.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" SPLITSERVE_CACHE_DIR=${SPLITSERVE_CACHE_DIR:-/tmp/splitserve-cache}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
if [ "${QUICK:-0}" = 1 ]; then big=tiny; small=tiny; bench=(--requests 4); else big=1b; small=100m; bench=(); fi

step() {  # step NAME SECONDS COMMAND...
  local name=$1 seconds=$2; shift 2
  echo "== $name"
  timeout "$seconds" "$@" > "$OUT/$name.log" 2>&1
  local code=$?
  tail -n 5 "$OUT/$name.log"
  echo "$name: exit $code" | tee -a "$OUT/summary.txt"
}

"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__);
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')" | tee "$OUT/device.txt"
nvidia-smi >> "$OUT/device.txt" 2>&1

step exactness 180 env SPLITSERVE_TEST_DEVICE="$DEVICE" "$PY" -m pytest -q -p no:cacheprovider \
  tests/engine/test_exactness.py tests/engine/test_memory_budget.py
step "engine-$small" 120 "$PY" -m loadtest.bench_engine --preset "$small" --device "$DEVICE" "${bench[@]}" \
  --output "$OUT/engine-$small.json"
step "engine-$big" 180 "$PY" -m loadtest.bench_engine --preset "$big" --device "$DEVICE" --requests 8 \
  --output "$OUT/engine-$big.json"
step roofline 30 "$PY" -m loadtest.decode_roofline "$OUT/engine-$big.json" --output "$OUT/roofline.json"
cat "$OUT/summary.txt"
