#!/usr/bin/env bash
# One device call (issue 14): the int4 GEMV's GPU tests, then the dense int4 decode GEMV at M = 1
# (`bench_kernels --gemv-sweep --formats int4 --ms 1`
# within SWEEP_BUDGET seconds, default 150; its winners written into the table as rows of this GPU), then AWQ
# W3 (`bench_offline --quant --quant-formats awq --quick`) of this tree, then of an older revision unpacked in .old/
# (`bash scripts/prepare_old.sh REV`, carried; skipped when absent). Each step is cut after STEP_TIMEOUT seconds
# (default 600). TESTS_K: the GPU tests' -k expression (default: the int4 GEMV's tiles, the MMA path's included);
# SWEEP_ONLY=FLAG: sweep only that path's candidates beside each shape's table row (`--only`, e.g. mma);
# SWEEP_MS: the sweep's M values (default 1; 1,8 for the MMA path's two keys); MMA_QUICK=1: first
# `scripts/int4_mma_quick.py` (the MMA path's hand-picked tiles against the table's rows, ~1 minute).
# Logs under $OUT; a table last.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
step=(timeout "${STEP_TIMEOUT:-600}")
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
# correctness first: every int4 GEMV tile of the GPU tests (load_ahead among them) against the reference
"${step[@]}" python3 -m pytest -q -m gpu tests/test_gpu_quant.py -k "${TESTS_K:-int4_gemv_tiles or int4_at_llama or int4_mma}" \
  -p no:cacheprovider > "$OUT/gpu_tests_int4_gemv.txt" 2>&1
tail -2 "$OUT/gpu_tests_int4_gemv.txt"
if [[ -n "${MMA_QUICK:-}" ]]; then  # the MMA path's hand-picked tiles against the table's rows, before any sweep
  "${step[@]}" python3 scripts/int4_mma_quick.py --ms 1,8 > "$OUT/int4_mma_quick.txt" 2>&1
  cut -c1-150 "$OUT/int4_mma_quick.txt"
fi
"${step[@]}" python3 -m loadtest.bench_kernels --gemv-sweep --formats int4 --ms "${SWEEP_MS:-1}" \
  --budget-s "${SWEEP_BUDGET:-150}" ${SWEEP_ONLY:+--only "$SWEEP_ONLY"} --write-table > "$OUT/gemv_sweep_int4.txt" 2>&1
cp kernels/quant_gemv_configs.py "$OUT/"  # the winners written as rows of this GPU: this tree's W3 below takes them
sed -n "/^winners/,\$p" "$OUT/gemv_sweep_int4.txt"
w3=(--quant --quant-formats awq --quick --skip-peers)
"${step[@]}" python3 -m loadtest.bench_offline "${w3[@]}" --out "$OUT/after" 2>&1 \
  | grep -v "rope_parameters\|Loading weights" > "$OUT/awq_after.log"
echo "== after"; grep -A4 "^NVIDIA" "$OUT/awq_after.log"
if [[ -d .old ]]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/old ./.old \
    > "$OUT/old_install.log" 2>&1
  (cd /tmp && PYTHONPATH=/tmp/old${PYTHONPATH:+:$PYTHONPATH} "${step[@]}" python3 -m asyncengine.loadtest.bench_offline \
    "${w3[@]}" --out "$OUT/before" 2>&1 | grep -v "rope_parameters\|Loading weights" > "$OUT/awq_before.log")
  echo "== before"; grep -A4 "^NVIDIA" "$OUT/awq_before.log"
fi
