#!/usr/bin/env bash
# Issue 17's served / offline ratio on CPU with the model's threads fixed and the cores around them varied: does the
# served side lose to offline because the server and the load generator share the model's cores?
# For each core set (taskset), `bench_cpu_serving --engine-process --client subprocess` with torch's threads set by
# THREADS (OMP_NUM_THREADS, inherited by the engine process; empty: torch's default, one per core of the set), CUDA
# hidden. Run on any Linux machine with enough cores (the GPU machine has 16): carry .whl (device-wheels.sh with
# aiohttp and its dependencies, for the load generator), e.g.
#     CORESETS="0-1 0-3" THREADS=2 bash scripts/cpu_serving_cores.sh --trials 3
# Logs and JSON under $OUT (or ./cpu_out); prints one line per core set last.
set -uo pipefail
OUT=${OUT:-cpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 CUDA_VISIBLE_DEVICES=""
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
lscpu > "$OUT/lscpu.txt"; grep -m1 "Model name" "$OUT/lscpu.txt"; nproc
THREADS=${THREADS-2}
for cores in ${CORESETS:-0-1 0-3}; do
  tag="cores${cores//,/_}-threads${THREADS:-default}"
  ( [[ -n $THREADS ]] && export OMP_NUM_THREADS=$THREADS
    timeout "${BENCH_TIMEOUT:-400}" taskset -c "$cores" python3 -m loadtest.bench_cpu_serving --engine-process \
      --client subprocess --out "$OUT/$tag.json" "$@" > "$OUT/$tag.log" 2>&1 )
  echo "cores $cores (threads ${THREADS:-default}): exit $?; $(grep -h "ratio served / offline\|CPU us per output" \
    "$OUT/$tag.log" | tr '\n' ' ')"
done
