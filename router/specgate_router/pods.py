"""What the router knows about each engine pod: last scrapes, learning samples, the controller's
decision, its pool, the router's own in-flight count and a circuit breaker."""

from __future__ import annotations

import functools
import hashlib
import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from specgate import contract
from specgate.engine_client import EngineClient, EngineLoad
from specgate_router import control
from specgate_router.settings import ControlSettings, ResilienceSettings

Pool = Literal["latency", "throughput", "mixed"]
MAX_SAMPLES = 1200
SAMPLE_SPAN_SECONDS = 5.0
"""A learning sample spans consecutive scrapes until they hold `control.samples.SAMPLE_MIN_STEPS`
decode steps, at most this long. Dropping an interval with a long prefill and no step instead
would leave samples that read a mode as fast as its steps alone: the slower a mode's steps,
the more of its prefills go missing, and a probe reads it faster than it runs (BENCHMARKS.md,
section 0)."""


@dataclass
class CircuitBreaker:
    """Closed -> open after `breaker_failures` consecutive failures -> half-open after
    `breaker_open_seconds` (one trial request) -> closed on success, open again on failure."""

    failures: int = 0
    opened_at: float | None = None
    trial_in_flight: bool = False

    def state(self, now: float, params: ResilienceSettings) -> str:
        if self.opened_at is None:
            return "closed"
        if now - self.opened_at >= params.breaker_open_seconds:
            return "half_open"
        return "open"

    def allows(self, now: float, params: ResilienceSettings) -> bool:
        state = self.state(now, params)
        return state == "closed" or (state == "half_open" and not self.trial_in_flight)

    def on_dispatch(self, now: float, params: ResilienceSettings) -> None:
        if self.state(now, params) == "half_open":
            self.trial_in_flight = True

    def on_success(self) -> None:
        self.failures, self.opened_at, self.trial_in_flight = 0, None, False

    def trip(self, now: float, params: ResilienceSettings) -> None:
        """Open at once: the pod went silent, which one more try would only wait out again."""
        self.failures = max(self.failures, params.breaker_failures)
        self.trial_in_flight = False
        self.opened_at = now

    def on_failure(self, now: float, params: ResilienceSettings) -> None:
        self.failures += 1
        self.trial_in_flight = False
        if self.opened_at is not None or self.failures >= params.breaker_failures:
            self.opened_at = now


@dataclass(frozen=True)
class Scrape:
    at: float
    load: EngineLoad
    # This router's requests in flight to the pod when the report arrived: what the pod
    # reports beyond them came from other router replicas.
    own_in_flight: int = 0


def speculating_fraction(prev: Scrape | None, scrape: Scrape) -> float | None:
    """The share of decode steps between two scrapes that speculated; None when the engine
    does not count them or no decode step ran."""
    if prev is None:
        return None
    on0, off0 = prev.load.decode_steps_on, prev.load.decode_steps_off
    on1, off1 = scrape.load.decode_steps_on, scrape.load.decode_steps_off
    if on0 is None or off0 is None or on1 is None or off1 is None:
        return None
    d_on, d_off = on1 - on0, off1 - off0
    if d_on < 0 or d_off < 0 or d_on + d_off <= 0:
        return None
    return d_on / (d_on + d_off)


def decode_cycles(prev: Scrape, scrape: Scrape) -> tuple[float, float] | None:
    """(decode steps, seconds of their launch-to-launch cycles: SGLang's decode moments, the
    prefills between steps included) between two scrapes; None when no decode step ran or the
    counters went back."""
    a, b = prev.load, scrape.load
    steps, micros = b.decode_steps - a.decode_steps, b.decode_step_us - a.decode_step_us
    if steps <= 0 or micros < 0:
        return None
    return steps, micros / 1e6


def outside_steps(prev: Scrape, scrape: Scrape, step_seconds: float) -> float | None:
    """The share of an interval's decode cycles not spent in the decode steps themselves
    (`step_seconds` each, from the steps that followed another directly), in [0, 1]; None
    when no decode step ran."""
    cycles = decode_cycles(prev, scrape)
    if cycles is None or cycles[1] <= 0:
        return None
    steps, seconds = cycles
    return min(1.0, max(0.0, 1.0 - steps * step_seconds / seconds))


