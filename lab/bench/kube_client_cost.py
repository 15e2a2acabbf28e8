"""What a maintained Kubernetes client would cost the router, against specgate's own
(specgate/kube.py), side by side in one run: the time a fresh interpreter takes to import each
and build a client from a kubeconfig, its memory after that, and the time of one GET of a
Lease-sized object from an in-process server (the router's per-request path never calls the
API: what it pays there is start-up and memory; a renewal every few seconds is the steady call).

kubernetes_asyncio (the asyncio port of the `kubernetes` package the design first named) is
installed into its own virtual environment, .tools/bench-kube (its pins differ from specgate's).

    .venv/bin/python lab/bench/kube_client_cost.py [--runs 11]

Runs alternate between the two so that a noisy machine slows both alike; prints medians and
ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".tools" / "bench-kube"
VERSION = "32.3.2"

OURS = """
import asyncio, resource, sys, time
t0 = time.perf_counter()
from specgate.kube import Credentials, KubeClient
client = KubeClient(Credentials.from_kubeconfig(sys.argv[1]))
t1 = time.perf_counter()
async def main():
    await client.get_or_none("coordination.k8s.io/v1", "Lease", "d", "l")
    t = time.perf_counter()
    for _ in range(50):
        await client.get_or_none("coordination.k8s.io/v1", "Lease", "d", "l")
    return (time.perf_counter() - t) / 50
call = asyncio.run(main())
print(t1 - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, call)
"""
THEIRS = """
import asyncio, resource, sys, time
t0 = time.perf_counter()
from kubernetes_asyncio import client as k8s, config
async def main():
    await config.load_kube_config(config_file=sys.argv[1])
    api = k8s.ApiClient()
    t1 = time.perf_counter()
    leases = k8s.CoordinationV1Api(api)
    async def get():
        try:
            await leases.read_namespaced_lease("l", "d")
        except k8s.ApiException:
            pass
    await get()
    t = time.perf_counter()
    for _ in range(50):
        await get()
    call = (time.perf_counter() - t) / 50
    await api.close()
    return t1 - t0, call
start, call = asyncio.run(main())
print(start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, call)
"""
SERVER = """
import http.server, json, socket, sys
body = json.dumps({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
    "metadata": {"name": "l", "namespace": "d", "resourceVersion": "1"},
    "spec": {"holderIdentity": "router-0", "leaseDurationSeconds": 15}}).encode()
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def setup(self):
        super().setup()  # headers and body go out in two writes: no Nagle delay between them
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
s.serve_forever()
"""


def _venv() -> Path:
    python = VENV / "bin" / "python"
    marker = VENV / f".kubernetes_asyncio-{VERSION}"
    if not marker.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q", f"kubernetes_asyncio=={VERSION}"]
        subprocess.run(pip, check=True)
        marker.touch()
    return python


def _kubeconfig(port: int) -> str:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
    }
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump(config, f)
    return f.name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=11)
    args = parser.parse_args(argv)
    clients = {"specgate.kube": (sys.executable, OURS),
               "kubernetes_asyncio": (str(_venv()), THEIRS)}  # fmt: skip
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in clients}
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        kubeconfig = _kubeconfig(int(server.stdout.readline()))
        for _ in range(args.runs):
            for name, (python, code) in clients.items():
                done = subprocess.run([python, "-c", code, kubeconfig], check=True,
                                      capture_output=True, text=True, cwd=ROOT)  # fmt: skip
                start, rss_kib, call = (float(x) for x in done.stdout.split())
                runs[name].append((start * 1000, rss_kib / 1024, call * 1000))
    finally:
        server.terminate()
    medians = {name: [statistics.median(r[i] for r in rs) for i in range(3)]
               for name, rs in runs.items()}  # fmt: skip
    print(f"medians of {args.runs} fresh interpreters each, alternating")
    print(f"{'client':<20} {'import+client ms':>17} {'max RSS MiB':>12} {'GET ms':>8}")
    for name, (start, rss, call) in medians.items():
        print(f"{name:<20} {start:>17.0f} {rss:>12.1f} {call:>8.2f}")
    ours, theirs = medians["specgate.kube"], medians["kubernetes_asyncio"]
    print(f"ratio kubernetes_asyncio/specgate.kube: start {theirs[0] / ours[0]:.2f}, "
          f"memory {theirs[1] / ours[1]:.2f}, GET {theirs[2] / ours[2]:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
