#!/usr/bin/env bash
# Run a GPU check on a machine with a GPU, Python 3.12 and torch 2.11 but no SGLang: unpack the
# SGLang 0.5.17 archive (../shared/gpu/build_site.sh builds it) into /tmp/site, apply the patch
# (again whenever it changed), then run one script. With SGLang already installed, run the
# scripts directly after `apply-patch.sh`.
#   bash lab/gpu/run-on-gpu.sh [site312.tar.xz] [out-dir] [SCRIPT] [args...]
# SCRIPT: verify (default), speed, recovery (scripts beside this one), a path from the
# repository root (lab/bench/gpu_envelope.py), or `none` to only set up. Several may run at once
# once one has set up.
set -euo pipefail
cd "$(dirname "$0")/../.."
ARCHIVE=${1:-.gpu/site312.tar.xz}
OUTDIR=${2:-${OUT:-out}/gputest}
SITE=${SPECGATE_SITE:-/tmp/site}  # tests point it elsewhere
mkdir -p "$OUTDIR"
# The marker holds the patches' checksum: a machine kept warm between calls re-patches when the
# patches changed (a bare marker once left the previous call's patch in place).
PATCHES=(worker-image/patches/*.patch)
PATCHES_SUM=$(cat "${PATCHES[@]}" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$SITE/.specgate-patched" 2>/dev/null)" != "$PATCHES_SUM" ]; then
  rm -rf "$SITE" && mkdir -p "$SITE"
  xz -dc -T0 "$ARCHIVE" | tar -x -C "$SITE"
  for p in "${PATCHES[@]}"; do
    (cd "$SITE" && patch -p1 --forward --quiet) < "$p"
  done
  echo "$PATCHES_SUM" > "$SITE/.specgate-patched"
fi
if [ ! -f "$SITE-upstream/.specgate-unpacked" ]; then
  # The same SGLang without the patch, for baselines that must be upstream's own code
  # (lab/bench/gpu_envelope.py runs upstream's --speculative-adaptive from it).
  rm -rf "$SITE-upstream" && mkdir -p "$SITE-upstream"
  xz -dc -T0 "$ARCHIVE" | tar -x -C "$SITE-upstream"
  touch "$SITE-upstream/.specgate-unpacked"
  # Compiled kernels from an earlier run (job.py packs them for the jobs that say so), if carried along.
  if [ -f .gpu/kcache.tar.xz ]; then tar -xJf .gpu/kcache.tar.xz -C /tmp; fi
fi
# Router dependencies the GPU image lacks (httptools, PyJWT, the OpenTelemetry SDK), carried as
# wheels in .gpu/wheels/ (lab/gpu/stage.sh downloads them).
EXTRA=$SITE-wheels
rm -rf "$EXTRA" && mkdir -p "$EXTRA"
for w in .gpu/wheels/*.whl; do
  if [ -f "$w" ]; then python3 -m zipfile -e "$w" "$EXTRA"; fi
done
REPO=$(pwd)
export PYTHONPATH=$SITE:$EXTRA:$REPO:$REPO/router CUDA_HOME=/usr/local/cuda PYTHONUNBUFFERED=1
export SPECGATE_UPSTREAM_SITE=$SITE-upstream
export TRITON_CACHE_DIR=/tmp/kcache/triton TVM_FFI_CACHE_DIR=/tmp/kcache/tvm XDG_CACHE_HOME=/tmp/kcache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUTDIR/gpu.txt"
SCRIPT=${3:-verify}
case "$SCRIPT" in
  none) exit 0 ;;
  */*) exec python3 "$SCRIPT" --out "$OUTDIR" "${@:4}" ;;
  *) cd lab/gpu && exec python3 "$SCRIPT.py" --out "$OUTDIR" "${@:4}" ;;
esac
