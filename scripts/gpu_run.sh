#!/usr/bin/env bash
# One device call: install, GPU tests, offline benchmark, served benchmark. Logs under $OUT (or ./gpu_out).
# Usage: bash scripts/gpu_run.sh [tests|bench|served|served-modes|served-engine-process|before-after|tp N|profile|all] [extra args]
# served-modes: offline W1 (same engine flags as the server), then the server with --engine-process, then
# in-process, each at unlimited rate with enough client processes (--workers), and each mode's ratio to offline,
# all in one bench_served call; extra args go to it (e.g. --workers 8, --rates 16 inf --prompts-per-rate 200).
# before-after: W1 and W3 of an older revision unpacked in .old/ (`bash scripts/prepare_old.sh REV`, then carry
# .old), then of this tree, in one lease; extra args go to both bench_offline calls.
# tp N: on a machine of N >= 2 GPUs, the tensor-parallel GPU tests (NCCL, graphs on every rank), then
# bench_offline's TP mode (--tp-model 8b: TP=1 vs TP=N on the 8B shape; 70b: the 70B shape at TP=N); extra args
# go to it. tp-bench N: the benchmark alone (TP_BENCH_TIMEOUT seconds, default 400).
# The served benchmark needs the server's wheels: run ../shared/tools/device-wheels.sh first and carry .whl.
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
what=${1:-all}; shift || true
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
rc=0
if [[ $what == tests || $what == all ]]; then
  # every test file with a GPU-marked test, except the tensor-parallel ones (`tp N` runs those on N GPUs)
  gpu_files=$(grep -l "mark.gpu" tests/test_*.py | grep -v test_tensor_parallel)
  timeout "${GPU_TESTS_TIMEOUT:-480}" python3 -m pytest -q -s -m gpu $gpu_files -p no:cacheprovider 2>&1 \
    | grep -v "rope_parameters\|Loading weights\|Writing model" | tee "$OUT/gpu_tests.log" | tail -12
  rc=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all ]]; then
  python3 -m loadtest.bench_offline --out "$OUT" "$@" 2>&1 | grep -v "rope_parameters\|Loading weights\|Writing model" \
    | tee "$OUT/bench.log" | tail -12
fi
if [[ $what == served || $what == all ]]; then
  python3 -m loadtest.bench_served --out "$OUT" --rates 4 16 32 inf --prompts-per-rate 200 --modes engine-process \
    --no-offline 2>&1 | tee "$OUT/served.log" | tail -10
fi
if [[ $what == served-modes ]]; then
  python3 -m loadtest.bench_served --out "$OUT" "$@" 2>&1 | tee "$OUT/served_modes.log" | tail -12
fi
if [[ $what == served-engine-process ]]; then
  python3 -m loadtest.bench_served --out "$OUT" --modes engine-process "$@" 2>&1 \
    | tee "$OUT/served_engine_process.log" | tail -8
fi
if [[ $what == before-after ]]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/old ./.old > "$OUT/old_install.log" 2>&1 \
    || { cat "$OUT/old_install.log"; exit 1; }
  # From /tmp, with the old package first on the path, `asyncengine.loadtest` is the old revision's.
  (cd /tmp && PYTHONPATH=/tmp/old${PYTHONPATH:+:$PYTHONPATH} python3 -m asyncengine.loadtest.bench_offline \
    --only W1 W3 --skip-peers --out "$OUT/before" "$@" 2>&1 | grep -v "rope_parameters\|Loading weights" \
    | tee "$OUT/before.log" | tail -6)
  python3 -m loadtest.bench_offline --only W1 W3 --skip-peers --out "$OUT/after" "$@" 2>&1 \
    | grep -v "rope_parameters\|Loading weights" | tee "$OUT/after.log" | tail -6
fi
if [[ $what == tp || $what == tp-bench ]]; then
  tp=${1:?usage: gpu_run.sh tp|tp-bench N [bench_offline args]}; shift
  nvidia-smi topo -m > "$OUT/topology.txt" 2>&1; head -4 "$OUT/topology.txt"
fi
if [[ $what == tp ]]; then
  timeout 200 python3 -m pytest -q -s -m gpu tests/test_tensor_parallel.py -p no:cacheprovider 2>&1 \
    | grep -v "rope_parameters\|Loading weights\|Writing model" | tee "$OUT/tp_tests.log" | tail -12
  rc=${PIPESTATUS[0]}
fi
if [[ $what == tp || $what == tp-bench ]]; then
  timeout "${TP_BENCH_TIMEOUT:-400}" python3 -m loadtest.bench_offline --tensor-parallel-size "$tp" --out "$OUT" "$@" 2>&1 \
    | grep -v "rope_parameters\|Loading weights\|Writing model" | tee "$OUT/tp_bench.log" | tail -12
fi
if [[ $what == tp-smoke ]]; then
  # scripts/tp_smoke.py N; if it is still running after TP_SMOKE_TIMEOUT seconds (default 150), every Python
  # process of ours dumps its stacks (faulthandler on SIGABRT) and is ended.
  PYTHONFAULTHANDLER=1 python3 scripts/tp_smoke.py "${1:-2}" "${@:2}" > "$OUT/tp_smoke.log" 2>&1 &
  pid=$!
  for _ in $(seq "${TP_SMOKE_TIMEOUT:-150}"); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  if kill -0 $pid 2>/dev/null; then
    echo "tp-smoke: still running after ${TP_SMOKE_TIMEOUT:-150} s, dumping stacks" | tee -a "$OUT/tp_smoke.log"
    pkill -ABRT -f asyncengine.distributed.worker; sleep 2; kill -ABRT $pid; sleep 2; pkill -9 -f tp_smoke.py
  fi
  wait $pid; rc=$?
  grep -v "decode GEMV" "$OUT/tp_smoke.log" | tail -60
fi
if [[ $what == profile ]]; then
  python3 -m loadtest.profile_steps --out "$OUT" 2>&1 | grep -v "rope_parameters\|Loading weights\|Writing model" \
    | tee "$OUT/profile.log" | tail -60
fi
exit $rc
