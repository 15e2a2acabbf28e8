"""specgate as a user runs it: the images `make images` builds, installed by `helm install` on
a cluster whose node really runs pods (tests/node.py: kubelet, containerd, runc, CNI,
kube-proxy), a SpecDecodeDeployment whose engine pods run the engine stand-in image, and
requests from the official OpenAI client through the router's Service.

The steps run in order on one cluster (each test builds on the last); a failure names the
step. What the node leaves out (cluster DNS, GPUs) is in tests/node.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from specgate import __version__, contract

from . import control_plane
from .conftest import ROOT
from .control_plane import ControlPlane
from .tools import helm_template, wait_for

pytestmark = pytest.mark.integration
CHART = ROOT / "charts" / "specgate"
NAMESPACE = "specgate-system"
NAME = "demo"
ENGINE_IMAGE = f"ghcr.io/specgate/engine-sim:{__version__}"
SPECGATE_IMAGE = f"ghcr.io/specgate/specgate:{__version__}"
RELEASE = "specgate"  # the operator's Deployment and Lease take the release's name


def _wait(check: Any, what: str, seconds: float = 90.0) -> Any:
    return wait_for(check, what, seconds)


def _get(cluster: ControlPlane, *args: str) -> Any:
    got = cluster.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(got.stdout) if got.returncode == 0 else None


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return not pod["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in conditions
    )


def _pods(cluster: ControlPlane, component: str, namespace: str = "default") -> list[Any]:
    selector = f"app.kubernetes.io/instance={NAME},app.kubernetes.io/component={component}"
    listed = _get(cluster, "pods", "-n", namespace, "-l", selector) or {"items": []}
    return list(listed["items"])


def _events(cluster: ControlPlane) -> str:
    return cluster.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp", check=False).stdout[
        -4000:
    ]


@pytest.fixture(scope="module")
def cluster(
    built_images: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControlPlane]:
    """The images `make images` builds, loaded into a real node's containerd."""
    images = [built_images[name][0] for name in ("specgate", "engine-sim")]
    with control_plane.running(tmp_path_factory.mktemp("cluster"), node_images=images) as plane:
        yield plane


@pytest.fixture(scope="module")
def client_service(cluster: ControlPlane) -> str:
    """The router Service's ClusterIP address, once the resource exists (kube-proxy's rules
    route it to a router pod, from this machine as from a pod)."""
    service = _wait(lambda: _get(cluster, "service", f"{NAME}-router"), "the router Service")
    port = service["spec"]["ports"][0]["port"]
    return f"http://{service['spec']['clusterIP']}:{port}"


FETCH = """
import json, sys, urllib.request
request = urllib.request.Request(sys.argv[1], headers=json.loads(sys.argv[2]))
try:
    with urllib.request.urlopen(request, timeout=5) as answer:
        print(json.dumps({"status": answer.status, "body": answer.read().decode()}))
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
"""
"""A GET from inside a pod (the specgate image's python3), as another workload would send it."""


class ClientPods:
    """A pod in `monitoring` (the namespace the engine NetworkPolicy lets scrape, by default)
    and one in `elsewhere`, each able to send a GET from inside the cluster."""

    def __init__(self, cluster: ControlPlane) -> None:
        self.cluster = cluster
        for namespace in ("monitoring", "elsewhere"):
            cluster.kubectl("create", "namespace", namespace)
            cluster.kubectl(
                "run", "client", "-n", namespace, f"--image={SPECGATE_IMAGE}",
                "--image-pull-policy=Never", "--restart=Never", "--command", "--", "sleep", "1d",
            )  # fmt: skip
        for namespace in ("monitoring", "elsewhere"):
            cluster.kubectl("wait", "-n", namespace, "--for=condition=Ready", "pod/client",
                            "--timeout=120s")  # fmt: skip

    def get(self, namespace: str, url: str, headers: dict[str, str] | None = None) -> Any:
        """{"status", "body"} or {"error"}."""
        done = self.cluster.kubectl(
            "exec", "-n", namespace, "client", "--", "python3", "-c", FETCH, url,
            json.dumps(headers or {}),
        )  # fmt: skip
        return json.loads(done.stdout)


@pytest.fixture(scope="module")
def clients(cluster: ControlPlane) -> ClientPods:
    return ClientPods(cluster)


