#!/usr/bin/env bash
# The next call after the twelfth session (about 9.5 min on two GPUs): are the remaining misses
# real, now that the patch's prefill sync is gone and the router talks to engines through
# aiohttp? All as deployed (prefill CUDA graphs, caches emptied before each window,
# temperature 0.9), bench/gpu_envelope.py:
#   GPU 0: off over plain (the worker-image target, 0.95 at c = 16 and 64: job 36 measured
#          0.964 and 0.945 over three window pairs), plain against the patch pinned off, ten
#          window pairs per level;
#   GPU 1: the sweep's two misses (jobs 38-39: 0.934 at c = 4, 0.966 at c = 16; target 0.97),
#          plain, always-on and specgate over ten 2-second windows each, after 90 s of
#          learning (the report takes rows above threshold 8 only from jobs that learned).
# Results: OUT/off.json, OUT/misses.json, their logs, logs.tar.xz (server and router logs).
#   bash bench/misses-2gpu.sh [site312.tar.xz] [out-dir] [gpu_envelope args for both...]
set -uo pipefail
cd "$(dirname "$0")/.."
ARCHIVE=${1:-.gpu/site312.tar.xz}
OUT=${2:-${OUT:-out}/misses}
RUN=${MISSES_RUN:-worker-image/gputest/run-on-gpu.sh}  # tests put a stand-in here
# shellcheck source=worker-image/gputest/job-lib.sh
. worker-image/gputest/job-lib.sh
job_setup "$RUN" "$ARCHIVE" "$OUT" || exit 1
DEPLOYED=(--prefill-graph-tokens 2048 --flush-cache --temperature 0.9 --deadline 520)
CUDA_VISIBLE_DEVICES=0 timeout 560 bash "$RUN" "$ARCHIVE" "$OUT/off" bench/gpu_envelope.py \
  --servers plain --extra patched-off --levels 16,64 --extra-levels 16,64 --repeat 10 \
  --mem-fraction 0.25 "${DEPLOYED[@]}" "${@:3}" > "$OUT/off.log" 2>&1 &
OFF=$!
CUDA_VISIBLE_DEVICES=1 timeout 560 bash "$RUN" "$ARCHIVE" "$OUT/misses" bench/gpu_envelope.py \
  --servers plain,always-on,specgate-probes --levels 16,4 --repeat 10 --seconds 2 --warmup 0.5 \
  --learn-seconds 90 --mem-fraction 0.3 --port-base 31300 --models /tmp/specgate-models-misses \
  "${DEPLOYED[@]}" "${@:3}" > "$OUT/misses.log" 2>&1
echo "misses: exit $?"
wait "$OFF"
echo "off: exit $?"
# The results at the top of OUT, the rest in logs.tar.xz (job-lib.sh's pack_logs).
cp "$OUT/off/envelope.json" "$OUT/off.json" 2>/dev/null
cp "$OUT/misses/envelope.json" "$OUT/misses.json" 2>/dev/null
pack_logs "$OUT" setup off misses
ls -l "$OUT"
