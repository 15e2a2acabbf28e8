"""specgate against a real kube-apiserver (tests/control_plane.py): the CRD as the API server
registers and explains it, the examples and malformed resources as `kubectl apply` answers
them (the same verdicts as `specgate render`), and the operator installed by `helm install`,
running as a local process with the chart's ServiceAccount token, reconciling a resource whose
children the garbage collector removes after it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from . import control_plane
from .conftest import EXAMPLES, ROOT
from .control_plane import GATEWAY_CRDS, ControlPlane, own_address
from .tools import wait_for

pytestmark = pytest.mark.integration
CHART = ROOT / "charts" / "specgate"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """The control plane with the chart installed by `helm install`: the CRD comes from the
    chart and the API server registers it."""
    with control_plane.running(tmp_path_factory.mktemp("control-plane")) as plane:
        plane.helm(
            "install", "specgate", str(CHART), "--namespace", "specgate-system",
            "--create-namespace",
        )  # fmt: skip
        plane.kubectl(
            "wait", "--for=condition=Established", "--timeout=60s",
            "crd/specdecodedeployments.specgate.io",
        )  # fmt: skip
        plane.forget_discovery()
        # The CRD is one of the chart's templates: its OpenAPI schema (what `kubectl explain`
        # and field validation read) is published a moment after it is Established.
        _wait(lambda: plane.kubectl("explain", "specdecodedeployment", check=False).returncode
              == 0, "the CRD's schema in the API server's OpenAPI")  # fmt: skip
        yield plane


def _wait(check: Any, what: str, seconds: float = 60.0) -> Any:
    return wait_for(check, what, seconds)


def test_kubectl_explain_prints_the_field_docs(cluster: ControlPlane) -> None:
    out = cluster.kubectl("explain", "specdecodedeployment.spec.speculative").stdout
    assert "numSteps" in out and "offStepTokens" in out and "control" in out
    control = cluster.kubectl("explain", "sdd.spec.speculative.control.threshold").stdout
    assert "speculates while its decode batch holds" in " ".join(control.split())  # api.py


def test_every_example_is_accepted_and_listed_with_its_columns(cluster: ControlPlane) -> None:
    cluster.kubectl("create", "namespace", "llm")
    for example in EXAMPLES:
        cluster.kubectl("apply", "-f", str(example))
    listed = cluster.kubectl("get", "sdd", "-A").stdout
    header = listed.splitlines()[0].split()
    assert header[:6] == ["NAMESPACE", "NAME", "REPLICAS", "READY", "MODE", "THRESHOLD"], listed
    names = {yaml.safe_load(e.read_text())["metadata"]["name"] for e in EXAMPLES}
    assert names <= {line.split()[1] for line in listed.splitlines()[1:]}
    for example in EXAMPLES:
        cluster.kubectl("delete", "-f", str(example), "--wait=false")


def _example() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(EXAMPLES[-1].read_text())
    doc["metadata"] = {"name": "bad", "namespace": "default"}
    return doc


def _hub_token(cluster: ControlPlane, namespace: str) -> None:
    """The example's hub token Secret, labelled so resources may name it, as its comment says
    a user creates it."""
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": "hf-token",
            "namespace": namespace,
            "labels": {"specgate.io/referable": "true"},
        },
        "stringData": {"token": "hf_test"},
    }
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(secret))


def _pod_security_warnings(cluster: ControlPlane, namespace: str, doc: dict[str, Any]) -> str:
    """What the API server's PodSecurity admission says about a workload in `namespace` (its
    warn level; a Deployment is warned about, its pods would be refused), by a server-side
    dry run."""
    doc = {**doc, "metadata": {**doc["metadata"], "namespace": namespace}}
    result = cluster.kubectl("apply", "--dry-run=server", "-f", "-", stdin=json.dumps(doc))
    return "\n".join(line for line in result.stderr.splitlines() if "PodSecurity" in line)


def test_rendered_pods_meet_the_pod_security_standards(cluster: ControlPlane) -> None:
    """Judged by the API server's own PodSecurity admission, for every example: the router
    meets `restricted`; the engine meets `baseline`, and `restricted` with
    spec.engine.runAsUser; by default (root in SGLang's image) `restricted` objects to
    nothing but the user."""
    from specgate import api
    from specgate_operator import render

    for level in ("baseline", "restricted"):
        cluster.kubectl("create", "namespace", f"pss-{level}")
        cluster.kubectl("label", "namespace", f"pss-{level}",
                        f"pod-security.kubernetes.io/warn={level}")  # fmt: skip
    for example in EXAMPLES:
        doc = yaml.safe_load(example.read_text())
        for run_as_user in (None, 1000):
            if run_as_user is not None:
                doc["spec"].setdefault("engine", {})["runAsUser"] = run_as_user
            sdd = api.SpecDecodeDeployment.model_validate(doc)
            workloads = {
                m["metadata"]["name"]: m
                for m in render.render(sdd, api_key="k")
                if m["kind"] == "Deployment"
            }
            engine = workloads[render.names(sdd.name)["engine"]]
            router = workloads[render.names(sdd.name)["router"]]
            where = f"{example.name}, runAsUser {run_as_user}"
            assert _pod_security_warnings(cluster, "pss-restricted", router) == "", where
            assert _pod_security_warnings(cluster, "pss-baseline", engine) == "", where
            restricted = _pod_security_warnings(cluster, "pss-restricted", engine)
            if run_as_user is None:
                assert "runAsNonRoot != true" in restricted, where
                assert "allowPrivilegeEscalation" not in restricted, where
                assert "capabilities" not in restricted and "seccomp" not in restricted, where
            else:
                assert restricted == "", (where, restricted)


MALFORMED = [
    ("spec.speculative", lambda d: d["spec"]["speculative"].update(numDraftTokens=7)),
    ("spec.engine", lambda d: d["spec"]["engine"].update(gpusPerPod=3, tensorParallelSize=2)),
    ("spec.speculative.control", lambda d: d["spec"]["speculative"].update(
        control={"threshold": 100, "maxThreshold": 64})),
    ("spec.replicas", lambda d: d["spec"].update(replicas=-1)),
    ("spec.speculative.offStepTokens", lambda d: d["spec"]["speculative"].update(offStepTokens=0)),
    ("spec.router.plugins", lambda d: d["spec"]["router"].update(
        plugins={"filters": ["not-draining"]})),
    ("spec.unknownField", lambda d: d["spec"].update(unknownField=1)),
    ("spec.router.clientAuth", lambda d: d["spec"]["router"].update(clientAuth={"key": "k"})),
    ("spec.router.clientAuth.oidc.algorithms[0]", lambda d: d["spec"]["router"].update(
        clientAuth={"oidc": {"issuer": "https://i", "audience": "a", "algorithms": ["HS256"]}})),
]  # fmt: skip


@pytest.mark.parametrize(("field", "mutate"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_resources_get_the_same_verdict_from_the_api_server_and_render(
    cluster: ControlPlane, field: str, mutate: Any
) -> None:
    doc = _example()
    doc["spec"].setdefault("router", {})
    mutate(doc)
    text = yaml.safe_dump(doc)
    server = cluster.kubectl(
        "apply", "--dry-run=server", "--validate=strict", "-f", "-", stdin=text, check=False
    )
    assert server.returncode != 0, server.stdout
    assert field in server.stderr, server.stderr
    local = subprocess.run(
        [sys.executable, "-m", "specgate.cli", "render", "-f", "-"],
        input=text, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert local.returncode == 2 and field in local.stderr, local.stderr
    # And the valid resource passes both, as does one with OIDC client authentication.
    good = yaml.safe_dump(_example())
    assert cluster.kubectl("apply", "--dry-run=server", "-f", "-", stdin=good).returncode == 0
    doc = _example()
    doc["spec"].setdefault("router", {})["clientAuth"] = {
        "oidc": {"issuer": "https://idp.example", "audience": "specgate", "ca": {"name": "ca"}}
    }
    oidc = yaml.safe_dump(doc)
    assert cluster.kubectl("apply", "--dry-run=server", "-f", "-", stdin=oidc).returncode == 0


class LocalOperator:
    """`specgate operator` in a local process, with a kubeconfig of the chart's ServiceAccount."""

    def __init__(
        self, cluster: ControlPlane, kubeconfig: Path, scope: tuple[str, ...] = ("-A",)
    ) -> None:
        self.cluster, self.kubeconfig, self.scope = cluster, kubeconfig, scope
        self.log = cluster.folder / "operator.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "specgate.cli",
                    "operator",
                    *self.scope,
                    "--resync-seconds",
                    "5",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "KUBECONFIG": str(self.kubeconfig)},
            )

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None


