#!/usr/bin/env bash
# One device call (issue 14): the int4 decode GEMV's pipelined K loop (GemvConfig.loop_stages) swept into the tile
# table, then AWQ W3 of the 8B shape with the table before and after, alternating in fresh processes.
#   bash scripts/int4_pipeline_run.sh [ROUNDS]
# Logs, the new table and a summary under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
rounds=${1:-2}
bash scripts/gpu_run.sh none > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
table=kernels/quant_gemv_configs.py
cp "$table" /tmp/table_before.py
timeout 120 python3 -m pytest -q -m gpu tests/test_gpu_quant.py -k "gemv_tiles" -p no:cacheprovider 2>&1 \
  | grep -v "rope_parameters" > "$OUT/gpu_tests.log"; tail -2 "$OUT/gpu_tests.log"
timeout 300 python3 -m loadtest.bench_kernels --gemv-sweep --formats int4 --ms 1 --budget-s 200 --write-table \
  > "$OUT/sweep_int4_m1.txt" 2>&1
grep -A3 "^int4 .* M=1" "$OUT/sweep_int4_m1.txt" | grep -v "^--"; grep "best per path" "$OUT/sweep_int4_m1.txt"
cp "$table" /tmp/table_after.py; cp "$table" "$OUT/quant_gemv_configs_after.py"
args=(--family llama3-8b --num-layers 32 --checkpoint /dev/shm/l8b-32l --quantization awq --repeats 2
      --variants base --out "$OUT")
for i in $(seq "$rounds"); do
  for side in before after; do
    cp "/tmp/table_$side.py" "$table"
    timeout 200 python3 scripts/decode_ablation.py "${args[@]}" > "$OUT/w3_awq_${side}_$i.log" 2>&1
  done
done
cp /tmp/table_after.py "$table"
for f in "$OUT"/w3_awq_*.log; do printf "%-22s %s\n" "$(basename "$f")" "$(grep "^base " "$f" | head -1)"; done
