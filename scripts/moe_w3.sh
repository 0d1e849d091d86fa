#!/usr/bin/env bash
# One device call (issue 18): the Qwen3-30B-A3B shape end to end on one checkpoint, transformers and the engine in
# the same run. Builds the checkpoint in /dev/shm, runs transformers (W3 and W1 within HF_BUDGET_S seconds, default
# 90; skipped with PEERS=0), then the engine of an older revision unpacked in .old/ (`bash scripts/prepare_old.sh
# REV`, carried; skipped when absent) and of this tree, each W3 then W1 (W1_REQUESTS, default 100). With
# MOE_WINNER set to a line of kernels/moe_configs.py's TUNED table (a sweep's winner), this tree also runs with that
# line written into the table. Logs and JSON under $OUT; a table of W3 and W1 last.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
ckpt=/dev/shm/q3
common=(--family qwen3-30b-a3b --checkpoint "$ckpt" --moe-w1-requests "${W1_REQUESTS:-100}")
python3 -m loadtest.bench_offline "${common[@]}" --moe-part build --out "$OUT" > "$OUT/moe_build.log" 2>&1 \
  || { tail -20 "$OUT/moe_build.log"; exit 1; }
if [[ ${PEERS:-1} == 1 ]]; then
  python3 -m loadtest.bench_offline "${common[@]}" --moe-part peers --hf-budget-s "${HF_BUDGET_S:-90}" --out "$OUT" \
    2>&1 | grep -v "rope_parameters\|Loading weights" > "$OUT/moe_peers.log"
fi
run_engine() {  # name, then the python path to put first ('' for this tree)
  local name=$1 path=$2
  mkdir -p "$OUT/$name"
  cp "$OUT"/bench_offline_qwen3-30b-a3b_peers.json "$OUT/$name/" 2>/dev/null
  local dir=.; [[ -n $path ]] && dir=/tmp  # from /tmp, `asyncengine.loadtest` is the old revision's
  (cd "$dir" && PYTHONPATH=${path:+$path:}${PYTHONPATH:-} python3 -m ${path:+asyncengine.}loadtest.bench_offline \
    "${common[@]}" --moe-part engine --out "$OUT/$name") 2>&1 | grep -v "rope_parameters\|Loading weights" \
    > "$OUT/moe_$name.log"
  echo "== $name"; grep -A8 "^NVIDIA\|^W3\b" "$OUT/moe_$name.log" | tail -9
}
if [[ -d .old ]]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/old ./.old \
    > "$OUT/old_install.log" 2>&1 && run_engine before /tmp/old
fi
run_engine after ""
if [[ -n ${MOE_WINNER:-} ]]; then
  python3 -c "import sys; from loadtest.bench_gemv import write_table; write_table([sys.argv[1]], 'kernels/moe_configs.py')" \
    "$MOE_WINNER" && git diff --stat kernels/moe_configs.py && run_engine swept ""
fi
