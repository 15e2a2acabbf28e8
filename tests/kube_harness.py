"""A kmock-based Kubernetes API emulator on loopback, with a kubeconfig pointing at it."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import kmock
import pytest
import yaml

from specgate import crd

from .kube_emulator import SpecgateApiEmulator

SDD_PATH = "/apis/specgate.io/v1alpha1/namespaces/default/specdecodedeployments"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def wait_for(
    probe: Callable[[], Awaitable[Any]], *, timeout: float = 20.0, what: str = "condition"
) -> Any:
    """Poll `probe` until it returns something truthy (the event loop keeps serving the API)."""
    deadline = asyncio.get_running_loop().time() + timeout
    last: Any = None
    while asyncio.get_running_loop().time() < deadline:
        last = await probe()
        if last:
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last value: {last!r}")


@dataclass
class Cluster:
    emulator: SpecgateApiEmulator
    api: httpx.AsyncClient
    kubeconfig: Path

    async def get(self, collection: str, name: str) -> dict[str, Any] | None:
        resp = await self.api.get(f"{collection}/{name}")
        return resp.json() if resp.status_code == 200 else None

    async def sdd(self) -> dict[str, Any] | None:
        return await self.get(SDD_PATH, "demo")

    async def condition(self, ctype: str) -> dict[str, Any] | None:
        obj = await self.sdd()
        for cond in ((obj or {}).get("status") or {}).get("conditions", []):
            if cond["type"] == ctype:
                return dict(cond)
        return None

    async def set_deployment_status(self, name: str, replicas: int, ready: int) -> None:
        """Play kube-controller-manager: report a Deployment's pods."""
        dep = await self.get("/apis/apps/v1/namespaces/default/deployments", name)
        assert dep is not None
        status = {
            "observedGeneration": dep["metadata"]["generation"],
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": ready,
            "availableReplicas": ready,
        }
        resp = await self.api.patch(
            f"/apis/apps/v1/namespaces/default/deployments/{name}/status",
            json={"status": status},
            headers={"Content-Type": "application/merge-patch+json"},
        )
        resp.raise_for_status()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    emulator = SpecgateApiEmulator()
    emulator.register_crd(crd.crd())
    emulator.add_namespace("default")
    emulator.serve_builtin("coordination.k8s.io/v1", "leases", "Lease")
    emulator.serve_builtin("discovery.k8s.io/v1", "endpointslices", "EndpointSlice")
    # The children the operator watches (specgate_operator.children): kopf finds them through
    # discovery before it watches them.
    emulator.serve_builtin("apps/v1", "deployments", "Deployment", status=True)
    emulator.serve_builtin("v1", "services", "Service")
    emulator.serve_builtin("v1", "configmaps", "ConfigMap")
    emulator.serve_builtin("networking.k8s.io/v1", "networkpolicies", "NetworkPolicy")
    emulator.serve_builtin("policy/v1", "poddisruptionbudgets", "PodDisruptionBudget")
    async with emulator, kmock.Server(emulator) as server:
        url = str(server.url).rstrip("/")
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "emulator",
                    "clusters": [{"name": "emulator", "cluster": {"server": url}}],
                    "users": [{"name": "test", "user": {}}],
                    "contexts": [
                        {
                            "name": "emulator",
                            "context": {"cluster": "emulator", "user": "test"},
                        }
                    ],
                }
            )
        )
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            yield Cluster(emulator, client, kubeconfig)
