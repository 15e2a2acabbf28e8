"""The simulated engine: continuous batching as a discrete-event state machine.

`EngineCore` holds no clock: `plan(now)` decides the next step (a prefill of newly admitted
requests, or one decode step of the running batch) and its duration from the profile;
`finish(step, end)` applies it. A real-time driver sleeps the duration between the two (the HTTP
pods); a virtual-time driver just adds it to a number (tests, benchmarks). Both run the same
code, so what the tests measure is what the pods serve.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from specgate import contract
from specgate_sim.profile import Profile

TokenSink = Callable[[int, bool], None]
"""Called with (new tokens, finished) when a step ends for a request."""

ACCEPT_FRESH_SECONDS = 5.0
"""How recent a speculating step must be for the engine to report an accept length."""

DECODE_STEP_MAX_SECONDS = 2.0
"""SGLang's bound on a decode step's interval from the previous one (longer: idle time)."""

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, math.inf)


@dataclass(eq=False)
class SimRequest:
    rid: str
    prompt_tokens: int
    max_new_tokens: int
    arrival: float
    sink: TokenSink | None = None
    generated: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    accepted_steps: list[int] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.generated


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        self.total += value
        self.n += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
                break

    def cumulative(self) -> list[tuple[float, int]]:
        out, running = [], 0
        for bound, count in zip(self.buckets, self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


@dataclass
class EngineStats:
    """Cumulative counters, as SGLang's metrics collector keeps them."""

    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0  # as SGLang counts it: when a request finishes
    decode_steps_on: int = 0
    decode_steps_off: int = 0
    prefill_steps: int = 0
    spec_request_steps: int = 0  # (request, speculating step) pairs
    spec_accepted_tokens: int = 0  # accepted drafts over those pairs
    spec_first_agreed: int = 0  # of those pairs, the ones whose first draft was accepted
    draft_first_proposed: int = 0  # (request, off step) pairs where the draft proposed a token
    draft_first_agreed: int = 0  # ... that the target's sampled token agreed with
    last_spec_step_end: float | None = None  # when the last speculating step ended
    last_step_end: float = 0.0
    busy_seconds: float = 0.0
    decode_moments: list[float] = field(default_factory=lambda: [0.0] * 6)
    """SGLang's per-step sums (contract.DECODE_MOMENTS): steps, batch, step microseconds,
    batch squared, batch x microseconds, generated tokens. As in SGLang, a step's
    microseconds are the interval from the previous decode step's start, so the prefills run
    between them count (a step with none before it, or over 2 s after it, counts its own)."""
    uninterrupted_decode_steps: int = 0
    uninterrupted_decode_us: float = 0.0
    """contract.STEP_TIME_COUNTERS: decode steps started right after a decode step, and the
    sum of those intervals."""
    ttft: Histogram = field(default_factory=Histogram)
    e2e: Histogram = field(default_factory=Histogram)
    itl: Histogram = field(default_factory=Histogram)

    def accept_length(self) -> float:
        """Mean tokens per request per speculating step; steps with speculation off are not
        counted, so a pod that stopped speculating keeps its real figure."""
        if self.spec_request_steps == 0:
            return 0.0
        return 1.0 + self.spec_accepted_tokens / self.spec_request_steps

    def live_accept_length(self) -> float | None:
        """The accept length, only while the engine speculates (its last speculating step is
        within ACCEPT_FRESH_SECONDS of its last step): a pod running plain reports none rather
        than a figure from another load or workload."""
        last = self.last_spec_step_end
        if last is None or self.last_step_end - last > ACCEPT_FRESH_SECONDS:
            return None
        return self.accept_length()


@dataclass(frozen=True)
class HostSpells:
    """Slow spells of a shared host: a GPU server's short windows can fall into fast and slow
    ones, 1.5x apart at the same accept length and GPU clock, when the host runs the same
    step's work slower for seconds at a time. Here the engine alternates between
    fast and slow spells, each lasting an exponentially distributed time of its own decode
    and prefill steps (means `fast_seconds`, `slow_seconds`; idle time does not count), and in
    a slow spell the host's part of a decode step (`Profile.host_time`) takes `slowdown`
    times as long."""

    slowdown: float = 2.0
    fast_seconds: float = 6.0
    slow_seconds: float = 4.0

    def __post_init__(self) -> None:
        if self.slowdown < 1:
            raise ValueError(f"slowdown {self.slowdown}: a slow spell is at least as slow (>= 1)")
        if self.fast_seconds <= 0 or self.slow_seconds <= 0:
            raise ValueError("fast_seconds and slow_seconds: spells last > 0 seconds")

    @classmethod
    def parse(cls, text: str) -> HostSpells:
        """`SLOWDOWN[:FAST_SECONDS:SLOW_SECONDS]`, as `specgate sim --host-spells` takes it."""
        parts = text.split(":")
        if len(parts) not in (1, 3):
            raise ValueError(f"{text!r}: SLOWDOWN or SLOWDOWN:FAST_SECONDS:SLOW_SECONDS")
        try:
            values = [float(v) for v in parts]
        except ValueError:
            raise ValueError(f"{text!r}: numbers, as 2:6:4") from None
        return cls(*values)


