"""The pod's acceptance: measured while it speculates, estimated while it does not.

Per request, a speculating step yields the accept length tau (accepted drafts plus the bonus
token). While speculation is off the patched engine still runs the draft a step ahead and
counts how often its proposal for the next position agrees with the target's token
(first-position agreement p1); for a chain of n drafts with equal acceptance at every position,
tau = 1 + p + ... + p^n. Real chains accept less at later positions, so the map is calibrated
where the pod switches between the modes: the accept length measured on one side of a switch
against the estimate from the agreement on the other. First-position acceptance counted while
speculating is not used for this: after a rejection the bonus token is sampled from the
target's residual distribution, so the context a speculating draft sees differs from an off
step's (BENCHMARKS.md, section 0b, measures both).

The constants below describe the estimator (how many proposals a reading needs, how fast it
follows a change of workload), not the control law: `control.tuning` holds the law's.
Everything here is pure and takes time as an argument.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from specgate import contract
from specgate_router.control.profile import finite_number
from specgate_router.control.samples import STEADY_MODE_FRACTION

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
MIN_PROPOSALS = 64
"""Draft proposals (while off) before their agreement rate says anything."""
CALIBRATING_PROPOSALS = 256
"""Proposals behind one reading of the agreement for it to calibrate alone (within about 0.03)."""
SETTLED_AGREEMENT = 0.05
"""The latest agreement reading within this of the smoothed one: the workload is not moving."""
ANOTHER_WORKLOAD = 0.1
"""Two comparisons whose agreements lie further apart than this were made on different
workloads (a reading of CALIBRATING_PROPOSALS is within about 0.03 of its workload's, so two
on one workload differ by less)."""
MIN_CALIBRATING_REQUEST_STEPS = 256
"""Speculating request-steps behind a measured accept length before it calibrates the estimate
at a switch off (a chain's accepted drafts vary by about 1 a step: 256 put it within 3%). A pod
taken off within a scrape of starting has measured a few dozen."""


UNCALIBRATED_ERROR = 0.25
"""How far (as a share) an estimate while off may be from the accept length before any switch
has calibrated it: a real chain accepts less at later positions than its first position's
agreement implies, and the draft's agreement while off differs from a speculating step's by
workload (BENCHMARKS.md, section 0b)."""
CALIBRATED_ERROR = 0.1
"""The same once calibrated: the map moves with the workload between two switches."""


class Acceptance(NamedTuple):
    """The accept length the law predicts with, where it comes from, and how far it may be
    from the one speculation would measure (as a share; 0 when measured)."""

    tau: float
    source: str
    error: float = 0.0


def chain_accept_length(p1: float, num_steps: int) -> float:
    """Expected tokens a speculating step yields per request when every one of `num_steps`
    drafted positions is accepted with probability p1, the first rejection ending the chain."""
    p = min(max(p1, 0.0), 1.0)
    return sum(p**j for j in range(num_steps + 1))


@dataclass
class AcceptanceTracker:
    """The pod's acceptance from the engine's lifetime counters (contract.ACCEPTANCE_COUNTERS),
    read interval by interval: measured while speculating, estimated from first-position
    agreement while off, and the map between the two calibrated where both are seen."""

    num_steps: int = 3
    tau: float | None = None  # measured accept length (smoothed)
    tau_at: float = -math.inf
    recent: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=64))
    """(request-steps, accepted drafts) of the steady speculating intervals since speculation
    last resumed, newest last: the accept length as measured now, without the smoothing's lag
    (`recent_measured`)."""
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
    calibration_weight: float = 0.0
    """The comparisons behind `calibration`, each counted once and halved every
    CALIBRATION_HALF_LIFE_SECONDS: a mean over comparisons, so that the few seconds of them
    around one switch outweigh one made minutes before on another workload."""
    calibration_p1: float | None = None
    """The agreement of the latest comparison: one whose agreement lies more than
    ANOTHER_WORKLOAD from it was made on another workload, and starts the mean over."""
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
                self.recent.clear()
            self.tau = _smooth(self.tau, measured, at - self.tau_at, TAU_HALF_LIFE_SECONDS)
            self.tau_at = at
            self.recent.append((steps, d["spec_accepted_tokens"]))
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
                tau, behind = self.recent_measured()
                if (
                    at - self.tau_at <= CROSS_CALIBRATION_SECONDS
                    and behind >= MIN_CALIBRATING_REQUEST_STEPS
                ):
                    self._calibrate(tau, min(1.0, pooled[1] / pooled[0]), at)

    def recent_measured(self) -> tuple[float, float]:
        """(accept length, request-steps behind it) over the newest steady speculating
        intervals that hold MIN_CALIBRATING_REQUEST_STEPS (all since speculation resumed,
        where fewer): the accept length measured now, where the smoothed one still carries a
        workload that has just changed. (1.0, 0) where none."""
        steps = accepted = 0.0
        for n, a in reversed(self.recent):
            steps, accepted = steps + n, accepted + a
            if steps >= MIN_CALIBRATING_REQUEST_STEPS:
                break
        return (1.0 + accepted / steps, steps) if steps > 0 else (1.0, 0.0)

    def settled(self, now: float, band: float) -> bool:
        """Whether the acceptance holds still: the accept length measured now (while
        speculating), or the agreement's latest reading (while off), lies within `band` of
        the smoothed one. After a change of workload the smoothed figures take several
        half-lives to follow. True for an engine that reports no acceptance: nothing moves."""
        if self.tau is None and self.p1_off is None:
            return True
        if self.tau is not None and now - self.tau_at <= MEASURED_FRESH_SECONDS:
            tau, _ = self.recent_measured()
            return abs(tau - self.tau) <= band * self.tau
        if self.p1_off is None or self.p1_off_last is None:
            return False
        if now - self.p1_off_at > ESTIMATE_FRESH_SECONDS:
            return False
        smoothed = chain_accept_length(self.p1_off, self.num_steps)
        last = chain_accept_length(self.p1_off_last, self.num_steps)
        return abs(last - smoothed) <= band * smoothed

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
        kept = 0.0
        # How a chain accepts along its positions, and so the map, is the workload's: one
        # whose first position agrees otherwise than the last comparison's is another.
        moved = self.calibration_p1 is not None and abs(p1_off - self.calibration_p1) > (
            ANOTHER_WORKLOAD
        )
        if self.calibrated and not moved:
            elapsed = max(0.0, at - self.calibration_at)
            kept = self.calibration_weight * 0.5 ** (elapsed / CALIBRATION_HALF_LIFE_SECONDS)
        self.calibration = (kept * self.calibration + ratio) / (kept + 1.0)
        self.calibration_weight = kept + 1.0
        self.calibrated, self.calibration_at, self.calibration_p1 = True, at, p1_off

    def current(self, now: float) -> Acceptance | None:
        """The expected accept length, or None when nothing recent says."""
        if self.tau is not None and now - self.tau_at <= MEASURED_FRESH_SECONDS:
            return Acceptance(self.tau, "measured")
        estimate = self.estimate(now)
        if estimate is None:
            return None
        if self.calibrated:
            return Acceptance(estimate, "estimated while off (calibrated)", CALIBRATED_ERROR)
        return Acceptance(estimate, "estimated while off (uncalibrated)", UNCALIBRATED_ERROR)

    def estimate(self, now: float) -> float | None:
        """The accept length estimated from the agreement while off, where that is recent
        (None otherwise)."""
        if self.p1_off is None or now - self.p1_off_at > ESTIMATE_FRESH_SECONDS:
            return None
        return max(1.0, self.calibration * chain_accept_length(self.p1_off, self.num_steps))


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
            value = finite_number(spec[name])
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
