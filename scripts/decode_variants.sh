#!/usr/bin/env bash
# One device call (issues 14 and 18): scripts/decode_ablation.py's variants on several checkpoints, per spec "TAG
# SECONDS DECODE_ABLATION_ARGS..." (each spec killed after SECONDS), the variants from $VARIANTS (default: base,
# nowait_gemv, nowait_all, base: how much any overlap of the step's kernels could save). Optional, first:
# GPU_TESTS="pytest args" (-m gpu is not added: name the tests). Logs and JSON under $OUT; every spec's table last.
#   VARIANTS="base first_tile_after_wait base first_tile_after_wait" bash scripts/decode_variants.sh \
#       "bf16 150 --family llama3-8b --num-layers 8 --checkpoint /dev/shm/l8b-8l"
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
bash scripts/gpu_run.sh none > /dev/null 2>&1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
read -r -a variants <<< "${VARIANTS:-base nowait_gemv nowait_all base}"
if [[ -n ${GPU_TESTS:-} ]]; then
  eval "test_args=($GPU_TESTS)"
  timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q "${test_args[@]}" -rfE --tb=short -p no:cacheprovider 2>&1 \
    | grep -v "rope_parameters\|Loading weights" > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log"
  grep -q " passed" "$OUT/gpu_tests.log" || echo "GPU TESTS: NONE PASSED (none selected, or all failed)"
fi
for spec in "$@"; do
  read -r -a words <<< "$spec"
  tag=${words[0]} seconds=${words[1]}
  start=$(date +%s)
  timeout "$seconds" python3 scripts/decode_ablation.py "${words[@]:2}" --out "$OUT" --variants "${variants[@]}" \
    2>&1 | grep -v "rope_parameters\|Loading weights" > "$OUT/$tag.log"
  echo "$tag: $(( $(date +%s) - start )) s" >> "$OUT/times.txt"
done
cat "$OUT/times.txt"
for spec in "$@"; do
  read -r -a words <<< "$spec"
  echo "== ${words[0]}"; sed -n '/^NVIDIA\|^variant/,$p' "$OUT/${words[0]}.log"
  grep -i "failed\|error" "$OUT/${words[0]}.log" | head -5
done