def test_helm_install_runs_the_operator_as_its_image_and_probes_say(cluster: ControlPlane) -> None:
    cluster.helm(
        "install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--create-namespace",
        "--wait", "--timeout=180s",
    )  # fmt: skip
    pods = _get(cluster, "pods", "-n", NAMESPACE, "-l", "app.kubernetes.io/component=operator")
    assert pods is not None and len(pods["items"]) == 2, pods
    for pod in pods["items"]:
        assert _ready(pod), pod["status"]
        (status,) = pod["status"]["containerStatuses"]
        assert status["restartCount"] == 0, status
        assert status["image"].endswith(f"specgate/specgate:{__version__}")
    exec_ = ("exec", "-n", NAMESPACE, f"deploy/{RELEASE}", "--")
    assert cluster.kubectl(*exec_, "id", "-u").stdout.strip() == "65532"
    written = cluster.kubectl(*exec_, "touch", "/probe", check=False)
    assert written.returncode != 0 and "Read-only file system" in written.stderr
    # It reconciles with its in-cluster ServiceAccount: one replica holds the Lease.
    lease = _wait(
        lambda: (
            (got := _get(cluster, "lease", RELEASE, "-n", NAMESPACE))
            and got["spec"].get("holderIdentity")
            and got
        ),
        "the operator's Lease",
    )
    names = {p["metadata"]["name"] for p in pods["items"]}
    assert lease["spec"]["holderIdentity"] in names


def _resource(replicas: int = 1) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "examples" / "tiny-single-gpu.yaml").read_text())
    doc["metadata"] = {"name": NAME, "namespace": "default"}
    spec = doc["spec"]
    spec["replicas"] = replicas
    spec["model"] = {"path": "meta-llama/Llama-3.1-8B-Instruct"}  # baked in: no download
    spec["speculative"]["draftModel"] = {"path": "jamesliu1/sglang-EAGLE3-Llama-3.1-Instruct-8B"}
    spec["engine"]["image"] = ENGINE_IMAGE
    spec["engine"].pop("shmSize", None)
    # The node has 2 cores: requests a real GPU node would meet are scaled down to fit.
    small = {"requests": {"cpu": "100m", "memory": "128Mi"}}
    spec["engine"]["resources"] = small
    spec["router"] = {"replicas": 2, "resources": small}
    return doc  # type: ignore[no-any-return]


def test_a_resource_gets_engine_and_router_pods_that_find_each_other(
    cluster: ControlPlane,
) -> None:
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(_resource()))

    def all_ready() -> bool:
        engines, routers = _pods(cluster, "engine"), _pods(cluster, "router")
        return len(engines) == 1 and len(routers) == 2 and all(map(_ready, engines + routers))

    try:
        _wait(all_ready, "one engine and two router pods Ready", 180)
    except AssertionError:
        raise AssertionError(
            json.dumps([p["status"] for p in _pods(cluster, "engine") + _pods(cluster, "router")])[
                -3000:
            ]
            + _events(cluster)
        ) from None
    (engine,) = _pods(cluster, "engine")
    assert engine["status"]["podIP"].startswith("10.244.")
    # The engine Service's EndpointSlice holds the pod's own address, and a router routes to it.
    slices = _get(cluster, "endpointslices", "-l", f"kubernetes.io/service-name={NAME}-engine")
    addresses = {
        a for s in slices["items"] for e in s.get("endpoints") or [] for a in e["addresses"]
    }
    assert addresses == {engine["status"]["podIP"]}
    lease = _wait(
        lambda: (
            (got := _get(cluster, "lease", f"{NAME}-router-leader"))
            and got["spec"].get("holderIdentity")
            and got
        ),
        "a router replica to lead",
    )
    assert lease["spec"]["holderIdentity"] in {
        p["metadata"]["name"] for p in _pods(cluster, "router")
    }
    status = _wait(
        lambda: ((_get(cluster, "sdd", NAME) or {}).get("status") or {}).get("pods"),
        "the leader to publish the pods in status",
    )
    assert [p["name"] for p in status] == [engine["metadata"]["name"]], status
    # The API server takes the resource's NetworkPolicy (kube-router enforces it: see below).
    policies = _get(cluster, "networkpolicies", "-l", f"app.kubernetes.io/instance={NAME}")
    assert policies is not None and policies["items"], policies
    table = cluster.kubectl("get", "sdd", NAME).stdout
    assert "THRESHOLD" in table and NAME in table, table


async def test_openai_requests_reach_the_engines_through_the_routers_service(
    cluster: ControlPlane, client_service: str
) -> None:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{client_service}/v1", api_key="unused", max_retries=0)
    models = await client.models.list()
    model = models.data[0].id
    answer = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=16
    )
    assert answer.choices[0].message.content and answer.usage and answer.usage.completion_tokens
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=16, stream=True
    )
    pieces = [c.choices[0].delta.content async for c in stream if c.choices]
    assert len([p for p in pieces if p]) >= 2, pieces
    await client.close()


