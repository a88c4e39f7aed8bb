#!/usr/bin/env bash
# The CUDA checks in one run: CUDA tests, verify on the GPU, the GPU bench (float32 and bfloat16,
# batch 256, and the hub graphs) and the notebooks, everything written under one folder. The
# whole run is bounded to 10 minutes: each step gets what is left of that budget (a step cut off
# by it counts as failed, and the steps after it are skipped).
#
#   bash scripts/gpu_check.sh [OUT]        (default OUT: results/gpu)
#
# Needs a CUDA build of torch and fovi_ref importable (pip install -e . --no-deps).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-results/gpu}
mkdir -p "$out/notebooks"
export PYTHONUNBUFFERED=1
status=0
deadline=$((SECONDS + ${GPU_CHECK_BUDGET_S:-600}))
run() {  # run a step, keep its log, remember a failure, go on with the next step
  local name=$1; shift
  local left=$((deadline - SECONDS))
  if ((left <= 0)); then status=1; echo "== $name: SKIPPED (the 10-minute budget is spent)"; return; fi
  echo "== $name: $* (at most $left s)"
  local t0=$SECONDS
  timeout --kill-after=10 "$left" "$@" >"$out/$name.log" 2>&1 \
    || { status=1; echo "   FAILED or cut off (see $out/$name.log)"; }
  tail -n 3 "$out/$name.log"
  echo "   $((SECONDS - t0)) s"
}
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())" \
  | tee "$out/device.txt" || exit 1
run tests python -m pytest -q -p no:cacheprovider tests
run verify python -m fovi_ref --out "$out" verify --device cuda
run bench_float32 python -m fovi_ref --out "$out/float32" bench --device cuda --dtypes float32 --batch 256
run bench_bfloat16 python -m fovi_ref --out "$out/bfloat16" bench --device cuda --dtypes bfloat16 --batch 256
run bench_hub python -m fovi_ref --out "$out" bench --device cuda --hub --dtypes float32
run notebooks jupyter nbconvert --to notebook --execute --output-dir "$out/notebooks" \
  --ExecutePreprocessor.timeout=600 notebooks/*.ipynb
exit $status
