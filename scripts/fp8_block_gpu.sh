#!/usr/bin/env bash
# One device call (issue 14, block-wise FP8): the GPU tests of block-wise FP8 (dense at the 8B sizes, the engine on
# a block-wise checkpoint, FP8 experts at Mixtral / Qwen3-30B-A3B shapes) and of the FP8 decode GEMV paths they
# share, and online FP8's peak GPU memory while loading (TESTS=none: skipped; TESTS_K: another -k selection); then `bench_offline --quant --quick`
# on the formats in $FORMATS (default: fp8 fp8-block; none: tests only).
# Optional MOE_LAYERS=N: the Qwen3-30B-A3B shape at N layers in the formats of $MOE_FORMATS (default: bf16 fp8-block;
# awq too), the engine alone. Logs under $OUT.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
bash scripts/gpu_run.sh none > /dev/null 2>&1
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
if [[ ${TESTS:-} != none ]]; then
  timeout "${TESTS_TIMEOUT:-170}" python3 -m pytest -q -m gpu tests/test_gpu_quant.py tests/test_kernels.py -k \
    "${TESTS_K:-block_wise or decode_gemv or fp8_words or online_fp8 or fp8_experts or int4_experts or fused_moe_at_real or never_holds}" \
    -p no:cacheprovider -rfE --tb=short 2>&1 | grep -v "rope_parameters\|Loading weights" > "$OUT/gpu_tests.log"
  tail -4 "$OUT/gpu_tests.log"
  grep -q " passed" "$OUT/gpu_tests.log" || echo "GPU TESTS: NONE PASSED (none selected, or all failed)"
fi
if [[ ${FORMATS:-} != none ]]; then
  read -r -a formats <<< "${FORMATS:-fp8 fp8-block}"
  timeout "${BENCH_TIMEOUT:-330}" python3 -m loadtest.bench_offline --quant --quick --quant-formats "${formats[@]}" \
    --out "$OUT" 2>&1 | grep -v "rope_parameters\|Loading weights\|Writing model" > "$OUT/bench.log"
  tail -8 "$OUT/bench.log"
fi
# Optional, MOE_LAYERS=N: W3 / W1 of the Qwen3-30B-A3B shape at N layers per format, the engine alone
if [[ -n ${MOE_LAYERS:-} ]]; then
  for fmt in ${MOE_FORMATS:-bf16 fp8-block}; do
    flag=$([[ $fmt == bf16 ]] || echo "--moe-$fmt")
    timeout "${MOE_TIMEOUT:-240}" python3 -m loadtest.bench_offline --family qwen3-30b-a3b --num-layers "$MOE_LAYERS" \
      --checkpoint "/dev/shm/q3-${MOE_LAYERS}l" --skip-peers --quick $flag --out "$OUT" 2>&1 \
      | grep -v "rope_parameters\|Loading weights\|Writing model" > "$OUT/moe_$fmt.log"
    echo "$fmt"; grep "^W3\|^W1 (" "$OUT/moe_$fmt.log"
  done
fi
