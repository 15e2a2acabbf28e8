"""The controller across workloads and loads it was not tuned on, in virtual time.

For each per-token acceptance rate and client count: the load is held at another level for a
minute (16 clients before a small load, 4 before a large one), then at c for a minute; the
last 30 s of the routed pod are compared with always speculating and never speculating over
the same 30 s (specgate_sim.virtual: the simulator's engine behind the router's own control
code). The router starts from the resource's defaults.

    .venv/bin/python lab/bench/control_grid.py [--profile NAME] [--off-step-tokens K]

Prints one table (c x acceptance) of routed / better static, and writes
lab/results/control_grid-PROFILE-kK.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specgate_router.settings import ControlSettings
from specgate_sim import profile as profiles
from specgate_sim.virtual import Change, ratio_to_better_static

LEVELS = (1, 4, 16, 64, 128)
RATES = (0.5, 0.6, 0.7, 0.8, 0.9, 0.99)
RESULTS = Path(__file__).resolve().parent.parent / "results"


def cell(name: str, k: int, rate: float, c: int, *, model_inputs: bool) -> dict[str, object]:
    changes = [Change(0, concurrency=16 if c < 16 else 4, acceptance=rate)]
    changes.append(Change(60, concurrency=c))
    ratio, routed = ratio_to_better_static(
        profiles.load(name),
        changes,
        seconds=120,
        window=(90, 120),
        off_step_tokens=k,
        params=ControlSettings(),  # the resource's defaults
        seeds=(0, 1, 2) if c <= 4 else (0,),
        model_inputs=model_inputs,
    )
    return {
        "rate": rate,
        "c": c,
        "ratio": round(ratio, 3),
        "threshold": routed.thresholds[-1][1] if routed.thresholds else 8,
        "pushes_after_change": sum(1 for at, _ in routed.thresholds if at >= 60),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="h200-3b-synthetic-deployed")
    parser.add_argument("--off-step-tokens", type=int, default=4)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--without-prediction",
        action="store_true",
        help="the pod reports no step profile or acceptance counters (an engine without the"
        " patch's prediction inputs): the law runs on rates fitted from samples and trials",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    how = "-without-prediction" if args.without_prediction else ""
    cells = []
    for rate in RATES:
        for c in LEVELS:
            cells.append(
                cell(
                    args.profile,
                    args.off_step_tokens,
                    rate,
                    c,
                    model_inputs=not args.without_prediction,
                )
            )
            done = len(cells) / (len(RATES) * len(LEVELS))
            print(f"[{done:4.0%}] acceptance {rate}, c = {c}: {cells[-1]['ratio']}", flush=True)
    header = "| per-token acceptance | " + " | ".join(f"c = {c}" for c in LEVELS) + " |"
    rows = [header, "| --- " * (len(LEVELS) + 1) + "|"]
    for rate in RATES:
        mine = [x for x in cells if x["rate"] == rate]
        rows.append(f"| {rate} | " + " | ".join(f"{x['ratio']:.3f}" for x in mine) + " |")
    worst = min(float(x["ratio"]) for x in cells)  # type: ignore[arg-type]
    md = (
        f"Routed / better static mode, last 30 s of a minute at each load, arriving from"
        f" another level; profile {args.profile}, off steps of {args.off_step_tokens} tokens"
        f"{'; the pod reports no step profile (samples and trials only)' if how else ''}."
        f" Worst cell {worst:.3f}; {time.monotonic() - started:.0f} s.\n\n" + "\n".join(rows)
    )
    print("\n" + md)
    stem = f"control_grid-{args.profile}-k{args.off_step_tokens}{how}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.md").write_text(md + "\n")
    (args.out / f"{stem}.json").write_text(json.dumps({"cells": cells}, indent=1) + "\n")
    what = f"{args.profile}, {args.off_step_tokens}-token off steps{how.replace('-', ' ')}"
    plot(cells, args.out / f"{stem}.png", what)
    return 0


def plot(cells: list[dict[str, object]], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot (pip install 'specgate[plot]')", file=sys.stderr)
        return
    grid = [[float(x["ratio"]) for x in cells if x["rate"] == r] for r in RATES]  # type: ignore[arg-type]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.9, vmax=1.05, aspect="auto")
    ax.set_xticks(range(len(LEVELS)), [str(c) for c in LEVELS])
    ax.set_yticks(range(len(RATES)), [str(r) for r in RATES])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("per-token acceptance")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.3f}", ha="center", va="center", fontsize=8)
    ax.set_title(f"routed / better static mode ({title})", fontsize=10)
    fig.colorbar(image, ax=ax, label="target >= 0.97")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