@pytest.fixture(scope="module")
def operator(cluster: ControlPlane) -> Iterator[LocalOperator]:
    """The chart's operator as a local process with a token of the chart's ServiceAccount:
    every call it makes is one the chart's RBAC grants."""
    token = cluster.kubectl(
        "create", "token", "specgate", "-n", "specgate-system", "--duration=2h"
    ).stdout.strip()
    # Elected through a Lease in the release namespace, as the chart runs it: its Role there
    # must grant every call of the election.
    scope = ("-A", "--leader-election-namespace", "specgate-system", "--identity", "test-0")
    local = LocalOperator(cluster, cluster.kubeconfig_for(token, "operator"), scope)
    _hub_token(cluster, "default")
    local.start()
    try:
        yield local
    finally:
        local.stop()


def _get(cluster: ControlPlane, *args: str) -> dict[str, Any] | None:
    result = cluster.kubectl("get", *args, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else None


def test_the_operator_reconciles_with_the_charts_rights_and_children_go_with_the_resource(
    cluster: ControlPlane, operator: LocalOperator
) -> None:
    doc = _example()
    doc["metadata"] = {"name": "demo", "namespace": "default"}
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))
    sdd = _wait(lambda: _get(cluster, "sdd", "demo"), "the resource")
    uid = sdd["metadata"]["uid"]
    children = [
        ("deployment", "demo-engine"),
        ("deployment", "demo-router"),
        ("service", "demo-engine"),
        ("service", "demo-router"),
        ("poddisruptionbudget", "demo-router"),
        ("configmap", "demo-router"),
        ("secret", "demo-engine-key"),
    ]
    for kind, name in children:
        obj = _wait(lambda k=kind, n=name: _get(cluster, k, n), f"{kind}/{name}")
        owners = obj["metadata"].get("ownerReferences", [])
        assert any(o["uid"] == uid and o.get("controller") for o in owners), (kind, owners)
    status = _wait(
        lambda: (s := _get(cluster, "sdd", "demo")) and s.get("status", {}).get("conditions") and s,
        "status conditions",
    )["status"]
    assert status["observedGeneration"] == 1
    assert {c["type"] for c in status["conditions"]} >= {"Ready", "Progressing", "Degraded"}

    # The ReplicaSet controller made the pods, the fake kubelet started them, and the operator
    # saw its Deployments become available.
    def condition(kind: str) -> dict[str, Any]:
        conditions = (_get(cluster, "sdd", "demo") or {}).get("status", {}).get("conditions", [])
        return next((c for c in conditions if c["type"] == kind), {})

    _wait(lambda: condition("Ready").get("status") == "True", "Ready", 90)
    assert condition("Ready")["reason"] == "AllReplicasReady", condition("Ready")
    assert condition("Progressing").get("reason") == "RolloutComplete", condition("Progressing")

    # A spec change rolls the engine Deployment and moves observedGeneration.
    before = _get(cluster, "deployment", "demo-engine")["metadata"]["generation"]  # type: ignore[index]
    cluster.kubectl(
        "patch", "sdd", "demo", "--type=merge",
        "-p", '{"spec": {"speculative": {"control": {"threshold": 12}}}}',
    )  # fmt: skip
    _wait(lambda: _get(cluster, "deployment", "demo-engine")["metadata"]["generation"] > before,  # type: ignore[index]
          "the engine Deployment to roll")  # fmt: skip
    _wait(lambda: _get(cluster, "sdd", "demo")["status"].get("observedGeneration") == 2,  # type: ignore[index]
          "observedGeneration 2")  # fmt: skip

    # The chart's role, and nothing beyond it.
    as_operator = operator.kubeconfig
    can = cluster.kubectl("auth", "can-i", "delete", "nodes", kubeconfig=as_operator, check=False)
    assert can.stdout.strip() == "no"
    refused = cluster.kubectl("get", "nodes", kubeconfig=as_operator, check=False)
    assert refused.returncode != 0 and "forbidden" in refused.stderr.lower()

    lease = _get(cluster, "lease", "specgate-operator", "-n", "specgate-system")
    assert lease is not None and lease["spec"]["holderIdentity"] == "test-0"

    # A restarted operator converges on what is there: one of each child, no conflicts.
    operator.stop()
    operator.start()
    time.sleep(8)  # a resync or more
    engines = _get(cluster, "deployments", "-l", "app.kubernetes.io/instance=demo")
    assert engines is not None and len(engines["items"]) == 2  # engine and router, once each
    log = operator.log.read_text(errors="replace")
    # A refused call shows as an HTTP status or its reason, never as digits inside a UID.
    refused = re.search(r"\b403\b|Forbidden|conflict", log, re.IGNORECASE)
    assert refused is None, log[max(0, refused.start() - 1500) : refused.end() + 1500]

    cluster.kubectl("delete", "sdd", "demo", "--timeout=60s")
    for kind, name in children:
        _wait(lambda k=kind, n=name: _get(cluster, k, n) is None, f"{kind}/{name} to go", 90)


