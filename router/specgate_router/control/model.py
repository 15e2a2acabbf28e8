"""The rates the law compares: each mode's expected output per request at every batch.

From what the engine reports, a request at decode batch b spends per output token

    speculating   t_on(b) / tau + q * b        off   t_off(b) / k + q * b

(t_*: the step profile, each mode's scaled by what the pod's own decode steps in that mode
took against it (`measured_scale`: a start-up profile taken on a busier or quieter GPU is off
by a factor per mode, and the engine times every step it runs); tau: the accept length; k:
the off-step tokens; q: the seconds the pod spends between decode steps per token it
generates, mostly prefills, measured from its own samples and taken to be the same in both
modes, since both prefill the same requests; a request waits for the prefills of a whole
batch). One measured correction, rho, multiplies the
speculating rate: what the trials read between the two modes' delivered-over-predicted
(`correction.Reading`). Speculation pays at b where

    ratio(b) = rho * (t_off(b) / k + q b) / (t_on(b) / tau + q b) >= 1

and the threshold is the top of the band of batches where it pays that holds the pod's batch.
For a profile fitted from samples tau = k = 1 and q = 0: its step times are delivered seconds
per token, prefills included.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from specgate_router.control.profile import StepProfile
from specgate_router.control.samples import Sample


@dataclass(frozen=True)
class RateModel:
    profile: StepProfile
    tau: float
    """The accept length the speculating rate is predicted with (1 for a fitted profile)."""
    source: str
    """Where `tau` comes from: "measured", "estimated while off (calibrated)", "siblings'"..."""
    between: float = 0.0
    """q: seconds between decode steps per generated token, the pod's own (0: none measured)."""
    correction: float = 1.0
    """rho: the modes' delivered-over-predicted, speculating over off (1: none measured)."""
    tau_error: float = 0.0
    """How far (as a share) `tau` may be from what speculation would measure (0: measured)."""
    scale: tuple[float, float] = (1.0, 1.0)
    """(speculating, off): the pod's measured decode steps over the profile's, per mode
    (`measured_scale`; 1: not measured)."""

    def corrected(self, correction: float, between: float | None = None) -> RateModel:
        """This model with the correction `correction`, and `between` where given (a reading's:
        its correction was read against the rates with that q)."""
        return replace(
            self, correction=correction, between=self.between if between is None else between
        )

    def seconds_per_token(
        self, batch: float, speculating: bool, tau: float | None = None
    ) -> float | None:
        """Uncorrected seconds per output token of one request at `batch` in one mode, its
        decode step's share plus its wait between steps (None: not profiled there), with
        accept length `tau` where given (a sample's own) instead of the model's."""
        step = self.profile.step_seconds(batch, speculating)
        if step is None:
            return None
        step *= self.scale[0] if speculating else self.scale[1]
        if self.profile.fitted:
            return step
        tokens = (self.tau if tau is None else tau) if speculating else self.profile.off_step_tokens
        return step / tokens + self.between * batch

    def ratio(self, batch: float) -> float | None:
        """Corrected speculating over off rate per request at `batch` (None: not profiled)."""
        steps = self.profile.steps
        b = round(batch)
        if not 0 <= b < len(steps) or (pair := steps[b]) is None:
            return None
        return self._ratio(b, pair)

    def _ratio(self, b: int, pair: tuple[float, float]) -> float:
        on, off = pair[0] * self.scale[0], pair[1] * self.scale[1]
        if self.profile.fitted:
            return self.correction * off / on
        wait = self.between * b
        return (
            self.correction * (off / self.profile.off_step_tokens + wait) / (on / self.tau + wait)
        )

    def threshold(self, batch: float | None, *, low: int, high: int) -> int | None:
        """The top of the band of batches where speculation pays that holds `batch` (or, where
        it does not pay at `batch`, the top of the nearest such band below it: plain decoding
        from there up), within [low, high]; for an idle pod (`batch` None), the largest batch
        where it pays. Where the profile stops first, the threshold stops at its top: beyond
        it the model cannot say. None where the profile does not cover `batch`."""
        steps = self.profile.steps
        top = min(high, len(steps) - 1)

        def pays(b: int) -> bool:
            pair = steps[b]
            return pair is not None and self._ratio(b, pair) >= 1.0

        if batch is None or batch < 1:
            best = next((b for b in range(top, 0, -1) if pays(b)), 0)
        else:
            at = min(top, max(1, round(batch)))
            if steps[at] is None:
                return None
            if pays(at):
                best = at
                while best < top and pays(best + 1):
                    best += 1
            else:
                best = at - 1
                while best > 0 and not pays(best):
                    best -= 1
        return min(max(best, low), high)


