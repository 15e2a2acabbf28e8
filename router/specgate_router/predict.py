"""The crossover predicted from what an engine reports: its step-cost profile and acceptance.

Per request, a speculating step of t_on(b) seconds at decode batch b yields tau tokens (the
accept length), and an off step of t_off(b) seconds yields k (the off-step tokens). Speculation
pays at batch b while

    tau / t_on(b) >= k / t_off(b)

so the threshold is the largest batch where it does. The engine reports t_on and t_off for its
batch sizes (`contract.STEP_PROFILE`), measured whatever mode it runs; tau is measured while it
speculates and estimated while it does not, from how often the draft's proposal for the next
position agrees with the target's token (first-position acceptance p1): for a chain of n drafts
with equal acceptance at every position, tau = 1 + p + ... + p^n. Real chains accept less at
later positions, so the map is calibrated where the pod switches from off to on: the accept
length measured right after the switch against the estimate from the agreement measured right
before it (`AcceptanceTracker`). First-position acceptance counted while speculating is not
used for this: after a rejection the bonus token is sampled from the target's residual
distribution, so the context a speculating draft sees differs from an off step's
(BENCHMARKS.md, section 0b, measures both).

The steps the pod then runs check the model: each learning interval's mean decode step (over
the steps that directly followed another decode step: a prefill between two steps costs the
same in both modes and is not the model's business) against the profile's at its batch and
mode (`Residuals`; the accept length is measured, not
predicted, wherever speculation runs). A steady bias corrects the prediction; a
disagreement beyond the samples' noise makes the prediction unconfident, and the controller
goes back to learning from samples and probes (`control.decide`).

Everything here is pure and takes time as an argument.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from specgate import contract

TAU_HALF_LIFE_SECONDS = 4.0
"""How fast the measured and estimated acceptance follow a change of workload."""
CALIBRATION_HALF_LIFE_SECONDS = 120.0
MEASURED_FRESH_SECONDS = 5.0
"""Acceptance measured this recently (while speculating) is the pod's current acceptance."""
ESTIMATE_FRESH_SECONDS = 10.0
"""First-position agreement this recent (while off) gives the current acceptance."""
CROSS_CALIBRATION_SECONDS = 15.0
"""A measured accept length calibrates the estimate only when the agreement it is compared
with was measured this recently: across one switch, on the same workload."""
STEADY_MODE_FRACTION = 0.9
"""An interval counts for a mode when at least this share of its decode steps ran in that mode
(for the accept length here, for learning samples in `control`)."""
MIN_PROPOSALS = 64
"""Draft proposals (while off) before their agreement rate says anything."""
CALIBRATING_PROPOSALS = 256
"""Proposals behind one reading of the agreement for it to calibrate alone (within about 0.03)."""
SETTLED_AGREEMENT = 0.05
"""The latest agreement reading within this of the smoothed one: the workload is not moving."""
MIN_CALIBRATING_REQUEST_STEPS = 256
"""Speculating request-steps behind a measured accept length before it calibrates the estimate
at a switch off (a chain's accepted drafts vary by about 1 a step: 256 put it within 3%). A pod
taken off within a scrape of starting has measured a few dozen."""
RESIDUAL_HALF_LIFE_SECONDS = 30.0
RESIDUAL_TOLERANCE = 0.25
"""Samples more than this (as |log(observed / predicted)|) from a corrected prediction mean
the model does not describe the pod: the controller learns from samples instead."""
CONTEMPORARY_RESIDUALS_SECONDS = 15.0
"""The two modes' residuals say how they differ from the profile only when each was last
measured within this of the other: a shared host's speed drifts, and a mode measured a
minute before the other would read that drift as a difference between the modes."""
CORRECTION_BOUNDS = (0.5, 2.0)
"""A steady bias corrects predictions within these factors; beyond them the model is wrong."""
SWITCH_MARGIN = 0.03
"""A new threshold that flips the mode at the pod's current batch needs the new mode to be
predicted this much faster there: near the crossover the two modes deliver the same, and a
stationary load must not switch back and forth on noise."""


def chain_accept_length(p1: float, num_steps: int) -> float:
    """Expected tokens a speculating step yields per request when every one of `num_steps`
    drafted positions is accepted with probability p1, the first rejection ending the chain."""
    p = min(max(p1, 0.0), 1.0)
    return sum(p**j for j in range(num_steps + 1))