def test_the_autoscaling_example_targets_the_resources_scale_subresource(
    cluster: ControlPlane,
) -> None:
    """The HPA example is accepted by the API server, and what it scales, the resource's
    scale subresource, reads and writes spec.replicas with the engine pods' selector."""
    doc = yaml.safe_load((ROOT / "examples" / "tiny-single-gpu.yaml").read_text())
    doc["metadata"] = {"name": "llama-8b", "namespace": "default"}
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))
    cluster.kubectl("apply", "-f", str(ROOT / "examples" / "autoscaling" / "hpa.yaml"))
    hpa = _get(cluster, "hpa", "llama-8b")
    assert hpa is not None and hpa["spec"]["scaleTargetRef"]["kind"] == "SpecDecodeDeployment"
    scale = json.loads(
        cluster.kubectl("get", "--raw", "/apis/specgate.io/v1alpha1/namespaces/default/"
                        "specdecodedeployments/llama-8b/scale").stdout
    )  # fmt: skip
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 1
    cluster.kubectl("scale", "sdd", "llama-8b", "--replicas=2")
    assert _get(cluster, "sdd", "llama-8b")["spec"]["replicas"] == 2  # type: ignore[index]
    cluster.kubectl("delete", "hpa", "llama-8b")
    cluster.kubectl("delete", "sdd", "llama-8b", "--wait=false")


