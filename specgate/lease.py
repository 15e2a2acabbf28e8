"""Lease-based leader election (coordination.k8s.io/v1), as client-go's: one holder at a
time, renewed every few seconds, taken over by another candidate only after it has watched the
record stay unchanged for the lease's duration. The routers elect the one that controls
thresholds; the operator's replicas elect the one that reconciles."""

from __future__ import annotations

import datetime
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from specgate.kube import KubeClient, KubeError

log = logging.getLogger("specgate.lease")


class LeaseTerms(Protocol):
    """Which Lease, and for how long a holder's renewal stands."""

    @property
    def lease_name(self) -> str: ...
    @property
    def namespace(self) -> str: ...
    @property
    def lease_seconds(self) -> float: ...


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class LeaseObservation:
    """When this replica last saw the Lease's record change, on its own monotonic clock.

    A lease is expired when its record (holder, renew time) has not changed for its duration
    as this replica measures it, as client-go's leader election does: comparing the holder's
    renewTime with the local wall clock would hand the lease over early, or never, on a node
    whose clock is skewed from the holder's."""

    record: tuple[Any, ...] | None = None
    observed_at: float = -math.inf

    def expired(self, lease: dict[str, Any], now: float) -> bool:
        spec = lease.get("spec") or {}
        record = (spec.get("holderIdentity"), spec.get("renewTime"), spec.get("acquireTime"))
        if record != self.record:
            self.record, self.observed_at = record, now
            return False
        return now - self.observed_at > float(spec.get("leaseDurationSeconds") or 0)


async def try_acquire(
    kube: KubeClient,
    cfg: LeaseTerms,
    identity: str,
    observation: LeaseObservation | None = None,
    now: float | None = None,
) -> bool:
    """One round of Lease-based election; True when `identity` holds the lease afterwards.
    `observation` carries what earlier rounds saw (a fresh one never takes over a lease another
    holds: it has not watched it expire); `now` is monotonic seconds."""
    observation = observation if observation is not None else LeaseObservation()
    now = time.monotonic() if now is None else now
    stamp = now_rfc3339()
    lease = await kube.get_or_none("coordination.k8s.io/v1", "Lease", cfg.namespace, cfg.lease_name)
    spec = {
        "holderIdentity": identity,
        "leaseDurationSeconds": math.ceil(cfg.lease_seconds),
        "renewTime": stamp,
    }
    if lease is None:
        body = {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": cfg.lease_name, "namespace": cfg.namespace},
            "spec": {**spec, "acquireTime": stamp, "leaseTransitions": 0},
        }
        try:
            await kube.create(body)
        except KubeError as exc:
            if exc.conflict:
                return False  # somebody else created it first
            raise
        return True
    holder = (lease.get("spec") or {}).get("holderIdentity")
    expired = observation.expired(lease, now)
    if holder != identity and holder and not expired:
        return False
    if holder != identity:
        transitions = int((lease.get("spec") or {}).get("leaseTransitions") or 0) + 1
        spec = {**spec, "acquireTime": stamp, "leaseTransitions": transitions}
    return await _patch_unchanged(kube, cfg, lease, spec)


async def _patch_unchanged(
    kube: KubeClient, terms: LeaseTerms, lease: dict[str, Any], spec: dict[str, Any]
) -> bool:
    """Patch the Lease's spec only if it is still the version read (its resourceVersion): two
    candidates cannot both win. False when another wrote it first."""
    patch = {"metadata": {"resourceVersion": lease["metadata"].get("resourceVersion")},
             "spec": spec}  # fmt: skip
    try:
        await kube.merge_patch(
            "coordination.k8s.io/v1", "Lease", terms.namespace, terms.lease_name, patch
        )
    except KubeError as exc:
        if exc.conflict:
            return False
        raise
    return True


async def attempt(
    kube: KubeClient, terms: LeaseTerms, identity: str, seen: LeaseObservation
) -> bool | None:
    """One election round: True held, False held by another, None unknown (the API call
    failed; logged)."""
    try:
        return await try_acquire(kube, terms, identity, seen)
    except (KubeError, httpx.HTTPError) as exc:
        log.warning("leader election round failed: %s", exc)
        return None


async def release(kube: KubeClient, terms: LeaseTerms, identity: str) -> bool:
    """Give the Lease up on a clean exit, so a standby takes over at its next round instead
    of after the lease's duration. False when `identity` no longer held it."""
    lease = await kube.get_or_none(
        "coordination.k8s.io/v1", "Lease", terms.namespace, terms.lease_name
    )
    if lease is None or (lease.get("spec") or {}).get("holderIdentity") != identity:
        return False
    return await _patch_unchanged(
        kube, terms, lease, {"holderIdentity": None, "renewTime": now_rfc3339()}
    )
