"""One real Kubernetes node beside the control plane (tests/control_plane.py): kubelet,
kube-scheduler and kube-proxy built from their Go modules (scripts/build-control-plane.sh),
Debian's containerd 1.6 and runc, the CNI plugins' bridge, host-local, portmap and loopback,
and kube-router's NetworkPolicy controller (its firewall only: iptables and ipset rules that
enforce the policies; the bridge routes). Pods really run: images come from OCI archives
imported into containerd (nothing is pulled), the sandbox ("pause") image is compiled here from
a few lines of C.

The node lives in a network namespace of its own (`sgnode`), joined to this machine by a veth
pair as a second host would be by a wire: its bridge, pod addresses, kube-proxy's nftables
rules and the node's forwarding settings stay inside it and go with it. This machine routes
the pod range and the Service range to the node, so a test reaches a pod IP or a ClusterIP as
a client in the cluster's network would. The processes share this machine's mount namespace
(runc needs the cgroup hierarchy) and run as root.

What it leaves out, for a test machine: no cluster DNS (pods resolve with this machine's
resolv.conf, so `<service>.<namespace>.svc` names do not resolve; specgate's own clients find
the API server by KUBERNETES_SERVICE_HOST, as client-go does), the kubelet serves its API
without authentication, and the node advertises 8 `nvidia.com/gpu` as an extended resource
(the engine stand-in needs none; the pods ask for them as real engine pods do).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .control_plane import BINARIES, ControlPlaneError, free_ports, tail
from .tools import TOOLS, load_script

NAME = "specgate-node"
NETNS = "sgnode"
LINK_HOST, LINK_NODE = "sgnode-host", "sgnode-eth0"
HOST_IP, NODE_IP = "10.250.0.1", "10.250.0.2"
POD_SUBNET = "10.244.0.0/24"
SERVICE_RANGE = "10.96.0.0/16"
BRIDGE = "sgbr0"
CNI_PLUGINS = Path("/usr/lib/cni")
PAUSE_IMAGE = "registry.k8s.io/pause:specgate"
GPUS = 8
READY_SECONDS = 120.0
PAUSE_SOURCE = r"""
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
static void stop(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, 0, WNOHANG) > 0) {} }
int main(void) {
    signal(SIGINT, stop);
    signal(SIGTERM, stop);
    signal(SIGCHLD, reap);
    for (;;) pause();
}
"""
"""The sandbox's one process: holds the pod's namespaces, exits on SIGTERM, reaps orphans."""


class NodeError(ControlPlaneError):
    """The node did not come up; the message says which part and its log's tail."""


@dataclass
class Node:
    name: str
    address: str
    folder: Path
    containerd_socket: Path

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """containerd's own client, in the namespace the kubelet uses."""
        done = subprocess.run(
            ["ctr", f"--address={self.containerd_socket}", "--namespace=k8s.io", *args],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if check and done.returncode != 0:
            raise NodeError(f"ctr {' '.join(args)}: {done.stderr.strip() or done.stdout}")
        return done

    def load(self, archive: Path) -> None:
        """Import an OCI archive (its `io.containerd.image.name` names it), as `kind load`."""
        self.ctr("images", "import", "--no-unpack=false", str(archive))


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=60)
    if check and done.returncode != 0:
        raise NodeError(f"{' '.join(args)}: {done.stderr.strip() or done.stdout.strip()}")
    return done


def _in_node(*args: str) -> list[str]:
    """A command in the node's network namespace only (not `ip netns exec`, which also
    remounts /sys and would hide the cgroup hierarchy from runc)."""
    return ["nsenter", f"--net=/run/netns/{NETNS}", "--", *args]


