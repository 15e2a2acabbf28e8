#!/usr/bin/env bash
# Job 37 (one GPU, about 8 min): at c = 128 the router sometimes holds far fewer requests than
# there are clients. In job 36 the engine's batch fell to 24 and 41 in two of three windows
# through the router, never at its own port; job 34 saw it once in four. Why?
# Two runs of lab/bench/gpu_envelope.py, one after the other on one GPU, each measuring the routed
# engine held speculating (threshold 146) through its router and at its own port at c = 128,
# as deployed (prefill graphs, caches emptied before each window):
#   conn/  clients open a connection per request, as in every job so far; py-spy records the
#          router (when .gpu/ holds its wheel);
#   keep/  each client keeps one connection (--client-keepalive), as SDK clients do.
# Every window records the router's in-flight count four times a second, its main thread's CPU
# time and the host's TCP counters (accept queues overflowed, SYNs sent again).
# Results: OUT/conn.json, OUT/keep.json, OUT/router.folded, their logs, logs.tar.xz.
#   bash lab/bench/router-stall.sh [site312.tar.xz] [out-dir] [gpu_envelope args...]
set -uo pipefail
cd "$(dirname "$0")/../.."
ARCHIVE=${1:-.gpu/site312.tar.xz}
OUT=${2:-${OUT:-out}/router-stall}
RUN=${ROUTER_STALL_RUN:-lab/gpu/run-on-gpu.sh}  # tests put a stand-in here
WHEEL=${ROUTER_STALL_PYSPY-$(ls .gpu/py_spy-*.whl 2>/dev/null | head -n 1)}  # and none here
# shellcheck source=lab/gpu/job-lib.sh
. lab/gpu/job-lib.sh
job_setup "$RUN" "$ARCHIVE" "$OUT" || exit 1
mkdir -p "$OUT/host"
host_net > "$OUT/host/net.txt"
COMMON=(--servers specgate-probes --direct-too --levels 128 --repeat 5 --router-threshold 146
  --probe-interval 600 --prefill-graph-tokens 2048 --flush-cache --temperature 0.9
  --mem-fraction 0.2 --models /tmp/specgate-models-stall --deadline 210)
record_router "$WHEEL" "$OUT/conn" "$OUT/router.folded" 210 > "$OUT/pyspy.log" 2>&1 &
SPY=$!
timeout 240 bash "$RUN" "$ARCHIVE" "$OUT/conn" lab/bench/gpu_envelope.py "${COMMON[@]}" \
  "${@:3}" > "$OUT/conn.log" 2>&1
echo "conn: exit $?"
wait "$SPY"
timeout 230 bash "$RUN" "$ARCHIVE" "$OUT/keep" lab/bench/gpu_envelope.py "${COMMON[@]}" \
  --client-keepalive --port-base 31300 "${@:3}" > "$OUT/keep.log" 2>&1
echo "keep: exit $?"
cp "$OUT/conn/envelope.json" "$OUT/conn.json" 2>/dev/null
cp "$OUT/keep/envelope.json" "$OUT/keep.json" 2>/dev/null
pack_logs "$OUT" setup host conn keep
ls -l "$OUT"