def public_id(pod_name: str) -> str:
    """An opaque, stable name for a pod in answers (`x-specgate-pod`): pod names and
    addresses are internal. /specgate/pods shows it beside the name."""
    return "pod-" + hashlib.sha256(pod_name.encode()).hexdigest()[:12]


@dataclass
class PodState:
    name: str
    url: str
    client: EngineClient
    decision: control.Decision
    healthy: bool = False
    draining: bool = False
    last: Scrape | None = None
    scrape_error: str | None = None
    samples: deque[control.Sample] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    pool: Pool = "mixed"
    throughput_room: int = 0
    """In the latency pool: how many throughput requests it takes besides its share of the
    latency traffic (the batch it is sized for, less that share)."""
    pool_batch: int = 0
    """In the latency pool: the batch it is sized for. Throughput requests stop there
    whoever sent them (the pod's reported batch counts every router replica's requests)."""
    in_flight: int = 0
    throughput_in_flight: int = 0
    dispatched_since_scrape: int = 0
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    confirmed_threshold: int | None = None
    threshold_known: bool = False
    push_failures: int = 0
    push_logged_at: float = -math.inf
    scrape_failures: int = 0
    """Failed scrapes since the router started (shown in /specgate/pods)."""
    next_push_at: float = 0.0
    rejected_logged_at: float = -math.inf
    profile: control.StepProfile | None = None
    """The engine's step-cost profile (None: it reports none)."""
    profile_error: str | None = None
    acceptance: control.AcceptanceTracker = field(default_factory=control.AcceptanceTracker)
    _profile_wire: Any = None
    _sample_start: Scrape | None = None
    """Where the next learning sample starts, when the scrapes since held too few steps."""

    # ---- reading ----

    def fresh(self, now: float, params: ControlSettings) -> bool:
        return self.last is not None and now - self.last.at <= params.stale_after_seconds

    def scrape_age(self, now: float) -> float:
        return math.inf if self.last is None else now - self.last.at

    @property
    def threshold(self) -> int | None:
        """The threshold the pod runs with, as last confirmed (else the decision)."""
        return self.confirmed_threshold if self.threshold_known else self.decision.threshold

    def expected_batch(self) -> int:
        """Running + queued at the engine, plus what this router sent since the last scrape."""
        if self.last is None:
            return self.in_flight
        return self.last.load.running + self.last.load.waiting + self.dispatched_since_scrape

    def serving(self) -> bool:
        """Requests are running, queued or on their way to it: it makes data of its own."""
        return self.expected_batch() > 0 or self.in_flight > 0

    def capacity(self) -> int:
        return max(1, self.last.load.max_running) if self.last else 1

    def speculating(self) -> bool:
        if self.last is not None and self.last.load.speculating is not None:
            return bool(self.last.load.speculating)
        batch = self.last.load.running if self.last else 0
        return contract.speculates(batch, self.threshold)

    @property
    def hardware(self) -> tuple[str | None, int | None]:
        """(accelerator, accelerators per engine) as the pod last reported them; pods with
        the same pair pool their learning samples (unknown: pooled with the other unknown)."""
        load = self.last.load if self.last else None
        return (load.accelerator, load.num_accelerators) if load else (None, None)

    # ---- writing ----

    def record(self, scrape: Scrape) -> None:
        """Take a new scrape; derive a learning sample from the scrapes since the last one."""
        prev, self.last = self.last, scrape
        self.scrape_error = None
        self.healthy = True
        self.dispatched_since_scrape = 0
        load = scrape.load
        self.threshold_known = load.threshold_known
        if load.threshold_known:
            self.confirmed_threshold = load.threshold
        self._read_model_inputs(scrape, speculating_fraction(prev, scrape))
        start = self._interval_start(prev, scrape)
        sample = _sample_between_scrapes(start, scrape) if start is not None else None
        if start is not None and sample is not None:
            self.samples.append(self._annotated(sample, start, scrape))

    def _interval_start(self, prev: Scrape | None, scrape: Scrape) -> Scrape | None:
        """The scrape a sample ending at `scrape` starts from, or None while the interval
        holds too few decode steps to time (the next scrape's sample then covers it too)."""
        start, self._sample_start = self._sample_start, None
        if start is None or scrape.at - start.at > SAMPLE_SPAN_SECONDS:
            start = prev
        if start is None or not _counts_steps(start) or not _counts_steps(scrape):
            return None
        load = scrape.load
        taken = (load.decode_steps_on or 0) - (start.load.decode_steps_on or 0)
        taken += (load.decode_steps_off or 0) - (start.load.decode_steps_off or 0)
        if (
            0 <= taken < control.samples.SAMPLE_MIN_STEPS
            and load.decode_tokens >= start.load.decode_tokens
        ):
            self._sample_start = start
            return None
        return start

    def _annotated(self, sample: control.Sample, start: Scrape, scrape: Scrape) -> control.Sample:
        """`sample` with the accept length it ran at and its share of time between steps."""
        acceptance = self.acceptance.current(scrape.at)
        if acceptance is not None:
            tau = acceptance.tau
            if sample.speculating and acceptance.source == "measured":
                # As measured now, not smoothed: a trial reads each sample against its own
                # accept length, and a smoothed one lags a change of workload by seconds.
                now_tau, behind = self.acceptance.recent_measured()
                tau = now_tau if behind > 0 else tau
            sample = replace(sample, accept_length=tau)
        try:
            step_seconds = control.uninterrupted_step_seconds(
                start.load.speculative, scrape.load.speculative
            )
        except ValueError as exc:
            self.profile_error = str(exc)[:300]
            step_seconds = None
        if step_seconds is not None:
            sample = replace(sample, step_seconds=step_seconds)
        if step_seconds is None and self.profile is not None:
            # A prefill between every two decode steps leaves none timed alone: the profile
            # says what such a step takes.
            step_seconds = self.profile.step_seconds(sample.batch, sample.speculating)
        if step_seconds is None:
            return sample
        return replace(sample, outside_steps=outside_steps(start, scrape, step_seconds))

    def _read_model_inputs(self, scrape: Scrape, speculating: float | None) -> None:
        """The step profile (parsed when it changes) and the acceptance counters. A malformed
        one is dropped with its error kept for the pod's view: it never reaches the model."""
        spec = scrape.load.speculative
        wire = spec.get(contract.STEP_PROFILE)
        try:
            if wire != self._profile_wire:
                self._profile_wire = wire
                self.profile = control.StepProfile.from_wire(
                    wire,
                    off_step_tokens=spec.get("off_step_tokens", 1),
                    num_steps=spec.get("num_steps", 3),
                )
                self.profile_error = None
            counters = control.counters_from_wire(spec)
        except ValueError as exc:
            self.profile, self.profile_error = None, str(exc)[:300]
            return
        if counters is not None:
            steps = self.profile.num_steps if self.profile else 3
            self.acceptance.update(counters, scrape.at, steps, speculating)

    @functools.cached_property
    def public_id(self) -> str:
        return public_id(self.name)  # a hash: every answer names its pod

    def scrape_failed(self, error: str, *, unreachable: bool) -> None:
        """A failed scrape leaves the metrics to go stale (the pod is then de-prioritised and
        gets no threshold decisions); only an unreachable pod is taken out of rotation. A pod
        that is merely slow to answer its metrics under load still serves requests, and the
        circuit breaker judges those."""
        self.scrape_error = error
        self.scrape_failures += 1
        self.healthy = not unreachable

    def view(
        self, now: float, params: ControlSettings, resilience: ResilienceSettings
    ) -> dict[str, Any]:
        load = self.last.load if self.last else None
        return {
            "name": self.name,
            "id": self.public_id,
            "url": self.url,
            "healthy": self.healthy,
            "draining": self.draining,
            "fresh": self.fresh(now, params),
            "scrapeAgeSeconds": None if self.last is None else round(now - self.last.at, 3),
            "scrapeError": self.scrape_error,
            "scrapeFailures": self.scrape_failures,
            "pushFailures": self.push_failures,
            "pool": self.pool,
            "throughputRoom": self.throughput_room,
            "accelerator": {"name": self.hardware[0], "perEngine": self.hardware[1]},
            "batch": load.running if load else None,
            "queued": load.waiting if load else None,
            "maxRunning": load.max_running if load else None,
            "speculating": self.speculating() if load else None,
            "threshold": self.threshold,
            "decidedThreshold": self.decision.threshold,
            "rule": str(self.decision.rule),
            "reason": self.decision.detail,
            "trial": _trial_view(self.decision.trial),
            "lastChange": None
            if math.isinf(self.decision.changed_at)
            else self.decision.changed_at,
            "acceptLength": load.accept_length if load else None,
            "genThroughput": load.gen_throughput if load else None,
            "inFlight": self.in_flight,
            "circuit": self.breaker.state(now, resilience),
            "samples": len(self.samples),
            "prediction": self._prediction_view(now),
        }

    def _prediction_view(self, now: float) -> dict[str, Any] | None:
        if self.profile is None:
            return None if self.profile_error is None else {"error": self.profile_error}
        acceptance = self.acceptance.current(now)
        model = self.decision.model
        readings = self.decision.readings
        return {
            "profiledUpTo": self.profile.top(),
            "acceptLength": None if acceptance is None else round(acceptance.tau, 3),
            "acceptLengthSource": None if acceptance is None else acceptance.source,
            "correction": None if model is None else round(model.correction, 3),
            "stepScale": None
            if model is None
            else {"on": round(model.scale[0], 3), "off": round(model.scale[1], 3)},
            "readings": [
                {
                    "batch": round(r.batch, 1),
                    "correction": round(r.correction, 3),
                    "measured": round(r.measured, 3),
                    "error": round(r.error, 3),
                    "ageSeconds": round(now - r.at, 1),
                }
                for r in readings
            ],
        }

    def control_input(self, now: float, params: ControlSettings) -> control.PodInput:
        """What the control step needs of this pod now."""
        return control.PodInput(
            self.decision,
            self.samples,
            fresh=self.fresh(now, params),
            pool=self.pool,
            profile=self.profile,
            acceptance=self.acceptance.current(now),
            settled=self.acceptance.settled(now, control.TUNING.workload_band),
            group=self.hardware,
        )


