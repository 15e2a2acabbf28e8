"""The router's Kubernetes loops against the API emulator (tests/kube_emulator.py): Lease
leader election, EndpointSlice discovery and status publishing.

The emulator does not enforce resourceVersion preconditions, so the conflict path of the Lease
update (two candidates racing on one expired lease) is not exercised here; with a real API
server the second update fails with 409 and that candidate stays a follower.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from specgate import lease
from specgate.kube import Credentials, KubeClient
from specgate_router import cluster as router_cluster
from specgate_router.settings import LeaderElection, RouterSettings
from specgate_router.state import RouterState
from specgate_sim import profile as profiles
from specgate_sim.cluster import SimCluster, free_ports
from specgate_sim.pod import PodSettings

from .conftest import minimal_resource
from .kube_harness import SDD_PATH, Cluster, cluster, wait_for

__all__ = ["cluster"]
pytestmark = pytest.mark.integration


@pytest.fixture
def kubeconfig(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> Cluster:
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return cluster


@contextlib.asynccontextmanager
async def router(settings: dict[str, Any], identity: str) -> AsyncIterator[RouterState]:
    state = RouterState(RouterSettings.model_validate(settings), identity=identity)
    await state.start()
    try:
        yield state
    finally:
        await state.stop()


def lease_settings(backends: list[str]) -> dict[str, Any]:
    return {
        "model": "m",
        "backends": backends,
        "leaderElection": {
            "leaseName": "demo-router-leader",
            "namespace": "default",
            "leaseSeconds": 2,
            "renewSeconds": 0.3,
        },
    }


async def test_lease_acquire_renew_and_takeover(kubeconfig: Cluster) -> None:
    kube = KubeClient(Credentials(server=str(kubeconfig.api.base_url).rstrip("/")))
    cfg = LeaderElection(lease_name="l", namespace="default", lease_seconds=2, renew_seconds=1)
    try:
        a, b = lease.LeaseObservation(), lease.LeaseObservation()
        assert await lease.try_acquire(kube, cfg, "a", a)
        assert not await lease.try_acquire(kube, cfg, "b", b)
        assert await lease.try_acquire(kube, cfg, "a", a)  # renew
        assert not await lease.try_acquire(kube, cfg, "b", b)  # b sees it renewed
        await asyncio.sleep(2.5)  # a stops renewing
        assert await lease.try_acquire(kube, cfg, "b", b)
        held = await kube.get("coordination.k8s.io/v1", "Lease", "default", "l")
        assert held["spec"]["holderIdentity"] == "b" and held["spec"]["leaseTransitions"] == 1
    finally:
        await kube.aclose()


async def test_exactly_one_replica_leads_and_a_new_one_takes_over(kubeconfig: Cluster) -> None:
    settings = RouterSettings.model_validate(lease_settings(["http://127.0.0.1:9"]))
    replicas = [RouterState(settings, identity=name) for name in ("replica-a", "replica-b")]
    for state in replicas:
        await state.start()
    try:
        await wait_for(lambda: _async(any(r.is_leader for r in replicas)), what="a leader")
        await asyncio.sleep(1.0)  # several renew rounds: still exactly one
        leaders = [r for r in replicas if r.is_leader]
        assert len(leaders) == 1
        leader = leaders[0]
        (follower,) = [r for r in replicas if r is not leader]
        await leader.stop()  # its pod died: no more renewals
        replicas.remove(leader)
        started = asyncio.get_running_loop().time()
        await wait_for(lambda: _async(follower.is_leader), timeout=10, what="takeover")
        assert asyncio.get_running_loop().time() - started < 5.0
    finally:
        for state in replicas:
            await state.stop()


async def _async(value: Any) -> Any:
    return value


async def test_endpointslice_discovery_routes_to_ready_pods_only(kubeconfig: Cluster) -> None:
    port = free_ports(1)[0]
    prof = profiles.load("rtx-pro-6000-x8")
    ready = SimCluster(
        prof, 1, base_port=port, host="127.0.0.2", settings=PodSettings(model="m", time_scale=10)
    )
    later = SimCluster(
        prof, 1, base_port=port, host="127.0.0.3", settings=PodSettings(model="m", time_scale=10)
    )

    def endpoint(ip: str, name: str, is_ready: bool) -> dict[str, Any]:
        return {
            "addresses": [ip],
            "conditions": {"ready": is_ready},
            "targetRef": {"kind": "Pod", "name": name, "namespace": "default"},
        }

    slice_ = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": "demo-engine-abc",
            "namespace": "default",
            "labels": {"kubernetes.io/service-name": "demo-engine"},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port}],
        "endpoints": [
            endpoint("127.0.0.2", "engine-0", True),
            endpoint("127.0.0.3", "engine-1", False),
        ],
    }
    path = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
    assert (await kubeconfig.api.post(path, json=slice_)).status_code == 201
    settings = {
        "model": "m",
        "discovery": {
            "kubernetes": {"namespace": "default", "service": "demo-engine", "port": port}
        },
        "control": {"scrapeIntervalSeconds": 0.1},
    }
    async with ready, later, router(settings, "r") as state:
        await wait_for(lambda: _async(set(state.pods) == {"engine-0"}), what="ready pod found")
        patch = {
            "endpoints": [
                endpoint("127.0.0.2", "engine-0", True),
                endpoint("127.0.0.3", "engine-1", True),
            ]
        }
        resp = await kubeconfig.api.patch(
            f"{path}/demo-engine-abc",
            json=patch,
            headers={"Content-Type": "application/merge-patch+json"},
        )
        assert resp.status_code == 200
        await wait_for(
            lambda: _async(set(state.pods) == {"engine-0", "engine-1"}),
            what="watch added the newly ready pod",
        )
        assert state.pods["engine-1"].url == f"http://127.0.0.3:{port}"
        await wait_for(
            lambda: _async(all(p.healthy for p in state.pods.values())), what="both scraped"
        )
        resp = await kubeconfig.api.delete(f"{path}/demo-engine-abc")
        await wait_for(lambda: _async(not state.pods), what="pods dropped with the slice")


async def test_router_publishes_pod_state_to_the_resource(kubeconfig: Cluster) -> None:
    assert (await kubeconfig.api.post(SDD_PATH, json=minimal_resource())).status_code == 201
    prof = profiles.load("rtx-pro-6000-x8")
    async with SimCluster(prof, 2, settings=PodSettings(model="m", threshold=5)) as pods:
        settings = {
            "model": "m",
            "backends": pods.urls,
            "control": {"scrapeIntervalSeconds": 0.1},
            "statusTarget": {"namespace": "default", "name": "demo", "intervalSeconds": 0.3},
        }
        async with router(settings, "r"):

            async def published() -> dict[str, Any] | None:
                obj = await kubeconfig.sdd()
                status = (obj or {}).get("status") or {}
                return status if len(status.get("pods", [])) == 2 else None

            status = await wait_for(published, what="status.pods")
    assert {p["threshold"] for p in status["pods"]} == {5}
    assert status["threshold"] == "5"
    cond = next(c for c in status["conditions"] if c["type"] == "SpeculationControlled")
    assert cond["status"] == "True" and "2/2" in cond["message"]


async def test_ready_endpoints_is_pure() -> None:
    slices = [
        {
            "endpoints": [
                {
                    "addresses": ["10.0.0.1"],
                    "conditions": {"ready": True},
                    "targetRef": {"name": "a"},
                },
                {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                {"addresses": ["fd00::3"], "conditions": {"ready": True, "terminating": False}},
                {"addresses": ["10.0.0.4"], "conditions": {"ready": True, "terminating": True}},
            ]
        }
    ]
    assert router_cluster.ready_endpoints(slices, 30000) == {
        "a": "http://10.0.0.1:30000",
        "fd00::3": "http://[fd00::3]:30000",
    }


def test_threshold_summary() -> None:
    assert router_cluster.threshold_summary([4, 4]) == "4"
    assert router_cluster.threshold_summary([2, 8, 4]) == "2-8"
    assert router_cluster.threshold_summary([None, None]) == "always"
    assert router_cluster.threshold_summary([]) == ""


def test_a_lease_expires_by_the_observers_own_clock_not_the_holders_renew_time() -> None:
    """A holder whose clock runs an hour behind still holds the lease while it renews, and one
    whose clock runs ahead loses it once it stops: only changes of the record, timed by the
    observer's monotonic clock, count."""
    observation = lease.LeaseObservation()

    def record(renew: str) -> dict[str, object]:
        return {"spec": {"holderIdentity": "a", "renewTime": renew, "leaseDurationSeconds": 10}}

    skewed = [f"2020-01-01T00:00:0{i}Z" for i in range(5)]  # far in the past
    assert not observation.expired(record(skewed[0]), 100.0)  # first sight: not expired
    for i, renew in enumerate(skewed[1:], start=1):
        assert not observation.expired(record(renew), 100.0 + 8 * i)  # renewed every 8 s
    assert not observation.expired(record(skewed[-1]), 100.0 + 8 * 4 + 9)
    assert observation.expired(record(skewed[-1]), 100.0 + 8 * 4 + 11)  # silent for 11 s
    ahead = lease.LeaseObservation()
    future = record("2099-01-01T00:00:00Z")
    assert not ahead.expired(future, 0.0) and not ahead.expired(future, 9.0)
    assert ahead.expired(future, 10.5)
