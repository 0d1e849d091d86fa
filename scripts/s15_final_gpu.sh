#!/usr/bin/env bash
# Session 15, run 104: the GPU tests of the quantized paths and the fused kernels on the final tree, the start-up
# with recorded choices (scripts/startup_choices_check.py), and W1/W3 per format once more. Logs under $OUT.
set -uo pipefail
bash scripts/gpu_run.sh none > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 330 python3 -m pytest -q -m gpu tests/test_gpu_quant.py tests/test_fused_kernels.py tests/test_gpu_model.py \
  -p no:cacheprovider 2>&1 | grep -v "rope_parameters\|Loading weights\|Writing model" > "$OUT/run104-gpu_tests.log"
tail -3 "$OUT/run104-gpu_tests.log"
for q in fp8 none; do
  timeout 140 python3 scripts/startup_choices_check.py --quantization $q 2>&1 | grep -v "rope_parameters\|Loading weights" \
    | tee -a "$OUT/run104-startup_choices.txt" | tail -3
done
