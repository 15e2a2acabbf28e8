"""Placement: filters -> scorers -> picker, as small named units chosen by configuration.

Shaped after the llm-d router's plugins: a `Filter` drops pods that cannot take the request, a
`Scorer` rates the rest in [0, 1], and the picker takes the best weighted sum, breaking ties at
random. No candidates left is a typed `Saturated` result (the HTTP edge turns it into 503 with
Retry-After), never an exception. Which filters, scorers (with weights) and picker run is the
resource's spec.router.plugins; every plugin is registered by that name below.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from specgate import contract
from specgate_router.pods import PodState
from specgate_router.settings import RouterSettings, TrafficClass


@dataclass(frozen=True)
class Context:
    traffic_class: TrafficClass
    now: float
    settings: RouterSettings
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Saturated:
    """No pod can take the request; `reasons` counts why pods were dropped."""

    reasons: dict[str, int]


class Filter(Protocol):
    name: ClassVar[str]
    soft: ClassVar[bool]
    """A soft filter only de-prioritises: it is ignored when it would leave no candidate."""

    def keep(self, pod: PodState, ctx: Context) -> bool: ...


class Scorer(Protocol):
    name: ClassVar[str]

    def score(self, pod: PodState, ctx: Context) -> float: ...


class Healthy:
    soft: ClassVar[bool] = False
    name: ClassVar[str] = "healthy"

    def keep(self, pod: PodState, ctx: Context) -> bool:
        return pod.healthy and pod.name not in ctx.exclude


class NotDraining:
    soft: ClassVar[bool] = False
    name: ClassVar[str] = "not-draining"

    def keep(self, pod: PodState, ctx: Context) -> bool:
        return not pod.draining


class FreshMetrics:
    """Stale metrics mean the router cannot see the pod's load: it counts as saturated, taken
    only when no pod with fresh metrics can take the request."""

    name: ClassVar[str] = "fresh-metrics"
    soft: ClassVar[bool] = True

    def keep(self, pod: PodState, ctx: Context) -> bool:
        return pod.fresh(ctx.now, ctx.settings.control)


class CircuitClosed:
    soft: ClassVar[bool] = False
    name: ClassVar[str] = "circuit-closed"

    def keep(self, pod: PodState, ctx: Context) -> bool:
        return pod.breaker.allows(ctx.now, ctx.settings.resilience)


class LoadScorer:
    """Free capacity: 1 for an idle pod, 0 for one whose running + queued fill its cap."""

    name: ClassVar[str] = "load"

    def score(self, pod: PodState, ctx: Context) -> float:
        return max(0.0, 1.0 - pod.expected_batch() / pod.capacity())


class ClassFitScorer:
    """Latency traffic goes where it will be speculated on: a pod whose batch stays at or under
    its threshold with this request added, in the latency pool first. Where no pod would
    speculate it, the class does not matter and load decides alone (piling latency traffic
    onto its pool's busy pods would only make it slower). Throughput traffic goes to
    throughput-pool pods, which batch past their thresholds without speculation, and to a
    latency pod only while it has room besides its share of the latency traffic
    (`throughput_room`, this router's) and its batch, every replica's requests counted, is
    under the one it is sized for (`pool_batch`), or when that is all there is."""

    name: ClassVar[str] = "class-fit"

    def score(self, pod: PodState, ctx: Context) -> float:
        home = pod.pool == "mixed" or pod.pool == ctx.traffic_class
        if ctx.traffic_class == "latency":
            if not contract.speculates(pod.expected_batch() + 1, pod.threshold):
                return 0.0
            return 1.0 if home else 0.6
        if (
            not home
            and pod.throughput_in_flight < pod.throughput_room
            and pod.expected_batch() < pod.pool_batch
        ):
            return 1.0
        return 1.0 if home else 0.2


FILTERS: dict[str, Callable[[], Filter]] = {
    f.name: f for f in (Healthy, NotDraining, CircuitClosed, FreshMetrics)
}
SCORERS: dict[str, Callable[[], Scorer]] = {s.name: s for s in (LoadScorer, ClassFitScorer)}
"""Every plugin by the name the resource's spec.router.plugins gives it."""


def max_score(scored: Sequence[tuple[float, PodState]], rng: random.Random) -> PodState:
    """The highest weighted sum; ties broken at random."""
    best = max(score for score, _ in scored)
    return rng.choice([p for score, p in scored if score >= best - 1e-9])


def weighted_random(scored: Sequence[tuple[float, PodState]], rng: random.Random) -> PodState:
    """A pod drawn with probability proportional to its weighted sum (uniform when all are 0)."""
    weights = [max(0.0, score) for score, _ in scored]
    if sum(weights) <= 0:
        return rng.choice([p for _, p in scored])
    return rng.choices([p for _, p in scored], weights=weights)[0]


Picker = Callable[[Sequence[tuple[float, PodState]], random.Random], PodState]
PICKERS: dict[str, Picker] = {"max-score": max_score, "weighted-random": weighted_random}


def configured_filters(settings: RouterSettings) -> list[Filter]:
    return [FILTERS[name]() for name in settings.plugins.filters]


def scorers(settings: RouterSettings) -> list[tuple[Scorer, float]]:
    """The weighted scorers named in the configuration."""
    return [(SCORERS[s.name](), s.weight) for s in settings.plugins.scorers]


def choose(
    pods: Sequence[PodState],
    ctx: Context,
    *,
    rng: random.Random,
    filters: Sequence[Filter] | None = None,
) -> PodState | Saturated:
    reasons: dict[str, int] = {}
    candidates = list(pods)
    for f in configured_filters(ctx.settings) if filters is None else filters:
        kept = [pod for pod in candidates if f.keep(pod, ctx)]
        if f.soft and not kept:
            continue
        if len(kept) < len(candidates):
            reasons[f.name] = reasons.get(f.name, 0) + len(candidates) - len(kept)
        candidates = kept
    if not candidates:
        return Saturated(reasons)
    weighted = scorers(ctx.settings)
    scored = [(sum(w * s.score(p, ctx) for s, w in weighted), p) for p in candidates]
    return PICKERS[ctx.settings.plugins.picker](scored, rng)