@dataclass(frozen=True)
class StepProfile:
    """Decode step seconds by batch in both modes, as an engine reports them."""

    on: tuple[tuple[float, float], ...]
    off: tuple[tuple[float, float], ...]
    off_step_tokens: int = 1
    num_steps: int = 3

    @classmethod
    def from_wire(
        cls, data: Any, *, off_step_tokens: Any = 1, num_steps: Any = 3
    ) -> StepProfile | None:
        """The profile from /v1/loads, or None when absent; ValueError when malformed (a
        hostile or broken engine's numbers never reach the controller)."""
        if data is None:
            return None
        if not isinstance(data, Mapping):
            raise ValueError(f"{contract.STEP_PROFILE} must be an object with 'on' and 'off'")
        modes = {}
        for mode in ("on", "off"):
            points = data.get(mode)
            if not isinstance(points, list) or not 1 <= len(points) <= contract.MAX_PROFILE_POINTS:
                raise ValueError(
                    f"{contract.STEP_PROFILE}.{mode} must list 1-{contract.MAX_PROFILE_POINTS}"
                    " [batch, seconds] pairs"
                )
            parsed = []
            for point in points:
                if not (isinstance(point, list | tuple) and len(point) == 2):
                    raise ValueError(f"{contract.STEP_PROFILE}.{mode}: [batch, seconds] pairs")
                batch, seconds = (_number(v) for v in point)
                if not (1 <= batch <= contract.MAX_THRESHOLD and 0 < seconds <= 60):
                    raise ValueError(
                        f"{contract.STEP_PROFILE}.{mode}: batch {batch} or {seconds} s out of range"
                    )
                parsed.append((batch, seconds))
            parsed.sort()
            if len({b for b, _ in parsed}) != len(parsed):
                raise ValueError(f"{contract.STEP_PROFILE}.{mode}: a batch size appears twice")
            modes[mode] = tuple(parsed)
        k, n = _number(off_step_tokens), _number(num_steps)
        if not (k == int(k) and 1 <= k <= 256 and n == int(n) and 1 <= n <= 16):
            raise ValueError(f"off_step_tokens {k} or num_steps {n} out of range")
        return cls(modes["on"], modes["off"], int(k), int(n))

    def step_seconds(self, batch: float, speculating: bool) -> float | None:
        """Interpolated linearly between profiled batches; None beyond them (no guessing).
        A bisection, not a scan: the controller asks at every batch size for every pod on
        every control step."""
        points = self.on if speculating else self.off
        if batch < points[0][0] or batch > points[-1][0]:
            return None
        i = bisect.bisect_left(points, (batch, -math.inf))
        if points[i][0] == batch or i == 0:
            return points[i][1]
        (b0, s0), (b1, s1) = points[i - 1], points[i]
        return s0 + (s1 - s0) * (batch - b0) / (b1 - b0)

    def top(self) -> float:
        """The largest batch both modes are profiled at."""
        return min(self.on[-1][0], self.off[-1][0])


