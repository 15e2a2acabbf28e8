"""Policy at scale: specgate's speculation control against static configurations, on the
simulator in virtual time.

A fleet of simulated pods (`specgate_sim.engine.EngineCore`, the same step machine the HTTP
pods serve, on the `rtx-pro-6000-x8` profile) behind the router's own decision code: the
pods' `PodState` views fed by scrapes every 0.5 s (`PodState.record`), the router's control
step (`control.step`: the pods report no step profile, so the law reads its rates from their
pooled samples), the latency/throughput pools (`control.pools.plan_latency_pool`) and
placement (`placement.choose`). Only the transport is left
out: a scrape reads the engine's counters directly and a threshold push lands at once (pushes
to different pods are still staggered as the router staggers them). Virtual time, so a
30-minute trace takes minutes, not hours, and the result does not depend on this machine.

Clients are closed-loop per class: `latency` (512-token prompts, 192 new tokens, TPOT SLO 15 ms)
and `throughput` (1024-token prompts, 512 new tokens, TPOT SLO 100 ms). A client sends its next
request as soon as the last one returns; the client count per class follows the scenario.

Policies:
  always-on   every pod speculates at every batch size; least-load routing
  always-off  no pod speculates; least-load routing
  fixed-8     upstream-style fixed threshold 8 on every pod; least-load routing
  specgate    dynamic per-pod thresholds, class pools and class-aware placement; told the
              latency class's SLO as its TPOT target (spec.router.pools.latencyTpotTargetMs)

Scenarios:
  diurnal     one day compressed into --minutes, over --pods pods: clients per pod from about
              0.5 at night to 26 at the peak, the latency share falling from 60% to 15%.
              Reports delivered tokens, latency TPOT p99, threshold pushes per pod per 10
              minutes, and the ratio to the per-window oracle (in each 30 s window, the
              static policy that delivered the most tokens in it).
  stationary  constant load at the crossover (6 clients per pod): threshold pushes per pod per
              10 minutes once the controller has settled.
  mixed       2 pods, 4 latency + 24 throughput clients: goodput (requests per second that
              met their class's TPOT SLO) of specgate against the best static policy.

    .venv/bin/python lab/bench/policy_at_scale.py [--pods 64] [--minutes 30] [--out lab/results]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from specgate.api import RouterPlugins, WeightedScorer
from specgate.engine_client import EngineClient
from specgate_router import control, placement
from specgate_router.control import pools as pools_
from specgate_router.pods import PodState, Scrape
from specgate_router.settings import (
    ControlSettings,
    PoolSettings,
    RouterSettings,
    TrafficClass,
)
from specgate_sim.engine import EngineCore, HostSpells, SimRequest
from specgate_sim.profile import Profile, load
from specgate_sim.virtual import engine_load

PROFILE = "rtx-pro-6000-x8"
SCRAPE_SECONDS = 0.5
WINDOW_SECONDS = 30.0


@dataclass(frozen=True)
class RequestShape:
    prompt_tokens: int
    new_tokens: int
    tpot_slo_s: float


SHAPES: dict[TrafficClass, RequestShape] = {
    "latency": RequestShape(512, 192, 0.015),
    "throughput": RequestShape(1024, 512, 0.100),
}


@dataclass(frozen=True)
class Policy:
    name: str
    threshold: int | None  # what every pod starts with (None: always speculate)
    dynamic: bool  # specgate's threshold controller and class pools
    description: str
    probe_interval: float = 0.0  # the controller's probeIntervalSeconds (0: no trials)


POLICIES = (
    Policy("always-on", None, False, "speculate at every batch size"),
    Policy("always-off", 0, False, "never speculate"),
    Policy("fixed-8", 8, False, "upstream-style fixed threshold 8"),
    Policy("specgate", 8, True, "dynamic thresholds, class pools, class-aware placement"),
)
STATIC = ("always-on", "always-off", "fixed-8")
MIXED_AT_SCALE = ((8, 8, 64), (8, 16, 96), (16, 32, 192))
"""(pods, latency clients, throughput clients) for the mixed comparison beyond two pods."""

Load = Callable[[float], dict[TrafficClass, int]]
"""Clients per class wanted at a virtual time."""


@dataclass
class Outcome:
    """What one policy did over one scenario."""

    policy: str
    seconds: float
    pods: int
    tokens_by_window: list[float] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=lambda: {"latency": 0, "throughput": 0})
    tpot: dict[str, list[float]] = field(default_factory=lambda: {"latency": [], "throughput": []})
    good_requests: dict[str, int] = field(default_factory=lambda: {"latency": 0, "throughput": 0})
    requests: dict[str, int] = field(default_factory=lambda: {"latency": 0, "throughput": 0})
    pushes: list[tuple[float, str, int | None]] = field(default_factory=list)
    thresholds_over_time: list[tuple[float, float]] = field(default_factory=list)
    steps_on: int = 0
    steps_off: int = 0
    control_seconds: list[float] = field(default_factory=list)
    """Wall time of each control step (pooling samples and deciding for every pod)."""

    def tpot_p99_ms(self, cls: str) -> float | None:
        values = sorted(self.tpot[cls])
        if not values:
            return None
        return 1000 * values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]

    def pushes_per_pod_per_10min(self, after: float = 0.0) -> float:
        n = sum(1 for at, _, _ in self.pushes if at >= after)
        return n / self.pods / max(1e-9, (self.seconds - after) / 600)

    def goodput_rps(self) -> float:
        return sum(self.good_requests.values()) / self.seconds

    def summary(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "tokens": sum(self.tokens.values()),
            "tokens_by_class": self.tokens,
            "latency_tpot_p99_ms": _round(self.tpot_p99_ms("latency")),
            "throughput_tpot_p99_ms": _round(self.tpot_p99_ms("throughput")),
            "goodput_rps": round(self.goodput_rps(), 3),
            "requests": self.requests,
            "good_requests": self.good_requests,
            "pushes_per_pod_per_10min": round(self.pushes_per_pod_per_10min(), 2),
            "speculating_step_share": round(
                self.steps_on / max(1, self.steps_on + self.steps_off), 3
            ),
            "control_step_ms_p50": _round(_quantile(self.control_seconds, 0.5, 1000)),
            "control_step_ms_max": _round(max(self.control_seconds, default=0) * 1000 or None),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def _quantile(values: Sequence[float], q: float, scale: float = 1.0) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return scale * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Fleet:
    """Pods and the router's view of them, stepped in virtual time."""

    def __init__(
        self,
        profile: Profile,
        pods: int,
        policy: Policy,
        seed: int,
        pools: PoolSettings | None = None,
        host_spells: HostSpells | None = None,
    ) -> None:
        self.policy = policy
        self.control = ControlSettings(
            threshold=8 if policy.threshold is None else policy.threshold,
            probe_interval_seconds=policy.probe_interval,
        )
        if not policy.dynamic:
            self.control = self.control.model_copy(
                update={"mode": {None: "alwaysOn", 0: "off"}.get(policy.threshold, "dynamic")}
            )
        # Static baselines get a plain least-load balancer; specgate its class-aware placement.
        plugins = RouterPlugins()
        if not policy.dynamic:
            plugins = RouterPlugins(scorers=[WeightedScorer(name="load", weight=1.0)])
        self.settings = RouterSettings(
            backends=["http://sim"],
            control=self.control,
            plugins=plugins,
            pools=pools or self.default_pools(policy),
        )
        self.cores = [
            EngineCore(
                profile, threshold=policy.threshold, seed=seed * 1000 + i, host_spells=host_spells
            )
            for i in range(pods)
        ]
        decision = control.initial_decision(self.control, now=0.0)
        # The transport (EngineClient) is what this benchmark leaves out.
        no_client = cast(EngineClient, None)
        self.views = [
            PodState(name=f"pod-{i:02d}", url="", client=no_client, decision=decision, healthy=True)
            for i in range(pods)
        ]
        self.rng = random.Random(seed)
        self.events: list[tuple[float, int, int]] = []  # (step end, sequence, pod)
        self.planned: list[Any] = [None] * pods
        self.sequence = 0
        self.now = 0.0
        self.latency_pool: set[str] = set()
        self.class_load: dict[TrafficClass, float] = {"latency": 0.0, "throughput": 0.0}
        self.in_flight: dict[TrafficClass, int] = {"latency": 0, "throughput": 0}
        self.last_push_at = -math.inf

    @staticmethod
    def default_pools(policy: Policy) -> PoolSettings:
        # specgate is told the latency class's SLO, as a deployment would set
        # spec.router.pools.latencyTpotTargetMs; static policies have no pools.
        if not policy.dynamic:
            return PoolSettings()
        return PoolSettings(latency_tpot_target_ms=SHAPES["latency"].tpot_slo_s * 1000)

    # ---- requests ----

    def dispatch(self, request: SimRequest, cls: TrafficClass) -> None:
        ctx = placement.Context(traffic_class=cls, now=self.now, settings=self.settings)
        chosen = placement.choose(self.views, ctx, rng=self.rng)
        assert isinstance(chosen, PodState), chosen  # pods never go unhealthy here
        i = int(chosen.name.removeprefix("pod-"))
        chosen.dispatched_since_scrape += 1
        self.in_flight[cls] += 1
        self.cores[i].add(request)
        if self.planned[i] is None:
            self._plan(i)

    def _plan(self, i: int) -> None:
        step = self.cores[i].plan()
        self.planned[i] = step
        if step is not None:
            self.sequence += 1
            heapq.heappush(self.events, (self.now + step.duration, self.sequence, i))

    def advance(self, until: float) -> None:
        while self.events and self.events[0][0] <= until:
            end, _, i = heapq.heappop(self.events)
            self.now = end
            step, self.planned[i] = self.planned[i], None
            self.cores[i].finish(step, end)
            if self.planned[i] is None:  # a sink may have planned it already
                self._plan(i)
        self.now = until

    # ---- the router's loop ----

    def scrape_and_control(self, outcome: Outcome) -> None:
        now = self.now
        for core, view in zip(self.cores, self.views, strict=True):
            # No step profile: the law reads its rates from the pods' samples.
            load = engine_load(core)
            view.record(Scrape(at=now, load=load))
        if not self.policy.dynamic:
            return
        started = time.perf_counter()
        samples = control.pool_samples([view.samples for view in self.views])
        self._update_pools(now, samples)
        decisions = control.step(
            [view.control_input(now, self.control) for view in self.views],
            now=now,
            params=self.control,
        )
        for view, decision in zip(self.views, decisions, strict=True):
            view.decision = decision
        outcome.control_seconds.append(time.perf_counter() - started)
        for core, view in zip(self.cores, self.views, strict=True):
            if view.decision.threshold == core.threshold:
                continue
            if now - self.last_push_at < self.control.stagger_seconds:
                break  # the router staggers pushes to different pods
            core.set_threshold(view.decision.threshold)
            self.last_push_at = now
            outcome.pushes.append((now, view.name, view.decision.threshold))
        known = [c.threshold for c in self.cores if c.threshold is not None]
        outcome.thresholds_over_time.append((now, statistics.median(known) if known else -1))

    def _update_pools(self, now: float, samples: Sequence[control.Sample]) -> None:
        tau = self.settings.pools.class_mix_window_seconds
        alpha = min(1.0, SCRAPE_SECONDS / tau)
        for cls in self.class_load:
            self.class_load[cls] += alpha * (self.in_flight[cls] - self.class_load[cls])
        pools = self.settings.pools
        thresholds = [c.threshold for c in self.cores if c.threshold is not None]
        pool = pools_.plan_latency_pool(
            [v.name for v in self.views],
            thresholds,
            latency_load=self.class_load["latency"],
            throughput_load=self.class_load["throughput"],
            previous=self.latency_pool,
            default_threshold=self.control.threshold,
            min_fraction=pools.min_latency_fraction,
            max_fraction=pools.max_latency_fraction,
            throughput_batch_per_pod=pools.throughput_batch_per_pod,
            latency_batch=pools_.latency_batch_for_target(
                samples,
                thresholds,
                target_ms=pools.latency_tpot_target_ms,
                now=now,
                min_samples=self.control.min_samples,
            ),
        )
        self.latency_pool = pool or set()
        for view in self.views:
            view.pool = (
                "mixed" if pool is None else "latency" if view.name in pool else "throughput"
            )