def pause_image(out: Path, build_image: Any) -> Path:
    """The sandbox image: PAUSE_SOURCE compiled static, alone in a one-layer OCI archive."""
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "tree"
        tree.mkdir()
        source = Path(scratch) / "pause.c"
        source.write_text(PAUSE_SOURCE)
        _sh("gcc", "-static", "-Os", "-s", "-o", str(tree / "pause"), str(source))
        config = build_image.ImageConfig("65535:65535", ["/pause"], [], {})
        archive = out / "pause.oci.tar"
        name, tag = PAUSE_IMAGE.rsplit(":", 1)
        build_image.oci_archive(
            [build_image.layer_from_tree(tree, 0)], config, tag, 0, archive, repository=name
        )
    return archive


def _leftovers() -> None:
    """What an earlier node that was killed left: its namespace, links and routes."""
    if Path(f"/run/netns/{NETNS}").exists():
        owner = Path(f"/run/{NETNS}.pid")
        pid = int(owner.read_text()) if owner.is_file() else 0
        if pid and Path(f"/proc/{pid}").exists():
            raise NodeError(
                f"another specgate node is running (pid {pid}): stop it (`make cluster`"
                " ends with Ctrl-C) before starting one"
            )
        _sh("ip", "netns", "delete", NETNS, check=False)
    _sh("ip", "link", "delete", LINK_HOST, check=False)
    for route in (POD_SUBNET, SERVICE_RANGE):
        _sh("ip", "route", "delete", route, check=False)


def _network() -> None:
    """The node's namespace, wired to this machine, forwarding and bridging through iptables
    as kube-proxy and the bridge plugin expect."""
    _leftovers()
    _sh("ip", "netns", "add", NETNS)
    Path(f"/run/{NETNS}.pid").write_text(str(os.getpid()))
    _sh("ip", "link", "add", LINK_HOST, "type", "veth", "peer", "name", LINK_NODE)
    _sh("ip", "link", "set", LINK_NODE, "netns", NETNS)
    _sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", LINK_HOST)
    _sh("ip", "link", "set", LINK_HOST, "up")
    for args in (
        ("ip", "addr", "add", f"{NODE_IP}/30", "dev", LINK_NODE),
        ("ip", "link", "set", LINK_NODE, "up"),
        ("ip", "link", "set", "lo", "up"),
        ("ip", "route", "add", "default", "via", HOST_IP),
        ("sysctl", "-qw", "net.ipv4.ip_forward=1"),
        ("sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"),
        ("sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1"),
    ):
        _sh(*_in_node(*args))
    for route in (POD_SUBNET, SERVICE_RANGE):
        _sh("ip", "route", "add", route, "via", NODE_IP)


def _teardown_network() -> None:
    for route in (POD_SUBNET, SERVICE_RANGE):
        _sh("ip", "route", "delete", route, check=False)
    _sh("ip", "link", "delete", LINK_HOST, check=False)
    for netns in Path("/run/netns").glob("cni-*"):
        # containerd names its pods' namespaces cni-*: once the node's processes are gone, those
        # no process holds any more are what this node left
        if not _held(netns):
            _sh("ip", "netns", "delete", netns.name, check=False)
    _sh("ip", "netns", "delete", NETNS, check=False)
    Path(f"/run/{NETNS}.pid").unlink(missing_ok=True)


def _held(netns: Path) -> bool:
    inode = netns.stat().st_ino
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(proc / "ns" / "net").st_ino == inode:
                    return True
    return False


def _containerd_config(folder: Path) -> str:
    return f"""version = 2
root = "{folder / "root"}"
state = "{folder / "state"}"
[grpc]
  address = "{folder / "containerd.sock"}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # Without CAP_SYS_RESOURCE (as in most sandboxes) runc cannot lower oom_score_adj.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_PLUGINS}"
    conf_dir = "{folder / "cni"}"
"""


