"""The router's Kubernetes side: EndpointSlice discovery, Lease leader election, and publishing
pod state to the SpecDecodeDeployment's status. Each is a loop owned by `RouterState`."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import httpx

from specgate.kube import Credentials, KubeClient, KubeError
from specgate.lease import LeaseObservation, attempt, now_rfc3339
from specgate_router.settings import KubernetesDiscovery, LeaderElection, StatusTarget
from specgate_router.state import RouterState

log = logging.getLogger("specgate.router.cluster")


async def connect() -> KubeClient:
    """In-cluster service account, else the kubeconfig's current context."""
    return KubeClient(Credentials.discover())


# ---- discovery ----


def ready_endpoints(slices: list[dict[str, Any]], port: int) -> dict[str, str]:
    """name -> URL of every ready endpoint in the slices (pure)."""
    out: dict[str, str] = {}
    for sl in slices:
        for ep in sl.get("endpoints") or []:
            if not (ep.get("conditions") or {}).get("ready", False):
                continue
            if (ep.get("conditions") or {}).get("terminating", False):
                continue
            for address in ep.get("addresses") or []:
                name = (ep.get("targetRef") or {}).get("name") or address
                host = f"[{address}]" if ":" in address else address
                out[name] = f"http://{host}:{port}"
    return out


async def watch_endpoints(state: RouterState, k8s: KubernetesDiscovery) -> None:
    """Follow the engine Service's EndpointSlices: list once, then watch from the list's
    resourceVersion, and after a watch ends or breaks resume from the last version seen
    (bookmarks keep it fresh while nothing changes). Only a version the server no longer has
    (410 Gone) or a broken list starts over with a list."""
    path = f"/apis/discovery.k8s.io/v1/namespaces/{k8s.namespace}/endpointslices"
    selector = f"kubernetes.io/service-name={k8s.service}"
    slices: dict[str, dict[str, Any]] = {}
    version = ""  # where the next watch starts; empty: list first
    while True:
        try:
            if not version:
                listed, version = await state.kube.list_versioned(
                    "discovery.k8s.io/v1", "EndpointSlice", k8s.namespace, label_selector=selector
                )
                slices = {s["metadata"]["name"]: s for s in listed}
                state.sync_backends(ready_endpoints(list(slices.values()), k8s.port))
            params = {"watch": "true", "labelSelector": selector, "timeoutSeconds": "300",
                      "resourceVersion": version, "allowWatchBookmarks": "true"}  # fmt: skip
            async for event in state.kube.watch(path, params):
                version = follow_slices(slices, event, version)
                if not version:
                    log.info("EndpointSlice watch expired; listing again")
                    break
                state.sync_backends(ready_endpoints(list(slices.values()), k8s.port))
        except (KubeError, httpx.HTTPError, json.JSONDecodeError) as exc:
            if isinstance(exc, KubeError) and exc.status == 410:
                version = ""
            log.warning("EndpointSlice watch failed (%s); resuming in 2s", exc)
            await asyncio.sleep(2.0)


def follow_slices(slices: dict[str, dict[str, Any]], event: dict[str, Any], version: str) -> str:
    """Apply one watch event to `slices` (pure but for that); returns the version to resume
    from, empty when the server says the watch's version is gone."""
    obj = event.get("object") or {}
    if event.get("type") == "ERROR":
        return "" if obj.get("code") == 410 else version
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    if event.get("type") in ("ADDED", "MODIFIED") and name:
        slices[name] = obj
    elif event.get("type") == "DELETED" and name:
        slices.pop(name, None)
    return str(meta.get("resourceVersion") or version)


# ---- leader election ----


async def lead(state: RouterState, cfg: LeaderElection) -> None:
    observation = LeaseObservation()
    while True:
        # An unknown round (the API unreachable) counts as lost: thresholds are not pushed.
        leader = await attempt(state.kube, cfg, state.identity, observation) is True
        if leader != state.is_leader:
            log.info("leadership %s", "acquired" if leader else "lost")
        state.is_leader = leader
        state.metrics.leader.set(1 if leader else 0)
        await asyncio.sleep(cfg.renew_seconds)


# ---- status ----


def threshold_summary(values: list[int | None]) -> str:
    if not values:
        return ""
    if any(v is None for v in values):
        return "always" if all(v is None for v in values) else "mixed"
    ints = [v for v in values if v is not None]
    lo, hi = min(ints), max(ints)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def status_patch(state: RouterState, current: dict[str, Any]) -> dict[str, Any]:
    views = state.views()
    stamp = now_rfc3339()
    pods = [
        {
            "name": v["name"],
            "ready": bool(v["healthy"] and v["fresh"]),
            "speculating": bool(v["speculating"]),
            "threshold": v["threshold"],
            "batchSize": v["batch"] or 0,
            "acceptLength": v["acceptLength"],
            "rule": v["rule"],
            "reason": v["reason"][:200],
        }
        for v in views
    ]
    controlled = bool(views) and all(v["fresh"] for v in views)
    condition = {
        "type": "SpeculationControlled",
        "status": "True" if controlled else "False",
        "reason": "ThresholdsControlled" if controlled else "PodsNotObserved",
        "message": f"{sum(v['fresh'] for v in views)}/{len(views)} pods observed by "
        f"{state.identity}",
        "lastTransitionTime": stamp,
    }
    conditions = [c for c in current.get("conditions") or [] if c.get("type") != condition["type"]]
    old = next(
        (c for c in current.get("conditions") or [] if c.get("type") == condition["type"]), None
    )
    if old is not None and old.get("status") == condition["status"]:
        condition["lastTransitionTime"] = old.get("lastTransitionTime", stamp)
    return {
        "status": {
            "pods": pods,
            "threshold": threshold_summary([v["threshold"] for v in views]),
            "conditions": [*conditions, condition],
        }
    }


async def publish_status(state: RouterState, target: StatusTarget) -> None:
    while True:
        await asyncio.sleep(target.interval_seconds)
        if not state.is_leader:
            continue
        try:
            current = await state.kube.get(
                "specgate.io/v1alpha1", "SpecDecodeDeployment", target.namespace, target.name
            )
            patch = status_patch(state, current.get("status") or {})
            await state.kube.merge_patch(
                "specgate.io/v1alpha1",
                "SpecDecodeDeployment",
                target.namespace,
                target.name,
                patch,
                subresource="status",
            )
        except (KubeError, httpx.HTTPError) as exc:
            log.warning("status publish failed: %s", exc)
