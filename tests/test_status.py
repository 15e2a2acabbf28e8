"""Status derivation from children: pure functions."""

from __future__ import annotations

from typing import Any

from specgate_operator import status


def deployment(
    replicas: int,
    ready: int,
    *,
    generation: int = 1,
    observed: int = 1,
    conditions: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {"generation": generation},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": observed,
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": ready,
            "conditions": conditions or [],
        },
    }


def observed(
    engine: dict[str, Any] | None,
    router: dict[str, Any] | None,
    *,
    problem: tuple[str, str] | None = None,
    replicas: int = 2,
) -> status.Observed:
    return status.Observed(
        generation=3,
        desired_replicas=replicas,
        engine=engine,
        router=router,
        router_endpoint="http://r",
        problem=problem,
    )


def by_type(conds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in conds}


def test_ready_when_engine_and_router_ready() -> None:
    conds = by_type(status.desired_conditions(observed(deployment(2, 2), deployment(2, 1))))
    assert conds["Ready"]["status"] == "True"
    assert conds["Progressing"]["status"] == "False"
    assert conds["Degraded"]["status"] == "False"


def test_not_ready_while_engine_pods_start() -> None:
    conds = by_type(status.desired_conditions(observed(deployment(2, 1), deployment(2, 2))))
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["reason"] == "ReplicasNotReady"
    assert "1/2" in conds["Ready"]["message"]


def test_progressing_while_the_controller_has_not_caught_up() -> None:
    engine = deployment(2, 2, generation=4, observed=3)
    conds = by_type(status.desired_conditions(observed(engine, deployment(1, 1))))
    assert conds["Progressing"]["status"] == "True"


def test_not_ready_without_a_ready_router() -> None:
    conds = by_type(status.desired_conditions(observed(deployment(2, 2), deployment(2, 0))))
    assert conds["Ready"]["status"] == "False"


def test_reconcile_problem_degrades() -> None:
    conds = by_type(
        status.desired_conditions(
            observed(deployment(2, 2), deployment(1, 1), problem=("SecretNotFound", "no key"))
        )
    )
    assert conds["Degraded"] == {
        "type": "Degraded",
        "status": "True",
        "reason": "SecretNotFound",
        "message": "no key",
    }
    assert conds["Ready"]["status"] == "False"


def test_stuck_rollout_degrades() -> None:
    stuck = [
        {
            "type": "Progressing",
            "status": "False",
            "reason": "ProgressDeadlineExceeded",
            "message": "ReplicaSet has timed out progressing",
        }
    ]
    conds = by_type(
        status.desired_conditions(observed(deployment(2, 0, conditions=stuck), deployment(1, 1)))
    )
    assert conds["Degraded"]["reason"] == "ProgressDeadlineExceeded"


def test_transition_time_changes_only_when_status_flips() -> None:
    first = status.merge_conditions(
        [],
        [{"type": "Ready", "status": "False", "reason": "A", "message": ""}],
        now="t1",
        generation=1,
    )
    same = status.merge_conditions(
        first,
        [{"type": "Ready", "status": "False", "reason": "B", "message": "x"}],
        now="t2",
        generation=2,
    )
    flipped = status.merge_conditions(
        same,
        [{"type": "Ready", "status": "True", "reason": "C", "message": ""}],
        now="t3",
        generation=3,
    )
    assert by_type(first)["Ready"]["lastTransitionTime"] == "t1"
    assert by_type(same)["Ready"]["lastTransitionTime"] == "t1"
    assert by_type(same)["Ready"]["reason"] == "B"
    assert by_type(flipped)["Ready"]["lastTransitionTime"] == "t3"


def test_router_condition_is_seeded_then_preserved() -> None:
    seeded = by_type(status.merge_conditions([], [], now="t", generation=1))
    assert seeded["SpeculationControlled"]["status"] == "Unknown"
    router_said = {
        "type": "SpeculationControlled",
        "status": "True",
        "reason": "ThresholdsPushed",
        "message": "3 pods",
        "lastTransitionTime": "t0",
    }
    merged = by_type(status.merge_conditions([router_said], [], now="t9", generation=2))
    assert merged["SpeculationControlled"] == router_said


def test_status_patch_counts_and_endpoint() -> None:
    patch = status.status_patch(
        observed(deployment(2, 1), deployment(2, 2)), {}, now="t", selector="a=b"
    )
    assert patch["replicas"] == 2 and patch["readyReplicas"] == 1
    assert patch["observedGeneration"] == 3 and patch["selector"] == "a=b"
    assert patch["router"] == {"endpoint": "http://r", "ready": True}