def test_an_operator_limited_to_a_namespace_reconciles_there_and_can_do_nothing_elsewhere(
    cluster: ControlPlane,
) -> None:
    """A second release of the chart watching one namespace: its ServiceAccount may manage
    children there and nowhere else (no Secret of another namespace, no Deployment), and the
    operator, run with that ServiceAccount's token, reconciles a resource there."""
    for ns in ("tenant-a", "tenant-b"):
        cluster.kubectl("create", "namespace", ns)
    cluster.helm(
        "install", "scoped", str(CHART), "--namespace", "scoped-system", "--create-namespace",
        "--set", "crds.enabled=false", "--set", "operator.watchNamespaces={tenant-a}",
    )  # fmt: skip
    token = cluster.kubectl(
        "create", "token", "scoped-specgate", "-n", "scoped-system", "--duration=1h"
    ).stdout.strip()
    scoped = cluster.kubeconfig_for(token, "scoped-operator")

    def can(verb: str, what: str, ns: str) -> bool:
        result = cluster.kubectl("auth", "can-i", verb, what, "-n", ns, kubeconfig=scoped,
                                 check=False)  # fmt: skip
        return result.stdout.strip() == "yes"

    assert can("create", "deployments", "tenant-a") and can("get", "secrets", "tenant-a")
    for ns in ("tenant-b", "default", "specgate-system"):
        assert not can("get", "secrets", ns), ns
        assert not can("create", "deployments", ns), ns
        assert not can("list", "specdecodedeployments", ns), ns
    local = LocalOperator(cluster, scoped, scope=("-n", "tenant-a"))
    local.start()
    try:
        _hub_token(cluster, "tenant-a")
        doc = _example()
        doc["metadata"] = {"name": "scoped", "namespace": "tenant-a"}
        cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))
        _wait(lambda: _get(cluster, "deployment", "scoped-engine", "-n", "tenant-a"),
              "the engine Deployment in tenant-a")  # fmt: skip
        cluster.kubectl("delete", "sdd", "scoped", "-n", "tenant-a", "--timeout=60s")
    finally:
        local.stop()
        cluster.helm("uninstall", "scoped", "--namespace", "scoped-system")


def test_the_gateway_api_accepts_the_route_the_operator_makes_with_the_charts_rights(
    cluster: ControlPlane, operator: LocalOperator
) -> None:
    """The Gateway API's CRDs and the Inference Extension's InferencePool CRD, from their Go
    modules, installed: the HTTPRoute the operator renders for spec.router.httpRoute passes
    the API server's own validation of it (schema and CEL rules), is owned by the resource,
    follows a spec change, and goes with the resource."""
    crds = sorted(GATEWAY_CRDS.glob("*.yaml"))
    assert len(crds) >= 7, f"Gateway API CRDs missing in {GATEWAY_CRDS}: run `make tools`"
    for crd in crds:
        cluster.kubectl("apply", "--server-side", "-f", str(crd))
    for name in (
        "httproutes.gateway.networking.k8s.io",
        "inferencepools.inference.networking.k8s.io",
    ):
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
    cluster.forget_discovery()
    doc = _example()
    doc["metadata"] = {"name": "gated", "namespace": "default"}
    doc["spec"]["router"]["httpRoute"] = {
        "parentRefs": [{"name": "inference-gateway", "sectionName": "http"}],
        "hostnames": ["llm.example.com"],
    }
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))
    uid = _wait(lambda: _get(cluster, "sdd", "gated"), "the resource")["metadata"]["uid"]
    route = _wait(lambda: _get(cluster, "httproute", "gated-router"), "the HTTPRoute", 60)
    assert [o["uid"] for o in route["metadata"]["ownerReferences"]] == [uid]
    assert route["spec"]["rules"][0]["backendRefs"][0]["name"] == "gated-router"
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    cluster.kubectl("patch", "sdd", "gated", "--type=merge", "-p", json.dumps(
        {"spec": {"router": {"httpRoute": {"hostnames": ["chat.example.com"]}}}}))  # fmt: skip
    _wait(lambda: (_get(cluster, "httproute", "gated-router") or {}).get("spec", {})
          .get("hostnames") == ["chat.example.com"], "the route to follow the spec")  # fmt: skip
    # The API server's own checks of a route, the same ones the operator's route passed.
    bad = {**route, "metadata": {"name": "bad-route", "namespace": "default"}}
    bad["spec"] = {**route["spec"], "hostnames": ["Not A Hostname"]}
    refused = cluster.kubectl("apply", "-f", "-", stdin=json.dumps(bad), check=False)
    assert refused.returncode != 0 and "hostnames" in refused.stderr, refused.stderr
    cluster.kubectl("delete", "sdd", "gated", "--timeout=60s")
    _wait(lambda: _get(cluster, "httproute", "gated-router") is None, "the route to go", 90)


