"""The real operator process (`specgate operator`) against a Kubernetes API emulator.

The emulator is kmock, extended in `tests/kube_emulator.py`; its docstring lists what it does
not emulate. What that means here: nothing runs the Deployment controller, so tests that need
ready pods write a Deployment's status themselves, as kube-controller-manager would; the garbage
collector does not run, so "deletion leaves nothing behind" is the operator's own cleanup
(a real cluster would also collect the children through their ownerReferences); admission
webhooks, RBAC and server-side apply's field ownership are not checked.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from specgate_operator import install
from specgate_operator.handlers import FINALIZER

from .conftest import minimal_resource
from .kube_harness import SDD_PATH, Cluster, _free_port, cluster, wait_for
from .test_install import granted

__all__ = ["cluster"]  # the fixture, imported for pytest

pytestmark = pytest.mark.integration

CHILDREN = [
    ("/api/v1/namespaces/default/serviceaccounts", "demo-router"),
    ("/apis/rbac.authorization.k8s.io/v1/namespaces/default/roles", "demo-router"),
    ("/apis/rbac.authorization.k8s.io/v1/namespaces/default/rolebindings", "demo-router"),
    ("/api/v1/namespaces/default/configmaps", "demo-router"),
    ("/api/v1/namespaces/default/services", "demo-engine"),
    ("/apis/apps/v1/namespaces/default/deployments", "demo-engine"),
    ("/apis/policy/v1/namespaces/default/poddisruptionbudgets", "demo-engine"),
    ("/apis/networking.k8s.io/v1/namespaces/default/networkpolicies", "demo-engine"),
    ("/apis/apps/v1/namespaces/default/deployments", "demo-router"),
    ("/apis/policy/v1/namespaces/default/poddisruptionbudgets", "demo-router"),
    ("/api/v1/namespaces/default/services", "demo-router"),
    ("/api/v1/namespaces/default/secrets", "demo-engine-key"),
]


class OperatorProcess:
    """`specgate operator` in a child process, as a cluster would run it."""

    def __init__(self, kubeconfig: Path, log: Path, *flags: str) -> None:
        self.kubeconfig, self.log, self.flags = kubeconfig, log, flags
        self.liveness_port = _free_port()
        self.metrics_port = _free_port()
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "specgate.cli",
            "operator",
            "-n",
            "default",
            "--resync-seconds",
            "1",
            "--liveness",
            f"http://127.0.0.1:{self.liveness_port}/healthz",
            "--metrics-port",
            str(self.metrics_port),
            *self.flags,
            env=env,
            stdout=self.log.open("a"),
            stderr=asyncio.subprocess.STDOUT,
        )

    async def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(sig)
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self.proc = None


@pytest.fixture
async def operator(cluster: Cluster, tmp_path: Path) -> AsyncIterator[OperatorProcess]:
    proc = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log")
    await proc.start()
    try:
        yield proc
    finally:
        await proc.stop()
        print((tmp_path / "operator.log").read_text()[-5000:])  # shown when a test fails


async def _create(cluster: Cluster, resource: dict[str, Any]) -> dict[str, Any]:
    resp = await cluster.api.post(SDD_PATH, json=resource)
    assert resp.status_code == 201, resp.text
    created: dict[str, Any] = resp.json()
    return created


async def _all_children(cluster: Cluster) -> list[dict[str, Any]] | None:
    found = [await cluster.get(collection, name) for collection, name in CHILDREN]
    return None if any(f is None for f in found) else [f for f in found if f]


async def test_create_makes_every_child_with_owner_references_and_status(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    sdd = await _create(cluster, minimal_resource())
    children = await wait_for(lambda: _all_children(cluster), what="all children")
    for child in children:
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner["uid"] == sdd["metadata"]["uid"] and owner["controller"] is True
        assert child["metadata"]["labels"]["specgate.io/deployment"] == "demo"

    async def status_written() -> dict[str, Any] | None:
        obj = await cluster.sdd()
        return (obj or {}).get("status", {}).get("conditions") and obj["status"]  # type: ignore[index]

    status = await wait_for(status_written, what="status conditions")
    types = {c["type"]: c for c in status["conditions"]}
    assert set(types) == {"Ready", "Progressing", "Degraded", "SpeculationControlled"}
    assert types["Ready"]["status"] == "False" and types["Degraded"]["status"] == "False"
    assert status["observedGeneration"] == 1
    assert status["selector"] == "app.kubernetes.io/component=engine,specgate.io/deployment=demo"
    assert status["threshold"] == "8"
    async with httpx.AsyncClient() as client:
        live = await client.get(f"http://127.0.0.1:{operator.liveness_port}/healthz")
    assert live.status_code == 200


def _first_version(history: list[Any], holds: Any = lambda version: True) -> int:
    """The resourceVersion of the first version in an emulator object's history that holds."""
    return min(int(v["metadata"]["resourceVersion"]) for v in history if v is not None and holds(v))


