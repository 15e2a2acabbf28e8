"""One simulated engine pod behind the router's own control code, in virtual time: how the
controller is tested on workloads it was not tuned on (tests/test_control_scenarios.py) and
measured across them (lab/bench/control_grid.py).

The pod is the simulator's `EngineCore`; the router side is what the router runs every scrape
interval: `PodState.record` of a scrape (as `/v1/loads` reports it, the step profile and the
acceptance counters included), `control.step` (the router's control step), and a push of the
decided threshold. Closed-loop clients keep `concurrency` requests in flight; tests change the
concurrency and the workload's acceptance at chosen times and compare the tokens delivered
with the same run under a static mode (threshold None: always speculate; 0: never).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
from dataclasses import dataclass, field
from typing import Any, cast

from specgate import contract
from specgate.engine_client import EngineClient, EngineLoad
from specgate_router import control
from specgate_router.pods import PodState, Scrape
from specgate_router.settings import ControlSettings
from specgate_sim.engine import EngineCore, SimRequest
from specgate_sim.profile import Profile

SCRAPE_SECONDS = 0.5


@dataclass(frozen=True)
class Change:
    at: float
    concurrency: int | None = None
    acceptance: float | None = None  # per-token rate of the workload from here on
    host_speed: float | None = None
    """From here on every step takes 1 / host_speed of its time: a shared host that drifts
    (1.0: as profiled)."""


@dataclass
class Run:
    tokens: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) per step
    thresholds: list[tuple[float, int | None]] = field(default_factory=list)
    speculating: list[tuple[float, bool]] = field(default_factory=list)  # per scrape
    decisions: list[tuple[float, control.Decision]] = field(default_factory=list)
    """Per scrape, the controller's decision (its rule, detail, trial and readings)."""

    @property
    def reasons(self) -> list[tuple[float, str]]:
        return [(t, d.reason) for t, d in self.decisions]

    def rules(self, start: float = 0.0, end: float = float("inf")) -> list[control.Rule]:
        """The rules of the decisions made in [start, end), in order."""
        return [d.rule for t, d in self.decisions if start <= t < end]

    def tokens_between(self, start: float, end: float) -> int:
        return sum(n for t, n in self.tokens if start <= t < end)

    def mode_switches(self, start: float, end: float) -> int:
        modes = [s for t, s in self.speculating if start <= t < end]
        return sum(1 for a, b in itertools.pairwise(modes) if a != b)


def run(
    profile: Profile,
    changes: list[Change],
    *,
    seconds: float,
    threshold: int | None = 8,
    dynamic: bool = True,
    params: ControlSettings | None = None,
    off_step_tokens: int = 1,
    seed: int = 0,
    output_tokens: tuple[int, int] = (128, 384),
    prompt_tokens: tuple[int, int] = (128, 128),
    model_inputs: bool = True,
    profile_error: tuple[float, float] = (1.0, 1.0),
    off_agreement_factor: float = 1.0,
    tuning: control.Tuning = control.TUNING,
) -> Run:
    """`seconds` of virtual time; `changes` (sorted) set the load and the workload.

    What makes the pod's reports imperfect, as a GPU's are: `profile_error` scales the step
    profile the pod reports (speculating, off) against the steps it runs (a start-up profile
    taken on a busier or quieter GPU), and `off_agreement_factor` the draft's first-position
    agreement while off against a speculating step's first position."""
    params = params or ControlSettings(threshold=8 if threshold is None else threshold)
    core = EngineCore(profile, threshold=threshold, seed=seed, off_step_tokens=off_step_tokens)
    core.off_agreement_factor = off_agreement_factor
    rng = random.Random(seed + 1)
    view = PodState(
        name="pod-0",
        url="",
        client=cast(EngineClient, None),
        decision=control.initial_decision(params, now=0.0),
        healthy=True,
    )
    step_profile = None
    if model_inputs:
        step_profile = profile.step_profile(off_step_tokens, core.max_running)
        for mode, factor in zip(("on", "off"), profile_error, strict=True):
            step_profile[mode] = [[b, t * factor] for b, t in step_profile[mode]]
    out = Run()
    now, target, in_flight, issued = 0.0, 0, 0, 0
    speed = 1.0
    pending = sorted(changes, key=lambda c: c.at)

    def submit() -> None:
        nonlocal in_flight, issued
        issued += 1
        in_flight += 1
        prompt = (
            prompt_tokens[0]
            if prompt_tokens[0] == prompt_tokens[1]
            else rng.randint(*prompt_tokens)
        )
        request = SimRequest(f"r{issued}", prompt, rng.randint(*output_tokens), now)
        request.sink = on_tokens
        core.add(request)

    def on_tokens(n: int, done: bool) -> None:
        nonlocal in_flight
        if done:
            in_flight -= 1
            while in_flight < target:
                submit()

    events: list[tuple[float, int, str]] = []
    sequence = 0

    def schedule(at: float, kind: str) -> None:
        nonlocal sequence
        sequence += 1
        heapq.heappush(events, (at, sequence, kind))

    schedule(0.0, "scrape")
    step = None
    while now < seconds:
        if step is None and core.has_work():
            step = core.plan()
            if step is not None:
                if speed != 1.0:
                    step = dataclasses.replace(step, duration=step.duration / speed)
                schedule(now + step.duration, "step")
        at, _, kind = heapq.heappop(events)
        now = at
        while pending and pending[0].at <= now:
            change = pending.pop(0)
            if change.acceptance is not None:
                core.set_acceptance(change.acceptance)
            if change.host_speed is not None:
                speed = change.host_speed
            if change.concurrency is not None:
                target = change.concurrency
                while in_flight < target:
                    submit()
        if kind == "step":
            assert step is not None
            before = sum(r.generated for r, _ in step.tokens)
            core.finish(step, now)
            after = sum(r.generated for r, _ in step.tokens)
            out.tokens.append((now, after - before))
            step = None
        else:
            _scrape_and_decide(core, view, step_profile, params, now, dynamic, out, tuning)
            schedule(now + SCRAPE_SECONDS, "scrape")
    return out


