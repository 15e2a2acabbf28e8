"""A resource's reconciles and its deletion, kept apart (handlers.Lifecycle), without kopf or an
API server: an in-memory client whose server-side applies can be held mid-reconcile.

kopf runs the resync timer in a task of its own beside the deletion handler, so a reconcile can
be under way when the deletion starts; on the API emulator that once left two children behind
and the resource terminating (tests/test_operator_integration.py has that end to end)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import kopf

from specgate_operator import handlers

from .conftest import minimal_resource

LOG = logging.getLogger("test")
Key = tuple[str, str, str | None, str]


class HeldClient:
    """The operator's KubeClient calls, on a dict. After `hold_after` applies, the next one
    waits for `release` (and says so through `holding`)."""

    def __init__(self, hold_after: int | None = None) -> None:
        self.objects: dict[Key, dict[str, Any]] = {}
        self.applied = 0
        self.hold_after = hold_after
        self.holding = asyncio.Event()
        self.release = asyncio.Event()

    @staticmethod
    def _key(manifest: dict[str, Any]) -> Key:
        meta = manifest["metadata"]
        return manifest["apiVersion"], manifest["kind"], meta.get("namespace"), meta["name"]

    async def apply(self, manifest: dict[str, Any], *, force: bool = True) -> dict[str, Any]:
        if self.hold_after is not None and self.applied == self.hold_after:
            self.holding.set()
            await self.release.wait()
        self.applied += 1
        self.objects[self._key(manifest)] = manifest
        return manifest

    async def create_if_absent(self, manifest: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        key = self._key(manifest)
        if key in self.objects:
            return self.objects[key], False
        self.objects[key] = manifest
        return manifest, True

    async def get_or_none(
        self, api_version: str, kind: str, namespace: str | None, name: str
    ) -> dict[str, Any] | None:
        return self.objects.get((api_version, kind, namespace, name))

    async def delete(self, api_version: str, kind: str, namespace: str | None, name: str) -> bool:
        return self.objects.pop((api_version, kind, namespace, name), None) is not None


def _body(**meta: Any) -> dict[str, Any]:
    body = minimal_resource()
    body["metadata"].update(namespace="default", uid="uid-1", generation=1, **meta)
    return body


def _memo(client: HeldClient) -> kopf.Memo:
    config = handlers.OperatorConfig(detect_monitoring=False)
    return kopf.Memo(kube=client, config=config, service_monitor=False)


async def test_a_deletion_waits_for_the_reconcile_under_way_and_none_follows_it() -> None:
    client = HeldClient(hold_after=3)
    memo, body = _memo(client), _body()
    reconciling = asyncio.create_task(
        handlers.reconcile(body, SimpleNamespace(status={}), memo, LOG)
    )
    await asyncio.wait_for(client.holding.wait(), 5)  # three children applied, more to come
    deleting = asyncio.create_task(handlers.finalize(body, memo, LOG))
    await asyncio.sleep(0.05)
    assert not deleting.done()  # it waits: deleting now would race the remaining applies
    client.release.set()
    await asyncio.wait_for(asyncio.gather(reconciling, deleting), 5)
    assert client.objects == {}
    # A resync whose body predates the deletion (kopf hands timers the last body it saw) makes
    # nothing again and writes no status.
    applied, patch = client.applied, SimpleNamespace(status={})
    await handlers.reconcile(body, patch, memo, LOG)
    assert client.objects == {} and client.applied == applied and patch.status == {}


async def test_a_reconcile_of_a_resource_being_deleted_does_nothing() -> None:
    client = HeldClient()
    patch = SimpleNamespace(status={})
    body = _body(deletionTimestamp="2026-12-02T00:00:00Z", finalizers=[handlers.FINALIZER])
    await handlers.reconcile(body, patch, _memo(client), LOG)
    assert client.objects == {} and patch.status == {}
    # The same resource before its deletion: every child and a status.
    await handlers.reconcile(_body(), patch, _memo(client), LOG)
    owned = [o for o in client.objects.values() if o["metadata"].get("ownerReferences")]
    assert len(owned) == len(client.objects) >= 10 and patch.status["observedGeneration"] == 1


def test_the_resync_timer_runs_only_between_the_finalizer_and_the_deletion() -> None:
    assert not handlers.resyncable({})
    assert handlers.resyncable({"finalizers": [handlers.FINALIZER]})
    assert not handlers.resyncable(
        {"finalizers": [handlers.FINALIZER], "deletionTimestamp": "2026-12-02T00:00:00Z"}
    )
