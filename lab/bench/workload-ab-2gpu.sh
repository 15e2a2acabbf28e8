#!/usr/bin/env bash
# Where does the off server's gap to plain decoding come from: its prefills or its decode steps?
# One job on two GPUs (about 9 min), plain against the patch pinned off, window by window at
# c = 16 and 64, each GPU with one change to the sweep's workload (lab/bench/gpu_envelope.py):
#   GPU 0: 512-1024 new tokens a request instead of 64-192, so prefills are about one step in
#          400 at c = 64 instead of one in 64: the decode steps' ratio, nearly alone;
#   GPU 1: the sweep's requests, with prefills replaying SGLang's breakable CUDA graphs (its
#          default; the sweep's servers run prefills eagerly): the ratio as deployed.
# Results: OUT/long.json, OUT/graphs.json, their logs, logs.tar.xz (server logs).
#   bash lab/bench/workload-ab-2gpu.sh [site312.tar.xz] [out-dir] [gpu_envelope args for both...]
set -uo pipefail
cd "$(dirname "$0")/../.."
ARCHIVE=${1:-.gpu/site312.tar.xz}
OUT=${2:-${OUT:-out}/workload-ab}
RUN=${WORKLOAD_AB_RUN:-lab/gpu/run-on-gpu.sh}  # tests put a stand-in here
# shellcheck source=lab/gpu/job-lib.sh
. lab/gpu/job-lib.sh
job_setup "$RUN" "$ARCHIVE" "$OUT" || exit 1
AB=(--servers plain --extra patched-off --levels 16,64 --extra-levels 16,64 --mem-fraction 0.25
    --deadline 500)
CUDA_VISIBLE_DEVICES=0 timeout 540 bash "$RUN" "$ARCHIVE" "$OUT/long" lab/bench/gpu_envelope.py \
  "${AB[@]}" --repeat 6 --new-tokens 512,1024 --seconds 6 "${@:3}" > "$OUT/long.log" 2>&1 &
LONG=$!
CUDA_VISIBLE_DEVICES=1 timeout 540 bash "$RUN" "$ARCHIVE" "$OUT/graphs" lab/bench/gpu_envelope.py \
  "${AB[@]}" --repeat 8 --prefill-graph-tokens 2048 --port-base 31300 \
  --models /tmp/specgate-models-graphs "${@:3}" > "$OUT/graphs.log" 2>&1
echo "graphs: exit $?"
wait "$LONG"
echo "long: exit $?"
grep -h "prefill CUDA graph\|Capture prefill\|Traceback" "$OUT"/graphs/*.log 2>/dev/null | sort | uniq -c | head
# The results at the top of OUT, the rest in logs.tar.xz (job-lib.sh's pack_logs).
cp "$OUT/long/envelope.json" "$OUT/long.json" 2>/dev/null
cp "$OUT/graphs/envelope.json" "$OUT/graphs.json" 2>/dev/null
pack_logs "$OUT" setup long graphs
ls -l "$OUT"
