"""What one control step costs the router, per pod, at 1, 16 and 64 pods.

Each pod is the simulator's engine (`EngineCore`) in virtual time, reporting what the patched
engine reports (`virtual.engine_load`: step profile and acceptance counters; with
`--without-profile`, neither, so the law fits its rates from the pods' samples), read by the
router's own `PodState.record` every 0.5 s of virtual time. Pods hold loads from 1 to 96
requests (closed loop) with acceptance from 0.5 to 0.95 per token, different per pod, so that
some run trials, some hold and some move. After a minute of warm-up, the wall time of
`control.step` over every pod is measured for the next minute (120 steps) on this machine:
per step, per pod per step, and the longest one pod's turn takes (`control.each_decision`:
the router's event loop runs other work between turns, so that is the longest it waits).

    .venv/bin/python lab/bench/control_cost.py [--pods 1,16,64] [--without-profile]
        [--out lab/results]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, cast

from specgate.engine_client import EngineClient
from specgate_router import control
from specgate_router.pods import PodState, Scrape
from specgate_router.settings import ControlSettings
from specgate_sim import profile as profiles
from specgate_sim.engine import EngineCore, SimRequest
from specgate_sim.virtual import engine_load

RESULTS = Path(__file__).resolve().parent.parent / "results"
SCRAPE = 0.5
LOADS = (1, 4, 8, 16, 24, 32, 48, 64, 96)
RATES = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


class Pod:
    """One simulated engine with closed-loop clients, stepped to a given virtual time."""

    def __init__(self, index: int, profile: profiles.Profile, report_profile: bool) -> None:
        self.rng = random.Random(index)
        self.core = EngineCore(profile, threshold=8, seed=index)
        self.core.set_acceptance(RATES[index % len(RATES)])
        self.clients = LOADS[(index * 5) % len(LOADS)]
        self.step_profile = (
            profile.step_profile(1, self.core.max_running) if report_profile else None
        )
        self.view = PodState(
            name=f"pod-{index:02d}", url="", client=cast(EngineClient, None),
            decision=control.initial_decision(ControlSettings(), 0.0), healthy=True,
        )  # fmt: skip
        self.now = 0.0
        self.pending: Any = None  # a planned step not yet finished
        self.issued = 0
        for _ in range(self.clients):
            self.submit()

    def submit(self) -> None:
        self.issued += 1
        request = SimRequest(f"r{self.issued}", 128, self.rng.randint(64, 256), self.now)
        request.sink = lambda n, done: self.submit() if done else None
        self.core.add(request)

    def advance(self, until: float) -> None:
        while True:
            if self.pending is None:
                self.pending = self.core.plan()
            if self.pending is None or self.now + self.pending.duration > until:
                break
            self.now += self.pending.duration
            step, self.pending = self.pending, None
            self.core.finish(step, self.now)

    def scrape(self, now: float) -> None:
        self.view.record(Scrape(now, engine_load(self.core, self.step_profile)))


def measure(n: int, report_profile: bool, params: ControlSettings) -> dict[str, Any]:
    profile = profiles.load("h200-3b-synthetic-deployed")
    pods = [Pod(i, profile, report_profile) for i in range(n)]
    timings: list[float] = []
    longest: list[float] = []
    rules: dict[str, int] = {}
    now = 0.0
    for tick in range(240):
        now = (tick + 1) * SCRAPE
        for pod in pods:
            pod.advance(now)
            pod.scrape(now)
        inputs = [pod.view.control_input(now, params) for pod in pods]
        decisions: list[Any] = [None] * n
        slices = []  # what the router's loop waits between its pauses: one pod's turn
        started = mark = time.perf_counter()
        for i, decision in control.each_decision(inputs, now=now, params=params):
            decisions[i] = decision
            slices.append(time.perf_counter() - mark)
            mark = time.perf_counter()
        elapsed = mark - started
        for pod, decision in zip(pods, decisions, strict=True):
            pod.view.decision = decision
            if decision.threshold != pod.core.threshold:
                pod.core.set_threshold(decision.threshold)
        if tick >= 120:
            timings.append(elapsed)
            longest.append(max(slices))
            for d in decisions:
                rules[str(d.rule)] = rules.get(str(d.rule), 0) + 1
    ordered = sorted(timings)
    return {
        "pods": n,
        "profile": report_profile,
        "step_ms_median": round(statistics.median(ordered) * 1e3, 3),
        "step_ms_p99": round(ordered[int(0.99 * (len(ordered) - 1))] * 1e3, 3),
        "per_pod_ms_median": round(statistics.median(ordered) * 1e3 / n, 4),
        "per_pod_ms_p99": round(ordered[int(0.99 * (len(ordered) - 1))] * 1e3 / n, 4),
        "longest_turn_ms_median": round(statistics.median(longest) * 1e3, 3),
        "longest_turn_ms_p99": round(sorted(longest)[int(0.99 * (len(longest) - 1))] * 1e3, 3),
        "rules": dict(sorted(rules.items())),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", default="1,16,64")
    parser.add_argument("--without-profile", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    params = ControlSettings()
    rows = []
    for n in (int(p) for p in args.pods.split(",")):
        row = measure(n, not args.without_profile, params)
        rows.append(row)
        print(
            f"{n:3d} pods: control step {row['step_ms_median']:.2f} ms median,"
            f" {row['step_ms_p99']:.2f} ms p99; per pod {row['per_pod_ms_median']:.3f} ms"
            f" median, {row['per_pod_ms_p99']:.3f} ms p99; longest pod's turn"
            f" {row['longest_turn_ms_median']:.3f} ms median, {row['longest_turn_ms_p99']:.3f} ms"
            f" p99; rules {row['rules']}",
            flush=True,
        )
    lines = [
        "| pods | engine reports a profile | step median | step p99 | per pod median |"
        " per pod p99 | longest turn median | longest turn p99 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['pods']} | {'yes' if r['profile'] else 'no'} | {r['step_ms_median']:.2f} ms"
        f" | {r['step_ms_p99']:.2f} ms | {r['per_pod_ms_median']:.3f} ms"
        f" | {r['per_pod_ms_p99']:.3f} ms | {r['longest_turn_ms_median']:.3f} ms"
        f" | {r['longest_turn_ms_p99']:.3f} ms |"
        for r in rows
    ]
    table = "\n".join(lines)
    print("\n" + table)
    stem = "control_cost" + ("-without-profile" if args.without_profile else "")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.md").write_text(table + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
