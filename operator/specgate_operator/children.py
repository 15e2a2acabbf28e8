"""Which children the operator watches, and how a child's change reaches its resource.

The children whose drift or status matters at once (the engine and router Deployments, their
Services, the router's ConfigMap, the NetworkPolicy and the disruption budgets) are watched:
an event on one wakes its resource's resync, which re-applies the children and refreshes the
status within about a second. The others (Secrets, the router's ServiceAccount and RBAC,
ServiceMonitors, the HTTPRoute) are put back by the periodic resync alone: watching Secrets
would have the operator read every Secret in the namespaces it serves.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Protocol

from specgate import api

WATCHED: tuple[tuple[str, str, str], ...] = (
    ("apps", "v1", "deployments"),
    ("", "v1", "services"),
    ("", "v1", "configmaps"),
    ("networking.k8s.io", "v1", "networkpolicies"),
    ("policy", "v1", "poddisruptionbudgets"),
)
"""(group, version, plural) of the watched kinds: the operator's role lists and watches them."""

SETTLE_SECONDS = 1.0
"""How long a woken resync waits for more events before it reconciles: a rollout's burst of
Deployment updates becomes one reconcile."""

Key = tuple[str, str]
"""(namespace, name) of a SpecDecodeDeployment."""


def key_of(body: Mapping[str, Any]) -> Key:
    """A SpecDecodeDeployment's own key, as `owner_of` gives it for its children."""
    meta = body["metadata"]
    return meta.get("namespace") or "default", meta["name"]


def owner_of(body: Mapping[str, Any]) -> Key | None:
    """The SpecDecodeDeployment that controls a child, from the child's ownerReferences (the
    label alone could be set by anyone)."""
    meta = body.get("metadata") or {}
    namespace = meta.get("namespace")
    for ref in meta.get("ownerReferences") or []:
        if (
            isinstance(ref, Mapping)
            and ref.get("kind") == api.KIND
            and str(ref.get("apiVersion", "")).split("/")[0] == api.GROUP
            and ref.get("controller") is True
            and isinstance(ref.get("name"), str)
            and isinstance(namespace, str)
        ):
            return namespace, ref["name"]
    return None


class Stopped(Protocol):
    """kopf's `stopped` flag, as far as it is used here."""

    def __bool__(self) -> bool: ...

    async def wait(self, timeout: float | None = None) -> Any: ...


class Wakeups:
    """One wake-up flag per resource: a watched child's event sets it, the resource's resync
    waits on it (or its period, or the resource's stopping). Owned by the operator's memo;
    its flags belong to kopf's event loop."""

    def __init__(self) -> None:
        self._flags: dict[Key, asyncio.Event] = {}

    def _flag(self, key: Key) -> asyncio.Event:
        return self._flags.setdefault(key, asyncio.Event())

    def wake(self, key: Key) -> None:
        self._flag(key).set()

    def forget(self, key: Key) -> None:
        self._flags.pop(key, None)

    async def wait(self, key: Key, period: float, stopped: Stopped) -> bool:
        """Until a child of `key` changed (True), or `period` passed or the resource is
        stopping (False). A wake-up waits SETTLE_SECONDS more for the rest of its burst."""
        flag = self._flag(key)
        await _first(period, flag.wait(), stopped.wait())
        if not flag.is_set() or stopped:
            return False
        await _first(SETTLE_SECONDS, stopped.wait())
        flag.clear()
        return not stopped


async def _first(timeout: float, *awaitables: Any) -> None:
    """Until the first of `awaitables` completes or `timeout` passes; the others are cancelled."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


__all__ = ["SETTLE_SECONDS", "WATCHED", "Wakeups", "key_of", "owner_of"]
