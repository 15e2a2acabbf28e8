"""The latency and throughput pools: which pods serve latency traffic first, and how many
throughput requests each of them takes besides.

Latency traffic speculates only on pods whose batch stays at or under their threshold, so the
pool is sized to hold the latency class's in-flight requests at the pods' typical threshold (or
at the batch that meets a TPOT target, where one is set), and takes only pods the throughput
class can spare. Pure functions of the loads and thresholds the router reads.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from specgate_router.control.model import RateModel
from specgate_router.control.samples import STEADY_MODE_FRACTION, Sample

HALF_LIFE_SECONDS = 300.0
"""Samples this old weigh half as much in the speculating line a TPOT target is read from."""


@dataclass(frozen=True)
class Line:
    alpha: float
    beta: float
    samples: int
    distinct_batches: int
    lowest_batch: float = 0.0
    highest_batch: float = 0.0

    def at(self, batch: float) -> float:
        return self.alpha + self.beta * batch


def fit(
    samples: Sequence[Sample],
    *,
    speculating: bool,
    now: float,
    batch_range: tuple[float, float] = (0.0, math.inf),
) -> Line | None:
    """Weighted least-squares line through y = batch / tok/s for one mode."""
    lo, hi = batch_range
    fraction = STEADY_MODE_FRACTION
    # The batch range first: it is narrow, and this scans every pooled sample several times a
    # control step (the step's largest cost).
    pts = [
        (s.batch, s.batch / s.tokens_per_second, 0.5 ** ((now - s.at) / HALF_LIFE_SECONDS))
        for s in samples
        if lo <= s.batch <= hi
        and (s.speculating_fraction >= fraction) == speculating
        and s.tokens_per_second > 0
    ]
    if not pts:
        return None
    distinct = len({round(b) for b, _, _ in pts})
    span = (min(b for b, _, _ in pts), max(b for b, _, _ in pts))
    w = sum(p[2] for p in pts)
    mx = sum(b * wt for b, _, wt in pts) / w
    my = sum(y * wt for _, y, wt in pts) / w
    var = sum(wt * (b - mx) ** 2 for b, _, wt in pts)
    if distinct < 2 or var <= 1e-12:
        return Line(my, 0.0, len(pts), distinct, *span)
    beta = sum(wt * (b - mx) * (y - my) for b, y, wt in pts) / var
    return Line(my - beta * mx, beta, len(pts), distinct, *span)


ClassName = TypeVar("ClassName")


def fleet_class_load(
    own: Mapping[ClassName, float], others_in_flight: float
) -> dict[ClassName, float]:
    """The in-flight requests per class across every router replica: this replica's (`own`)
    scaled up by the requests the pods report beyond this replica's own at the moment of each
    report (`others_in_flight`, what other replicas sent), taking their class mix to be this
    replica's. The replicas then size the pools from the same load, and as one router would.
    Comparing each report with this replica's count at that report, not with its count now,
    keeps a single router from inflating its load: when a wave of requests has just finished,
    a report a scrape interval old would otherwise read as other replicas' traffic."""
    total = sum(own.values())
    if total <= 0 or others_in_flight <= 0:
        return dict(own)
    scale = (total + others_in_flight) / total
    return {cls: load * scale for cls, load in own.items()}


def latency_pool_size(
    pods: int,
    latency_load: float,
    throughput_load: float,
    *,
    threshold: int,
    min_fraction: float,
    max_fraction: float,
    throughput_batch_per_pod: float = math.inf,
    speculating_up_to: int | None = None,
) -> int:
    """How many pods serve latency traffic first: enough to hold the latency concurrency at or
    under `threshold` a pod (the batch a latency pod is sized for). The pool only takes pods
    the throughput traffic does not need to stay at or under `throughput_batch_per_pod` (at
    least one pod when there is any) and that `max_fraction` allows. Where that room is too
    small, the pool takes the pods that hold the latency traffic at or under
    `speculating_up_to` a pod, if the room has them (the pods' threshold: the traffic misses a
    TPOT target's batch but is still speculated on, which mixing it into throughput batches
    would not do); else there is no pool (beyond `min_fraction`): a pool over its threshold
    speculates nothing and only costs the throughput pods capacity. With no throughput traffic
    every pod the bounds allow serves latency first."""
    if pods <= 1:
        return pods
    lo = math.ceil(min_fraction * pods - 1e-9)
    hi = math.floor(max_fraction * pods + 1e-9)
    need = math.ceil(latency_load / max(1, threshold) - 1e-9) if latency_load > 0 else 0
    if throughput_load > 0:
        reserved = max(1, math.ceil(throughput_load / throughput_batch_per_pod - 1e-9))
        room = min(hi, pods - reserved)
        if need > room:
            limit = speculating_up_to or 0
            speculated = math.ceil(latency_load / limit - 1e-9) if limit > 0 else room + 1
            need = speculated if speculated <= room else 0
    return max(lo, min(hi, need))