@dataclass
class AcceptanceTracker:
    """The pod's acceptance from the engine's lifetime counters (contract.ACCEPTANCE_COUNTERS),
    read interval by interval: measured while speculating, estimated from first-position
    agreement while off, and the map between the two calibrated where both are seen."""

    num_steps: int = 3
    tau: float | None = None  # measured accept length (smoothed)
    tau_at: float = -math.inf
    tau_request_steps: float = 0.0
    """Request-steps behind `tau` since speculation last resumed: how much it can be trusted."""
    p1_off: float | None = None  # first-position agreement while off (smoothed)
    p1_off_at: float = -math.inf
    p1_off_last: float | None = None
    """The latest reading of the agreement, unsmoothed, and the proposals behind it: after a
    change of workload the smoothed figure lags for a few half-lives, and a calibration
    against it would carry that lag for minutes."""
    p1_off_last_proposals: float = 0.0
    calibration: float = 1.0  # measured tau / chain_accept_length(p1 while off, just before)
    calibrated: bool = False
    calibration_at: float = -math.inf
    _last: dict[str, float] | None = None
    _pending: list[float] = field(default_factory=lambda: [0.0, 0.0])
    _off_since_switch: list[float] | None = None
    """Proposals and agreements since the pod last speculated steadily, pooled until they are
    enough to calibrate with (CALIBRATING_PROPOSALS); None: nothing to calibrate against."""

    def update(
        self,
        counters: Mapping[str, float],
        at: float,
        num_steps: int,
        speculating_fraction: float | None = None,
    ) -> None:
        """Read one interval's counters. `speculating_fraction`, the share of the interval's
        decode steps that speculated (None: unknown, taken as steady): an interval that mixed
        the modes says nothing of the accept length speculation keeps up. Its speculating
        steps mostly follow off steps, whose tokens all came from the target's own sampling,
        and accept more than a steady chain does, whose context holds the bonus tokens drawn
        from the residual distribution after each rejection (BENCHMARKS.md, section 0c)."""
        self.num_steps = num_steps
        last, self._last = self._last, dict(counters)
        if last is None:
            return
        d = {name: counters[name] - last[name] for name in contract.ACCEPTANCE_COUNTERS}
        if any(v < 0 for v in d.values()):
            return  # counters reset (an engine restart): start over from this reading
        steps = d["spec_request_steps"]
        steady = speculating_fraction is None or speculating_fraction >= STEADY_MODE_FRACTION
        if steps > 0 and steady:
            measured = 1.0 + d["spec_accepted_tokens"] / steps
            if at - self.tau_at > CROSS_CALIBRATION_SECONDS:
                self.tau_request_steps = 0.0
            self.tau = _smooth(self.tau, measured, at - self.tau_at, TAU_HALF_LIFE_SECONDS)
            self.tau_at = at
            self.tau_request_steps += steps
            self._off_since_switch = [0.0, 0.0]
            fresh_estimate = at - self.p1_off_at <= CROSS_CALIBRATION_SECONDS
            p1 = self._p1_before_switch()
            if p1 is not None and fresh_estimate and steps >= 8:
                self._calibrate(measured, p1, at)
        # Agreement accumulates until it has MIN_PROPOSALS: one scrape at a small batch
        # proposes a handful of tokens.
        pending = self._pending
        pending[0] += d["draft_first_proposed"]
        pending[1] += d["draft_first_agreed"]
        if pending[0] >= MIN_PROPOSALS:
            p1 = min(1.0, pending[1] / pending[0])
            self.p1_off = _smooth(self.p1_off, p1, at - self.p1_off_at, TAU_HALF_LIFE_SECONDS)
            self.p1_off_at = at
            self.p1_off_last, self.p1_off_last_proposals = p1, pending[0]
            pending[0] = pending[1] = 0.0
        pooled = self._off_since_switch
        if pooled is not None and not (steps > 0 and steady):
            # Off now, speculating just before: the same comparison across the switch the
            # other way, so that a pod the model took off speculation on a too-high estimate
            # corrects it within a few scrapes. Against the agreement since the switch pooled
            # to CALIBRATING_PROPOSALS, not the first reading after it: the chain's accept
            # length is steep in the agreement, and that reading, after a probe of a few
            # seconds, can rest on a few dozen proposals (one 0.15 low reads the estimate
            # 25% high, and the calibration's half-life keeps that for minutes).
            pooled[0] += d["draft_first_proposed"]
            pooled[1] += d["draft_first_agreed"]
            if pooled[0] >= CALIBRATING_PROPOSALS:
                self._off_since_switch = None
                if (
                    self.tau is not None
                    and at - self.tau_at <= CROSS_CALIBRATION_SECONDS
                    and self.tau_request_steps >= MIN_CALIBRATING_REQUEST_STEPS
                ):
                    self._calibrate(self.tau, min(1.0, pooled[1] / pooled[0]), at)

    def _p1_before_switch(self) -> float | None:
        """The agreement to calibrate with at a switch on: the latest reading, where it rests on
        enough proposals to be read alone and the smoothed figure has caught up with it. While
        they differ the workload is changing under the switch, and the accept length measured
        after it belongs to another workload than the agreement before it: None (the switch
        back off calibrates instead)."""
        last, smoothed = self.p1_off_last, self.p1_off
        if last is None or smoothed is None:
            return smoothed
        if abs(last - smoothed) > SETTLED_AGREEMENT:
            return None
        return last if self.p1_off_last_proposals >= CALIBRATING_PROPOSALS else smoothed

    def _calibrate(self, measured: float, p1_off: float, at: float) -> None:
        """Measured accept length against the chain estimate from agreement while off, the two
        taken across one switch, on the same workload."""
        chain = chain_accept_length(p1_off, self.num_steps)
        if chain <= 0:
            return
        ratio = min(1.5, max(0.3, measured / chain))
        self.calibration = _smooth(
            self.calibration if self.calibrated else None,
            ratio,
            at - self.calibration_at,
            CALIBRATION_HALF_LIFE_SECONDS,
        )
        self.calibrated, self.calibration_at = True, at

    def current(self, now: float) -> tuple[float, str] | None:
        """(expected accept length, where it comes from), or None when nothing recent says."""
        if self.tau is not None and now - self.tau_at <= MEASURED_FRESH_SECONDS:
            return self.tau, "measured"
        estimate = self.estimate(now)
        if estimate is not None:
            how = "calibrated" if self.calibrated else "uncalibrated"
            return estimate, f"estimated while off ({how})"
        return None

    def estimate(self, now: float) -> float | None:
        """The accept length estimated from the agreement while off, where that is recent
        (None otherwise), also while a measured one is current: a verdict taken across both
        modes keeps both, and while the pod runs plain decoding it is read against this one."""
        if self.p1_off is None or now - self.p1_off_at > ESTIMATE_FRESH_SECONDS:
            return None
        return max(1.0, self.calibration * chain_accept_length(self.p1_off, self.num_steps))