def engine_load(
    core: EngineCore, step_profile: dict[str, list[list[float]]] | None = None
) -> EngineLoad:
    """What a scrape of the engine's /v1/loads gives the router, read straight off the core;
    with `step_profile`, the prediction's inputs too (contract.STEP_PROFILE)."""
    stats = core.stats
    return EngineLoad(
        running=len(core.running),
        waiting=len(core.waiting),
        max_running=core.max_running,
        threshold=core.threshold,
        threshold_known=True,
        speculating=core.speculating,
        decode_steps_on=stats.decode_steps_on,
        decode_steps_off=stats.decode_steps_off,
        decode_steps=stats.decode_moments[0],
        decode_batch_sum=stats.decode_moments[1],
        decode_tokens=stats.decode_moments[5],
        decode_step_us=stats.decode_moments[2],
        speculative={}
        if step_profile is None
        else {
            contract.STEP_PROFILE: step_profile,
            "num_steps": core.profile.num_steps,
            "off_step_tokens": core.off_step_tokens,
            **{name: getattr(stats, name) for name in contract.ACCEPTANCE_COUNTERS},
            **{name: getattr(stats, name) for name in contract.STEP_TIME_COUNTERS},
        },
    )


def _scrape_and_decide(
    core: EngineCore,
    view: PodState,
    step_profile: dict[str, list[list[float]]] | None,
    params: ControlSettings,
    now: float,
    dynamic: bool,
    out: Run,
    tuning: control.Tuning = control.TUNING,
) -> None:
    load = engine_load(core, step_profile)
    view.record(Scrape(at=now, load=load))
    out.speculating.append((now, core.speculating))
    if not dynamic:
        return
    (decision,) = control.step(
        [view.control_input(now, params)], now=now, params=params, tuning=tuning
    )
    view.decision = decision
    out.decisions.append((now, decision))
    if decision.threshold != core.threshold:
        core.set_threshold(decision.threshold)
        out.thresholds.append((now, decision.threshold))


def ratio_to_better_static(
    profile: Profile,
    changes: list[Change],
    *,
    seconds: float,
    window: tuple[float, float],
    seeds: tuple[int, ...] = (0,),
    **kw: Any,
) -> tuple[float, Run]:
    """Routed tokens in `window` over the better of always-on and always-off there, each
    summed over `seeds` (a small load delivers few requests in 30 s: more seeds, less noise).
    Returns the routed run of the first seed too."""
    routed_runs = [run(profile, changes, seconds=seconds, seed=s, **kw) for s in seeds]
    statics = [
        sum(
            run(
                profile, changes, seconds=seconds, threshold=t, dynamic=False, seed=s, **kw
            ).tokens_between(*window)
            for s in seeds
        )
        for t in (None, 0)
    ]
    routed = sum(r.tokens_between(*window) for r in routed_runs)
    return routed / max(statics), routed_runs[0]


__all__: list[str] = ["Change", "Run", "engine_load", "ratio_to_better_static", "run"]