def test_metrics_answer_on_the_ports_the_charts_pod_monitors_name(
    cluster: ControlPlane, clients: ClientPods
) -> None:
    """Scraped from a pod in the monitoring namespace, as Prometheus would."""
    rendered = helm_template(
        sets=("monitoring.podMonitor.enabled=true",),
        api_versions=("monitoring.coreos.com/v1/PodMonitor",),
        namespace=NAMESPACE,
    ).stdout
    monitors = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "PodMonitor"]
    scraped = 0
    for monitor in monitors:
        labels = monitor["spec"]["selector"]["matchLabels"]
        component = labels["app.kubernetes.io/component"]  # (the release's name differs)
        namespace = NAMESPACE if component == "operator" else "default"
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        selector = f"app.kubernetes.io/component={component}"
        pods = _get(cluster, "pods", "-n", namespace, "-l", selector)["items"]
        assert pods, (component, labels)
        for pod in pods:
            (port,) = [p["containerPort"] for c in pod["spec"]["containers"]
                       for p in c.get("ports") or [] if p["name"] == endpoint["port"]]  # fmt: skip
            url = f"http://{pod['status']['podIP']}:{port}{endpoint['path']}"
            got = clients.get("monitoring", url)
            assert got.get("status") == 200 and "# TYPE" in got["body"], (url, got)
            scraped += 1
    assert scraped >= 5  # two operator, one engine and two router pods


def test_network_policies_let_only_routers_and_scrapers_reach_the_engines(
    cluster: ControlPlane, clients: ClientPods
) -> None:
    """kube-router enforces the operator's engine NetworkPolicy: the engine port answers a
    scraper in the monitoring namespace (and the routers, which the request tests use), and
    nothing else: not a pod in another namespace, not this machine."""
    (url,) = _engine_urls(cluster)
    assert clients.get("monitoring", f"{url}/health").get("status") == 200
    refused = clients.get("elsewhere", f"{url}/health")
    assert "error" in refused, refused
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=3)
    # The routers' pods have no policy: anyone in the cluster reaches them.
    (router, *_) = _pods(cluster, "router")
    got = clients.get("elsewhere", f"http://{router['status']['podIP']}:8000/health")
    assert got.get("status") == 200, got


