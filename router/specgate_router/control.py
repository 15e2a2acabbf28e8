"""The threshold controller: pure functions of (observations, previous decision, now).

Where does speculation stop paying on a pod? Each scrape interval in which the pod ran mostly
in one mode with a steady batch gives a sample: batch size b, mode, delivered output tok/s. A pod
with threshold T speculates at b <= T and not above, so it shows the speculating curve just
below T and the plain curve just above. Per mode the controller fits the per-request cost
y(b) = b / (tok/s), seconds per generated token per request, as a line y = alpha + beta * b
(weighted least squares, recent samples weigh more) over a window around T only: the costs
follow a roofline with a kink where steps turn compute-bound, so one global line would
mislead, while near T a line is accurate. Speculation pays while y_on(b) < y_off(b); the
estimate is the largest such b. Each move is bounded to [T/2, 2T+1], so a far estimate is
approached in steps and re-measured on the way: a fixed-point iteration towards the crossover.

Until both modes have enough samples near T at two or more batch sizes, the pod keeps its
threshold; so does an idle pod, whatever its siblings measured, until it serves. A load that
holds steadily away from T never gives such samples: a pod running plain at batch 64 under
T = 20 never measures speculation there. Such a pod probes: it runs the other mode at its batch for
a few seconds (`probe`), keeps it when it delivers more per request, and otherwise goes back
and waits twice as long before the next probe. Probes are rare (`probeIntervalSeconds` apart at
least, one pod of a deployment at a time), and a mode the pod measured at that batch within the
wait decides without one. Probes compare a pod with itself (siblings at the same batch may
serve another traffic mix), and pods of the latency pool do not probe: their threshold is what
the pool is sized by.

A new value is pushed only when it moves more than `hysteresis` from the current one, the
pod's last change is `cooldownSeconds` old, and samples near the current threshold were taken
since that change (`min_samples`): a move needs evidence the last move has not already spent.
Stale metrics never produce a decision. A move back the way the last one came goes halfway:
the crossover lies between the two thresholds, and two windows that each read it on the
other's side would otherwise swap them for ever. In dynamic mode the threshold stays >= 1: at
0 a pod would never speculate and the controller could never measure speculation again (use
mode `off` for that).

The same functions drive the router's control loop and the simulations in `lab/bench/`, and tests
feed them time instead of sleeping.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple, TypeVar

from specgate import contract
from specgate_router import predict
from specgate_router.predict import Prediction
from specgate_router.settings import ControlSettings

STEADY_MODE_FRACTION = predict.STEADY_MODE_FRACTION
"""A sample counts for a mode when at least this share of its decode steps ran in that mode."""
CYCLES_SPAN = 1.5
"""A sample's decode cycles time its tokens where they span the scrape interval within this
factor: a step launched more than 2 s after the one before it counts only its own time, so
cycles far shorter than the interval left a long prefill or an idle spell out."""
SAMPLE_MIN_STEPS = 2
"""A sample holds at least this many decode steps (the pod's state reader spans scrapes until
it does)."""
HALF_LIFE_SECONDS = 300.0
POOLED_SAMPLES = 4800
"""At most this many samples, the newest, go into one control step for a whole deployment: a
fleet of 64 pods keeping 1200 each would otherwise fit 77k points per pod per scrape."""


@dataclass(frozen=True)
class Sample:
    """What one pod did between two scrapes."""

    at: float
    batch: float  # mean running requests over the interval
    tokens_per_second: float  # output tokens delivered
    speculating_fraction: float  # share of decode steps with speculation on
    accept_length: float | None = None
    """The pod's accept length (measured or estimated) when taken: samples of another
    workload are not compared with the current one's (None: unknown)."""
    outside_steps: float | None = None
    """The share of the pod's decode cycles (one decode step's launch to the next's) spent
    outside its decode steps: prefills and what runs around them, which the step profile does
    not time (None: unknown)."""

    @property
    def per_request(self) -> float:
        """Output tok/s per running request (batch > 0 where samples are compared)."""
        return self.tokens_per_second / self.batch


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


PROBE_BAND = 0.15
"""Samples within this fraction of a batch size (at least one request) count as that batch."""
PROBE_MARGIN = 0.03
"""A mode replaces the running one at a batch when it delivers this much more per request: a
pod that keeps a mode measured slower by less loses at most this much, and the noise rules
(PROBE_CONFIDENCE) keep a smaller gain from switching on a few scrapes' swing."""
PROBE_BACKOFF_LIMIT = 8
"""A probe that changed nothing doubles the wait before the next, up to this many intervals."""


@dataclass(frozen=True)
class Probe:
    """A pod running the other mode for a while at the batch it holds steadily."""

    batch: float
    speculating: bool  # the mode on trial
    threshold: int  # the threshold that runs it at `batch`
    previous: int | None  # the threshold to go back to
    started: float
    until: float  # judged from here, once it has min_samples samples ...
    give_up: float  # ... or abandoned from here without a verdict
    measuring: bool = False
    """Started where the model's margin at the pod's batch is small (`MEASURE_BELOW_GAIN`):
    judged by its rate as any probe is, and its verdict outranks the model at that batch."""
    returned: float | None = None
    """A measuring probe's trial over: when it went back to the mode it left, to measure that
    again (the trial is judged against that mode before and after it)."""
    held_since: float = -math.inf
    """When the pod last changed mode before a measuring probe: a probe that goes back leaves
    the model's cooldown running from there, since its own switches are no move of the model's
    (a probe that ends inconclusive would otherwise hold back the model's next move a whole
    cooldown)."""
    tau: float | None = None
    """The accept length the pod had when a measuring probe started, which its samples before
    the probe carry. A probe of speculation from plain decoding measures the accept length
    that the estimate while off only guessed: the samples before it are still this workload's."""
    tau_measured: bool = True
    """`tau` was measured (the pod speculated), not estimated while off."""
    trials: tuple[tuple[float, float], ...] = ()
    """A measuring probe's earlier rounds, (trial started, went back) each: a round whose
    ratio lies within its scrapes' noise runs again, and the verdict pools every round's."""

    @property
    def began(self) -> float:
        """When the first round's trial started: the samples before it are the baseline."""
        return self.trials[0][0] if self.trials else self.started


@dataclass(frozen=True)
class Measurement:
    """A measuring probe's verdict: at `batch`, on the workload of accept length `tau`,
    speculation delivered `ratio` times plain decoding (None: the probe told nothing). It
    stands, and no other probe measures there, until `until`."""

    until: float
    tau: float
    batch: float
    ratio: float | None
    also: float | None = None
    """The accept length the probe started with: the same workload, read in the other mode."""
    taken: float = -math.inf
    """When the probe gave it. The pod's runs before that are the probe's own rounds, which it
    judged pooled: a newer three of them, read alone, would only judge them again on less."""
    measured: tuple[bool, bool] = (True, True)
    """Whether `tau` and `also` were measured (speculating), not estimated while off."""
    scaled: float | None = None
    """`ratio` as last read at a measured accept length (`read_at`), which stands while the
    pod runs plain decoding: the estimate while off differs from the measured accept length
    on one workload, and its calibration moves, so it scales nothing."""
    noise: float = 0.0
    """The reading's standard error (`_ratio_noise`): scaled, it names a mode the probe did
    not name only past PROBE_CONFIDENCE of it, as the probe itself would have."""
    estimated: float | None = None
    """The accept length estimated while off when it was taken (None: none recent). While the
    pod runs plain decoding its workload is read from that estimate, whose calibration can
    leave it 10% from the measured one on the same workload: read against the measured
    reading alone, the estimate's swing would take the verdict away and give it back every
    few seconds, and the model would switch the pod each time."""

    @property
    def better(self) -> bool | None:
        """The mode measured faster by PROBE_MARGIN (True: speculation; None: neither)."""
        return _better(self.ratio)

    def read_at(self, tau: float) -> Measurement:
        """The verdict at the measured accept length `tau`: speculation's rate per request
        grows with its accept length at a batch while plain decoding's does not, so a verdict
        that holds across a small acceptance move (COMPARABLE_ACCEPT) is scaled by it, against
        its own measured reading on that workload (unscaled where it has none)."""
        readings = zip((self.tau, self.also), self.measured, strict=True)
        then = next((a for a, m in readings if m and a and same_workload(tau, a)), None)
        if self.ratio is None or then is None:
            return self
        # Only the move beyond a steady workload's swing between readings scales it.
        moved = math.log(tau / then)
        beyond = max(0.0, abs(moved) - math.log(1 + ACCEPT_SWING))
        return replace(self, scaled=self.ratio * math.exp(math.copysign(beyond, moved)))

    def reading(self) -> tuple[bool | None, float]:
        """The mode faster by PROBE_MARGIN (None: neither) and by how much, as last read."""
        ratio = self.scaled if self.scaled is not None else self.ratio
        if ratio is None or ratio <= 0:
            return None, 1.0
        better, gain = _better(ratio), max(ratio, 1 / ratio)
        if better != self.better and gain <= 1 + PROBE_CONFIDENCE * self.noise:
            return None, gain  # within the reading's noise of what it measured
        return better, gain

    def holds(self, now: float, tau: float, batch: float) -> bool:
        """Whether it still speaks for the workload of accept length `tau` at this batch: its
        own workload, or one whose accept length moved beyond both its readings the way that
        favours the mode it named. Speculation's rate per request grows with its accept length
        and plain decoding's does not, so speculation measured faster stays faster where the
        drafts are accepted more, and plain decoding where they are accepted less."""
        if now >= self.until or abs(batch - self.batch) > band(self.batch):
            return False
        readings = [a for a in (self.tau, self.also, self.estimated) if a is not None]
        if any(same_workload(tau, a) for a in readings):
            return True
        better = self.better
        return (better is True and tau > max(readings)) or (better is False and tau < min(readings))


