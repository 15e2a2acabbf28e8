# Shared by the two-GPU job scripts (lab/bench/*-2gpu.sh, lab/gpu/off-step-2gpu.sh),
# which source it from the repository root. Functions only: nothing runs on sourcing.

# Unpack and patch SGLang once (run-on-gpu.sh's `none`) before jobs run side by side.
job_setup() {  # RUN ARCHIVE OUT
  mkdir -p "$3"
  bash "$1" "$2" "$3/setup" none > "$3/setup.log" 2>&1 || { tail -20 "$3/setup.log"; return 1; }
}

# One engine check (verify, draftkv) on the GPUs CUDA_VISIBLE_DEVICES names, cut at TIMEOUT
# seconds: its results in OUT/NAME, its output and exit status in OUT/NAME.log.
gpu_check() {  # NAME TIMEOUT RUN ARCHIVE OUT [check args...]
  local name=$1 limit=$2 run=$3 archive=$4 out=$5
  shift 5
  timeout "$limit" bash "$run" "$archive" "$out/$name" "$name" "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $?" >> "$out/$name.log"
}

# The checks a patch change needs, one after the other on the GPUs CUDA_VISIBLE_DEVICES names:
# verify.py (runtime control, 400s, greedy identity while the threshold flips), then draftkv.py
# (the draft KV cache in sync after an off stretch). Results in OUT/verify and OUT/draftkv, their
# results files copied to OUT/verify.json and OUT/draftkv.json, logs in OUT/NAME.log.
engine_checks() {  # RUN ARCHIVE OUT [check args...]
  local run=$1 archive=$2 out=$3
  shift 3
  gpu_check verify 300 "$run" "$archive" "$out" "$@"
  gpu_check draftkv 220 "$run" "$archive" "$out" "$@"
  cp "$out/verify/results.json" "$out/verify.json" 2>/dev/null
  cp "$out/draftkv/draftkv.json" "$out/draftkv.json" 2>/dev/null
  return 0
}

# A folder of torch traces: host time per step by part of the scheduler loop (where an off
# step's host time outside run_batch goes), then the syncs that make the host wait for the GPU.
profile_splits() {  # PROFILES
  local part
  for part in run_batch get_next_batch_to_run process_batch_result; do
    echo "# profile_summary.py PROFILES --functions 50 --part $part"
    python3 lab/gpu/profile_summary.py "$1" --functions 50 --part "$part"
  done
  echo "# profile_summary.py PROFILES --syncs"
  python3 lab/gpu/profile_summary.py "$1" --syncs
}

# The device tool returns at most 8 files, 2 folders down: the results stay at the top of OUT,
# the named parts (server logs, profiles, the set-up log) go into OUT/logs.tar.xz.
pack_logs() {  # OUT PART...
  local out=$1 parts
  shift
  mv "$out/setup.log" "$out/setup/" 2>/dev/null
  parts=$(cd "$out" && ls -d "$@" 2>/dev/null)
  # shellcheck disable=SC2086
  tar -cJf "$out/logs.tar.xz" -C "$out" $parts && (cd "$out" && rm -rf $parts)
}

# py-spy from its wheel, carried in .gpu/ (the device has no network): the binary's path, once
# unpacked to $SPECGATE_PYSPY_DIR (/tmp/specgate-pyspy); nothing and a non-zero status without.
# PyPI's wheel is 2.9 MB; rewritten with LZMA entries (python3's zipfile, ZIP_LZMA) it is 2.0
# MB, which keeps the site archive, the kernel cache and the tree under the 64 MiB carry, and
# `zipfile -e` reads either.
install_pyspy() {  # WHEEL
  local wheel=$1 dir=${SPECGATE_PYSPY_DIR:-/tmp/specgate-pyspy}
  [ -n "$wheel" ] && [ -f "$wheel" ] || return 1
  if [ ! -x "$dir/py-spy" ]; then
    python3 -m zipfile -e "$wheel" "$dir/wheel" >&2 || return 1
    install -m 755 "$dir"/wheel/py_spy-*.data/scripts/py-spy "$dir/py-spy" >&2 || return 1
  fi
  echo "$dir/py-spy"
}

# py-spy records where a router's process spends its time, idle samples included, in py-spy's
# raw format (folded stacks), while it lives: lab/bench/gpu_envelope.py writes RUN_DIR/router.pid
# once the router is up. No wheel (an empty WHEEL), no recording.
record_router() {  # WHEEL RUN_DIR OUTFILE SECONDS
  local wheel=$1 dir=$2 outfile=$3 seconds=$4 spy
  [ -n "$wheel" ] || { echo "record_router: no py-spy wheel"; return 0; }
  spy=$(install_pyspy "$wheel") || return 0
  for _ in $(seq "$((seconds * 2))"); do [ -f "$dir/router.pid" ] && break; sleep 0.5; done
  [ -f "$dir/router.pid" ] || { echo "record_router: no $dir/router.pid"; return 0; }
  timeout "$((seconds + 30))" "$spy" record --pid "$(cat "$dir/router.pid")" --rate 200 --idle \
    --format raw --nonblocking --duration "$seconds" --output "$outfile"
  echo "record_router: exit $?"
}

# The host's network limits that bear on connection churn (lab/bench/router-stall.sh).
host_net() {
  local key
  for key in net.core.somaxconn net.ipv4.tcp_max_syn_backlog net.ipv4.ip_local_port_range \
    net.ipv4.tcp_tw_reuse net.ipv4.tcp_syncookies net.ipv4.tcp_fin_timeout; do
    echo "$key = $(cat "/proc/sys/${key//.//}" 2>/dev/null)"
  done
}
