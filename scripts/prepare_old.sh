#!/usr/bin/env bash
# Unpack revision REV of this repository into .old/ (ignored; carry it to the GPU machine for
# `scripts/gpu_run.sh before-after`). The packaged default model is left out: it is not needed there.
set -euo pipefail
rev=${1:?usage: prepare_old.sh REV}
cd "$(dirname "$0")/.."
rm -rf .old && mkdir .old
git archive "$rev" | tar -x -C .old --exclude='asyncengine/default_model/*' --exclude='tests' --exclude='docs'
grep -qx '/.old/' .git/info/exclude 2>/dev/null || echo '/.old/' >> .git/info/exclude
du -sh .old