@dataclass
class Residual:
    """Smoothed log(observed / predicted) of one mode's samples."""

    mean: float = 0.0
    weight: float = 0.0
    at: float = -math.inf

    def add(self, log_ratio: float, at: float) -> None:
        decay = 0.5 ** (max(0.0, at - self.at) / RESIDUAL_HALF_LIFE_SECONDS)
        self.weight = self.weight * decay + 1.0
        self.mean += (log_ratio - self.mean) / self.weight
        self.at = at

    def factor(self) -> float:
        return _bounded_correction(math.exp(self.mean)) if self.weight >= 2 else 1.0

    def agrees(self) -> bool:
        low, high = CORRECTION_BOUNDS
        return self.weight < 2 or low <= math.exp(self.mean) <= high


@dataclass
class Residuals:
    """The model checked against the pod's own samples, per mode (True: speculating): the
    decode step against the profile (`modes`), and the time the pod spends between decode
    steps per generated token (`between`, seconds: prefills, mostly)."""

    modes: dict[bool, Residual] = field(
        default_factory=lambda: {True: Residual(), False: Residual()}
    )
    between: dict[bool, Residual] = field(
        default_factory=lambda: {True: Residual(), False: Residual()}
    )
    relative: Residual = field(default_factory=Residual)
    """log(on factor / off factor), from the moments both modes were measured within
    CONTEMPORARY_RESIDUALS_SECONDS of each other: how the profile errs between the modes (a
    start-up profile taken on a busier GPU, say), which outlasts a drift of the host's speed
    that moves both alike."""
    last_outlier: float = -math.inf

    def add_between(self, *, speculating: bool, seconds_per_token: float, at: float) -> None:
        """One interval's time between decode steps per generated token, in one mode: what the
        step profile leaves out (prefills, which a speculating batch pays for its draft too).
        Shown, not modelled: it does not scale simply with the batch (prefills batch up), so
        where it makes the model wrong the delivered rates measured at the pod's batch decide
        (`control`)."""
        if math.isfinite(seconds_per_token) and seconds_per_token >= 0:
            self.between[speculating].add(seconds_per_token, at)

    def add(
        self,
        *,
        batch: float,
        speculating: bool,
        step_seconds: float,
        profile: StepProfile,
        at: float,
    ) -> None:
        """One interval's mean decode step against the profile's at its batch, as a rate:
        log(predicted step / measured step)."""
        predicted = profile.step_seconds(batch, speculating)
        if predicted is None or not step_seconds > 0:
            return
        log_ratio = math.log(predicted / step_seconds)
        mode = self.modes[speculating]
        if mode.weight >= 4 and abs(log_ratio - mode.mean) > RESIDUAL_TOLERANCE:
            self.last_outlier = at
        mode.add(log_ratio, at)
        on, off = self.modes[True], self.modes[False]
        if (
            on.weight >= 2
            and off.weight >= 2
            and abs(on.at - off.at) <= CONTEMPORARY_RESIDUALS_SECONDS
        ):
            self.relative.add(on.mean - off.mean, at)

    def corrections(self) -> tuple[float, float]:
        """The (on, off) factors for the model's step rates. A mode without samples takes the
        other's factor: what slows a pod's delivery besides its decode steps (a busy host)
        slows both modes alike, and only a difference between them moves the crossover. Modes
        measured at different moments keep the difference learnt when they were measured
        together, applied to the newer's factor: a shared host's speed drifts, and a mode
        measured a minute before the other would read that drift as a difference."""
        on_r, off_r = self.modes[True], self.modes[False]
        if on_r.weight < 2 or off_r.weight < 2:
            # One mode measured (or none: both 1.0).
            f = (on_r if on_r.weight >= 2 else off_r).factor()
            return f, f
        if abs(on_r.at - off_r.at) <= CONTEMPORARY_RESIDUALS_SECONDS:
            return on_r.factor(), off_r.factor()
        rel = math.exp(self.relative.mean) if self.relative.weight > 0 else 1.0
        if on_r.at > off_r.at:
            on_f = on_r.factor()
            return on_f, _bounded_correction(on_f / rel)
        off_f = off_r.factor()
        return _bounded_correction(off_f * rel), off_f

    def between_seconds_per_token(self, *, speculating: bool) -> float | None:
        """One mode's time between decode steps per generated token (None: unmeasured)."""
        r = self.between[speculating]
        return r.mean if r.weight >= 2 else None

    def view(self) -> dict[str, float | None]:
        return {
            ("on" if mode else "off"): (round(math.exp(r.mean), 3) if r.weight >= 2 else None)
            for mode, r in self.modes.items()
        }

    def between_view(self) -> dict[str, float | None]:
        """Microseconds between decode steps per generated token, per mode (None: unmeasured)."""
        return {
            ("on" if mode else "off"): (round(r.mean * 1e6, 2) if r.weight >= 2 else None)
            for mode, r in self.between.items()
        }


