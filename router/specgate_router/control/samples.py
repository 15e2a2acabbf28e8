"""What a pod delivered between two scrapes: the samples the control law reads.

A sample is one mode at one batch over an interval: its decode batch, the output tokens per
second it delivered, the share of its decode steps that speculated, the accept length the pod
had then, and the share of its time spent outside decode steps. Intervals that mixed the
modes, moved the batch a lot or reset the counters give none.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

STEADY_MODE_FRACTION = 0.9
"""A sample counts for a mode when at least this share of its decode steps ran in that mode."""
CYCLES_SPAN = 1.5
"""A sample's decode cycles time its tokens where they span the scrape interval within this
factor: a step launched more than 2 s after the one before it counts only its own time, so
cycles far shorter than the interval left a long prefill or an idle spell out."""
SAMPLE_MIN_STEPS = 2
"""A sample holds at least this many decode steps (the pod's state reader spans scrapes until
it does)."""


@dataclass(frozen=True)
class Sample:
    """What one pod did between two scrapes."""

    at: float
    batch: float  # mean running requests over the interval
    tokens_per_second: float  # output tokens delivered
    speculating_fraction: float  # share of decode steps with speculation on
    accept_length: float | None = None
    """The pod's accept length (measured or estimated) when taken (None: unknown)."""
    outside_steps: float | None = None
    """The share of the pod's decode cycles (one decode step's launch to the next's) spent
    outside its decode steps: prefills and what runs around them, which the step profile does
    not time (None: unknown)."""
    step_seconds: float | None = None
    """The mean of its decode steps that directly followed another decode step (no prefill
    between): what a step of its mode took at its batch, measured (None: none ran)."""

    @property
    def per_request(self) -> float:
        """Output tok/s per running request (batch > 0 where samples are compared)."""
        return self.tokens_per_second / self.batch

    @property
    def speculating(self) -> bool:
        return self.speculating_fraction >= STEADY_MODE_FRACTION


def sample_between(
    *,
    t0: float,
    t1: float,
    batch0: int,
    batch1: int,
    tokens0: float,
    tokens1: float,
    steps_on0: float,
    steps_on1: float,
    steps_off0: float,
    steps_off1: float,
    mean_batch: float | None = None,
    cycle_seconds: float | None = None,
) -> Sample | None:
    """A sample from two scrapes, or None when the interval says nothing about one mode at one
    batch size (idle, mixed modes, batch moving, counters reset). `mean_batch`, the engine's
    mean decode batch over the interval where it reports one, replaces the mean of the two
    scrapes' batch sizes. `cycle_seconds`, the launch-to-launch cycles of the decode steps the
    interval completed (the prefills between them included), replaces the interval's length as
    what the tokens took: a scrape interval holds a whole number of steps, so against the wall
    clock one that caught one step more reads faster by a step's share (a quarter where steps
    take 120 ms against half-second scrapes)."""
    dt = t1 - t0
    d_tokens = tokens1 - tokens0
    d_on, d_off = steps_on1 - steps_on0, steps_off1 - steps_off0
    if dt <= 0 or d_tokens <= 0 or d_on < 0 or d_off < 0 or d_on + d_off < SAMPLE_MIN_STEPS:
        return None
    if batch0 <= 0 or batch1 <= 0 or abs(batch1 - batch0) > max(1.0, 0.25 * max(batch0, batch1)):
        return None
    fraction = d_on / (d_on + d_off)
    if STEADY_MODE_FRACTION > fraction > 1 - STEADY_MODE_FRACTION:
        return None
    batch = mean_batch if mean_batch is not None and mean_batch > 0 else (batch0 + batch1) / 2
    seconds = dt
    if cycle_seconds is not None and dt / CYCLES_SPAN < cycle_seconds < dt * CYCLES_SPAN:
        seconds = cycle_seconds
    return Sample(t1, batch, d_tokens / seconds, fraction)


def newest_within(own: Sequence[Sample], *, now: float, seconds: float) -> Iterator[Sample]:
    """The pod's samples (in time order) of the last `seconds`, newest first: read back from
    the newest only, since a pod keeps up to 1200 and this runs every control step."""
    return itertools.takewhile(lambda s: now - s.at <= seconds, reversed(own))