def _trial_view(trial: control.Trial | None) -> dict[str, Any] | None:
    if trial is None:
        return None
    return {
        "batch": trial.batch,
        "mode": "speculation" if trial.speculating else "plain",
        "threshold": trial.threshold,
        "returnsTo": trial.back,
        "round": len(trial.rounds),
    }


def _counts_steps(scrape: Scrape) -> bool:
    """Whether the engine reports its decode steps per mode (a patched engine does)."""
    return scrape.load.decode_steps_on is not None and scrape.load.decode_steps_off is not None


def _sample_between_scrapes(start: Scrape, end: Scrape) -> control.Sample | None:
    """The learning sample of the decode steps between two scrapes, or None where they
    cannot give one (counters reset, no steps)."""
    a, b = start.load, end.load
    steps = b.decode_steps - a.decode_steps
    cycles = decode_cycles(start, end)
    return control.sample_between(
        t0=start.at,
        t1=end.at,
        batch0=a.running,
        batch1=b.running,
        tokens0=a.decode_tokens,
        tokens1=b.decode_tokens,
        steps_on0=a.decode_steps_on or 0,
        steps_on1=b.decode_steps_on or 0,
        steps_off0=a.decode_steps_off or 0,
        steps_off1=b.decode_steps_off or 0,
        mean_batch=(b.decode_batch_sum - a.decode_batch_sum) / steps if steps > 0 else None,
        cycle_seconds=cycles[1] if cycles else None,
    )
