#!/usr/bin/env bash
# Session 15, run 101: the fused FP8 input copies on the GPU: their tests, then the eager step's host time
# (bf16, FP8 with the copies, FP8 quantizing per product). Logs under $OUT.
set -uo pipefail
bash scripts/gpu_run.sh none > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -m gpu tests/test_gpu_quant.py tests/test_fused_kernels.py -k "fp8 or pdl" \
  -p no:cacheprovider 2>&1 | grep -v "rope_parameters\|Loading weights\|Writing model" > "$OUT/run101-gpu_tests_fp8.log"
tail -4 "$OUT/run101-gpu_tests_fp8.log"
for args in "" "--quantization fp8" "--quantization fp8 --separate-quant"; do
  timeout 150 python3 scripts/fp8_eager_host_profile.py $args 2>&1 | grep -v "rope_parameters\|Loading weights" \
    >> "$OUT/run101-eager_host_profile.txt"
done
grep "launch()" "$OUT/run101-eager_host_profile.txt"
