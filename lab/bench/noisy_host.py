"""The control policy on a noisy host: specgate against always-on and always-off on simulated
pods whose hosts have slow spells, side by side with the same pods on calm hosts.

On the H200 (lab/NOTEBOOK.md, jobs 57, 60, 94) a speculating server's windows fell into fast
and slow spells 1.5x apart, plain decoding's about 1.2x, for seconds at a time; one 3-second
probe in a slow spell read speculation at 0.69x the plain decoding it had been beating, and
the router stayed off. `specgate_sim.engine.HostSpells` puts such spells into the simulator:
here the host's part of a step takes three times as long in a slow spell (on the
`rtx-pro-6000-x8` profile that stretches a speculating step at batch 4 by 40% and a plain one
by 20%, the H200's asymmetry), spells lasting 4 s on average between fast ones of 6 s, every
pod's host its own.

Each load is a constant closed loop of latency and throughput clients, half each (the policy
benchmark's classes, `lab/bench/policy_at_scale.py`), at a few clients per pod below the
crossover, at it, just above it and far above it; the controller runs with the router's
defaults (probes every 600 s). Reported per host and load: delivered tokens of each policy,
specgate's over the better static policy, threshold pushes per pod per 10 minutes after the
first 5, and the share of decode steps that speculated.

    .venv/bin/python lab/bench/noisy_host.py [--pods 16] [--minutes 20] [--out lab/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specgate_sim.engine import HostSpells
from specgate_sim.profile import load

sys.path.insert(0, str(Path(__file__).resolve().parent))
import policy_at_scale as fleet

NOISY = HostSpells(slowdown=3.0, fast_seconds=6.0, slow_seconds=4.0)
HOSTS: dict[str, HostSpells | None] = {"calm": None, "noisy": NOISY}
CLIENTS_PER_POD = (2, 6, 8, 24)
"""Below the profile's crossover (a batch of 6), at it, just above it, and far above it."""
POLICIES = tuple(p for p in fleet.POLICIES if p.name in ("always-on", "always-off", "specgate"))
SETTLE_SECONDS = 300.0


def measure(pods: int, seconds: float, seed: int, progress: Any) -> list[dict[str, Any]]:
    profile = load(fleet.PROFILE)
    rows = []
    for host, spells in HOSTS.items():
        for per_pod in CLIENTS_PER_POD:
            half = per_pod * pods // 2
            load_at = fleet.constant(half, half)
            outcomes = {
                p.name: fleet.run(
                    profile, p, load_at, pods=pods, seconds=seconds, seed=seed, host_spells=spells
                )
                for p in POLICIES
            }
            ours = outcomes["specgate"]
            tokens = {name: sum(o.tokens.values()) for name, o in outcomes.items()}
            best = max(("always-on", "always-off"), key=tokens.__getitem__)
            row = {
                "host": host,
                "clients_per_pod": per_pod,
                "tokens": tokens,
                "better_static": best,
                "specgate_over_better_static": round(tokens["specgate"] / tokens[best], 3),
                "static_ratio_on_over_off": round(tokens["always-on"] / tokens["always-off"], 3),
                "pushes_per_pod_per_10min_after_settle": round(
                    ours.pushes_per_pod_per_10min(after=SETTLE_SECONDS), 3
                ),
                "specgate_speculating_step_share": round(
                    ours.steps_on / max(1, ours.steps_on + ours.steps_off), 3
                ),
                "specgate_latency_tpot_p99_ms": ours.summary()["latency_tpot_p99_ms"],
            }
            rows.append(row)
            progress(
                f"{host} host, {per_pod} clients a pod: specgate "
                f"{row['specgate_over_better_static']} of {best}, "
                f"{row['pushes_per_pod_per_10min_after_settle']} pushes"
            )
    return rows


def render(result: dict[str, Any]) -> str:
    header = (
        "host",
        "clients a pod",
        "always-on / always-off",
        "better static",
        "specgate / better static",
        "pushes a pod per 10 min (after 5 min)",
        "specgate's speculating steps",
        "latency TPOT p99 ms",
    )
    rows = [
        (
            r["host"],
            r["clients_per_pod"],
            r["static_ratio_on_over_off"],
            r["better_static"],
            r["specgate_over_better_static"],
            r["pushes_per_pod_per_10min_after_settle"],
            r["specgate_speculating_step_share"],
            r["specgate_latency_tpot_p99_ms"],
        )
        for r in result["rows"]
    ]
    spells = result["noisy_host"]
    return (
        f"# Policy on a noisy host ({result['date']})\n\n"
        f"{result['pods']} pods of `{result['profile']}`, {result['minutes']:g} virtual "
        f"minutes a run, seed {result['seed']}; noisy: the host's part of a step "
        f"{spells['slowdown']:g}x in slow spells of {spells['slow_seconds']:g} s on average "
        f"between fast ones of {spells['fast_seconds']:g} s.\n\n"
        + fleet.table(rows, header)
        + f"\n\n`{result['command']}` ({result['wall_seconds']:.0f} s)\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=16)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=8)
    parser.add_argument("--out", default="lab/results")
    args = parser.parse_args(argv)
    if args.pods < 2 or args.minutes * 60 <= SETTLE_SECONDS:
        parser.error(f"--pods at least 2 and --minutes above {SETTLE_SECONDS / 60:g}")
    started = time.time()

    def progress(msg: str) -> None:
        print(f"[{time.time() - started:6.0f}s] {msg}", file=sys.stderr, flush=True)

    rows = measure(args.pods, args.minutes * 60, args.seed, progress)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "profile": fleet.PROFILE,
        "pods": args.pods,
        "minutes": args.minutes,
        "seed": args.seed,
        "noisy_host": dataclasses.asdict(NOISY),
        "command": "lab/bench/noisy_host.py " + " ".join(argv or sys.argv[1:]),
        "rows": rows,
        "wall_seconds": round(time.time() - started, 1),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "noisy_host.json").write_text(json.dumps(result, indent=1) + "\n")
    report = render(result)
    (out / "noisy_host.md").write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
