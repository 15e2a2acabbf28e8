"""A real Kubernetes control plane: etcd, kube-apiserver and kube-controller-manager built from
their Go modules by scripts/build-control-plane.sh (run by `make test` through `make tools`).

The API server authorizes with RBAC and signs service-account tokens with a key generated at
start; it serves HTTPS with a certificate from a certificate authority generated at start (the
controller manager publishes it to every namespace as kube-root-ca.crt, as in any cluster). The
admin authenticates with a static token in the group system:masters. The controller manager
runs the garbage collector, the Deployment, ReplicaSet, EndpointSlice, ServiceAccount,
namespace and root-CA controllers.

Pods run one of two ways:
- `running(folder)`: no kubelet or scheduler. `FakeKubelet` stands in for both, as kwok does: it
  registers one Ready node, binds every pending pod to it, reports the pod Running and Ready
  with this machine's own address as its IP (loopback is refused in EndpointSlices), and
  completes deletions. Nothing runs in the pods: a test that needs an engine behind a pod's IP
  starts a simulated one on that address itself. Seconds to start; the API server listens on
  loopback only.
- `running(folder, node_images=[...])`: a real node (tests/node.py: kubelet, kube-scheduler,
  kube-proxy, containerd, runc, CNI) runs the pods from those image archives. The API server
  listens on every address and advertises the node's gateway, so pods reach it through the
  `kubernetes` Service as in any cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
K8S_VERSION = os.environ.get("K8S_VERSION", "1.34.4")
ETCD_VERSION = os.environ.get("ETCD_VERSION", "3.6.5")
BINARIES = ROOT / ".tools" / "control-plane" / f"k8s-{K8S_VERSION}-etcd-{ETCD_VERSION}"
GATEWAY_CRDS = (
    BINARIES
    / "crds"
    / "gateway-api-{}-inference-extension-{}".format(
        os.environ.get("GATEWAY_API_VERSION", "1.4.1"),
        os.environ.get("INFERENCE_EXTENSION_VERSION", "1.1.0"),
    )
)
"""The Gateway API's standard CRDs and the Inference Extension's InferencePool CRD, copied from
their Go modules by scripts/build-control-plane.sh."""
KUBECTL = ROOT / ".tools" / "bin" / "kubectl"
HELM = ROOT / ".tools" / "bin" / "helm"
START_SECONDS = 90.0


class ControlPlaneError(RuntimeError):
    """The control plane did not start; the message says which part and its log's tail."""


@dataclass
class ControlPlane:
    server: str
    admin_token: str
    kubeconfig: Path
    folder: Path

    def kubeconfig_for(self, token: str, name: str) -> Path:
        """A kubeconfig that authenticates with `token` (a service account's, say)."""
        path = self.folder / f"kubeconfig-{name}"
        path.write_text(_kubeconfig(self.server, token))
        return path

    def kubectl(
        self,
        *args: str,
        kubeconfig: Path | None = None,
        stdin: str | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [
                str(KUBECTL),
                f"--kubeconfig={kubeconfig or self.kubeconfig}",
                f"--cache-dir={self.folder / 'kube-cache'}",
                *args,
            ],
            capture_output=True,
            text=True,
            input=stdin,
            timeout=60,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr or result.stdout}")
        return result

    def forget_discovery(self) -> None:
        """Drop kubectl's cached API discovery (after a CRD is registered, say)."""
        shutil.rmtree(self.folder / "kube-cache", ignore_errors=True)

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(HELM), f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={
                **os.environ,
                "HELM_CACHE_HOME": str(self.folder / "helm-cache"),
                "HELM_CONFIG_HOME": str(self.folder / "helm-config"),
                "HELM_DATA_HOME": str(self.folder / "helm-data"),
            },
        )
        if check and result.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)}: {result.stderr or result.stdout}")
        return result


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _kubeconfig(server: str, token: str) -> str:
    return (
        "apiVersion: v1\nkind: Config\n"
        "clusters:\n- name: local\n"
        f"  cluster: {{server: '{server}', insecure-skip-tls-verify: true}}\n"
        f"users:\n- name: user\n  user: {{token: '{token}'}}\n"
        "contexts:\n- name: local\n  context: {cluster: local, user: user, namespace: default}\n"
        "current-context: local\n"
    )


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _certificates(folder: Path, addresses: list[str]) -> tuple[Path, Path, Path]:
    """A certificate authority and the API server's certificate and key, valid for its
    addresses and the `kubernetes` Service's names and ClusterIP."""
    ca_key, ca, key, cert = (folder / n for n in ("ca.key", "ca.crt", "server.key", "server.crt"))
    names = ["kubernetes", "kubernetes.default", "kubernetes.default.svc",
             "kubernetes.default.svc.cluster.local", "localhost"]  # fmt: skip
    san = ",".join([*(f"DNS:{n}" for n in names), *(f"IP:{a}" for a in addresses)])
    openssl = ["openssl", "req", "-x509", "-nodes", "-newkey", "rsa:2048", "-days", "2"]
    for args in (
        [*openssl, "-keyout", str(ca_key), "-out", str(ca), "-subj", "/CN=specgate-test-ca"],
        [*openssl, "-keyout", str(key), "-out", str(cert), "-subj", "/CN=kube-apiserver",
         "-CA", str(ca), "-CAkey", str(ca_key), "-addext", f"subjectAltName={san}"],
    ):  # fmt: skip
        subprocess.run(args, check=True, capture_output=True)
    return ca, cert, key