async def test_the_router_discovers_leads_and_publishes_with_its_own_service_account(
    cluster: ControlPlane, operator: LocalOperator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two router replicas, in process, with a token of the router ServiceAccount the operator
    made (so with the Role it made). They follow the engine pods through the whole chain: the
    operator's Deployment, its pods (started by the fake kubelet at this machine's address,
    where a simulated engine listens on the resource's engine port), the EndpointSlice
    controller's slices, as pods are added, turn unready and go. They elect one leader
    through the Lease, hand over when the leader stops, and the leader publishes the pods to
    the resource's status."""
    import asyncio

    from specgate_router.settings import RouterSettings
    from specgate_router.state import RouterState
    from specgate_sim import profile as profiles
    from specgate_sim.cluster import SimCluster, free_ports
    from specgate_sim.pod import PodSettings

    address = own_address()
    port = free_ports(1, address)[0]
    doc = _example()
    doc["metadata"] = {"name": "routed", "namespace": "default"}
    doc["spec"]["engine"]["port"] = port
    doc["spec"]["replicas"] = 1
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))
    _wait(lambda: _get(cluster, "role", "routed-router"), "the router's Role")
    token = cluster.kubectl("create", "token", "routed-router", "--duration=1h").stdout.strip()
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig_for(token, "router")))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    settings = RouterSettings.model_validate(
        {
            "model": "m",
            "discovery": {
                "kubernetes": {"namespace": "default", "service": "routed-engine", "port": port}
            },
            "control": {"scrapeIntervalSeconds": 0.2},
            "leaderElection": {
                "leaseName": "routed-router-leader",
                "namespace": "default",
                "leaseSeconds": 3,
                "renewSeconds": 0.5,
            },
            "statusTarget": {"namespace": "default", "name": "routed", "intervalSeconds": 1},
        }
    )
    engine = SimCluster(
        profiles.load("rtx-pro-6000-x8"),
        1,
        base_port=port,
        host=address,
        settings=PodSettings(model="m"),
    )
    selector = "app.kubernetes.io/instance=routed,app.kubernetes.io/component=engine"

    def ready_engine_pods() -> set[str]:
        listed = _get(cluster, "pods", "-l", selector) or {"items": []}
        return {
            p["metadata"]["name"]
            for p in listed["items"]
            if not p["metadata"].get("deletionTimestamp")
            and any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in (p.get("status") or {}).get("conditions") or []
            )
        }

    def routed_pods(state: RouterState) -> set[str]:
        return {name for name, pod in state.pods.items() if not pod.draining}

    def scale(replicas: int) -> None:
        cluster.kubectl("patch", "sdd", "routed", "--type=merge",
                        "-p", json.dumps({"spec": {"replicas": replicas}}))  # fmt: skip

    async def until(check: Any, what: str, seconds: float = 30.0) -> None:
        deadline = asyncio.get_running_loop().time() + seconds
        while not check():
            assert asyncio.get_running_loop().time() < deadline, f"timed out: {what}"
            await asyncio.sleep(0.2)

    replicas = [RouterState(settings, identity=name) for name in ("replica-a", "replica-b")]

    async def following(what: str, count: int) -> None:
        def agree() -> bool:
            ready = ready_engine_pods()
            return len(ready) == count and all(routed_pods(r) == ready for r in replicas)

        await until(agree, what, seconds=45)

    async with engine:
        for state in replicas:
            await state.start()
        try:
            await until(lambda: all(r.kube is not None for r in replicas), "connected")
            await following("the first engine pod", 1)
            scale(2)
            await following("a second engine pod", 2)
            unready = sorted(ready_engine_pods())[0]
            cluster.kubectl("patch", "pod", unready, "--subresource=status", "--type=merge",
                            "-p", json.dumps({"status": {"conditions": [
                                {"type": "Ready", "status": "False"}]}}))  # fmt: skip
            await following("one pod unready", 1)
            scale(1)
            await until(lambda: len((_get(cluster, "pods", "-l", selector) or {"items": []})
                                    ["items"]) == 1, "scaled down", seconds=45)  # fmt: skip
            await following("back to one pod", 1)
            await until(lambda: sum(r.is_leader for r in replicas) == 1, "one leader")
            await asyncio.sleep(1.5)  # renewals: still one
            leaders = [r for r in replicas if r.is_leader]
            assert len(leaders) == 1
            await until(
                lambda: bool(
                    ((_get(cluster, "sdd", "routed") or {}).get("status") or {}).get("pods")
                ),
                "status.pods published",
            )
            (follower,) = [r for r in replicas if r is not leaders[0]]
            await leaders[0].stop()
            replicas.remove(leaders[0])
            started = asyncio.get_running_loop().time()
            await until(lambda: follower.is_leader, "takeover", seconds=15)
            assert asyncio.get_running_loop().time() - started < 3 + 2  # lease + a renewal
        finally:
            for state in replicas:
                await state.stop()
    as_router = cluster.folder / "kubeconfig-router"
    for verb in ("list", "watch"):
        allowed = cluster.kubectl("auth", "can-i", verb, "endpointslices", kubeconfig=as_router)
        assert allowed.stdout.strip() == "yes"
    denied = cluster.kubectl("auth", "can-i", "list", "secrets", kubeconfig=as_router, check=False)
    assert denied.stdout.strip() == "no"
    lease = _get(cluster, "lease", "routed-router-leader")
    assert lease is not None and lease["spec"]["holderIdentity"] == follower.identity
    cluster.kubectl("delete", "sdd", "routed", "--wait=false")