def seconds_per_token(
    profile: StepProfile, batch: float, speculating: bool, tau: float, *, step_rate: float = 1.0
) -> float | None:
    """Predicted seconds per generated token of one request at `batch` in one mode: the
    profile's decode step over the tokens it yields a request (tau, or the off-step tokens),
    the step divided by `step_rate` (the observed-over-profiled step rate)."""
    seconds = profile.step_seconds(batch, speculating)
    if seconds is None:
        return None
    return seconds / (step_rate * (tau if speculating else profile.off_step_tokens))


@dataclass(frozen=True)
class Prediction:
    """What the model says for one pod: the crossover within the resource's bounds."""

    threshold: int
    why: str
    confident: bool
    profile: StepProfile
    tau: float
    correction: tuple[float, float]  # (on, off) factors applied to the model's step rates
    measured: bool = True
    """tau was measured (speculating now), not estimated from the agreement while off."""
    estimate: float | None = None
    """The accept length estimated while off, where recent (`AcceptanceTracker.estimate`)."""

    def seconds_per_token(self, batch: float, speculating: bool) -> float | None:
        step_rate = self.correction[0 if speculating else 1]
        return seconds_per_token(self.profile, batch, speculating, self.tau, step_rate=step_rate)

    def ratio(self, batch: float) -> float | None:
        """Predicted speculating over plain per-request rate at `batch` (None: unprofiled)."""
        on = self.seconds_per_token(batch, True)
        off = self.seconds_per_token(batch, False)
        if on is None or off is None or on <= 0:
            return None
        return off / on