def _cni_config(folder: Path) -> dict[str, Any]:
    return {
        "cniVersion": "1.0.0",
        "name": "specgate",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": True,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_SUBNET}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(folder / "ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def _kubelet_config(folder: Path, socket: Path, port: int, healthz: int) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE_IP,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz,
        "containerRuntimeEndpoint": f"unix://{socket}",
        # cgroup v1 with the cgroupfs driver and no per-QoS hierarchy: what this machine has.
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupsPerQOS": False,
        "enforceNodeAllocatable": [],
        "failSwapOn": False,
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDomain": "cluster.local",
        "resolvConf": "/etc/resolv.conf",
        "serializeImagePulls": False,
        # a shared disk: evict on nothing but a nearly full one
        "evictionHard": {"nodefs.available": "1%", "imagefs.available": "1%",
                         "memory.available": "100Mi"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "syncFrequency": "5s",
        "fileCheckFrequency": "5s",
        "nodeStatusUpdateFrequency": "5s",
        "volumeStatsAggPeriod": "0s",
    }  # fmt: skip


def _kube_proxy_config(kubeconfig: Path, metrics: int, healthz: int) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        # nftables, its own table: kube-router rewrites iptables' filter table as a whole
        # (save, edit, restore), which raced kube-proxy's iptables rules away
        "mode": "nftables",
        "clusterCIDR": POD_SUBNET,
        "hostnameOverride": NAME,
        "bindAddress": NODE_IP,
        "metricsBindAddress": f"127.0.0.1:{metrics}",
        "healthzBindAddress": f"127.0.0.1:{healthz}",
        # the kernel's conntrack table is the machine's: leave its size alone
        "conntrack": {"maxPerCore": 0, "min": 0},
    }


