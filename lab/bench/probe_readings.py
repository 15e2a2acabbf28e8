"""How far trials read from the modes as they run steadily, on random engines.

For each scenario of `control_random.py` (an engine, a workload and one change, drawn from
its seed), the routed run's trial readings after the change (speculation over plain decoding
as each trial's samples read it, before it is weighed against the model) against the ratio
of the two static runs over the measured 30 s: the mean of log(reading / steady), its mean
absolute value, and how many readings put the slower mode ahead where the steady runs differ
by more than 3%.

    .venv/bin/python lab/bench/probe_readings.py [--seed S] [--scenarios N] [--jobs J]

Prints one line per scenario with a verdict as it ends, then the summary.
"""

from __future__ import annotations

import argparse
import math
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from control_random import draw

from specgate_router.settings import ControlSettings
from specgate_sim.profile import Profile
from specgate_sim.virtual import Change, run

CHANGE_AT = 60.0
WINDOW = (90.0, 120.0)


def readings(seed: int) -> tuple[int, list[float], float]:
    """(seed, the verdicts after the change as speculation over plain, the steady ratio)."""
    scenario = draw(seed)
    profile = Profile.model_validate(scenario["profile"])
    changes = [
        Change(0, concurrency=scenario["c_before"], acceptance=scenario["rate_before"]),
        Change(CHANGE_AT, concurrency=scenario["c_after"], acceptance=scenario["rate_after"]),
    ]
    kw: dict[str, Any] = {
        "seconds": WINDOW[1],
        "off_step_tokens": scenario["off_step_tokens"],
        "params": ControlSettings(),
        "output_tokens": tuple(scenario["output_tokens"]),
        "prompt_tokens": tuple(scenario["prompt_tokens"]),
        "profile_error": tuple(scenario["profile_error"]),
        "off_agreement_factor": scenario["off_agreement_factor"],
    }
    routed = run(profile, changes, **kw)
    found = []
    seen: set[float] = set()
    for _, decision in routed.decisions:
        for reading in decision.readings:
            if reading.tried and reading.at > CHANGE_AT and reading.at not in seen:
                seen.add(reading.at)
                assert decision.model is not None
                model = decision.model.corrected(reading.measured, reading.between)
                found.append(model.ratio(reading.batch) or 1.0)
    if not found:
        return seed, [], math.nan
    on = run(profile, changes, threshold=None, dynamic=False, **kw).tokens_between(*WINDOW)
    off = run(profile, changes, threshold=0, dynamic=False, **kw).tokens_between(*WINDOW)
    return seed, found, on / max(1, off)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1000, help="the first scenario's seed")
    parser.add_argument("--scenarios", type=int, default=100)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    errors: list[float] = []
    wrong = 0
    seeds = range(args.seed, args.seed + args.scenarios)
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for seed, found, steady in pool.map(readings, seeds):
            for reading in found:
                errors.append(math.log(reading / steady))
                wrong += abs(math.log(steady)) > math.log(1.03) and (reading > 1) != (steady > 1)
            if found:
                shown = ", ".join(f"{r:.2f}" for r in found)
                print(f"seed {seed}: read {shown}; steady {steady:.3f}", flush=True)
    if not errors:
        print("no trial reading after the change")
        return 0
    mean = sum(errors) / len(errors)
    absolute = sum(map(abs, errors)) / len(errors)
    print(
        f"\n{len(errors)} readings in {args.scenarios} scenarios from seed {args.seed}:"
        f" mean log(reading / steady) {mean:+.4f}, mean absolute {absolute:.4f};"
        f" the slower mode read ahead where the steady runs differ by over 3%: {wrong}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