@dataclass(frozen=True)
class Step:
    kind: Literal["prefill", "decode"]
    duration: float
    batch: int
    speculating: bool
    tokens: tuple[tuple[SimRequest, int], ...]


class EngineCore:
    def __init__(
        self,
        profile: Profile,
        *,
        threshold: int | None = None,
        seed: int | None = None,
        max_running_requests: int | None = None,
        off_step_tokens: int = 1,
        host_spells: HostSpells | None = None,
    ) -> None:
        if off_step_tokens < 1:
            raise ValueError(f"off_step_tokens {off_step_tokens}: an off step decodes >= 1 token")
        self.profile = profile
        self.host_spells = host_spells
        # Its own stream: spells on or off leave the acceptance draws as they were.
        self._spell_rng = random.Random(None if seed is None else seed + 0x5EED)
        self.slow_spell = False
        self._spell_left = self._spell_length()
        self.threshold = threshold
        self.off_step_tokens = off_step_tokens
        self.max_running = max_running_requests or profile.max_running_requests
        self.rng = random.Random(seed)
        # The draft's first-position agreement while speculation is off, drawn from a stream of
        # its own so that every speculating draw is what it was without it.
        self._draft_rng = random.Random(None if seed is None else seed + 0xD4AF7)
        self.acceptance_rate = profile.acceptance.per_token_rate
        """Per-token acceptance of the current workload (`set_acceptance` changes it)."""
        self.position_decay = profile.acceptance.position_decay
        self.off_agreement_factor = 1.0
        """The draft's first-position agreement while off, relative to a speculating step's
        first position: the contexts differ (after a rejection a speculating draft continues
        from a token sampled from the target's residual distribution), so on a GPU the two
        rates differ by workload."""
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.stats = EngineStats()
        self.last_step: Step | None = None
        self._last_decode_start: float | None = None
        self._prefill_since_decode = False

    # ---- inputs ----

    def add(self, request: SimRequest) -> None:
        self.waiting.append(request)
        self.stats.requests += 1
        self.stats.prompt_tokens += request.prompt_tokens

    def abort(self, request: SimRequest) -> None:
        """Drop a request whose client went away (SGLang counts its tokens as it finishes)."""
        if request in self.running:
            self.running.remove(request)
            self.stats.generation_tokens += request.generated
        elif request in self.waiting:
            self.waiting.remove(request)

    def set_threshold(self, threshold: int | None) -> None:
        self.threshold = threshold

    def set_acceptance(self, per_token_rate: float) -> None:
        """A workload whose drafts are accepted at another rate, from the next step on."""
        if not 0.0 <= per_token_rate <= 1.0:
            raise ValueError(f"per-token acceptance {per_token_rate}: a rate in [0, 1]")
        self.acceptance_rate = per_token_rate

    # ---- the step machine ----

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def speculating(self) -> bool:
        return contract.speculates(len(self.running), self.threshold)

    def _spell_length(self) -> float:
        spells = self.host_spells
        if spells is None:
            return math.inf
        mean = spells.slow_seconds if self.slow_spell else spells.fast_seconds
        return self._spell_rng.expovariate(1.0 / mean)

    def _in_spell(self, duration: float, host: float) -> float:
        """`duration` as the host's current spell runs it (a step's `host` part stretched in a
        slow one), and the spell clock moved on by it."""
        if self.host_spells is None:
            return duration
        if self.slow_spell:
            duration += (self.host_spells.slowdown - 1.0) * host
        self._spell_left -= duration
        while self._spell_left <= 0:
            self.slow_spell = not self.slow_spell
            self._spell_left += self._spell_length()
        return duration

    def _draw_accepted(self) -> int:
        rate, accepted = self.acceptance_rate, 0
        while accepted < self.profile.num_steps and self.rng.random() < rate:
            accepted += 1
            rate *= self.position_decay
        return accepted

    def plan(self) -> Step | None:
        """The next step, or None when idle."""
        admitted: list[SimRequest] = []
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            admitted.append(self.waiting.popleft())
        if admitted:
            self.running.extend(admitted)
            duration = self.profile.prefill_time(
                sum(r.prompt_tokens for r in admitted),
                contract.speculates(len(self.running), self.threshold),
            )
            duration = self._in_spell(duration, 0.0)
            return Step("prefill", duration, len(admitted), False, tuple((r, 1) for r in admitted))
        if not self.running:
            return None
        batch = len(self.running)
        on = contract.speculates(batch, self.threshold)
        tokens = []
        for req in self.running:
            if on:
                accepted = self._draw_accepted()
                req.accepted_steps.append(accepted)
                tokens.append((req, min(1 + accepted, req.remaining)))
            else:
                tokens.append((req, min(self.off_step_tokens, req.remaining)))
        duration = self.profile.step_time(batch, on, self.off_step_tokens)
        duration = self._in_spell(duration, self.profile.host_time(on))
        return Step("decode", duration, batch, on, tuple(tokens))

    def finish(self, step: Step, end: float) -> None:
        """Apply a planned step that ended at time `end`."""
        stats = self.stats
        stats.busy_seconds += step.duration
        # A set, not the list: fleet benchmarks run millions of steps at batch 64.
        running = set(self.running)
        if step.kind == "prefill":
            stats.prefill_steps += 1
            self._prefill_since_decode = True
        elif step.speculating:
            stats.decode_steps_on += 1
            live = [r for r, _ in step.tokens if r in running]
            stats.spec_request_steps += len(live)
            stats.spec_accepted_tokens += sum(r.accepted_steps[-1] for r in live)
            stats.spec_first_agreed += sum(1 for r in live if r.accepted_steps[-1] > 0)
            stats.last_spec_step_end = end
        else:
            stats.decode_steps_off += 1
            # The off step writes the draft's KV for every token; its proposal for the next
            # position is compared with the token the target sampled there.
            live_n = sum(1 for r, _ in step.tokens if r in running)
            stats.draft_first_proposed += live_n
            rate = min(1.0, self.acceptance_rate * self.off_agreement_factor)
            draw = self._draft_rng.random
            stats.draft_first_agreed += sum(1 for _ in range(live_n) if draw() < rate)
        stats.last_step_end = end
        if step.kind == "decode":
            start = end - step.duration
            since, self._last_decode_start = self._last_decode_start, start
            interval = None if since is None else start - since
            if interval is not None and not 0 < interval < DECODE_STEP_MAX_SECONDS:
                interval = None
            if interval is not None and not self._prefill_since_decode:
                stats.uninterrupted_decode_steps += 1
                stats.uninterrupted_decode_us += interval * 1e6
            self._prefill_since_decode = False
            b = float(step.batch)
            us = (interval if interval is not None else step.duration) * 1e6
            generated = sum(n for r, n in step.tokens if r in running and n > 0)
            for i, v in enumerate((1.0, b, us, b * b, b * us, float(generated))):
                stats.decode_moments[i] += v
        finished = []
        for req, n in step.tokens:
            if req not in running or n <= 0:
                continue  # aborted while the step ran
            if req.first_token_at is None:
                req.first_token_at = end
                stats.ttft.observe(end - req.arrival)
            else:
                stats.itl.observe(step.duration / n)
            req.generated += n
            done = req.remaining <= 0
            if done:
                stats.generation_tokens += req.generated
                req.finished_at = end
                finished.append(req)
                stats.e2e.observe(end - req.arrival)
            if req.sink is not None:
                req.sink(n, done)
        if finished:
            gone = set(finished)
            self.running = [r for r in self.running if r not in gone]
        self.last_step = step

    def token_usage(self) -> float:
        used = sum(r.prompt_tokens + r.generated for r in self.running)
        return used / self.profile.max_total_tokens


def closed_loop_throughput(
    profile: Profile,
    concurrency: int,
    *,
    threshold: int | None,
    output_tokens: int = 256,
    prompt_tokens: int = 128,
    requests_per_client: int = 8,
    seed: int = 0,
    off_step_tokens: int = 1,
    host_spells: HostSpells | None = None,
) -> float:
    """Output tok/s of `concurrency` clients that each send a new request when the last ends,
    in virtual time (no sleeping): the benchmark a GPU sweep runs, run on the simulator."""
    core = EngineCore(
        profile,
        threshold=threshold,
        seed=seed,
        off_step_tokens=off_step_tokens,
        host_spells=host_spells,
    )
    now, produced, issued = 0.0, 0, 0
    total = concurrency * requests_per_client

    def submit() -> None:
        nonlocal issued
        issued += 1
        req = SimRequest(f"r{issued}", prompt_tokens, output_tokens, now)
        req.sink = on_tokens
        core.add(req)

    def on_tokens(n: int, done: bool) -> None:
        nonlocal produced
        produced += n
        if done and issued < total:
            submit()

    for _ in range(concurrency):
        submit()
    while (step := core.plan()) is not None:
        now += step.duration
        core.finish(step, now)
    return produced / now
