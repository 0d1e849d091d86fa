#!/usr/bin/env bash
# One device call: the revision unpacked in .old/ (`bash scripts/prepare_old.sh REV`, carried with .whl) against this
# tree, each in fresh processes, alternating: the decode step's graph replay and W3 through scripts/decode_ablation.py
# (base only), per spec "TAG ROUNDS DECODE_ABLATION_ARGS...". Optional, first: GPU_TESTS="pytest args" (this tree;
# quotes as in a shell: GPU_TESTS="tests/test_gpu_model.py -k 'batching or lookahead'"),
# MOE_DECODE=1 (`bench_kernels --moe-decode --tokens 1`, old then new). Logs under $OUT; a table of the base rows last.
#   bash scripts/decode_before_after.sh "l8b 2 --family llama3-8b --num-layers 32 --checkpoint /dev/shm/l8b-32l \
#       --repeats 2" "q3 2 --family qwen3-30b-a3b --num-layers 8 --checkpoint /dev/shm/q3-8l"
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
bash scripts/gpu_run.sh none > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/old ./.old \
  > "$OUT/old_install.log" 2>&1 || { tail -5 "$OUT/old_install.log"; exit 1; }
if [[ -n ${GPU_TESTS:-} ]]; then
  # GPU_TESTS is pytest's arguments as a shell would read them, quotes included (-k 'a or b')
  eval "test_args=($GPU_TESTS)"
  timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -m gpu "${test_args[@]}" -rfE --tb=short -p no:cacheprovider \
    2>&1 | grep -v "rope_parameters\|Loading weights" > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log"
  # a selection that runs nothing must not read as green (run 127's "-k a_or_b" deselected every test)
  grep -q " passed" "$OUT/gpu_tests.log" || echo "GPU TESTS: NONE PASSED (none selected, or all failed)"
fi
if [[ ${MOE_DECODE:-0} == 1 ]]; then
  (cd /tmp && PYTHONPATH=/tmp/old:/tmp/site python3 -m asyncengine.loadtest.bench_kernels --moe-decode --tokens 1) \
    > "$OUT/moe_decode_old.txt" 2>&1
  python3 -m loadtest.bench_kernels --moe-decode --tokens 1 > "$OUT/moe_decode_new.txt" 2>&1
  for side in old new; do echo "== moe-decode T=1, $side"; grep "^  1 " "$OUT/moe_decode_$side.txt"; done
fi
for spec in "$@"; do
  read -r -a words <<< "$spec"
  tag=${words[0]} rounds=${words[1]}
  for i in $(seq "$rounds"); do
    ABLATION_SITE=/tmp/old python3 scripts/decode_ablation.py "${words[@]:2}" --variants base --out "$OUT" \
      > "$OUT/${tag}_old_$i.log" 2>&1
    python3 scripts/decode_ablation.py "${words[@]:2}" --variants base --out "$OUT" > "$OUT/${tag}_new_$i.log" 2>&1
  done
done
for f in "$OUT"/*_old_*.log "$OUT"/*_new_*.log; do
  [[ -e $f ]] && printf "%-24s %s\n" "$(basename "$f")" "$(grep "^base " "$f" | head -1)"
done
