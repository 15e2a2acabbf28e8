"""How a child's change reaches its resource (specgate_operator.children), without I/O."""

from __future__ import annotations

import asyncio
from typing import Any

from specgate_operator import children, install


def _child(**meta: Any) -> dict[str, Any]:
    return {"metadata": {"namespace": "llm", **meta}}


OWNER = {
    "apiVersion": "specgate.io/v1alpha1", "kind": "SpecDecodeDeployment", "name": "demo",
    "uid": "u", "controller": True,
}  # fmt: skip


def test_a_child_belongs_to_the_resource_that_controls_it() -> None:
    assert children.owner_of(_child(ownerReferences=[OWNER])) == ("llm", "demo")
    # The label alone is anyone's to set; a reference that does not control, or of another
    # kind or group, names no resource.
    assert children.owner_of(_child(labels={"specgate.io/deployment": "demo"})) is None
    assert children.owner_of(_child(ownerReferences=[{**OWNER, "controller": False}])) is None
    other = {**OWNER, "apiVersion": "example.com/v1"}
    assert children.owner_of(_child(ownerReferences=[other])) is None
    assert children.owner_of(_child(ownerReferences=["nonsense", {**OWNER, "name": 7}])) is None
    assert children.owner_of({"metadata": None}) is None
    # The resource itself has the key its children name.
    resource = {"metadata": {"namespace": "llm", "name": "demo"}}
    assert children.key_of(resource) == children.owner_of(_child(ownerReferences=[OWNER]))


def test_the_operator_may_list_and_watch_every_watched_kind_and_no_secret() -> None:
    watching = {
        (group, resource)
        for rule in install.NAMESPACED_RULES
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        if {"list", "watch"} <= set(rule["verbs"])
    }
    assert {(g, p) for g, _, p in children.WATCHED} <= watching
    assert ("", "secrets") not in watching


class Flag:
    """kopf's `stopped`: false until set."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def __bool__(self) -> bool:
        return self.event.is_set()

    async def wait(self, timeout: float | None = None) -> None:
        await self.event.wait()


async def test_a_childs_change_wakes_its_resource_and_a_burst_is_one_wake_up() -> None:
    wakeups, stopped, key = children.Wakeups(), Flag(), ("llm", "demo")
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await wakeups.wait(key, 0.05, stopped) is False  # the period passes
    waiting = asyncio.create_task(wakeups.wait(key, 60, stopped))
    await asyncio.sleep(0)
    for _ in range(5):
        wakeups.wake(key)
    wakeups.wake(("llm", "other"))
    assert await waiting is True
    elapsed = loop.time() - started
    assert children.SETTLE_SECONDS <= elapsed < children.SETTLE_SECONDS + 5
    # The burst was consumed: the next wait runs its period.
    assert await wakeups.wait(key, 0.05, stopped) is False


async def test_a_stopping_resource_stops_waiting_at_once() -> None:
    wakeups, stopped, key = children.Wakeups(), Flag(), ("llm", "demo")
    waiting = asyncio.create_task(wakeups.wait(key, 60, stopped))
    await asyncio.sleep(0)
    stopped.event.set()
    assert await asyncio.wait_for(waiting, 5) is False
    # A wake-up of a resource that is stopping does not run its reconcile either.
    wakeups.wake(key)
    assert await wakeups.wait(key, 60, stopped) is False


async def test_a_deleted_resource_leaves_no_wake_up_behind() -> None:
    """A resource deleted and made again under its name starts without its old wake-up."""
    wakeups, key = children.Wakeups(), ("llm", "demo")
    wakeups.wake(key)
    wakeups.forget(key)
    assert await wakeups.wait(key, 0.05, Flag()) is False
