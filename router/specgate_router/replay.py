"""The threshold controller replayed over recorded samples, offline.

The router exports what its controller decides from (`GET /specgate/samples`: every pod's
learning samples and the control settings). `replay` runs the control step over one pod's
samples as the router would have: one step every `scrapeIntervalSeconds`, each seeing the
samples taken by then. The export holds no step profile or acceptance, so the replayed law
reads its rates from the samples, as it does for an engine that reports no profile. A
recorded run then answers "why did the threshold go to 13?" and "what would `minSamples: 6`
have done?" without the GPU it was measured on.

Under other settings a replay still reads the samples the recorded thresholds produced: where
it would have run the other mode at a batch, it reads the mode that ran, which is no
measurement of its own. It tells what those settings decide from this evidence, not what a
live run under them would have measured. Nor does a replay see scrapes that gave no sample
(an idle pod, or one switching modes within an interval): they keep a live pod fresh, while a
replayed pod is fresh only while its newest sample is at most `staleAfterSeconds` old. It
replays one pod learning from its own samples in the mixed pool (no siblings, no latency
pool): the GPU envelope's routed server.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from specgate_router import control
from specgate_router.settings import ControlSettings

SAMPLE_FIELDS = ("at", "batch", "tokensPerSecond", "speculatingFraction")
"""The columns of an exported sample row, in order."""


def sample_rows(samples: Iterable[control.Sample]) -> list[list[float]]:
    """Samples as compact rows (SAMPLE_FIELDS): a pod keeps up to 1200."""
    return [
        [
            round(s.at, 3),
            round(s.batch, 3),
            round(s.tokens_per_second, 1),
            round(s.speculating_fraction, 3),
        ]
        for s in samples
    ]


def samples_from_rows(rows: Iterable[Sequence[float]]) -> list[control.Sample]:
    """The inverse of `sample_rows`; a row that is not four numbers is a ValueError naming it."""
    samples = []
    for i, row in enumerate(rows):
        if len(row) != len(SAMPLE_FIELDS) or not all(isinstance(v, int | float) for v in row):
            raise ValueError(f"sample row {i}: {row!r} is not [{', '.join(SAMPLE_FIELDS)}]")
        samples.append(control.Sample(*(float(v) for v in row)))
    return samples


@dataclass(frozen=True)
class Change:
    """A step at which the replayed threshold took a new value (the first: where it started)."""

    at: float
    threshold: int | None
    reason: str
    """The decision's rule and its figures (control.Decision.reason)."""


def replay(
    samples: Sequence[control.Sample],
    *,
    params: ControlSettings,
    start: control.Decision | None = None,
    until: float | None = None,
) -> list[Change]:
    """The thresholds one pod would have taken over `samples`, from `start` (default: a new
    pod's first decision at its first sample) to `until` (default: its last sample)."""
    ordered = sorted(samples, key=lambda s: s.at)
    if not ordered:
        return []
    times = [s.at for s in ordered]
    first, end = times[0], times[-1] if until is None else until
    interval = params.scrape_interval_seconds
    decision = start if start is not None else control.initial_decision(params, first)
    changes = [Change(first, decision.threshold, decision.reason)]
    visible: list[control.Sample] = []  # grows as the steps pass the samples' times
    step = 0
    # Steps counted, not summed: a float clock summed 0.5 at a time drifts off the samples.
    while (now := first + step * interval) <= end:
        seen = bisect.bisect_right(times, now)
        visible.extend(ordered[len(visible) : seen])
        fresh = now - times[seen - 1] <= params.stale_after_seconds
        if not fresh and seen < len(times):
            # Stale until the next sample: no decision (the control law changes nothing while
            # stale), so go straight there; a pod idle for a day is not 170k steps.
            step = max(step + 1, math.ceil((times[seen] - first) / interval))
            continue
        (decision,) = control.step(
            [control.PodInput(decision, visible, fresh=fresh)], now=now, params=params
        )
        if decision.threshold != changes[-1].threshold:
            changes.append(Change(now, decision.threshold, decision.reason))
        step += 1
    return changes


def pod_samples(export: dict[str, Any], pod: str | None = None) -> tuple[str, list[control.Sample]]:
    """(name, samples) of one pod of a `/specgate/samples` answer: `pod`, or the only one."""
    pods = export.get("pods")
    if not isinstance(pods, list) or not pods:
        raise ValueError("no pods in the samples export (expected GET /specgate/samples' answer)")
    if list(export.get("fields", SAMPLE_FIELDS)) != list(SAMPLE_FIELDS):
        raise ValueError(f"sample fields {export.get('fields')!r}, expected {list(SAMPLE_FIELDS)}")
    names = [p.get("name") for p in pods]
    if pod is None and len(pods) > 1:
        raise ValueError(f"{len(pods)} pods in the export ({', '.join(map(str, names))}): pick one")
    chosen = pods[0] if pod is None else next((p for p in pods if p.get("name") == pod), None)
    if chosen is None:
        raise ValueError(f"no pod {pod!r} in the export; it has {', '.join(map(str, names))}")
    return str(chosen["name"]), samples_from_rows(chosen.get("samples", []))