def _stop(procs: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    for _, proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for _, proc in reversed(procs):
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _remove_containers(node: Node) -> None:
    """Every container and sandbox the kubelet left: killed and deleted, so their shims exit
    and their mounts go (the kubelet stops pods only when told to)."""
    tasks = node.ctr("tasks", "ls", "--quiet", check=False).stdout.split()
    for task in tasks:
        node.ctr("tasks", "kill", "--all", "--signal=SIGKILL", task, check=False)
    for task in tasks:
        node.ctr("tasks", "delete", "--force", task, check=False)
    for container in node.ctr("containers", "ls", "--quiet", check=False).stdout.split():
        node.ctr("containers", "delete", container, check=False)


def _unmount_under(folder: Path) -> None:
    mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
    for target in sorted((m for m in mounts if m.startswith(str(folder))), reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)


def _in_chains(chain: str) -> bool:
    listed = subprocess.run(_in_node("iptables", "-S", chain), capture_output=True, timeout=10)
    return listed.returncode == 0


def _wait(what: str, check: Any, deadline: float, log: Path) -> None:
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise NodeError(f"{what} within {READY_SECONDS:.0f}s; its log:\n" + tail(log, 25))


@contextlib.contextmanager
def running(folder: Path, kubeconfig: Path, kubectl: Any, images: list[Path]) -> Iterator[Node]:
    """The node, registered and Ready with `images` loaded; everything it started is stopped,
    unmounted and unwired on exit. The API server in `kubeconfig` (an administrator's, on
    127.0.0.1) must listen at HOST_IP too; `kubectl(*args)` runs kubectl as that administrator."""
    if os.geteuid() != 0:
        raise NodeError("a node needs root (containerd, runc, network namespaces)")
    missing = [b for b in ("kubelet", "kube-scheduler", "kube-proxy")
               if not (BINARIES / b).is_file()]  # fmt: skip
    if not (TOOLS / "bin" / "kube-router").is_file():
        missing.append("kube-router")
    missing += [t for t in ("containerd", "runc", "ctr", "iptables", "ipset", "nft", "nsenter")
                if subprocess.run(["which", t], capture_output=True).returncode]  # fmt: skip
    if not (CNI_PLUGINS / "bridge").is_file():
        missing.append(str(CNI_PLUGINS / "bridge"))
    if missing:
        raise NodeError(f"{', '.join(missing)} missing: run `make tools`")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cni").mkdir(exist_ok=True)
    (folder / "cni" / "10-specgate.conflist").write_text(json.dumps(_cni_config(folder)))
    (folder / "containerd.toml").write_text(_containerd_config(folder))
    socket = folder / "containerd.sock"
    kubelet_port, kubelet_healthz, proxy_metrics, proxy_healthz = free_ports(4)
    (folder / "kubelet.yaml").write_text(
        json.dumps(_kubelet_config(folder, socket, kubelet_port, kubelet_healthz))
    )
    procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(name: str, args: list[str]) -> None:
        log = open(folder / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append((name, subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)))

    # the node reaches the API server as pods do, at this machine's end of the wire
    node_kubeconfig = folder / "kubeconfig"
    node_kubeconfig.write_text(
        kubeconfig.read_text().replace("https://127.0.0.1:", f"https://{HOST_IP}:")
    )
    (folder / "kube-proxy.yaml").write_text(
        json.dumps(_kube_proxy_config(node_kubeconfig, proxy_metrics, proxy_healthz))
    )
    pause = pause_image(folder, load_script("build_image"))
    node = Node(NAME, NODE_IP, folder, socket)
    _network()
    try:
        start("containerd", _in_node("containerd", f"--config={folder / 'containerd.toml'}"))
        deadline = time.monotonic() + READY_SECONDS
        _wait("containerd not serving", lambda: node.ctr("version", check=False).returncode
              == 0, deadline, folder / "containerd.log")  # fmt: skip
        for archive in [pause, *images]:
            node.load(archive)
        start("kube-scheduler", [
            str(BINARIES / "kube-scheduler"), f"--kubeconfig={kubeconfig}",
            "--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=0",
        ])  # fmt: skip
        start("kubelet", _in_node(
            str(BINARIES / "kubelet"), f"--config={folder / 'kubelet.yaml'}",
            f"--kubeconfig={node_kubeconfig}", f"--root-dir={folder / 'kubelet'}",
            f"--cert-dir={folder / 'kubelet-pki'}", f"--hostname-override={NAME}",
            f"--node-ip={NODE_IP}", "--v=1",
        ))  # fmt: skip
        start("kube-proxy", _in_node(
            str(BINARIES / "kube-proxy"), f"--config={folder / 'kube-proxy.yaml'}",
        ))  # fmt: skip

        def ready() -> bool:
            for name, proc in procs:
                if proc.poll() is not None:
                    raise NodeError(f"{name} exited:\n" + tail(folder / f"{name}.log", 25))
            got = kubectl("get", "node", NAME, "-o", "json", check=False)
            if got.returncode:
                return False
            conditions = json.loads(got.stdout)["status"].get("conditions") or []
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

        _wait("the node is not Ready", ready, deadline, folder / "kubelet.log")
        # An extended resource, advertised as a device plugin would (the pods ask for GPUs).
        patch = [{"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": str(GPUS)}]
        kubectl("patch", "node", NAME, "--subresource=status", "--type=json",
                "-p", json.dumps(patch))  # fmt: skip
        # The policy controller reads its Node at start: only once the node is registered.
        start("kube-router", _in_node(
            str(TOOLS / "bin" / "kube-router"), f"--kubeconfig={node_kubeconfig}",
            f"--hostname-override={NAME}", f"--service-cluster-ip-range={SERVICE_RANGE}",
            "--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
            "--enable-cni=false", "--health-port=0", "--iptables-sync-period=30s",
        ))  # fmt: skip
        _wait("kube-router has not set up its firewall chains", lambda: ready() and _in_chains(
            "KUBE-ROUTER-FORWARD"), time.monotonic() + 30, folder / "kube-router.log")  # fmt: skip
        yield node
    finally:
        try:
            _stop([p for p in procs if p[0] != "containerd"])
            if any(name == "containerd" for name, _ in procs):
                _remove_containers(node)
            _stop([p for p in procs if p[0] == "containerd"])
        finally:
            _unmount_under(folder)
            _teardown_network()