async def test_children_come_only_after_the_finalizer(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    """A child made before kopf's finalizer is on the resource could outlive a deletion that
    on_delete never sees: the resync timer waits for the finalizer. The emulator's
    resourceVersions come from one counter, so its histories give the order."""
    await _create(cluster, minimal_resource())
    await wait_for(lambda: _all_children(cluster), what="all children")
    histories = {
        (key[0].plural, key[2]): obj.history.raw for key, obj in cluster.emulator._objects.items()
    }
    finalized = _first_version(
        histories["specdecodedeployments", "demo"],
        lambda v: FINALIZER in (v["metadata"].get("finalizers") or []),
    )
    children = {(c.rsplit("/", 1)[1], n) for c, n in CHILDREN}
    assert finalized < min(_first_version(histories[key]) for key in children)


async def test_a_json_patch_reaches_a_resource_that_has_no_status_yet(cluster: Cluster) -> None:
    """kopf adds its finalizer with a JSON patch conditioned on the resourceVersion, before
    anything wrote a status: the emulator must not give the resource a null status (the CRD
    schema rejects it, and kopf would take the 422 for a conflict and wait for another event)."""
    created = await _create(cluster, minimal_resource())
    ops = [
        {
            "op": "test",
            "path": "/metadata/resourceVersion",
            "value": created["metadata"]["resourceVersion"],
        },
        {"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]},
    ]
    resp = await cluster.api.patch(
        f"{SDD_PATH}/demo", json=ops, headers={"Content-Type": "application/json-patch+json"}
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["metadata"]["finalizers"] == [FINALIZER] and "status" not in resp.json()


async def test_a_deletion_during_a_resync_leaves_nothing_and_takes_seconds(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    """A slow API server keeps a resync (every second here) under way most of the time, so the
    deletion lands in the middle of one. The resync must not make children again after
    on_delete has deleted them (handlers.Lifecycle), and kopf, which keeps its finalizer until
    the stopping timer has exited, must look again within seconds, not its default minute
    (handlers.TIMER_EXIT_POLL_SECONDS)."""
    await _create(cluster, minimal_resource())
    await wait_for(lambda: _all_children(cluster), what="all children")
    cluster.emulator.apply_delay_seconds = 0.3  # eleven children: over 3 s a reconcile
    await asyncio.sleep(2.0)  # a resync under way
    resp = await cluster.api.delete(f"{SDD_PATH}/demo")
    assert resp.status_code == 200

    async def all_gone() -> bool:
        left = [await cluster.get(c, n) for c, n in CHILDREN]
        return all(x is None for x in left) and await cluster.sdd() is None

    await wait_for(all_gone, timeout=20.0, what="children and resource deleted")


async def test_a_watched_child_changed_by_hand_is_put_back_within_seconds(
    cluster: Cluster, tmp_path: Path
) -> None:
    """With a resync period of ten minutes, only the watch on children can explain a repair
    within seconds: a Deployment scaled by hand, a ConfigMap deleted, a Deployment's status
    reaching the resource's conditions."""
    log = tmp_path / "operator.log"
    operator = OperatorProcess(cluster.kubeconfig, log, "--resync-seconds", "600")
    await operator.start()
    deployments = "/apis/apps/v1/namespaces/default/deployments"
    try:
        await _create(cluster, minimal_resource())
        await wait_for(lambda: _all_children(cluster), what="all children")
        resp = await cluster.api.patch(
            f"{deployments}/demo-engine", json={"spec": {"replicas": 5}},
            headers={"Content-Type": "application/merge-patch+json"},
        )  # fmt: skip
        assert resp.status_code == 200 and resp.json()["spec"]["replicas"] == 5

        async def scaled_back() -> bool:
            engine = await cluster.get(deployments, "demo-engine")
            return engine is not None and engine["spec"]["replicas"] == 1

        await wait_for(scaled_back, timeout=10, what="the engine Deployment scaled back")
        configmaps = "/api/v1/namespaces/default/configmaps"
        assert (await cluster.api.delete(f"{configmaps}/demo-router")).status_code == 200

        async def config_back() -> dict[str, Any] | None:
            return await cluster.get(configmaps, "demo-router")

        await wait_for(config_back, timeout=10, what="the router ConfigMap back")
        await cluster.set_deployment_status("demo-engine", replicas=1, ready=1)
        await cluster.set_deployment_status("demo-router", replicas=2, ready=2)

        async def ready() -> bool:
            cond = await cluster.condition("Ready")
            return bool(cond and cond["status"] == "True")

        await wait_for(ready, timeout=10, what="Ready=True from the Deployments' status")
    finally:
        await operator.stop()
        print(log.read_text()[-5000:])


async def test_ready_follows_the_children(cluster: Cluster, operator: OperatorProcess) -> None:
    await _create(cluster, minimal_resource())
    await wait_for(lambda: _all_children(cluster), what="all children")
    await cluster.set_deployment_status("demo-engine", replicas=1, ready=1)
    await cluster.set_deployment_status("demo-router", replicas=2, ready=2)

    async def ready() -> bool:
        cond = await cluster.condition("Ready")
        return bool(cond and cond["status"] == "True")

    await wait_for(ready, what="Ready=True")
    obj = await cluster.sdd()
    assert obj is not None
    assert obj["status"]["readyReplicas"] == 1 and obj["status"]["router"]["ready"] is True


async def test_spec_change_reaches_the_children(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    await _create(cluster, minimal_resource())
    await wait_for(lambda: _all_children(cluster), what="all children")
    patch = {
        "spec": {
            "replicas": 2,
            "speculative": {"control": {"threshold": 16}},
            "router": {"defaultClass": "throughput"},
        }
    }
    resp = await cluster.api.patch(
        f"{SDD_PATH}/demo", json=patch, headers={"Content-Type": "application/merge-patch+json"}
    )
    assert resp.status_code == 200, resp.text

    async def engine_rolled() -> bool:
        dep = await cluster.get("/apis/apps/v1/namespaces/default/deployments", "demo-engine")
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"] if dep else []
        i = args.index("--speculative-disable-batch-threshold")
        return bool(dep and dep["spec"]["replicas"] == 2 and args[i + 1] == "16")

    await wait_for(engine_rolled, what="engine Deployment updated")
    cm = await cluster.get("/api/v1/namespaces/default/configmaps", "demo-router")
    assert cm is not None
    assert yaml.safe_load(cm["data"]["router.yaml"])["defaultClass"] == "throughput"

    async def observed() -> bool:
        obj = await cluster.sdd()
        return bool(obj and obj["status"]["observedGeneration"] == 2)

    await wait_for(observed, what="observedGeneration 2")


async def test_delete_leaves_nothing_behind(cluster: Cluster, operator: OperatorProcess) -> None:
    await _create(cluster, minimal_resource())
    await wait_for(lambda: _all_children(cluster), what="all children")
    # An unrelated object with a child's name but no owner reference must survive.
    resp = await cluster.api.post(
        "/api/v1/namespaces/default/configmaps",
        json={"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "unrelated"}},
    )
    assert resp.status_code == 201
    resp = await cluster.api.delete(f"{SDD_PATH}/demo")
    assert resp.status_code == 200

    async def all_gone() -> bool:
        left = [await cluster.get(c, n) for c, n in CHILDREN]
        return all(x is None for x in left) and await cluster.sdd() is None

    await wait_for(all_gone, what="children and resource deleted")
    assert await cluster.get("/api/v1/namespaces/default/configmaps", "unrelated") is not None
    # Every call the operator made over the whole lifecycle is allowed by its ClusterRole.
    verbs = {
        "list": "list",
        "watch": "watch",
        "fetch": "get",
        "create": "create",
        "update": "patch",
        "delete": "delete",
    }
    grants = granted(install.OPERATOR_RULES)
    made = set()
    for request in cluster.emulator._requests:  # kmock's request log
        if (
            request.resource is None
            or request.resource.plural is None
            or request.headers.get("User-Agent", "").startswith("python-httpx")
        ):
            continue  # discovery, or the test's own client
        resource = request.resource.plural + (
            f"/{request.subresource}" if request.subresource else ""
        )
        made.add((request.resource.group, resource, verbs[request.action.value.lower()]))
    assert ("apps", "deployments", "patch") in made  # the log really holds the operator's calls
    assert made <= grants, made - grants


async def test_restart_mid_reconcile_converges_without_duplicates(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    await _create(cluster, minimal_resource())

    async def secret() -> dict[str, Any] | None:
        return await cluster.get("/api/v1/namespaces/default/secrets", "demo-engine-key")

    first_secret = await wait_for(secret, what="secret")
    await operator.stop(signal.SIGKILL)  # no graceful shutdown: as if the node died
    await operator.start()
    children = await wait_for(lambda: _all_children(cluster), what="all children")
    uids = {c["metadata"]["uid"] for c in children}
    await asyncio.sleep(2.5)  # two more resync periods of the new process
    again = await _all_children(cluster)
    assert again is not None and {c["metadata"]["uid"] for c in again} == uids
    # The generated key was not regenerated by the second operator.
    latest = await secret()
    assert latest is not None and latest["stringData"] == first_secret["stringData"]
    assert latest["metadata"]["uid"] == first_secret["metadata"]["uid"]
    # Exactly one object per child name in the store.
    stored = [
        key
        for key, obj in cluster.emulator.objects.items()
        if not obj.deleted and key[1] == "default"
    ]
    assert len(stored) == len(set(stored)) == len(CHILDREN) + 1


async def test_unrealisable_resource_is_degraded_until_fixed(
    cluster: Cluster, operator: OperatorProcess
) -> None:
    """Every object the resource names must exist (a Secret, the engine's ServiceAccount) and
    carry the label that lets resources use it; until then no children, and a condition."""
    resource = minimal_resource(
        apiKeySecretRef={"name": "missing"}, engine={"serviceAccountName": "s3-reader"}
    )
    await _create(cluster, resource)

    async def degraded() -> dict[str, Any] | None:
        cond = await cluster.condition("Degraded")
        return cond if cond and cond["status"] == "True" else None

    cond = await wait_for(degraded, what="Degraded=True")
    assert cond["reason"] == "SecretNotFound" and "missing" in cond["message"]
    assert await cluster.get("/apis/apps/v1/namespaces/default/deployments", "demo-engine") is None
    resp = await cluster.api.post(
        "/api/v1/namespaces/default/secrets",
        json={
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "missing"},
            "data": {"api-key": base64.b64encode(b"s3cret").decode()},
        },
    )
    assert resp.status_code == 201

    async def reason() -> str | None:
        cond = await cluster.condition("Degraded")
        return cond["reason"] if cond and cond["status"] == "True" else None

    async def account_missing() -> bool:
        return await reason() == "ServiceAccountNotFound"

    await wait_for(account_missing, timeout=30, what="ServiceAccountNotFound")
    resp = await cluster.api.post(
        "/api/v1/namespaces/default/serviceaccounts",
        json={"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "s3-reader"}},
    )
    assert resp.status_code == 201, resp.text

    # Both exist, but nobody who may write them let resources use them.
    async def unreferable() -> dict[str, Any] | None:
        cond = await cluster.condition("Degraded")
        return cond if cond and cond["reason"] == "PolicyViolation" else None

    cond = await wait_for(unreferable, timeout=30, what="PolicyViolation for the Secret")
    fields = [part.split(":")[0].strip() for part in cond["message"].split("; ")]
    assert fields == ["spec.apiKeySecretRef", "spec.engine.serviceAccountName"]
    assert "specgate.io/referable=true" in cond["message"]
    assert await cluster.get("/apis/apps/v1/namespaces/default/deployments", "demo-engine") is None
    for kind in ("secrets/missing", "serviceaccounts/s3-reader"):
        resp = await cluster.api.patch(
            f"/api/v1/namespaces/default/{kind}",
            json={"metadata": {"labels": {"specgate.io/referable": "true"}}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert resp.status_code == 200, resp.text

    async def healed() -> bool:
        cond = await cluster.condition("Degraded")
        return bool(cond and cond["status"] == "False")

    await wait_for(healed, timeout=60, what="Degraded=False")
    dep = await cluster.get("/apis/apps/v1/namespaces/default/deployments", "demo-engine")
    assert dep is not None
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "s3-reader"


async def test_a_resource_the_policy_refuses_gets_no_children_until_it_complies(
    cluster: Cluster, tmp_path: Path
) -> None:
    """An operator limited to one registry: a resource naming another image gets no
    children and a Degraded condition naming the field; once it names an allowed image,
    it is reconciled."""
    proc = OperatorProcess(
        cluster.kubeconfig, tmp_path / "operator.log", "--allowed-image-prefix=registry.io/llm/"
    )
    await proc.start()
    try:
        await _create(cluster, minimal_resource(engine={"image": "docker.io/evil/sglang:1"}))

        async def refused() -> dict[str, Any] | None:
            cond = await cluster.condition("Degraded")
            return cond if cond and cond["reason"] == "PolicyViolation" else None

        cond = await wait_for(refused, what="Degraded=True, PolicyViolation")
        assert cond["status"] == "True"
        assert cond["message"].startswith("spec.engine.image: 'docker.io/evil/sglang:1'")
        assert await _all_children(cluster) is None
        assert await cluster.get("/api/v1/namespaces/default/secrets", "demo-engine-key") is None
        resp = await cluster.api.patch(
            f"{SDD_PATH}/demo",
            json={"spec": {"engine": {"image": "registry.io/llm/sglang:1"}}},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert resp.status_code == 200, resp.text
        await wait_for(lambda: _all_children(cluster), timeout=30, what="children")
        # The operator's own metrics count both outcomes, and how long reconciles take.
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://127.0.0.1:{proc.metrics_port}/metrics")).text
        counts = {
            outcome: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            for outcome in ("ok", "failed")
            if line.startswith(f'specgate_operator_reconciles_total{{outcome="{outcome}"}}')
        }
        assert counts.get("failed", 0) >= 1 and counts.get("ok", 0) >= 1, text[-2000:]
        assert "specgate_operator_reconcile_seconds_count" in text
    finally:
        await proc.stop()
        print((tmp_path / "operator.log").read_text()[-5000:])
    # Its log is JSON lines, the refusal among them with its level and the field.
    records = [
        json.loads(line)
        for line in (tmp_path / "operator.log").read_text().splitlines()
        if line.startswith("{")
    ]
    refusals = [r for r in records if "spec.engine.image" in r["msg"]]
    assert refusals and refusals[0]["level"] == "warning" and refusals[0]["logger"]


async def test_api_rejects_a_malformed_resource_naming_the_field(cluster: Cluster) -> None:
    resp = await cluster.api.post(SDD_PATH, json=minimal_resource(replicas=-2))
    assert resp.status_code == 422
    assert "spec.replicas" in resp.json()["message"]


LEASE_PATH = "/apis/coordination.k8s.io/v1/namespaces/default/leases"


async def _holder(cluster: Cluster) -> str | None:
    lease = await cluster.get(LEASE_PATH, "specgate-operator")
    return ((lease or {}).get("spec") or {}).get("holderIdentity")


async def _scrape(proc: OperatorProcess, path: str) -> str:
    """The answer at `path` ("" while the process is not listening yet)."""
    async with httpx.AsyncClient() as client:
        port = proc.metrics_port if path == "/metrics" else proc.liveness_port
        try:
            return (await client.get(f"http://127.0.0.1:{port}{path}")).text
        except httpx.ConnectError:
            return ""


async def _threshold_reaches_engine(cluster: Cluster, threshold: int) -> bool:
    dep = await cluster.get("/apis/apps/v1/namespaces/default/deployments", "demo-engine")
    args = (dep or {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers")
    return bool(args) and str(threshold) in args[0]["args"]  # type: ignore[index]


async def _change_reaches_engine(cluster: Cluster, threshold: int, what: str) -> float:
    """Set the resource's threshold; the seconds until the engine Deployment carries it."""
    resp = await cluster.api.patch(
        f"{SDD_PATH}/demo",
        json={"spec": {"speculative": {"control": {"threshold": threshold}}}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert resp.status_code == 200, resp.text
    changed = asyncio.get_running_loop().time()
    await wait_for(lambda: _threshold_reaches_engine(cluster, threshold), timeout=30, what=what)
    return asyncio.get_running_loop().time() - changed


async def test_two_replicas_elect_one_that_reconciles_and_fail_over(
    cluster: Cluster, tmp_path: Path
) -> None:
    """With leader election, one of two operator processes holds the Lease and reconciles; the
    other waits, alive (liveness 200) and serving metrics. A killed leader (no chance to
    release) is replaced once its lease runs out; a stopped one releases it, and the standby
    takes over at its next round. Each failover is timed from a spec change to its child."""
    lease_seconds = 3.0
    flags = ("--leader-election-namespace", "default",
             "--leader-election-lease-seconds", str(lease_seconds))  # fmt: skip
    procs = {
        name: OperatorProcess(
            cluster.kubeconfig, tmp_path / f"{name}.log", *flags, "--identity", name
        )
        for name in ("a", "b")
    }
    try:
        for proc in procs.values():
            await proc.start()
        leader = await wait_for(lambda: _holder(cluster), what="a Lease holder")
        standby = "b" if leader == "a" else "a"
        await _create(cluster, minimal_resource())
        await wait_for(lambda: _all_children(cluster), what="all children")
        assert "specgate_operator_leader 1.0" in await _scrape(procs[leader], "/metrics")
        assert "specgate_operator_leader 0.0" in await _scrape(procs[standby], "/metrics")
        assert '"candidate"' in await _scrape(procs[standby], "/healthz")
        assert "Starting Kopf" not in (tmp_path / f"{standby}.log").read_text()

        await procs[leader].stop(signal.SIGKILL)
        after_kill = await _change_reaches_engine(cluster, 11, "the standby to take over")
        assert await _holder(cluster) == standby
        assert after_kill < lease_seconds + 5, after_kill

        await procs[leader].start()  # back as a candidate
        await wait_for(lambda: _scrape(procs[leader], "/healthz"), what="the candidate")
        await procs[standby].stop(signal.SIGTERM)
        after_stop = await _change_reaches_engine(cluster, 13, "the candidate to take over")
        assert await _holder(cluster) == leader
        assert after_stop < lease_seconds, after_stop  # released: no wait for the lease
        print(f"failover: killed leader {after_kill:.1f} s, stopped leader {after_stop:.1f} s")
    finally:
        for name, proc in procs.items():
            await proc.stop()
            print(name, (tmp_path / f"{name}.log").read_text()[-3000:])
