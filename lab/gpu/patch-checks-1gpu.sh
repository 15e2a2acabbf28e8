#!/usr/bin/env bash
# The engine checks a patch change needs, on one GPU, in one job (about 9 min; for a one-H200
# machine, where lab/bench/host-time-1gpu.sh's HOST_TIME_CHECKS=1 needs a second GPU):
#   1. verify.py: runtime control, 400s for bad values, greedy identity with the plain server
#      while the threshold flips;
#   2. draftkv.py: the draft KV cache in sync after a stretch of off steps (accept length).
# Both with SGLang's prefill CUDA graphs, as the operator's pods run. Results: OUT/verify.json,
# OUT/draftkv.json, their logs, the kernel cache, logs.tar.xz (servers' logs).
# Arguments after the first two go to both checks (e.g. --off-step-tokens 2).
#   bash lab/gpu/patch-checks-1gpu.sh [site312.tar.xz] [out-dir] [check args...]
set -uo pipefail
cd "$(dirname "$0")/../.."
ARCHIVE=${1:-.gpu/site312.tar.xz}
OUT=${2:-${OUT:-out}/patch-checks}
RUN=${PATCH_CHECKS_RUN:-lab/gpu/run-on-gpu.sh}  # tests put a stand-in here
# shellcheck source=lab/gpu/job-lib.sh
. lab/gpu/job-lib.sh
job_setup "$RUN" "$ARCHIVE" "$OUT" || exit 1
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} engine_checks "$RUN" "$ARCHIVE" "$OUT" \
  --prefill-graph-tokens 4096 "${@:3}"
tail -n 1 "$OUT/verify.log" "$OUT/draftkv.log"
# The compiled kernels, for the next run (copy to .gpu/kcache.tar.xz; about 1.3 MB).
tar -C /tmp -cJf "$OUT/kcache.tar.xz" kcache 2>/dev/null || true
pack_logs "$OUT" setup verify draftkv
ls -l "$OUT"
