"""The controller on random engines and workloads nobody tuned it on, in virtual time.

Each scenario draws, from its own seed, an engine the repository has no profile for (step
costs, draft chain length, running limit, prefill costs, including the draft's first
proposals that a speculating prefill adds, which the step profile does not see), a workload
(per-token acceptance, falling along the chain or not; prompt and output lengths), and what
makes the pod's reports imperfect as a GPU's are (a start-up profile off by up to 15% per mode;
the draft's agreement while off off by up to 25% from a speculating step's first position).
Then one change: the load moves to another level, or the acceptance moves at a fixed load. The
last 30 s of the minute after the change are compared with always speculating and never
speculating over the same 30 s (specgate_sim.virtual: the simulator's engine behind the
router's own control code). The router runs its defaults but maxThreshold, raised to the
engine's running limit so that the bound does not decide.

    .venv/bin/python lab/bench/control_random.py [--scenarios N] [--seed S] [--jobs J]
        [--without-prediction]
    .venv/bin/python lab/bench/control_random.py --report RESULTS.json [--compare OTHER.json]

Prints each scenario as it ends, then the distribution of routed / better static and the
worst scenarios with everything needed to rerun one (`--only SEED`); writes
lab/results/control_random-sS-nN.{md,json,png}. `--without-prediction`: the engines report no
step profile or acceptance while off, so the controller runs on samples and trials alone, as
it drives an engine without the patch's prediction inputs (files end `-without-prediction`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from specgate_router.settings import ControlSettings
from specgate_sim.profile import (
    Acceptance,
    PrefillCosts,
    Profile,
    StepCosts,
    chain_accept_length,
)
from specgate_sim.virtual import Change, ratio_to_better_static

RESULTS = Path(__file__).resolve().parent.parent / "results"
LEVELS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
TARGET = 0.97


def log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def draw(seed: int) -> dict[str, Any]:
    """One scenario, everything in it from `seed`."""
    rng = random.Random(seed)
    overhead = log_uniform(rng, 5e-4, 4e-3)
    prefill_overhead = log_uniform(rng, 1e-3, 1.5e-2)
    prefill_per_token = log_uniform(rng, 2e-6, 5e-5)
    step = StepCosts(
        overhead_s=overhead,
        weights_s=log_uniform(rng, 5e-4, 2.5e-2),
        kv_s_per_request=log_uniform(rng, 2e-5, 1.5e-3),
        compute_s_per_token=log_uniform(rng, 5e-5, 1.5e-3),
        draft_overhead_s=overhead * rng.uniform(0.1, 1.0),
        draft_s_per_request=log_uniform(rng, 1e-7, 1e-3),
        sync_s_per_request=0.0 if rng.random() < 0.5 else log_uniform(rng, 1e-6, 5e-5),
        batch_exponent=rng.uniform(0.5, 1.0),
    )
    num_steps = rng.choice((1, 2, 3, 3, 3, 4, 5, 6, 7))
    # A speculating prefill adds the draft's first proposals, about one chain of draft steps;
    # the draft's forward over the prompt (its KV) runs in both modes in the patched engine.
    prefill = PrefillCosts(
        overhead_s=prefill_overhead,
        s_per_token=prefill_per_token,
        draft_overhead_s=num_steps * step.draft_overhead_s * rng.uniform(0, 1.5),
    )
    max_running = rng.choice((64, 128, 256))
    rate = rng.uniform(0.3, 0.99)
    decay = 1.0 if rng.random() < 0.3 else rng.uniform(0.8, 1.0)
    levels = [c for c in LEVELS if c <= max_running]
    c_after = rng.choice(levels)
    kind = "load" if rng.random() < 0.7 else "acceptance"
    if kind == "load":
        c_before = rng.choice([c for c in levels if c != c_after])
        rate_after = rate
    else:
        c_before = c_after
        rate_after = rng.uniform(0.3, 0.99)
    out_lo = rng.choice((16, 32, 64, 128, 256, 512))
    # Lengths vary: requests of one length finish in lockstep, and only plain decoding (a token
    # a step) keeps them so, prefilling in waves that no real traffic gives it.
    out_hi = out_lo * rng.choice((2, 3, 4))
    prompt_lo = rng.choice((16, 64, 256, 1024))
    profile = Profile(
        name=f"random-{seed}",
        description="drawn by lab/bench/control_random.py",
        source="random",
        max_running_requests=max_running,
        max_total_tokens=2_000_000,
        context_length=8192,
        num_steps=num_steps,
        step=step,
        prefill=prefill,
        acceptance=Acceptance(per_token_rate=rate, position_decay=decay),
    )
    off_step_tokens = rng.choice((1, 1, 2, 4))
    # The requests in flight at the change finish within 20 s in either mode: the 30 s
    # measured compare the new load, not how fast each run drains the old one.
    slowest = min(
        profile.steady_throughput(c_before, on, off_step_tokens) / c_before for on in (True, False)
    )
    while out_hi > 16 and out_hi / slowest > 20:
        out_lo, out_hi = max(8, out_lo // 2), out_hi // 2
    return {
        "seed": seed,
        "kind": kind,
        "profile": profile.model_dump(mode="json", by_alias=True),
        "c_before": c_before,
        "c_after": c_after,
        "rate_before": rate,
        "rate_after": rate_after,
        "off_step_tokens": off_step_tokens,
        "output_tokens": (out_lo, out_hi),
        "prompt_tokens": (prompt_lo, prompt_lo * rng.choice((1, 2, 4))),
        "profile_error": (rng.uniform(0.85, 1.15), rng.uniform(0.85, 1.15)),
        "off_agreement_factor": rng.uniform(0.8, 1.25),
    }


def run_scenario(scenario: dict[str, Any]) -> dict[str, Any]:
    profile = Profile.model_validate(scenario["profile"])
    c_after = scenario["c_after"]
    changes = [
        Change(0, concurrency=scenario["c_before"], acceptance=scenario["rate_before"]),
        Change(60, concurrency=c_after, acceptance=scenario["rate_after"]),
    ]
    ratio, routed = ratio_to_better_static(
        profile,
        changes,
        seconds=120,
        window=(90, 120),
        seeds=(0, 1, 2) if c_after <= 4 else (0,),
        off_step_tokens=scenario["off_step_tokens"],
        params=ControlSettings(),  # the resource's defaults
        output_tokens=tuple(scenario["output_tokens"]),
        prompt_tokens=tuple(scenario["prompt_tokens"]),
        profile_error=tuple(scenario["profile_error"]),
        off_agreement_factor=scenario["off_agreement_factor"],
        model_inputs=scenario.get("model_inputs", True),
    )
    after = [t for at, t in routed.thresholds if at >= 60]
    trials = [at for at, d in routed.decisions if at >= 60 and d.trial is not None]
    decay = profile.acceptance.position_decay
    return {
        **{k: v for k, v in scenario.items() if k != "profile"},
        "num_steps": profile.num_steps,
        "max_running": profile.max_running_requests,
        "position_decay": round(decay, 3),
        "accept_length_after": round(
            chain_accept_length(scenario["rate_after"], decay, profile.num_steps), 2
        ),
        "ratio": round(ratio, 3),
        "threshold_after": routed.thresholds[-1][1] if routed.thresholds else 8,
        "pushes_after_change": len(after),
        "trial_seconds_after_change": len(trials) / 2,
        "last_reason": routed.reasons[-1][1] if routed.reasons else None,
    }


def report(results: list[dict[str, Any]], seconds: float, seed: int) -> str:
    ratios = sorted(r["ratio"] for r in results)
    met = sum(1 for x in ratios if x >= TARGET)

    def q(p: float) -> float:
        return float(ratios[min(len(ratios) - 1, int(p * len(ratios)))])

    worst = sorted(results, key=lambda r: r["ratio"])[:8]
    rows = [
        "| seed | change | c | accept length | steps | off tokens | routed / better | threshold"
        " | reason |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in worst:
        change = (
            f"load {r['c_before']} → {r['c_after']}"
            if r["kind"] == "load"
            else f"acceptance {r['rate_before']:.2f} → {r['rate_after']:.2f}"
        )
        rows.append(
            f"| {r['seed']} | {change} | {r['c_after']} | {r['accept_length_after']} |"
            f" {r['num_steps']} | {r['off_step_tokens']} | {r['ratio']:.3f} |"
            f" {r['threshold_after']} | {(r['last_reason'] or '')[:90]} |"
        )
    how = ", engines reporting no profile" if results[0].get("model_inputs") is False else ""
    return (
        f"{len(results)} random scenarios (seeds {seed}..{seed + len(results) - 1}{how}):"
        f" routed ≥ {TARGET} x the better static mode in **{met}** ({met / len(results):.0%});"
        f" median {q(0.5):.3f}, 5th percentile {q(0.05):.3f}, worst {ratios[0]:.3f};"
        f" {seconds:.0f} s.\n\nThe worst:\n\n" + "\n".join(rows)
    )


def plot(
    results: list[dict[str, Any]], path: Path, before: list[dict[str, Any]] | None = None
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot (pip install 'specgate[plot]')", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    points = None
    for kind, marker in (("load", "o"), ("acceptance", "^")):
        mine = [r for r in results if r["kind"] == kind]
        points = ax.scatter(
            [r["c_after"] for r in mine],
            [r["ratio"] for r in mine],
            c=[r["accept_length_after"] for r in mine],
            cmap="viridis",
            vmin=1,
            vmax=5,
            marker=marker,
            label=f"{kind} step",
            s=24,
        )
    if before:
        # The same scenarios under another controller, each joined to its current result.
        now = {r["seed"]: r["ratio"] for r in results}
        for r in before:
            if r["seed"] in now and abs(r["ratio"] - now[r["seed"]]) > 0.005:
                x = r["c_after"]
                ax.plot([x, x], [r["ratio"], now[r["seed"]]], color="0.75", lw=0.8, zorder=0)
        ax.scatter(
            [r["c_after"] for r in before],
            [r["ratio"] for r in before],
            marker="x",
            color="0.6",
            s=18,
            label="before (--compare)",
            zorder=0,
        )
    ax.axhline(TARGET, color="red", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests after the change")
    ax.set_ylabel("routed / better static mode")
    title = "random engines and workloads, 30 s from a minute after the change"
    if results[0].get("model_inputs") is False:
        title += "\n(engines reporting no profile: samples and trials only)"
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    if points is not None:
        fig.colorbar(points, ax=ax, label="accept length after the change")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenarios", type=int, default=120)
    parser.add_argument("--seed", type=int, default=1000, help="the first scenario's seed")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", type=int, help="run the scenario of this seed and print it")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--report", type=Path, help="a results JSON to report and plot again, running nothing"
    )
    parser.add_argument(
        "--compare", type=Path, help="a results JSON of the same seeds to draw beside (grey)"
    )
    parser.add_argument(
        "--without-prediction",
        action="store_true",
        help="engines that report no step profile: samples and trials only",
    )
    args = parser.parse_args(argv)
    inputs = {"model_inputs": False} if args.without_prediction else {}
    if args.only is not None:
        print(json.dumps(run_scenario({**draw(args.only), **inputs}), indent=1))
        return 0
    before = json.loads(args.compare.read_text())["results"] if args.compare else None
    if args.report is not None:
        saved: list[dict[str, Any]] = json.loads(args.report.read_text())["results"]
        print(report(saved, 0.0, min(r["seed"] for r in saved)))
        if before is not None:
            print("\nBefore:", report(before, 0.0, min(r["seed"] for r in before)).split("\n")[0])
        plot(saved, args.report.with_suffix(".png"), before)
        return 0
    started = time.monotonic()
    scenarios = [{**draw(args.seed + i), **inputs} for i in range(args.scenarios)]
    results: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for result in pool.map(run_scenario, scenarios):
            results.append(result)
            print(
                f"[{len(results) / len(scenarios):4.0%}] seed {result['seed']}"
                f" {result['kind']} c {result['c_before']} → {result['c_after']},"
                f" accept length {result['accept_length_after']}: {result['ratio']:.3f}"
                f" (threshold {result['threshold_after']})",
                flush=True,
            )
    md = report(results, time.monotonic() - started, args.seed)
    print("\n" + md)
    stem = f"control_random-s{args.seed}-n{args.scenarios}"
    stem += "-without-prediction" if args.without_prediction else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.md").write_text(md + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps({"results": results}, indent=1) + "\n")
    plot(results, args.out / f"{stem}.png", before)
    return 0


if __name__ == "__main__":
    sys.exit(main())
