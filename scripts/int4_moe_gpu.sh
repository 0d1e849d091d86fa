#!/usr/bin/env bash
# One device call (issues 14 and 18): the MoE layer's decode kernels at the Qwen3-30B-A3B expert shape on bf16
# experts and on int4 ones (groups of 128), T = $TOKENS (default 1 4), then the int4 tile sweep (winners for
# moe_configs.TUNED_INT4) within SWEEP_BUDGET seconds (default 300; 0: none). Logs under $OUT; a short table last.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
read -r -a tokens <<< "${TOKENS:-1 4}"
python3 -m loadtest.bench_kernels --moe-decode --tokens "${tokens[@]}" > "$OUT/moe_decode_bf16.txt" 2>&1
python3 -m loadtest.bench_kernels --moe-decode --int4 --tokens "${tokens[@]}" > "$OUT/moe_decode_int4.txt" 2>&1
if [[ ${SWEEP_BUDGET:-300} != 0 ]]; then
  python3 -m loadtest.bench_kernels --moe-sweep --int4 --tokens ${SWEEP_TOKENS:-1 4 8} --budget-s "${SWEEP_BUDGET:-300}" \
    > "$OUT/moe_sweep_int4.txt" 2>&1
  sed -n '/^winners/,$p' "$OUT/moe_sweep_int4.txt"
fi
for f in bf16 int4; do
  echo "== $f"; grep "copy\|experts:\|layer:" "$OUT/moe_decode_$f.txt"
done