def _prometheus_version() -> str:
    from .tools import tool

    out = subprocess.run([tool("prometheus"), "--version"], capture_output=True, text=True)
    words = (out.stdout + out.stderr).split()
    return "v" + words[words.index("version") + 1].split("+")[0]


async def test_the_charts_pod_monitors_scrape_the_pods_and_every_dashboard_query_has_data(
    cluster: ControlPlane, operator: LocalOperator, tmp_path: Path
) -> None:
    """Monitoring wired end to end, with the Prometheus Operator's part played by its own code:
    the chart's PodMonitors (as `helm template` renders them with a selector label) go through
    the Operator's configuration generator (scripts/prometheus-config, built from its Go
    module), and a real Prometheus runs that configuration: it discovers the operator's pods
    through this API server (the fake kubelet runs them at this machine's address, where a
    router and a simulated engine listen on the resource's ports), scrapes them, and labels
    their series as the dashboards expect. Every dashboard query, with its variables set to
    this resource, returns data. Not covered: the Operator's reconcile loop itself (its
    StatefulSet, config reloader and Secret), for which the test substitutes the reloader's
    $(SHARD) and $(POD_NAME) as it would; and Prometheus's own Kubernetes discovery, which
    Debian's build leaves out: the pods this API server lists reach Prometheus through a file
    with the meta labels that discovery gives them (`_pod_role_targets`)."""
    import asyncio

    import httpx

    from specgate import dashboards
    from specgate_sim import profile as profiles
    from specgate_sim.cluster import SimCluster, free_ports
    from specgate_sim.loadgen import LoadGenerator, Phase
    from specgate_sim.pod import PodSettings

    from .router_harness import run_router
    from .tools import query_range, tool

    address = own_address()
    engine_port, router_port = free_ports(2, address)
    doc = _example()
    doc["metadata"] = {"name": "watched", "namespace": "default"}
    doc["spec"]["replicas"] = 1
    doc["spec"]["engine"]["port"] = engine_port
    doc["spec"]["router"]["port"] = router_port
    cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(doc))

    def running(component: str) -> bool:
        selector = f"app.kubernetes.io/instance=watched,app.kubernetes.io/component={component}"
        listed = _get(cluster, "pods", "-l", selector) or {"items": []}
        return any((p.get("status") or {}).get("phase") == "Running" for p in listed["items"])

    try:
        _wait(lambda: running("engine") and running("router"), "the engine and router pods")
    except AssertionError:
        status = (_get(cluster, "sdd", "watched") or {}).get("status")
        pods = cluster.kubectl("get", "pods,deployments", "-A", check=False).stdout
        raise AssertionError(f"no running pods: status {status}\n{pods}") from None

    monitors = tmp_path / "monitors.yaml"
    monitors.write_text(
        cluster.helm(
            "template", "specgate", str(CHART), "--namespace", "specgate-system",
            "--api-versions", "monitoring.coreos.com/v1/PodMonitor",
            "--set", "monitoring.podMonitor.enabled=true",
            "--set", "monitoring.podMonitor.labels.release=watching",
            "--set", "monitoring.podMonitor.interval=1s",
        ).stdout
    )  # fmt: skip
    token = tmp_path / "token"
    token.write_text(cluster.admin_token)
    prometheus_resource = tmp_path / "prometheus.yaml"
    prometheus_resource.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "monitoring.coreos.com/v1",
                "kind": "Prometheus",
                "metadata": {"name": "k8s", "namespace": "monitoring"},
                "spec": {
                    "version": _prometheus_version(),
                    "scrapeInterval": "1s",
                    "evaluationInterval": "1s",
                    "podMonitorSelector": {"matchLabels": {"release": "watching"}},
                    "serviceMonitorSelector": {"matchLabels": {"release": "watching"}},
                    "apiserverConfig": {
                        "host": cluster.server,
                        "bearerTokenFile": str(token),
                        "tlsConfig": {"insecureSkipVerify": True},
                    },
                },
            }
        )
    )
    generated = subprocess.run(
        [tool("prometheus-config"), str(prometheus_resource), str(monitors)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "3 PodMonitors" in generated.stderr, generated.stderr
    config = yaml.safe_load(
        generated.stdout.replace("$(SHARD)", "0").replace("$(POD_NAME)", "prometheus-0")
    )
    listed = _get(cluster, "pods", "-A")
    assert listed is not None
    for i, job in enumerate(config["scrape_configs"]):
        (sd,) = job.pop("kubernetes_sd_configs")
        assert sd["role"] == "pod" and sd["api_server"] == cluster.server, sd
        names = (sd.get("namespaces") or {}).get("names")
        pods = [p for p in listed["items"] if not names or p["metadata"]["namespace"] in names]
        targets = tmp_path / f"targets-{i}.json"
        targets.write_text(json.dumps(_pod_role_targets(pods)))
        job["file_sd_configs"] = [{"files": [str(targets)]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prom_port = free_ports(1)[0]
    prometheus = subprocess.Popen(
        [
            tool("prometheus"),
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{prom_port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "prometheus.log", "wb"),  # noqa: SIM115 (the process writes it)
    )
    url = f"http://127.0.0.1:{prom_port}"
    settings = PodSettings(api_key="k", threshold=8, model="m", time_scale=1.0, seed=2)
    engine = SimCluster(
        profiles.load("rtx-pro-6000-x8"), 1, base_port=engine_port, host=address,
        settings=settings,
    )  # fmt: skip
    router_config = {
        "model": "m",
        "backends": [f"http://{address}:{engine_port}"],
        "engineApiKey": "k",
        "control": {"cooldownSeconds": 2, "hysteresis": 1, "scrapeIntervalSeconds": 0.25},
    }

    def targets_up() -> dict[str, dict[str, str]]:
        active = httpx.get(url + "/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        return {t["labels"]["job"]: t["labels"] for t in active if t["health"] == "up"}

    try:
        async with engine, run_router(router_config, port=router_port, host=address) as router:
            up: dict[str, dict[str, str]] = {}
            for _ in range(120):
                try:
                    up = targets_up()
                except (httpx.HTTPError, KeyError, ValueError):
                    up = {}
                if {"specgate-system/specgate-router", "specgate-system/specgate-engine"} <= set(
                    up
                ):
                    break
                await asyncio.sleep(0.5)
            else:
                raise AssertionError(
                    f"targets not up: {up}\n{(tmp_path / 'prometheus.log').read_text()[-2000:]}"
                )
            for job in ("specgate-system/specgate-router", "specgate-system/specgate-engine"):
                labels = up[job]
                assert labels["namespace"] == "default" and labels["pod"].startswith("watched-")
                assert labels.get("specgate_io_deployment") == "watched", labels
            start = time.time()
            await LoadGenerator(
                router.url,
                "m",
                [Phase("ramp", 10, 3, 12, ramp_from=(1, 1)), Phase("calm", 4, 1, 0)],
            ).run()
            await asyncio.sleep(3)  # a few more scrapes
            end = time.time()

        boards = {
            path.stem: json.loads(path.read_text()) for path in CHART.glob("dashboards/*.json")
        }
        assert set(boards) == set(dashboards.DASHBOARDS)
        # GPU panels need dcgm-exporter and operator panels the operator's pod, neither of
        # which runs here: test_dashboards.py queries those.
        elsewhere = {
            q.expr
            for source in ("dcgm-exporter", "operator")
            for _, panel in dashboards.panels_from(source)
            for q in panel.queries
        }
        queries = [
            (uid, panel["title"], target["expr"])
            for uid, board in boards.items()
            for panel in board["panels"]
            for target in panel.get("targets", [])
            if "expr" in target and target["expr"] not in elsewhere
        ]
        assert len(queries) >= 10
        window = {"url": url, "start": start, "end": end}
        empty = [
            f"{uid}: {title}: {expr}"
            for uid, title, expr in queries
            if not query_range(window, expr, namespace="default", deployment="watched")
        ]
        assert not empty, "\n".join(empty)
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=20)
    cluster.kubectl("delete", "sdd", "watched", "--timeout=60s")

    def children() -> list[Any]:
        listed = _get(cluster, "deployments", "-l", "app.kubernetes.io/instance=watched")
        return [None] if listed is None else list(listed["items"])

    _wait(lambda: not children(), "the resource's children collected")


def _label_name(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _pod_role_targets(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What Prometheus's Kubernetes discovery (role: pod) makes of `pods`: a target per
    container port, at the pod's IP, with the `__meta_kubernetes_*` labels its documentation
    lists for that role (the ones the Prometheus Operator's relabelings read, and more)."""
    groups = []
    for pod in pods:
        meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
        ready = any(
            c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or []
        )
        common = {
            "__meta_kubernetes_namespace": meta["namespace"],
            "__meta_kubernetes_pod_name": meta["name"],
            "__meta_kubernetes_pod_uid": meta.get("uid", ""),
            "__meta_kubernetes_pod_ip": status.get("podIP", ""),
            "__meta_kubernetes_pod_host_ip": status.get("hostIP", ""),
            "__meta_kubernetes_pod_node_name": spec.get("nodeName", ""),
            "__meta_kubernetes_pod_phase": status.get("phase", ""),
            "__meta_kubernetes_pod_ready": str(ready).lower(),
        }
        for key, value in (meta.get("labels") or {}).items():
            common[f"__meta_kubernetes_pod_label_{_label_name(key)}"] = value
            common[f"__meta_kubernetes_pod_labelpresent_{_label_name(key)}"] = "true"
        for key, value in (meta.get("annotations") or {}).items():
            common[f"__meta_kubernetes_pod_annotation_{_label_name(key)}"] = value
            common[f"__meta_kubernetes_pod_annotationpresent_{_label_name(key)}"] = "true"
        for owner in meta.get("ownerReferences") or []:
            if owner.get("controller"):
                common["__meta_kubernetes_pod_controller_kind"] = owner["kind"]
                common["__meta_kubernetes_pod_controller_name"] = owner["name"]
        containers = [(c, "false") for c in spec.get("containers") or []]
        containers += [(c, "true") for c in spec.get("initContainers") or []]
        for container, init in containers:
            for port in container.get("ports") or []:
                labels = {
                    **common,
                    "__meta_kubernetes_pod_container_name": container["name"],
                    "__meta_kubernetes_pod_container_image": container.get("image", ""),
                    "__meta_kubernetes_pod_container_init": init,
                    "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                    "__meta_kubernetes_pod_container_port_protocol": port.get("protocol", "TCP"),
                }
                address = f"{status.get('podIP', '')}:{port['containerPort']}"
                groups.append({"targets": [address], "labels": labels})
    return groups


def test_helm_upgrade_then_uninstall_leaves_only_the_documented_crd(
    cluster: ControlPlane, tmp_path: Path
) -> None:
    """helm upgrade with changed values and a changed CRD brings both (the CRD is a template,
    not in crds/, which Helm never upgrades); helm uninstall removes the chart's objects and
    leaves the CRD (and so every resource) by its keep policy, as the README says."""
    import shutil

    chart = tmp_path / "specgate"
    shutil.copytree(CHART, chart)
    crd_file = chart / "files" / "specdecodedeployments.specgate.io.yaml"
    crd = yaml.safe_load(crd_file.read_text())
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    columns.append({"name": "Note", "type": "string", "jsonPath": ".metadata.name"})
    crd_file.write_text(yaml.safe_dump(crd, sort_keys=False))
    cluster.helm(
        "upgrade", "specgate", str(chart), "-n", "specgate-system",
        "--set", "operator.resyncSeconds=12",
    )  # fmt: skip
    deployment = _get(cluster, "deployment", "-n", "specgate-system", "-l",
                      "app.kubernetes.io/name=specgate")  # fmt: skip
    assert deployment is not None
    args = " ".join(deployment["items"][0]["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "12" in args  # the new value reached the operator's Deployment
    registered = _get(cluster, "crd", "specdecodedeployments.specgate.io")
    assert registered is not None
    names = [c["name"] for c in registered["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert "Note" in names  # the upgrade brought the new schema

    def installed() -> list[str]:
        return cluster.kubectl(
            "get", "deployments,serviceaccounts,clusterroles,clusterrolebindings",
            "-A", "-l", "app.kubernetes.io/name=specgate", "-o", "name",
        ).stdout.split()  # fmt: skip

    before = installed()
    assert any(n.startswith("clusterrole.") for n in before), before  # the selector finds them
    assert any(n.startswith("deployment.") for n in before), before
    cluster.helm("uninstall", "specgate", "-n", "specgate-system", "--wait")
    assert installed() == []
    assert _get(cluster, "crd", "specdecodedeployments.specgate.io") is not None
