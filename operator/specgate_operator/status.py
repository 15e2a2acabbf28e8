"""Derive a SpecDecodeDeployment's status from its children: pure functions, no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

OPERATOR_CONDITIONS = ("Ready", "Progressing", "Degraded")
ROUTER_CONDITION = "SpeculationControlled"  # owned by the router; the operator only seeds it


@dataclass(frozen=True)
class Observed:
    """What the operator saw of the children and of its own last reconcile."""

    generation: int
    desired_replicas: int
    engine: dict[str, Any] | None  # the engine Deployment as read back, None if missing
    router: dict[str, Any] | None  # the router Deployment as read back
    router_endpoint: str
    problem: tuple[str, str] | None = None  # (reason, message) when reconcile failed


def _deployment_counts(dep: dict[str, Any] | None) -> tuple[int, int, int, bool]:
    """(replicas, ready, updated, rollout finished) of a Deployment."""
    if dep is None:
        return 0, 0, 0, False
    status = dep.get("status") or {}
    spec_replicas = int((dep.get("spec") or {}).get("replicas", 1))
    generation = int((dep.get("metadata") or {}).get("generation", 0))
    observed = int(status.get("observedGeneration", 0))
    updated = int(status.get("updatedReplicas", 0))
    ready = int(status.get("readyReplicas", 0))
    replicas = int(status.get("replicas", 0))
    finished = observed >= generation and updated >= spec_replicas and replicas == spec_replicas
    return replicas, ready, updated, finished


def _failed_condition(dep: dict[str, Any] | None) -> tuple[str, str] | None:
    for cond in (dep or {}).get("status", {}).get("conditions", []) or []:
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            return cond.get("reason", "ReplicaFailure"), cond.get("message", "")
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return "ProgressDeadlineExceeded", cond.get("message", "")
    return None


def desired_conditions(obs: Observed) -> list[dict[str, str]]:
    """Ready / Progressing / Degraded, without timestamps."""
    replicas, ready, _, engine_done = _deployment_counts(obs.engine)
    _, router_ready, _, _ = _deployment_counts(obs.router)
    failure = obs.problem or _failed_condition(obs.engine) or _failed_condition(obs.router)
    is_ready = (
        failure is None
        and obs.engine is not None
        and ready >= obs.desired_replicas
        and router_ready > 0
    )
    if is_ready:
        ready_c = ("True", "AllReplicasReady", f"{ready}/{obs.desired_replicas} engine pods ready")
    elif failure is not None:
        ready_c = ("False", failure[0], failure[1])
    else:
        ready_c = (
            "False",
            "ReplicasNotReady",
            f"{ready}/{obs.desired_replicas} engine pods ready, {router_ready} router pods ready",
        )
    if failure is not None:
        progressing = ("False", failure[0], failure[1])
    elif not engine_done:
        progressing = ("True", "RollingOut", f"engine rollout: {replicas} pods, {ready} ready")
    else:
        progressing = ("False", "RolloutComplete", "engine Deployment matches the spec")
    degraded = (
        ("True", failure[0], failure[1]) if failure else ("False", "AsExpected", "no problems seen")
    )
    return [
        {"type": t, "status": s, "reason": r, "message": m}
        for t, (s, r, m) in zip(OPERATOR_CONDITIONS, (ready_c, progressing, degraded), strict=True)
    ]


def merge_conditions(
    current: list[dict[str, Any]],
    desired: list[dict[str, str]],
    *,
    now: str,
    generation: int,
) -> list[dict[str, Any]]:
    """Replace the operator's conditions, keep the router's; keep lastTransitionTime unless the
    status flips (metav1.Condition semantics)."""
    by_type = {c.get("type"): c for c in current}
    out: list[dict[str, Any]] = []
    for cond in desired:
        old = by_type.get(cond["type"])
        flipped = old is None or old.get("status") != cond["status"]
        out.append(
            {
                **cond,
                "lastTransitionTime": now if flipped else old["lastTransitionTime"],  # type: ignore[index]
                "observedGeneration": generation,
            }
        )
    router = by_type.get(ROUTER_CONDITION)
    out.append(
        router
        if router is not None
        else {
            "type": ROUTER_CONDITION,
            "status": "Unknown",
            "reason": "RouterNotReporting",
            "message": "no router has published speculation state yet",
            "lastTransitionTime": now,
            "observedGeneration": generation,
        }
    )
    return out


def status_patch(
    obs: Observed, current_status: dict[str, Any], *, now: str, selector: str
) -> dict[str, Any]:
    """The operator's part of `.status` (pods[] and threshold belong to the router)."""
    replicas, ready, _, _ = _deployment_counts(obs.engine)
    _, router_ready, _, _ = _deployment_counts(obs.router)
    conditions = merge_conditions(
        list(current_status.get("conditions") or []),
        desired_conditions(obs),
        now=now,
        generation=obs.generation,
    )
    return {
        "observedGeneration": obs.generation,
        "replicas": replicas,
        "readyReplicas": ready,
        "selector": selector,
        "conditions": conditions,
        "router": {"endpoint": obs.router_endpoint, "ready": router_ready > 0},
    }