def _better(ratio: float | None) -> bool | None:
    """The mode that speculating-over-plain `ratio` says is faster by PROBE_MARGIN."""
    if ratio is None or ratio <= 0 or max(ratio, 1 / ratio) <= 1 + PROBE_MARGIN:
        return None
    return ratio > 1


@dataclass(frozen=True)
class Decision:
    threshold: int | None  # None: always speculate
    reason: str
    changed_at: float  # when the threshold last changed (-inf: never)
    probe: Probe | None = None
    probe_wait: float = 1.0  # the wait before the next probe, in probe intervals
    probe_after: float = -math.inf  # no probe before this (a pod's first: one interval in)
    moved: int = 0  # the direction of the last change the fit made: +1 up, -1 down, 0 none
    measured: Measurement | None = None  # the last measuring probe's verdict
    moved_on_estimate: float | None = None
    """The accept length estimated while off that the model's last move rested on; None when
    it rested on a measured one."""


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
    """A sample from two consecutive scrapes, or None when the interval says nothing about one
    mode at one batch size (idle, mixed modes, batch moving, counters reset). `mean_batch`, the
    engine's mean decode batch over the interval where it reports one, replaces the mean of the
    two scrapes' batch sizes. `cycle_seconds`, the launch-to-launch cycles of the decode steps
    the interval completed (SGLang's decode moments, the prefills between them included),
    replaces the interval's length as what the tokens took: a scrape interval holds a whole
    number of steps, so against the wall clock one that caught one step more reads faster by
    a step's share (a quarter where steps take 120 ms against half-second scrapes), and a
    probe of a few scrapes reads that alias as a difference between the modes."""
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


