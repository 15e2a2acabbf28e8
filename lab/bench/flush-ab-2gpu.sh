#!/usr/bin/env bash
# Is part of the off server's gap to plain decoding its fuller prefix cache? One job on two GPUs
# (about 9 min), plain against the patch pinned off, window by window at c = 16 and 64, prefills
# through SGLang's breakable CUDA graphs as deployed (lab/bench/gpu_envelope.py):
#   GPU 0: as jobs 26-27: each server's radix tree fills with finished requests over the run,
#          the off server's first (its KV pool is about two thirds of plain's), after which it
#          evicts on every step or two;
#   GPU 1: the same with --flush-cache (every window starts from an empty cache), then torch
#          profiles of both at c = 16 and 64, split by part of the scheduler loop.
# Results: OUT/kept.json, OUT/flushed.json, their logs, OUT/functions.txt (the profiles'
# summary), logs.tar.xz (server logs and the profiles).
#   bash lab/bench/flush-ab-2gpu.sh [site312.tar.xz] [out-dir] [gpu_envelope args for both...]
set -uo pipefail
cd "$(dirname "$0")/../.."
ARCHIVE=${1:-.gpu/site312.tar.xz}
OUT=${2:-${OUT:-out}/flush-ab}
RUN=${FLUSH_AB_RUN:-lab/gpu/run-on-gpu.sh}  # tests put a stand-in here
# shellcheck source=lab/gpu/job-lib.sh
. lab/gpu/job-lib.sh
job_setup "$RUN" "$ARCHIVE" "$OUT" || exit 1
AB=(--servers plain --extra patched-off --levels 16,64 --extra-levels 16,64 --mem-fraction 0.25
    --prefill-graph-tokens 2048 --repeat 8 --deadline 500)
CUDA_VISIBLE_DEVICES=0 timeout 540 bash "$RUN" "$ARCHIVE" "$OUT/kept" lab/bench/gpu_envelope.py \
  "${AB[@]}" "${@:3}" > "$OUT/kept.log" 2>&1 &
KEPT=$!
CUDA_VISIBLE_DEVICES=1 timeout 540 bash "$RUN" "$ARCHIVE" "$OUT/flushed" lab/bench/gpu_envelope.py \
  "${AB[@]}" --flush-cache --profile-levels 16,64 --port-base 31300 \
  --models /tmp/specgate-models-flushed "${@:3}" > "$OUT/flushed.log" 2>&1
echo "flushed: exit $?"
wait "$KEPT"
echo "kept: exit $?"
if [ -d "$OUT/flushed/profiles" ]; then
  profile_splits "$OUT/flushed/profiles" > "$OUT/functions.txt" 2>&1
fi
grep -h "flush_cache at" "$OUT/flushed.log" | head
# The results at the top of OUT, the rest in logs.tar.xz (job-lib.sh's pack_logs).
cp "$OUT/kept/envelope.json" "$OUT/kept.json" 2>/dev/null
cp "$OUT/flushed/envelope.json" "$OUT/flushed.json" 2>/dev/null
pack_logs "$OUT" setup kept flushed
ls -l "$OUT"