def predict(
    profile: StepProfile | None,
    acceptance: tuple[float, str] | None,
    residuals: Residuals | None,
    *,
    min_threshold: int,
    max_threshold: int,
    batch: float | None = None,
    estimate: float | None = None,
) -> Prediction | None:
    """The predicted threshold, or None without a profile or a current acceptance. `batch`,
    the decode batch the pod runs now (None: unknown, an idle pod), picks the crossover
    nearest it where speculation pays in more than one band of batches (an engine whose
    multi-token off steps beat speculation at small batches, say): a threshold can keep only
    one band speculating, and the one that serves the load is the one around its batch.
    `estimate`, the accept length estimated while off where recent, rides along for the
    verdicts taken on the prediction."""
    if profile is None or acceptance is None:
        return None
    tau, source = acceptance
    modes = residuals.modes if residuals is not None else {}
    on_r, off_r = modes.get(True, Residual()), modes.get(False, Residual())
    correction = residuals.corrections() if residuals is not None else (1.0, 1.0)
    model = Prediction(0, "", True, profile, tau, correction)
    # 0 is allowed here, unlike a threshold learnt from samples: the acceptance is estimated
    # while off too, so a pod that never speculates still knows what speculation would give.
    low = max(0, min_threshold)
    high = max(low, min(max_threshold, int(profile.top())))
    pays = [False] + [
        (ratio := model.ratio(b)) is not None and ratio >= 1.0 for b in range(1, high + 1)
    ]
    best = max((b for b in range(1, high + 1) if pays[b]), default=0)
    first = min((b for b in range(1, high + 1) if pays[b]), default=0)
    if batch is not None and batch >= 1 and best > 0:
        at = min(high, max(1, round(batch)))
        if pays[at]:
            # Up from the batch while it pays: the crossover above the load.
            best = at
            while best < high and pays[best + 1]:
                best += 1
        else:
            # Down from the batch to where it pays again (or none): plain decoding above.
            best = at - 1
            while best > 0 and not pays[best]:
                best -= 1
        first = best
        while first > 1 and pays[first - 1]:
            first -= 1
    threshold = min(max(best, low), max_threshold)
    confident = on_r.agrees() and off_r.agrees()
    if best >= high and high < max_threshold:
        # Paying at the top of the profile: beyond it the model cannot say, so it stops there.
        why = f"predicted: speculation pays up to the profile's largest batch, {high}"
    elif best == 0:
        why = "predicted: speculation pays at no batch"
        if any(pays):
            why += f" up to {round(batch or 0)} (it pays from batch {pays.index(True)})"
    else:
        why = f"predicted: speculation pays up to batch {best}"
    if best > 0 and first > 1:
        why += f" from batch {first}"
    why += f" (accept length {tau:.2f}, {source}"
    if correction != (1.0, 1.0):
        why += f"; corrected x{correction[0]:.2f} on, x{correction[1]:.2f} off"
    why += ")"
    if not confident:
        why += "; samples disagree with the model"
    return Prediction(
        threshold, why, confident, profile, tau, correction, measured=source == "measured",
        estimate=estimate,
    )  # fmt: skip


def _bounded_correction(factor: float) -> float:
    low, high = CORRECTION_BOUNDS
    return min(high, max(low, factor))


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value!r}")
    return float(value)


def _smooth(previous: float | None, value: float, elapsed: float, half_life: float) -> float:
    if previous is None or not math.isfinite(elapsed):
        return value
    keep: float = 0.5 ** (max(0.0, elapsed) / half_life)
    return keep * previous + (1.0 - keep) * value


def _counters(spec: Mapping[str, Any], names: Sequence[str]) -> dict[str, float] | None:
    """`names` read from a /v1/loads `speculative` section as lifetime counters, or None when
    one is absent; ValueError naming the counter when one is not a finite number >= 0."""
    if not all(name in spec for name in names):
        return None
    out = {}
    for name in names:
        try:
            value = _number(spec[name])
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
        out[name] = value
    return out


def counters_from_wire(spec: Mapping[str, Any]) -> dict[str, float] | None:
    """The acceptance counters of a /v1/loads `speculative` section, or None when the engine
    does not report them; ValueError when one is not a finite number >= 0."""
    return _counters(spec, contract.ACCEPTANCE_COUNTERS)


def uninterrupted_step_seconds(before: Mapping[str, Any], after: Mapping[str, Any]) -> float | None:
    """The mean decode step between two /v1/loads `speculative` sections, over the steps that
    directly followed another decode step (contract.STEP_TIME_COUNTERS); None when either
    does not report them, no such step ran, or the counters went back (a restart).
    ValueError when one is not a finite number >= 0."""
    first = _counters(before, contract.STEP_TIME_COUNTERS)
    last = _counters(after, contract.STEP_TIME_COUNTERS)
    if first is None or last is None:
        return None
    steps_name, us_name = contract.STEP_TIME_COUNTERS
    steps = last[steps_name] - first[steps_name]
    micros = last[us_name] - first[us_name]
    if steps <= 0 or micros <= 0:
        return None
    return micros / 1e6 / steps


__all__: Sequence[str] = (
    "AcceptanceTracker",
    "Prediction",
    "Residuals",
    "StepProfile",
    "chain_accept_length",
    "counters_from_wire",
    "predict",
    "seconds_per_token",
    "uninterrupted_step_seconds",
)
