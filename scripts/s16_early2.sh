#!/usr/bin/env bash
# Session 16's second device call for PDL rule 3: the decode graph replay of a 16-layer Qwen3-30B-A3B shape and W3 of
# the 8B shape with --quantization fp8 (32 layers), .old/ against this tree, alternating. Logs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
bash scripts/gpu_run.sh none > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/old ./.old > "$OUT/old_install.log" 2>&1 \
  || { tail -5 "$OUT/old_install.log"; exit 1; }
ab() {  # tag, rounds, then decode_ablation arguments
  local tag=$1 rounds=$2; shift 2
  for i in $(seq "$rounds"); do
    ABLATION_SITE=/tmp/old python3 scripts/decode_ablation.py "$@" --variants base --out "$OUT" > "$OUT/${tag}_old_$i.log" 2>&1
    python3 scripts/decode_ablation.py "$@" --variants base --out "$OUT" > "$OUT/${tag}_new_$i.log" 2>&1
  done
}
ab q3x16 2 --family qwen3-30b-a3b --num-layers 16 --checkpoint /dev/shm/q3-16l
ab l8bfp8 1 --family llama3-8b --num-layers 32 --checkpoint /dev/shm/l8b-32l --quantization fp8 --repeats 2
for f in "$OUT"/q3x16_*.log "$OUT"/l8bfp8_*.log; do printf "%-22s " "$(basename $f)"; grep "^base " "$f" | head -1; done
