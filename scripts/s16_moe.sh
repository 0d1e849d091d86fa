#!/usr/bin/env bash
# Session 16's device call for the MoE decode (issue 18): GPU tests of the MoE kernels and models, then the
# revision unpacked in .old/ (`bash scripts/prepare_old.sh REV`, carried) against this tree in one lease:
# `bench_kernels --moe-decode --tokens 1` each, and the batch-1 decode step's graph replay on an 8-layer
# Qwen3-30B-A3B-shape checkpoint (scripts/decode_ablation.py, base only), alternating old / new. ABLATE_NEW: extra
# variants for this tree's ablation (default none). Logs under $OUT; a table last.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
bash scripts/gpu_run.sh none > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/old ./.old > "$OUT/old_install.log" 2>&1 \
  || { tail -5 "$OUT/old_install.log"; exit 1; }
ckpt=/dev/shm/q3-8l
timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_gpu_model.py -k "moe or route" \
  -rfE --tb=short -p no:cacheprovider 2>&1 | grep -v "rope_parameters\|Loading weights" > "$OUT/gpu_moe_tests.log"
tail -3 "$OUT/gpu_moe_tests.log"
(cd /tmp && PYTHONPATH=/tmp/old:/tmp/site python3 -m asyncengine.loadtest.bench_kernels --moe-decode --tokens 1) \
  > "$OUT/moe_decode_old.txt" 2>&1
python3 -m loadtest.bench_kernels --moe-decode --tokens 1 > "$OUT/moe_decode_new.txt" 2>&1
for i in 1 2; do
  ABLATION_SITE=/tmp/old python3 scripts/decode_ablation.py --num-layers 8 --checkpoint $ckpt --variants base \
    --out "$OUT" > "$OUT/ablation_old_$i.log" 2>&1
  python3 scripts/decode_ablation.py --num-layers 8 --checkpoint $ckpt --variants base ${ABLATE_NEW:-} \
    --out "$OUT" > "$OUT/ablation_new_$i.log" 2>&1
done
echo "== moe-decode T=1, old | new"; paste <(grep "^  1 " "$OUT/moe_decode_old.txt" | cut -c1-70) \
  <(grep "^  1 " "$OUT/moe_decode_new.txt" | cut -c48-70)
for f in "$OUT"/ablation_*.log; do echo "== $f"; grep -A12 "^variant" "$f" | grep -v "^base runs"; done
