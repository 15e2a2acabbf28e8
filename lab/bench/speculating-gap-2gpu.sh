#!/usr/bin/env bash
# The next call after the eleventh session (about 9 min on two GPUs): is the patched engine still
# slower than always-on while speculating now that prefills no longer sync the stream, and where
# does each server's scheduler thread spend a decode step?
#   GPU 0: verify.py, then draftkv.py, with prefill CUDA graphs (the patch changed: correctness);
#   GPU 1: lab/bench/gpu_envelope.py as deployed (prefill graphs, caches emptied before each
#          window): plain, always-on and specgate held at threshold 146 (speculating throughout,
#          measured through the router and at its engine's own port) at c = 16, 64 and 128,
#          and the patch pinned off at 16 and 64. Every window records each scheduler main
#          thread's time on a CPU and waiting for one (envelope_report.py's scheduler table).
# Results: OUT/verify.json, OUT/draftkv.json, OUT/envelope.json, their logs, logs.tar.xz.
#   bash lab/bench/speculating-gap-2gpu.sh [site312.tar.xz] [out-dir] [gpu_envelope args...]
set -uo pipefail
cd "$(dirname "$0")/../.."
ARCHIVE=${1:-.gpu/site312.tar.xz}
OUT=${2:-${OUT:-out}/speculating-gap}
RUN=${SPECULATING_GAP_RUN:-lab/gpu/run-on-gpu.sh}  # tests put a stand-in here
# shellcheck source=lab/gpu/job-lib.sh
. lab/gpu/job-lib.sh
job_setup "$RUN" "$ARCHIVE" "$OUT" || exit 1
(
  export CUDA_VISIBLE_DEVICES=0
  gpu_check verify 330 "$RUN" "$ARCHIVE" "$OUT" --prefill-graph-tokens 4096
  gpu_check draftkv 250 "$RUN" "$ARCHIVE" "$OUT" --prefill-graph-tokens 4096
) &
CHECKS=$!
CUDA_VISIBLE_DEVICES=1 timeout 540 bash "$RUN" "$ARCHIVE" "$OUT/envelope" lab/bench/gpu_envelope.py \
  --servers plain,always-on,specgate-probes --direct-too --levels 16,64,128 \
  --extra patched-off --extra-levels 16,64 --repeat 3 --router-threshold 146 \
  --probe-interval 600 --prefill-graph-tokens 2048 --flush-cache --temperature 0.9 \
  --mem-fraction 0.2 --port-base 31300 --models /tmp/specgate-models-gap --deadline 500 \
  "${@:3}" > "$OUT/envelope.log" 2>&1
echo "gpu_envelope: exit $?"
wait "$CHECKS"
tail -n 1 "$OUT/verify.log" "$OUT/draftkv.log"
# The results at the top of OUT, the rest in logs.tar.xz (job-lib.sh's pack_logs).
cp "$OUT/verify/results.json" "$OUT/verify.json" 2>/dev/null
cp "$OUT/draftkv/draftkv.json" "$OUT/draftkv.json" 2>/dev/null
cp "$OUT/envelope/envelope.json" "$OUT/envelope.json" 2>/dev/null
pack_logs "$OUT" setup verify draftkv envelope
ls -l "$OUT"
