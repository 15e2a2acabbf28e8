#!/usr/bin/env bash
# The two questions this host's noise left open, with each run on its own half of the host's
# physical cores and every server on whole cores of its own (gpu_envelope.py --pin-cpus), idle
# servers asleep. One job on two GPUs (about 8 min):
#   GPU 0, cores 1/2: job 19 again (c = 4: plain, always-on and the routed server, which
#          speculates there; 30 rotations): is the routed server's 0.92x always-on a cost?
#   GPU 1, cores 2/2: plain against the patch pinned off at c = 16 and 64, prefills replaying
#          SGLang's breakable CUDA graphs as deployed (jobs 26-27 again, pinned).
# Results: OUT/c4.json, OUT/off.json, their logs, logs.tar.xz (server logs).
#   bash lab/bench/pinned-2gpu.sh [site312.tar.xz] [out-dir]
set -uo pipefail
cd "$(dirname "$0")/../.."
ARCHIVE=${1:-.gpu/site312.tar.xz}
OUT=${2:-${OUT:-out}/pinned}
RUN=${PINNED_RUN:-lab/gpu/run-on-gpu.sh}  # tests put a stand-in here
# shellcheck source=lab/gpu/job-lib.sh
. lab/gpu/job-lib.sh
job_setup "$RUN" "$ARCHIVE" "$OUT" || exit 1
CUDA_VISIBLE_DEVICES=0 timeout 540 bash "$RUN" "$ARCHIVE" "$OUT/c4" lab/bench/gpu_envelope.py \
  --servers plain,always-on,specgate-probes --levels 4 --repeat 30 --seconds 2 --warmup 0.5 \
  --temperature 0.9 --probe-interval 600 --deadline 440 --pin-cpus 1/2 > "$OUT/c4.log" 2>&1 &
C4=$!
CUDA_VISIBLE_DEVICES=1 timeout 540 bash "$RUN" "$ARCHIVE" "$OUT/off" lab/bench/gpu_envelope.py \
  --servers plain --extra patched-off --levels 16,64 --extra-levels 16,64 --repeat 10 \
  --prefill-graph-tokens 2048 --temperature 0.9 --mem-fraction 0.25 --deadline 440 \
  --pin-cpus 2/2 --port-base 31300 --models /tmp/specgate-models-off > "$OUT/off.log" 2>&1
echo "off: exit $?"
wait "$C4"
echo "c4: exit $?"
grep -h "cpus" "$OUT"/c4/envelope.json "$OUT"/off/envelope.json 2>/dev/null | head -4
# The device tool returns at most 8 files, 2 folders down: the results at the top, the rest
# (server logs) in one archive.
cp "$OUT/c4/envelope.json" "$OUT/c4.json" 2>/dev/null
cp "$OUT/off/envelope.json" "$OUT/off.json" 2>/dev/null
for f in /sys/devices/system/cpu/cpu*/topology/thread_siblings_list; do
  echo "$f: $(cat "$f")"
done > "$OUT/setup/thread-siblings.txt" 2>/dev/null
# The results at the top of OUT, the rest in logs.tar.xz (job-lib.sh's pack_logs).
pack_logs "$OUT" setup c4 off
ls -l "$OUT"