SCALE_SAMPLES = 9
"""Samples of a run (the pod in one mode) a measured scale is the median of."""
SCALE_MIN_SAMPLES = 3
"""A run counts once it holds this many (its first, which times the new mode's first step
from the old mode's last, left out): until then the scales stay as they were before it."""
SCALE_SCAN = 600
"""How far back (samples: five minutes of scrapes) the runs are looked for: a mode not run
for that long keeps the profile's own figure."""
SCALE_BOUNDS = (0.5, 2.0)
"""A scale outside these says the steps measured something other than the profile (another
model, a stalled host): it is clipped, not believed."""


def measured_scale(samples: Sequence[Sample], profile: StepProfile) -> tuple[float, float]:
    """(speculating, off): each mode's decode steps as the pod timed them alone
    (`Sample.step_seconds`) over the profile's at the same batch.

    The mode of the pod's newest run: the median over its newest samples. The other mode,
    from the run before: its steps against those of the newer run right after the switch,
    times the newer run's scale now: the host's speed moves both modes alike, and a mode
    measured minutes after the other would read a host that slowed in between as a gain of
    the mode measured first. A mode without a run within SCALE_SCAN samples keeps the
    profile's figure (1), as does a profile fitted from samples (measured already)."""
    if profile.fitted:
        return 1.0, 1.0
    runs = _runs(samples, profile)
    if not runs:
        return 1.0, 1.0
    mode, newest, adjacent = runs[0]
    now = _median(newest)
    other = now * _median(runs[1][1]) / _median(adjacent) if len(runs) > 1 else 1.0
    low, high = SCALE_BOUNDS
    now, other = (min(high, max(low, v)) for v in (now, other))
    return (now, other) if mode else (other, now)


def _runs(
    samples: Sequence[Sample], profile: StepProfile
) -> list[tuple[bool, list[float], list[float]]]:
    """The pod's two newest runs of SCALE_MIN_SAMPLES timed samples or more, newest first:
    (speculating, its newest SCALE_SAMPLES steps over the profile's, its oldest as many).
    Only those are divided out: a pod that held one mode for minutes has hundreds."""
    runs: list[tuple[bool, list[float], list[float]]] = []
    newest: list[Sample] = []  # the run being read: its newest timed samples
    oldest: deque[Sample] = deque(maxlen=SCALE_SAMPLES + 1)  # and its oldest, one to spare
    count = 0
    mode: bool | None = None

    def ratios(run: Iterable[Sample]) -> list[float]:
        out = []
        for s in run:
            reported = profile.step_seconds(s.batch, s.speculating)
            if reported and s.step_seconds is not None:
                out.append(s.step_seconds / reported)
        return out

    # The batches each mode is profiled at: a sample beyond them has nothing to scale.
    spans = {m: (p[0][0], p[-1][0]) for m, p in ((True, profile.on), (False, profile.off))}
    for s in itertools.islice(reversed(samples), SCALE_SCAN):
        if s.speculating != mode:
            if mode is not None and count > SCALE_MIN_SAMPLES:
                # The run's first timed sample (oldest[-1]) spans the switch: left out.
                first = list(oldest)[:-1] if count > SCALE_SAMPLES else newest[:-1]
                runs.append((mode, ratios(newest), ratios(first[-SCALE_SAMPLES:])))
                if len(runs) == 2:
                    return runs
            mode, newest, count = s.speculating, [], 0
            oldest.clear()
        low, high = spans[s.speculating]
        if s.step_seconds is None or not low <= s.batch <= high:
            continue
        count += 1
        if len(newest) < SCALE_SAMPLES:
            newest.append(s)
        oldest.append(s)
    if mode is not None and count >= SCALE_MIN_SAMPLES:
        first = list(oldest) if count > SCALE_SAMPLES else newest
        runs.append((mode, ratios(newest), ratios(first[-SCALE_SAMPLES:])))
    return [run for run in runs if run[1] and run[2]]


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]