def pool_samples(per_pod: Sequence[Sequence[Sample]], limit: int = POOLED_SAMPLES) -> list[Sample]:
    """The newest samples of all pods of a deployment, at most `limit`. Pods are scraped at the
    same rate, so an equal share of each pod's newest samples is the newest overall."""
    if not per_pod:
        return []
    share = max(1, limit // len(per_pod))
    # From the newest end: a pod's history (a deque of up to 1200) is not copied every step.
    newest = (list(itertools.islice(reversed(samples), share))[::-1] for samples in per_pod)
    return [s for samples in newest for s in samples]


WIDENINGS = (1, 2, 4)
"""How far the window around the threshold may widen when both modes have samples near it but
at too few batch sizes to fit: a closed loop of c clients runs at a mean batch just under c,
so clients stepping 4, 8, 12, 16 put one batch size on each side of a threshold of 8. A mode
missing near the threshold does not widen the window:
its samples would come from far away and old (a ramp), and lines extrapolated from those
swung a steady pod's threshold back and forth."""


def window(threshold: int, widen: int = 1) -> tuple[float, float, float]:
    """(lowest speculating batch, boundary, highest plain batch) of the samples that count."""
    width = max(2.0, threshold / 2) * widen
    return max(1.0, threshold - width), threshold + 0.5, threshold + 1 + width


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


class Estimate(NamedTuple):
    """What the samples near one threshold say: where it should go (None: they cannot say) and
    why; once a move asks for them (`with_taken`), when the samples in the threshold's window
    were taken (sorted), so that a pod moves only on samples measured since its last change."""

    threshold: int | None
    why: str
    taken: tuple[float, ...] | None = None

    def with_taken(self, samples: Sequence[Sample], current: int) -> Estimate:
        """The times of the samples in `current`'s own window (not a widened one: a load
        holding far from the threshold keeps giving samples there, the same evidence every
        cooldown). Only a move needs them, so the scan runs then, once per threshold."""
        if self.taken is not None:
            return self
        low, _, high = window(current)
        return self._replace(taken=tuple(sorted(s.at for s in samples if low <= s.batch <= high)))

    def taken_since(self, since: float) -> int:
        taken = self.taken or ()
        return len(taken) - bisect.bisect_right(taken, since)


def estimate_threshold(
    samples: Sequence[Sample], *, current: int, now: float, params: ControlSettings
) -> tuple[int | None, str]:
    """(estimated threshold, why), or (None, why not) when the data near `current` cannot say.
    Both modes need samples in the window around `current`; the window widens (WIDENINGS)
    until each mode spans two or more batch sizes."""
    need = params.min_samples
    for widen in WIDENINGS:
        low, boundary, high = window(current, widen)
        on = fit(samples, speculating=True, now=now, batch_range=(low, boundary))
        off = fit(samples, speculating=False, now=now, batch_range=(boundary, high))
        if widen == 1 and (on is None or off is None or on.samples < need or off.samples < need):
            have_on = on.samples if on else 0
            have_off = off.samples if off else 0
            return None, (
                f"learning: {have_on} speculating samples at batch {low:.0f}-{current} and "
                f"{have_off} plain at {current + 1}-{high:.0f}, need {need} of each"
            )
        assert on is not None and off is not None  # a wider window holds what a narrower held
        if on.distinct_batches < 2 or off.distinct_batches < 2:
            # A line through one batch size is flat: compared with the other mode's slope it
            # puts the crossover anywhere (a varying load then swung the threshold 7 <-> 12).
            why = (
                f"learning: batch sizes {low:.0f}-{high:.0f} too uniform to fit both modes "
                f"({on.distinct_batches} speculating, {off.distinct_batches} plain; need 2 each)"
            )
        else:
            break
    else:
        return None, why
    # The threshold only moves across batch sizes seen running: from just under the smallest
    # speculating batch to the largest plain one. Extrapolating a line beyond its data let
    # stale samples from a ramp push a pod at a steady batch back and forth for ever. A mean
    # batch rounds to the batch that ran most: an engine capped at 16 running requests shows
    # 15.8, and a threshold of 15 there (rounded down) ran it plain at 16, where speculation
    # had just been measured paying, and mixed modes, which give no samples to correct it.
    lowest = max(1, round(on.lowest_batch) - 1)
    highest = max(lowest, round(off.highest_batch))
    # y_on(b) < y_off(b)  <=>  b * (beta_on - beta_off) < alpha_off - alpha_on
    gain, slope = off.alpha - on.alpha, on.beta - off.beta
    if slope <= 0:
        # Speculation gains (or keeps) ground as the batch grows, so whichever mode is cheaper
        # at the boundary stays cheaper above it: noisy samples on a busy host give such lines.
        # Read at the boundary, a line whose samples all sit in the far half of its side is an
        # extrapolation, and two such readings from either side would swap the threshold at
        # every cooldown.
        near_on = on.highest_batch >= boundary - (boundary - low) / 2
        near_off = off.lowest_batch <= boundary + (high - boundary) / 2
        if not (near_on and near_off):
            return None, (
                f"learning: speculating samples at {on.lowest_batch:.0f}-{on.highest_batch:.0f}"
                f" and plain at {off.lowest_batch:.0f}-{off.highest_batch:.0f} are too far from"
                f" threshold {current} to compare there"
            )
        if on.at(boundary) < off.at(boundary):
            return highest, (
                f"speculation pays at every batch size seen above the threshold (up to {highest})"
            )
        # Down to the lowest speculating batch, this drops speculation where it was measured
        # for plain decoding read off a line: only on plain samples near the boundary without
        # widening. A plain line read from far above would halve the threshold to where no
        # plain samples exist, and nothing could bring it back.
        unwidened_high = window(current)[2]
        if off.lowest_batch > boundary + (unwidened_high - boundary) / 2:
            return None, (
                f"learning: plain samples at {off.lowest_batch:.0f}-{off.highest_batch:.0f} are"
                f" too far from threshold {current} to say speculation loses there"
            )
        return lowest, f"speculation does not pay at the threshold (from {lowest})"
    crossover = gain / slope
    if crossover < lowest:
        return lowest, f"speculation stops paying below batch {lowest} ({crossover:.1f})"
    if crossover > highest:
        return highest, f"speculation pays at least up to batch {highest} ({crossover:.1f})"
    return math.floor(crossover), f"speculation stops paying above batch {crossover:.1f}"


def clamp(value: int, current: int, params: ControlSettings) -> int:
    """Within the resource's bounds, at least 1, and at most a halving or doubling step."""
    stepped = max(current // 2, min(2 * current + 1, value))
    return max(params.min_threshold, 1, min(params.max_threshold, stepped))


def decide(
    *,
    samples: Sequence[Sample],
    previous: Decision,
    now: float,
    fresh: bool,
    params: ControlSettings,
    estimates: dict[int, Estimate] | None = None,
    own: Sequence[Sample] = (),
    may_probe: bool = True,
    prediction: Prediction | None = None,
    serving: bool = True,
) -> Decision:
    """The next threshold for one pod, from `prediction` (the crossover its engine's step
    profile and acceptance predict) when that is confident, else from `samples` (pooled
    across its deployment) and, for probes, `own` (its own; none: it does not probe). Pods
    deciding from the same samples at the same time can share `estimates` (keyed by current
    threshold): the fit is then made once per distinct threshold, not once per pod.
    `may_probe`: no other pod is probing. `serving`: the pod has requests now; an idle pod
    has no data of its own, and its siblings' samples do not move it until it serves (what
    they measured may come from another traffic mix; it costs one scrape once load arrives)."""
    if params.mode == "alwaysOn":
        return _keep_or(previous, None, "control.mode alwaysOn", now)
    if params.mode == "off":
        return _keep_or(previous, 0, "control.mode off", now)
    if not fresh:
        return replace(previous, reason="metrics stale: no decision")
    if prediction is not None and prediction.confident:
        return _follow_prediction(prediction, own, previous, now, params, may_probe=may_probe)
    if previous.probe is not None:
        return _continue_probe(own, previous, now, params)
    current = previous.threshold if previous.threshold is not None else params.max_threshold
    cached = estimates.get(current) if estimates is not None else None
    if cached is None:
        cached = Estimate(*estimate_threshold(samples, current=current, now=now, params=params))
        if estimates is not None:
            estimates[current] = cached
    value, why = cached.threshold, cached.why
    if value is not None and not serving:
        return replace(previous, reason=f"{why}; idle: keeps {current} until it serves")
    if value is not None:
        target = clamp(value, current, params)
        direction = (target > current) - (target < current)
        if direction and direction == -previous.moved:
            # Back the way the last move came: the crossover lies between the last two
            # thresholds, so go halfway. Each window reads its own batches: two that each read
            # the crossover on the other's side would otherwise swap them every cooldown.
            target = current + int((target - current) / 2)
            why = f"{why}; reversing the last move: halfway, {target}"
        if abs(target - current) <= params.hysteresis:
            why = f"{why}; within hysteresis of {current}"
        elif now - previous.changed_at < params.cooldown_seconds:
            wait = params.cooldown_seconds - (now - previous.changed_at)
            return replace(previous, reason=f"{why}; cooling down {wait:.0f}s")
        else:
            cached = cached.with_taken(samples, current)
            if estimates is not None:
                estimates[current] = cached
            new = cached.taken_since(previous.changed_at)
            if new >= params.min_samples:
                return Decision(target, why, now, probe_wait=previous.probe_wait, moved=direction)
            # The samples near the threshold all predate its last change: the fit would read
            # the same data as the move that brought it here, and a load holding away from the
            # threshold would swap it between two values every cooldown. Such a load is the
            # probes' to measure.
            why = f"{why}; holding: {new} samples near {current} since its last change"
    explored = _explore(own, previous, now, params, may_probe=may_probe)
    return explored if explored is not None else replace(previous, reason=why)


MEASURE_BELOW_GAIN = 1.3
"""A pod that holds one mode where the model predicts it less than this much faster than the
other measures the other (a probe of `minSamples` scrapes) unless it has recently, on the same
workload. The profile holds decode steps only and misses whatever else differs between the
modes: on the H200 pair at accept length 1.5 it said speculation pays up to batch 64 where
plain delivered 1.4x at batch 16 (BENCHMARKS.md, section 0c)."""
REMEASURE_INTERVALS = 4
"""After a measuring probe, the next waits this many probe intervals unless the load holds
another batch or the accept length moves by more than COMPARABLE_ACCEPT: each costs a few
seconds of the slower mode."""
COMPARABLE_ACCEPT = 0.1
"""Samples taken at an accept length within this fraction of the current one describe the
same workload; others are not compared with it: in the seconds after an acceptance step the
requests of the old workload still run (BENCHMARKS.md, section 0c)."""


ACCEPT_SWING = 0.03
"""How far a steady workload's measured accept length moves between readings (its counters
cover a few decode steps a scrape): a move within it scales no measuring verdict."""


def same_workload(accept_length: float | None, current: float) -> bool:
    """Whether a sample or verdict taken at `accept_length` describes the workload whose
    accept length is `current` (within COMPARABLE_ACCEPT; None: unknown, so no)."""
    return accept_length is not None and abs(accept_length - current) <= COMPARABLE_ACCEPT * current


MEASURED_OVER_MODEL_MARGIN = 0.1
"""Measured rates overrule the model at a batch only when one mode delivered this much more:
a shared host's windows scatter by several percent."""


def _follow_prediction(
    prediction: Prediction,
    own: Sequence[Sample],
    previous: Decision,
    now: float,
    params: ControlSettings,
    *,
    may_probe: bool = True,
) -> Decision:
    """The model's move, checked against what the pod delivered at the batch it holds: the
    delivered rates of both modes there, on the same workload, outrank the model (which sees
    decode steps only) at that batch; where they are missing and the model's margin is small,
    a measuring probe takes them."""
    probe = previous.probe
    if probe is not None and probe.measuring:
        return _end_of_measuring(prediction, own, previous, probe, now, params)
    decision = _model_move(prediction, own, previous, now, params)
    # A few scrapes at one batch in one mode suffice here, not a cooldown: what is measured is
    # bracketed, and a verdict stands for its batch and workload, so measuring soon after the
    # model's move costs no more switches than measuring a cooldown later, and spends less
    # time in a mode the model barely prefers.
    settle = measure_settle_seconds(params)
    steady = steady_batch(own, now=now, params=params, seconds=settle)
    if steady is None or decision.threshold is None:
        return _held_by_verdict(prediction, own, previous, decision, now, settle)
    batch, speculating = steady
    current = previous.threshold if previous.threshold is not None else params.max_threshold
    verdict = previous.measured
    measured = verdict is not None and verdict.holds(now, prediction.tau, batch)
    if verdict is not None and measured and prediction.measured:
        verdict = verdict.read_at(prediction.tau)
        previous, decision = (
            replace(previous, measured=verdict),
            replace(decision, measured=verdict),
        )
    since = now - params.probe_interval_seconds
    bracketed = bracketed_gain(
        own,
        batch=batch,
        since=max(since, verdict.taken) if verdict is not None and measured else since,
        accept_length=prediction.tau,
        need=params.min_samples,
    )
    if bracketed is not None and (not measured or bracketed[1] > 1 + MEASURED_OVER_MODEL_MARGIN):
        better, gain = bracketed
        return _measured_at_batch(prediction, previous, decision, batch, better, gain, now, params)
    if verdict is not None and measured:
        # The verdict of the last measuring probe here outlives the samples it took, and holds
        # at the margin the probe kept its mode by: the model, which kept the other, would
        # otherwise move the pod back into the mode measured slower once the cooldown ran out.
        faster, gain = verdict.reading()
        if faster is not None:
            return _measured_at_batch(
                prediction, previous, decision, batch, faster, gain, now, params,
                margin=PROBE_MARGIN,
            )  # fmt: skip
    if decision.threshold != current or not may_probe or measured:
        return decision
    ratio = prediction.ratio(batch)
    if ratio is None or ratio <= 0:
        return decision
    ahead = ratio if speculating else 1 / ratio  # what the model gives the mode the pod runs
    if ahead >= MEASURE_BELOW_GAIN:
        # Such a margin holds without measuring only where it survives what runs outside the
        # decode steps, or where a probe could not measure the pod anyway.
        outside = outside_steps_share(own, now=now, seconds=settle)
        if (
            margin_past_outside_steps(ahead, outside) >= MEASURE_BELOW_GAIN
            or probe_error(own, now=now, seconds=settle, need=params.min_samples) > PROBE_RESOLUTION
        ):
            return decision
    # Where the model prefers the other mode and only the cooldown holds the pod, a probe
    # would make that move ahead of the cooldown: it waits as the move does.
    wait = settle if ahead >= 1 else params.cooldown_seconds
    if params.probe_interval_seconds <= 0 or now - previous.changed_at < wait:
        return decision
    if not accept_settled(own, prediction.tau, now=now, seconds=settle):
        return decision  # the workload is still changing: what a probe measured would be stale
    other = threshold_to_run(batch, speculating=not speculating, params=params)
    if other is None:
        return decision
    probe = Probe(
        batch,
        not speculating,
        other,
        current,
        now,
        now,  # judged once it has min_samples samples: a few scrapes of the other mode
        now + 4 * params.probe_seconds,
        measuring=True,
        held_since=decision.changed_at,
        tau=prediction.tau,
        tau_measured=prediction.measured,
    )
    why = f"measuring {_mode(not speculating)} at batch {batch:.0f}: the model predicts"
    if ahead >= MEASURE_BELOW_GAIN:  # started by the check above, `outside` its reason
        why += (
            f" {_mode(speculating)} {ahead:.2f}x faster there from decode steps that take"
            f" {1 - outside:.0%} of the pod's time ({prediction.why})"
        )
    else:
        why += f" {_mode(speculating)} under {MEASURE_BELOW_GAIN}x faster there ({prediction.why})"
    return replace(decision, threshold=other, reason=why, changed_at=now, probe=probe)


def _held_by_verdict(
    prediction: Prediction,
    own: Sequence[Sample],
    previous: Decision,
    decision: Decision,
    now: float,
    seconds: float,
) -> Decision:
    """The model's move where the pod holds no steady batch, unless it would switch the mode
    at the batch of a standing measuring verdict that still holds for the batch the pod runs
    (its recent samples' median): a prefill-heavy load (many short requests at 128 streams)
    drops scrapes from its samples and moves its batch by a band now and then, and without
    this the model would run such a pod in the mode measured slower for seconds at a time,
    each time the batch reading wanders."""
    verdict = previous.measured
    if verdict is None or decision.threshold == previous.threshold:
        return decision
    batch = median_batch(own, now=now, seconds=seconds)
    if batch is None and own:
        batch = own[-1].batch
    if batch is None or not verdict.holds(now, prediction.tau, batch):
        return decision
    faster, _ = verdict.reading()
    at = max(1, round(verdict.batch))
    if faster is None or contract.speculates(at, decision.threshold) == faster:
        return decision
    why = f"{decision.reason}; holding {previous.threshold}: measured at batch {at}"
    why += f" ({_mode(faster)} faster)"
    return replace(previous, reason=why)


def _measured_at_batch(
    prediction: Prediction,
    previous: Decision,
    decision: Decision,
    batch: float,
    better: bool,
    gain: float,
    now: float,
    params: ControlSettings,
    margin: float = MEASURED_OVER_MODEL_MARGIN,
) -> Decision:
    """Both modes measured at the pod's batch on this workload, `better` (True: speculation)
    delivering `gain` times the other: where that is more than `margin` and the model's
    decision runs the other mode there, the threshold runs the measured one at that batch and
    keeps the model's elsewhere."""
    assert decision.threshold is not None
    if gain <= 1 + margin or contract.speculates(round(batch), decision.threshold) == better:
        return decision
    run_at = threshold_to_run(batch, speculating=better, params=params)
    if run_at is None:
        return decision
    target = max(decision.threshold, run_at) if better else min(decision.threshold, run_at)
    why = (
        f"{prediction.why}; measured at batch {batch:.0f}: {_mode(better)} delivers"
        f" {gain:.2f}x, which the model does not see"
    )
    current = previous.threshold if previous.threshold is not None else params.max_threshold
    moved = (target > current) - (target < current)
    # A threshold that already runs the measured mode across the batch's band stays: a move
    # back toward the band's edge would follow the batch reading's jitter and change no mode.
    covers = current >= run_at if better else current <= run_at
    if moved == 0 or (covers and moved == (-1 if better else 1)):
        return replace(previous, probe=None, reason=f"{why}; holding {current}")
    return replace(
        decision, threshold=target, reason=why, changed_at=now, probe_wait=1.0, moved=moved
    )


def bracketed_gain(
    samples: Sequence[Sample],
    *,
    batch: float,
    since: float,
    accept_length: float,
    need: int,
) -> tuple[bool, float] | None:
    """(better mode, True: speculating; its gain) from the pod's last three runs of one mode
    at `batch` on this workload (within COMPARABLE_ACCEPT of `accept_length`), one mode, the
    other, the first again, each of `need` samples or more: the middle run against the mean
    of the runs either side. A shared host's speed drifts by more than the modes differ near
    a crossover, and a comparison of one mode's earlier samples with the other's later ones
    reads that drift as a gain (BENCHMARKS.md, section 0c); bracketed, drift moves both sides
    alike. None without such runs, or where the gain is within PROBE_CONFIDENCE of their
    noise (`_ratio_noise`). Samples that mix the modes belong to neither."""
    width = band(batch)
    runs: list[tuple[bool, list[float]]] = []  # newest first: (speculating, rates newest first)
    for s in reversed(samples):
        if s.at < since:
            break
        if (
            not same_workload(s.accept_length, accept_length)
            or abs(s.batch - batch) > width
            or STEADY_MODE_FRACTION > s.speculating_fraction > 1 - STEADY_MODE_FRACTION
            or s.batch <= 0
        ):
            continue
        mode = s.speculating_fraction >= STEADY_MODE_FRACTION
        if runs and runs[-1][0] == mode:
            runs[-1][1].append(s.per_request)
        elif len(runs) == 3:
            break
        else:
            runs.append((mode, [s.per_request]))
    if len(runs) < 3 or any(len(rates) < need for _, rates in runs):
        return None
    after, middle, before = (rates[::-1] for _, rates in runs)
    either_side = _reference_rate([before, after])
    if either_side <= 0 or _mean(middle) <= 0:
        return None
    ratio = _mean(middle) / either_side
    gain = max(ratio, 1 / ratio)
    if gain <= 1 + PROBE_CONFIDENCE * _ratio_noise(middle, [before, after], seconds_apart=False):
        return None  # what the runs' own scrapes cannot tell apart says nothing of the modes
    return runs[1][0] if ratio > 1 else runs[0][0], gain


def _end_of_measuring(
    prediction: Prediction,
    own: Sequence[Sample],
    previous: Decision,
    probe: Probe,
    now: float,
    params: ControlSettings,
) -> Decision:
    """Hold a measuring probe until it has its samples, go back to the mode it left until
    that has as many again, then judge it as a probe is judged, against that mode before and
    after it (a drifting host moves both alike): kept where it delivered PROBE_MARGIN more,
    else back. The model and both modes' rates then decide together (`_measured_at_batch`)."""
    mode = _mode(probe.speculating)
    need = params.min_samples
    back = probe.previous
    since = probe.started if probe.returned is None else probe.returned
    moved = load_moved_from(own, batch=probe.batch, since=since, need=need)
    if moved is not None:
        # Nothing left to measure at that batch: the model decides at the new one, its
        # cooldown running from the pod's last change before the probe, as after any probe
        # that goes back.
        why = (
            f"measuring {mode} at batch {probe.batch:.0f} ended: the load moved to batch"
            f" {moved:.0f}; back to {back}"
        )
        return Decision(back, why, probe.held_since, probe_wait=previous.probe_wait)
    n = len(
        mode_rates(
            own,
            batch=probe.batch,
            speculating=probe.speculating,
            since=probe.started,
            until=probe.returned if probe.returned is not None else math.inf,
            accept_length=prediction.tau,
        )
    )
    # A mode that yields no samples at all within twice the scrapes a verdict needs (a
    # prefill-bound pod whose decode steps in that mode come further apart than its scrapes)
    # is not worth holding for the rest of the probe.
    barren = n == 0 and now - probe.started >= 2 * need * params.scrape_interval_seconds
    if probe.returned is None:
        if now < probe.until or (n < need and now < probe.give_up and not barren):
            why = f"measuring {mode} at batch {probe.batch:.0f}: {n} samples"
            return replace(previous, reason=why)
        if n >= need:
            why = f"measured {mode} at batch {probe.batch:.0f} ({n} samples);"
            why += f" measuring {_mode(not probe.speculating)} again"
            returned = replace(probe, returned=now, give_up=now + 4 * params.probe_seconds)
            return replace(previous, threshold=back, reason=why, changed_at=now, probe=returned)
    n_after = 0
    if probe.returned is not None:
        # From the scrape after the switch: the one that spans it ran both modes.
        n_after = len(
            mode_rates(
                own,
                batch=probe.batch,
                speculating=not probe.speculating,
                since=probe.returned + params.scrape_interval_seconds,
                accept_length=prediction.tau,
            )
        )
        if n_after < need and now < probe.give_up:
            why = f"measuring {_mode(not probe.speculating)} again at batch {probe.batch:.0f}:"
            return replace(previous, reason=f"{why} {n_after} samples")
    tried_rates, brackets = _measured_rates(own, probe, prediction.tau, now, params)
    # Counted over every round: a later round that the load starves (a prefill burst, a
    # batch at the band's edge) leaves the earlier rounds' reading to decide by the margin.
    n_tried, n_base = len(tried_rates), len(brackets[0])
    n_back = sum(map(len, brackets[1:]))
    reference = _reference_rate(brackets)
    told: float | None = None  # speculating over plain, where the reading decides
    noise = 0.0
    if min(n_tried, n_base, n_back) < need or min(_mean(tried_rates), reference) <= 0:
        threshold = back
        why = f"measuring {mode} at batch {probe.batch:.0f}: inconclusive ({n_tried} samples,"
        why += f" {n_base} before, {n_back} after); back to {back}"
    else:
        ratio = _mean(tried_rates) / reference
        gain = max(ratio, 1 / ratio)
        noise = _ratio_noise(tried_rates, brackets)
        rounds = len(probe.trials) + 1
        complete = min(n, n_after) >= need  # this round, not only the ones before it
        # Within its noise where that noise could hide the margin: a reading within the
        # margin whose scrapes swing wider says as little as one past it.
        noisy = gain <= 1 + PROBE_CONFIDENCE * noise and PROBE_CONFIDENCE * noise > PROBE_MARGIN
        if noisy and complete and rounds < MEASURING_ROUNDS:
            # Within its scrapes' noise: another round, pooled with this one, rather than a
            # verdict that a few scrapes of a prefill burst decided.
            why = f"measured {mode} at batch {probe.batch:.0f}: {ratio:.2f}x, within its"
            why += f" scrapes' noise (+/-{noise:.0%}); measuring {mode} again"
            assert probe.returned is not None  # n_after >= need: the pod went back
            again = replace(
                probe, started=now, until=now, give_up=now + 4 * params.probe_seconds,
                returned=None, trials=(*probe.trials, (probe.started, probe.returned)),
            )  # fmt: skip
            return replace(
                previous, threshold=probe.threshold, reason=why, changed_at=now, probe=again
            )
        # After its last round, a reading still within its noise names no mode where the
        # model names one: the pod goes back to the model's, whose decode steps the scrapes'
        # swing does not blur, also where prefills take most of the pod's time (such readings
        # named the slower mode more often than the model did: BENCHMARKS.md, section 0).
        # Where the model's modes run within the margin, the reading is the better guess.
        indifferent = _better(prediction.ratio(probe.batch)) is None
        tells = gain > 1 + PROBE_MARGIN and (not noisy or indifferent)
        keep = tells and ratio > 1
        threshold = probe.threshold if keep else back
        why = f"measured {mode} at batch {probe.batch:.0f}: {ratio:.2f}x"
        if rounds > 1:
            why += f" over {rounds} rounds"
        if noisy:
            why += f", within its scrapes' noise (+/-{noise:.0%})"
            if indifferent:
                why += f" where the model's modes run within {PROBE_MARGIN:.0%}"
        why += "; keeping it" if keep else f"; back to {back}"
        if not noisy or indifferent:
            told = ratio if probe.speculating else 1 / ratio
    until = now + REMEASURE_INTERVALS * params.probe_interval_seconds
    # The verdict is read later in the mode the pod runs then, whose accept length may come
    # from another source (measured while speculating, estimated while off) and differ by
    # more than COMPARABLE_ACCEPT on the same workload: it keeps the probe's first reading too.
    verdict = Measurement(
        until,
        prediction.tau,
        probe.batch,
        told,
        also=probe.tau,
        taken=now,
        measured=(prediction.measured, probe.tau_measured),
        noise=noise,
        estimated=prediction.estimate,
    )
    changed_at = now if threshold == probe.threshold else probe.held_since
    return Decision(threshold, why, changed_at, measured=verdict)


def _model_move(
    prediction: Prediction,
    own: Sequence[Sample],
    previous: Decision,
    now: float,
    params: ControlSettings,
) -> Decision:
    """Move to the predicted crossover in one step, past hysteresis and cooldown. A move that
    would flip the mode at the batch the pod runs now also needs the new mode predicted
    SWITCH_MARGIN faster there: at the crossover both modes deliver the same, and noise in the
    acceptance would otherwise switch a stationary load back and forth. That margin, not
    hysteresis, guards such a move: a load sitting between the two thresholds would otherwise
    run the slower mode for as long as the crossover stays within hysteresis of the current
    threshold."""
    current = previous.threshold if previous.threshold is not None else params.max_threshold
    target = max(params.min_threshold, min(params.max_threshold, prediction.threshold))
    why = prediction.why
    if previous.probe is not None:
        previous = replace(previous, probe=None)  # the model decides: no probe needed
    if target == current:
        return replace(previous, threshold=current, reason=why)
    batch = own[-1].batch if own and now - own[-1].at <= steady_window(params) else None
    flips_here = batch is not None and (batch <= current) != (batch <= target)
    if abs(target - current) <= params.hysteresis and not flips_here:
        return replace(previous, reason=f"{why}; within hysteresis of {current}")
    if previous.moved and not flips_here:
        # Once the model has placed the threshold, a crossover far from the load moves with
        # every wiggle of the step corrections (where the modes run close over a wide band of
        # large batches): pushes that change no mode at any batch the pod ran within the
        # cooldown. A load that reaches the band flips the mode there and moves it at once.
        ran = newest_within(own, now=now, seconds=steady_window(params))
        recent = [s.batch for s in ran if s.batch > 0]
        if recent:
            low, high = min(recent), max(recent)
            low, high = low - band(low), high + band(high)
            if max(current, target) < low or min(current, target) >= high:
                return replace(
                    previous,
                    reason=f"{why}; holding {current}: that changes no mode at the batches it"
                    f" runs ({min(recent):.0f}-{max(recent):.0f})",
                )
    direction = (target > current) - (target < current)
    # A move on in the direction of the model's last one is the same change still arriving
    # (the acceptance settling after a change of workload): it waits only MODEL_SETTLE_SECONDS.
    wait_for = params.cooldown_seconds
    if direction == previous.moved:
        wait_for = min(wait_for, MODEL_SETTLE_SECONDS)
    guessed = previous.moved_on_estimate
    if (
        direction == -previous.moved
        and guessed is not None
        and prediction.measured
        and not same_workload(prediction.tau, guessed)
    ):
        # The last move rested on an estimate that speculating has now measured wrong: undo
        # it once the measurement settles, not after a whole cooldown in the slower mode.
        wait_for = min(wait_for, MODEL_SETTLE_SECONDS)
        why = f"{why}; the last move assumed accept length {guessed:.2f}"
    if now - previous.changed_at < wait_for:
        wait = wait_for - (now - previous.changed_at)
        return replace(previous, reason=f"{why}; cooling down {wait:.0f}s")
    # Between the two thresholds the modes trade places: a move is worth a push only where it
    # buys SWITCH_MARGIN somewhere there. Where the modes run within a few percent of each
    # other over a wide band, the crossover's place is noise.
    between = range(min(current, target) + 1, max(current, target) + 1)
    gains = [g if direction > 0 else 1 / g for b in between if (g := prediction.ratio(b))]
    if gains and max(gains) < 1 + predict.SWITCH_MARGIN:
        return replace(
            previous,
            reason=f"{why}; holding {current}: the modes differ by under"
            f" {predict.SWITCH_MARGIN:.0%} between {between.start} and {between.stop - 1}",
        )
    if flips_here and batch is not None:
        ratio = prediction.ratio(batch)
        gain = None if ratio is None else (ratio if batch <= target else 1 / ratio)
        if gain is not None and gain < 1 + predict.SWITCH_MARGIN:
            return replace(
                previous,
                reason=f"{why}; holding {current}: the modes differ by {abs(gain - 1):.1%}"
                f" at batch {batch:.0f}",
            )
    return replace(
        previous,
        threshold=target,
        reason=why,
        changed_at=now,
        probe_wait=1.0,
        moved=direction,
        moved_on_estimate=None if prediction.measured else prediction.tau,
    )


MODEL_SETTLE_SECONDS = 5.0
"""A predicted move that continues the last one waits this long, not a whole cooldown."""


class PodInput(NamedTuple):
    """What `decide_pods` needs of one pod."""

    previous: Decision
    own: Sequence[Sample]  # its own samples
    fresh: bool
    pool: str = "mixed"  # latency pods do not probe: the pool is sized by their threshold
    prediction: Prediction | None = None
    serving: bool = True  # requests running, queued or in flight to it now


def decide_pods(
    pooled: Sequence[Sample], pods: Sequence[PodInput], *, now: float, params: ControlSettings
) -> list[Decision]:
    """`decide` for every pod of a deployment: fits shared between pods at the same threshold,
    and one probe at a time, so a fleet that holds steady does not dip all at once."""
    estimates: dict[int, Estimate] = {}
    probing = any(pod.previous.probe is not None for pod in pods)
    decisions = []
    for pod in pods:
        decision = decide(
            samples=pooled,
            previous=pod.previous,
            now=now,
            fresh=pod.fresh,
            params=params,
            estimates=estimates,
            own=() if pod.pool == "latency" else pod.own,
            may_probe=not probing,
            prediction=pod.prediction,
            serving=pod.serving,
        )
        probing = probing or decision.probe is not None
        decisions.append(decision)
    return decisions


# ---- probes: the load holds away from the threshold ----


def band(batch: float) -> float:
    return max(1.0, PROBE_BAND * batch)


def steady_window(params: ControlSettings) -> float:
    """How long a pod must hold one batch in one mode to count as steady (a cooldown, at least
    a few scrapes): also the baseline a probe is held to."""
    return max(2 * params.min_samples * params.scrape_interval_seconds, params.cooldown_seconds)


OTHER_MODE_OUTSIDE_FLOOR = 0.5
"""What the mode a pod does not run spends outside its decode steps per token, at the least,
as a share of what the running mode spends: the same requests' prefills. The model's margin
between the modes holds for the decode steps alone; where they take a share 1 - s of the
pod's time, the other mode could spend less of the rest, and the margin that holds without
measuring is the model's times 1 - s, plus this floor times s."""


PROBE_RESOLUTION = 0.1
"""The model's margin is checked against what runs outside decode steps only where a probe of
`minSamples` scrapes would measure the pod's rate this precisely (standard error over mean):
where prompts of a thousand tokens make half-second rates swing 2x, a probe reads noise, and
the decode steps' direction is the better guess."""


def probe_error(own: Sequence[Sample], *, now: float, seconds: float, need: int) -> float:
    """The relative error a probe of `need` scrapes would have, from the spread of the pod's
    per-request rates over the last `seconds` (inf with too few samples)."""
    recent = newest_within(own, now=now, seconds=seconds)
    rates = [s.per_request for s in recent if s.batch > 0]
    rates = [r for r in reversed(rates) if math.isfinite(r)]
    error = relative_error(rates)
    return error * math.sqrt(len(rates) / need) if math.isfinite(error) else math.inf


def outside_steps_share(own: Sequence[Sample], *, now: float, seconds: float) -> float:
    """The median share of the pod's decode cycles spent outside decode steps over its samples
    of the last `seconds` (0 where none says): short requests at a large batch spend most of
    the time in prefills (on the H200 pair at 128 streams of 64-192 tokens, 70-80%, where the
    profile alone put plain decoding 1.7x ahead and speculation delivered 1.1-1.2x:
    BENCHMARKS.md, section 0c)."""
    shares = sorted(
        s.outside_steps
        for s in newest_within(own, now=now, seconds=seconds)
        if s.outside_steps is not None
    )
    return min(0.95, max(0.0, shares[len(shares) // 2])) if shares else 0.0


def measure_settle_seconds(params: ControlSettings) -> float:
    """How long a pod holds one batch, mode and accept length before a measuring probe."""
    return max(MODEL_SETTLE_SECONDS, 2 * params.min_samples * params.scrape_interval_seconds)


def newest_within(own: Sequence[Sample], *, now: float, seconds: float) -> Iterator[Sample]:
    """The pod's samples (in time order) of the last `seconds`, newest first: read back from
    the newest only, since this runs for every pod on every control step and a pod keeps up
    to 1200 samples."""
    return itertools.takewhile(lambda s: now - s.at <= seconds, reversed(own))


def median_batch(own: Sequence[Sample], *, now: float, seconds: float) -> float | None:
    """The median decode batch of the pod's samples of the last `seconds` (None: none)."""
    batches = sorted(s.batch for s in newest_within(own, now=now, seconds=seconds))
    return batches[len(batches) // 2] if batches else None


def accept_settled(own: Sequence[Sample], tau: float, *, now: float, seconds: float) -> bool:
    """Whether every sample of the last `seconds` carries the accept length `tau` (within
    COMPARABLE_ACCEPT): after a change of workload the accept length drifts for several
    seconds while older requests finish."""
    recent = list(newest_within(own, now=now, seconds=seconds))
    return bool(recent) and all(same_workload(s.accept_length, tau) for s in recent)


def steady_batch(
    own: Sequence[Sample], *, now: float, params: ControlSettings, seconds: float | None = None
) -> tuple[float, bool] | None:
    """(batch, speculating) when the pod's samples (in time order) of the last `seconds` (a
    cooldown, at least the last few scrapes, unless given) all ran one mode at one batch size
    (within `band`), else None. Idle time after them counts: a load that comes in bursts at
    one batch (the GPU envelope's rotation runs a server 2.5 s in every 7.5) still holds it,
    and a probe there measures the next burst. One that comes back at another batch ends the
    probe early (`load_moved_from`)."""
    seconds = steady_window(params) if seconds is None else seconds
    recent = list(newest_within(own, now=now, seconds=seconds))[::-1]
    if len(recent) < params.min_samples or now - recent[0].at < 0.75 * seconds:
        return None  # too few samples, or they do not span the window: not held long enough
    modes = {s.speculating_fraction >= STEADY_MODE_FRACTION for s in recent}
    batches = sorted(s.batch for s in recent)
    middle = batches[len(batches) // 2]
    if len(modes) != 1 or any(abs(b - middle) > band(middle) for b in batches):
        return None
    return middle, modes.pop()


def rates_per_request(
    samples: Sequence[Sample],
    *,
    batch: float,
    since: float,
    until: float = math.inf,
    accept_length: float | None = None,
) -> dict[bool, tuple[float, int]]:
    """Per mode (True: speculating), the mean output tok/s per running request of the samples
    near `batch` taken in [since, until], and how many; with `accept_length`, only samples
    taken within COMPARABLE_ACCEPT of it. One pass, newest first, stopping at `since`: samples
    are in time order, and this runs for every steady pod on every step."""
    width = band(batch)
    totals = {True: [0.0, 0], False: [0.0, 0]}
    for s in reversed(samples):
        if s.at < since:
            break
        if accept_length is not None and not same_workload(s.accept_length, accept_length):
            continue
        if s.at <= until and abs(s.batch - batch) <= width:
            total = totals[s.speculating_fraction >= STEADY_MODE_FRACTION]
            total[0] += s.per_request
            total[1] += 1
    return {mode: (rate / n if n else 0.0, int(n)) for mode, (rate, n) in totals.items()}


def relative_error(rates: Sequence[float]) -> float:
    """The standard error of the mean of `rates` (in time order) as a share of it, widened by
    their lag-one correlation: neighbouring scrapes share a prefill burst, and n of them say
    less than n independent ones (inf under three)."""
    n = len(rates)
    mean = sum(rates) / n if n else 0.0
    if n < 3 or mean <= 0:
        return math.inf
    deviations = [r - mean for r in rates]
    variance = sum(d * d for d in deviations) / (n - 1)
    if variance <= 0:
        return 0.0
    lag = sum(a * b for a, b in itertools.pairwise(deviations)) / ((n - 1) * variance)
    rho = min(0.9, max(0.0, lag))
    return math.sqrt(variance / n * (1 + rho) / (1 - rho)) / mean


def mode_rates(
    samples: Sequence[Sample],
    *,
    batch: float,
    speculating: bool,
    since: float,
    until: float = math.inf,
    accept_length: float | None = None,
) -> list[float]:
    """One mode's output tok/s per running request over its samples near `batch` taken in
    [since, until], in time order; with `accept_length`, only samples within
    COMPARABLE_ACCEPT of it. Read back from the newest to `since`, as `rates_per_request`."""
    width = band(batch)
    newest_first = [
        s.per_request
        for s in itertools.takewhile(lambda s: s.at >= since, reversed(samples))
        if s.at <= until
        and abs(s.batch - batch) <= width
        and (s.speculating_fraction >= STEADY_MODE_FRACTION) == speculating
        and (accept_length is None or same_workload(s.accept_length, accept_length))
    ]
    return newest_first[::-1]


def threshold_to_run(batch: float, *, speculating: bool, params: ControlSettings) -> int | None:
    """The threshold closest to running `batch` (and its band) in the given mode, within the
    resource's bounds; None when they allow none."""
    if speculating:
        value = math.ceil(batch + band(batch))
        return value if value <= params.max_threshold else None
    value = math.ceil(batch - band(batch)) - 1
    return value if value >= max(1, params.min_threshold) else None


def _mode(speculating: bool) -> str:
    return "speculation" if speculating else "plain decoding"


def _explore(
    own: Sequence[Sample],
    previous: Decision,
    now: float,
    params: ControlSettings,
    *,
    may_probe: bool,
) -> Decision | None:
    """For a pod holding one batch size in one mode: switch when it measured the other mode
    delivering more there on the same workload (accept length), probe it when it has not
    measured it there within the wait."""
    if params.probe_interval_seconds <= 0 or now - previous.changed_at < params.cooldown_seconds:
        return None
    steady = steady_batch(own, now=now, params=params)
    if steady is None:
        return None
    batch, speculating = steady
    other = threshold_to_run(batch, speculating=not speculating, params=params)
    if other is None:
        return None
    wait = params.probe_interval_seconds * previous.probe_wait
    # Only what the pod ran on the workload it runs now: a pod that went idle after an
    # acceptance step has no prediction, and its samples of the old workload's mode would
    # otherwise decide for the new one.
    rates = rates_per_request(
        own, batch=batch, since=now - wait, accept_length=own[-1].accept_length
    )
    (here, n_here), (there, n_there) = rates[speculating], rates[not speculating]
    need = params.min_samples
    if n_here >= need and n_there >= need:
        if there <= here * (1 + PROBE_MARGIN):
            return None
        why = (
            f"{_mode(not speculating)} delivers {there / here:.2f}x {_mode(speculating)} at "
            f"batch {batch:.0f} (measured)"
        )
        return Decision(other, why, now, probe_wait=1.0)
    if not may_probe or now - previous.changed_at < wait or now < previous.probe_after:
        return None
    probe = Probe(
        batch,
        not speculating,
        other,
        previous.threshold,
        now,
        now + params.probe_seconds,
        now + 4 * params.probe_seconds,
    )
    why = (
        f"probing {_mode(not speculating)} at batch {batch:.0f}: the load holds there and "
        f"threshold {previous.threshold} never measures it"
    )
    return Decision(other, why, now, probe, previous.probe_wait)


def probe_outcome(previous: Decision, new: Decision) -> tuple[str, str] | None:
    """(mode tried: "speculation" | "plain", "started" | "kept" | "back") when `new` starts or
    ends a probe, else None: what the router counts in specgate_probes_total."""
    if new.probe is not None and previous.probe is None:
        return ("speculation" if new.probe.speculating else "plain"), "started"
    if previous.probe is not None and new.probe is None:
        kept = new.threshold == previous.probe.threshold
        return ("speculation" if previous.probe.speculating else "plain"), (
            "kept" if kept else "back"
        )
    return None


def _continue_probe(
    own: Sequence[Sample], previous: Decision, now: float, params: ControlSettings
) -> Decision:
    probe = previous.probe
    assert probe is not None
    need = params.min_samples
    back = probe.previous
    moved = load_moved_from(own, batch=probe.batch, since=probe.started, need=need)
    if moved is not None:
        # Not a verdict on the mode, nor a reason to probe less often: the wait stays.
        why = (
            f"probe at batch {probe.batch:.0f} ended: the load moved to batch {moved:.0f};"
            f" back to {back}"
        )
        return Decision(back, why, now, probe_wait=previous.probe_wait)
    rates = mode_rates(own, batch=probe.batch, speculating=probe.speculating, since=probe.started)
    tried, n_tried = _mean(rates), len(rates)
    if now < probe.until or (n_tried < need and now < probe.give_up):
        return replace(
            previous,
            reason=f"probing {_mode(probe.speculating)} at batch "
            f"{probe.batch:.0f}: {n_tried} samples",
        )
    baseline = _probe_baseline(own, probe, params)
    base, n_base = _mean(baseline), len(baseline)
    backoff = min(PROBE_BACKOFF_LIMIT, 2 * previous.probe_wait)
    if n_tried < need or n_base < need:
        # Steps too slow to give samples (fewer than two per scrape), or a load that left
        # without settling elsewhere: the next probe is no likelier to tell, so it waits
        # longer too.
        why = f"probe inconclusive ({n_tried} samples, {n_base} before); back to {back}"
        return Decision(back, why, now, probe_wait=backoff)
    ratio = tried / base if base > 0 else math.inf
    verdict = f"probe: {_mode(probe.speculating)} at batch {probe.batch:.0f} gave {ratio:.2f}x"
    if ratio > 1 + PROBE_MARGIN:
        return Decision(probe.threshold, f"{verdict}; keeping it", now, probe_wait=1.0)
    return Decision(back, f"{verdict}; back to {back}", now, probe_wait=backoff)


PROBE_CONFIDENCE = 2.0
"""A measuring probe's ratio, or a bracket's, counts once it differs from 1 by PROBE_MARGIN
and by this many standard errors (`_ratio_noise`): three seconds of scrapes of one mode at
32 streams of short requests swing by 10% on an H200, as much as the modes differ near a
crossover (BENCHMARKS.md, section 0c). Short of that, a measuring probe runs another round,
and a bracket says nothing."""
MEASURING_ROUNDS = 3
"""Rounds a measuring probe runs at most (trial, then back, each `minSamples` scrapes). A
reading of every round's scrapes pooled that is still within their noise after the last
names no mode where the model names one (its modes more than PROBE_MARGIN apart): the pod
goes back to the model's, which sees decode steps without the swing of what runs between
them."""


def margin_past_outside_steps(ahead: float, outside: float) -> float:
    """The least the model's margin `ahead` for one mode (its decode steps against the other's)
    can come to where the pod spends a share `outside` of its time outside decode steps and
    the other mode could spend as little as OTHER_MODE_OUTSIDE_FLOOR of that there. Prefills
    cost the modes differently: a speculating prefill adds the draft's first proposals, and a
    speculating batch finishes more requests a step, so it prefills them in fewer, larger
    batches, each paying a prefill's fixed cost once."""
    return ahead * (1.0 - outside) + OTHER_MODE_OUTSIDE_FLOOR * outside


def _mean(rates: Sequence[float]) -> float:
    return sum(rates) / len(rates) if rates else 0.0


def _measured_rates(
    own: Sequence[Sample], probe: Probe, tau: float, now: float, params: ControlSettings
) -> tuple[list[float], list[list[float]]]:
    """A measuring probe's per-request rates over all its rounds: the mode on trial, pooled,
    and the mode it left on either side of each trial (its brackets): over the steady window
    before the first round, then after each trial (from the scrape after the switch back: the
    one that spans it ran both modes; empty while that round has not gone back)."""
    rounds = [*probe.trials, (probe.started, probe.returned if probe.returned is not None else now)]
    tried: list[float] = []
    before = _probe_baseline(own, probe, params, tau if probe.tau is None else probe.tau)
    brackets = [before]
    for i, (started, returned) in enumerate(rounds):
        tried += mode_rates(
            own, batch=probe.batch, speculating=probe.speculating, since=started,
            until=returned, accept_length=tau,
        )  # fmt: skip
        after: list[float] = []
        if probe.returned is not None or i < len(rounds) - 1:
            after = mode_rates(
                own, batch=probe.batch, speculating=not probe.speculating,
                since=returned + params.scrape_interval_seconds,
                until=rounds[i + 1][0] if i < len(rounds) - 1 else math.inf, accept_length=tau,
            )  # fmt: skip
        brackets.append(after)
    return tried, brackets


def _bracket_weights(brackets: Sequence[Sequence[float]]) -> list[float]:
    """Trapezoid weights of a probe's brackets (those with samples), in time order: each trial
    is held to the mean of the brackets either side of it, so the ends count half. A bracket
    that drifted (the first, taken while a load settled) weighs less as rounds are added."""
    n = sum(1 for b in brackets if b)
    return [1.0] if n == 1 else [0.5 if i in (0, n - 1) else 1.0 for i in range(n)]


def _reference_rate(brackets: Sequence[Sequence[float]]) -> float:
    """The mode a trial left, interpolated to the trial's moments: its brackets' means with
    trapezoid weights (0 where no bracket has samples)."""
    means = [_mean(b) for b in brackets if b]
    if not means:
        return 0.0
    weights = _bracket_weights(brackets)
    return sum(w * m for w, m in zip(weights, means, strict=True)) / sum(weights)


def _ratio_noise(
    tried: Sequence[float], brackets: Sequence[Sequence[float]], *, seconds_apart: bool = True
) -> float:
    """The standard error, as a share, of a trial's ratio to `_reference_rate`: each part's
    scrape-to-scrape spread and, for brackets `seconds_apart` (a measuring probe's), the drift
    between neighbouring ones. A trial's reference is their mean only where the host moved in
    a straight line from one to the next, which over a few seconds it rarely does: a
    difference there is a step, a settling load or a prefill burst. `bracketed_gain`'s runs
    may span minutes, over which a host slows or speeds up steadily, and the mean is what
    corrects that: there the drift is left out.
    0 where a part has too few scrapes to tell their spread (a resource's minSamples under
    three): judged by the margin alone."""
    parts = [b for b in brackets if b]
    errors = [relative_error(rates) for rates in (tried, *parts)]
    if not all(math.isfinite(e) for e in errors):
        return 0.0
    weights = _bracket_weights(parts)
    reference = math.sqrt(sum((w * e) ** 2 for w, e in zip(weights, errors[1:], strict=True)))
    reference /= sum(weights)
    means = [_mean(b) for b in parts]
    pairs = itertools.pairwise(means) if seconds_apart else ()
    drifts = [abs(a - b) / (a + b) for a, b in pairs if a + b > 0]
    drift = math.sqrt(sum(d * d for d in drifts)) / len(drifts) if drifts else 0.0
    return math.sqrt(errors[0] ** 2 + reference**2 + drift**2)


def _probe_baseline(
    own: Sequence[Sample],
    probe: Probe,
    params: ControlSettings,
    accept_length: float | None = None,
) -> list[float]:
    """What the mode a probe left delivered per request at its batch over the steady window
    before it (before its first round): the rates the probe is held to."""
    return mode_rates(
        own,
        batch=probe.batch,
        speculating=not probe.speculating,
        since=probe.began - steady_window(params),
        until=probe.began,
        accept_length=accept_length,
    )


LOAD_MOVED_FACTOR = 1.5
"""A probe's load has moved when the pod runs more than this factor from the probe's batch
(either way) and more than two requests from it. Wider than `band`: under an open-loop load
the mode on trial moves the batch itself, by its speed-up over the other (up to about 1.3x
at large batches; the larger speed-ups at small ones move a batch by a request or two)."""


def load_moved_from(
    own: Sequence[Sample], *, batch: float, since: float, need: int
) -> float | None:
    """The batch the pod runs now, when its newest `need` samples since `since` all ran more
    than LOAD_MOVED_FACTOR from `batch`, else None. A probe whose load came back at another
    batch has nothing to measure; waiting it out would only double the wait before the probe
    the new load needs."""
    newest = list(
        itertools.islice(itertools.takewhile(lambda s: s.at >= since, reversed(own)), need)
    )
    if len(newest) < need:
        return None
    if all(
        max(s.batch / batch, batch / s.batch) > LOAD_MOVED_FACTOR and abs(s.batch - batch) > 2
        for s in newest
    ):
        return sorted(s.batch for s in newest)[len(newest) // 2]
    return None


def _keep_or(previous: Decision, value: int | None, reason: str, now: float) -> Decision:
    if previous.threshold == value:
        return Decision(value, reason, previous.changed_at)
    return Decision(value, reason, now)


def initial_decision(params: ControlSettings, now: float = -math.inf) -> Decision:
    """A pod's first decision at time `now`. Its first probe waits one probe interval: pools
    and the load settle first, and a probe while they settle misleads the fit."""
    value: int | None = {"alwaysOn": None, "off": 0}.get(params.mode, params.threshold)
    return Decision(
        value,
        "initial threshold from the resource",
        -math.inf,
        probe_after=now + params.probe_interval_seconds,
    )


# ---- pools ----


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
) -> int:
    """How many pods serve latency traffic first: enough to hold the latency concurrency at or
    under their threshold, so all of it is speculated on. The pool only takes pods the
    throughput traffic does not need to stay at or under `throughput_batch_per_pod` (at least
    one pod when there is any) and that `max_fraction` allows; when that room cannot hold the
    latency traffic there is no pool (beyond `min_fraction`): a pool too small for it would
    run over its threshold, speculate nothing, and only cost the throughput pods capacity.
    With no throughput traffic every pod the bounds allow serves latency first."""
    if pods <= 1:
        return pods
    lo = math.ceil(min_fraction * pods - 1e-9)
    hi = math.floor(max_fraction * pods + 1e-9)
    need = math.ceil(latency_load / max(1, threshold) - 1e-9) if latency_load > 0 else 0
    if throughput_load > 0:
        reserved = max(1, math.ceil(throughput_load / throughput_batch_per_pod - 1e-9))
        if need > min(hi, pods - reserved):
            need = 0
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
    prediction: Prediction,
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
    models: Sequence[tuple[Prediction, float]] = (),
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
