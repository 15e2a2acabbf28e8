#!/usr/bin/env bash
# One job on a machine with two GPUs (about 7 min; one GPU works too, below) for a change to the
# speculation-off step:
#   GPU 0: verify.py (runtime control, greedy identity while the threshold flips), then
#          draftkv.py (the draft KV cache after an off stretch): is the change correct;
#   GPU 1: lab/bench/gpu_envelope.py with plain and the pinned-off variants side by side at
#          c = 16 and 64, and a torch profile of plain and the patch's off step at c = 64:
#          is it faster (lab/NOTEBOOK.md section 1, jobs 12-14).
# Results land in OUT: verify.json, draftkv.json, envelope.json, their logs, the profile summary
# (off-step-functions.txt) and logs.tar.xz (server logs and torch profiles).
#   bash lab/gpu/off-step-2gpu.sh [site312.tar.xz] [out-dir] [envelope args...]
# Extra arguments go to gpu_envelope.py (e.g. --extra patched-off,patched-off-upstream-extend);
# OFF_STEP_CHECK_ARGS to verify.py and draftkv.py. Both run prefills through SGLang's breakable
# CUDA graphs, its default and the operator's pods' (`--prefill-graph-tokens 0` and
# OFF_STEP_CHECK_ARGS= run them eagerly, as every job before the tenth session did).
# The correctness checks and the speed runs use different GPUs on purpose: a server that starts
# beside others counts their memory against its --mem-fraction-static.
set -uo pipefail
cd "$(dirname "$0")/../.."
ARCHIVE=${1:-.gpu/site312.tar.xz}
OUT=${2:-${OUT:-out}/off-step}
RUN=${OFF_STEP_RUN:-lab/gpu/run-on-gpu.sh}  # tests put a stand-in here
CHECK_ARGS=${OFF_STEP_CHECK_ARGS---prefill-graph-tokens 4096}
# shellcheck source=lab/gpu/job-lib.sh
. lab/gpu/job-lib.sh
job_setup "$RUN" "$ARCHIVE" "$OUT" || exit 1
checks() {
  export CUDA_VISIBLE_DEVICES=0
  # verify took 169 s beside the speed runs in job 15, and its patched server 141 s to start
  # beside another server in the eighth session: 330 s leaves room.
  # shellcheck disable=SC2086
  gpu_check verify 330 "$RUN" "$ARCHIVE" "$OUT" $CHECK_ARGS
  if [ "$GPUS" -gt 1 ] || [ "${OFF_STEP_DRAFTKV:-0}" = 1 ]; then
    # shellcheck disable=SC2086
    gpu_check draftkv 250 "$RUN" "$ARCHIVE" "$OUT" $CHECK_ARGS
  fi
}
# With one GPU (a 10-minute call holds no more): verify, then the speed runs, on GPU 0;
# draftkv only with OFF_STEP_DRAFTKV=1, and pass a shorter --deadline to gpu_envelope.py.
GPUS=$(nvidia-smi -L | wc -l)
if [ "$GPUS" -gt 1 ]; then
  checks &
  CHECKS=$!
  SPEED_GPU=1
else
  checks
  CHECKS=
  SPEED_GPU=0
fi
CUDA_VISIBLE_DEVICES=$SPEED_GPU timeout 540 bash "$RUN" "$ARCHIVE" "$OUT/envelope" lab/bench/gpu_envelope.py \
  --servers plain --extra patched-off,patched-off-lean --levels 16,64 --extra-levels 16,64 \
  --repeat 6 --mem-fraction 0.25 --port-base 30300 --models /tmp/specgate-models-off-step \
  --deadline 500 --profile-levels 64 --profile-servers plain,patched-off \
  --prefill-graph-tokens 2048 "${@:3}" \
  > "$OUT/envelope.log" 2>&1
echo "gpu_envelope: exit $?"
[ -n "$CHECKS" ] && wait "$CHECKS"
tail -n 1 "$OUT/verify.log" "$OUT"/draftkv.log 2>/dev/null
if [ -d "$OUT/envelope/profiles" ]; then
  profile_splits "$OUT/envelope/profiles" > "$OUT/off-step-functions.txt" 2>&1
fi
grep -h "speculation-off steps" "$OUT"/*/*.log 2>/dev/null | sort | uniq -c
# The results at the top of OUT, the rest in logs.tar.xz (job-lib.sh's pack_logs).
cp "$OUT/verify/results.json" "$OUT/verify.json" 2>/dev/null
cp "$OUT/draftkv/draftkv.json" "$OUT/draftkv.json" 2>/dev/null
cp "$OUT/envelope/envelope.json" "$OUT/envelope.json" 2>/dev/null
pack_logs "$OUT" setup verify draftkv envelope
ls -l "$OUT"