def _wait_ready(server: str, token: str, deadline: float, logs: Path) -> None:
    context = ssl._create_unverified_context()  # the server's own self-signed certificate
    request = urllib.request.Request(
        server + "/readyz", headers={"Authorization": f"Bearer {token}"}
    )
    last = ""
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(request, context=context, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError as exc:
            last = str(exc)
        time.sleep(0.3)
    raise ControlPlaneError(
        f"kube-apiserver not ready within {START_SECONDS:.0f}s ({last}); its log:\n"
        + tail(logs / "kube-apiserver.log")
    )


def own_address() -> str:
    """This machine's IPv4 address on its default route, found without sending a packet (a
    UDP socket's connect only picks the route). Traffic to it stays on the machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("203.0.113.1", 9))  # TEST-NET-3: routed, never reached
            address = str(probe.getsockname()[0])
        except OSError as exc:
            raise ControlPlaneError(f"no non-loopback IPv4 address: {exc}") from exc
    if address.startswith("127."):
        raise ControlPlaneError(f"only a loopback address ({address}): pods need another")
    return address


class FakeKubelet:
    """One node's kubelet and the scheduler, as far as the API server can tell (see the
    module docstring), on a thread of its own; `stop` ends it."""

    NODE = "fake-node-0"

    def __init__(self, server: str, token: str, address: str, interval: float = 0.5) -> None:
        self.server, self.address, self.interval = server, address, interval
        self._headers = {"Authorization": f"Bearer {token}"}
        self._context = ssl._create_unverified_context()  # the server's self-signed certificate
        self._stop = threading.Event()
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="fake-kubelet", daemon=True)

    def start(self) -> None:
        self._register_node()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _call(self, method: str, path: str, body: object = None,
              content_type: str = "application/json") -> Any:  # fmt: skip
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.server + path,
            data=data,
            method=method,
            headers={**self._headers, "Content-Type": content_type},
        )
        with urllib.request.urlopen(request, context=self._context, timeout=10) as resp:
            return json.loads(resp.read() or b"null")

    def _register_node(self) -> None:
        self._call("POST", "/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": self.NODE, "labels": {"kubernetes.io/hostname": self.NODE}},
        })  # fmt: skip
        self._call("PATCH", f"/api/v1/nodes/{self.NODE}/status", {"status": {
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                            "message": "fake kubelet"}],
            "addresses": [{"type": "InternalIP", "address": self.address}],
            "capacity": {"cpu": "64", "memory": "512Gi", "pods": "110", "nvidia.com/gpu": "8"},
            "allocatable": {"cpu": "64", "memory": "512Gi", "pods": "110",
                            "nvidia.com/gpu": "8"},
        }}, "application/merge-patch+json")  # fmt: skip

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sync()
            except (OSError, ValueError) as exc:  # the server is going away, or a race
                self.errors.append(str(exc))

    def sync(self) -> None:
        """One pass: bind, start and delete what a scheduler and kubelet would."""
        listed = self._call("GET", "/api/v1/pods")
        for pod in listed["items"]:
            meta, spec = pod["metadata"], pod["spec"]
            where = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
            if meta.get("deletionTimestamp"):
                self._call("DELETE", where, {"gracePeriodSeconds": 0})
            elif not spec.get("nodeName"):
                self._call("POST", where + "/binding", {
                    "apiVersion": "v1", "kind": "Binding",
                    "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": self.NODE},
                })  # fmt: skip
            elif (pod.get("status") or {}).get("phase") != "Running":
                self._call("PATCH", where + "/status", self._running(spec),
                           "application/merge-patch+json")  # fmt: skip

    def _running(self, spec: dict[str, Any]) -> dict[str, Any]:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        containers: list[dict[str, Any]] = spec.get("containers") or []
        return {"status": {
            "phase": "Running",
            "hostIP": self.address,
            "podIP": self.address,
            "podIPs": [{"ip": self.address}],
            "startTime": now,
            "conditions": [
                {"type": t, "status": "True", "lastTransitionTime": now}
                for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
            ],
            "containerStatuses": [
                {"name": c["name"], "image": c["image"], "imageID": "", "ready": True,
                 "started": True, "restartCount": 0, "state": {"running": {"startedAt": now}}}
                for c in containers
            ],
        }}  # fmt: skip


@contextlib.contextmanager
def running(folder: Path, node_images: list[Path] | None = None) -> Iterator[ControlPlane]:
    """etcd, kube-apiserver and kube-controller-manager, stopped on exit, with FakeKubelet or,
    given `node_images`, a real node that has those image archives loaded."""
    missing = [b for b in ("etcd", "kube-apiserver", "kube-controller-manager")
               if not (BINARIES / b).is_file()]  # fmt: skip
    if missing:
        raise ControlPlaneError(
            f"{', '.join(missing)} not built in {BINARIES}: run `make tools`"
            " (scripts/build-control-plane.sh)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    etcd_port, peer_port, api_port = free_ports(3)
    token = secrets.token_hex(16)
    (folder / "tokens.csv").write_text(f'{token},admin,admin,"system:masters"\n')
    key = folder / "sa.key"
    subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True,
                   capture_output=True)  # fmt: skip
    server = f"https://127.0.0.1:{api_port}"
    from . import node  # the real node's module imports this one

    advertised = node.HOST_IP if node_images is not None else "127.0.0.1"
    ca, cert, cert_key = _certificates(folder, sorted({"127.0.0.1", advertised, "10.96.0.1"}))
    kubeconfig = folder / "kubeconfig"
    kubeconfig.write_text(_kubeconfig(server, token))
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str) -> None:
        log = open(folder / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen([str(BINARIES / name), *args], stdout=log,
                                      stderr=subprocess.STDOUT))  # fmt: skip

    try:
        start(
            "etcd",
            f"--data-dir={folder / 'etcd'}",
            f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
            f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
            f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
            "--log-level=warn",
        )
        start(
            "kube-apiserver",
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            f"--bind-address={'0.0.0.0' if node_images is not None else '127.0.0.1'}",
            f"--advertise-address={advertised}",
            f"--secure-port={api_port}",
            f"--tls-cert-file={cert}",
            f"--tls-private-key-file={cert_key}",
            f"--token-auth-file={folder / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={key}",
            f"--service-account-signing-key-file={key}",
            "--service-cluster-ip-range=10.96.0.0/16",
            "--enable-priority-and-fairness=false",
            "--kubelet-preferred-address-types=InternalIP",  # no DNS for the node's name
        )
        _wait_ready(server, token, time.monotonic() + START_SECONDS, folder)
        start(
            "kube-controller-manager",
            f"--kubeconfig={kubeconfig}",
            "--controllers=garbagecollector,deployment,replicaset,endpointslice,"
            "serviceaccount,serviceaccount-token,namespace,root-ca-cert-publisher"
            # a real node is tainted not-ready until this controller sees it Ready (FakeKubelet
            # renews no lease: this controller would mark its node unreachable)
            + (",nodelifecycle" if node_images is not None else ""),
            f"--service-account-private-key-file={key}",
            f"--root-ca-file={ca}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            "--secure-port=0",
            "--concurrent-gc-syncs=5",
        )
        time.sleep(0.5)
        for proc, name in zip(
            procs, ("etcd", "kube-apiserver", "kube-controller-manager"), strict=True
        ):
            if proc.poll() is not None:
                raise ControlPlaneError(f"{name} exited: \n" + tail(folder / f"{name}.log"))
        plane = ControlPlane(server, token, kubeconfig, folder)
        if node_images is not None:
            with node.running(folder / "node", kubeconfig, plane.kubectl, node_images):
                yield plane
            return
        kubelet = FakeKubelet(server, token, own_address())
        kubelet.start()
        try:
            yield plane
        finally:
            kubelet.stop()
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in reversed(procs):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(folder / "etcd", ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """`make cluster`: the control plane and a real node (tests/node.py) running the image
    archives in --images, until Ctrl-C, to try `helm install` and `kubectl apply` by hand;
    --fake-node: FakeKubelet instead (no root needed, nothing runs in the pods)."""
    import argparse
    import signal
    import tempfile

    parser = argparse.ArgumentParser(prog="make cluster", description=main.__doc__)
    parser.add_argument("--images", type=Path, default=ROOT / "dist" / "images",
                        help="folder of OCI archives (`make images` writes them)")  # fmt: skip
    parser.add_argument("--fake-node", action="store_true")
    args = parser.parse_args(argv)
    images = None if args.fake_node else sorted(args.images.glob("*.oci.tar"))
    if images is not None and not images:
        print(f"make cluster: no *.oci.tar in {args.images}: run `make images`", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="specgate-cluster-"))
    # Stop the servers on Ctrl-C and on a kill alike (a background job ignores SIGINT unless
    # told otherwise).
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, lambda *_: sys.exit(0))
    try:
        with running(folder, node_images=images) as plane:
            print(f"control plane up at {plane.server}; logs in {folder}")
            if images is not None:
                print(f"node {plane.kubectl('get', 'nodes', '-o', 'name').stdout.strip()} runs"
                      f" pods from {', '.join(i.name for i in images)}")  # fmt: skip
            print(f"export KUBECONFIG={plane.kubeconfig}")
            print(f"kubectl and helm are in {KUBECTL.parent}; Ctrl-C stops it", flush=True)
            try:
                signal.pause()
            finally:
                print("stopping", flush=True)
    except ControlPlaneError as exc:
        print(f"make cluster: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
