"""One control step for every pod of a router: the step the router, the simulator's virtual
harness and the lab's fleet benchmarks all run.

Pods on the same accelerators (a `group`) run the same model on the same hardware, so a pod
whose engine has not reported a step profile or a current acceptance yet borrows its
siblings', and pods whose engines report no profile at all share one fitted from all their
samples. One pod of a group runs a trial at a time, so a fleet that holds steady does not dip
all at once.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from typing import NamedTuple

from specgate_router.control.acceptance import Acceptance
from specgate_router.control.decision import Decision, decide
from specgate_router.control.model import RateModel, measured_scale
from specgate_router.control.profile import StepProfile, fitted_from_samples
from specgate_router.control.samples import Sample, newest_within, pool_samples
from specgate_router.control.tuning import TUNING, Tuning
from specgate_router.settings import ControlSettings


class PodInput(NamedTuple):
    """What the control step needs of one pod."""

    previous: Decision
    samples: Sequence[Sample]
    """Its own samples, in time order."""
    fresh: bool = True
    pool: str = "mixed"
    """Pods of the latency pool run no trials: the pool is sized by their thresholds."""
    profile: StepProfile | None = None
    """The step profile its engine reports (None: none yet, or none at all)."""
    acceptance: Acceptance | None = None
    """Its current accept length, where it comes from and how sure (None: nothing recent)."""
    settled: bool = True
    """Its acceptance holds still (`AcceptanceTracker.settled`)."""
    group: Hashable = None
    """Pods with the same group (accelerator, accelerators per engine) share what they learn."""


def step(
    pods: Sequence[PodInput],
    *,
    now: float,
    params: ControlSettings,
    tuning: Tuning = TUNING,
) -> list[Decision]:
    """Every pod's next decision, in the order given."""
    decisions: list[Decision | None] = [None] * len(pods)
    for i, decision in each_decision(pods, now=now, params=params, tuning=tuning):
        decisions[i] = decision
    return [d for d in decisions if d is not None]


def each_decision(
    pods: Sequence[PodInput],
    *,
    now: float,
    params: ControlSettings,
    tuning: Tuning = TUNING,
) -> Iterator[tuple[int, Decision]]:
    """`step`, one pod at a time: (index into `pods`, its decision), a pod's model built
    just before its decision. A caller that must not hold its thread for a whole fleet (the
    router's event loop, at 64 pods about 10 ms a step) may pause between pods; what it reads
    of a pod's samples then is what they hold when that pod's turn comes."""
    groups: dict[Hashable, list[int]] = {}
    for i, pod in enumerate(pods):
        groups.setdefault(pod.group, []).append(i)
    for members in groups.values():
        group = [pods[i] for i in members]
        trialing = any(pod.previous.trial is not None for pod in group)
        for i, pod, model in zip(
            members, group, models(group, now=now, params=params), strict=True
        ):
            decision = decide(
                pod.previous,
                pod.samples,
                model,
                fresh=pod.fresh,
                now=now,
                params=params,
                tuning=tuning,
                may_trial=not trialing and pod.pool != "latency" and pod.settled,
            )
            trialing = trialing or decision.trial is not None
            yield i, decision


def models(
    group: Sequence[PodInput], *, now: float, params: ControlSettings
) -> Iterator[RateModel | None]:
    """Each pod's uncorrected model, built as it is asked for: its engine's profile (or a
    sibling's) with its accept length (or its siblings' mean), or, where no pod of the group
    reports a profile, one fitted from the group's samples."""
    profiles = [p.profile for p in group if p.profile is not None]
    known = [p.acceptance for p in group if p.acceptance is not None]
    shared = (
        Acceptance(sum(a.tau for a in known) / len(known), "siblings'", max(a.error for a in known))
        if known
        else None
    )
    fitted: RateModel | None = None
    if not profiles:
        pooled = pool_samples([p.samples for p in group])
        profile = fitted_from_samples(pooled, now=now, need=params.min_samples)
        fitted = None if profile is None else RateModel(profile, 1.0, "samples")
    for pod in group:
        profile = pod.profile or (profiles[0] if profiles else None)
        acceptance = pod.acceptance or shared
        if profile is None:
            yield fitted
        elif acceptance is None:
            yield None
        else:
            between = between_steps(pod.samples, now)
            yield RateModel(
                profile, acceptance.tau, acceptance.source, between,
                tau_error=acceptance.error, scale=measured_scale(pod.samples, profile),
            )  # fmt: skip


BETWEEN_SECONDS = 10.0
"""A pod's time between decode steps is read over its samples of this long."""


def between_steps(samples: Sequence[Sample], now: float) -> float:
    """q: the seconds the pod spent between decode steps per token it generated, the median
    over its recent samples (0 where none says)."""
    values = sorted(
        s.outside_steps / s.tokens_per_second
        for s in newest_within(samples, now=now, seconds=BETWEEN_SECONDS)
        if s.outside_steps is not None and s.tokens_per_second > 0
    )
    return values[len(values) // 2] if values else 0.0