def run(
    profile: Profile,
    policy: Policy,
    load_at: Load,
    *,
    pods: int,
    seconds: float,
    seed: int,
    progress: Callable[[str], None] | None = None,
    pools: PoolSettings | None = None,
    host_spells: HostSpells | None = None,
) -> Outcome:
    """One policy over one scenario; closed-loop clients follow `load_at`; every pod's host
    has `host_spells` (each its own)."""
    fleet = Fleet(profile, pods, policy, seed, pools, host_spells)
    outcome = Outcome(policy.name, seconds, pods)
    active: dict[TrafficClass, int] = {"latency": 0, "throughput": 0}
    window_tokens = [0.0]
    issued = 0

    def submit(cls: TrafficClass) -> None:
        nonlocal issued
        issued += 1
        shape = SHAPES[cls]
        request = SimRequest(f"{cls[0]}{issued}", shape.prompt_tokens, shape.new_tokens, fleet.now)
        active[cls] += 1

        def sink(n: int, done: bool) -> None:
            window_tokens[-1] += n
            outcome.tokens[cls] += n
            if not done:
                return
            fleet.in_flight[cls] -= 1
            active[cls] -= 1
            outcome.requests[cls] += 1
            assert request.first_token_at is not None and request.finished_at is not None
            tpot = (request.finished_at - request.first_token_at) / max(1, request.generated - 1)
            outcome.tpot[cls].append(tpot)
            if tpot <= shape.tpot_slo_s:
                outcome.good_requests[cls] += 1
            top_up()

        request.sink = sink
        fleet.dispatch(request, cls)

    def top_up() -> None:
        wanted = load_at(fleet.now)
        classes: tuple[TrafficClass, ...] = ("latency", "throughput")
        for cls in classes:
            while active[cls] < wanted[cls]:
                submit(cls)

    t = 0.0
    next_window = WINDOW_SECONDS
    while t < seconds:
        top_up()
        t = min(seconds, t + SCRAPE_SECONDS)
        fleet.advance(t)
        fleet.scrape_and_control(outcome)
        if t >= next_window - 1e-9:
            outcome.tokens_by_window.append(window_tokens[-1])
            window_tokens.append(0.0)
            next_window += WINDOW_SECONDS
            if progress and len(outcome.tokens_by_window) % 10 == 0:
                progress(f"{policy.name}: {t / 60:.1f} of {seconds / 60:.1f} virtual minutes")
    outcome.steps_on = sum(c.stats.decode_steps_on for c in fleet.cores)
    outcome.steps_off = sum(c.stats.decode_steps_off for c in fleet.cores)
    return outcome


