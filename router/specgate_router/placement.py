"""Placement: filters -> scorers -> picker, as small named units chosen by configuration.

Shaped after the llm-d router's plugins: a `Filter` drops pods that cannot take the request, a
`Scorer` rates the rest in [0, 1], and the picker takes the best weighted sum, breaking ties at
random. No candidates left is a typed `Saturated` result (the HTTP edge turns it into 503 with
Retry-After), never an exception.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

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
    name: str
    soft: bool
    """A soft filter only de-prioritises: it is ignored when it would leave no candidate."""

    def keep(self, pod: PodState, ctx: Context) -> bool: ...


class Scorer(Protocol):
    name: str

    def score(self, pod: PodState, ctx: Context) -> float: ...


class Healthy:
    soft = False
    name = "healthy"

    def keep(self, pod: PodState, ctx: Context) -> bool:
        return pod.healthy and pod.name not in ctx.exclude


class NotDraining:
    soft = False
    name = "not-draining"

    def keep(self, pod: PodState, ctx: Context) -> bool:
        return not pod.draining


class FreshMetrics:
    """Stale metrics mean the router cannot see the pod's load: it counts as saturated, taken
    only when no pod with fresh metrics can take the request."""

    name = "fresh-metrics"
    soft = True

    def keep(self, pod: PodState, ctx: Context) -> bool:
        return pod.fresh(ctx.now, ctx.settings.control)


class CircuitClosed:
    soft = False
    name = "circuit-closed"

    def keep(self, pod: PodState, ctx: Context) -> bool:
        return pod.breaker.allows(ctx.now, ctx.settings.resilience)


class LoadScorer:
    """Free capacity: 1 for an idle pod, 0 for one whose running + queued fill its cap."""

    name = "load"

    def score(self, pod: PodState, ctx: Context) -> float:
        return max(0.0, 1.0 - pod.expected_batch() / pod.capacity())


class ClassFitScorer:
    """Latency traffic goes where it will be speculated on: a pod whose batch stays at or under
    its threshold with this request added, in the latency pool first. Where no pod would
    speculate it, the class does not matter and load decides alone (piling latency traffic
    onto its pool's busy pods would only make it slower). Throughput traffic goes to
    throughput-pool pods, which batch past their thresholds without speculation, and spills to
    the latency pool only when that is all there is."""

    name = "class-fit"

    def score(self, pod: PodState, ctx: Context) -> float:
        home = pod.pool == "mixed" or pod.pool == ctx.traffic_class
        if ctx.traffic_class == "latency":
            if not contract.speculates(pod.expected_batch() + 1, pod.threshold):
                return 0.0
            return 1.0 if home else 0.6
        return 1.0 if home else 0.2


def default_filters() -> list[Filter]:
    return [Healthy(), NotDraining(), FreshMetrics(), CircuitClosed()]


def scorers(settings: RouterSettings) -> list[tuple[Scorer, float]]:
    """The weighted scorers named in the configuration."""
    weights = settings.placement
    return [(LoadScorer(), weights.load_weight), (ClassFitScorer(), weights.class_fit_weight)]


def choose(
    pods: Sequence[PodState],
    ctx: Context,
    *,
    rng: random.Random,
    filters: Sequence[Filter] | None = None,
) -> PodState | Saturated:
    reasons: dict[str, int] = {}
    candidates = list(pods)
    for f in filters or default_filters():
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
    best = max(score for score, _ in scored)
    return rng.choice([p for score, p in scored if score >= best - 1e-9])
