#!/usr/bin/env bash
# Stages what a GPU call carries in .gpu/ (which .git/info/exclude must ignore), within the
# device's 64 MiB for the working tree and everything carried:
#   .gpu/site312.tar.xz  SGLang 0.5.17 (../shared/gpu/build_site.sh builds it), without
#                        sglang/multimodal_gen (the diffusion server; nothing under sglang/srt
#                        imports it) nor the examples, tests and Python sources of the
#                        CUTLASS tree flashinfer carries (its JIT includes only
#                        cutlass/include and tools/util/include), nor the test folders of
#                        packages other than sglang (its scheduler imports sglang.test), its
#                        shared libraries without debug info (xgrammar's bindings carry
#                        50 MB of it), packed with xz -9e: about 44 MB instead of 58
#   .gpu/wheels/         what the router imports beyond the GPU image and the archive
#                        (httptools, PyJWT, the OpenTelemetry SDK and OTLP/HTTP exporter)
# Usage: bash lab/gpu/stage.sh [BUILD_DIR]   (BUILD_DIR: where build_site.sh puts its tree;
# it runs there first when that holds no site312/). Takes about 4 minutes on two cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-${TMPDIR:-/tmp}/specgate-gpu-site}
if [ ! -d "$BUILD/site312" ]; then bash ../shared/gpu/build_site.sh "$BUILD"; fi
CUTLASS=$BUILD/site312/flashinfer/data/cutlass
rm -rf "$BUILD/site312/sglang/multimodal_gen" "$CUTLASS/examples" "$CUTLASS/test" "$CUTLASS/python"
find "$BUILD/site312" -mindepth 2 -type d \( -name tests -o -name test \) -not -path '*/sglang/*' -prune \
  -exec rm -rf {} +
find "$BUILD/site312" -name '*.so*' -type f -exec strip --strip-debug {} + 2>/dev/null || true
mkdir -p .gpu/wheels
grep -qx '.gpu/' .git/info/exclude 2>/dev/null || echo '.gpu/' >> .git/info/exclude
tar -cf - -C "$BUILD/site312" . | xz -T2 -9e > .gpu/site312.tar.xz
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  -d .gpu/wheels httptools==0.9.0 PyJWT==2.15.1 opentelemetry-sdk==1.45.2 \
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2 \
  opentelemetry-proto==1.45.2 opentelemetry-semantic-conventions==0.66b2 \
  opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2
du -sh .gpu/site312.tar.xz .gpu/wheels
