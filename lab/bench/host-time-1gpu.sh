#!/usr/bin/env bash
# Where an off step's extra host time goes (about 8 min on one H200; lab/NOTEBOOK.md jobs 45-46).
# Off over plain is 0.93 at c = 16 and 0.91 at 64 (job 41, ten window pairs): each off step
# takes 0.27-0.64 ms more of the scheduler's CPU than a plain one, spread too thin for the torch
# profiler, whose own overhead inflated every function 2x and more (job 31). This job measures
# job 41's pair again, ten window pairs per level, with:
#   --gc-stats   every scheduler's garbage collections, timed per window (a collection is
#                charged by any profiler to the line that allocated last);
#   --pyspy      a py-spy recording of each window's scheduler (200 samples a second, without
#                pausing it): lab/bench/pyspy_steps.py gives each function's us per decode step,
#                off against plain, into OUT/pyspy-steps.md.
# Job 45 added `--repeat 12 --freeze-gc-from-rep 6` (the last six pairs after SGLang's
# /freeze_gc); its frozen half measured the GC probe's own cost (see gcstats/sitecustomize.py).
# HOST_TIME_CHECKS=1 (a two-GPU machine): the A/B on GPU 0, and verify.py then draftkv.py on
# GPU 1, for a patch that changed (job 46; on one GPU, lab/gpu/patch-checks-1gpu.sh
# runs the checks in a call of their own). Job 47 added `--shape 8b --mem-fraction 0.35
# --repeat 8` (a target whose step leaves more to the GPU). Job 49 added `--scheduler-cores
# odd-reps`: each scheduler's main thread alone on a physical core in odd repeats, free in even
# ones (is the off server's slower code a busy sibling hardware thread?). Job 53 added
# `--repeat 6 --profile-levels 16,64 --profile-activities GPU --profile-servers plain,patched-off`:
# the GPU's busy and idle time per step, kernel by kernel, into OUT/profiles.txt.
# Results: OUT/host-time.json, OUT/host-time.log, OUT/pyspy-steps.md, with the checks
# OUT/verify.json and OUT/draftkv.json, and logs.tar.xz (server logs, the recordings, the GC
# totals, the checks' logs).
#   bash lab/bench/host-time-1gpu.sh [site312.tar.xz] [out-dir] [gpu_envelope args...]
set -uo pipefail
cd "$(dirname "$0")/../.."
ARCHIVE=${1:-.gpu/site312.tar.xz}
OUT=${2:-${OUT:-out}/host-time}
RUN=${HOST_TIME_RUN:-lab/gpu/run-on-gpu.sh}  # tests put a stand-in here
WHEEL=${HOST_TIME_PYSPY-$(ls .gpu/py_spy-*.whl 2>/dev/null | head -n 1)}
# shellcheck source=lab/gpu/job-lib.sh
. lab/gpu/job-lib.sh
job_setup "$RUN" "$ARCHIVE" "$OUT" || exit 1
SPY=$(install_pyspy "$WHEEL") || { echo "no py-spy: carry its wheel in .gpu/"; exit 1; }
CHECKS=
PARTS=(setup run)
if [ "${HOST_TIME_CHECKS:-}" = 1 ]; then
  CUDA_VISIBLE_DEVICES=1 engine_checks "$RUN" "$ARCHIVE" "$OUT" --prefill-graph-tokens 4096 &
  CHECKS=$!
  PARTS+=(verify draftkv verify.log draftkv.log)
fi
CUDA_VISIBLE_DEVICES=0 timeout 500 bash "$RUN" "$ARCHIVE" "$OUT/run" lab/bench/gpu_envelope.py \
  --servers plain --extra patched-off --levels 16,64 --extra-levels 16,64 --repeat 10 \
  --gc-stats --pyspy "$SPY" --temperature 0.9 --mem-fraction 0.25 --prefill-graph-tokens 2048 \
  --flush-cache --deadline 470 "${@:3}" > "$OUT/host-time.log" 2>&1
echo "run: exit $?"
cp "$OUT/run/envelope.json" "$OUT/host-time.json" 2>/dev/null
# With --profile-levels: the profiles' summaries (the traces go into logs.tar.xz).
cp "$OUT/run/profiles.txt" "$OUT/profiles.txt" 2>/dev/null
python3 lab/bench/pyspy_steps.py "$OUT/run" --top 45 > "$OUT/pyspy-steps.md" 2>&1
echo "pyspy_steps: exit $?"
if [ -n "$CHECKS" ]; then
  wait "$CHECKS"
  tail -n 1 "$OUT/verify.log" "$OUT/draftkv.log"
fi
# The compiled kernels, for the next run (copy to .gpu/kcache.tar.xz; about 3 MB).
tar -C /tmp -cJf "$OUT/kcache.tar.xz" kcache 2>/dev/null || true
pack_logs "$OUT" "${PARTS[@]}"
ls -l "$OUT"