def accept_length_now(newest_first: Sequence[Sample], count: int = 3) -> float | None:
    """The median accept length measured by the newest `count` speculating samples (None:
    none): the workload the pod runs now, steadier than one interval's reading. An estimate
    while off moves with its calibration and its source as well as with the workload, so
    only measured lengths tell workloads apart."""
    found = sorted(
        itertools.islice(
            (s.accept_length for s in newest_first if s.speculating and s.accept_length), count
        )
    )
    return found[len(found) // 2] if found else None


def same_workload(sample: Sample, accept_length: float | None, band: float) -> bool:
    """Whether `sample` was taken on the workload whose measured accept length is
    `accept_length`: a speculating sample's own within `band` of it (True where either is
    unknown, and for samples that did not speculate)."""
    if accept_length is None or not sample.speculating or not sample.accept_length:
        return True
    return abs(sample.accept_length - accept_length) <= band * accept_length


def since(own: Sequence[Sample], start: float) -> list[Sample]:
    """The samples taken after `start`, in time order."""
    return list(itertools.takewhile(lambda s: s.at > start, reversed(own)))[::-1]


def median_batch(own: Sequence[Sample], *, now: float, seconds: float) -> float | None:
    """The median decode batch of the pod's samples of the last `seconds` (None: none)."""
    batches = sorted(s.batch for s in newest_within(own, now=now, seconds=seconds))
    return batches[len(batches) // 2] if batches else None


def band(batch: float, fraction: float) -> float:
    """Half-width of the batches that count as `batch`: a fraction of it, at least one request."""
    return max(1.0, fraction * batch)


def near(batch: float, other: float, factor: float) -> bool:
    """Whether `batch` lies within `factor` (either way) or two requests of `other`."""
    if batch <= 0 or other <= 0:
        return False
    return max(batch / other, other / batch) <= factor or abs(batch - other) <= 2


def held(
    own: Sequence[Sample], *, now: float, seconds: float, need: int, batch_band: float
) -> tuple[float, bool] | None:
    """(batch, speculating) where the pod's newest samples, at least `need` of them and those
    of the last `seconds` (a long prefill can stretch one sample over several scrapes), all
    ran one mode at one batch (within `batch_band`) and the pod has run since at least
    `seconds` before `now`; else None."""
    recent: list[Sample] = []
    for s in reversed(own):
        if len(recent) >= need and now - s.at > seconds:
            break
        recent.append(s)
    if len(recent) < need or now - recent[-1].at < 0.75 * seconds:
        return None
    modes = {s.speculating for s in recent}
    batches = sorted(s.batch for s in recent)
    middle = batches[len(batches) // 2]
    if len(modes) != 1 or any(abs(b - middle) > band(middle, batch_band) for b in batches):
        return None
    return middle, modes.pop()


def mean_and_error(values: Sequence[float]) -> tuple[float, float]:
    """The mean of `values` (in time order) and its standard error, widened by their lag-one
    correlation: neighbouring scrapes share a prefill burst, and n of them say less than n
    independent ones (inf under three)."""
    n = len(values)
    mean = sum(values) / n if n else 0.0
    if n < 3:
        return mean, math.inf
    deviations = [v - mean for v in values]
    variance = sum(d * d for d in deviations) / (n - 1)
    if variance <= 0:
        return mean, 0.0
    lag = sum(a * b for a, b in itertools.pairwise(deviations)) / ((n - 1) * variance)
    rho = min(0.9, max(0.0, lag))
    return mean, math.sqrt(variance / n * (1 + rho) / (1 - rho))


def pool_samples(per_pod: Sequence[Sequence[Sample]], limit: int = 4800) -> list[Sample]:
    """The newest samples of all pods of a deployment, at most `limit`. Pods are scraped at the
    same rate, so an equal share of each pod's newest samples is the newest overall."""
    if not per_pod:
        return []
    share = max(1, limit // len(per_pod))
    newest = (list(itertools.islice(reversed(samples), share))[::-1] for samples in per_pod)
    return [s for samples in newest for s in samples]
