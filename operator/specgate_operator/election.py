"""The operator's replicas elect one that reconciles (specgate.lease); the others wait.

A candidate tries the Lease every `renew_seconds`. Once it holds it, it starts the work (kopf)
and keeps renewing; when a renewal finds another holder, or none succeeds for
`renew_deadline_seconds` (the API server unreachable: another replica may take over once the
lease has run out), it stops the work and the process exits non-zero, so its container
restarts as a candidate. That deadline is shorter than the lease, so the old leader has
stopped before anyone can take over. On a clean stop the leader releases the Lease and a
standby takes over at its next round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from enum import Enum
from typing import Any

import httpx

from specgate import lease
from specgate.kube import KubeClient, KubeError

log = logging.getLogger("specgate.operator.election")


@dataclass(frozen=True)
class Election:
    namespace: str
    lease_name: str
    identity: str
    lease_seconds: float = 15.0
    """How long a renewal stands: a standby takes over this long after the leader's last one.
    The renewal period and deadline follow from it, in client-go's default proportions."""

    def __post_init__(self) -> None:
        if not 0 < self.lease_seconds <= 3600:
            raise ValueError(
                f"--leader-election-lease-seconds: seconds in (0, 3600], got {self.lease_seconds:g}"
            )

    @property
    def renew_seconds(self) -> float:
        """How often a candidate tries and a leader renews (2 s of a 15-s lease)."""
        return self.lease_seconds / 7.5

    @property
    def renew_deadline_seconds(self) -> float:
        """A leader that could not renew for this long stops: before the lease can pass."""
        return self.lease_seconds * 2 / 3


class Role(Enum):
    CANDIDATE = "candidate"
    LEADER = "leader"
    STOPPED = "stopped"


Work = Callable[[asyncio.Event], Coroutine[Any, Any, None]]
"""The leader's work; it returns soon after the event is set."""

WORK_STOP_SECONDS = 30.0
"""How long a leader that lost the lease waits for its work to stop before it exits anyway."""


async def lead(
    kube: KubeClient,
    election: Election,
    work: Work,
    on_role: Callable[[Role], None] = lambda role: None,
) -> bool:
    """Wait to be elected, run `work` while leading. True when the work ended by itself (a
    clean stop), False when leadership was lost."""
    seen = lease.LeaseObservation()
    on_role(Role.CANDIDATE)
    while await lease.attempt(kube, election, election.identity, seen) is not True:
        await asyncio.sleep(election.renew_seconds)
    log.info("leading as %s (Lease %s/%s)", election.identity, election.namespace,
             election.lease_name)  # fmt: skip
    on_role(Role.LEADER)
    stop = asyncio.Event()
    running = asyncio.create_task(work(stop), name="operator")
    renewed = time.monotonic()
    try:
        while True:
            done, _ = await asyncio.wait({running}, timeout=election.renew_seconds)
            if done:
                running.result()  # the work's own failure propagates
                return True
            held = await lease.attempt(kube, election, election.identity, seen)
            if held:
                renewed = time.monotonic()
            elif held is False or time.monotonic() - renewed > election.renew_deadline_seconds:
                log.error(
                    "leadership lost (%s): stopping",
                    "another replica holds the Lease" if held is False else "no renewal",
                )
                return False
    finally:
        on_role(Role.STOPPED)
        stop.set()
        try:
            await asyncio.wait_for(asyncio.shield(running), WORK_STOP_SECONDS)
        except Exception:  # stopping (a timeout included): its failure was logged where it happened
            running.cancel()
            with contextlib.suppress(BaseException):
                await running
        with contextlib.suppress(KubeError, httpx.HTTPError):
            await lease.release(kube, election, election.identity)
