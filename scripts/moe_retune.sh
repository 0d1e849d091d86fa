#!/usr/bin/env bash
# One device call (issue 18): re-sweep the MoE decode tiles at batch 1 on this GPU, then W3/W1 of the
# Qwen3-30B-A3B shape with the table as committed and with the sweep's batch-1 winner, in that order, on one
# checkpoint (scripts/moe_w3.sh, without transformers). Logs under $OUT.
# Usage: bash scripts/moe_retune.sh [sweep budget seconds, default 150]
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader
python3 -m loadtest.bench_kernels --moe-decode --tokens 1 2>&1 | tee "$OUT/moe_decode_before.txt" | tail -6
python3 -m loadtest.bench_kernels --moe-sweep --tokens 1 --budget-s "${1:-150}" 2>&1 | tee "$OUT/moe_sweep.txt" | tail -4
winner=$(grep -A1 "^winners" "$OUT/moe_sweep.txt" | grep "(2048, 768, 8, 1)")
[[ -n $winner ]] || echo "no batch-1 winner: the committed table only"
PEERS=0 W1_REQUESTS=200 MOE_WINNER="$winner" bash scripts/moe_w3.sh
