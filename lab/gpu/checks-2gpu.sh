#!/usr/bin/env bash
# The engine checks of one GPU session on a machine with two GPUs, in one job (about 8 min):
#   1. verify.py --tp 2: runtime control and greedy identity with tensor parallelism (issue 8);
#   2. recovery.py --upstream-extend-too: accept length after off stretches and the synthetic
#      pair's acceptance, the lean and upstream's off-step draft extend side by side (one per GPU);
#   3. verify.py --upstream-extend on GPU 0 once the tensor-parallel run is done.
# Servers that share a GPU start one after another (verify.MEMORY_SIZED says why).
#   bash lab/gpu/checks-2gpu.sh [site312.tar.xz] [out-dir]
set -uo pipefail
cd "$(dirname "$0")/../.."
ARCHIVE=${1:-.gpu/site312.tar.xz}
OUT=${2:-${OUT:-out}/checks}
RUN=lab/gpu/run-on-gpu.sh
mkdir -p "$OUT"
bash "$RUN" "$ARCHIVE" "$OUT/setup" none || exit 1
bash "$RUN" "$ARCHIVE" "$OUT/tp2" verify --tp 2 --mem-fraction 0.25 > "$OUT/tp2.log" 2>&1 &
TP2=$!
CUDA_VISIBLE_DEVICES=0,1 bash "$RUN" "$ARCHIVE" "$OUT/recovery" recovery --upstream-extend-too \
  --after-log "$OUT/tp2/plain.log" > "$OUT/recovery.log" 2>&1 &
RECOVERY=$!
wait $TP2; echo "verify --tp 2: exit $?"
CUDA_VISIBLE_DEVICES=0 bash "$RUN" "$ARCHIVE" "$OUT/upstream-extend" verify --upstream-extend \
  --port 31100 --mem-fraction 0.25 > "$OUT/upstream-extend.log" 2>&1
echo "verify --upstream-extend: exit $?"
wait $RECOVERY; echo "recovery: exit $?"
tail -n 3 "$OUT"/*.log
# The compiled kernels, for the next run (copy to .gpu/kcache.tar.xz; about 4 MB).
tar -C /tmp -cJf "$OUT/kcache.tar.xz" kcache 2>/dev/null || true