def latency_batch_for_tpot(
    samples: Sequence[Sample],
    *,
    threshold: int,
    target_seconds: float,
    now: float,
    min_samples: int,
) -> int | None:
    """The largest batch, at most `threshold`, at which a speculating pod still delivers each
    request a token every `target_seconds`, from the speculating line (batch / tok/s is the
    time per output token). None when the samples cannot say, or no batch meets the target."""
    line = fit(samples, speculating=True, now=now, batch_range=(1.0, threshold + 0.5))
    if line is None or line.samples < min_samples:
        return None
    if line.beta <= 0:
        return threshold if line.at(1) <= target_seconds else None
    batch = math.floor((target_seconds - line.alpha) / line.beta + 1e-9)
    return min(threshold, batch) if batch >= 1 else None


def latency_batch_predicted(
    prediction: RateModel,
    between_seconds_per_token: float,
    *,
    threshold: int,
    target_seconds: float,
) -> int | None:
    """The largest batch, at most `threshold`, up to which the model predicts a speculating pod
    gives each request a token every `target_seconds`: the profile's decode step over the
    accept length, plus the time the pod spends between decode steps per generated token
    (prefills, mostly) times the batch, since a batch of b requests waits for the prefills of
    b requests' successors. Unlike a line fitted to samples, it needs no samples at small
    batches: a pod under throughput load has none. None when no batch meets the target."""
    best = None
    for batch in range(1, threshold + 1):
        step = prediction.seconds_per_token(batch, True)
        if step is None or step + between_seconds_per_token * batch > target_seconds:
            break
        best = batch
    return best


def median_threshold(thresholds: Sequence[int], default: int) -> int:
    """The pods' typical threshold (the median), or `default` when none is known."""
    ordered = sorted(thresholds)
    return ordered[len(ordered) // 2] if ordered else default


def latency_batch_for_target(
    samples: Sequence[Sample],
    thresholds: Sequence[int],
    *,
    target_ms: float | None,
    now: float,
    min_samples: int,
    models: Sequence[tuple[RateModel, float]] = (),
) -> int | None:
    """The batch that meets a TPOT target at the pods' median threshold: the median of what
    the pods' models predict (`models`: each pod's prediction and its time between decode
    steps per token, `latency_batch_predicted`), or without them `latency_batch_for_tpot`
    from the samples; None without a target, or when neither can say."""
    if target_ms is None or not thresholds:
        return None
    threshold = median_threshold(thresholds, 1)
    target = target_ms / 1000
    predicted = [
        latency_batch_predicted(m, between, threshold=threshold, target_seconds=target) or 0
        for m, between in models
    ]
    if predicted:
        batch = sorted(predicted)[len(predicted) // 2]
        return batch if batch >= 1 else None
    return latency_batch_for_tpot(
        samples, threshold=threshold, target_seconds=target, now=now, min_samples=min_samples
    )


def latency_pool_batch(
    thresholds: Sequence[int], *, default_threshold: int, latency_batch: int | None
) -> int:
    """The batch a latency pod is sized for: the pods' median threshold, or `latency_batch`
    (the batch that meets a TPOT target) when that is smaller."""
    typical = median_threshold(thresholds, default_threshold)
    return typical if latency_batch is None else min(typical, latency_batch)


def plan_latency_pool(
    pods: Sequence[str],
    thresholds: Sequence[int],
    *,
    latency_load: float,
    throughput_load: float,
    previous: set[str],
    default_threshold: int,
    min_fraction: float,
    max_fraction: float,
    throughput_batch_per_pod: float = math.inf,
    latency_batch: int | None = None,
) -> set[str] | None:
    """The latency pool for the live pods, or None when every pod serves both classes: one pod,
    no traffic yet, or so little that spread over all pods it stays at or under the batch a
    latency pod is sized for (`latency_pool_batch`: every pod speculates anyway, within the
    TPOT target where one is set, and splitting would only raise batch sizes)."""
    per_pod = latency_pool_batch(
        thresholds, default_threshold=default_threshold, latency_batch=latency_batch
    )
    total = latency_load + throughput_load
    if len(pods) <= 1 or total < 0.05 or total <= len(pods) * per_pod:
        return None
    size = latency_pool_size(
        len(pods),
        latency_load,
        throughput_load,
        threshold=per_pod,
        min_fraction=min_fraction,
        max_fraction=max_fraction,
        throughput_batch_per_pod=throughput_batch_per_pod,
        speculating_up_to=median_threshold(thresholds, default_threshold),
    )
    return assign_pools(pods, previous, size)


def throughput_room(pool_batch: int, *, latency_load: float, pool_size: int) -> int:
    """The throughput requests a latency pod takes: the batch it is sized for less its share
    of the latency class's in-flight requests (rounded up), so that the latency traffic keeps
    the batch it was promised and the pod's spare capacity still serves."""
    if pool_size <= 0:
        return 0
    return max(0, pool_batch - math.ceil(latency_load / pool_size - 1e-9))


def assign_pools(pods: Sequence[str], previous: set[str], size: int) -> set[str]:
    """The latency pool: keeps earlier members (no churn), fills or trims by name order."""
    ordered = sorted(pods)
    keep = [p for p in ordered if p in previous][:size]
    fill = [p for p in ordered if p not in keep][: size - len(keep)]
    return set(keep + fill)
