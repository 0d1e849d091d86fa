#!/usr/bin/env bash
# Session 16's device call for PDL rule 3 (issues 14 and 18): GPU tests of the fused kernels, then W3 of the 8B
# shape (32 layers, bf16) and the decode graph replay of an 8-layer Qwen3-30B-A3B shape, the revision in .old/
# against this tree, alternating (scripts/decode_ablation.py, base only). Logs under $OUT; a table last.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
bash scripts/gpu_run.sh none > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/old ./.old > "$OUT/old_install.log" 2>&1 \
  || { tail -5 "$OUT/old_install.log"; exit 1; }
timeout "${TESTS_TIMEOUT:-170}" python3 -m pytest -q -m gpu tests/test_fused_kernels.py -rfE --tb=short -p no:cacheprovider \
  2>&1 | grep -v "rope_parameters\|Loading weights" > "$OUT/gpu_fused_tests.log"
tail -3 "$OUT/gpu_fused_tests.log"
ab() {  # tag, then decode_ablation arguments
  local tag=$1; shift
  for i in 1 2; do
    ABLATION_SITE=/tmp/old python3 scripts/decode_ablation.py "$@" --variants base --out "$OUT" > "$OUT/${tag}_old_$i.log" 2>&1
    python3 scripts/decode_ablation.py "$@" --variants base --out "$OUT" > "$OUT/${tag}_new_$i.log" 2>&1
  done
}
ab l8b --family llama3-8b --num-layers 32 --checkpoint /dev/shm/l8b-32l --repeats 2
ab q3 --family qwen3-30b-a3b --num-layers 8 --checkpoint /dev/shm/q3-8l
for f in "$OUT"/l8b_*.log "$OUT"/q3_*.log; do printf "%-40s " "$(basename $f)"; grep "^base " "$f" | head -1; done
