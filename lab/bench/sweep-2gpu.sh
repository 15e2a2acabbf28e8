#!/usr/bin/env bash
# The envelope sweep as deployed, in one job on two GPUs (about 9.5 min): prefills replay SGLang's
# breakable CUDA graphs (its default and the operator's pods'; the sweep's jobs 1-10 ran them
# eagerly) and every window starts from empty prefix caches (--flush-cache), at temperature 0.9
# (accept length about 3.3), lab/bench/gpu_envelope.py:
#   GPU 0: c = 4, 8, 2, 1 for plain, always-on, upstream's adaptive baseline and specgate, whose
#          router starts at threshold 8 and probes at its own default interval (600 s: never
#          within the job), so low loads speculate as they would in production;
#   GPU 1: c = 16, 128, 64, 32 for plain, always-on and specgate, after 90 s of learning (the
#          router fits its cost lines and moves the threshold, probing every 60 s).
# Results: OUT/low.json, OUT/high.json, their logs, logs.tar.xz (server and router logs).
#   bash lab/bench/sweep-2gpu.sh [site312.tar.xz] [out-dir] [gpu_envelope args for both...]
set -uo pipefail
cd "$(dirname "$0")/../.."
ARCHIVE=${1:-.gpu/site312.tar.xz}
OUT=${2:-${OUT:-out}/sweep}
RUN=${SWEEP_RUN:-lab/gpu/run-on-gpu.sh}  # tests put a stand-in here
# shellcheck source=lab/gpu/job-lib.sh
. lab/gpu/job-lib.sh
job_setup "$RUN" "$ARCHIVE" "$OUT" || exit 1
DEPLOYED=(--prefill-graph-tokens 2048 --flush-cache --temperature 0.9 --repeat 3 --deadline 530)
CUDA_VISIBLE_DEVICES=0 timeout 570 bash "$RUN" "$ARCHIVE" "$OUT/low" lab/bench/gpu_envelope.py \
  --servers plain,always-on,upstream-0step,specgate-probes --levels 4,8,2,1 \
  --probe-interval 600 --mem-fraction 0.22 "${DEPLOYED[@]}" "${@:3}" > "$OUT/low.log" 2>&1 &
LOW=$!
CUDA_VISIBLE_DEVICES=1 timeout 570 bash "$RUN" "$ARCHIVE" "$OUT/high" lab/bench/gpu_envelope.py \
  --servers plain,always-on,specgate-probes --levels 16,128,64,32 --learn-seconds 90 \
  --mem-fraction 0.3 --port-base 31300 --models /tmp/specgate-models-high \
  "${DEPLOYED[@]}" "${@:3}" > "$OUT/high.log" 2>&1
echo "high: exit $?"
wait "$LOW"
echo "low: exit $?"
grep -h "flush_cache at\|Traceback" "$OUT/low.log" "$OUT/high.log" | sort | uniq -c | head
# The results at the top of OUT, the rest in logs.tar.xz (job-lib.sh's pack_logs).
cp "$OUT/low/envelope.json" "$OUT/low.json" 2>/dev/null
cp "$OUT/high/envelope.json" "$OUT/high.json" 2>/dev/null
pack_logs "$OUT" setup low high
ls -l "$OUT"