# ---- scenarios ----


def diurnal(pods: int, seconds: float) -> Load:
    """One day compressed into `seconds`: night at the start and end, the peak in the middle."""

    def load_at(t: float) -> dict[TrafficClass, int]:
        day = 0.5 - 0.5 * math.cos(2 * math.pi * t / seconds)  # 0 at night, 1 at the peak
        per_pod = 0.5 + 25.5 * day**1.5
        latency_share = 0.6 - 0.45 * day
        latency = round(pods * per_pod * latency_share)
        return {"latency": latency, "throughput": round(pods * per_pod) - latency}

    return load_at


def constant(latency: int, throughput: int) -> Load:
    def load_at(t: float) -> dict[TrafficClass, int]:
        return {"latency": latency, "throughput": throughput}

    return load_at


def oracle_ratio(outcomes: dict[str, Outcome], name: str) -> tuple[float, list[float]]:
    """Tokens of `name` over the per-window oracle: the best static policy in each window."""
    windows = len(outcomes[name].tokens_by_window)
    oracle = [max(outcomes[s].tokens_by_window[w] for s in STATIC) for w in range(windows)]
    return sum(outcomes[name].tokens_by_window) / max(1.0, sum(oracle)), oracle


# ---- report ----


def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join("—" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def plot(outcomes: dict[str, Outcome], oracle: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    minutes = [(w + 1) * WINDOW_SECONDS / 60 for w in range(len(oracle))]
    for name, outcome in outcomes.items():
        rate = [v / WINDOW_SECONDS for v in outcome.tokens_by_window]
        top.plot(minutes, rate, label=name, linewidth=2.2 if name == "specgate" else 1.2)
    top.plot(minutes, [v / WINDOW_SECONDS for v in oracle], "k:", label="per-window oracle")
    top.set_ylabel("fleet output tok/s")
    top.set_title("Diurnal trace: delivered tokens per 30 s window")
    top.legend(fontsize=8)
    series = outcomes["specgate"].thresholds_over_time
    bottom.plot([t / 60 for t, _ in series], [v for _, v in series], color="tab:red")
    bottom.set_ylabel("specgate median threshold")
    bottom.set_xlabel("virtual minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=64)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--stationary-minutes", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", default="lab/results")
    parser.add_argument(
        "--probe-interval",
        type=float,
        default=ControlSettings().probe_interval_seconds,
        help="specgate's probeIntervalSeconds (0: no trials; default: the router's)",
    )
    args = parser.parse_args(argv)
    policies = [
        replace(p, probe_interval=args.probe_interval) if p.dynamic else p for p in POLICIES
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = load(PROFILE)
    started = time.time()

    def progress(msg: str) -> None:
        print(f"[{time.time() - started:6.0f}s] {msg}", file=sys.stderr, flush=True)

    seconds = args.minutes * 60
    diurnal_load = diurnal(args.pods, seconds)
    outcomes = {
        p.name: run(
            profile,
            p,
            diurnal_load,
            pods=args.pods,
            seconds=seconds,
            seed=args.seed,
            progress=progress,
        )
        for p in policies
    }
    ratio, oracle = oracle_ratio(outcomes, "specgate")

    stationary_seconds = args.stationary_minutes * 60
    stationary = run(
        profile,
        policies[3],
        constant(3 * args.pods, 3 * args.pods),
        pods=args.pods,
        seconds=stationary_seconds,
        seed=args.seed + 1,
        progress=progress,
    )
    settle = min(300.0, stationary_seconds / 2)

    mixed = {
        p.name: run(profile, p, constant(4, 24), pods=2, seconds=600, seed=args.seed + 2)
        for p in policies
    }
    best_static = max(STATIC, key=lambda s: mixed[s].goodput_rps())
    mixed_ratio = mixed["specgate"].goodput_rps() / max(1e-9, mixed[best_static].goodput_rps())
    # The same comparison on larger fleets and heavier latency shares: where it stops holding.
    mixed_scale = []
    for pods, latency, throughput in MIXED_AT_SCALE:
        runs = {
            p.name: run(
                profile,
                p,
                constant(latency, throughput),
                pods=pods,
                seconds=300,
                seed=args.seed + 3,
            )
            for p in policies
        }
        best = max(STATIC, key=lambda s: runs[s].goodput_rps())
        ours = runs["specgate"]
        mixed_scale.append(
            {
                "pods": pods,
                "latency_clients": latency,
                "throughput_clients": throughput,
                "best_static": best,
                "specgate_goodput_over_best_static": round(
                    ours.goodput_rps() / max(1e-9, runs[best].goodput_rps()), 3
                ),
                "specgate_latency_within_slo": round(
                    ours.good_requests["latency"] / max(1, ours.requests["latency"]), 3
                ),
                "specgate_latency_tpot_p99_ms": _round(ours.tpot_p99_ms("latency")),
            }
        )
        progress(f"mixed at {pods} pods: {mixed_scale[-1]['specgate_goodput_over_best_static']}")

    result = {
        "date": time.strftime("%Y-%m-%d"),
        "profile": PROFILE,
        "command": "lab/bench/policy_at_scale.py " + " ".join(argv or sys.argv[1:]),
        "diurnal": {
            "pods": args.pods,
            "minutes": args.minutes,
            "policies": {n: o.summary() for n, o in outcomes.items()},
            "specgate_over_oracle": round(ratio, 3),
            "oracle_tokens": round(sum(oracle)),
            "window_seconds": WINDOW_SECONDS,
            "tokens_by_window": {
                n: [round(v) for v in o.tokens_by_window] for n, o in outcomes.items()
            },
            "oracle_by_window": [round(v) for v in oracle],
        },
        "stationary": {
            "pods": args.pods,
            "minutes": args.stationary_minutes,
            "clients_per_pod": 6,
            "settle_seconds": settle,
            "pushes_per_pod_per_10min_after_settle": round(
                stationary.pushes_per_pod_per_10min(after=settle), 3
            ),
            "pushes_per_pod_per_10min_all": round(stationary.pushes_per_pod_per_10min(), 3),
            "final_median_threshold": stationary.thresholds_over_time[-1][1],
        },
        "mixed": {
            "pods": 2,
            "clients": {"latency": 4, "throughput": 24},
            "policies": {n: o.summary() for n, o in mixed.items()},
            "best_static": best_static,
            "specgate_goodput_over_best_static": round(mixed_ratio, 3),
        },
        "mixed_at_scale": mixed_scale,
        "wall_seconds": round(time.time() - started, 1),
    }
    (out / "policy_at_scale.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(outcomes, oracle, out / "policy_at_scale.png")
    report = render(result)
    (out / "policy_at_scale.md").write_text(report)
    print(report)
    return 0


def render(result: dict[str, Any]) -> str:
    d, s, m = result["diurnal"], result["stationary"], result["mixed"]
    ours = d["policies"]["specgate"]
    rows = [
        (
            name,
            p["tokens"],
            p["latency_tpot_p99_ms"],
            p["throughput_tpot_p99_ms"],
            p["speculating_step_share"],
            p["pushes_per_pod_per_10min"],
        )
        for name, p in d["policies"].items()
    ]
    mixed_rows = [
        (
            name,
            p["goodput_rps"],
            p["good_requests"]["latency"],
            p["requests"]["latency"],
            p["good_requests"]["throughput"],
            p["requests"]["throughput"],
            p["latency_tpot_p99_ms"],
            p["tokens"],
        )
        for name, p in m["policies"].items()
    ]
    diurnal_header = [
        "policy",
        "delivered tokens",
        "latency TPOT p99 ms",
        "throughput TPOT p99 ms",
        "speculating step share",
        "threshold pushes / pod / 10 min",
    ]
    mixed_header = [
        "policy",
        "goodput req/s",
        "latency good",
        "latency done",
        "throughput good",
        "throughput done",
        "latency TPOT p99 ms",
        "tokens",
    ]
    parts = [
        f"# Policy at scale ({result['date']}, profile {result['profile']}, virtual time)",
        f"Command: `.venv/bin/python {result['command'].strip()}` "
        f"({result['wall_seconds']} s of wall time)",
        f"## Diurnal trace: {d['pods']} pods, {d['minutes']:g} virtual minutes",
        table(rows, diurnal_header),
        "specgate / per-window oracle (best static policy in each 30 s window): "
        f"**{d['specgate_over_oracle']}** (target >= 0.95)",
        f"The router's control step for all {d['pods']} pods (pooling samples, deciding every "
        f"pod's threshold) took {ours['control_step_ms_p50']} ms at the median and "
        f"{ours['control_step_ms_max']} ms at most on this machine's CPU, once per "
        f"{SCRAPE_SECONDS} s scrape.",
        f"## Stationary load at the crossover: {s['pods']} pods x {s['clients_per_pod']} "
        f"clients, {s['minutes']:g} virtual minutes",
        "Threshold pushes per pod per 10 minutes after the first "
        f"{s['settle_seconds']:g} s: **{s['pushes_per_pod_per_10min_after_settle']}** "
        f"(target <= 2; over the whole run {s['pushes_per_pod_per_10min_all']}); median "
        f"threshold at the end {s['final_median_threshold']}.",
        "## Mixed traffic on 2 pods: 4 latency + 24 throughput clients, 10 virtual minutes",
        table(mixed_rows, mixed_header),
        "Goodput counts requests that met their class's TPOT SLO (latency 15 ms, throughput "
        f"100 ms). specgate / best static ({m['best_static']}): "
        f"**{m['specgate_goodput_over_best_static']}** (target >= 1.05)",
        "The same comparison on larger fleets (5 virtual minutes each):",
        table(
            [
                (
                    r["pods"],
                    r["latency_clients"],
                    r["throughput_clients"],
                    r["best_static"],
                    r["specgate_goodput_over_best_static"],
                    r["specgate_latency_within_slo"],
                    r["specgate_latency_tpot_p99_ms"],
                )
                for r in result.get("mixed_at_scale", [])
            ],
            [
                "pods",
                "latency clients",
                "throughput clients",
                "best static",
                "specgate / best static",
                "specgate latency within SLO",
                "specgate latency TPOT p99 ms",
            ],
        ),
    ]
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.exit(main())
