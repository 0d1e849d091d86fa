#!/usr/bin/env bash
# Session 16's third device call for PDL rule 3: GPU tests of the FP8 copies and fused kernels, then W3 of the 8B
# shape (32 layers) with --quantization fp8 (two rounds) and in bf16 (one), .old/ against this tree, alternating.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
bash scripts/gpu_run.sh none > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/old ./.old > "$OUT/old_install.log" 2>&1 \
  || { tail -5 "$OUT/old_install.log"; exit 1; }
timeout 150 python3 -m pytest -q -m gpu tests/test_gpu_quant.py tests/test_fused_kernels.py -k "copy or fused or pdl or norm or silu" \
  -rfE --tb=short -p no:cacheprovider 2>&1 | grep -v "rope_parameters\|Loading weights" > "$OUT/gpu_tests.log"
tail -3 "$OUT/gpu_tests.log"
ab() {  # tag, rounds, then decode_ablation arguments
  local tag=$1 rounds=$2; shift 2
  for i in $(seq "$rounds"); do
    ABLATION_SITE=/tmp/old python3 scripts/decode_ablation.py "$@" --variants base --out "$OUT" > "$OUT/${tag}_old_$i.log" 2>&1
    python3 scripts/decode_ablation.py "$@" --variants base --out "$OUT" > "$OUT/${tag}_new_$i.log" 2>&1
  done
}
ab fp8 2 --family llama3-8b --num-layers 32 --checkpoint /dev/shm/l8b-32l --quantization fp8 --repeats 2
ab bf16 1 --family llama3-8b --num-layers 32 --checkpoint /dev/shm/l8b-32l --repeats 2
for f in "$OUT"/fp8_*.log "$OUT"/bf16_*.log; do printf "%-16s " "$(basename $f)"; grep "^base " "$f" | head -1; done
