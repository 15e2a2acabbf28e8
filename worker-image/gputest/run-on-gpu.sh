#!/usr/bin/env bash
# Run the GPU verification on a machine with one GPU, Python 3.12 and torch 2.11 but no SGLang:
# unpack the SGLang 0.5.17 archive (../shared/gpu/build_site.sh builds it), apply the patch,
# run verify.py. With SGLang already installed, run verify.py directly after `apply-patch.sh`.
#   bash worker-image/gputest/run-on-gpu.sh [site312.tar.xz] [out-dir] [verify|speed] [args...]
set -euo pipefail
cd "$(dirname "$0")/../.."
ARCHIVE=${1:-.gpu/site312.tar.xz}
OUTDIR=${2:-${OUT:-out}/gputest}
SITE=/tmp/site
rm -rf "$SITE" && mkdir -p "$SITE" "$OUTDIR"
xz -dc -T0 "$ARCHIVE" | tar -x -C "$SITE"
for p in worker-image/patches/*.patch; do
  (cd "$SITE" && patch -p1 --forward --quiet) < "$p"
done
export PYTHONPATH=$SITE CUDA_HOME=/usr/local/cuda PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=/tmp/kcache/triton TVM_FFI_CACHE_DIR=/tmp/kcache/tvm XDG_CACHE_HOME=/tmp/kcache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUTDIR/gpu.txt"
SCRIPT=${3:-verify}
cd worker-image/gputest
python3 "$SCRIPT.py" --out "$OUTDIR" "${@:4}"
