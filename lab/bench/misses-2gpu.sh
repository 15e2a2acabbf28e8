#!/usr/bin/env bash
# The calls after the twelfth session (about 9.5 min on two GPUs): are the remaining misses
# real, now that the patch's prefill sync is gone and the router talks to engines through
# aiohttp? All as deployed (prefill CUDA graphs, caches emptied before each window),
# lab/bench/gpu_envelope.py:
#   GPU 0, MISSES_GPU0=off (the default; lab/NOTEBOOK.md job 41): off over plain (the
#          worker-image target, 0.95 at c = 16 and 64), plain against the patch pinned off,
#          ten window pairs per level, temperature 0.9;
#   GPU 0, MISSES_GPU0=weak-draft (job 44): the weaker draft of job 17 (temperature 1.0,
#          accept length 2.3), plain, always-on and specgate at c = 8 (which job 17 never
#          reached) and 32, five 4-second windows each after 90 s of learning;
#   MISSES_GPU0=none: nothing there; the misses below run on GPU 0 (a one-GPU machine;
#          MISSES_GPU1=none leaves them out, for MISSES_GPU0's run alone on one GPU);
#   GPU 1: the sweep's two misses (jobs 38-39: 0.934 at c = 4, 0.966 at c = 16; target 0.97),
#          plain, always-on and specgate over ten 2-second windows each after 90 s of
#          learning, temperature 0.9. Every server admits 128 requests, as the sweep's did (job
#          42 ran with 16, its largest level, and the router could learn nothing above 16), and
#          the router keeps its default probe interval (600 s: no probe within the job; job 42
#          probed every 60 s).
# Results: OUT/gpu0.json, OUT/misses.json, their logs, logs.tar.xz (server and router logs).
#   bash lab/bench/misses-2gpu.sh [site312.tar.xz] [out-dir] [gpu_envelope args for both...]
set -uo pipefail
cd "$(dirname "$0")/../.."
ARCHIVE=${1:-.gpu/site312.tar.xz}
OUT=${2:-${OUT:-out}/misses}
RUN=${MISSES_RUN:-lab/gpu/run-on-gpu.sh}  # tests put a stand-in here
# shellcheck source=lab/gpu/job-lib.sh
. lab/gpu/job-lib.sh
DEPLOYED=(--prefill-graph-tokens 2048 --flush-cache --deadline 520)
case ${MISSES_GPU0:-off} in
  off) GPU0=(--servers plain --extra patched-off --levels 16,64 --extra-levels 16,64 --repeat 10
             --temperature 0.9 --mem-fraction 0.25) ;;
  weak-draft) GPU0=(--servers plain,always-on,specgate-probes --levels 8,32 --repeat 5
                    --temperature 1.0 --learn-seconds 90 --max-running 128 --probe-interval 600
                    --mem-fraction 0.25 --models /tmp/specgate-models-weak) ;;
  none) GPU0=() ;;
  *) echo "MISSES_GPU0=${MISSES_GPU0}: off, weak-draft or none"; exit 2 ;;
esac
MISSES_GPU=1
[ ${#GPU0[@]} -gt 0 ] || MISSES_GPU=0
job_setup "$RUN" "$ARCHIVE" "$OUT" || exit 1
GPU0_JOB=
if [ ${#GPU0[@]} -gt 0 ]; then
  CUDA_VISIBLE_DEVICES=0 timeout 560 bash "$RUN" "$ARCHIVE" "$OUT/gpu0" lab/bench/gpu_envelope.py \
    "${GPU0[@]}" "${DEPLOYED[@]}" "${@:3}" > "$OUT/gpu0.log" 2>&1 &
  GPU0_JOB=$!
fi
if [ "${MISSES_GPU1:-}" != none ]; then
  CUDA_VISIBLE_DEVICES=$MISSES_GPU timeout 560 bash "$RUN" "$ARCHIVE" "$OUT/misses" \
    lab/bench/gpu_envelope.py --servers plain,always-on,specgate-probes --levels 16,4 --repeat 10 \
    --seconds 2 --warmup 0.5 --learn-seconds 90 --max-running 128 --probe-interval 600 \
    --mem-fraction 0.3 --port-base 31300 --models /tmp/specgate-models-misses \
    --temperature 0.9 "${DEPLOYED[@]}" "${@:3}" > "$OUT/misses.log" 2>&1
  echo "misses: exit $?"
fi
if [ -n "$GPU0_JOB" ]; then
  wait "$GPU0_JOB"
  echo "gpu0 (${MISSES_GPU0:-off}): exit $?"
fi
# The results at the top of OUT, the rest in logs.tar.xz (job-lib.sh's pack_logs).
cp "$OUT/gpu0/envelope.json" "$OUT/gpu0.json" 2>/dev/null
cp "$OUT/misses/envelope.json" "$OUT/misses.json" 2>/dev/null
pack_logs "$OUT" setup gpu0 misses
ls -l "$OUT"