class Load:
    """Clients sending chat completions through the router's Service until stopped; every
    answer's status is kept."""

    def __init__(self, url: str, clients: int = 6) -> None:
        self.url, self.clients = url, clients
        self.statuses: list[int | str] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _client(self, http: httpx.AsyncClient) -> None:
        body = {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        while not self._stop.is_set():
            try:
                got = await http.post(f"{self.url}/v1/chat/completions", json=body)
                self.statuses.append(got.status_code)
            except httpx.HTTPError as exc:
                self.statuses.append(type(exc).__name__)

    async def __aenter__(self) -> Load:
        self._http = httpx.AsyncClient(timeout=30)
        self._tasks = [asyncio.create_task(self._client(self._http)) for _ in range(self.clients)]
        return self

    async def __aexit__(self, *_: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)
        await self._http.aclose()

    def failures(self) -> list[int | str]:
        return [s for s in self.statuses if s != 200]


def _routed(cluster: ControlPlane) -> list[set[str]]:
    """Each router replica's view: the engine URLs it routes to."""
    views = []
    for pod in _pods(cluster, "router"):
        if _ready(pod):
            got = httpx.get(f"http://{pod['status']['podIP']}:8000/specgate/pods", timeout=5)
            views.append({p["url"] for p in got.json()["pods"] if not p["draining"]})
    return views


def _engine_key(cluster: ControlPlane) -> str:
    """The key the engine pods want, from the Secret their SGLANG_API_KEY names."""
    import base64

    (engine, *_) = _pods(cluster, "engine")
    (env,) = [e for e in engine["spec"]["containers"][0]["env"] if e["name"] == "SGLANG_API_KEY"]
    ref = env["valueFrom"]["secretKeyRef"]
    secret = _get(cluster, "secret", ref["name"])
    return base64.b64decode(secret["data"][ref["key"]]).decode()


def _engine_urls(cluster: ControlPlane) -> set[str]:
    return {f"http://{p['status']['podIP']}:30000" for p in _pods(cluster, "engine") if _ready(p)}


async def test_scaling_adds_an_engine_pod_that_joins_the_rotation(
    cluster: ControlPlane, client_service: str, clients: ClientPods
) -> None:
    cluster.kubectl("scale", "sdd", NAME, "--replicas=2")
    _wait(lambda: len(_engine_urls(cluster)) == 2, "a second engine pod Ready", 120)
    _wait(lambda: all(v == _engine_urls(cluster) for v in _routed(cluster)),
          "both routers to route to both engine pods", 60)  # fmt: skip
    async with Load(client_service) as load:
        await asyncio.sleep(5)
    assert len(load.statuses) > 20 and not load.failures(), load.failures()[:10]
    served = set()
    for url in _engine_urls(cluster):
        metrics = clients.get("monitoring", f"{url}/metrics")["body"]
        served |= {url} if "sglang:generation_tokens_total" in metrics else set()
    assert served == _engine_urls(cluster)


async def test_an_engine_pod_deleted_under_load_loses_no_request(
    cluster: ControlPlane, client_service: str
) -> None:
    victim = sorted(p["metadata"]["name"] for p in _pods(cluster, "engine"))[0]
    async with Load(client_service) as load:
        await asyncio.sleep(2)
        await asyncio.to_thread(cluster.kubectl, "delete", "pod", victim, "--wait=true")
        await asyncio.to_thread(
            _wait, lambda: len(_engine_urls(cluster)) == 2, "the replacement pod", 120
        )
        await asyncio.sleep(2)
    assert len(load.statuses) > 20 and not load.failures(), (
        f"{len(load.failures())} of {len(load.statuses)} failed: {load.failures()[:10]}"
    )


async def test_a_rolling_update_completes_with_requests_flowing(
    cluster: ControlPlane, client_service: str
) -> None:
    before = _engine_urls(cluster)
    patch = {"spec": {"engine": {"env": [{"name": "SPECGATE_ROLL", "value": "1"}]}}}
    async with Load(client_service) as load:
        await asyncio.sleep(1)
        cluster.kubectl("patch", "sdd", NAME, "--type=merge", "-p", json.dumps(patch))
        await asyncio.to_thread(
            _wait,
            lambda: (
                len(now := _engine_urls(cluster)) == 2
                and not now & before
                and len(_pods(cluster, "engine")) == 2
            ),
            "the engine pods to be replaced",
            180,
        )
        await asyncio.sleep(2)
    assert len(load.statuses) > 20 and not load.failures(), (
        f"{len(load.failures())} of {len(load.statuses)} failed: {load.failures()[:10]}"
    )
    ready = _wait(
        lambda: (
            (got := _get(cluster, "sdd", NAME))
            and next((c for c in got["status"]["conditions"] if c["type"] == "Ready"), {}).get(
                "status"
            )
            == "True"
        ),
        "the resource Ready after the rollout",
    )
    assert ready


async def test_the_router_moves_a_threshold_that_does_not_pay_under_load(
    cluster: ControlPlane, client_service: str, clients: ClientPods
) -> None:
    """Speculating up to batch 64 costs throughput on this engine's profile at the batches a
    load of 24 clients makes; the leading router moves each engine pod's threshold down, as it
    does locally (`make demo`), and the pods and the resource's status show the new value."""
    before = _engine_urls(cluster)
    patch = {"spec": {"speculative": {"control": {"threshold": 64}}}}
    cluster.kubectl("patch", "sdd", NAME, "--type=merge", "-p", json.dumps(patch))

    def replaced() -> bool:
        now = _engine_urls(cluster)
        return len(now) == 2 and not now & before and len(_pods(cluster, "engine")) == 2

    _wait(replaced, "the engine pods at threshold 64", 180)

    def thresholds() -> list[int | None]:
        pods = ((_get(cluster, "sdd", NAME) or {}).get("status") or {}).get("pods") or []
        return [p.get("threshold") for p in pods]

    async with Load(client_service, clients=24) as load:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            values = await asyncio.to_thread(thresholds)
            if len(values) == 2 and all(v is not None and v < 64 for v in values):
                break
            await asyncio.sleep(2)
    values = thresholds()
    assert len(values) == 2 and all(v is not None and v < 64 for v in values), values
    assert not load.failures(), load.failures()[:10]
    running = []  # what the engines themselves run with (asked with the engine key)
    headers = {"Authorization": f"Bearer {_engine_key(cluster)}"}
    for url in _engine_urls(cluster):
        info = json.loads(clients.get("monitoring", f"{url}/server_info", headers)["body"])
        running.append(info["internal_states"][0][contract.THRESHOLD_KEY])
    assert sorted(running) == sorted(thresholds()), (running, thresholds())
    row = cluster.kubectl("get", "sdd", NAME, "--no-headers").stdout.split()
    assert row[4] != "64", row  # NAME REPLICAS READY MODE THRESHOLD AGE


def test_deleting_the_resource_then_helm_uninstall_removes_every_pod(
    cluster: ControlPlane,
) -> None:
    for namespace in ("monitoring", "elsewhere"):  # the tests' own client pods
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
    cluster.kubectl("delete", "sdd", NAME, "--timeout=120s")
    cluster.helm("uninstall", RELEASE, "--namespace", NAMESPACE, "--wait", "--timeout=120s")
    _wait(lambda: not (_get(cluster, "pods", "-A") or {"items": [1]})["items"], "no pods", 120)
