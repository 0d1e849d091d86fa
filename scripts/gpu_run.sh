#!/usr/bin/env bash
# One device call: install, GPU tests, offline benchmark. Logs under $OUT (or ./gpu_out).
# Usage: bash scripts/gpu_run.sh [tests|bench|all] [extra bench args]
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
what=${1:-all}; shift || true
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
rc=0
if [[ $what == tests || $what == all ]]; then
  timeout 400 python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_gpu_model.py -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
  rc=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all ]]; then
  python3 -m loadtest.bench_offline --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v Warning | tail -30
fi
exit $rc
