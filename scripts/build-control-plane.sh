#!/usr/bin/env bash
# Builds a real Kubernetes control plane from published Go modules into .tools/, keyed by
# version (a second run reuses the binaries):
#  - kube-apiserver, kube-controller-manager, kube-scheduler, and a node's kubelet and
#    kube-proxy, and kubectl of the same version, from k8s.io/kubernetes, its k8s.io/* staging
#    modules pinned with `replace` to the matching v0.x.y releases (the documented way to
#    depend on k8s.io/kubernetes);
#  - etcd from go.etcd.io/etcd/server/v3 (etcdmain, a few lines of main);
#  - the Gateway API's standard CRDs (sigs.k8s.io/gateway-api) and the Inference Extension's
#    InferencePool CRD (sigs.k8s.io/gateway-api-inference-extension), from their modules'
#    config folders, into $OUT/crds (seconds).
# Cold (empty Go build and module caches) on 2 cores: most of the 10 minutes that
# `make tools` takes; warm: nothing to do.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
K8S=${K8S_VERSION:-1.34.4}
ETCD=${ETCD_VERSION:-3.6.5}
OUT=$PWD/.tools/control-plane/k8s-$K8S-etcd-$ETCD
STAGING="api apiextensions-apiserver apimachinery apiserver cli-runtime client-go cloud-provider
cluster-bootstrap code-generator component-base component-helpers controller-manager cri-api
cri-client csi-translation-lib dynamic-resource-allocation endpointslice externaljwt kms
kube-aggregator kube-controller-manager kube-proxy kube-scheduler kubectl kubelet metrics
mount-utils pod-security-admission sample-apiserver sample-cli-plugin sample-controller"
GATEWAY_API=${GATEWAY_API_VERSION:-1.4.1}
INFERENCE_EXTENSION=${INFERENCE_EXTENSION_VERSION:-1.1.0}
export GOTOOLCHAIN=local GOFLAGS=-mod=mod
CRDS=$OUT/crds/gateway-api-$GATEWAY_API-inference-extension-$INFERENCE_EXTENSION
if [ ! -f "$CRDS/.complete" ]; then
  mkdir -p "$CRDS"
  module_dir() { go mod download -json "$1" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p'; }
  gw=$(module_dir "sigs.k8s.io/gateway-api@v$GATEWAY_API")
  ie=$(module_dir "sigs.k8s.io/gateway-api-inference-extension@v$INFERENCE_EXTENSION")
  cp "$gw"/config/crd/standard/*.yaml "$CRDS/"
  cp "$ie/config/crd/bases/inference.networking.k8s.io_inferencepools.yaml" "$CRDS/"
  chmod u+w "$CRDS"/*.yaml
  touch "$CRDS/.complete"
fi
COMMANDS="kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kubectl"
built() { for c in $COMMANDS etcd; do [ -x "$OUT/$c" ] || return 1; done; }
# kubectl of the server's own version (no skew warning), where the tests and users find it.
link_kubectl() { mkdir -p "$ROOT/.tools/bin" && ln -sf "$OUT/kubectl" "$ROOT/.tools/bin/kubectl"; }
if built; then
  link_kubectl
  echo "control plane ready in $OUT"
  exit 0
fi
mkdir -p "$OUT/src/k8s" "$OUT/src/etcd"
started=$(date +%s)

cd "$OUT/src/k8s"
if [ ! -f go.mod ]; then
  go mod init specgate-control-plane >/dev/null 2>&1
  printf 'package main\n\nimport _ "k8s.io/kubernetes/cmd/kube-apiserver/app"\n\nfunc main() {}\n' > tools.go
  for m in $STAGING; do go mod edit -replace="k8s.io/$m=k8s.io/$m@v0.${K8S#1.}"; done
  go mod edit -require="k8s.io/kubernetes@v$K8S"
  go mod tidy
fi
# The version the binaries report (kubectl compares it with its own).
pkg=k8s.io/component-base/version
minor=$(echo "$K8S" | cut -d. -f2)
ldflags="-s -w -X $pkg.gitVersion=v$K8S -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
ldflags="$ldflags -X $pkg.gitTreeState=clean"
for cmd in $COMMANDS; do
  if [ ! -x "$OUT/$cmd" ]; then
    echo "building $cmd v$K8S (minutes on a small machine)..."
    go build -ldflags "$ldflags" -o "$OUT/$cmd.tmp" "k8s.io/kubernetes/cmd/$cmd"
    mv "$OUT/$cmd.tmp" "$OUT/$cmd"
  fi
done

cd "$OUT/src/etcd"
if [ ! -x "$OUT/etcd" ]; then
  if [ ! -f go.mod ]; then
    go mod init specgate-etcd >/dev/null 2>&1
    printf 'package main\n\nimport (\n\t"os"\n\n\t"go.etcd.io/etcd/server/v3/etcdmain"\n)\n\nfunc main() { etcdmain.Main(os.Args) }\n' > main.go
    go get "go.etcd.io/etcd/server/v3@v$ETCD"
    go mod tidy
  fi
  echo "building etcd v$ETCD..."
  go build -ldflags "-s -w" -o "$OUT/etcd.tmp" .
  mv "$OUT/etcd.tmp" "$OUT/etcd"
fi
link_kubectl
echo "control plane built in $(( $(date +%s) - started )) s into $OUT"
